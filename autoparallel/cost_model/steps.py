"""One step of a redistribution: what it runs and what it costs.

A redistribution changes one mesh dim at a time. A **step** on mesh dim
``m`` from placement ``a`` to ``b`` runs the collectives and local copies
:data:`STEP_KINDS` names for the pair's kind letters
(:func:`autoparallel.cost_model.placement_codes.kind`), and its seconds are
:func:`step_time` of the mesh dim's topology, those kinds and the local
bytes before and after (:func:`local_bytes` of the shard divisors). These
functions are the only place the cost of a step is written: the reference
(:mod:`autoparallel.cost_model.comm`) and its fast forms all call them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

from torch.distributed.tensor.placement_types import Placement

from .caches import register
from .devices import H100, DeviceSpec
from .placement_codes import PARTIAL, REPLICATE, SHARD, STRIDED, kind, shard_dim


@dataclass(frozen=True)
class MeshDimTopology:
    """How the process groups along one mesh dim sit on nodes."""

    group_size: int
    intra_node: bool  # every group lies within one node
    ranks_per_node: int  # fewest group members sharing a node (NICs in use)


def mesh_dim_topology(mesh: Any, gpus_per_node: int = 8) -> tuple[MeshDimTopology, ...]:
    """Per mesh dim: group size, whether it is intra-node, members per node.

    Derived from the rank layout ``mesh.mesh`` with node = rank // gpus_per_node;
    for a 16x8 mesh with 8 GPUs per node, dim 0 is inter-node (1 rank per
    node) and dim 1 intra-node. Cached per (mesh, gpus_per_node).
    """
    return _topology_cached(mesh, gpus_per_node)


@register
@lru_cache(maxsize=None)
def _topology_cached(mesh: Any, gpus_per_node: int) -> tuple[MeshDimTopology, ...]:
    # apply costs redistributions while it traces under fake and proxy
    # modes (a saved plan applied without planning first reaches here there):
    # the rank layout is real data, read outside them
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        return _topology_of(mesh.mesh, gpus_per_node)


def _topology_of(ranks, gpus_per_node: int) -> tuple[MeshDimTopology, ...]:
    result = []
    for d in range(ranks.ndim):
        n = ranks.shape[d]
        groups = (ranks.movedim(d, -1).reshape(-1, n) // gpus_per_node).tolist()
        intra = all(len(set(g)) == 1 for g in groups)
        per_node = min(min(g.count(x) for x in set(g)) for g in groups)
        result.append(MeshDimTopology(n, intra, per_node))
    return tuple(result)


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def collective_time(
    kind: str,
    bytes_per_rank: float,
    group_size: int,
    intra_node: bool,
    device: DeviceSpec = H100,
    ranks_per_node: int = 1,
) -> float:
    """Seconds for one NCCL-style collective (ring algorithm).

    ``bytes_per_rank`` is each rank's INPUT buffer: the shard for
    ``all_gather`` (output is ``group_size`` times larger), the full
    unreduced buffer for ``reduce_scatter`` and ``all_reduce``, the buffer
    being exchanged for ``all_to_all``. With ``n = group_size``, bandwidth
    ``bw`` and per-step latency ``lat``::

        all_gather      floor + (n-1) lat + (n-1) * bytes / bw
        reduce_scatter  floor + (n-1) lat + (n-1)/n * bytes / bw
        all_reduce      floor + 2 (n-1) lat + 2 (n-1)/n * bytes / bw
        all_to_all      floor + lat + (n-1)/n * bytes / bw

    Inter-node groups with ``ranks_per_node`` members on each node drive that
    many NICs: ``bw = min(intra_node_bw, ranks_per_node * inter_node_bw)``.
    """
    if group_size <= 1 or bytes_per_rank <= 0:
        return 0.0
    n = group_size
    if intra_node:
        bw, lat = device.intra_node_bw, device.intra_node_latency
        counted = device.intra_node_counted
    else:
        bw = min(device.intra_node_bw, max(ranks_per_node, 1) * device.inter_node_bw)
        lat = device.inter_node_latency
        counted = device.inter_node_counted
    bw *= device.comm_efficiency
    if kind == "all_gather":
        time = device.launch_floor + (n - 1) * lat + (n - 1) * bytes_per_rank / bw
    elif kind == "reduce_scatter":
        time = device.launch_floor + (n - 1) * lat + (n - 1) / n * bytes_per_rank / bw
    elif kind == "all_reduce":
        time = device.launch_floor + 2 * ((n - 1) * lat + (n - 1) / n * bytes_per_rank / bw)
    elif kind == "all_to_all":
        time = device.launch_floor + lat + (n - 1) / n * bytes_per_rank / bw
    else:
        raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")
    # the overlap policy's share of a hidden collective (1.0 on a real device)
    return time if counted == 1.0 else time * counted


def local_copy_time(out_bytes: float, device: DeviceSpec) -> float:
    """Seconds of one local copy kernel around a collective (slice a shard
    out of a replica, scale for a Partial, concatenate gathered chunks,
    stage an all-to-all): read + write of ``out_bytes``, at least a kernel
    launch (the overlap scheduler's compute model costs every copy kernel
    so), times the device's ``copies_counted`` share."""
    time = max(2 * out_bytes / (device.hbm_bw * device.memory_efficiency), device.launch_floor)
    return time if device.copies_counted == 1.0 else time * device.copies_counted


