"""Planning LLaMA-3 on 2-, 3- and 4-D meshes side by side.

Each configuration plans in its own process (so peak RSS is its own), under
an address-space limit (--max-gib, default 6) and the planner's problem-size
guard, and reports: option pairs before and after pruning (and after the
solver's presolve), time per stage, peak RSS, solver status and the
estimated step. Asserts nothing::

    python benchmarks/plan_mesh3d.py                 # the six plans below
    python benchmarks/plan_mesh3d.py --layers 2      # quick look
    python benchmarks/plan_mesh3d.py --only 8B-4x4x8 --layers 1

Configurations (name: model, mesh, names; the batch is sharded over dp*):
16x8 (dp, tp), 4x4x8 (dp_replicate, dp_shard, tp), HSDP 2x8x8
(dp_replicate, dp_shard, tp) for 8B at 32 layers; 70B at 80 layers on
8x16x8 (dp_replicate, dp_shard, tp) and 4x4x8x8 (dp_replicate, dp_shard,
cp, tp). Targets: each 3-D/4-D plan within 2x the time of the 16x8 plan of
the same model, under 2 GB peak RSS; 70B at 1024 ranks under 60 s; optimal.

Current figures, with the date and commit they were measured at, are in
docs/benchmarks.md; earlier ones are in git history.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CONFIGS = {
    "8B-16x8": ("8B", 32, (16, 8), ("dp", "tp")),
    "8B-4x4x8": ("8B", 32, (4, 4, 8), ("dp_replicate", "dp_shard", "tp")),
    "8B-hsdp-2x8x8": ("8B", 32, (2, 8, 8), ("dp_replicate", "dp_shard", "tp")),
    "70B-16x8": ("70B", 80, (16, 8), ("dp", "tp")),
    # batch 128: sharded over the 128 data-parallel ranks (32 would not divide)
    "70B-8x16x8": ("70B", 80, (8, 16, 8), ("dp_replicate", "dp_shard", "tp"), 128),
    "70B-4x4x8x8": ("70B", 80, (4, 4, 8, 8), ("dp_replicate", "dp_shard", "cp", "tp")),
}


def _plan(
    name: str, layers: int | None, seq: int, batch: int, max_gib: float, time_limit: float | None, bf16: bool, queue
) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (int(max_gib * 2**30),) * 2)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.placement_types import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autoparallel import AutoParallel
    from autoparallel.models.llama3 import LLAMA3_CONFIGS, Transformer, apply_ac

    model_name, n_layers, shape, names, *batch_override = CONFIGS[name]
    batch = batch_override[0] if batch_override else batch
    n_layers = layers or n_layers
    world = 1
    for n in shape:
        world *= n
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    config = dataclasses.replace(LLAMA3_CONFIGS[model_name], n_layers=n_layers, max_seq_len=seq)
    with torch.device("meta"):
        model = Transformer(config)
    apply_ac(model, mode="selective")
    dp = [i for i, n in enumerate(names) if n.startswith("dp")]
    data = tuple(Shard(0) if i in dp else Replicate() for i in range(len(shape)))
    out = {"name": name, "model": model_name, "layers": n_layers, "mesh": shape, "batch": batch}
    t0 = time.perf_counter()
    try:
        with AutoParallel(
            model,
            mesh,
            lambda: torch.randint(0, config.vocab_size, (batch, seq), device="meta"),
            max_problem_bytes=max_gib * 2**30 / 2,
            time_limit=time_limit,
            # the example's default (--mp bf16): bf16 compute, fp32 gradient reduction
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None,
        ) as autop:
            autop.add_input_constraints([data])
            autop.add_output_constraints([data])
            plan = autop.optimize_placement()
        s, built = plan.solution, autop.built
        out.update(
            status=s.status,
            objective=s.objective,
            step_ms=(plan.compute_cost + plan.comm_cost) * 1e3,
            comm_ms=plan.comm_cost * 1e3,
            pairs_before=built.size_unpruned.pairs,
            pairs=(built.priced_size or built.size).pairs,
            kept=sum(len(st.options) for st in built.strategies.values()) if built.priced_size else None,
            presolved=s.presolve.pairs_after if s.presolve else None,
            options_before=built.pruning.options_before if built.pruning else None,
            options_after=built.pruning.options_after if built.pruning else None,
            timings=dict(autop.timings),
            gap=s.gap,
            memory=_per_rank_memory(plan),
        )
    except Exception as e:  # noqa: BLE001 - reported in the table
        out.update(status=f"{type(e).__name__}: {str(e)[:300]}")
        size = getattr(e, "size", None)  # ProblemTooLarge: where the pairs are
        if size is not None:
            out.update(options_after=size.options, pairs=size.pairs, by_op=size.by_op)
        out["timings"] = dict(autop.timings) if "autop" in locals() else {}
    out["total_s"] = time.perf_counter() - t0
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put(out)


def _per_rank_memory(plan) -> tuple[float, float, str]:
    """(estimated bytes per rank, budget bytes, what the estimate covers):
    the whole step's estimate (parameters, gradients, AdamW state, saved
    activations) against the memory budget the plan was made under, from
    :func:`autoparallel.problem.memory.breakdown`; without the step's memory model,
    parameters + gradients + optimizer state against the HBM."""
    from autoparallel.problem import memory

    b = memory.breakdown(plan)
    if b.activations_source.startswith("saved for backward"):
        return b.total, b.budget if b.budget is not None else b.hbm, "whole step"
    return b.parameters + b.gradients + b.optimizer, b.hbm, "p+g+opt"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", default=None, choices=sorted(CONFIGS))
    p.add_argument("--layers", type=int, default=None, help="override every config's layer count")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=32, help="global batch (70B-8x16x8 uses 128)")
    p.add_argument("--max-gib", type=float, default=6.0, help="address-space limit per configuration")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    p.add_argument(
        "--time-limit",
        type=float,
        default=600.0,
        help="solver time limit in seconds (0: none); past it the plan reports its gap",
    )
    p.add_argument(
        "--mp",
        choices=["fp32", "bf16"],
        default="fp32",
        help="fp32 everywhere (default, the figures below) or the example's bf16 compute with fp32 gradient reduction",
    )
    a = p.parse_args(argv)
    names = a.only or ["8B-16x8", "8B-4x4x8", "8B-hsdp-2x8x8", "70B-16x8", "70B-8x16x8", "70B-4x4x8x8"]
    ctx = mp.get_context("spawn")
    print(f"load average at the start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs); precision {a.mp}", flush=True)
    rows = []
    for name in names:
        q = ctx.Queue()
        proc = ctx.Process(
            target=_plan, args=(name, a.layers, a.seq, a.batch, a.max_gib, a.time_limit or None, a.mp == "bf16", q)
        )
        proc.start()
        proc.join(a.timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            rows.append({"name": name, "status": f"killed after {a.timeout:.0f} s"})
        elif q.empty():
            rows.append({"name": name, "status": f"died (exit code {proc.exitcode}; memory limit?)"})
        else:
            rows.append(q.get())
        print(_row(rows[-1]), flush=True)
    print()
    print(f"load average at the end: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    print(_table(rows))


def _row(r: dict) -> str:
    row = f"{r['name']}: {r.get('status')} in {r.get('total_s', float('nan')):.1f} s, peak RSS {r.get('peak_rss_mib', float('nan')):.0f} MiB"
    for op, nodes, options, pairs in r.get("by_op", ()):
        row += f"\n    {op}: {nodes} nodes, {options:,} options, {pairs:,} pairs into them"
    return row


def _table(rows: list[dict]) -> str:
    stages = [
        "tracing",
        "options",
        "problem_build",
        "coarse_seed",
        "solve",
        "plan_report",
        "solver.presolve",
        "solver.build",
        "solver.solve",
    ]
    cols = [r["name"] for r in rows]
    lines = [f"{'':24s}" + "".join(f"{c:>16s}" for c in cols)]

    def line(label, fn):
        cells = []
        for r in rows:
            try:
                v = fn(r)
            except (KeyError, TypeError):
                v = None
            cells.append(f"{'-' if v is None else v:>16}")
        lines.append(f"{label:24s}" + "".join(cells))

    line("layers", lambda r: r["layers"])
    line("batch", lambda r: r["batch"])
    line("options (pruned)", lambda r: f"{r['options_before']}->{r['options_after']}")
    line("pairs unpruned", lambda r: f"{r['pairs_before']:,}")
    line("pairs pruned (built)", lambda r: f"{r['pairs']:,}")
    line("pairs after presolve", lambda r: f"{r['presolved']:,}")
    line("options kept (pricing)", lambda r: None if r["kept"] is None else f"{r['kept']:,}")
    for st in stages:
        line(f"{st} s", lambda r, st=st: f"{r['timings'][st]:.2f}")
    line("total s", lambda r: f"{r['total_s']:.1f}")
    line("peak RSS MiB", lambda r: f"{r['peak_rss_mib']:.0f}")
    line("status", lambda r: r["status"][:15])
    line(
        "gap",
        lambda r: "0 (proven)" if r["status"] == "optimal" else ("-" if r["gap"] is None else f"{100 * r['gap']:.3g}%"),
    )
    line("est. step ms", lambda r: f"{r['step_ms']:.1f}")
    line("  of it comm ms", lambda r: f"{r['comm_ms']:.1f}")
    line("mem/rank GB (budget)", lambda r: f"{r['memory'][0] / 1e9:.1f} ({r['memory'][1] / 1e9:.0f})")
    line("  of it", lambda r: r["memory"][2])
    return "\n".join(lines)


if __name__ == "__main__":
    main()
