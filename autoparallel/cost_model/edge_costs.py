"""Redistribution cost matrices, fast: every entry equal to
:func:`autoparallel.cost_model.redistribute_time`.

On a 3-D mesh one edge matrix has ~45K distinct (source, target) placement
pairs (~1.6M on 4-D); asking ``redistribute_time`` pair by pair spends most
of its ~10 us in hashing DTensorSpecs and Placements and in walking the step
plan. Here, per matrix:

* placements tuples are interned to small ints once per spec (not per pair);
* DTensor's greedy step plan (:func:`comm._plan`, which looks at placements
  only for default shard orders and plain Shards) is rebuilt on small tuples
  (:func:`_greedy_plan`) and cached per int pair;
* a step's time depends on (mesh dim, kinds, local bytes before and after):
  cached per those values, and local bytes per shard divisors, for the
  tensor's shape;
* the min-cost plan's time (:func:`redistribute_plan.min_cost_total`, its
  distances cached per source layout) replaces the greedy one where it
  applies and is strictly cheaper, as in ``comm._costed_steps``;

The arithmetic is the one of ``comm._costed_steps`` (same operations, same
order), so entries are bit-identical; pairs outside the fast path (strided
shards, non-default shard orders, specs without tensor metadata, different
meshes) go to ``redistribute_time`` itself.
"""

from __future__ import annotations

import math
from typing import Sequence

from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from . import comm, redistribute_plan
from .devices import DeviceSpec

_INTERN: dict[tuple, int] = {}
_CODES: list[tuple] = []  # interned id -> per-mesh-dim codes
# (mesh shape, src id, dst id) -> comm._plan's result
_PLANS: dict[tuple, tuple] = {}
# (mesh, device) -> {(mesh dim, kinds, bytes before, bytes after): seconds}
_STEPS: dict[tuple, dict[tuple, float]] = {}
# interned shard divisors (tensor dim, mesh size) of a layout, and the id
# per (mesh shape, layout codes)
_DIV_IDS: dict[tuple, int] = {}
_DIV_OF_CODES: dict[tuple, int] = {}
_DIVS: list[tuple] = []


def clear_caches() -> None:
    _INTERN.clear()
    _CODES.clear()
    _PLANS.clear()
    _STEPS.clear()
    _DIV_IDS.clear()
    _DIV_OF_CODES.clear()
    _DIVS.clear()


def _fast_id(spec: DTensorSpec) -> int | None:
    """Interned id of the spec's placements, or None when the spec needs
    DTensor's own planner (strided shards, explicit shard order, no meta)."""
    if spec.tensor_meta is None:
        return None
    i = _INTERN.get(spec.placements)
    if i is None:
        # exact types: Partial subclasses (masked, norm) compare differently
        # (Partial() == _MaskPartial() but not the other way round)
        if any(type(p) not in _PLAIN for p in spec.placements):
            return None
        i = _INTERN[spec.placements] = len(_INTERN)
        _CODES.append(tuple(_code(p) for p in spec.placements))
    if not DTensorSpec.is_default_device_order(spec.shard_order):
        return None
    return i


def _code(p) -> tuple:
    """A plain placement as a tuple that is equal exactly when placements are."""
    t = type(p)
    if t is Shard:
        return ("S", p.dim)
    if t is Partial:
        return ("P", p.reduce_op)
    return ("R",)


_PLAIN = (Replicate, Shard, Partial)
_STEP_KINDS = comm._STEP_KINDS


def _greedy_plan(mesh_shape: tuple[int, ...], src: tuple, dst: tuple) -> tuple:
    """:func:`comm._plan` for plain placements (as :func:`_code` tuples) in
    default shard order: :func:`comm._greedy_steps`, then per step its kinds
    and the shard divisors after it. Checked against ``comm._plan`` in
    tests/autoparallel/test_option_pruning.py."""
    n = len(mesh_shape)
    steps = []
    current = list(src)
    if n == 1:
        raw = [(0, src[0], dst[0])] if src[0] != dst[0] else []
    else:
        raw = []
        cur_dims = [c[1] if c[0] == "S" else None for c in src]
        dst_dims = [c[1] if c[0] == "S" else None for c in dst]
        if math.prod(m for m, c in zip(mesh_shape, src) if c[0] == "S") > 1:
            for mesh_dim in reversed(range(n)):
                cur, tgt = current[mesh_dim], dst[mesh_dim]
                d = dst_dims[mesh_dim]
                if d is not None and [i for i in range(mesh_dim) if cur_dims[i] == d] != [
                    i for i in range(mesh_dim) if dst_dims[i] == d
                ]:
                    tgt = ("R",)
                if cur != tgt:
                    raw.append((mesh_dim, cur, tgt))
                    current[mesh_dim] = tgt
                    cur_dims[mesh_dim] = tgt[1] if tgt[0] == "S" else None
        for mesh_dim, (cur, tgt) in enumerate(zip(current, dst)):
            if cur != tgt:
                raw.append((mesh_dim, cur, tgt))
                current[mesh_dim] = tgt
    current = list(src)
    for mesh_dim, a, b in raw:
        current[mesh_dim] = b
        kinds = _STEP_KINDS.get((a[0], b[0]), ("forbidden",)) if a != b else ()
        steps.append((mesh_dim, kinds, _divisors_id(mesh_shape, current)))
    return _divisors_id(mesh_shape, src), tuple(steps)


