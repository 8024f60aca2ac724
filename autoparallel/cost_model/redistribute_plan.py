"""Min-cost redistribution plans under our own per-step cost model.

DTensor's greedy plan (:func:`comm.greedy_steps`) first un-shards inner mesh
dims, so on >= 3-D meshes its later steps move 8-64x bigger buffers than
needed: LLaMA-3 70B's activation [32, 8192, 8192] fp32 on 4x4x8x8,
``S(2) S(2) S(2) S(2) -> S(0) S(0) S(1) S(1)``, costs 11.8 ms greedily and
~0.7 ms as six all-to-alls at the local size. Here the plan is a shortest
path over layout states, each edge costed with :func:`steps.step_time` (the
function every form calls, bytes from :func:`steps.local_bytes`).

A **state** is, per mesh dim, a state code
(:func:`placement_codes.state_codes`: ``R``, ``P`` the source's Partial,
``S0 + d`` a Shard of tensor dim ``d``) and the mesh dim's rank in
its tensor dim's shard order (0 outermost; DTensorSpec's ``shard_order``: a
mesh dim later in the order holds an inner chunk). Default order: ranks
ascending with the mesh dim. **Edges** change one mesh dim ``m``:

* ``S(d) -> R`` all-gather, ``S(d) -> S(e)`` all-to-all: only when ``m`` is
  the innermost shard of ``d`` (gathering an outer one would leave a
  strided layout); ``m`` becomes the innermost shard of ``e``;
* ``R -> S(e)`` local slice, ``P -> S(e)`` reduce-scatter: ``m`` becomes
  the innermost shard of ``e``;
* ``P -> R`` all-reduce.

Only even states exist (every sharded tensor dim divides by the product of
its mesh dims: apply raises on uneven splits). There is no ``R -> P`` edge
and a Partial is never entered: a target Partial on a mesh dim the source
holds Replicate is one local ``R -> P`` step after the path (in mesh dim
order); one the source holds equal is never touched. The greedy plan is a
path of this graph, so the shortest path is never dearer; callers keep the
greedy plan unless the min-cost one is strictly cheaper (so plans only
change where it pays).

Pairs this graph does not cover keep DTensor's plan (:func:`comm.dtensor_plan`):
``_StridedShard`` / tp-outer layouts, ``_MaskPartial`` and norm Partials
(apply threads their masks per mesh dim), non-default shard orders, uneven
shards, Shard/other-Partial -> Partial (forbidden), 1-D meshes.

**Solver.** Bellman-Ford from many sources at once (numpy, one column per
source, state-major so a gather reads contiguous rows), Gauss-Seidel over
edge groups (one group per mesh dim and code change: within a group the map
``u -> v`` is injective, so an update has no scatter conflicts). Float sums
are monotone, so every column converges to the minimum over paths of the
left-to-right sum of step times, independently of which other sources share
the batch: scalar, per-pair and grid callers read bit-identical figures, and
the path recovered from the predecessors re-sums to exactly that figure.
Distances (to default-order states) are cached per source state on a graph
per (mesh, tensor shape, itemsize, device).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from .caches import register
from .compute import mesh_shape as _mesh_shape
from .devices import DeviceSpec
from .placement_codes import PARTIAL, REPLICATE, P, R, S0, code_kind, state_codes
from .steps import kinds_between, mesh_dim_topology, step_kinds, step_time

# Sources per Bellman-Ford batch: bounds the (states x sources) arrays.
BATCH = 256


@dataclass
class StateGraph:
    """The layout states of one tensor (shape, itemsize) on one mesh, the
    edges between them costed for one device, and solved distances."""

    mesh_shape: tuple[int, ...]
    radix: int  # codes per mesh dim: R, P, S(0..ndim-1)
    codes: np.ndarray  # (states, mesh dims) code per mesh dim
    ranks: np.ndarray  # (states, mesh dims) rank in the tensor dim's shard order
    state_bytes: list[int]  # local bytes per state (steps.local_bytes)
    default_of: np.ndarray  # assignment number (mixed radix codes) -> default-order state, -1 if uneven
    default_states: np.ndarray  # state ids of the default-order states
    default_pos: np.ndarray  # state id -> position in default_states (-1: not default order)
    # edge groups: (mesh dim, from code, to code, kinds, u ids, v ids, weights, first edge id)
    groups: list[tuple]
    rows: dict[int, np.ndarray] = field(default_factory=dict)  # source state -> distance per default state
    preds: dict[int, np.ndarray] = field(default_factory=dict)  # source state -> edge id into each state
    partition: dict[int, np.ndarray] = field(default_factory=dict)  # mesh dim -> R -> P seconds per default state

    def assignment(self, codes: Sequence[int]) -> int:
        return sum(c * self.radix**m for m, c in enumerate(codes))

    def default_state(self, codes: Sequence[int]) -> int:
        """The default-order state of these codes, -1 if it is uneven."""
        return int(self.default_of[self.assignment(codes)])

    def distances(self, sources: Sequence[int]) -> np.ndarray:
        """(len(sources), default states): shortest times from each source
        state to each default-order state (inf: unreachable)."""
        missing = [s for s in dict.fromkeys(sources) if s not in self.rows]
        for b in range(0, len(missing), BATCH):
            batch = missing[b : b + BATCH]
            dist, _ = self._solve(batch, keep_pred=False)
            for i, s in enumerate(batch):
                self.rows[s] = dist[self.default_states, i].copy()
        if not sources:
            return np.zeros((0, len(self.default_states)))
        return np.stack([self.rows[s] for s in sources])

    def distance(self, source: int, target: int) -> float:
        """Shortest time from ``source`` to the default-order ``target``."""
        row = self.rows.get(source)
        if row is None:
            row = self.distances([source])[0]
        return row[self.default_pos[target]]

    def path(self, source: int, target: int) -> list[tuple[int, int, int, tuple[str, ...], int, int]]:
        """Steps (mesh dim, from code, to code, kinds, state before, state
        after) of the shortest path found from ``source`` to ``target``."""
        pred = self.preds.get(source)
        if pred is None:
            pred = self.preds[source] = self._solve([source], keep_pred=True)[1][:, 0]
        edges = self._edge_table()
        steps, v = [], target
        while v != source:
            e = int(pred[v])
            if e < 0 or len(steps) > len(self.codes):
                raise RuntimeError(f"no min-cost path from state {source} to {target}")
            m, a, b, kinds, u = edges[e]
            steps.append((m, a, b, kinds, u, v))
            v = u
        return steps[::-1]

    def _edge_table(self) -> list[tuple]:
        table = getattr(self, "_edges", None)
        if table is None:
            table = []
            for m, a, b, kinds, u, v, w, first in self.groups:
                table.extend((m, a, b, kinds, uu) for uu in u.tolist())
            self._edges = table
        return table

    def _solve(self, sources: Sequence[int], keep_pred: bool) -> tuple[np.ndarray, np.ndarray | None]:
        n_states = len(self.codes)
        cols = np.arange(len(sources))
        dist = np.full((n_states, len(sources)), np.inf)
        dist[np.asarray(sources), cols] = 0.0
        pred = np.full((n_states, len(sources)), -1, dtype=np.int32) if keep_pred else None
        # Only edges out of states whose distance changed since their last
        # relaxation can improve anything: ``dirty`` (this sweep) and
        # ``was_dirty`` (the previous one) select them. The fixed point, the
        # minimum over paths, does not depend on the relaxation order.
        was_dirty = np.zeros(n_states, dtype=bool)
        dirty = np.zeros(n_states, dtype=bool)
        dirty[np.asarray(sources)] = True
        while dirty.any():
            was_dirty, dirty = dirty, np.zeros(n_states, dtype=bool)
            for m, a, b, kinds, u, v, w, first in self.groups:
                sel = np.flatnonzero(was_dirty[u] | dirty[u])
                if not len(sel):
                    continue
                us, vs = u[sel], v[sel]
                cand = dist[us] + w[sel, None]
                old = dist[vs]
                better = cand < old
                improved = better.any(axis=1)
                if not improved.any():
                    continue
                dist[vs] = np.minimum(cand, old)  # == where(cand < old, cand, old): no NaN
                dirty[vs[improved]] = True
                if keep_pred:
                    pred[vs] = np.where(better, (first + sel).astype(np.int32)[:, None], pred[vs])
        return dist, pred


_GRAPHS: dict[tuple, StateGraph] = register({})


def state_graph(mesh: Any, shape: tuple[int, ...], itemsize: int, device: DeviceSpec) -> StateGraph:
    """The (cached) state graph of a tensor of ``shape`` on ``mesh``."""
    key = (mesh, shape, itemsize, device)
    graph = _GRAPHS.get(key)
    if graph is None:
        graph = _GRAPHS[key] = _build(mesh, shape, itemsize, device)
    return graph


@dataclass
class _Structure:
    """States and edges of a graph, shared by the tensor shapes that split
    evenly over the same mesh dim subsets."""

    codes: list[tuple[int, ...]]
    ranks: list[tuple[int, ...]]
    splits: np.ndarray  # (states, tensor dims): product of the mesh dims sharding each tensor dim
    default_of: np.ndarray
    edges: list[tuple[int, int, int, tuple[str, ...], np.ndarray, np.ndarray]]  # (m, from, to, kinds, u, v)


_STRUCTURES: dict[tuple, _Structure] = register({})
_SWEEP_ORDER = {"local_copy": 0, "reduce_scatter": 1, "all_to_all": 2, "all_gather": 3, "all_reduce": 4}


def _collective(kinds: tuple[str, ...]) -> str:
    """The step's collective, or its copy (a staging copy does not order it)."""
    return next((k for k in kinds if k != "pre_copy"), kinds[0])


