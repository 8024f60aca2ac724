"""Planning LLaMA-3 end to end: model to proven-optimal solution.

Plans one training step of LLaMA-3 (8B by default: 32 layers, sequence 8192,
batch 32) on a fake 16 x 8 mesh (128 ranks, "dp" x "tp") with selective
activation checkpointing, input and output constrained to
``(Shard(0), Replicate())``, and prints where the time goes, how big the
ILP is, the peak memory of the process and what the plan costs. Target:
at most 30 s and 2 GB peak RSS with status optimal. Asserts nothing::

    python benchmarks/plan_llama3.py                    # LLaMA-3 8B on 16x8
    python benchmarks/plan_llama3.py --layers 2 --seq 2048
    python benchmarks/plan_llama3.py --mesh 8 8 --no-ac
    python benchmarks/plan_llama3.py --compare-meshes   # 2-, 3- and 4-D side by side
                                                        # (plan_mesh3d.py, its arguments)

Model construction and imports are not timed; "total" is tracing through
the solver's answer (everything ``AutoParallel`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.placement_types import Replicate, Shard  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from _chunk_report import add_chunk_argument, chunk_compare, parse_chunk  # noqa: E402
from autoparallel import AutoParallel  # noqa: E402
from autoparallel.models.llama3 import LLAMA3_CONFIGS, Transformer, apply_ac  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--mesh", type=int, nargs="+", default=[16, 8], help="mesh shape, e.g. 16 8 or 4 4 8")
    p.add_argument(
        "--mesh-names",
        nargs="+",
        default=None,
        help="mesh dim names (default dp tp for 2-D, d0 d1 ... otherwise); the batch is "
        "sharded over the dims named dp* (the first dim when none is)",
    )
    p.add_argument("--gpus-per-node", type=int, default=None, help="cost model: GPUs per node (default 8)")
    p.add_argument("--model", default="8B", choices=sorted(LLAMA3_CONFIGS))
    p.add_argument("--no-ac", action="store_true", help="no activation checkpointing")
    p.add_argument(
        "--compare-full",
        action="store_true",
        help="with --apply: also apply without layer folding (slow) and check "
        "that the folded apply gave the same graphs",
    )
    p.add_argument(
        "--compare-meshes",
        action="store_true",
        help="plan 8B on 16x8, 4x4x8 and HSDP 2x8x8 and 70B on 16x8, 8x16x8 and 4x4x8x8, each in "
        "its own process, and print them side by side (benchmarks/plan_mesh3d.py: the other "
        "arguments are its own, e.g. --only, --layers, --time-limit, --mp)",
    )
    p.add_argument(
        "--apply",
        action="store_true",
        help="also time apply_placement and print its collectives and pass stats "
        "(applies twice: without and with the rewrite passes)",
    )
    p.add_argument("--verbose", action="store_true", help="log autoparallel's INFO messages")
    # --chunk: apply without/with chunk_regions and compare (_chunk_report.py)
    add_chunk_argument(p, {"layers.*.attention": "batch", "layers.*.feed_forward": "batch"})
    p.add_argument("--no-dump", action="store_true", help="skip timing the debug dumps")
    return p.parse_args(argv)


def _peak_rss_mib() -> float:
    # ru_maxrss is KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--compare-meshes" in argv:
        # the side-by-side table (16x8, 4x4x8, HSDP 2x8x8 for 8B;
        # 8x16x8 and 4x4x8x8 for 70B), each plan in its own process:
        # benchmarks/plan_mesh3d.py, which takes the remaining arguments
        from plan_mesh3d import main as compare_meshes

        compare_meshes([x for x in argv if x != "--compare-meshes"])
        return
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(name)s: %(message)s")
    world = 1
    for n in a.mesh:
        world *= n
    names = ("dp", "tp") if len(a.mesh) == 2 else tuple(f"d{i}" for i in range(len(a.mesh)))
    if a.mesh_names:
        if len(a.mesh_names) != len(a.mesh):
            raise SystemExit(f"--mesh-names needs {len(a.mesh)} names, got {a.mesh_names}")
        names = tuple(a.mesh_names)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh("cpu", tuple(a.mesh), mesh_dim_names=names)
    config = dataclasses.replace(LLAMA3_CONFIGS[a.model], n_layers=a.layers, max_seq_len=a.seq)
    with torch.device("meta"):
        model = Transformer(config)
    if not a.no_ac:
        apply_ac(model, mode="selective")

    def inputs():
        return torch.randint(0, config.vocab_size, (a.batch, a.seq), device="meta")

    dp_dims = [i for i, n in enumerate(names) if n.startswith("dp")] or [0]
    constraint = [tuple(Shard(0) if i in dp_dims else Replicate() for i in range(len(a.mesh)))]
    rss_before = _peak_rss_mib()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    with AutoParallel(model, mesh, inputs, gpus_per_node=a.gpus_per_node) as autop:
        autop.add_input_constraints(constraint)
        autop.add_output_constraints(constraint)
        plan = autop.optimize_placement()
        total = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        applied = _apply_both_ways(autop, plan, mesh, a.compare_full) if a.apply else None
        if a.chunk is not None:
            chunk_compare(autop, plan, mesh, parse_chunk(a.chunk, a._chunk_default))

    t = autop.timings
    s = plan.solution
    ps = s.presolve
    stats = autop.strategy_stats
    problem = autop.built.problem
    print(
        f"LLaMA-3 {a.model}: {a.layers} layers, seq {a.seq}, batch {a.batch}, mesh {tuple(a.mesh)}"
        f", {'no AC' if a.no_ac else 'selective AC'}"
    )
    print("time (s)")
    rows = [
        ("tracing", t.get("tracing", 0.0)),
        ("options", t.get("options", 0.0)),
        ("repeated layers", t.get("repeated_layers", 0.0)),
        ("costs + problem build", t.get("problem_build", 0.0)),
        ("presolve", t.get("solver.presolve", 0.0)),
        ("ILP build", t.get("solver.build", 0.0)),
        ("ILP solve", t.get("solver.solve", 0.0)),
        ("solver total", t.get("solve", 0.0)),
        ("total", total),
    ]
    for name, sec in rows:
        print(f"  {name:22s} {sec:8.2f}")
    # On a shared machine wall time includes waiting for a core; CPU time
    # (all threads of this process) does not.
    print(f"  {'total CPU time':22s} {cpu:8.2f}")
    print("problem")
    print(
        f"  graph nodes {stats.nodes}, options {stats.options}, option lists computed "
        f"{stats.computed} (the other nodes share them)"
    )
    print(f"  decisions {len(problem.decisions)}, edges {len(problem.edges)}, links {len(problem.links)}")
    if ps is not None:
        print(
            f"  presolve: decisions {ps.decisions_before} -> {ps.decisions_after}, "
            f"options {ps.options_before} -> {ps.options_after}, "
            f"option pairs {ps.pairs_before} -> {ps.pairs_after}"
        )
    print(f"  ILP: {s.num_variables} variables, {s.num_constraints} constraints")
    print("plan")
    print(f"  status {s.status} ({s.backend}, gap {s.gap})")
    print(
        f"  parameters per rank {plan.parameter_bytes_per_rank / 1e9:.3f} GB"
        f" of {plan.parameter_bytes_total / 1e9:.3f} GB"
    )
    print(
        f"  estimated per step: compute {plan.compute_cost * 1e3:.2f} ms, communication {plan.comm_cost * 1e3:.2f} ms"
    )
    if applied is not None:
        _print_apply(applied, plan)
        _print_buckets(applied, plan)
    if not a.no_dump:
        _print_dumps(problem, s, plan)
    print(f"peak RSS {_peak_rss_mib():.0f} MiB (before planning {rss_before:.0f} MiB)")
    dist.destroy_process_group()


def _apply_both_ways(autop, plan, mesh, compare_full: bool = False) -> dict:
    """Apply without passes (the baseline graphs) and with all of them
    (timed: what a user pays), and count collectives in both. With
    ``compare_full``, apply once more without layer folding and compare."""
    from autoparallel import passes
    from autoparallel.apply import collectives
    from autoparallel.apply.fingerprint import differences, fingerprint
    from autoparallel.passes.recompute_all_gathers import saved_for_backward

    out = {}
    runs = [("no passes", tuple(passes.pass_names()), True), ("passes", (), True)]
    if compare_full:
        runs.append(("unfolded", (), False))
    for label, disabled, fold in runs:
        t0, c0 = time.perf_counter(), time.process_time()
        pm = autop.apply_placement(plan, disable_passes=disabled, fold_layers=fold)
        out[label] = {
            "wall": time.perf_counter() - t0,
            "cpu": time.process_time() - c0,
            "folded": bool(pm.parallel_state.local.extra.get("folded")),
            "fingerprint": fingerprint(pm.parallel_state.step.graphs),
            "forward": _count(collectives(pm.forward_graph, mesh)),
            "backward": _count(collectives(pm.backward_graph, mesh)),
            "saved_bytes": sum(
                b for _, b in saved_for_backward(pm.forward_graph, pm.parallel_state.step.graphs.num_fwd_outputs)
            ),
        }
    if compare_full:
        diff = differences(out["passes"]["fingerprint"], out["unfolded"]["fingerprint"])
        out["unfolded"]["same_graphs"] = "identical" if not diff else "DIFFERENT: " + ", ".join(diff)
    return out


def _print_dumps(problem, solution, plan) -> None:
    """Size and write time of the debug dumps (what AUTOPARALLEL_DUMP_DIR
    writes): the problem with each distinct cost table once, plain and
    gzip; the solution; the plan. Target for 8B: problem <= 20 MB, <= 1 s."""
    import tempfile

    from solver import serialize

    print("dumps (size, write time)")
    with tempfile.TemporaryDirectory() as d:
        for label, write, name in [
            ("problem.json", lambda p: serialize.dump(problem, p, shared=True), "problem.json"),
            ("problem.json.gz", lambda p: serialize.dump(problem, p, shared=True), "problem.json.gz"),
            ("solution.json", lambda p: serialize.dump(solution, p), "solution.json"),
            ("plan.json", lambda p: plan.dump_json(p, indent=None), "plan.json"),
        ]:
            path = os.path.join(d, name)
            t0 = time.perf_counter()
            write(path)
            sec = time.perf_counter() - t0
            print(f"  {label:16s} {os.path.getsize(path) / 1e6:8.2f} MB {sec:6.2f} s")
        t0 = time.perf_counter()
        serialize.load(os.path.join(d, "problem.json"))
        print(f"  problem.json read back in {time.perf_counter() - t0:.2f} s")


def _count(items) -> dict:
    counts: dict = {}
    for c in items:
        counts[c.kind] = counts.get(c.kind, 0) + 1
    return counts


def _print_apply(applied: dict, plan) -> None:
    print("apply")
    for label, r in applied.items():
        print(
            f"  {label:10s} {r['wall']:7.2f} s wall, {r['cpu']:7.2f} s CPU; saved for backward "
            f"{r['saved_bytes'] / 1e9:.2f} GB per rank; layers {'folded' if r['folded'] else 'not folded'}"
            + (f"; graphs vs the folded apply: {r['same_graphs']}" if "same_graphs" in r else "")
        )
    print("  collectives per graph (without -> with passes)")
    for graph in ("forward", "backward"):
        before, after = applied["no passes"][graph], applied["passes"][graph]
        kinds = sorted(before.keys() | after.keys())
        print(f"    {graph:8s} " + ", ".join(f"{k} {before.get(k, 0)} -> {after.get(k, 0)}" for k in kinds))
    for name, stats in plan.pass_stats.items():
        print(f"  pass {name}: {stats}")


# --- collectives per step before/after bucket_collectives ------------------
def _print_buckets(applied: dict, plan) -> None:
    """Collectives per step (forward + backward) with all passes, and what
    they would be without bucket_collectives (each bucket stands for the
    collectives it merged)."""
    stats = plan.pass_stats.get("bucket_collectives") or {}
    after = sum(sum(applied["passes"][g].values()) for g in ("forward", "backward"))
    merged = sum(s.collectives_merged - s.buckets for s in stats.values())
    saved = sum(s.comm_time_saved_s for s in stats.values())
    print(
        f"  collectives per step: {after + merged} before bucketing -> {after} after "
        f"(est. {saved * 1e3:.2f} ms of latency saved, not in the plan's cost)"
    )
    for kind, s in stats.items():
        print(
            f"    {kind:8s} {s.buckets} buckets replace {s.collectives_merged} {s.by_kind}; "
            f"est. peak {s.peak_memory_before / 1e9:.2f} -> {s.peak_memory_after / 1e9:.2f} GB "
            f"(bucket_bytes {s.bucket_bytes_used >> 20} MiB)"
        )


if __name__ == "__main__":
    main()
