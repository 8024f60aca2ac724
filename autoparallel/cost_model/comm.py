"""What a redistribution costs and which steps it takes: the reference.

A redistribution turns a tensor laid out as ``src`` (a DTensorSpec: one
placement per mesh dim) into ``dst`` on the same mesh. This module is the
one place that decides its steps and sums their costs; everything else
that prices a redistribution is a faster form of it, tested equal to it.

**Encoding.** A placement is read through
:mod:`autoparallel.cost_model.placement_codes`: its kind letter (``R``
Replicate, ``P`` Partial, ``S`` Shard, ``X`` strided shard), a hashable key,
or (plain placements) a small int per mesh dim for the vectorised forms.

**Steps.** A step changes one mesh dim; what it runs (all-gather,
reduce-scatter, all-reduce, all-to-all, local copy, or forbidden) comes
from the pair's kind letters (:data:`autoparallel.cost_model.steps.STEP_KINDS`),
its seconds from :func:`autoparallel.cost_model.steps.step_time` (ring model
per mesh dim, local bytes tracked step by step). Which steps:

1. DTensor's own plan (:func:`dtensor_plan`): its greedy planner
   (:func:`greedy_steps`, rebuilt on placements and tested step for step
   against torch) for plain shards in default order; strided shards
   gathered first (:func:`strided_steps`); DTensor's graph planner for the
   tp-outer layout and explicit shard orders.
2. The min-cost plan (:mod:`autoparallel.cost_model.redistribute_plan`, a
   shortest path over layout states with the same step costs), taken only
   where it applies and is strictly cheaper than 1.

:func:`redistribute_steps` lists the chosen steps (what apply runs),
:func:`redistribute_time` sums them from 0 in order, and
:func:`edge_time` is what the planning problem counts for the move (the
overlap discount, bucket copies, the transition tiebreak, a kept Partial).

**Fast forms.** The ILP needs millions of these figures on 3-D and 4-D
meshes. :mod:`autoparallel.cost_model.class_costs` computes whole grids
(every source x target layout of one tensor) with numpy: the greedy plan
vectorised over pairs, the min-cost distances from
:func:`redistribute_plan.improve_grid`. It shares the encoding, the step
table, :func:`~autoparallel.cost_model.steps.local_bytes` and
:func:`~autoparallel.cost_model.steps.step_time` (called on the distinct
values present) with this module, and sums steps in the same order, so its
entries are bit-identical to :func:`redistribute_time` (and its edge grids
to :func:`edge_time`); property tests check that on random layouts over 1-D
to 4-D meshes (``tests/autoparallel/cost_model/test_forms_agree.py``), and
on every pair the LLaMA-3 and MoE planning problems price
(``tests/autoparallel/cost_model/test_forms_agree_on_problems.py``).

**Who asks.** The planning problem's edges
(:mod:`autoparallel.problem.edge_matrices`: whole grids from
:mod:`~autoparallel.cost_model.class_costs`, a tp-outer parameter's
gradient rows from :func:`edge_time`), apply (:func:`min_cost_plan`: the
steps it runs) and the benchmarks' breakdowns. Collectives that are not a
redistribution (an op's own all-to-all, the applied graph's collectives the
overlap scheduler orders) are priced with the same
:func:`~autoparallel.cost_model.steps.collective_time`.

**Caches** (step plans per placements, costs per spec pair, state graphs)
are registered with :mod:`autoparallel.cost_model.caches`;
``cost_model.clear_caches()`` clears them all.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

from . import redistribute_plan
from .caches import register
from .compute import mesh_shape as _mesh_shape_of
from .bucket_copies import bucket_copy_time
from .devices import H100, DeviceSpec
from .overlap import CommOverlapPolicy, HiddenComm, apply_discount, counted_device
from .placement_codes import REPLICATE, SHARD, STRIDED, kind, partial_mask, shard_dim
from .steps import (  # noqa: F401  (collective_time, MeshDimTopology, mesh_dim_topology: public here too)
    Divisors,
    MeshDimTopology,
    collective_time,
    local_bytes,
    mesh_dim_topology,
    shard_divisors,
    step_kinds,
    step_time,
)

logger = logging.getLogger(__name__)

# Added by :func:`edge_time` to every non-identical transition so that, when costs
# tie (e.g. a free Replicate -> Shard slice), the ILP prefers fewer
# redistributions. 0.1 us: far below any real collective (>= ~5 us) and below
# the launch floor, so it only ever breaks ties.
TRANSITION_TIEBREAK = 1e-7


@dataclass(frozen=True)
class CommStep:
    """One step of a redistribution on one mesh dim."""

    mesh_dim: int
    src: Placement
    dst: Placement
    kind: str  # a collective, "local_copy", or "forbidden"
    bytes_per_rank: int  # local bytes before the step
    time: float


def greedy_steps(
    mesh_shape: tuple[int, ...],
    src: Sequence[Any],
    dst: Sequence[Any],
    letter: Callable[[Any], str] = kind,
    shard_dim: Callable[[Any], int | None] = shard_dim,
    replicate: Any = None,
) -> list[tuple[int, Any, Any]]:
    """DTensor's greedy redistribution planner
    (``DTensorRedistributePlanner.generate_greedy_transform_infos``) for
    default shard order: steps ``(mesh dim, from, to)``. Much faster than
    building specs and asking torch, and tested step for step against it.

    First, inner to outer mesh dims, a Shard target whose tensor dim is
    sharded differently on the outer mesh dims goes to Replicate (nested
    sharding must be undone from the inside); then, outer to inner, every
    mesh dim still off target moves to it.

    ``src`` and ``dst`` hold placements, or any encoding of them whose
    ``!=`` is the placements' (``letter`` gives the kind letter,
    ``shard_dim`` a plain Shard's tensor dim, ``replicate`` the encoded
    ``Replicate()``).
    """
    if replicate is None:
        replicate = Replicate()
    if len(mesh_shape) == 1:
        return [(0, src[0], dst[0])] if src[0] != dst[0] else []
    cur_dims = [shard_dim(p) for p in src]
    dst_dims = [shard_dim(p) for p in dst]
    current, steps = list(src), []
    if math.prod(n for n, p in zip(mesh_shape, src) if letter(p) in (SHARD, STRIDED)) > 1:  # src.num_shards
        for mesh_dim in reversed(range(len(current))):
            cur, tgt = current[mesh_dim], dst[mesh_dim]
            d = dst_dims[mesh_dim]
            if d is not None and [i for i in range(mesh_dim) if cur_dims[i] == d] != [
                i for i in range(mesh_dim) if dst_dims[i] == d
            ]:
                tgt = replicate
            if cur != tgt:
                steps.append((mesh_dim, cur, tgt))
                current[mesh_dim] = tgt
                cur_dims[mesh_dim] = shard_dim(tgt)
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


def strided_steps(
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
        if p != dst[d] and kind(p) == STRIDED:
            steps.append((d, p, Replicate()))
            current[d] = Replicate()
    return steps + greedy_steps(mesh_shape, tuple(current), dst)


def _via_replicate_steps(
    src: tuple[Placement, ...], dst: tuple[Placement, ...]
) -> list[tuple[int, Placement, Placement]]:
    """Upper bound: differing mesh dims go to Replicate (inner first), then
    to the target (outer first)."""
    steps = [
        (d, a, Replicate()) for d, (a, b) in reversed(list(enumerate(zip(src, dst)))) if a != b and kind(a) != REPLICATE
    ]
    steps += [(d, Replicate(), b) for d, (a, b) in enumerate(zip(src, dst)) if a != b and kind(b) != REPLICATE]
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
# placement, dst placement, kinds, shard divisors after the step).
Plan = tuple[Divisors, tuple[tuple[int, Placement, Placement, tuple[str, ...], Divisors], ...]]
_PLAN_CACHE: dict[tuple, Any] = register({})
_SHAPE_DEPENDENT = object()


def dtensor_plan(src: DTensorSpec, dst: DTensorSpec) -> Plan:
    """DTensor's steps from ``src`` to ``dst``, cached per placements.

    * Default shard order, plain Shards: DTensor's greedy planner, which
      looks at placements only (:func:`greedy_steps`).
    * The tp-outer parameter layout (:func:`tp_outer_placements`) on either
      side: DTensor's own plan (what apply runs: it reads the layout as
      Shards in tp-first order), cached per shape.
    * Any other _StridedShard: :func:`strided_steps`.
    * Explicit non-default shard order: DTensor's graph planner, which may
      look at the shape, so cached per shape.
    """
    mesh_shape = _mesh_shape_of(src.mesh)
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
    elif any(kind(p) == STRIDED for p in (*src.placements, *dst.placements)):
        raw = strided_steps(mesh_shape, src.placements, dst.placements)
    elif DTensorSpec.is_default_device_order(src.shard_order) and DTensorSpec.is_default_device_order(dst.shard_order):
        raw = greedy_steps(mesh_shape, src.placements, dst.placements)
    else:
        _PLAN_CACHE[base] = _SHAPE_DEPENDENT
        key = (base, src.mesh, tuple(src.tensor_meta.shape))
        raw = _transform_steps(src, dst)
    current, steps = list(src.placements), []
    for mesh_dim, a, b in raw:
        current[mesh_dim] = b
        steps.append((mesh_dim, a, b, step_kinds(a, b), shard_divisors(mesh_shape, current)))
    plan = _PLAN_CACHE[key] = (shard_divisors(mesh_shape, src.placements), tuple(steps))
    return plan


def dtensor_plan_steps(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec = H100):
    """Yield DTensor's plan's (mesh_dim, src placement, dst placement,
    kinds, bytes before, seconds), bytes tracked step by step."""
    meta = src.tensor_meta
    if meta is None:
        raise ValueError("redistribute cost needs src.tensor_meta (global shape and dtype)")
    src_divs, plan = dtensor_plan(src, dst)
    if not plan:
        return
    topo = mesh_dim_topology(src.mesh, device.gpus_per_node)
    shape = tuple(meta.shape)
    itemsize = meta.dtype.itemsize
    cur_bytes = local_bytes(shape, src_divs, itemsize)
    for mesh_dim, a, b, kinds, divs in plan:
        new_bytes = local_bytes(shape, divs, itemsize)
        yield mesh_dim, a, b, kinds, cur_bytes, step_time(topo[mesh_dim], kinds, cur_bytes, new_bytes, device)
        cur_bytes = new_bytes


def total_time(steps) -> float:
    """The seconds of a plan: its step times summed from 0 in order (every
    form sums this way, so totals round alike)."""
    return sum(step[-1] for step in steps)


def _costed_steps(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec) -> list[tuple]:
    """(mesh_dim, src placement, dst placement, kinds, bytes before, time)
    per step: the min-cost plan where it applies and is strictly cheaper
    than DTensor's plan, else DTensor's plan."""
    steps = list(dtensor_plan_steps(src, dst, device))
    if steps:
        cheaper = redistribute_plan.min_cost_steps(src, dst, device, total_time(steps))
        if cheaper is not None:
            return cheaper
    return steps


def min_cost_plan(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec = H100) -> list[tuple] | None:
    """The min-cost plan's steps (mesh_dim, src placement, dst placement,
    kinds, bytes before, time) when the cost model prices it (it applies and
    is strictly cheaper than DTensor's plan); None when it prices DTensor's
    own plan (what apply then runs)."""
    if src.tensor_meta is None or (src.mesh is not dst.mesh and src.mesh != dst.mesh):
        return None
    steps = list(dtensor_plan_steps(src, dst, device))
    if not steps:
        return None
    return redistribute_plan.min_cost_steps(src, dst, device, total_time(steps))


def redistribute_steps(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec = H100) -> list[CommStep]:
    """The steps that turn ``src`` into ``dst`` (what apply runs), each costed.

    Local bytes are tracked step by step (rank 0, the largest shard): an
    all-gather grows them by the group size, a reduce-scatter shrinks them.
    """
    return [
        CommStep(mesh_dim, a, b, "+".join(kinds) or "noop", nbytes, time)
        for mesh_dim, a, b, kinds, nbytes, time in _costed_steps(src, dst, device)
    ]


_REDISTRIBUTE_CACHE: dict[tuple, float] = register({})


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
    cost = _REDISTRIBUTE_CACHE[key] = total_time(_costed_steps(src, dst, device))
    return cost


def edge_time(
    src: DTensorSpec,
    dst: DTensorSpec,
    device: DeviceSpec,
    overlap: CommOverlapPolicy,
    kind: str | HiddenComm | None = None,
    keep_partial: bool = False,
) -> float:
    """What an edge of the planning problem counts for moving ``src`` to
    ``dst``: :func:`redistribute_time` on the device the overlap policy
    counts for ``kind`` (:func:`~autoparallel.cost_model.counted_device`),
    less its hidden share (:func:`~autoparallel.cost_model.apply_discount`),
    plus the copies of a bucketed parameter gather or gradient reduction
    (:mod:`~autoparallel.cost_model.bucket_copies`), plus the transition
    tiebreak when something moves; the tiebreak alone for a free move between
    different placements; ``inf`` where ``keep_partial`` and a Partial mesh
    dim of ``src`` would be reduced. ``device`` carries the share of local
    copies the edge counts (:func:`~autoparallel.cost_model.copies_device`).

    The scalar reference of :func:`autoparallel.cost_model.class_costs.class_cost_grid`
    (the edge matrices' whole grids), equal to it bit for bit."""
    if keep_partial and partial_mask(src.placements) & ~partial_mask(dst.placements):
        return math.inf
    t = redistribute_time(src, dst, counted_device(device, overlap, kind))
    if t != 0.0 and math.isfinite(t):
        if kind is not None:
            t = apply_discount(t, kind, overlap)
            t += bucket_copy_time(src, dst, kind, device)
        t += TRANSITION_TIEBREAK
    elif t == 0.0 and src.placements != dst.placements:
        t = TRANSITION_TIEBREAK
    return t
