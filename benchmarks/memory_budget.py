"""Figures for the whole-step memory budget.

1. LLaMA-3 8B (32 layers, selective AC, bf16 compute / fp32 reduction,
   batch 32 x 8192) on a 16 x 8 mesh of H100s, planned with the default
   budget (HBM less 10%) and without any: are the plans the same, what does
   the budget cost in planning time (problem build + solver), and the
   estimate against the budget.
2. Tiny LLaMA-3 on a 2 x 2 mesh run on 4 simulated ranks (LocalTensorMode),
   without and with selective AC, under the default budget, with every forward
   matmul pinned data parallel, and under a 2 MB budget that makes the
   solver shard the batch: estimated vs measured bytes per rank
   (see tests/autoparallel/problem/test_memory_budget.py for how it is measured).

3. The 8B plan applied: the saved activations the partitioned forward
   hands the backward, against the estimate.

    PYTHONPATH=. python benchmarks/memory_budget.py [--skip-8b] [--skip-8b-apply] [--skip-tiny]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [
    ROOT,
    os.path.join(ROOT, "examples"),
    os.path.join(ROOT, "tests", "autoparallel"),
    os.path.join(ROOT, "tests", "autoparallel", "problem"),
]

from autoparallel import AutoParallel  # noqa: E402
from autoparallel.problem import memory  # noqa: E402

STAGES = ("problem_build", "solver.presolve", "solver.build", "solver.solve")


def _plan_8b(budget: bool):
    import example_llama3 as ex

    args = ex.parse_args(["--no-apply"])
    model, config = ex.build_model(args)
    mesh = init_device_mesh("cpu", (16, 8), mesh_dim_names=("dp", "tp"))

    def inputs():
        return torch.randint(0, config.vocab_size, (args.batch, args.seq), device="meta")

    with AutoParallel(model, mesh, inputs, device="H100", mp_policy=ex.mp_policy(args), memory_budget=budget) as autop:
        autop.add_input_constraints([ex.data_placements(mesh)])
        autop.add_output_constraints([ex.data_placements(mesh)])
        autop.add_parameter_memory_constraint()
        t0 = time.perf_counter()
        plan = autop.optimize_placement()
        plan_seconds = time.perf_counter() - t0
    return plan, plan_seconds


def bench_8b() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=128)
    try:
        runs = {}
        for budget in (False, True, False, True):  # twice each: load varies
            plan, secs = _plan_8b(budget)
            runs.setdefault(budget, []).append((plan, secs))
    finally:
        dist.destroy_process_group()
    (off, _), (on, _) = runs[False][0], runs[True][0]
    differ = [n for n in off.nodes if off.nodes[n].output_placements != on.nodes[n].output_placements]
    print("== LLaMA-3 8B, 16 x 8 H100, selective AC, bf16/fp32, batch 32 x 8192 ==")
    print(f"  plans identical with and without the default budget: {not differ} ({len(differ)} nodes differ)")
    print(f"  objective: without {off.solution.objective * 1e3:.3f} ms, with {on.solution.objective * 1e3:.3f} ms")
    for budget, label in ((False, "no budget "), (True, "budget    ")):
        for plan, secs in runs[budget]:
            stages = ", ".join(f"{k} {plan.timings.get(k, 0.0):.2f}s" for k in STAGES)
            print(f"  {label}: build+solve {secs:.2f} s ({stages})")
    best = {b: min(s for _, s in runs[b]) for b in runs}
    print(
        f"  planning time (best of 2) without / with budget: {best[False]:.2f} s / {best[True]:.2f} s "
        f"({100 * (best[True] / best[False] - 1):+.1f}%)"
    )
    print("  memory per rank (the budget's estimate):")
    for line in memory.breakdown(on).lines():
        print("    " + line)


def bench_8b_saved() -> None:
    """Apply the 8B plan and add up what the partitioned forward hands the
    backward (its outputs after the user's, distinct storages by view base):
    the saved activations of the real step, per rank."""
    import example_llama3 as ex
    from autoparallel.capture.saved_activations import VIEW_OPS

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=128)
    try:
        args = ex.parse_args([])
        model, config = ex.build_model(args)
        mesh = init_device_mesh("cpu", (16, 8), mesh_dim_names=("dp", "tp"))

        def inputs():
            return torch.randint(0, config.vocab_size, (args.batch, args.seq), device="meta")

        with AutoParallel(model, mesh, inputs, device="H100", mp_policy=ex.mp_policy(args)) as autop:
            autop.add_input_constraints([ex.data_placements(mesh)])
            autop.add_output_constraints([ex.data_placements(mesh)])
            plan = autop.optimize_placement()
            parallel = autop.apply_placement(plan)
    finally:
        dist.destroy_process_group()
    fw = parallel.forward_graph
    outs = list(fw.graph.find_nodes(op="output")[0].args[0])[parallel.parallel_state.step.graphs.num_fwd_outputs :]
    bases = {}
    for o in outs:
        while isinstance(o, torch.fx.Node) and o.op == "call_function" and o.target in VIEW_OPS:
            o = o.args[0]
        v = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
        if o.op != "placeholder" and isinstance(v, torch.Tensor):
            bases[o] = v.numel() * v.element_size()
    est = memory.breakdown(plan)
    saved = sum(bases.values())
    print("\n== LLaMA-3 8B on 16 x 8, applied: saved activations per rank ==")
    print(
        f"  estimate {est.activations / 1e9:.2f} GB, partitioned forward saves {saved / 1e9:.2f} GB "
        f"({100 * (est.activations / saved - 1):+.1f}%); the overlap scheduler's live-bytes peak "
        f"(activations and transients) {est.scheduler_activations / 1e9:.2f} GB"
    )


def bench_tiny() -> None:
    import test_memory_budget as t
    from torch.distributed._local_tensor import LocalTensorMode

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    print("\n== tiny LLaMA-3 (debug config, batch 8 x 64) on 2 x 2, LocalTensorMode: bytes per rank ==")
    print(f"  {'AC':10s} {'budget':>9s} {'category':12s} {'estimate':>10s} {'measured':>10s} {'error':>7s}")
    try:
        for ac, budget in t.CASES:
            plan, parallel, _ = t._plan_llama(ac, apply=True, budget=budget)
            est = memory.breakdown(plan)
            tokens = torch.randint(0, t.ARGS.vocab_size, (t.BATCH, t.SEQ), generator=torch.Generator().manual_seed(0))
            with LocalTensorMode(t.N) as lm:
                parallel.to_empty(device="cpu")
                parallel.init_weights()
                got = t.measure_step(parallel, tokens, lm)
            rows = [(k, getattr(est, k), got[k]) for k in got] + [("total", est.total, sum(got.values()))]
            for k, e, m in rows:
                print(
                    f"  {ac or 'none':10s} {str(budget or 'default'):>9s} "
                    f"{k:12s} {e / 1e3:8.1f}kB {m / 1e3:8.1f}kB {100 * (e / m - 1):+6.1f}%"
                )
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--skip-8b-apply", action="store_true", help="skip applying the 8B plan (~1 min)")
    a = ap.parse_args()
    print(f"load: {os.getloadavg()[0]:.2f} (1-min average) on {os.cpu_count()} cores")
    if not a.skip_8b:
        bench_8b()
    if not a.skip_8b_apply:
        bench_8b_saved()
    if not a.skip_tiny:
        bench_tiny()


if __name__ == "__main__":
    main()
