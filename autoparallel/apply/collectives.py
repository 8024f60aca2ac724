"""What a rank-local graph communicates: one record per functional collective.

>>> # for c in collectives(parallel.parallel_graph, mesh): print(c)   # doctest: +SKIP
>>> # summarize(collectives(...))  -> {("all_gather_into_tensor", 0): (count, bytes)}
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh

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


def _bytes(val) -> int:
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def collectives(gm: torch.fx.GraphModule, mesh: DeviceMesh) -> list[Collective]:
    """Every collective of ``gm`` (a local joint, forward or backward graph)."""
    group_dim = {mesh.get_group(d).group_name: d for d in range(mesh.ndim)}
    out = []
    for n in gm.graph.nodes:
        target = n.target
        if not isinstance(target, torch._ops.OpOverload) or target.namespace != "_c10d_functional":
            continue
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
