"""Plan time of the test zoo: trace to plan per model.

Plans one training step of each tiny model (random init, meta device) on a
fake 2 x 2 ("dp", "tp") mesh (or --mesh) with every tensor input's batch on dp, and
prints per model: tracing, options, problem build, presolve, ILP build and
solve times, ILP size, and the solver's status, objective, bound and proven
gap. Target: every model at most 20 s trace to plan, with the gap reported.
Also the 1-layer debug LLaMA on 4 x 2 (the case that took 50 s in HiGHS).
Asserts nothing; a model that fails prints its error and the rest go on::

    python benchmarks/plan_zoo.py                 # all
    python benchmarks/plan_zoo.py t5 llama1_4x2   # some
    python benchmarks/plan_zoo.py --time-limit 0  # no time limit (0 = None)
    python benchmarks/plan_zoo.py --slow-compute  # a device where compute dominates
    python benchmarks/plan_zoo.py --mesh 2x2x2    # every model on one mesh

Current figures, with the date and commit they were measured at, are in
docs/benchmarks.md; earlier ones are in git history.

Columns: seconds per stage (trace, options, problem build, coarse seeds and
option pricing when lazy, solve), the problem as built (decisions, options,
option pairs, ``dense`` or ``lazy``), repeated-layer linking (nodes linked
to a twin / layers left unlinked), and the solver's status and proven gap.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.placement_types import Replicate, Shard  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from autoparallel import AutoParallel  # noqa: E402
from autoparallel.api import DEFAULT_TIME_LIMIT  # noqa: E402

B, S, VOCAB = 8, 32, 128


def _tokens(*names):
    def make():
        ids = {n: torch.randint(0, VOCAB, (B, S), device="meta") for n in names}
        return ids if len(names) > 1 else (ids[names[0]],)

    return make


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return LlamaForCausalLM(cfg), _tokens("input_ids"), (2, 2)


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=S, use_cache=False)
    return GPT2LMHeadModel(cfg), _tokens("input_ids"), (2, 2)


def hf_bert():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=S,
    )
    return BertForMaskedLM(cfg), _tokens("input_ids"), (2, 2)


def hf_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        use_cache=False,
    )
    return T5ForConditionalGeneration(cfg), _tokens("input_ids", "decoder_input_ids"), (2, 2)


def hf_vit():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=10,
    )
    return ViTForImageClassification(cfg), lambda: (torch.randn(B, 3, 32, 32, device="meta"),), (2, 2)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.body(x))


def convnet():
    return ConvNet(), lambda: (torch.randn(B, 3, 16, 16, device="meta"),), (2, 2)


class _DebugLlama(nn.Module):
    def __init__(self):
        super().__init__()
        from autoparallel.models.llama3 import LLAMA3_CONFIGS, Transformer

        self.model = Transformer(LLAMA3_CONFIGS["debug"])

    def forward(self, tokens):
        return self.model(tokens).float().pow(2).mean()


def llama3_debug():
    from autoparallel.models.llama3 import LLAMA3_CONFIGS

    vocab = LLAMA3_CONFIGS["debug"].vocab_size
    return _DebugLlama(), lambda: (torch.randint(0, vocab, (8, 16), device="meta"),), (2, 2)


def llama1_4x2():
    from autoparallel.models.llama3 import LLAMA3_CONFIGS, Transformer

    cfg = dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=1, max_seq_len=64)
    return Transformer(cfg), lambda: (torch.randint(0, cfg.vocab_size, (8, 64), device="meta"),), (4, 2)


MODELS = {
    "llama": hf_llama,
    "gpt2": hf_gpt2,
    "bert": hf_bert,
    "t5": hf_t5,
    "vit": hf_vit,
    "convnet": convnet,
    "llama3_debug": llama3_debug,
    "llama1_4x2": llama1_4x2,
}
MESH_DIM_NAMES = {2: ("dp", "tp"), 3: ("dp_replicate", "dp_shard", "tp"), 4: ("dp_replicate", "dp_shard", "cp", "tp")}


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2x2x2"`` -> ``(2, 2, 2)``."""
    shape = tuple(int(x) for x in text.lower().split("x"))
    if len(shape) not in MESH_DIM_NAMES or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"mesh {text!r}: 2 to 4 sizes joined by 'x', e.g. 2x2x2")
    return shape


def slow_compute_device(factor: float = 1000.0):
    """H100 with compute and memory bandwidth ``factor`` times slower: plans
    that shard compute (the zoo tests' second cost model)."""
    from autoparallel.cost_model import DeviceSpec

    h100 = DeviceSpec.get("H100")
    return dataclasses.replace(
        h100,
        peak_bf16=h100.peak_bf16 / factor,
        peak_fp32=h100.peak_fp32 / factor,
        peak_tf32=h100.peak_tf32 / factor,
        peak_fp8=None if h100.peak_fp8 is None else h100.peak_fp8 / factor,
        hbm_bw=h100.hbm_bw / factor,
    )


