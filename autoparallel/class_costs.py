"""Whole class grids of redistribution costs, vectorised with numpy (issue 13).

A class grid holds the cost of every (distinct source placements, distinct
target placements) pair of one tensor: on LLaMA-3 70B over 4x4x8x8 up to
1218 x 1218 entries, 18M over a 2-layer problem. :func:`redistribution_grid`
computes the raw times of a grid at once, equal bit for bit to
:func:`autoparallel.cost_model.redistribute_time` (and to
:func:`autoparallel.edge_costs.redistribution_matrix`, its per-pair fast
path); :func:`class_cost_grid` adds what an edge matrix counts on top
(keep-partial masking, the overlap discount, the transition tiebreak).

How, for plain placements (Replicate, Shard, Partial of exact types, default
shard order, one tensor meta, one mesh; the pairs ``edge_costs`` takes its
fast path for):

* each placement is an int per mesh dim (its code, its kind, its sharded
  tensor dim), for all sources and targets at once;
* DTensor's greedy plan (:func:`autoparallel.cost_model.comm._greedy_steps`)
  runs over all pairs together, with a Python loop over mesh dims only: an
  inner-to-outer pass (a Shard target whose tensor dim is sharded
  differently on outer mesh dims goes to Replicate first), then an
  outer-to-inner pass to the targets. Every (pass, mesh dim) is one step
  slot, present or not for each pair;
* the layout after each step is a state id (the sharded tensor dim per mesh
  dim, mixed radix), whose local bytes (``comm._local_bytes``, same ceil
  divisions in the same order) come from a table over all states;
* a step's time depends on (mesh dim, kinds, bytes before, bytes after): the
  distinct values present are computed with the scalar function
  (:func:`autoparallel.edge_costs.step_time`, cached) and looked up;
* a pair's time is the sum of its slots' times in plan order, an absent step
  adding 0.0 (x + 0.0 == x), so sums round as the scalar loop's do.

Other pairs (strided shards, tp-outer layouts, non-default shard orders,
Partial subclasses, mixed metas) go through the per-pair path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import cost_model
from .cost_model import comm
from .cost_model.devices import DeviceSpec
from .cost_model.overlap import CommOverlapPolicy, HiddenComm
from .edge_costs import _CODES, _fast_id, redistribution_matrix, step_time, step_times

# Pairs per vectorised chunk (sources x targets): bounds the temporaries
# (about 30 arrays of this many entries) and keeps them in cache.
CHUNK_PAIRS = 1 << 17
# Largest step-time lookup table (kind pairs x bytes before x bytes after)
# indexed directly; larger ones go through np.unique.
_LUT_LIMIT = 1 << 22

_KINDS = ("R", "P", "S")  # kind ids 0, 1, 2
# kinds of a step from kind id a to kind id b (a placement to a different one)
_STEP_KINDS_BY_ID = tuple(
    comm._STEP_KINDS.get((_KINDS[a], _KINDS[b]), ("forbidden",)) for a in range(3) for b in range(3)
)


@dataclass
class _Layouts:
    """Plain placements tuples as ints, shape (tuples, mesh dims)."""

    code: np.ndarray  # equal exactly where the placements are equal
    kind: np.ndarray  # index into _KINDS
    shard: np.ndarray  # 1 + index of the sharded tensor dim in _Vocabulary.dims; 0 when not a Shard

    def rows(self, r: slice) -> "_Layouts":
        return _Layouts(self.code[r], self.kind[r], self.shard[r])


@dataclass
class _Vocabulary:
    """The distinct placements (as ``edge_costs._code`` tuples) and sharded
    tensor dims of one grid; ``("R",)`` is always code 0."""

    codes: dict
    dims: dict

    @classmethod
    def of(cls, tuples: Sequence[tuple]) -> "_Vocabulary":
        codes: dict = {("R",): 0}
        dims: dict = {}
        for t in tuples:
            for c in t:
                codes.setdefault(c, len(codes))
                if c[0] == "S":
                    dims.setdefault(c[1], len(dims))
        return cls(codes, dims)

    def layouts(self, tuples: Sequence[tuple]) -> _Layouts:
        n = len(tuples[0])
        code = np.array([[self.codes[c] for c in t] for t in tuples], dtype=np.int32).reshape(-1, n)
        kind = np.array([[_KINDS.index(c[0]) for c in t] for t in tuples], dtype=np.int32).reshape(-1, n)
        shard = np.array(
            [[1 + self.dims[c[1]] if c[0] == "S" else 0 for c in t] for t in tuples], dtype=np.int32
        ).reshape(-1, n)
        return _Layouts(code, kind, shard)


class _StepLookup:
    """Step times of one grid by (mesh dim, kind pair, bytes before, bytes
    after), the bytes as indices into the grid's distinct local sizes."""

    def __init__(self, mesh, device: DeviceSpec, byte_values: list[int]):
        self._topo = comm._mesh_dim_topology(mesh, device.gpus_per_node)
        self._device = device
        self._cache = step_times(mesh, device)
        self._bytes = byte_values
        self._size = 9 * len(byte_values) ** 2
        self.absent = self._size  # key of "no step here": 0.0
        self._tables: dict[int, np.ndarray] = {}

    def key(self, present: np.ndarray, kinds: np.ndarray, before: np.ndarray, after: np.ndarray) -> np.ndarray:
        b = len(self._bytes)
        return np.where(present, (kinds * b + before) * b + after, self.absent)

    def _time(self, mesh_dim: int, key: int) -> float:
        b = len(self._bytes)
        kind_pair, rest = divmod(key, b * b)
        before, after = divmod(rest, b)
        kinds = _STEP_KINDS_BY_ID[kind_pair]
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
        seen = np.zeros(self._size + 1, dtype=bool)
        seen[keys] = True
        for k in np.flatnonzero(seen & np.isnan(table)).tolist():
            table[k] = self._time(mesh_dim, k)
        return table[keys]


