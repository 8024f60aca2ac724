"""Plan time of the test zoo (issue 10, items 6 and 7): trace to plan per model.

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

Session 10 (2-core machine shared with 3 other runs; load average 2.4-3.9
throughout: an idle machine takes about half these times). Before: T5's
blocks unlinked (its rows from the session's base commit, --time-limit 60);
the other rows run the same code before and after, so they differ by load
only. After: T5's block 1 linked to block 0 where they align
(autoparallel/capture/repeated_layers.py), --time-limit 0. ``slow``: --slow-compute
1e6 (the zoo tests' sharded_compute model; its slow HBM makes a local copy
dearer than a collective, which turns Partial pruning off: 2x the options,
lazy for LLaMA). Time in seconds, trace to plan::

                                  before      | after (T5 before: no node linked, 4 layers unlinked)
    model        mesh   cost     total  solve |  total  solve options      pairs kind   linked status
    llama        2x2    default    8.6    1.2 |    4.3    1.3   10791    325,462 dense   234/0 optimal
    gpt2         2x2    default   11.5    1.0 |    4.3    0.4    7841    204,362 dense   179/0 optimal
    bert         2x2    default    4.4    0.4 |    3.4    0.4    8242    191,456 dense   202/0 optimal
    t5           2x2    default    7.3    3.1 |    8.8    3.2   27861    774,853 dense   600/0 optimal
    vit          2x2    default    3.7    0.2 |    1.6    0.1    4196     72,880 dense   156/0 optimal
    convnet      2x2    default    1.0    0.0 |    0.8    0.0     776     15,926 dense     0/8 optimal
    llama3_debug 2x2    default    2.9    0.7 |    2.4    0.7   10606    320,506 dense   232/0 optimal
    llama        2x2    slow       6.4    1.3 |    2.7    0.6   18246  1,112,160 dense   234/0 optimal
    gpt2         2x2    slow       7.4    0.4 |    3.3    0.3   11326    462,945 dense   179/0 optimal
    bert         2x2    slow       5.0    0.3 |    2.9    0.3   11973    409,031 dense   202/0 optimal
    t5           2x2    slow       6.2    2.2 |    6.8    1.6   42266  2,044,763 dense   600/0 optimal
    vit          2x2    slow       2.1    0.1 |    3.7    0.2    6785    216,755 dense   156/0 optimal
    convnet      2x2    slow       1.0    0.1 |    1.2    0.0     967     27,070 dense     0/8 optimal
    llama3_debug 2x2    slow       5.8    1.3 |    5.8    1.5   18030  1,114,096 dense   232/0 optimal
    llama        2x2x2  default   36.1   26.1 |   26.8   20.2   53470  8,469,543 dense   234/0 optimal
    gpt2         2x2x2  default   13.7    2.3 |    5.7    1.4   38251  5,035,062 dense   179/0 optimal
    bert         2x2x2  default    9.5    1.8 |    8.2    1.7   38501  4,260,751 dense   202/0 optimal
    t5           2x2x2  default   73.7   67.6 |   47.1   37.0  137390 19,419,561 dense   600/0 optimal
    vit          2x2x2  default    2.5    0.3 |    3.6    0.5   17417  1,233,396 dense   156/0 optimal
    convnet      2x2x2  default    1.0    0.1 |    1.2    0.2    3496    361,177 dense     0/8 optimal
    llama3_debug 2x2x2  default   29.2   21.9 |   18.5   13.0   52893  8,298,565 dense   232/0 optimal
    llama        2x2x2  slow      43.5   30.2 |   40.8   35.0  122445 56,205,099 lazy    234/0 optimal
    gpt2         2x2x2  slow      19.7    8.5 |   14.9    7.5   70630 18,074,731 dense   179/0 optimal
    bert         2x2x2  slow      12.2    6.2 |   12.1    6.1   73542 14,657,010 dense   202/0 optimal
    t5           2x2x2  slow     164.8  154.2 |   85.7   70.8  271749 91,299,747 dense   600/0 optimal
    vit          2x2x2  slow       7.8    3.1 |    8.1    3.5   39270  6,863,287 dense   156/0 optimal
    convnet      2x2x2  slow       2.9    0.8 |    3.0    0.9    5127    866,252 dense     0/8 optimal
    llama3_debug 2x2x2  slow      19.0   10.0 |   21.1   10.5  121565 56,158,213 lazy    232/0 optimal

Session 11: on 2x2x2 the time was not branch and bound but the root LP
(LLaMA-3 debug: presolve leaves 132 decisions, 13.8K options, 2.0M pairs;
column generation's first restricted LP alone, 208K columns, 23K dual
simplex iterations; the LP is integral). solver.solve now sends presolved
problems with >= 1M pairs (solver.api.PRICING_MIN_PAIRS) to option pricing,
whose dual ascent meets its plan (29 sweeps) and whose forests drop 99% of
the options. Planning (optimize_placement) wall / CPU seconds, 2-core
machine shared with 3-4 other runs (load 6-7; CPU seconds are comparable,
wall is ~4x idle), before -> after, same objectives to the last digit::

    llama3_debug 2x2x2 default   84.0 / 21.1  ->  12.7 / 5.1   optimal
    t5           2x2x2 default  101.3 / 25.4  ->  36.2 / 8.8   optimal
    MoE debug 2-layer dp,ep,tp   607.9 / 131.1 -> 71.2 / 20.4  0.41% gap (time limit 10 s)
    (tests/autoparallel/models/test_moe.py::test_moe_plan_apply_3d_dp_ep_tp)

The MoE's local-polytope LP is 0.41% below its optimum (half-integral:
the dense FFN weights mix RRR with S(1)S(1)S(1)); pricing finds the optimum
(the plan above) and, without a time limit, proves it in ~290 s (its
restricted ILP: 10.7K options, HiGHS' MIP after 200 of our B&B nodes).
With the sharded_compute device (no Partial pruning: 243K options, 87M
pairs for T5) presolve is now the larger part: T5 22.6 s CPU of presolve
(dominance and degree-2 elimination), then pricing.

Before session 11 (not in this module's reach then): on 2x2x2 the time was
HiGHS (LLaMA: presolve leaves 144 decisions, 14.6K options,
2.2M pairs; the ILP has 938K variables, 14.6K binary; 20-29 s of solve).
A device slow at compute only (HBM as H100, so pruning stays on) gives
LLaMA 53K options, dense, and a longer solve (48 s at load 2.3); the
batch on both data-parallel dims (breaking the dp_shard/tp symmetry)
18 s instead of 20-26 s.

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
