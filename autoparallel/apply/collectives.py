"""What a rank-local graph communicates: one record per functional collective.

>>> # for c in collectives(parallel.parallel_graph, mesh): print(c)   # doctest: +SKIP
>>> # summarize(collectives(...))  -> {("all_gather_into_tensor", 0): (count, bytes)}
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.distributed_c10d import _resolve_process_group

from .moe_a2a_phases import EXCHANGE as MOE_EXCHANGE
from .redistribute import REDISTRIBUTE_KEY

__all__ = ["Collective", "collectives", "summarize"]

_KINDS = {
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_to_all_single",
}


@dataclass(frozen=True)
class Collective:
    node: str
    kind: str  # all_gather_into_tensor, reduce_scatter_tensor, all_reduce, all_to_all_single
    mesh_dim: int | None  # None: a group that is not one mesh dim
    in_bytes: int  # per rank
    out_bytes: int  # per rank
    phase: str  # "forward" | "backward"
    why: tuple | None  # (producer->consumer, src placements, dst placements)
    # the group in words: a mesh dim's name, "dp*tp" for the whole mesh in
    # row-major rank order (the flattened mesh), "dp*tp col-major" for the
    # other order (fused all-gathers), else the process group's name
    group: str = ""


def _bytes(val) -> int:
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _group_labels(mesh: DeviceMesh) -> tuple[dict[str, int], callable]:
    names = mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))
    group_dim = {mesh.get_group(d).group_name: d for d in range(mesh.ndim)}
    whole = "*".join(names)
    with unset_fake_temporarily():  # apply runs inside the tracing's fake mode
        row_major = mesh.mesh.flatten().tolist()
        column_major = mesh.mesh.permute(tuple(reversed(range(mesh.ndim)))).flatten().tolist()
    labels: dict[str, str] = {}

    def label(group: str) -> str:
        if group in group_dim:
            return names[group_dim[group]]
        if group not in labels:
            try:
                ranks = dist.get_process_group_ranks(_resolve_process_group(group))
            except Exception:  # not a group of this process (a graph from elsewhere)
                ranks = None
            labels[group] = whole if ranks == row_major else f"{whole} col-major" if ranks == column_major else group
        return labels[group]

    return group_dim, label


def collectives(gm: torch.fx.GraphModule, mesh: DeviceMesh) -> list[Collective]:
    """Every collective of ``gm`` (a local joint, forward or backward graph)."""
    group_dim, label = _group_labels(mesh)
    out = []
    for n in gm.graph.nodes:
        target = n.target
        if target is MOE_EXCHANGE:  # the MoE row all-to-all (variable size; balanced bytes)
            kind = "all_to_all_single"
        elif not isinstance(target, torch._ops.OpOverload) or target.namespace != "_c10d_functional":
            continue
        else:
            kind = target._schema.name.split("::")[-1]
        if kind not in _KINDS:
            continue
        group = n.args[-1] if isinstance(n.args[-1], str) else n.kwargs.get("group_name")
        src = n.args[0]
        out.append(
            Collective(
                node=n.name,
                kind=kind,
                mesh_dim=group_dim.get(group),
                in_bytes=_bytes(src.meta.get("val")) if isinstance(src, torch.fx.Node) else 0,
                out_bytes=_bytes(n.meta.get("val")),
                phase="backward" if n.meta.get("partitioner_tag") == "is_backward" else "forward",
                why=n.meta.get(REDISTRIBUTE_KEY),
                group=label(group) if isinstance(group, str) else str(group),
            )
        )
    return out


def summarize(items: list[Collective]) -> dict[tuple[str, str, int | None], tuple[int, int]]:
    """(phase, kind, mesh dim) -> (count, output bytes per rank)."""
    table: dict[tuple[str, str, int | None], tuple[int, int]] = {}
    for c in items:
        key = (c.phase, c.kind, c.mesh_dim)
        count, size = table.get(key, (0, 0))
        table[key] = (count + 1, size + c.out_bytes)
    return dict(sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] if kv[0][2] is not None else -1)))


def traffic_bytes(kind: str, in_bytes: float, n: int) -> float:
    """Bytes each rank sends for one ring collective of ``n`` ranks whose
    per-rank input is ``in_bytes`` (not the output size: an all-gather's
    output is ``n`` times its input, but each rank sends ``(n-1)`` inputs)."""
    if n <= 1:
        return 0.0
    if kind.startswith("all_gather"):
        return in_bytes * (n - 1)
    if kind.startswith("all_reduce"):
        return 2 * in_bytes * (n - 1) / n
    return in_bytes * (n - 1) / n  # reduce_scatter, all_to_all


def traffic_table(graphs: dict[str, torch.fx.GraphModule], mesh: DeviceMesh, device) -> list[dict]:
    """Per (phase, kind, group): count, output bytes, traffic bytes per rank
    and estimated seconds (:func:`autoparallel.cost_model.comm.collective_time`).
    ``graphs``: phase -> graph (by graph, not by node tag: a backward graph
    also runs recomputed forward ops)."""
    from ..cost_model.comm import collective_time, mesh_dim_topology

    with unset_fake_temporarily():
        topo = mesh_dim_topology(mesh, device.gpus_per_node)
    rows: dict[tuple, dict] = {}
    for phase, gm in graphs.items():
        for c in collectives(gm, mesh):
            if c.mesh_dim is not None:
                t = topo[c.mesh_dim]
                n, intra, per_node = t.group_size, t.intra_node, t.ranks_per_node
            else:  # a flattened (whole-mesh) group
                n = mesh.size()
                intra = n <= device.gpus_per_node
                per_node = min(n, device.gpus_per_node)
            kind = c.kind.removesuffix("_into_tensor").removesuffix("_tensor").removesuffix("_single")
            row = rows.setdefault(
                (phase, kind, c.group),
                {
                    "phase": phase,
                    "kind": kind,
                    "group": c.group,
                    "group_size": n,
                    "count": 0,
                    "output_bytes": 0,
                    "traffic_bytes": 0.0,
                    "seconds": 0.0,
                },
            )
            row["count"] += 1
            row["output_bytes"] += c.out_bytes
            row["traffic_bytes"] += traffic_bytes(kind, c.in_bytes, n)
            row["seconds"] += collective_time(kind, c.in_bytes, n, intra, device, per_node)
    return list(rows.values())
