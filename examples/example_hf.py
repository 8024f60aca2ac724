"""Plan a Hugging Face model from its config (no weights are downloaded).

    python examples/example_hf.py            # GPT-2 (tied head) on a fake 2x2 mesh
    python examples/example_hf.py --model bert
    python examples/example_hf.py --model mixtral   # MoE: prints what the experts got
    python examples/example_hf.py --model mixtral-8x7b --seq 4096 --mesh 4 8

Builds the model on the meta device from a small config, plans it for a
("dp", "tp") mesh on a fake process group with the batch split over dp, and
prints the plan's summary.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoparallel import AutoParallel
from autoparallel.cli import HelpFormatter, setup_logging, user_errors


def build(name: str, layers: int | None = None):
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        config.use_cache = False
        return transformers.GPT2LMHeadModel(config), config.vocab_size
    if name == "bert":
        config = transformers.BertConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=128
        )
        return transformers.BertForMaskedLM(config), config.vocab_size
    if name == "llama":
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            use_cache=False,
        )
        return transformers.LlamaForCausalLM(config), config.vocab_size
    if name == "mixtral":
        # Any experts_implementation plans: the routed experts are traced as
        # autoparallel's moe_experts op, which can be expert parallel.
        config = transformers.MixtralConfig(
            hidden_size=64,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            vocab_size=128,
            use_cache=False,
        )
        return transformers.MixtralForCausalLM(config), config.vocab_size
    if name == "mixtral-8x7b":
        # Mixtral-8x7B's shapes (2 of its 32 layers unless --layers): at these
        # sizes the step is compute-bound and the expert weights dwarf a rank's
        # tokens, the regime where expert parallelism pays.
        config = transformers.MixtralConfig(num_hidden_layers=layers or 2, use_cache=False)
        return transformers.MixtralForCausalLM(config), config.vocab_size
    raise SystemExit(f"unknown model {name!r}: choose gpt2, bert, llama, mixtral or mixtral-8x7b")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="example_hf.py",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--model", default="gpt2", choices=["gpt2", "bert", "llama", "mixtral", "mixtral-8x7b"])
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=16, help="sequence length")
    ap.add_argument(
        "--layers", type=int, default=None, help="mixtral-8x7b: decoder layers (default 2; the real model has 32)"
    )
    ap.add_argument("--mesh", type=int, nargs=2, default=(2, 2), metavar=("DP", "TP"), help="mesh shape")
    ap.add_argument("-v", "--verbose", action="store_true", help="log the planner's detail; tracebacks of errors")
    args = ap.parse_args(argv)
    setup_logging(verbose=args.verbose)
    with user_errors("example_hf.py", verbose=args.verbose):
        plan_hf(args)


def plan_hf(args: argparse.Namespace) -> None:
    dp, tp = args.mesh
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp * tp)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model, vocab = build(args.model, args.layers)
    input_ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")  # global batch
    try:
        # batch over dp, checked against the mesh before the trace
        with AutoParallel(model, mesh, {"input_ids": input_ids}, input_constraints=[(Shard(0), Replicate())]) as autop:
            plan = autop.optimize_placement()
    finally:
        dist.destroy_process_group()
    print(plan.summary())
    # What the routed experts got, one line per distinct choice. The op's
    # inputs: tokens, expert ids per token, routing weights, w1, w3, w2, the
    # expert ids a rank holds; S(0) weights with a P output = expert parallel.
    chosen: dict[str, list[str]] = {}
    for n in plan.nodes.values():
        if n.op == "autoparallel.moe_experts.default":
            what = f"tokens {n.input_placements[0]}, expert weights {n.input_placements[3]} -> output {n.output_placements}"
            chosen.setdefault(what, []).append(n.module_path)
    for what, paths in chosen.items():
        print(f"experts ({len(paths)}: {paths[0]}{', ...' if len(paths) > 1 else ''}): {what}")


if __name__ == "__main__":
    main()