def _structure(mesh_shape: tuple[int, ...], shape: tuple[int, ...]) -> _Structure:
    n = len(mesh_shape)
    products = sorted({math.prod(c) for k in range(n + 1) for c in itertools.combinations(mesh_shape, k)})
    even = tuple(tuple(size % p == 0 for p in products) for size in shape)
    key = (mesh_shape, even)
    found = _STRUCTURES.get(key)
    if found is None:
        found = _STRUCTURES[key] = _enumerate(mesh_shape, shape)
    return found


def _enumerate(mesh_shape: tuple[int, ...], shape: tuple[int, ...]) -> _Structure:
    n, ndim = len(mesh_shape), len(shape)
    radix = S0 + ndim
    index: dict[tuple, int] = {}
    codes_list, ranks_list, splits = [], [], []
    default_of = np.full(radix**n, -1, dtype=np.int64)
    for codes in itertools.product(range(radix), repeat=n):
        codes = codes[::-1]  # mixed radix: mesh dim 0 is the lowest digit
        groups = [[m for m in range(n) if codes[m] == S0 + d] for d in range(ndim)]
        split = [math.prod(mesh_shape[m] for m in g) for g in groups]
        if any(size % k for size, k in zip(shape, split)):
            continue  # uneven: not a state
        for orders in itertools.product(*(itertools.permutations(g) for g in groups if g)):
            ranks = [0] * n
            for order in orders:
                for r, m in enumerate(order):
                    ranks[m] = r
            index[(codes, tuple(ranks))] = len(codes_list)
            codes_list.append(codes)
            ranks_list.append(tuple(ranks))
            splits.append(split)
        default_ranks = [0] * n
        for g in groups:
            for r, m in enumerate(g):
                default_ranks[m] = r
        default_of[sum(c * radix**m for m, c in enumerate(codes))] = index[(codes, tuple(default_ranks))]
    # edges, grouped by (mesh dim, from code, to code)
    grouped: dict[tuple, list[tuple[int, int]]] = {}
    for u, (codes, ranks) in enumerate(zip(codes_list, ranks_list)):
        counts = [0] * radix
        for c in codes:
            counts[c] += 1
        for m, c in enumerate(codes):
            if c >= S0 and ranks[m] != counts[c] - 1:
                continue  # not the innermost shard of its tensor dim
            targets = [S0 + e for e in range(ndim) if S0 + e != c]
            if c != R:
                targets.append(R)
            for t in targets:
                new_codes = codes[:m] + (t,) + codes[m + 1 :]
                new_ranks = list(ranks)
                new_ranks[m] = counts[t] if t >= S0 else 0  # innermost of its new tensor dim
                v = index.get((new_codes, tuple(new_ranks)))
                if v is not None:
                    grouped.setdefault((m, c, t), []).append((u, v))
    edges = []
    for (m, a, b), pairs in grouped.items():
        kinds = kinds_between(code_kind(a), code_kind(b), a - S0 if a >= S0 else None, b - S0 if b >= S0 else None)
        edges.append((m, a, b, kinds, np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])))
    # relaxation order: shrinking steps first, inner mesh dims first (fewer
    # Gauss-Seidel sweeps: ~6 instead of ~8 on LLaMA-3's 4-D tensors)
    edges.sort(key=lambda e: (_SWEEP_ORDER[_collective(e[3])], -e[0], e[1], e[2]))
    return _Structure(
        codes_list, ranks_list, np.array(splits, dtype=np.int64).reshape(len(splits), ndim), default_of, edges
    )


