"""Communication cost: the steps of a redistribution, each costed with a
ring model per mesh dim (intra- or inter-node). The steps are the min-cost
plan (:mod:`.redistribute_plan`) where it applies and beats DTensor's greedy
plan (:func:`_plan`), else the greedy plan; apply runs the same steps."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

from ..torch_compat import is_shard_like as _is_shard_like

from .compute import _mesh_shape
from .devices import H100, DeviceSpec

logger = logging.getLogger(__name__)

# Added by the caller to every non-identical transition so that, when costs
# tie (e.g. a free Replicate -> Shard slice), the ILP prefers fewer
# redistributions. 0.1 us: far below any real collective (>= ~5 us) and below
# the launch floor, so it only ever breaks ties.
TRANSITION_TIEBREAK = 1e-7


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
    node) and dim 1 intra-node.
    """
    return _mesh_dim_topology(mesh, gpus_per_node)


@lru_cache(maxsize=None)
def _mesh_dim_topology(mesh: Any, gpus_per_node: int) -> tuple[MeshDimTopology, ...]:
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


_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


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
    else:
        bw = min(device.intra_node_bw, max(ranks_per_node, 1) * device.inter_node_bw)
        lat = device.inter_node_latency
    bw *= device.comm_efficiency
    if kind == "all_gather":
        return device.launch_floor + (n - 1) * lat + (n - 1) * bytes_per_rank / bw
    if kind == "reduce_scatter":
        return device.launch_floor + (n - 1) * lat + (n - 1) / n * bytes_per_rank / bw
    if kind == "all_reduce":
        return device.launch_floor + 2 * ((n - 1) * lat + (n - 1) / n * bytes_per_rank / bw)
    if kind == "all_to_all":
        return device.launch_floor + lat + (n - 1) / n * bytes_per_rank / bw
    raise ValueError(f"unknown collective {kind!r}; expected one of {_COLLECTIVES}")


def _local_copy_time(out_bytes: float, device: DeviceSpec) -> float:
    # Slicing a shard out of a replica (clone) or zeroing for Partial: read +
    # write of the result. No launch floor: it is kept tiny on purpose, so
    # that a free-ish local reshard never looks like a collective.
    return 2 * out_bytes / (device.hbm_bw * device.memory_efficiency)


@dataclass(frozen=True)
class CommStep:
    """One step of a redistribution on one mesh dim."""

    mesh_dim: int
    src: Placement
    dst: Placement
    kind: str  # a collective, "local_copy", or "forbidden"
    bytes_per_rank: int  # local bytes before the step
    time: float


def _kind(p: Placement) -> str:
    """Placement kind: "R" replicate, "P" partial, "S" plain shard, "X"
    strided shard. Exact type checks first: isinstance on the C++-backed
    placements is slow."""
    t = type(p)
    if t is Replicate:
        return "R"
    if t is Shard:
        return "S"
    if t is Partial:
        return "P"
    if t is _StridedShard:
        return "X"
    if p.is_partial():
        return "P"
    if p.is_replicate():
        return "R"
    if _is_shard_like(p):
        return "S" if p.is_shard() else "X"
    return "?"


# What DTensor's ``redistribute_local_tensor`` runs for one mesh dim, by
# (src kind, dst kind) of two different placements. Strided shards go
# through Replicate; Shard -> Partial and Partial(op1) -> Partial(op2) are
# unsupported. Replicate -> anything is a local slice or scale.
_STEP_KINDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("P", "R"): ("all_reduce",),
    ("P", "S"): ("reduce_scatter",),
    ("P", "X"): ("all_reduce", "local_copy"),
    ("P", "P"): ("forbidden",),
    ("S", "R"): ("all_gather",),
    ("S", "S"): ("all_to_all",),
    ("S", "X"): ("all_gather", "local_copy"),
    ("S", "P"): ("forbidden",),
    ("X", "R"): ("all_gather", "local_copy"),
    ("X", "S"): ("all_gather", "local_copy"),
    ("X", "X"): ("all_gather", "local_copy"),
    ("X", "P"): ("forbidden",),
    ("R", "S"): ("local_copy",),
    ("R", "X"): ("local_copy",),
    ("R", "P"): ("local_copy",),
}


