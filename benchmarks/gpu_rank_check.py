"""Rank 0 of the LLaMA-3 8B 16 x 8 plan run on one GPU, beside the plan's estimates.

Made for one H100 or H200 with no network: everything runs in this process.
It plans LLaMA-3 8B for a 16 x 8 (dp x tp) mesh of 128 ranks on a fake
process group, as ``examples/example_llama3.py`` does (same constraints,
bf16 compute with fp32 gradient reduction, selective activation
checkpointing) but on a mesh of the GPU's device type, so that attention is
traced as the GPU's fused kernel. It applies the plan, puts rank 0's shards
on the GPU and runs rank 0's local forward + backward + AdamW: the fake
group's collectives return at once without moving data, so what is timed is
the rank's own work (compute and the copies its plan makes), communication
taken out. Then the same for the hand FSDP2 + TP + SP layout of the same
model on the same fake group (``tests/autoparallel/_hand_plan.py``, as
torchtitan writes it), and, with ``--ranks ... cudagraphs``, the plan again
with ``apply_placement(..., cudagraphs=True)``: the same step replayed as
captured CUDA graphs (at least two untimed steps first: the warm-up and the
capture). Its per-kind profile is skipped: the replayed kernels carry no
aten op names, so a per-kind split of them would skew the implied
efficiencies.

Printed per rank: forward + backward and optimizer milliseconds (median of
``--steps`` after ``--warmup``, CUDA events), peak memory
(``torch.cuda.max_memory_allocated``), the plan's estimates of both (compute
including recomputation; whole-step memory), the device time of one profiled
step by kind of work (matmul, attention, memory-bound) beside the plan's
per-kind estimate, and the ``DeviceSpec`` efficiencies the measurement
implies (``autoparallel.cost_model.measured``). ``--json`` writes it all as a
record that ``corrected_device_spec`` reads.

A rank the library refuses to run here (the CUDA-graphs rank on CPU) is
reported as refused, with the library's reason, and does not fail the run;
any other exception is an error (exit status 1).

    python benchmarks/gpu_rank_check.py --json rank_check.json   # one H100 or H200, all 32 layers
    python benchmarks/gpu_rank_check.py --layers 8               # a quicker run (fewer blocks)
    python benchmarks/gpu_rank_check.py --ranks autoparallel hand cudagraphs --json rank_check.json
    python benchmarks/gpu_rank_check.py --ranks compiled hand_compiled --json rank_check_compiled.json
    python benchmarks/gpu_rank_check.py --device cpu --layers 2 --dim 256 --heads 8 --kv-heads 8 \\
        --vocab 1024 --seq 64 --mesh 2 2 --batch 4                  # dry mode (seconds)

The hand rank has no estimate: the cost model prices plans, not hand
layouts. The backward starts from a fixed gradient of the logits (the traced
step's tangent), so no loss op runs. The fake collectives move no data
(what lands in their outputs does not change kernel times).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "examples", ROOT / "tests" / "autoparallel"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

# cudagraphs: the plan run as captured CUDA graphs; compiled: the plan's graphs compiled by Inductor
# (apply_placement(..., compile=True)); hand_compiled: the hand layout with each block under torch.compile,
# as torchtitan trains it
RANKS = ("autoparallel", "hand", "cudagraphs", "compiled", "hand_compiled")
CUDA_GRAPH_WARMUP = 2  # untimed steps a captured step needs: the eager warm-up, then the capture


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    ap.add_argument(
        "--layers",
        type=int,
        default=32,
        help="transformer blocks (8B: 32; planning and applying them takes about a minute of CPU, "
        "each timed step well under a second on an H100; fewer for a quicker run)",
    )
    ap.add_argument("--dim", type=int, default=4096, help="model width (8B: 4096)")
    ap.add_argument("--heads", type=int, default=32, help="query heads (8B: 32)")
    ap.add_argument("--kv-heads", type=int, default=8, help="key/value heads (8B: 8)")
    ap.add_argument("--vocab", type=int, default=128256, help="vocabulary (8B: 128256)")
    ap.add_argument("--mesh", type=int, nargs=2, default=[16, 8], metavar=("DP", "TP"), help="dp x tp mesh")
    ap.add_argument("--batch", type=int, default=32, help="global batch (split over dp)")
    ap.add_argument("--seq", type=int, default=8192, help="sequence length")
    ap.add_argument("--ac", default="selective", choices=["selective", "full", "none"])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per rank")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--preset", default=None, help="DeviceSpec preset (default: from the GPU's name; H100 on CPU)")
    ap.add_argument(
        "--ranks",
        nargs="+",
        default=["autoparallel", "hand"],
        choices=RANKS,
        help="which layouts to run (cudagraphs: the plan with apply_placement(..., cudagraphs=True), CUDA only; "
        "compiled: the plan with compile=True; hand_compiled: the hand layout, each block under torch.compile)",
    )
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled step (no per-kind times)")
    ap.add_argument("--json", default=None, help="write the record (measurements and estimates) here")
    a = ap.parse_args(argv)
    if a.device is None:
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible (use --device cpu for the dry mode)")
    dp, tp = a.mesh
    problems = [
        f"{name} {value} is not divisible by {by_name} {by}"
        for name, value, by_name, by in (
            ("--batch", a.batch, "dp", dp),
            ("--heads", a.heads, "tp", tp),
            ("--kv-heads", a.kv_heads, "tp", tp),
            ("--dim", a.dim, "--heads", a.heads),
            ("--seq", a.seq, "tp", tp),
        )
        if value % by
    ]
    if problems:
        ap.error("; ".join(problems) + " (the hand layout shards them evenly)")
    if a.preset is None:
        name = torch.cuda.get_device_name().upper() if a.device == "cuda" else ""
        a.preset = next((p for p in ("H200", "H100", "B200", "A100") if p in name), "H100")
    return a


def model_config(a):
    from autoparallel.models.llama3 import LLAMA3_CONFIGS

    return dataclasses.replace(
        LLAMA3_CONFIGS["8B"],
        n_layers=a.layers,
        dim=a.dim,
        n_heads=a.heads,
        n_kv_heads=a.kv_heads,
        vocab_size=a.vocab,
        max_seq_len=max(a.seq, 8),
    )


def example_args(a):
    """The example's options for this run (its plan_model reads them)."""
    import example_llama3

    return example_llama3.parse_args(
        ["--mesh", *map(str, a.mesh), "--seq", str(a.seq), "--batch", str(a.batch), "--ac", a.ac]
        + ["--device", a.preset, "--mp", "bf16", "--layers", str(a.layers)]
    )