def copies_device(device: DeviceSpec, share: float) -> DeviceSpec:
    """``device`` with a redistribution's local copies counted at ``share``.

    The applied graph makes a redistribution once per (value, target
    layout), whatever the number of readers (the partitioner's common
    subexpression elimination merges the copies of several readers), while
    the planning problem prices one edge per reader: an edge out of a value
    with ``k`` readers counts ``1/k`` of its copies, exact when the readers
    want one layout (q, k and v of one normed input)."""
    return device if share == device.copies_counted else dataclasses.replace(device, copies_counted=share)


# What DTensor's ``redistribute_local_tensor`` runs for one mesh dim, by
# (src kind, dst kind) of two different placements. Strided shards go
# through Replicate; Shard -> Partial and Partial(op1) -> Partial(op2) are
# unsupported. Replicate -> anything is a local slice or scale.
FORBIDDEN = ("forbidden",)
STEP_KINDS: dict[tuple[str, str], tuple[str, ...]] = {
    (PARTIAL, REPLICATE): ("all_reduce",),
    (PARTIAL, SHARD): ("reduce_scatter",),
    (PARTIAL, STRIDED): ("all_reduce", "local_copy"),
    (PARTIAL, PARTIAL): FORBIDDEN,
    (SHARD, REPLICATE): ("all_gather",),
    (SHARD, SHARD): ("all_to_all",),
    (SHARD, STRIDED): ("all_gather", "local_copy"),
    (SHARD, PARTIAL): FORBIDDEN,
    (STRIDED, REPLICATE): ("all_gather", "local_copy"),
    (STRIDED, SHARD): ("all_gather", "local_copy"),
    (STRIDED, STRIDED): ("all_gather", "local_copy"),
    (STRIDED, PARTIAL): FORBIDDEN,
    (REPLICATE, SHARD): ("local_copy",),
    (REPLICATE, STRIDED): ("local_copy",),
    (REPLICATE, PARTIAL): ("local_copy",),
}


def kinds_between(
    src_kind: str, dst_kind: str, src_dim: int | None = None, dst_dim: int | None = None
) -> tuple[str, ...]:
    """What a step between two *different* placements of these kind letters
    runs (``src_dim`` / ``dst_dim``: the tensor dim of a plain Shard), with
    the local copies apply runs around the collective: a gather along a
    non-leading tensor dim concatenates the gathered chunks (``local_copy``
    of the result), a reduce-scatter along one stacks its input's chunks
    first (``pre_copy`` of the input), and an all-to-all stages its input
    when the new shard dim is not the leading one and regroups its output
    when the old one is not (:func:`autoparallel.apply.redistribute.shard_to_shard`)."""
    kinds = STEP_KINDS.get((src_kind, dst_kind), FORBIDDEN)
    if kinds == ("all_gather",) and src_dim:
        return ("all_gather", "local_copy")
    if kinds == ("reduce_scatter",) and dst_dim:
        return ("pre_copy", "reduce_scatter")
    if kinds == ("all_to_all",):
        return (("pre_copy",) if dst_dim else ()) + kinds + (("local_copy",) if src_dim else ())
    return kinds


def step_kinds(a: Placement, b: Placement) -> tuple[str, ...]:
    """What the step ``a -> b`` runs on its mesh dim (nothing when equal)."""
    if a == b:
        return ()
    return kinds_between(kind(a), kind(b), shard_dim(a), shard_dim(b))


# Shard divisors of a layout: (tensor dim, mesh dim size) per sharded mesh
# dim, outer to inner: all a local shape needs.
Divisors = tuple[tuple[int, int], ...]


def shard_divisors(mesh_shape: Sequence[int], placements: Sequence[Placement]) -> Divisors:
    """The shard divisors of ``placements`` (plain and strided shards)."""
    return tuple((p.dim, n) for n, p in zip(mesh_shape, placements) if kind(p) in (SHARD, STRIDED))


def local_bytes(shape: tuple[int, ...], divs: Divisors, itemsize: int) -> int:
    """Bytes of rank 0's local shard (the largest: ceil divisions)."""
    if not divs:
        return math.prod(shape) * itemsize
    local = list(shape)
    for d, n in divs:
        d %= len(local)
        local[d] = -(-local[d] // n)  # ceil: rank 0 holds the largest shard
    return math.prod(local) * itemsize


def step_time(t: MeshDimTopology, kinds: tuple[str, ...], cur_bytes: int, new_bytes: int, device: DeviceSpec) -> float:
    """Seconds of one step on a mesh dim of topology ``t`` that turns
    ``cur_bytes`` of local shard into ``new_bytes`` through ``kinds``: the
    one body every form of the cost model calls, so their figures are
    bit-identical."""
    time = 0.0
    if t.group_size > 1:
        for kind_ in kinds:
            if kind_ == "forbidden":
                time = math.inf
            elif kind_ == "local_copy":
                time += local_copy_time(new_bytes, device)
            elif kind_ == "pre_copy":
                time += local_copy_time(cur_bytes, device)
            else:
                time += collective_time(kind_, cur_bytes, t.group_size, t.intra_node, device, t.ranks_per_node)
    return time
