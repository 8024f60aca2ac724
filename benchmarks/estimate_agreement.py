"""The solver's figure against the overlap scheduler's estimate, and the hand
layouts beside the plan.

Per configuration: plan (the ILP's objective: compute, recomputation
included, plus communication as the objective counts it), apply, and read
the overlap scheduler's estimated step of the applied graphs, and the
memory per rank both ways (``mem plan``: the planner's estimate, which the
memory budget bounds; ``mem peak``: with the scheduler's live-bytes peak
of the applied graphs); with ``--baselines`` also plan, apply and schedule each hand layout
(:mod:`autoparallel.baselines`) and print the plan's margin. Each row runs
in its own subprocess under a memory limit (``--max-gb``), one after the
other; a row that fails prints its error and the rest go on. Asserts
nothing::

    python benchmarks/estimate_agreement.py                       # the small rows
    python benchmarks/estimate_agreement.py --rows all --baselines
    python benchmarks/estimate_agreement.py --rows 8b_16x8 70b_16x8
    python benchmarks/estimate_agreement.py --rows debug_2x2 --breakdown  # where the figures part

Rows: ``8b_16x8`` / ``8b_16x8_full`` (LLaMA-3 8B, seq 8192, batch 32, bf16,
selective / full AC), ``70b_16x8`` (minutes), ``8b_2x8x8`` (dp_replicate
dp_shard tp), ``moe16b_8x8`` (the 16B MoE, seq 4096, one sequence per rank),
``zoo_llama`` / ``zoo_gpt2`` / ``zoo_vit`` (benchmarks/plan_zoo.py's models
on 2x2); small: ``debug_2x2``, ``debug_2x2_full``, ``debug_2x2x2``,
``moe_debug_2x2``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

# name -> (kind, arguments)
ROWS = {
    "8b_16x8": ("llama", dict(model="8B", mesh=[16, 8])),
    "8b_16x8_full": ("llama", dict(model="8B", mesh=[16, 8], ac="full")),
    "70b_16x8": ("llama", dict(model="70B", mesh=[16, 8])),
    "8b_2x8x8": ("llama", dict(model="8B", mesh=[2, 8, 8], names=["dp_replicate", "dp_shard", "tp"])),
    "moe16b_8x8": ("moe", dict(model="16B", mesh=[8, 8], seq=4096)),
    "zoo_llama": ("zoo", dict(model="llama")),
    "zoo_gpt2": ("zoo", dict(model="gpt2")),
    "zoo_vit": ("zoo", dict(model="vit")),
    "debug_2x2": ("llama", dict(model="debug", mesh=[2, 2], seq=256, batch=8)),
    "debug_2x2_full": ("llama", dict(model="debug", mesh=[2, 2], seq=256, batch=8, ac="full")),
    "debug_2x2x2": (
        "llama",
        dict(model="debug", mesh=[2, 2, 2], seq=256, batch=8, names=["dp_replicate", "dp_shard", "tp"]),
    ),
    "moe_debug_2x2": ("moe", dict(model="debug", mesh=[2, 2], seq=64)),
}
SMALL = ("debug_2x2", "debug_2x2_full", "debug_2x2x2", "moe_debug_2x2")
FULL = ("8b_16x8", "8b_16x8_full", "70b_16x8", "8b_2x8x8", "moe16b_8x8", "zoo_llama", "zoo_gpt2", "zoo_vit")


def _fake_mesh(shape, names):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))


def _setup(kind: str, a: dict):
    """(model, mesh, inputs, mp_policy, input placements, output placements)."""
    import torch
    from torch.distributed.tensor import Shard

    if kind == "llama":
        import example_llama3 as ex

        argv = ["--model", a["model"], "--mesh", *map(str, a["mesh"]), "--ac", a.get("ac", "selective")]
        argv += ["--seq", str(a.get("seq", 8192)), "--batch", str(a.get("batch", 32))]
        if a.get("names"):
            argv += ["--mesh-names", *a["names"]]
        args = ex.parse_args(argv)
        mesh = _fake_mesh(a["mesh"], ex.mesh_names(args, len(a["mesh"])))
        model, config = ex.build_model(args)

        def inputs():
            return torch.randint(0, config.vocab_size, (args.batch, args.seq), device="meta")

        data = ex.data_placements(mesh)
        return model, mesh, inputs, ex.mp_policy(args), [data], [data]
    if kind == "moe":
        from autoparallel.models.llama3 import apply_ac
        from autoparallel.models.moe import MOE_CONFIGS, MoETransformer

        mesh = _fake_mesh(a["mesh"], ("dp", "ep"))
        config = dataclasses.replace(MOE_CONFIGS[a["model"]], max_seq_len=a["seq"])
        with torch.device("meta"):
            model = MoETransformer(config)
        apply_ac(model, mode="selective")
        x = torch.empty(math.prod(a["mesh"]), a["seq"], dtype=torch.long, device="meta")
        data = (Shard(0),) * len(a["mesh"])
        return model, mesh, x, None, [data], [data]
    import plan_zoo

    with torch.device("meta"):
        model, inputs, shape = plan_zoo.MODELS[a["model"]]()
    mesh = _fake_mesh(shape, plan_zoo.MESH_DIM_NAMES[len(shape)])
    return model, mesh, inputs, None, "batch_on_dp", None


def run_row(name: str, with_baselines: bool, breakdown_too: bool = False) -> dict:
    """Plan, apply and estimate one row (in this process)."""

    from autoparallel import AutoParallel, baselines
    from autoparallel.problem.memory import breakdown
    from autoparallel.report.numbers import step_estimate

    kind, a = ROWS[name]
    model, mesh, inputs, mp, ins, outs = _setup(kind, a)
    out: dict = {"row": name}
    parallel = None
    with AutoParallel(model, mesh, inputs, mp_policy=mp) as autop:
        constrain(autop, mesh, ins, outs)
        t0 = time.perf_counter()
        plan = autop.optimize_placement()
        out["plan_s"] = time.perf_counter() - t0
        out["solve_s"] = autop.timings.get("solve", 0.0)
        t0 = time.perf_counter()
        parallel = autop.apply_placement(plan)
        out["apply_s"] = time.perf_counter() - t0
        e = step_estimate(plan)
        mem = breakdown(plan)
        out.update(
            solver=plan.compute_cost + plan.comm_cost,
            solver_compute=plan.compute_cost,
            solver_comm=plan.comm_cost,
            step=e["step"],
            compute=e["compute"],
            exposed=e["exposed_after"],
            memory=mem.total,
            # the planner's estimate, which the memory budget bounds
            memory_planned=mem.planned,
            memory_budget=mem.budget,
        )
        if breakdown_too:
            out["breakdown"] = _breakdown(autop, plan, parallel)
        if with_baselines:
            out["baselines"] = [r.to_json() for r in baselines.compare(autop, plan)]
    return out


def _op(target) -> str:
    parts = str(target).split(".")
    return (
        parts[1] if len(parts) > 1 and parts[0] in ("aten", "_c10d_functional", "autoparallel", "prims") else parts[0]
    )


def _breakdown(autop, plan, parallel) -> dict:
    """Where the two figures part: per op, the solver's compute (recomputation
    included) against the scheduler's compute ops of the applied graphs; per
    (phase, collective, link), the time on the link and the stall it causes."""
    import collections
    import types

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from autoparallel.graph_vocab import REDISTRIBUTE_KEY
    from autoparallel.passes.overlap_model import COLLECTIVE_START, OTHER_CALL, WAIT_NODE, Clock, Costs, Info

    solver_ops: collections.Counter = collections.Counter()
    for n in plan.nodes.values():
        solver_ops[_op(n.op.replace("::", "."))] += n.compute_cost
    sched_ops: collections.Counter = collections.Counter()
    sched_copies = 0.0  # compute ops apply emitted for redistributions (and the passes' copies of them)
    on_link: collections.Counter = collections.Counter()
    exposed: collections.Counter = collections.Counter()
    ctx = types.SimpleNamespace(mesh=autop.mesh, device=autop.device)
    with unset_fake_temporarily():
        for phase, gm in (("forward", parallel.forward_graph), ("backward", parallel.backward_graph)):
            nodes = list(gm.graph.nodes)
            info = Info(nodes, Costs(ctx))
            clock = Clock(info)
            for n in nodes:
                before = clock.exposed
                clock.run(n)
                kind = info.kind[n]
                if kind == OTHER_CALL:
                    sched_ops[_op(n.target)] += info.time[n]
                    if n.meta.get(REDISTRIBUTE_KEY) is not None:
                        sched_copies += info.time[n]
                elif kind == COLLECTIVE_START:
                    on_link[f"{phase} {_op(n.target)} on {info.stream[n]}"] += info.time[n]
                elif kind == WAIT_NODE and clock.exposed > before:
                    start = n.args[0]
                    exposed[f"{phase} {_op(start.target)} on {info.stream[start]}"] += clock.exposed - before
    ops = sorted(set(solver_ops) | set(sched_ops), key=lambda o: -abs(sched_ops[o] - solver_ops[o]))
    return {
        "edges": _solver_edges(autop, plan),
        "sched_copies": sched_copies,
        "compute_by_op": [(o, solver_ops[o], sched_ops[o]) for o in ops if solver_ops[o] or sched_ops[o]][:20],
        "collectives": sorted(((k, v, exposed.get(k, 0.0)) for k, v in on_link.items()), key=lambda r: -r[1]),
    }


def _solver_edges(autop, plan) -> dict:
    """The plan's redistribution edges as the objective counts them, split
    into collectives (their time on the link, before any overlap share)
    and local copies (in full per edge, and as the edge's share of them)."""
    from autoparallel import cost_model
    from autoparallel.cost_model.bucket_copies import bucket_copy_time
    from autoparallel.problem.builder import forward_param_chain

    built, choice = autop.built, plan.solution.choice
    param_chain = {n.name for n in forward_param_chain(autop.traced)}
    strategies = built.strategies
    by_name = {n.name: n for n in built.nodes}
    readers: dict = {}
    edges = []
    for e in built.problem.edges:
        cons = by_name.get(e.consumer)
        if e.arg_index < 0 or cons is None or strategies[cons].getitem_index is not None:
            continue
        readers[e.producer] = readers.get(e.producer, 0) + 1
        edges.append(e)
    total = {"collectives": 0.0, "copies": 0.0, "copies_shared": 0.0, "bucket_copies": 0.0, "counted": 0.0}
    no_copies = cost_model.copies_device(autop.device, 0.0)
    for e in edges:
        prod, cons = by_name[e.producer], by_name[e.consumer]
        src = strategies[prod].options[choice[e.producer]].output_spec
        dst = strategies[cons].options[choice[e.consumer]].input_specs[e.arg_index]
        if src.tensor_meta is None:
            continue
        full = cost_model.redistribute_time(src, dst, autop.device)
        coll = cost_model.redistribute_time(src, dst, no_copies)
        total["collectives"] += coll
        total["copies"] += full - coll
        total["copies_shared"] += (full - coll) / readers[e.producer]
        if e.producer in param_chain and cons.meta.get("partitioner_tag") != "is_backward":
            share = cost_model.copies_device(autop.device, 1.0 / readers[e.producer])
            total["bucket_copies"] += bucket_copy_time(src, dst, cost_model.PARAM_ALL_GATHER, share)
        total["counted"] += e.costs[choice[e.producer]][choice[e.consumer]]
    return total


def print_breakdown(rows: list[dict]) -> None:
    for r in rows:
        b = r.get("breakdown")
        if not b:
            continue
        ed = b.get("edges")
        if ed:
            print(
                f"\n{r['row']}: solver's edges: collectives {ed['collectives'] * 1e3:.2f} ms on the link, "
                f"copies {ed['copies'] * 1e3:.2f} ms per edge, {ed['copies_shared'] * 1e3:.2f} ms shared, "
                f"parameter gathers' bucket copies {ed.get('bucket_copies', 0.0) * 1e3:.2f} ms "
                f"(edges count {ed['counted'] * 1e3:.2f} ms); scheduler's redistribution copies "
                f"{b.get('sched_copies', 0.0) * 1e3:.2f} ms"
            )
        print(f"\n{r['row']}: compute per op (solver / scheduler, ms)")
        for op, a, c in b["compute_by_op"]:
            print(f"  {op:32s} {a * 1e3:9.2f} {c * 1e3:9.2f} {(c - a) * 1e3:+9.2f}")
        print(f"{r['row']}: collectives (time on the link / exposed, ms)")
        for key, t, e in b["collectives"]:
            print(f"  {key:48s} {t * 1e3:9.2f} {e * 1e3:9.2f}")


def constrain(autop, mesh, ins, outs) -> None:
    """A row's input and output constraints (``ins == "batch_on_dp"``: every
    input's batch split over the first mesh dim)."""
    from torch.distributed.tensor import Replicate, Shard

    if ins == "batch_on_dp":
        ins = [(Shard(0),) + (Replicate(),) * (mesh.ndim - 1)] * len(autop.traced.input_nodes)
    autop.add_input_constraints(ins)
    if outs is not None:
        autop.add_output_constraints(outs)


def _child(name: str, with_baselines: bool, max_gb: float, breakdown_too: bool = False) -> dict:
    from _row_child import run_row_child

    extra = (["--baselines"] if with_baselines else []) + (["--breakdown"] if breakdown_too else [])
    return run_row_child(__file__, name, extra, max_gb)


def _ms(s):
    return "n/a" if s is None else f"{s * 1e3:9.2f}"


def _gb(b):
    return f"{'n/a':>8s}" if b is None else f"{b / 1e9:5.2f} GB"


def print_table(rows: list[dict]) -> None:
    print(
        f"{'row':16s} {'solver ms':>9s} {'sched ms':>9s} {'diff':>7s} {'s.compute':>9s} {'s.comm':>9s} "
        f"{'compute':>9s} {'exposed':>9s} {'plan s':>7s} {'solve s':>7s} {'mem plan':>8s} {'mem peak':>8s}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['row']:16s} {r['error']}")
            continue
        diff = (r["solver"] - r["step"]) / r["step"] * 100 if r.get("step") else float("nan")
        print(
            f"{r['row']:16s} {_ms(r['solver'])} {_ms(r['step'])} {diff:+6.1f}% {_ms(r['solver_compute'])} "
            f"{_ms(r['solver_comm'])} {_ms(r['compute'])} "
            f"{_ms(r['exposed'])} {r['plan_s']:7.1f} {r['solve_s']:7.2f} {_gb(r.get('memory_planned'))} "
            f"{_gb(r.get('memory'))}"
        )
    for r in rows:
        for b in r.get("baselines", ()):
            if b.get("step_s"):
                d = r["step"] - b["step_s"]
                margin = f"{d * 1e3:+.2f} ms, {d / b['step_s'] * 100:+.1f}%"
            else:
                margin = b.get("note") or "no figure"
            mem = f"{b['memory_bytes'] / 1e9:.2f} GB" if b.get("memory_bytes") else ""
            print(f"  {r['row']:16s} {b['name']:16s} {_ms(b.get('step_s'))} ms {mem:>9s}  plan {margin}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="*", default=None, help="row names, 'all' (the issue's rows) or 'small' (default)")
    p.add_argument("--baselines", action="store_true", help="also plan, apply and estimate the hand layouts")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="per row, the compute per op (solver against scheduler) and the time and exposure per collective",
    )
    p.add_argument("--max-gb", type=float, default=16.0, help="address-space limit per row")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(run_row(a.child, a.baselines, a.breakdown)))
        return
    names = a.rows or ["small"]
    names = [n for x in names for n in (FULL if x == "all" else SMALL if x == "small" else (x,))]
    rows = []
    for n in names:
        t0 = time.perf_counter()
        rows.append(_child(n, a.baselines, a.max_gb, a.breakdown))
        print(f"# {n}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print_table(rows)
    print_breakdown(rows)
    print(json.dumps(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