def _step_kinds(a: Placement, b: Placement) -> tuple[str, ...]:
    if a == b:
        return ()
    return _STEP_KINDS.get((_kind(a), _kind(b)), ("forbidden",))


def _greedy_steps(
    mesh_shape: tuple[int, ...], src: tuple[Placement, ...], dst: tuple[Placement, ...]
) -> list[tuple[int, Placement, Placement]]:
    """DTensor's greedy redistribution planner
    (``DTensorRedistributePlanner.generate_greedy_transform_infos``) over
    placements alone, for default shard order and plain Shards; much faster
    than building specs and asking torch, and tested step for step against it.

    First, inner to outer mesh dims, a Shard target whose tensor dim is
    sharded differently on the outer mesh dims goes to Replicate (nested
    sharding must be undone from the inside); then, outer to inner, every
    mesh dim still off target moves to it.
    """
    if len(mesh_shape) == 1:
        return [(0, src[0], dst[0])] if src[0] != dst[0] else []
    # Tensor dim of each plain Shard (DTensor's is_shard(); not strided).
    cur_dims = [p.dim if _kind(p) == "S" else None for p in src]
    dst_dims = [p.dim if _kind(p) == "S" else None for p in dst]
    current, steps = list(src), []
    if math.prod(n for n, p in zip(mesh_shape, src) if _kind(p) in ("S", "X")) > 1:  # src.num_shards
        for mesh_dim in reversed(range(len(current))):
            cur, tgt = current[mesh_dim], dst[mesh_dim]
            d = dst_dims[mesh_dim]
            if d is not None and [i for i in range(mesh_dim) if cur_dims[i] == d] != [
                i for i in range(mesh_dim) if dst_dims[i] == d
            ]:
                tgt = Replicate()
            if cur != tgt:
                steps.append((mesh_dim, cur, tgt))
                current[mesh_dim] = tgt
                cur_dims[mesh_dim] = tgt.dim if _kind(tgt) == "S" else None
    for mesh_dim, (cur, tgt) in enumerate(zip(current, dst)):
        if cur != tgt:
            steps.append((mesh_dim, cur, tgt))
            current[mesh_dim] = tgt
    return steps


def tp_outer_placements(dim: int, mesh_shape: Sequence[int]) -> tuple[Placement, Placement]:
    """Tensor dim ``dim`` sharded over both dims of a 2-D mesh, the inner
    (tp) mesh dim outermost: rank ``(i, j)`` holds chunk ``j * dp + i``
    (FSDP2 + TP's layout, DTensor's "reverse shard order").

    Gathering it over dp is ONE all-gather that leaves the tp shard
    ``(R, S(dim))``; gathering it fully is a dp-then-tp chain.
    """
    return (_StridedShard(dim, split_factor=mesh_shape[1]), Shard(dim))