def meta_model(a, config):
    from autoparallel.models.llama3 import Transformer, apply_ac

    with torch.device("meta"):
        model = Transformer(config)
    if a.ac != "none":
        apply_ac(model, mode=a.ac)
    return model


@dataclasses.dataclass
class RankResult:
    """One layout's rank 0: measurements (ms, bytes) and, for a plan, its estimates."""

    fwd_bwd_ms: list[float]
    optimizer_ms: list[float]
    peak_bytes: int | None
    measured_by_kind_ms: dict[str, float] | None
    setup_s: float
    estimate: dict | None = None  # compute_ms, step_ms, solver_compute_ms, solver_comm_ms, peak_bytes
    estimated_by_kind_ms: dict[str, float] | None = None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["fwd_bwd_median_ms"] = statistics.median(self.fwd_bwd_ms)
        d["optimizer_median_ms"] = statistics.median(self.optimizer_ms)
        return d


def plan_rank(a, mesh, device, cudagraphs: bool = False, compile: bool = False):
    """The example's plan of the model, applied; rank 0's module on ``device``."""
    import example_llama3

    from autoparallel.cost_model.measured import estimated_by_kind
    from autoparallel.problem import memory
    from autoparallel.report.numbers import step_estimate

    config = model_config(a)
    args = example_args(a)
    args.cudagraphs = cudagraphs
    args.compile = compile
    plan, parallel, _, _ = example_llama3.plan_model(args, mesh, meta_model(a, config), config)
    e = step_estimate(plan)
    ms = lambda s: None if s is None else s * 1e3  # noqa: E731
    estimate = {
        "compute_ms": ms(e["compute"]),
        "step_ms": ms(e["step"]),
        "solver_compute_ms": ms(e["solver_compute"]),
        "solver_comm_ms": ms(e["solver_comm"]),
        "peak_bytes": memory.breakdown(plan).total,
    }
    by_kind = {k: v * 1e3 for k, v in estimated_by_kind(plan).items()}
    parallel.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        parallel.init_weights()
    return parallel, estimate, by_kind