def _divisors(mesh_shape, codes) -> tuple:
    return tuple((c[1], m) for m, c in zip(mesh_shape, codes) if c[0] == "S")


def _divisors_id(mesh_shape, codes) -> int:
    """:func:`_divisors`, interned to a small int (``_DIVS[id]`` gives it
    back): pair costing looks local bytes up per step, and an int hashes
    faster than a tuple of tuples."""
    key = (mesh_shape, tuple(codes))
    i = _DIV_OF_CODES.get(key)
    if i is None:
        divs = _divisors(mesh_shape, codes)
        i = _DIV_IDS.get(divs)
        if i is None:
            i = _DIV_IDS[divs] = len(_DIVS)
            _DIVS.append(divs)
        _DIV_OF_CODES[key] = i
    return i


step_time = comm.step_time  # one step's seconds (shared with the scalar path)


def step_times(mesh, device: DeviceSpec) -> dict[tuple, float]:
    """The cache of :func:`step_time` per (mesh dim, kinds, bytes before,
    bytes after), shared by every matrix on ``mesh`` and ``device``."""
    return _STEPS.setdefault((mesh, device), {})


def redistribution_matrix(
    src_specs: Sequence[DTensorSpec],
    dst_specs: Sequence[DTensorSpec],
    device: DeviceSpec,
    pair_cache: dict | None = None,
) -> list[list[float]]:
    """``[[redistribute_time(s, d, device) for d in dst_specs] for s in src_specs]``.

    ``pair_cache``: a dict kept by the caller across matrices (one problem
    build): pair times per tensor shape, so that matrices over tensors of
    one shape (a layer's activations) share their common pairs."""
    if not src_specs or not dst_specs:
        return [[] for _ in src_specs]
    mesh = src_specs[0].mesh
    src_ids = [_fast_id(s) if (s.mesh is mesh or s.mesh == mesh) else None for s in src_specs]
    dst_ids = [_fast_id(d) if (d.mesh is mesh or d.mesh == mesh) else None for d in dst_specs]
    meta = next((s.tensor_meta for s, i in zip(src_specs, src_ids) if i is not None), None)
    if meta is None or any(s.tensor_meta != meta for s, i in zip(src_specs, src_ids) if i is not None):
        # mixed tensor metas (never from one producer): pair by pair
        return [[comm.redistribute_time(s, d, device) for d in dst_specs] for s in src_specs]
    mesh_shape = comm._mesh_shape(mesh)
    shape = tuple(meta.shape)
    itemsize = meta.dtype.itemsize
    topo = comm._mesh_dim_topology(mesh, device.gpus_per_node)
    steps = step_times(mesh, device)
    pairs = (pair_cache if pair_cache is not None else {}).setdefault((shape, itemsize, mesh, device), {})
    nbytes: dict[int, int] = {}

    def local_bytes(div_id: int) -> int:
        b = nbytes.get(div_id)
        if b is None:
            b = nbytes[div_id] = comm._local_bytes(shape, _DIVS[div_id], itemsize)
        return b

    def pair_time(s: DTensorSpec, d: DTensorSpec, si: int, di: int) -> float:
        key = (mesh_shape, si, di)
        plan = _PLANS.get(key)
        if plan is None:
            plan = _PLANS[key] = _greedy_plan(mesh_shape, _CODES[si], _CODES[di])
        src_divs, plan_steps = plan
        total = 0  # as sum() in redistribute_time
        if not plan_steps:
            return total
        cur_bytes = local_bytes(src_divs)
        for mesh_dim, kinds, div_id in plan_steps:
            new_bytes = local_bytes(div_id)
            skey = (mesh_dim, kinds, cur_bytes, new_bytes)
            time = steps.get(skey)
            if time is None:
                time = steps[skey] = step_time(topo[mesh_dim], kinds, cur_bytes, new_bytes, device)
            total += time
            cur_bytes = new_bytes
        # the min-cost plan where it covers the pair and is cheaper (as comm._costed_steps)
        cheaper = redistribute_plan.min_cost_total(s, d, device)
        if cheaper is not None and cheaper[0] < total:
            return cheaper[0]
        return total

    # the min-cost distances of every new source at once (pair_time reads them)
    fresh = [s.placements for s, si in zip(src_specs, src_ids) if si is not None and si not in pairs]
    redistribute_plan.prefetch(mesh, shape, itemsize, device, fresh)
    rows = []
    for s, si in zip(src_specs, src_ids):
        if si is None:
            rows.append([comm.redistribute_time(s, d, device) for d in dst_specs])
            continue
        known = pairs.get(si)  # per source: destination id -> seconds
        if known is None:
            known = pairs[si] = {}
        row = []
        for d, di in zip(dst_specs, dst_ids):
            if di is None:
                row.append(comm.redistribute_time(s, d, device))
                continue
            t = known.get(di)
            if t is None:
                t = known[di] = pair_time(s, d, si, di)
            row.append(t)
        rows.append(row)
    return rows
