"""The planner's memory figure against what the applied step allocates.

Per configuration (the rows of ``benchmarks/estimate_agreement.py``): plan
once, apply, then run rank 0's step of the parallel module under
``FakeTensorMode`` with torch's ``MemTracker``: the forward, the example's
loss (cross-entropy of the logits in fp32), the backward and an AdamW step,
twice (the second step holds the optimizer state from its start, as every
step after the first does). No compute runs and nothing is allocated; the
tracker counts every tensor's storage as it lives and dies. Printed per row:
the planner's figure (the one ``plan.summary()`` shows and the memory budget
bounds), the tracker's peak with its breakdown (parameters, gradients,
optimizer state, activations, temporaries), and diff = (planner - tracked) /
tracked. Each row runs in its own subprocess under a memory limit::

    python benchmarks/memory_tracker.py                    # the small rows
    python benchmarks/memory_tracker.py --rows 8b_16x8 70b_16x8 moe16b_8x8
    python benchmarks/memory_tracker.py --rows debug_2x2 --trace   # the live bytes around the peak, per op

:func:`tracked_step` is the measurement (the tests call it on the debug LLaMA).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402


@dataclass
class TrackedStep:
    """The tracker's peak of a step, bytes (on the step's device), by category."""

    peak: float
    by_category: dict[str, float] = field(default_factory=dict)
    # (op, live bytes) around the peak, with ``trace=True``
    trace: list[tuple[str, float]] = field(default_factory=list)


def _fake_state(parallel: nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer of ``parallel`` (meta DTensors after
    apply) a fake local shard on ``device``: the current fake mode's
    ``torch.empty``, so no memory is allocated."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    st = parallel.parallel_state
    for slots_of, wrap in ((st.param_slots, True), (st.buffer_slots, False)):
        for slots in slots_of.values():
            old = getattr(*slots[0])
            if isinstance(old, DTensor):
                with unset_fake_temporarily():
                    shape = old.to_local().shape
                local = torch.empty(shape, dtype=old.dtype, device=device)
                new = DTensor.from_local(
                    local, old.device_mesh, old.placements, run_check=False, shape=old.shape, stride=old.stride()
                )
            else:
                new = torch.empty(old.shape, dtype=old.dtype, device=device)
            if wrap:
                new = nn.Parameter(new, requires_grad=old.requires_grad)
            for mod, name in slots:
                (mod._parameters if wrap else mod._buffers)[name] = new


def tracked_step(
    parallel: nn.Module,
    local_input_shape: tuple[int, ...],
    vocab_size: int,
    *,
    device: str = "cpu",
    steps: int = 2,
    trace: bool = False,
    labels_like_logits: bool = False,
) -> TrackedStep:
    """Run ``steps`` training steps of rank 0's ``parallel`` module (its
    local shard of a token batch of ``local_input_shape``) under a fresh
    ``FakeTensorMode`` and ``MemTracker``: forward, cross-entropy of the
    fp32 logits (as ``examples/example_llama3.py`` trains), backward, AdamW
    step, ``zero_grad``. Returns the tracker's peak over all steps.
    ``labels_like_logits``: the labels take the local logits' batch and
    sequence dims (a plan whose logits are not split like the tokens, such
    as a sequence split over cp that the planner undoes before the output)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autoparallel.torch_compat import memory_tracker, tracker_peak

    dev = torch.device(device)
    with FakeTensorMode():
        _fake_state(parallel, dev)
        tokens = torch.randint(0, vocab_size, local_input_shape, device=dev)
        labels = torch.randint(0, vocab_size, local_input_shape, device=dev)
        params = [p for p in parallel.parameters() if p.requires_grad]
        # AdamW over the local shards: what a DTensor optimizer runs per
        # rank. On the DTensors themselves, DTensor's sharding propagation
        # runs each op on global-shape fake tensors under this same fake
        # mode, and the tracker would count those as if allocated.
        with torch.no_grad():
            shards = [p.to_local() for p in params]
        opt = torch.optim.AdamW(shards, lr=1e-4, foreach=True)
        tracker = memory_tracker()
        tracker.track_external(parallel, tokens, labels)
        live: list[tuple[str, float]] = []
        with tracker, _OpTrace(tracker, live) if trace else _nothing():
            for _ in range(steps):
                logits = parallel(tokens)
                if labels_like_logits and logits.shape[:2] != labels.shape:
                    labels = torch.randint(0, vocab_size, tuple(logits.shape[:2]), device=dev)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                loss.backward()
                for p, shard in zip(params, shards):
                    shard.grad = p.grad.to_local() if p.grad is not None else None
                opt.step()
                for p, shard in zip(params, shards):
                    p.grad = shard.grad = None
                del logits, loss
                tracker.reset_mod_stats()  # per-module stats are per call; the peak stays
        peak, cats = tracker_peak(tracker, dev)
    around: list[tuple[str, float]] = []
    if live:
        i = max(range(len(live)), key=lambda k: live[k][1])
        around = live[max(0, i - 12) : i + 4]
    return TrackedStep(float(peak), cats, around)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _OpTrace(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (op, the tracker's current total) after every op, inside the tracker."""

    def __init__(self, tracker, out):
        super().__init__()
        self.tracker, self.out = tracker, out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        snap = self.tracker.get_tracker_snapshot()
        self.out.append((str(func), float(sum(d.get("Total", 0) for d in snap.values()))))
        return res


# -- the rows -------------------------------------------------------------------------


def run_row(name: str, trace: bool = False) -> dict:
    """Plan, apply and track one row (in this process)."""

    import estimate_agreement as ea
    from autoparallel import AutoParallel
    from autoparallel.apply.local_graph import local_shape
    from autoparallel.problem.memory import breakdown
    from autoparallel.problem.step_memory import CATEGORIES

    kind, a = ea.ROWS[name]
    if kind == "zoo":
        raise SystemExit(f"{name}: the zoo models have no token loss; rows: the LLaMA-3 and MoE ones")
    model, mesh, inputs, mp, ins, outs = ea._setup(kind, a)
    vocab = model.config.vocab_size if hasattr(model, "config") else model.tok_embeddings.num_embeddings
    out: dict = {"row": name}
    t0 = time.perf_counter()
    with AutoParallel(model, mesh, inputs, mp_policy=mp) as autop:
        ea.constrain(autop, mesh, ins, outs)
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan)
        spec = parallel.parallel_state.inputs[0].spec
    out["plan_s"] = time.perf_counter() - t0
    mem = breakdown(plan)
    t0 = time.perf_counter()
    tracked = tracked_step(parallel, tuple(local_shape(spec)), vocab, trace=trace)
    out["track_s"] = time.perf_counter() - t0
    out.update(
        planner=mem.total,
        planned=mem.planned,
        # the planner's categories; the outputs' gradients are in "outputs"
        parts={k: getattr(mem, k) for k in CATEGORIES if k != "output_grads"},
        applied=mem.applied,
        tracked=tracked.peak,
        tracked_parts=tracked.by_category,
        trace=tracked.trace,
    )
    return out


def _child(name: str, max_gb: float, trace: bool) -> dict:
    from _row_child import run_row_child

    return run_row_child(__file__, name, ["--trace"] if trace else [], max_gb)


def _size(b: float) -> str:
    from autoparallel.report.units import size

    return size(b)


def print_table(rows: list[dict]) -> None:
    print(f"{'row':16s} {'planner':>10s} {'tracked':>10s} {'diff':>7s}  tracked peak by category; planner's terms")
    for r in rows:
        if "error" in r:
            print(f"{r['row']:16s} {r['error']}")
            continue
        diff = (r["planner"] - r["tracked"]) / r["tracked"] * 100
        cats = ", ".join(f"{k} {_size(v)}" for k, v in r["tracked_parts"].items() if v)
        print(f"{r['row']:16s} {_size(r['planner']):>10s} {_size(r['tracked']):>10s} {diff:+6.1f}%  {cats}")
        if r.get("parts"):
            print(f"{'':16s} planner: " + ", ".join(f"{k} {_size(v)}" for k, v in r["parts"].items() if v))
        for op, b in r.get("trace") or ():
            print(f"{'':20s}{_size(b):>10s}  {op}")


def main(argv=None) -> None:
    import estimate_agreement as ea

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="*", default=None, help="row names (benchmarks/estimate_agreement.py), or 'small'")
    p.add_argument("--trace", action="store_true", help="print the live bytes per op around the tracked peak")
    p.add_argument("--max-gb", type=float, default=16.0, help="address-space limit per row")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(run_row(a.child, a.trace)))
        return
    names = [n for x in (a.rows or ["small"]) for n in (ea.SMALL if x == "small" else (x,))]
    rows = []
    for n in names:
        t0 = time.perf_counter()
        rows.append(_child(n, a.max_gb, a.trace))
        print(f"# {n}: {time.perf_counter() - t0:.0f} s {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    print_table(rows)
    print(json.dumps(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
