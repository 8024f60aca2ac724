"""Whole class grids of redistribution costs, vectorised with numpy.

A class grid holds the cost of every (distinct source placements, distinct
target placements) pair of one tensor: on LLaMA-3 70B over 4x4x8x8 up to
1218 x 1218 entries, 18M over a 2-layer problem. :func:`redistribution_grid`
computes the raw times of a grid at once, equal bit for bit to
:func:`autoparallel.cost_model.redistribute_time`, the reference
(:mod:`autoparallel.cost_model.comm`); :func:`class_cost_grid` adds what an edge matrix counts on top
(keep-partial masking, the overlap discount, the transition tiebreak), equal
bit for bit to :func:`autoparallel.cost_model.comm.edge_time`.

How, for placements of the types DTensor's greedy planner handles
(Replicate, Shard, Partial, and the masked / norm Partials of embeddings and
norms; default shard order, one tensor meta, one mesh):

* each distinct placement of the grid is an int; the planner's questions
  about two of them (``a != b``, the step kinds ``steps.step_kinds(a, b)``)
  are tables filled with the scalar code's own calls, so even the Partial
  subclasses' asymmetric equality is followed;
* DTensor's greedy plan (:func:`autoparallel.cost_model.comm.greedy_steps`)
  runs over all pairs together, with a Python loop over mesh dims only: an
  inner-to-outer pass (a Shard target whose tensor dim is sharded
  differently on outer mesh dims goes to Replicate first), then an
  outer-to-inner pass to the targets. Every (pass, mesh dim) is one step
  slot, present or not for each pair;
* the layout after each step is a state id (the sharded tensor dim per mesh
  dim, mixed radix), whose local bytes (``steps.local_bytes``, same ceil
  divisions in the same order) come from a table over all states;
* a step's time depends on (mesh dim, kinds, bytes before, bytes after): the
  distinct values present are computed with the scalar function
  (:func:`autoparallel.cost_model.steps.step_time`, cached) and looked up;
* a pair's time is the sum of its slots' times in plan order, an absent step
  adding 0.0 (x + 0.0 == x), so sums round as the scalar loop's do;
* then the min-cost plan (:func:`redistribute_plan.improve_grid`: shortest
  paths over layout states from all the grid's sources at once) replaces
  the greedy time where it covers the pair and is strictly cheaper, as
  the reference does pair by pair (same distances, bit for bit).

Other pairs (strided shards, tp-outer layouts, non-default shard orders,
other Partial subclasses, mixed metas) are asked of the reference pair by
pair (:func:`autoparallel.cost_model.redistribute_time`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _MaskPartial

from . import redistribute_plan
from .bucket_copies import bucket_copy_grid
from .caches import register
from .comm import TRANSITION_TIEBREAK, redistribute_time
from .compute import mesh_shape as _mesh_shape
from .devices import DeviceSpec
from .overlap import CommOverlapPolicy, HiddenComm, apply_discount, counted_device
from .placement_codes import partial_mask, shard_dim
from .steps import local_bytes, mesh_dim_topology, step_kinds, step_time

# Pairs per vectorised chunk (sources x targets): bounds the temporaries
# (about 30 arrays of this many entries) and keeps them in cache.
CHUNK_PAIRS = 1 << 17
# Largest step-time lookup table (step kinds x bytes before x bytes after)
# indexed directly; larger ones go through np.unique.
_LUT_LIMIT = 1 << 22

# Placement types planned here: DTensor's greedy planner (comm.dtensor_plan)
# looks at them through placement_codes.kind ("R", "S", "P") and their == / != only. The
# masked sum of an embedding and a norm's Partial are Partials to it; they
# compare asymmetrically with a plain Partial (Partial() == _MaskPartial()
# but not the other way round), so equality comes from tables filled with
# Python's own comparisons, in the planner's direction.
_PLANNED = (Replicate, Shard, Partial, _MaskPartial, _NormPartial)


def _planned(spec, mesh) -> bool:
    """``spec`` takes the vectorised path: placements of the types above,
    default shard order, a tensor meta, on ``mesh``."""
    return (
        spec.tensor_meta is not None
        and (spec.mesh is mesh or spec.mesh == mesh)
        and all(type(p) in _PLANNED for p in spec.placements)
        and DTensorSpec.is_default_device_order(spec.shard_order)
    )


@dataclass
class _Layouts:
    """Placements tuples as ints, shape (tuples, mesh dims)."""

    index: np.ndarray  # the placement's index in its _Vocabulary
    shard: np.ndarray  # 1 + index of the sharded tensor dim in _Vocabulary.dims; 0 when not a Shard

    def rows(self, r: slice) -> "_Layouts":
        return _Layouts(self.index[r], self.shard[r])


class _Vocabulary:
    """The distinct placements of one grid (by type and equality; Replicate
    first) and the relations the planner reads between them, as tables:
    ``ne[a, b]`` is ``a != b``, ``eq[a, b]`` is ``a is b or a == b`` (what a
    tuple comparison asks first), ``kinds[a, b]`` indexes ``step_kinds``,
    ``steps.step_kinds(a, b)``; ``shard[a]``: 1 + the index of its tensor dim
    in ``dims`` for a Shard, else 0."""

    def __init__(self, tuples: Sequence[tuple]):
        index: dict = {(Replicate, Replicate()): 0}
        for t in tuples:
            for p in t:
                index.setdefault((type(p), p), len(index))
        self.index = index
        objects = [p for _, p in index]
        self.dims: dict = {}
        for p in objects:
            if shard_dim(p) is not None:
                self.dims.setdefault(p.dim, len(self.dims))
        self.shard = np.array([0 if shard_dim(p) is None else 1 + self.dims[p.dim] for p in objects], dtype=np.int32)
        self.ne = np.array([[a != b for b in objects] for a in objects], dtype=bool)
        self.eq = np.array([[a is b or a == b for b in objects] for a in objects], dtype=bool)
        kinds: dict = {}
        self.kinds = np.array(
            [[kinds.setdefault(step_kinds(a, b), len(kinds)) for b in objects] for a in objects], dtype=np.int32
        )
        self.step_kinds = list(kinds)

    def pair(self, table: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``table[a, b]`` broadcast (a flat take: faster than 2-D fancy indexing)."""
        return table.ravel().take(a * len(table) + b)

    def layouts(self, tuples: Sequence[tuple]) -> _Layouts:
        n = len(tuples[0])
        index = np.array([[self.index[(type(p), p)] for p in t] for t in tuples], dtype=np.int32).reshape(-1, n)
        return _Layouts(index, self.shard[index])