def hand_rank(a, mesh, device, compile: bool = False):
    """The hand FSDP2 + TP + SP layout of the same model, rank 0's shards on
    ``device``; ``compile``: each transformer block under ``torch.compile``."""
    from _hand_plan import hand_fsdp_tp
    from example_llama3 import mp_policy

    model = hand_fsdp_tp(meta_model(a, model_config(a)), mesh, mp_policy=mp_policy(example_args(a)))
    if compile:
        for block in model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers:
            block.compile()
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    return model


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(
    model, tokens, device, a, *, warmup: int | None = None, profile: bool = True
) -> tuple[list[float], list[float], int | None, dict | None]:
    """Forward + backward and AdamW times of ``--steps`` steps after
    ``warmup`` (default ``--warmup``), the peak memory of all of them, and
    (``profile``, unless ``--no-profile``) one profiled step's device time by
    kind of work."""
    warmup = a.warmup if warmup is None else warmup
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    grad = None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    fwd_bwd, optim = [], []
    for step in range(warmup + a.steps):
        if cuda:
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record()
        else:
            t0 = time.perf_counter()
        out = model(tokens)
        if grad is None:  # the traced step's tangent: a fixed gradient of the logits
            grad = torch.full_like(out, 1.0 / out.numel())
        out.backward(grad)
        del out
        if cuda:
            marks[1].record()
        else:
            t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            marks[2].record()
            marks[2].synchronize()
            times = (marks[0].elapsed_time(marks[1]), marks[1].elapsed_time(marks[2]))
        else:
            times = ((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)
        if step >= warmup:
            fwd_bwd.append(times[0])
            optim.append(times[1])
    peak = torch.cuda.max_memory_allocated() if cuda else None
    by_kind = profile_by_kind(model, tokens, grad, device) if profile and not a.no_profile else None
    return fwd_bwd, optim, peak, by_kind


def profile_by_kind(model, tokens, grad, device) -> dict[str, float]:
    """Milliseconds of one forward + backward by kind of work: the profiler's
    self device time (self CPU time on CPU) of each aten op, summed by
    :func:`~autoparallel.cost_model.measured.op_kind`."""
    from torch.profiler import ProfilerActivity, profile

    from autoparallel.cost_model.measured import KIND_EFFICIENCY, op_kind

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        model(tokens).backward(grad)
        _sync(device)
    model.zero_grad(set_to_none=True)
    out = dict.fromkeys(KIND_EFFICIENCY, 0.0)
    for e in prof.key_averages():
        kind = op_kind(e.key) if e.key.startswith("aten::") else None
        if kind is None:
            continue
        if device.type == "cuda":
            us = getattr(e, "self_device_time_total", None)
            if us is None:  # older spelling
                us = e.self_cuda_time_total
        else:
            us = e.self_cpu_time_total
        out[kind] += us / 1e3
    return out


def run_rank(name, a, mesh, device) -> RankResult:
    t0 = time.perf_counter()
    estimate = by_kind_est = None
    if name in ("autoparallel", "cudagraphs", "compiled"):
        model, estimate, by_kind_est = plan_rank(
            a, mesh, device, cudagraphs=name == "cudagraphs", compile=name == "compiled"
        )
    else:
        model = hand_rank(a, mesh, device, compile=name == "hand_compiled")
    setup = time.perf_counter() - t0
    dp = a.mesh[0]
    tokens = torch.randint(0, a.vocab, (a.batch // dp, a.seq), generator=torch.Generator().manual_seed(1))
    if name == "cudagraphs":
        warmup, profile = max(a.warmup, CUDA_GRAPH_WARMUP), False
    elif name in ("compiled", "hand_compiled"):
        # the first step compiles; generated kernels carry no aten op names for the per-kind profile
        warmup, profile = max(a.warmup, 1), False
    else:
        warmup, profile = a.warmup, True
    fwd_bwd, optim, peak, by_kind = measure(model, tokens.to(device), device, a, warmup=warmup, profile=profile)
    if hasattr(model, "release_cuda_graphs"):
        model.release_cuda_graphs()  # before the process group goes
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return RankResult(fwd_bwd, optim, peak, by_kind, setup, estimate, by_kind_est)


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def report_lines(record: dict) -> list[str]:
    """The printed table of a record (also what --json writes)."""
    out = [
        f"{'rank 0 of':14s} {'fwd+bwd ms':>11s} {'est. ms':>8s} {'AdamW ms':>9s} "
        f"{'peak GB':>8s} {'est. GB':>8s} {'setup s':>8s}"
    ]
    for name, r in record["ranks"].items():
        est = r["estimate"] or {}
        out.append(
            f"{name:14s} {r['fwd_bwd_median_ms']:11.1f} {_ms(est.get('compute_ms')):>8s} "
            f"{r['optimizer_median_ms']:9.1f} {_gb(r['peak_bytes']):>8s} {_gb(est.get('peak_bytes')):>8s} "
            f"{r['setup_s']:8.1f}"
        )
    for name, r in record["ranks"].items():
        m, e = r["measured_by_kind_ms"], r["estimated_by_kind_ms"]
        if m is None:
            continue
        out.append(f"{name} by kind of work (one profiled forward + backward; estimate beside it):")
        for kind, ms in m.items():
            out.append(
                f"  {kind:10s} measured {ms:9.1f} ms   estimated {_ms(None if e is None else e.get(kind)):>9s} ms"
            )
    if record.get("implied"):
        effs = record["efficiencies"]
        note = " (CPU dry mode: meaningless against a GPU preset)" if record["device"] == "cpu" else ""
        out.append(f"DeviceSpec {record['preset']} efficiencies: preset -> implied by this measurement{note}")
        for field, value in record["implied"].items():
            out.append(f"  {field:22s} {effs[field]:.2f} -> {value:.3f}")
        out.append(
            f"  dataclasses.replace(DeviceSpec.get({record['preset']!r}), "
            + ", ".join(f"{k}={v:.3f}" for k, v in record["implied"].items())
            + ")"
        )
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from torch.distributed.device_mesh import init_device_mesh

    from autoparallel import CudaGraphError
    from autoparallel.cost_model import DeviceSpec
    from autoparallel.cost_model.measured import implied_efficiencies

    spec = DeviceSpec.get(a.preset)
    world = math.prod(a.mesh)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "preset": spec.name,
        "efficiencies": {
            "compute_efficiency": spec.compute_efficiency,
            "attention_efficiency": spec.attention_efficiency,
            "memory_efficiency": spec.memory_efficiency,
        },
        "config": {
            k: getattr(a, k) for k in ("layers", "dim", "heads", "kv_heads", "vocab", "mesh", "batch", "seq", "ac")
        },
        "ranks": {},
        "errors": {},
        "refused": {},  # rank -> why the library refused to run it here (not an error)
    }
    print(
        f"LLaMA-3 8B shapes, {a.layers} layers (dim {a.dim}, {a.heads}/{a.kv_heads} heads, vocab {a.vocab}), "
        f"mesh dp {a.mesh[0]} x tp {a.mesh[1]} on a fake group, batch {a.batch} x seq {a.seq}, AC {a.ac}, "
        f"bf16 compute; rank 0 on {record['device']} (torch {torch.__version__}), preset {spec.name}; "
        f"{a.steps} timed steps after {a.warmup}"
    )
    try:
        mesh = init_device_mesh(device.type, tuple(a.mesh), mesh_dim_names=("dp", "tp"))
        for name in a.ranks:
            try:
                record["ranks"][name] = run_rank(name, a, mesh, device).to_json()
            except Exception as e:  # one layout failing must not lose the other's figures
                if isinstance(e, CudaGraphError) and name == "cudagraphs" and device.type != "cuda":
                    record["refused"][name] = str(e)  # CUDA graphs need a GPU: the library says so
                    continue
                traceback.print_exc()
                record["errors"][name] = f"{type(e).__name__}: {e}"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    record["implied"] = implied_efficiencies([record])
    print()
    for line in report_lines(record):
        print(line)
    for name, why in record["refused"].items():
        print(f"{name}: refused on {device.type} ({why})")
    for name, err in record["errors"].items():
        print(f"{name}: FAILED ({err})")
    if a.json:
        Path(a.json).write_text(json.dumps(record, indent=1))
        print(f"record written to {a.json}")
    return 1 if record["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