def is_tp_outer(placements: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    """``placements`` is :func:`tp_outer_placements` for some tensor dim."""
    if len(placements) != 2 or len(mesh_shape) != 2:
        return False
    a, b = placements
    return type(a) is _StridedShard and type(b) is Shard and a.dim == b.dim and a.split_factor == mesh_shape[1]


def _strided_steps(
    mesh_shape: tuple[int, ...], src: tuple[Placement, ...], dst: tuple[Placement, ...]
) -> list[tuple[int, Placement, Placement]]:
    """Plan with _StridedShard: DTensor has no direct strided collective, so
    source strided dims are gathered first (inner to outer), then the greedy
    plan runs from there (a strided target is sliced out of a replica).
    DTensor's graph planner costs ~ms a call here, and upstream
    ``redistribute_cost`` gives up with inf."""
    steps, current = [], list(src)
    for d in reversed(range(len(src))):
        p = src[d]
        if p != dst[d] and _kind(p) == "X":
            steps.append((d, p, Replicate()))
            current[d] = Replicate()
    return steps + _greedy_steps(mesh_shape, tuple(current), dst)


def _via_replicate_steps(
    src: tuple[Placement, ...], dst: tuple[Placement, ...]
) -> list[tuple[int, Placement, Placement]]:
    """Upper bound: differing mesh dims go to Replicate (inner first), then
    to the target (outer first)."""
    steps = [
        (d, a, Replicate()) for d, (a, b) in reversed(list(enumerate(zip(src, dst)))) if a != b and not a.is_replicate()
    ]
    steps += [(d, Replicate(), b) for d, (a, b) in enumerate(zip(src, dst)) if a != b and not b.is_replicate()]
    return steps


def _transform_steps(src: DTensorSpec, dst: DTensorSpec) -> list[tuple[int, Placement, Placement]]:
    """DTensor's own (graph-based) plan, for non-default shard orders."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

    try:
        infos = _gen_transform_infos_non_cached(src, dst)
        return [(i.mesh_dim, *i.src_dst_placements) for i in infos]
    except Exception as e:
        logger.debug("DTensor planner failed for %s -> %s (%s); costing via Replicate", src, dst, e)
        return _via_replicate_steps(src.placements, dst.placements)


# A plan: the shard divisors of the source, then per step (mesh_dim, src
# placement, dst placement, kinds, shard divisors after the step). Divisors
# are (tensor dim, mesh dim size) pairs: all a local shape needs.
_Divs = tuple[tuple[int, int], ...]
_Plan = tuple[_Divs, tuple[tuple[int, Placement, Placement, tuple[str, ...], _Divs], ...]]
_PLAN_CACHE: dict[tuple, Any] = {}
_SHAPE_DEPENDENT = object()


def _divisors(mesh_shape: tuple[int, ...], placements: Sequence[Placement]) -> _Divs:
    return tuple((p.dim, n) for n, p in zip(mesh_shape, placements) if _kind(p) in ("S", "X"))


def _local_bytes(shape: tuple[int, ...], divs: _Divs, itemsize: int) -> int:
    if not divs:
        return math.prod(shape) * itemsize
    local = list(shape)
    for d, n in divs:
        d %= len(local)
        local[d] = -(-local[d] // n)  # ceil: rank 0 holds the largest shard
    return math.prod(local) * itemsize


def _plan(src: DTensorSpec, dst: DTensorSpec) -> _Plan:
    """The redistribution steps, cached per placements.

    * Default shard order, plain Shards: DTensor's greedy planner, which
      looks at placements only (reimplemented in :func:`_greedy_steps`).
    * The tp-outer parameter layout (:func:`tp_outer_placements`) on either
      side: DTensor's own plan (what apply runs: it reads the layout as
      Shards in tp-first order), cached per shape.
    * Any other _StridedShard: :func:`_strided_steps`.
    * Explicit non-default shard order: DTensor's graph planner, which may
      look at the shape, so cached per shape.
    """
    mesh_shape = _mesh_shape(src.mesh)
    base = key = (mesh_shape, src.placements, src.shard_order, dst.placements, dst.shard_order)
    plan = _PLAN_CACHE.get(base)
    if plan is _SHAPE_DEPENDENT:
        key = (base, src.mesh, tuple(src.tensor_meta.shape))
        plan = _PLAN_CACHE.get(key)
    if plan is not None:
        return plan
    if is_tp_outer(src.placements, mesh_shape) or is_tp_outer(dst.placements, mesh_shape):
        _PLAN_CACHE[base] = _SHAPE_DEPENDENT
        key = (base, src.mesh, tuple(src.tensor_meta.shape))
        raw = _transform_steps(src, dst)
    elif any(_kind(p) == "X" for p in (*src.placements, *dst.placements)):
        raw = _strided_steps(mesh_shape, src.placements, dst.placements)
    elif DTensorSpec.is_default_device_order(src.shard_order) and DTensorSpec.is_default_device_order(dst.shard_order):
        raw = _greedy_steps(mesh_shape, src.placements, dst.placements)
    else:
        _PLAN_CACHE[base] = _SHAPE_DEPENDENT
        key = (base, src.mesh, tuple(src.tensor_meta.shape))
        raw = _transform_steps(src, dst)
    current, steps = list(src.placements), []
    for mesh_dim, a, b in raw:
        current[mesh_dim] = b
        steps.append((mesh_dim, a, b, _step_kinds(a, b), _divisors(mesh_shape, current)))
    plan = _PLAN_CACHE[key] = (_divisors(mesh_shape, src.placements), tuple(steps))
    return plan


def _costed_steps(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec) -> list[tuple]:
    """(mesh_dim, src placement, dst placement, kinds, bytes before, time)
    per step: the min-cost plan (:mod:`.redistribute_plan`) where it
    applies and is strictly cheaper than today's plan (:func:`_plan`),
    else today's plan."""
    steps = list(_planned_steps(src, dst, device))
    if steps:
        cheaper = _min_cost_steps(src, dst, device, sum(step[-1] for step in steps))
        if cheaper is not None:
            return cheaper
    return steps