class _StepLookup:
    """Step times of one grid by (mesh dim, step kinds, bytes before, bytes
    after), kinds and bytes as indices into the grid's distinct values."""

    def __init__(self, mesh, device: DeviceSpec, step_kinds: list[tuple[str, ...]], byte_values: list[int]):
        self._topo = mesh_dim_topology(mesh, device.gpus_per_node)
        self._device = device
        self._cache = _STEP_TIMES.setdefault((mesh, device), {})
        self._kinds = step_kinds
        self._bytes = byte_values
        self._size = len(step_kinds) * len(byte_values) ** 2
        self.absent = self._size  # key of "no step here": 0.0
        self._tables: dict[int, np.ndarray] = {}

    def key(self, present: np.ndarray, kinds: np.ndarray, before: np.ndarray, after: np.ndarray) -> np.ndarray:
        b = len(self._bytes)
        return np.where(present, (kinds * b + before) * b + after, self.absent)

    def _time(self, mesh_dim: int, key: int) -> float:
        b = len(self._bytes)
        kinds_id, rest = divmod(key, b * b)
        before, after = divmod(rest, b)
        kinds = self._kinds[kinds_id]
        cur, new = self._bytes[before], self._bytes[after]
        skey = (mesh_dim, kinds, cur, new)
        t = self._cache.get(skey)
        if t is None:
            t = self._cache[skey] = step_time(self._topo[mesh_dim], kinds, cur, new, self._device)
        return t

    def times(self, mesh_dim: int, keys: np.ndarray) -> np.ndarray:
        if self._size >= _LUT_LIMIT:
            uniq, inverse = np.unique(keys, return_inverse=True)
            values = [0.0 if k == self.absent else self._time(mesh_dim, int(k)) for k in uniq.tolist()]
            return np.asarray(values, dtype=np.float64)[inverse].reshape(keys.shape)
        table = self._tables.get(mesh_dim)
        if table is None:
            table = self._tables[mesh_dim] = np.full(self._size + 1, np.nan)
            table[self.absent] = 0.0
        times = table[keys]
        missing = np.isnan(times)
        if missing.any():  # NaN: not computed yet (no time is NaN)
            for k in np.unique(keys[missing]).tolist():
                table[k] = self._time(mesh_dim, k)
            times = table[keys]
        return times


# (mesh, device) -> {(mesh dim, kinds, bytes before, bytes after): seconds},
# shared by every grid on that mesh and device
_STEP_TIMES: dict[tuple, dict[tuple, float]] = register({})


def _pairwise(src_specs: Sequence, dst_specs: Sequence, device: DeviceSpec) -> list[list[float]]:
    return [[redistribute_time(s, d, device) for d in dst_specs] for s in src_specs]


