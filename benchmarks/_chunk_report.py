"""``--chunk`` of the planning benchmarks: apply one plan without and with
the chunk_regions pass and print what chunking buys, from the cost model:
estimated exposed communication per chunked layer and per step (forward and
backward graphs as the overlap scheduler leaves them), estimated peak memory
per rank, node counts, apply time. Asserts nothing.

Shared by ``plan_llama3.py`` and ``plan_moe.py``::

    from _chunk_report import add_chunk_argument, chunk_compare, parse_chunk, pin_expert_parallel
    add_chunk_argument(parser, {"layers.*.moe": "batch"})   # --chunk [PATTERN=MODE ...], --pin-ep
    ...
    if a.pin_ep: pin_expert_parallel(autop, mesh)            # before optimize_placement
    if a.chunk is not None: chunk_compare(autop, plan, mesh, parse_chunk(a.chunk, a._chunk_default))
"""

from __future__ import annotations

import time


def add_chunk_argument(parser, default: dict[str, str]) -> None:
    """``--chunk [PATTERN=MODE ...]`` (no value: ``default``)."""
    text = " ".join(f"{k}={v}" for k, v in default.items())
    parser.add_argument(
        "--chunk",
        nargs="*",
        default=None,
        metavar="PATTERN=MODE",
        help=f"apply without and with chunk_regions and compare (default: {text})",
    )
    parser.set_defaults(_chunk_default=default)
    parser.add_argument(
        "--pin-ep",
        action="store_true",
        help="pin routed-expert weights to expert parallelism: Shard(0) (experts) on the last mesh dim, "
        "Shard(2) on the others (FSDP)",
    )


def pin_expert_parallel(autop, mesh) -> int:
    """Constrain stacked expert weights (``*.moe.w1/w2/w3``) to EP on the
    last mesh dim x FSDP (hidden dim) on the others; returns how many. This
    pins the weights' layout only; all-to-all token dispatch is asked for
    by the mesh role ``"ep"`` (``AutoParallel(..., mesh_roles={dim: "ep"})``)."""
    from torch.distributed.tensor import Shard

    pin = tuple(Shard(2) for _ in range(mesh.ndim - 1)) + (Shard(0),)
    n = 0
    for fqn, node in autop.traced.param_nodes.items():
        if fqn.endswith(("moe.w1", "moe.w2", "moe.w3")):
            autop.add_node_constraint(node, pin)
            n += 1
    return n


def parse_chunk(values, default: dict[str, str]) -> dict[str, str] | None:
    if values is None:
        return None
    if not values:
        return dict(default)
    out = {}
    for v in values:
        pattern, _, mode = v.partition("=")
        out[pattern] = mode or "batch"
    return out


def _all_to_alls(nodes) -> set:
    """The all-to-alls of a graph: functional and MoE row exchanges, and the
    fused MoE ops that run theirs inside (blocking)."""
    import torch

    from autoparallel.passes.overlap_model import A2A, MOE_EXCHANGE

    ops = torch.ops.autoparallel
    kinds = {A2A, MOE_EXCHANGE, ops.moe_experts_a2a.default, ops.moe_experts_a2a_backward.default}
    return {n for n in nodes if n.target in kinds}


def _graph_figures(pm, mesh, plan, modules) -> dict:
    from autoparallel.passes import PassContext
    from autoparallel.passes.chunk_regions import exposed_comm_by_region
    from autoparallel.passes.overlap_model import Costs, estimate

    costs = Costs(PassContext(mesh=mesh, plan=plan))
    out = {"layers": {}, "layers_a2a": {}}
    for kind, gm in (("forward", pm.forward_graph), ("backward", pm.backward_graph)):
        nodes = list(gm.graph.nodes)
        exposed, peak = estimate(nodes, costs)
        out[kind] = {"nodes": len(nodes), "exposed_s": exposed, "peak": peak}
        for region, sec in exposed_comm_by_region(nodes, costs, modules).items():
            out["layers"][region] = out["layers"].get(region, 0.0) + sec
        for region, sec in exposed_comm_by_region(nodes, costs, modules, only=_all_to_alls(nodes)).items():
            out["layers_a2a"][region] = out["layers_a2a"].get(region, 0.0) + sec
    return out