def _build(mesh: Any, shape: tuple[int, ...], itemsize: int, device: DeviceSpec) -> StateGraph:
    mesh_shape = _mesh_shape(mesh)
    n = len(mesh_shape)
    st = _structure(mesh_shape, shape)
    topo = mesh_dim_topology(mesh, device.gpus_per_node)
    # even states: steps.local_bytes' ceil divisions are exact
    local = np.prod(np.array(shape, dtype=np.int64) // st.splits, axis=1) * itemsize
    byte_values, byte_index = np.unique(local, return_inverse=True)
    byte_list = byte_values.tolist()
    nb = len(byte_list)
    groups, first = [], 0
    for m, a, b, kinds, u, v in st.edges:
        keys, inverse = np.unique(byte_index[u] * nb + byte_index[v], return_inverse=True)
        times = [step_time(topo[m], kinds, byte_list[k // nb], byte_list[k % nb], device) for k in keys.tolist()]
        w = np.array(times, dtype=np.float64)[inverse]
        groups.append((m, a, b, kinds, u, v, w, first))
        first += len(u)
    default_states = st.default_of[st.default_of >= 0]
    default_pos = np.full(len(st.codes), -1, dtype=np.int64)
    default_pos[default_states] = np.arange(len(default_states))
    return StateGraph(
        mesh_shape=mesh_shape,
        radix=S0 + len(shape),
        codes=np.array(st.codes, dtype=np.int64).reshape(-1, n),
        ranks=np.array(st.ranks, dtype=np.int64).reshape(-1, n),
        state_bytes=local.tolist(),
        default_of=st.default_of,
        default_states=default_states,
        default_pos=default_pos,
        groups=groups,
    )


def pair_codes(src: tuple[Placement, ...], dst: tuple[Placement, ...], ndim: int):
    """(source codes, target codes in the graph, mesh dims needing a final
    ``R -> P``) for a pair the graph covers, else None. Reads placements as
    :func:`improve_grid` does (:func:`_layout`: codes and reduce ops)."""
    if len(src) < 2:
        return None  # 1-D mesh: the one step is the plan
    a, b = _layout(src, ndim), _layout(dst, ndim)
    if a is None or b is None:
        return None
    (src_codes, src_ops), (dst_codes, dst_ops) = a, b
    target, partition = list(dst_codes), []
    for m, (x, y) in enumerate(zip(src_codes, dst_codes)):
        if y == P:
            if x == R:
                target[m] = R
                partition.append(m)
            elif not (x == P and src_ops[m] == dst_ops[m]):
                return None  # Shard or another Partial -> Partial: forbidden (today's plan says inf)
    return src_codes, tuple(target), tuple(partition)


_R_TO_P = kinds_between(REPLICATE, PARTIAL)


def _partition_time(graph: StateGraph, topo, m: int, state: int, device: DeviceSpec) -> float:
    nbytes = graph.state_bytes[state]
    return step_time(topo[m], _R_TO_P, nbytes, nbytes, device)


def _partition_times(graph: StateGraph, topo, m: int, device: DeviceSpec) -> np.ndarray:
    """:func:`_partition_time` on mesh dim ``m`` per default-order state."""
    cache = graph.partition.get(m)
    if cache is None:
        by_bytes: dict[int, float] = {}
        values = []
        for state in graph.default_states.tolist():
            b = graph.state_bytes[state]
            if b not in by_bytes:
                by_bytes[b] = _partition_time(graph, topo, m, state, device)
            values.append(by_bytes[b])
        cache = graph.partition[m] = np.array(values, dtype=np.float64)
    return cache


def prefetch(mesh: Any, shape: tuple[int, ...], itemsize: int, device: DeviceSpec, sources: Sequence[tuple]) -> None:
    """Solve the distances of these source placements in one batch (what a
    matrix or grid is about to ask pair by pair; one solve per source costs
    ~a Bellman-Ford pass each)."""
    if len(_mesh_shape(mesh)) < 2:
        return
    graph = state_graph(mesh, shape, itemsize, device)
    states = []
    for placements in sources:
        codes = state_codes(placements, len(shape))
        if codes is not None:
            state = graph.default_state(codes)
            if state >= 0 and state not in graph.rows:
                states.append(state)
    if states:
        graph.distances(states)


def min_cost_total(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec) -> tuple | None:
    """(seconds, graph, source state, target state, partition mesh dims) of
    the min-cost plan, or None where the graph does not apply."""
    meta = src.tensor_meta
    if meta is None or not (
        DTensorSpec.is_default_device_order(src.shard_order) and DTensorSpec.is_default_device_order(dst.shard_order)
    ):
        return None
    shape = tuple(meta.shape)
    codes = pair_codes(src.placements, dst.placements, len(shape))
    if codes is None:
        return None
    graph = state_graph(src.mesh, shape, meta.dtype.itemsize, device)
    a, target, partition = codes
    s, t = graph.default_state(a), graph.default_state(target)
    if s < 0 or t < 0:
        return None  # uneven source or target
    total = graph.distance(s, t)
    if partition:
        topo = mesh_dim_topology(src.mesh, device.gpus_per_node)
        for m in partition:
            total += _partition_time(graph, topo, m, t, device)
    return float(total), graph, s, t, partition


def min_cost_steps(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec, greedy_total: float):
    """The min-cost plan's steps as comm yields them (mesh dim, src
    placement, dst placement, kinds, bytes before, seconds), when it is
    strictly cheaper than ``greedy_total``; else None."""
    found = min_cost_total(src, dst, device)
    if found is None or not found[0] < greedy_total:
        return None
    _, graph, s, t, partition = found
    topo = mesh_dim_topology(src.mesh, device.gpus_per_node)
    current, steps = list(src.placements), []
    for m, a, b, kinds, u, v in graph.path(s, t):
        new = Replicate() if b == R else Shard(b - S0)
        nbytes = graph.state_bytes[u]
        steps.append(
            (m, current[m], new, kinds, nbytes, step_time(topo[m], kinds, nbytes, graph.state_bytes[v], device))
        )
        current[m] = new
    for m in partition:
        nbytes = graph.state_bytes[t]
        steps.append(
            (
                m,
                current[m],
                dst.placements[m],
                step_kinds(current[m], dst.placements[m]),
                nbytes,
                _partition_time(graph, topo, m, t, device),
            )
        )
        current[m] = dst.placements[m]
    return steps


_OPS: dict = register({})  # a Partial's reduce op -> small int
_LAYOUTS: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]] | None] = register({})


def _layout(placements: tuple[Placement, ...], ndim: int):
    """(codes, reduce op id per mesh dim or -1) of plain placements, else
    None: two plain Partials are equal exactly when their reduce ops are."""
    key = (placements, ndim)
    try:
        return _LAYOUTS[key]
    except KeyError:
        pass
    codes = state_codes(placements, ndim)
    found = None
    if codes is not None:
        ops = tuple(_OPS.setdefault(p.reduce_op, len(_OPS)) if c == P else -1 for p, c in zip(placements, codes))
        found = (codes, ops)
    _LAYOUTS[key] = found
    return found


def improve_grid(
    mesh: Any,
    device: DeviceSpec,
    shape: tuple[int, ...],
    itemsize: int,
    src: Sequence[tuple[Placement, ...]],
    dst: Sequence[tuple[Placement, ...]],
    times: np.ndarray,
) -> None:
    """Lower ``times[i, j]`` (today's plan's seconds from ``src[i]`` to
    ``dst[j]``, default shard order, one tensor) to the min-cost plan's
    where the graph covers the pair and it is strictly cheaper: what
    :func:`comm.redistribute_time` gives pair by pair, bit for bit (same
    distances, then the same ``R -> P`` additions in the same order)."""
    n, ndim = len(_mesh_shape(mesh)), len(shape)
    if n < 2 or not len(src) or not len(dst):
        return
    graph = state_graph(mesh, shape, itemsize, device)
    radix = np.array([graph.radix**m for m in range(n)], dtype=np.int64)

    def arrays(tuples):
        found = [_layout(t, ndim) for t in tuples]
        keep = [i for i, f in enumerate(found) if f is not None]
        codes = np.array([found[i][0] for i in keep], dtype=np.int64).reshape(-1, n)
        ops = np.array([found[i][1] for i in keep], dtype=np.int64).reshape(-1, n)
        assign = codes @ radix
        state = graph.default_of[assign]
        even = state >= 0
        return np.array(keep, dtype=np.int64)[even], codes[even], ops[even], assign[even], state[even]

    rows_ok, sc, sop, _, s_state = arrays(src)
    cols_ok, dc, dop, d_assign, d_state = arrays(dst)
    if not len(rows_ok) or not len(cols_ok):
        return
    uniq, inverse = np.unique(s_state, return_inverse=True)
    dist = graph.distances(uniq.tolist())[inverse.reshape(-1)]
    eligible = None
    target_assign = None
    partitions = []
    for m in range(n):
        target_partial = dc[:, m] == P
        if not target_partial.any():
            continue
        # a target Partial needs a Replicate source (then R -> P after the
        # path) or the same Partial (untouched); Shard / other op: forbidden
        part = (sc[:, m] == R)[:, None] & target_partial[None, :]
        same = (sc[:, m] == P)[:, None] & (sop[:, m][:, None] == dop[:, m][None, :])
        ok = ~target_partial[None, :] | part | same
        eligible = ok if eligible is None else eligible & ok
        if target_assign is None:
            target_assign = np.repeat(d_assign[None, :], len(rows_ok), axis=0)
        target_assign -= part * ((P - R) * int(radix[m]))
        partitions.append((m, part))
    if target_assign is None:
        mc = dist[:, graph.default_pos[d_state]]
    else:
        # even: the target's shards with fewer Partials
        target_pos = graph.default_pos[graph.default_of[target_assign]]
        mc = np.take_along_axis(dist, target_pos, axis=1)
        topo = mesh_dim_topology(mesh, device.gpus_per_node)
        for m, part in partitions:
            mc = np.where(part, mc + _partition_times(graph, topo, m, device)[target_pos], mc)
    block = np.ix_(rows_ok, cols_ok)
    greedy = times[block]
    better = mc < greedy
    if eligible is not None:
        better &= eligible
    times[block] = np.where(better, mc, greedy)