def _plain_grid(mesh, device: DeviceSpec, meta, vocab: _Vocabulary, S: _Layouts, D: _Layouts) -> np.ndarray:
    """Raw redistribution times between planned placements of one tensor
    (``S`` sources x ``D`` targets, default shard order)."""
    mesh_shape = _mesh_shape(mesh)
    n = len(mesh_shape)
    shape, itemsize = tuple(meta.shape), meta.dtype.itemsize
    # layout states: the sharded tensor dim (0: none) per mesh dim, mixed radix
    radix = len(vocab.dims) + 1
    weight = [radix**m for m in range(n)]
    dims = list(vocab.dims)
    state_bytes = []
    for state in range(radix**n):
        digits = [(state // weight[m]) % radix for m in range(n)]
        divs = tuple((dims[s - 1], mesh_shape[m]) for m, s in enumerate(digits) if s)
        state_bytes.append(local_bytes(shape, divs, itemsize))
    byte_values = sorted(set(state_bytes))
    position = {b: i for i, b in enumerate(byte_values)}
    steps = _StepLookup(mesh, device, vocab.step_kinds, byte_values)
    # step keys (kinds, bytes before, bytes after) fit int32 unless huge
    key_type = np.int32 if steps.absent < 2**31 else np.int64
    byte_index = np.array([position[b] for b in state_bytes], dtype=key_type)
    weights = np.array(weight, dtype=np.int32)
    src_state = (S.shard * weights).sum(axis=1).astype(np.int32)
    # DTensor's num_shards > 1: only then does the inner-to-outer pass run
    # (never on a 1-D mesh, where the plan is the one step to the target)
    sharded = np.array([math.prod(m for m, k in zip(mesh_shape, row) if k) for row in S.shard.tolist()])
    nested = (sharded > 1) & (n > 1)

    out = np.empty((len(S.index), len(D.index)), dtype=np.float64)
    rows = max(1, CHUNK_PAIRS // max(len(D.index), 1))
    for r0 in range(0, len(S.index), rows):
        r = slice(r0, r0 + rows)
        out[r] = _plain_chunk(vocab, S.rows(r), D, nested[r, None], src_state[r, None], weights, byte_index, steps)
    return out


def _plain_chunk(vocab: _Vocabulary, S: _Layouts, D: _Layouts, nested, state, weights, byte_index, steps: _StepLookup):
    """:func:`_plain_grid` for some sources (``S``, ``nested`` and ``state``
    theirs, as columns) and all targets: comm.greedy_steps, step by step."""
    n = S.index.shape[1]
    total = None
    cur, cur_shard = [None] * n, [None] * n

    def add(mesh_dim, present, a, b, before, after):
        nonlocal total
        kinds = vocab.pair(vocab.kinds, a, b).astype(byte_index.dtype)
        t = steps.times(mesh_dim, steps.key(present, kinds, byte_index.take(before), byte_index.take(after)))
        if total is None:
            total = t  # as the scalar sum from 0: 0 + t == t
        else:
            total += t

    # inner to outer: a Shard target goes to Replicate (index 0) when its
    # tensor dim is sharded differently on the outer mesh dims (sources
    # there unchanged)
    for m in reversed(range(n)):
        d = D.shard[:, m]
        differ = np.zeros((len(S.index), len(d)), dtype=bool)
        for i in range(m):
            differ |= (S.shard[:, i, None] == d) != (D.shard[:, i] == d)
        target = np.where(differ & (d != 0), 0, D.index[:, m])
        src = S.index[:, m, None]
        present = nested & vocab.pair(vocab.ne, src, target)
        cur[m] = np.where(present, target, src)
        cur_shard[m] = vocab.shard.take(cur[m])
        after = state + (cur_shard[m] - S.shard[:, m, None]) * weights[m]
        add(m, present, src, target, state, after)
        state = after
    # outer to inner: every mesh dim still off target moves to it
    for m in range(n):
        present = vocab.pair(vocab.ne, cur[m], D.index[:, m])
        after = state + (D.shard[:, m] - cur_shard[m]) * weights[m]
        add(m, present, cur[m], D.index[:, m], state, after)
        state = after
    return total


def _differs(vocab: _Vocabulary, S: _Layouts, D: _Layouts) -> np.ndarray:
    """``s.placements != d.placements`` per source x target, as a tuple
    compares: the first mesh dim whose placements are not ``is`` or ``==``
    decides, by ``!=``."""
    out = np.zeros((len(S.index), len(D.index)), dtype=bool)
    decided = np.zeros_like(out)
    for m in range(S.index.shape[1]):
        a, b = S.index[:, m, None], D.index[:, m]
        first = ~decided & ~vocab.pair(vocab.eq, a, b)
        out |= first & vocab.pair(vocab.ne, a, b)
        decided |= first
    return out


def redistribution_grid(src_specs: Sequence, dst_specs: Sequence, device: DeviceSpec) -> np.ndarray:
    """``redistribute_time(s, d, device)`` for every source x target spec,
    as a float64 array (bit-identical; ``inf`` where forbidden)."""
    return _raw_grid(src_specs, dst_specs, device)[0]


def _raw_grid(src_specs: Sequence, dst_specs: Sequence, device: DeviceSpec) -> tuple[np.ndarray, np.ndarray]:
    """:func:`redistribution_grid`, and where its entries are free moves
    between different placements (``0`` and ``s.placements != d.placements``)."""
    out = np.zeros((len(src_specs), len(dst_specs)), dtype=np.float64)
    free = np.zeros(out.shape, dtype=bool)
    if not src_specs or not dst_specs:
        return out, free
    mesh = src_specs[0].mesh
    planned_src = [i for i, s in enumerate(src_specs) if _planned(s, mesh)]
    planned_dst = [j for j, d in enumerate(dst_specs) if _planned(d, mesh)]
    metas = {src_specs[i].tensor_meta for i in planned_src}
    if len(metas) != 1:  # no planned source, or mixed tensor metas (never from one producer)
        planned_src, planned_dst = [], []
    if planned_src and planned_dst:
        src = [src_specs[i].placements for i in planned_src]
        dst = [dst_specs[j].placements for j in planned_dst]
        vocab = _Vocabulary(src + dst)
        S, D = vocab.layouts(src), vocab.layouts(dst)
        block = np.ix_(planned_src, planned_dst)
        meta = metas.pop()
        raw = _plain_grid(mesh, device, meta, vocab, S, D)
        # the min-cost plan where it covers the pair and is cheaper
        redistribute_plan.improve_grid(mesh, device, tuple(meta.shape), meta.dtype.itemsize, src, dst, raw)
        out[block] = raw
        free[block] = (raw == 0.0) & _differs(vocab, S, D)
    # the other pairs one by one, from the reference
    other_src = sorted(set(range(len(src_specs))) - set(planned_src))
    if other_src:
        out[other_src, :] = _pairwise([src_specs[i] for i in other_src], dst_specs, device)
    other_dst = sorted(set(range(len(dst_specs))) - set(planned_dst))
    if other_dst and planned_src:
        out[np.ix_(planned_src, other_dst)] = _pairwise(
            [src_specs[i] for i in planned_src], [dst_specs[j] for j in other_dst], device
        )
    zero = out == 0.0
    zero[np.ix_(planned_src, planned_dst)] = False
    for i, j in zip(*np.nonzero(zero)):
        free[i, j] = src_specs[i].placements != dst_specs[j].placements
    return out, free


def discounted(times: np.ndarray, kind: str | HiddenComm, policy: CommOverlapPolicy) -> np.ndarray:
    """:func:`~autoparallel.cost_model.apply_discount` of every entry of ``times``: on the
    array where the policy is a flat fraction (``time * fraction``, the same
    float product), else once per distinct value (compute windows)."""
    if not (isinstance(kind, HiddenComm) and policy.enabled and policy.compute_windows):
        return np.asarray(apply_discount(times, kind, policy), dtype=np.float64)
    uniq, inverse = np.unique(times, return_inverse=True)
    values = [apply_discount(t, kind, policy) for t in uniq.tolist()]
    return np.asarray(values, dtype=np.float64)[inverse].reshape(times.shape)


def class_cost_grid(
    src_specs: Sequence,
    dst_specs: Sequence,
    device: DeviceSpec,
    overlap: CommOverlapPolicy,
    kind: str | HiddenComm | None,
    keep_partial: bool,
) -> np.ndarray:
    """:func:`autoparallel.cost_model.comm.edge_time` of every source x
    target spec, bit for bit: the redistribution time, discounted
    (``kind``), plus the copies of a bucketed parameter gather or gradient
    reduction (:mod:`~autoparallel.cost_model.bucket_copies`) and the
    tiebreak when something moves, the tiebreak alone for a free move
    between different placements; ``inf`` where ``keep_partial`` and a
    source's Partial mesh dim would be reduced."""
    raw, free = _raw_grid(src_specs, dst_specs, counted_device(device, overlap, kind))
    out = raw.copy()
    moved = (raw != 0.0) & np.isfinite(raw)
    if kind is not None:
        out[moved] = discounted(raw[moved], kind, overlap)
        bucket = bucket_copy_grid(src_specs, dst_specs, kind, device)
        if bucket is not None:
            out[moved] += bucket[moved]
    out[moved] += TRANSITION_TIEBREAK
    out[free] = TRANSITION_TIEBREAK
    if keep_partial:
        src_partial = np.array([partial_mask(s.placements) for s in src_specs], dtype=np.int64)
        dst_whole = np.array([~partial_mask(d.placements) for d in dst_specs], dtype=np.int64)
        out[(src_partial[:, None] & dst_whole[None, :]) != 0] = math.inf
    return out