def chunk_compare(autop, plan, mesh, modules: dict[str, str], pass_options=None, fused_baseline=False) -> dict:
    """Apply ``plan`` without ``chunk_modules``, with them (weight-gradient
    sums added before their collectives: the default) and with them and
    late sums (``chunk_early_grad_sum=False``); ``fused_baseline``: first
    without chunking and with the all-to-all MoE ops kept fused
    (``split_moe_a2a`` off). Print and return the figures."""
    import dataclasses

    from autoparallel.passes import PassOptions

    base = pass_options or PassOptions()
    variants = (
        ("unchunked", dataclasses.replace(base, chunk_modules=None), ()),
        ("chunked", dataclasses.replace(base, chunk_modules=dict(modules)), ()),
        ("late sums", dataclasses.replace(base, chunk_modules=dict(modules), chunk_early_grad_sum=False), ()),
    )
    if fused_baseline:
        # all-to-all MoE ops kept fused (their all-to-alls block inside them)
        variants = (("fused a2a", dataclasses.replace(base, chunk_modules=None), ("split_moe_a2a",)),) + variants
    runs = {}
    for label, opts, disabled in variants:
        t0 = time.perf_counter()
        pm = autop.apply_placement(plan, pass_options=opts, disable_passes=disabled)
        runs[label] = _graph_figures(pm, mesh, plan, modules)
        runs[label]["apply_s"] = time.perf_counter() - t0
        runs[label]["stats"] = (plan.pass_stats or {}).get("chunk_regions")
    stats = runs["chunked"]["stats"]
    print(f"chunking {modules}")
    if stats is not None:
        print(
            f"  regions chunked {stats.regions_chunked}, refused {stats.regions_refused}, "
            f"nodes added {stats.nodes_added} (joint graph), live-ins split {stats.live_ins_split}, "
            f"shared {stats.live_ins_shared}"
        )
        for line in stats.refusal_lines():
            print(line)
    labels = [v[0] for v in variants]
    print(f"  {'':26s} " + " ".join(f"{lb:>12s}" for lb in labels))

    def row(name, fn, fmt="12.3f"):
        print(f"  {name:26s} " + " ".join(format(fn(runs[lb]), fmt) for lb in labels))

    row("apply (s)", lambda r: r["apply_s"], "12.1f")
    for kind in ("forward", "backward"):
        row(kind + " nodes", lambda r: r[kind]["nodes"], "12d")
        row(kind + " exposed comm (ms)", lambda r: r[kind]["exposed_s"] * 1e3)
        row(kind + " peak (MiB)", lambda r: r[kind]["peak"] / 2**20, "12.1f")
    row("step exposed comm (ms)", lambda r: (r["forward"]["exposed_s"] + r["backward"]["exposed_s"]) * 1e3)
    layers = sorted(set().union(*(r["layers"] for r in runs.values())))
    if layers:
        row("exposed per layer (ms)", lambda r: sum(r["layers"].get(x, 0.0) for x in layers) / len(layers) * 1e3)
        row("  of it all-to-all (ms)", lambda r: sum(r["layers_a2a"].get(x, 0.0) for x in layers) / len(layers) * 1e3)
        print(
            f"  (the matching layers' own collectives, fwd + bwd, mean over {len(layers)} layers; an "
            "all-to-all inside a fused MoE op counts whole)"
        )
    for ref in ("fused a2a", "unchunked") if fused_baseline else ("unchunked",):
        u = runs[ref]
        for lb in labels[labels.index(ref) + 1 :]:
            c = runs[lb]
            peak = max(c["forward"]["peak"], c["backward"]["peak"]) / max(u["forward"]["peak"], u["backward"]["peak"])
            lu = sum(u["layers"].values()) or float("nan")
            la = sum(u["layers_a2a"].values()) or float("nan")
            print(
                f"  {lb} vs {ref}: exposed per layer x{sum(c['layers'].values()) / lu:.2f}, all-to-all "
                f"x{sum(c['layers_a2a'].values()) / la:.2f}, peak memory {(peak - 1) * 100:+.1f}%"
            )
    return runs