def _plain_grid(mesh, device: DeviceSpec, meta, src: list[tuple], dst: list[tuple]) -> np.ndarray:
    """Raw redistribution times between plain placements (``edge_costs._code``
    tuples, default shard order) of one tensor: sources x targets."""
    mesh_shape = comm._mesh_shape(mesh)
    n = len(mesh_shape)
    shape, itemsize = tuple(meta.shape), meta.dtype.itemsize
    vocab = _Vocabulary.of(src + dst)
    S, D = vocab.layouts(src), vocab.layouts(dst)
    # layout states: the sharded tensor dim (0: none) per mesh dim, mixed radix
    radix = len(vocab.dims) + 1
    weight = [radix**m for m in range(n)]
    dims = list(vocab.dims)
    state_bytes = []
    for state in range(radix**n):
        digits = [(state // weight[m]) % radix for m in range(n)]
        divs = tuple((dims[s - 1], mesh_shape[m]) for m, s in enumerate(digits) if s)
        state_bytes.append(comm._local_bytes(shape, divs, itemsize))
    byte_values = sorted(set(state_bytes))
    position = {b: i for i, b in enumerate(byte_values)}
    # step keys (kind pair, bytes before, bytes after) fit int32 unless huge
    key_type = np.int32 if 9 * len(byte_values) ** 2 < 2**31 else np.int64
    byte_index = np.array([position[b] for b in state_bytes], dtype=key_type)
    steps = _StepLookup(mesh, device, byte_values)
    weights = np.array(weight, dtype=np.int32)
    src_state = (S.shard * weights).sum(axis=1).astype(np.int32)
    # DTensor's num_shards > 1: only then does the inner-to-outer pass run
    # (never on a 1-D mesh, where the plan is the one step to the target)
    sharded = np.array([math.prod(m for m, k in zip(mesh_shape, row) if k == 2) for row in S.kind.tolist()])
    nested = (sharded > 1) & (n > 1)

    out = np.empty((len(src), len(dst)), dtype=np.float64)
    rows = max(1, CHUNK_PAIRS // max(len(dst), 1))
    for r0 in range(0, len(src), rows):
        r = slice(r0, r0 + rows)
        out[r] = _plain_chunk(S.rows(r), D, nested[r, None], src_state[r, None], weights, byte_index, steps)
    return out


def _plain_chunk(S: _Layouts, D: _Layouts, nested, state, weights, byte_index, steps: _StepLookup) -> np.ndarray:
    """:func:`_plain_grid` for some sources (``S``, ``nested`` and ``state``
    theirs, as columns) and all targets."""
    n = S.code.shape[1]
    total = None
    cur_code, cur_kind, cur_shard = [None] * n, [None] * n, [None] * n

    def add(mesh_dim, present, kind_a, kind_b, before, after):
        nonlocal total
        key = steps.key(present, (kind_a * 3 + kind_b).astype(byte_index.dtype), byte_index[before], byte_index[after])
        t = steps.times(mesh_dim, key)
        total = t if total is None else total + t  # 0.0 + t == t: as the scalar sum from 0

    # inner to outer: a Shard target goes to Replicate when its tensor dim is
    # sharded differently on the outer mesh dims (sources there unchanged)
    for m in reversed(range(n)):
        d = D.shard[:, m]
        differ = np.zeros((len(S.code), len(d)), dtype=bool)
        for i in range(m):
            differ |= (S.shard[:, i, None] == d) != (D.shard[:, i] == d)
        to_replicate = differ & (d != 0)
        tgt_code = np.where(to_replicate, 0, D.code[:, m])
        tgt_kind = np.where(to_replicate, 0, D.kind[:, m])
        tgt_shard = np.where(to_replicate, 0, D.shard[:, m])
        src_code = S.code[:, m, None]
        present = nested & (src_code != tgt_code)
        cur_code[m] = np.where(present, tgt_code, src_code)
        cur_kind[m] = np.where(present, tgt_kind, S.kind[:, m, None])
        cur_shard[m] = np.where(present, tgt_shard, S.shard[:, m, None])
        after = state + (cur_shard[m] - S.shard[:, m, None]) * weights[m]
        add(m, present, S.kind[:, m, None], tgt_kind, state, after)
        state = after
    # outer to inner: every mesh dim still off target moves to it
    for m in range(n):
        present = cur_code[m] != D.code[:, m]
        after = state + (D.shard[:, m] - cur_shard[m]) * weights[m]
        add(m, present, cur_kind[m], D.kind[:, m], state, after)
        state = after
    return total


def redistribution_grid(src_specs: Sequence, dst_specs: Sequence, device: DeviceSpec) -> np.ndarray:
    """``redistribute_time(s, d, device)`` for every source x target spec,
    as a float64 array (bit-identical; ``inf`` where forbidden)."""
    out = np.zeros((len(src_specs), len(dst_specs)), dtype=np.float64)
    if not src_specs or not dst_specs:
        return out
    mesh = src_specs[0].mesh
    src_ids = [_fast_id(s) if (s.mesh is mesh or s.mesh == mesh) else None for s in src_specs]
    dst_ids = [_fast_id(d) if (d.mesh is mesh or d.mesh == mesh) else None for d in dst_specs]
    fast_src = [i for i, x in enumerate(src_ids) if x is not None]
    fast_dst = [j for j, x in enumerate(dst_ids) if x is not None]
    metas = {src_specs[i].tensor_meta for i in fast_src}
    if len(metas) != 1:
        # no plain source, or mixed tensor metas (never from one producer)
        out[:] = redistribution_matrix(src_specs, dst_specs, device)
        return out
    if fast_dst:
        out[np.ix_(fast_src, fast_dst)] = _plain_grid(
            mesh,
            device,
            metas.pop(),
            [_CODES[src_ids[i]] for i in fast_src],
            [_CODES[dst_ids[j]] for j in fast_dst],
        )
    slow_src = [i for i, x in enumerate(src_ids) if x is None]
    if slow_src:
        out[slow_src, :] = redistribution_matrix([src_specs[i] for i in slow_src], dst_specs, device)
    slow_dst = [j for j, x in enumerate(dst_ids) if x is None]
    if slow_dst:
        out[np.ix_(fast_src, slow_dst)] = redistribution_matrix(
            [src_specs[i] for i in fast_src], [dst_specs[j] for j in slow_dst], device
        )
    return out


def discounted(times: np.ndarray, kind: str | HiddenComm, policy: CommOverlapPolicy) -> np.ndarray:
    """:func:`cost_model.apply_discount` of every entry of ``times``: on the
    array where the policy is a flat fraction (``time * fraction``, the same
    float product), else once per distinct value (compute windows)."""
    if not (isinstance(kind, HiddenComm) and policy.enabled and policy.compute_windows):
        return np.asarray(cost_model.apply_discount(times, kind, policy), dtype=np.float64)
    uniq, inverse = np.unique(times, return_inverse=True)
    values = [cost_model.apply_discount(t, kind, policy) for t in uniq.tolist()]
    return np.asarray(values, dtype=np.float64)[inverse].reshape(times.shape)


def _interned(spec) -> int:
    i = _fast_id(spec)
    return -1 if i is None else i


def _partial_mask(spec) -> int:
    return sum(1 << i for i, p in enumerate(spec.placements) if p.is_partial())


def class_cost_grid(
    src_specs: Sequence,
    dst_specs: Sequence,
    device: DeviceSpec,
    overlap: CommOverlapPolicy,
    kind: str | HiddenComm | None,
    keep_partial: bool,
) -> np.ndarray:
    """The edge cost of every source x target spec, as
    :meth:`autoparallel.edge_matrices.EdgeMatrices._pair` counts it: the
    redistribution time, discounted (``kind``) and plus the tiebreak when
    something moves, the tiebreak alone for a free move between different
    placements; ``inf`` where ``keep_partial`` and a source's Partial mesh
    dim would be reduced."""
    raw = redistribution_grid(src_specs, dst_specs, device)
    out = raw.copy()
    moved = (raw != 0.0) & np.isfinite(raw)
    if kind is not None:
        out[moved] = discounted(raw[moved], kind, overlap)
    out[moved] += cost_model.TRANSITION_TIEBREAK
    # free moves between different placements: plain specs compare by their
    # interned placements (-1: not plain), the others as Python tuples
    src_ids = np.array([_interned(s) for s in src_specs], dtype=np.int64)
    dst_ids = np.array([_interned(d) for d in dst_specs], dtype=np.int64)
    zero = raw == 0.0
    differ = zero & (src_ids[:, None] != dst_ids[None, :])
    for i, j in zip(*np.nonzero(zero & ((src_ids[:, None] < 0) | (dst_ids[None, :] < 0)))):
        differ[i, j] = src_specs[i].placements != dst_specs[j].placements
    out[differ] = cost_model.TRANSITION_TIEBREAK
    if keep_partial:
        src_partial = np.array([_partial_mask(s) for s in src_specs], dtype=np.int64)
        dst_whole = np.array([~_partial_mask(d) for d in dst_specs], dtype=np.int64)
        out[(src_partial[:, None] & dst_whole[None, :]) != 0] = math.inf
    return out
