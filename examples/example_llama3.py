"""Plan LLaMA-3 training for a GPU cluster, on any machine.

By default this plans LLaMA-3 8B (32 layers, sequence 8192, global batch 32)
with selective activation checkpointing for 128 GPUs arranged as a 16 x 8
(dp x tp) mesh. No GPU is needed: the process group is a fake one and the
model lives on the meta device, so only shapes flow through the planner.

It prints the time of each planning stage, the placement chosen for each
kind of weight and activation, the estimated compute and communication per
step and the per-rank parameter memory, and writes the solver's debug dumps
(problem.json, solution.json, plan.json) to a folder it names.

    python examples/example_llama3.py
    python examples/example_llama3.py --mesh 8 8 --layers 4 --seq 2048 --batch 16
    python examples/example_llama3.py --model 70B --mesh 32 8
    python examples/example_llama3.py --model debug --mesh 2 4 --seq 64 --batch 8
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoparallel import AutoParallel
from autoparallel.models.llama3 import LLAMA3_CONFIGS, Transformer, apply_ac, count_params


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="8B", choices=sorted(LLAMA3_CONFIGS), help="model config")
    ap.add_argument("--mesh", type=int, nargs="+", default=[16, 8], help="mesh shape: dp [tp]")
    ap.add_argument("--layers", type=int, default=None, help="override the config's layer count")
    ap.add_argument("--seq", type=int, default=8192, help="sequence length")
    ap.add_argument("--batch", type=int, default=32, help="global batch size")
    ap.add_argument("--ac", default="selective", choices=["selective", "full", "none"],
                    help="activation checkpointing of each transformer block")
    ap.add_argument("--device", default="H100", help="cost-model preset (H100, A100, H200, B200)")
    ap.add_argument("--memory-high", type=float, default=None,
                    help="parameter memory budget as a fraction of the replicated size "
                         "(default: fully sharded)")
    ap.add_argument("--dump-dir", default="autoparallel_dumps", help="where the solver dumps go")
    ap.add_argument("--all-kinds", action="store_true",
                    help="list the placements of every kind of op, not just weights and matmuls")
    ap.add_argument("-v", "--verbose", action="store_true", help="log every stage")
    return ap.parse_args(argv)


def build_model(args: argparse.Namespace) -> tuple[Transformer, object]:
    config = LLAMA3_CONFIGS[args.model]
    config = dataclasses.replace(
        config,
        n_layers=args.layers or config.n_layers,
        max_seq_len=max(args.seq, config.max_seq_len),
    )
    with torch.device("meta"):
        model = Transformer(config)
    if args.ac != "none":
        apply_ac(model, mode=args.ac)
    return model, config


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    world = math.prod(args.mesh)
    names = ("dp", "tp", "cp", "ep")[: len(args.mesh)]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", tuple(args.mesh), mesh_dim_names=names)
        t0 = time.perf_counter()
        model, config = build_model(args)
        print(f"LLaMA-3 {args.model}: {config.n_layers} layers, dim {config.dim}, "
              f"{count_params(model) / 1e9:.2f}B parameters, AC {args.ac}")
        print(f"planning for {world} ranks, mesh {dict(zip(names, args.mesh))}, "
              f"batch {args.batch} x seq {args.seq}, device model {args.device}")

        def inputs():
            return torch.randint(0, config.vocab_size, (args.batch, args.seq), device="meta")

        # Tokens and logits split over dp, replicated over the other mesh dims.
        data = (Shard(0),) + (Replicate(),) * (len(args.mesh) - 1)
        os.makedirs(args.dump_dir, exist_ok=True)
        os.environ["AUTOPARALLEL_DUMP_DIR"] = args.dump_dir
        with AutoParallel(model, mesh, inputs, device=args.device) as autop:
            autop.add_input_constraints([data])
            autop.add_output_constraints([data])
            autop.add_parameter_memory_constraint(high=args.memory_high)
            plan = autop.optimize_placement()
        total = time.perf_counter() - t0
    finally:
        dist.destroy_process_group()
    print_report(plan, total, args.dump_dir, args.all_kinds)


# The ops whose placements tell the parallelism story (what runs sharded
# how); --all-kinds lists the element-wise and layout ops too.
STORY_OPS = (
    "aten.mm.default",
    "aten.bmm.default",
    "aten.addmm.default",
    "aten.embedding.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
)


def print_report(plan, total: float, dump_dir: str, all_kinds: bool = False) -> None:
    t = plan.timings
    print("\n== planning time ==")
    for stage in ("tracing", "options", "repeated_layers", "problem_build"):
        print(f"  {stage:16s} {t.get(stage, 0.0):7.2f} s")
    for phase in ("presolve", "build", "solve"):
        print(f"  solver.{phase:9s} {t.get('solver.' + phase, 0.0):7.2f} s")
    print(f"  {'total':16s} {total:7.2f} s   (peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB)")

    s = plan.solution
    pre = s.presolve
    print("\n== solver ==")
    print(f"  {s.status} ({s.backend}, gap {s.gap}), {s.num_variables} variables, "
          f"{s.num_constraints} constraints")
    if pre is not None:
        print(f"  presolve: {pre.decisions_before} -> {pre.decisions_after} decisions, "
              f"{pre.options_before} -> {pre.options_after} options")

    print("\n== placements by kind (mesh dims in order " + str(plan.mesh_dim_names) + ") ==")
    for kind in plan.placements_by_kind():
        if all_kinds or kind.role == "parameter" or kind.op in STORY_OPS:
            print("  " + str(kind))

    print("\n== estimated per step and rank ==")
    print(f"  compute        {plan.compute_cost * 1e3:9.2f} ms")
    print(f"  communication  {plan.comm_cost * 1e3:9.2f} ms (after the overlap discount)")
    print(f"  parameters     {plan.parameter_bytes_per_rank / 2**30:9.3f} GiB of "
          f"{plan.parameter_bytes_total / 2**30:.3f} GiB")
    print(f"\nsolver debug dumps: {os.path.abspath(dump_dir)}/"
          "{problem,solution,plan}.json  (re-solve: python -m solver "
          f"{os.path.join(dump_dir, 'problem.json')})")


if __name__ == "__main__":
    sys.exit(main())