def plan_one(
    name: str, time_limit: float | None, slow_compute: float | None = None, mesh_shape: tuple[int, ...] | None = None
) -> dict:
    with torch.device("meta"):
        model, inputs, default_shape = MODELS[name]()
    mesh_shape = mesh_shape or default_shape
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=int(torch.tensor(mesh_shape).prod()))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=MESH_DIM_NAMES[len(mesh_shape)])
    t0 = time.perf_counter()
    device = slow_compute_device(slow_compute) if slow_compute else "H100"
    with AutoParallel(model, mesh, inputs, time_limit=time_limit, device=device) as autop:
        # the zoo tests' inputs: batch over the first mesh dim
        batch_on_dp = (Shard(0),) + (Replicate(),) * (len(mesh_shape) - 1)
        autop.add_input_constraints([batch_on_dp] * len(autop.traced.input_nodes))
        plan = autop.optimize_placement()
        built, repeats = autop.built, autop.repeats
    total = time.perf_counter() - t0
    size = built.priced_size or built.size  # the lazy problem's size when priced
    # nodes linked to a twin, layers left wholly unlinked
    layers = (0, 0) if repeats is None else (len(repeats.reference), len(repeats.mismatched))
    return {
        "total": total,
        "timings": dict(autop.timings),
        "plan": plan,
        "mesh": mesh_shape,
        "size": size,
        "lazy": built.priced_size is not None or built.lazy,
        "layers": layers,
    }


HEADER = (
    f"{'model':12s} {'mesh':6s} {'total':>6s} {'trace':>6s} {'opts':>6s} {'build':>6s} {'seed':>6s} "
    f"{'solve':>6s} {'decis':>6s} {'options':>8s} {'pairs':>10s} {'kind':5s} {'linked':>7s} "
    f"{'status':9s} {'gap':>7s}"
)


def _row(name: str, r: dict) -> str:
    t, s, size = r["timings"], r["plan"].solution, r["size"]
    gap = "n/a" if s.gap is None else f"{100 * s.gap:.3g}%"
    mesh = "x".join(map(str, r["mesh"]))
    return (
        f"{name:12s} {mesh:6s} {r['total']:6.1f} {t.get('tracing', 0):6.1f} {t.get('options', 0):6.1f} "
        f"{t.get('problem_build', 0) + t.get('problem_rebuild', 0):6.1f} {t.get('coarse_seed', 0):6.1f} "
        f"{t.get('solve', 0):6.1f} {size.decisions:6d} {size.options:8d} {size.pairs:10,d} "
        f"{'lazy' if r['lazy'] else 'dense':5s} {'%d/%d' % r['layers']:>7s} {s.status:9s} {gap:>7s}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", default=[], metavar="MODEL", help=f"subset of: {', '.join(MODELS)}")
    p.add_argument(
        "--time-limit", type=float, default=DEFAULT_TIME_LIMIT, help="solver time limit in seconds (0: none)"
    )
    p.add_argument("--verbose", action="store_true")
    p.add_argument(
        "--slow-compute",
        type=float,
        nargs="?",
        const=1000.0,
        default=None,
        metavar="FACTOR",
        help="a device FACTOR (default 1000) times slower at compute, so plans shard compute",
    )
    p.add_argument(
        "--mesh",
        type=parse_mesh,
        default=None,
        metavar="AxB[xC]",
        help="mesh shape for every model (default: each model's own, mostly 2x2)",
    )
    p.add_argument("--max-gib", type=float, default=5.0, help="address-space limit per model process (0: none)")
    p.add_argument("--one", metavar="MODEL", help=argparse.SUPPRESS)  # the per-model child
    a = p.parse_args(argv)
    unknown = [m for m in [*a.models, *([a.one] if a.one else [])] if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING)
    time_limit = a.time_limit or None
    if a.one:
        try:
            if a.max_gib:
                import resource

                limit = int(a.max_gib * 2**30)
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            r = plan_one(a.one, time_limit, a.slow_compute, a.mesh)
        except Exception as exc:  # noqa: BLE001 -- report and go on with the next model
            where = traceback.extract_tb(exc.__traceback__)[-1]
            print(
                f"{a.one:12s} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:120]} "
                f"({os.path.basename(where.filename)}:{where.lineno})"
            )
            return 1
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        print(_row(a.one, r), flush=True)
        return 0
    print(
        f"time (s); solver time limit {time_limit}"
        f"{f'; device {a.slow_compute:g}x slower at compute' if a.slow_compute else ''}; "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(HEADER)
    for name in a.models or MODELS:
        # One process per model: timings as a user's first plan sees them
        # (no warm caches), and one model's failure cannot affect the next.
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--one",
            name,
            "--time-limit",
            str(a.time_limit),
            "--max-gib",
            str(a.max_gib),
        ]
        cmd += ["--mesh", "x".join(map(str, a.mesh))] if a.mesh else []
        cmd += ["--verbose"] if a.verbose else []
        cmd += ["--slow-compute", str(a.slow_compute)] if a.slow_compute else []
        out = subprocess.run(cmd, capture_output=True, text=True)
        rows = [line for line in out.stdout.splitlines() if line.startswith(f"{name:12s} ")]
        print(rows[-1] if rows else f"{name:12s} CRASHED rc {out.returncode}: {out.stderr[-300:]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