def _min_cost_steps(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec, planned_total: float):
    from . import redistribute_plan

    return redistribute_plan.min_cost_steps(src, dst, device, planned_total)


def min_cost_plan(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec = H100) -> list[tuple] | None:
    """The min-cost plan's steps (mesh_dim, src placement, dst placement,
    kinds, bytes before, time) when the cost model prices it (it applies and
    is strictly cheaper than today's plan); None when it prices today's
    plan, DTensor's own (what apply then runs)."""
    if src.tensor_meta is None or (src.mesh is not dst.mesh and src.mesh != dst.mesh):
        return None
    steps = list(_planned_steps(src, dst, device))
    if not steps:
        return None
    return _min_cost_steps(src, dst, device, sum(step[-1] for step in steps))


def _planned_steps(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec):
    """Yield today's plan's (mesh_dim, src placement, dst placement, kinds,
    bytes before, time)."""
    meta = src.tensor_meta
    if meta is None:
        raise ValueError("redistribute cost needs src.tensor_meta (global shape and dtype)")
    src_divs, plan = _plan(src, dst)
    if not plan:
        return
    topo = _mesh_dim_topology(src.mesh, device.gpus_per_node)
    shape = tuple(meta.shape)
    itemsize = meta.dtype.itemsize
    cur_bytes = _local_bytes(shape, src_divs, itemsize)
    for mesh_dim, a, b, kinds, divs in plan:
        new_bytes = _local_bytes(shape, divs, itemsize)
        yield mesh_dim, a, b, kinds, cur_bytes, step_time(topo[mesh_dim], kinds, cur_bytes, new_bytes, device)
        cur_bytes = new_bytes


def step_time(t: MeshDimTopology, kinds: tuple[str, ...], cur_bytes: int, new_bytes: int, device: DeviceSpec) -> float:
    """Seconds of one plan step on a mesh dim of topology ``t`` that turns
    ``cur_bytes`` of local shard into ``new_bytes`` through ``kinds`` (the
    one body the scalar, per-matrix and vectorised costs share, so their
    figures are bit-identical)."""
    time = 0.0
    if t.group_size > 1:
        for kind in kinds:
            if kind == "forbidden":
                time = math.inf
            elif kind == "local_copy":
                time += _local_copy_time(new_bytes, device)
            else:
                time += collective_time(kind, cur_bytes, t.group_size, t.intra_node, device, t.ranks_per_node)
    return time


def redistribute_steps(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec = H100) -> list[CommStep]:
    """The steps that turn ``src`` into ``dst`` (what apply runs), each costed.

    Local bytes are tracked step by step (rank 0, the largest shard): an
    all-gather grows them by the group size, a reduce-scatter shrinks them.
    """
    return [
        CommStep(mesh_dim, a, b, "+".join(kinds) or "noop", nbytes, time)
        for mesh_dim, a, b, kinds, nbytes, time in _costed_steps(src, dst, device)
    ]


_REDISTRIBUTE_CACHE: dict[tuple, float] = {}


def redistribute_time(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec = H100) -> float:
    """Seconds to redistribute a tensor from ``src`` to ``dst`` (same tensor,
    same mesh): the sum of :func:`redistribute_steps`. 0 for identical
    layouts, ``inf`` for Shard -> Partial, mixed Partial ops, or different
    meshes. Cached per (src, dst, device); the step plan per placements.
    """
    if src.tensor_meta is None:
        raise ValueError("redistribute cost needs src.tensor_meta (global shape and dtype)")
    key = (src, dst, device)  # DTensorSpec caches its hash; equal specs share entries
    try:
        return _REDISTRIBUTE_CACHE[key]
    except KeyError:
        pass
    if src.mesh is not dst.mesh and src.mesh != dst.mesh:
        return math.inf  # cross-mesh moves are not DTensor redistributions
    cost = _REDISTRIBUTE_CACHE[key] = sum(step[-1] for step in _costed_steps(src, dst, device))
    return cost
