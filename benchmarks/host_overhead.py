"""Host time per training step of rank 0 of the LLaMA-3 8B 16 x 8 plan, on CPU.

The plan is the one ``examples/example_llama3.py`` makes for LLaMA-3 8B on a
16 x 8 (dp x tp) mesh of 128 ranks on a fake process group (all 32 blocks,
32 query / 8 key-value heads, bf16 compute with fp32 gradient reduction),
at tiny widths (``--dim 256 --vocab 1024 --seq 64``): every kernel then
costs microseconds, so a step's wall time is the host's work: Python, the
dispatcher, DTensor, autograd, kernel launches. Rank 0 runs its local
forward + backward (the fake group's collectives return at once) for

* ``eager``: the planned graphs run as FX code, one ATen call per node;
* ``compiled``: ``apply_placement(plan, compile=True)``, the graphs
  compiled by Inductor (C++ kernels here; Triton on a GPU);
* ``hand``: the hand FSDP2 + TP + SP layout of the same model on the same
  fake group (``tests/autoparallel/_hand_plan.py``, as torchtitan writes it,
  eager DTensor modules).

Printed: the median forward + backward milliseconds of ``--steps`` steps
after ``--warmup`` per layout, as this process's CPU time (one intra-op
thread: other processes on the cores do not inflate it) and wall time, the
AdamW step apart, and the one-off compile time of the rank's graphs
(decomposition + Inductor, per graph). On CPU a step's kernels run in the
same thread, so the figure is host time plus the tiny kernels; on a GPU it
is what the GPU waits for when kernels are shorter than their launches.

The plan is made for a compute-bound device (:func:`compute_bound_device`)
so that, at tiny widths, it shards compute over both mesh dims as the 8B
plan does at its real widths.

    PYTHONPATH=$PWD python benchmarks/host_overhead.py                 # 32 layers (minutes: compile)
    PYTHONPATH=$PWD python benchmarks/host_overhead.py --layers 4      # quicker
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "examples", ROOT / "tests" / "autoparallel"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

LAYOUTS = ("eager", "compiled", "hand")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32, help="transformer blocks (8B: 32)")
    ap.add_argument("--dim", type=int, default=256, help="model width (tiny: kernels cost ~nothing)")
    ap.add_argument("--heads", type=int, default=32, help="query heads (8B: 32)")
    ap.add_argument("--kv-heads", type=int, default=8, help="key/value heads (8B: 8)")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--mesh", type=int, nargs=2, default=[16, 8], metavar=("DP", "TP"))
    ap.add_argument("--batch", type=int, default=32, help="global batch (split over dp)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--ac", default="none", choices=["selective", "full", "none"])
    ap.add_argument("--mp", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return ap.parse_args(argv)


def model_config(a):
    from gpu_rank_check import model_config as rank_check_config  # the same 8B-shaped config

    return rank_check_config(a)


def meta_model(a):
    from autoparallel.models.llama3 import Transformer, apply_ac

    with torch.device("meta"):
        model = Transformer(model_config(a))
    if a.ac != "none":
        apply_ac(model, mode=a.ac)
    return model


def example_args(a, compile: bool):
    import example_llama3

    return example_llama3.parse_args(
        ["--mesh", *map(str, a.mesh), "--seq", str(a.seq), "--batch", str(a.batch), "--ac", a.ac]
        + ["--mp", a.mp, "--layers", str(a.layers)]
        + (["--compile"] if compile else [])
    )


def compute_bound_device():
    """An H100 whose compute and memory are 1e6x slower: at tiny widths the
    plan then shards compute over every mesh dim, as the 8B plan does at its
    real widths (on the H100 preset a tiny model would rather replicate
    compute than communicate, and its attention would run on many ranks' data)."""
    from autoparallel.cost_model import DeviceSpec

    h100 = DeviceSpec.get("H100")
    return dataclasses.replace(h100, name="H100-compute-bound", peak_bf16=1e9, peak_fp32=1e9, peak_tf32=1e9, hbm_bw=1e9)


def plan_rank(a, mesh, compile: bool):
    """(module, setup seconds, compile record or None) of the example's plan."""
    import example_llama3

    t0 = time.perf_counter()
    args = example_args(a, compile)
    args.device = compute_bound_device()
    _, parallel, _, _ = example_llama3.plan_model(args, mesh, meta_model(a), model_config(a))
    setup = time.perf_counter() - t0
    compiled = parallel.parallel_state.step.compiled
    return parallel, setup, compiled


def hand_rank(a, mesh):
    from _hand_plan import hand_fsdp_tp
    from example_llama3 import mp_policy

    t0 = time.perf_counter()
    model = hand_fsdp_tp(meta_model(a), mesh, mp_policy=mp_policy(example_args(a, False)))
    return model, time.perf_counter() - t0


@dataclasses.dataclass
class Times:
    """Per timed step, milliseconds: forward + backward and AdamW, as this
    process's CPU time (the host's work; robust to other processes sharing
    the cores) and as wall time."""

    fwd_bwd_cpu: list[float] = dataclasses.field(default_factory=list)
    fwd_bwd_wall: list[float] = dataclasses.field(default_factory=list)
    optim_cpu: list[float] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        med = statistics.median
        return (
            f"forward+backward {med(self.fwd_bwd_cpu):8.1f} ms CPU ({med(self.fwd_bwd_wall):8.1f} ms wall), "
            f"AdamW {med(self.optim_cpu):6.1f} ms CPU"
        )


def measure(model, tokens, a) -> Times:
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    grad = None
    times = Times()
    for step in range(a.warmup + a.steps):
        c0, w0 = time.process_time(), time.perf_counter()
        out = model(tokens)
        if grad is None:  # the traced step's tangent: a fixed gradient of the logits
            grad = torch.full_like(out, 1.0 / out.numel())
        out.backward(grad)
        del out
        c1, w1 = time.process_time(), time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        c2 = time.process_time()
        if step >= a.warmup:
            times.fwd_bwd_cpu.append((c1 - c0) * 1e3)
            times.fwd_bwd_wall.append((w1 - w0) * 1e3)
            times.optim_cpu.append((c2 - c1) * 1e3)
    return times


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)  # the fake collectives leave garbage: keep denormals off the clock
    from torch.distributed.device_mesh import init_device_mesh

    world = math.prod(a.mesh)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    print(
        f"LLaMA-3 8B-shaped plan, {a.layers} layers at dim {a.dim} ({a.heads}/{a.kv_heads} heads, vocab {a.vocab}), "
        f"mesh dp {a.mesh[0]} x tp {a.mesh[1]} on a fake group, batch {a.batch} x seq {a.seq}, AC {a.ac}, "
        f"{a.mp}; rank 0 on CPU ({torch.get_num_threads()} thread(s), torch {torch.__version__}, commit {_commit()}); "
        f"median of {a.steps} steps after {a.warmup}"
    )
    rows = []
    try:
        mesh = init_device_mesh("cpu", tuple(a.mesh), mesh_dim_names=("dp", "tp"))
        tokens = torch.randint(0, a.vocab, (a.batch // a.mesh[0], a.seq), generator=torch.Generator().manual_seed(1))
        for layout in a.layouts:
            compiled = None
            if layout == "hand":
                model, setup = hand_rank(a, mesh)
            else:
                model, setup, compiled = plan_rank(a, mesh, compile=layout == "compiled")
            times = measure(model, tokens, a)
            rows.append((layout, statistics.median(times.fwd_bwd_cpu)))
            print(f"{layout:>9}: {times.line()} (plan/apply/compile {setup:.0f} s)", flush=True)
            if compiled is not None:
                for record in compiled.records:
                    print(f"           {record.describe()}")
            del model
    finally:
        dist.destroy_process_group()
    by = {r[0]: r[1] for r in rows}
    if "eager" in by and "compiled" in by:
        print(f"compiled / eager graphs: {by['compiled'] / by['eager']:.2f}")
    if "hand" in by and "compiled" in by:
        print(f"compiled / hand layout: {by['compiled'] / by['hand']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
