"""Presolve: shrink a :class:`~solver.problem.Problem` without changing its optimum.

:func:`presolve` returns a :class:`Presolved`: a smaller problem whose optimal
choice, passed through :meth:`Presolved.expand`, is an optimal choice of the
original problem with the same objective (up to float rounding). Every step
is exact:

1. **Links merge decisions.** Decisions connected by links become one
   decision whose options are the tuples of corresponding options that are
   consistent around every link (options without a counterpart are dropped).
   Unary costs, resource weights and pins of the members are combined; edges
   between two merged groups are re-indexed and summed into one edge, so 32
   linked transformer layers cost one layer's worth of variables; an edge
   inside one group only ever pays its diagonal and becomes a unary cost.
2. **Forbidden options are dropped**: infinite unary cost, pinned out, no
   finite pair left on some edge (arc consistency), or unable to meet a
   resource bound whatever the others choose; to a fixpoint.
3. **Dominated options and pairs are dropped.** Switching a decision from
   option ``i`` to ``k`` changes the cost by at most
   ``u[k] - u[i] + sum over its edges of max_j (M[k][j] - M[i][j])``. When
   that bound is ``<= 0`` and the switch cannot break a resource bound,
   ``i`` goes (among equivalent options the lowest id stays). When the bound
   with one edge's ``max_j`` replaced by the entry of the neighbour's option
   ``j`` is ``< 0``, no optimum pairs ``i`` with ``j``: that pair becomes
   ``inf`` (the ILP creates no variable for it).
4. **Small pieces are folded away**: separable edge matrices
   (``c[i][j] == r[i] + s[j]``, zero matrices included) become unary costs;
   a decision with one option left is fixed and its edges folded into its
   neighbours' unary costs (its resource weights into the bounds); a decision
   outside resource constraints with at most two neighbours is eliminated
   (``min`` over its options folded into a neighbour's unary costs or into an
   edge between its two neighbours, when that does not grow the number of
   option pairs), its best option per neighbour choice recorded for
   :meth:`Presolved.expand`.

Constant costs (fixed decisions) are added to the unary costs of the first
remaining decision, so the reduced objective equals the original objective.
The reduced problem has no pins and no links.

Example::

    >>> from solver.problem import Decision, Edge, Link, Problem
    >>> p = Problem(
    ...     decisions=[Decision("l0", ["R", "S0"], [1.0, 0.5]),
    ...                Decision("l1", ["R", "S0"], [1.0, 0.5]),
    ...                Decision("x", ["R", "S0"], [0.0, 0.0])],
    ...     edges=[Edge("l0", "x", 0, [[0.0, 3.0], [3.0, 0.0]]),
    ...            Edge("l1", "x", 1, [[0.0, 3.0], [3.0, 0.0]])],
    ...     links=[Link("layers", "l0", "l1", [0, 1])],
    ... )
    >>> pre = presolve(p)
    >>> pre.stats.merged_by_links, pre.stats.decisions_after  # all decided
    (1, 0)
    >>> pre.expand({d.name: 0 for d in pre.problem.decisions})
    {'l0': 1, 'l1': 1, 'x': 1}
    >>> pre.problem.decisions[0].costs  # a stand-in carrying the constant optimum
    [1.0]
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .problem import Decision, Edge, PresolveStats, Problem, ResourceConstraint

logger = logging.getLogger(__name__)

__all__ = ["PresolveInfeasible", "Presolved", "presolve"]

# Relative tolerance (to the matrix's largest entry) of the separability test.
SEPARABLE_RTOL = 1e-12
# How many times the dominance tests (options, then pairs) may run on one
# decision. Re-running them whenever a neighbour shrinks reaches a fixpoint,
# but on a 32-layer transformer that doubles presolve time to shrink the ILP
# by another 5%; once is the better deal.
DOMINANCE_ROUNDS = 1
# Tolerance of conditional (pair) dominance, relative to the largest costs
# involved: a pair is only dropped when another option is better by more.
PAIR_RTOL = 1e-9
# Relative slack when a resource bound rules an option out: only options that
# miss the bound clearly are dropped, leaving borderline ones to the ILP.
RESOURCE_RTOL = 1e-9
# Name of the stand-in decision (one option) carrying the constant cost when
# presolve decides everything; not counted in PresolveStats.decisions_after.
CONSTANT_DECISION = "__presolve_constant__"

_chain = itertools.chain.from_iterable


class PresolveInfeasible(ValueError):
    """Presolve proved the problem infeasible (the message says where and why)."""


@dataclass
class Presolved:
    """A reduced problem and the way back to the original decisions.

    ``problem`` is the reduced problem, ``stats`` what shrank. ``timings``
    maps presolve phases (``merge``, ``reduce``, ``emit``) to seconds.
    """

    problem: Problem
    stats: PresolveStats
    timings: dict[str, float] = field(default_factory=dict)
    # How to expand (filled by presolve(); empty means "nothing was reduced").
    _groups: list[_Group] | None = field(default=None, repr=False)
    _final: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict, repr=False)
    _steps: list[tuple] = field(default_factory=list, repr=False)
    _names: list[str] = field(default_factory=list, repr=False)  # original order

    def expand(self, reduced_choice: dict[str, int]) -> dict[str, int]:
        """Choice for every original decision (original option ids).

        ``reduced_choice`` maps every decision of :attr:`problem` to an option
        id of the reduced problem.
        """
        if self._groups is None:
            return {d.name: int(reduced_choice[d.name]) for d in self.problem.decisions}
        root: dict[int, int] = {}  # group -> chosen option in its root's ids
        for name, (g, alive) in self._final.items():
            if name not in reduced_choice:
                raise KeyError(f"reduced choice has no option for {name!r}")
            t = reduced_choice[name]
            if not isinstance(t, (int, np.integer)) or not 0 <= t < len(alive):
                raise ValueError(
                    f"reduced choice {t!r} for {name!r} out of range 0..{len(alive) - 1}"
                )
            root[g] = int(alive[t])
        for step in reversed(self._steps):
            kind, g = step[0], step[1]
            if kind == "fix":
                root[g] = step[2]
            elif kind == "elim1":
                _, _, a, table = step
                root[g] = table[root[a]]
            else:  # "elim2"
                _, _, a, b, pos_a, pos_b, table = step
                root[g] = int(table[pos_a[root[a]], pos_b[root[b]]])
        out: dict[str, int] = {}
        for g, grp in enumerate(self._groups):
            r = root[g]
            for name, omap in zip(grp.members, grp.omaps):
                out[name] = r if omap is None else int(omap[r])
        return {name: out[name] for name in self._names}


@dataclass
class _Group:
    """Decisions merged by links. Option ids are those of ``root`` (members[0])."""

    members: list[str]
    # Per member: root option -> member option (-1: no counterpart); None when
    # the member is the root itself.
    omaps: list[np.ndarray | None]


class _Edge:
    __slots__ = ("u", "v", "M", "arg", "flip", "clean", "has_inf")

    def __init__(self, u: int, v: int, M: np.ndarray, arg: int, flip: bool):
        self.u, self.v, self.M = u, v, M  # M[i][j]: option i of u, j of v
        self.arg, self.flip = arg, flip  # emitted as v -> u when flip
        self.clean = False  # checked (arc consistency, separability) since last change
        self.has_inf: bool | None = None  # None: unknown


class _Resource:
    __slots__ = ("name", "terms", "low", "high", "orig", "fixed")

    def __init__(self, name, terms, low, high):
        self.name = name
        self.terms: dict[int, np.ndarray] = terms  # group -> weight per alive option
        self.low: float | None = low  # shifted by the weights of fixed decisions
        self.high: float | None = high
        self.orig = (low, high)
        self.fixed = 0.0  # sum of the weights of fixed decisions


def presolve(problem: Problem) -> Presolved:
    """Shrink ``problem`` exactly; see the module docstring for the steps.

    Raises :class:`PresolveInfeasible` when presolve proves that no choice
    satisfies the constraints (a decision loses all its options, or a
    resource bound cannot be met).
    """
    t0 = time.perf_counter()
    # Presolve creates no reference cycles; a full collection over a big
    # problem's millions of cost rows would cost more than presolve itself.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        r = _Reducer(problem)
        r.merge()
        t1 = time.perf_counter()
        r.reduce()
        t2 = time.perf_counter()
        out = r.emit()
        t3 = time.perf_counter()
    finally:
        if gc_was_enabled:
            gc.enable()
    out.timings = {"merge": t1 - t0, "reduce": t2 - t1, "emit": t3 - t2}
    s = out.stats
    logger.info(
        "presolve %r: decisions %d -> %d, options %d -> %d, edges %d -> %d, "
        "pairs %d -> %d (%d merged by links, %d fixed, %d eliminated, "
        "%d options forbidden, %d dominated) in %.3fs",
        problem.name,
        s.decisions_before,
        s.decisions_after,
        s.options_before,
        s.options_after,
        s.edges_before,
        s.edges_after,
        s.pairs_before,
        s.pairs_after,
        s.merged_by_links,
        s.decisions_fixed,
        s.decisions_eliminated,
        s.options_removed_forbidden,
        s.options_removed_dominated,
        t3 - t0,
    )
    logger.debug("presolve timings: %s", out.timings)
    return out


class _Reducer:
    """The mutable working state of one presolve run."""

    def __init__(self, problem: Problem):
        self.p = problem
        self.stats = PresolveStats(
            decisions_before=len(problem.decisions),
            options_before=sum(len(d.options) for d in problem.decisions),
            edges_before=len(problem.edges),
            pairs_before=sum(len(e.costs) * len(e.costs[0]) for e in problem.edges if e.costs),
        )
        self.groups: list[_Group] = []
        self.alive: list[np.ndarray] = []  # group -> alive root option ids
        self.unary: list[np.ndarray] = []
        self.active: list[bool] = []
        self.adj: list[dict[int, int]] = []  # group -> {neighbour: edge id}
        self.edges: dict[int, _Edge] = {}
        self.next_eid = 0
        self.resources: list[_Resource] = []
        self.res_of: list[list[_Resource]] = []
        self.const = 0.0
        self.steps: list[tuple] = []
        self.queue: deque[int] = deque()
        self.queued: list[bool] = []
        self.dom_queue: deque[int] = deque()
        self.dom_queued: list[bool] = []
        self.pair_queue: deque[int] = deque()
        self.pair_queued: list[bool] = []
        self.res_dirty: dict[int, _Resource] = {}

    # ------------------------------------------------------------------ merge

    def merge(self) -> None:
        p = self.p
        decs = p.decisions
        index = {d.name: i for i, d in enumerate(decs)}
        group_of = [-1] * len(decs)
        # Per decision: its option for each alive option of its group (None:
        # identity, all options alive).
        sel: list[np.ndarray | None] = [None] * len(decs)
        pins_on: dict[int, list] = {}
        for pin in p.pins:
            pins_on.setdefault(index[pin.decision], []).append(pin)

        comps = self._link_components(index)
        in_comp = {i for comp in comps for i in comp[0]}
        plan: list[tuple] = []  # group -> (root idx, members, omaps, valid, cause)
        for i in range(len(decs)):
            if i in in_comp:
                continue
            plan.append((i, [i], [None], None, None))
        for members, omaps, valid, cause in comps:
            plan.append((members[0], members, omaps, valid, cause))
        plan.sort(key=lambda t: t[0])

        for g, (root, members, omaps, valid, cause) in enumerate(plan):
            self.groups.append(_Group([decs[m].name for m in members], omaps))
            n_root = len(decs[root].options)
            removed_by_links = 0
            if valid is None:
                alive = np.arange(n_root)
            else:
                alive = np.flatnonzero(valid)
                removed_by_links = n_root - len(alive)
                if not len(alive):
                    raise PresolveInfeasible(self._msg(g, cause))
            # Member option per alive option, unary costs summed over members
            # (repeated layers: equal cost lists are counted, not added).
            unary = None
            same: dict[int, list] = {}  # id(sel) -> [sel, costs, count]
            for m, omap in zip(members, omaps):
                group_of[m] = g
                s = None if omap is None else omap[alive]
                if s is not None or removed_by_links:
                    s = alive if s is None else s
                sel[m] = s
                costs = decs[m].costs
                if omap is not None or s is None:  # s is shared by all users of omap
                    entry = same.get(id(omap))
                    if entry is None:
                        same[id(omap)] = [s, costs, 1]
                        continue
                    if costs is entry[1] or costs == entry[1]:
                        entry[2] += 1
                        continue
                c = np.fromiter(costs, float, len(costs))
                c = c if s is None else c[s]
                unary = c if unary is None else unary + c
            for s, costs, count in same.values():
                c = np.fromiter(costs, float, len(costs))
                c = (c if s is None else c[s]) * count
                unary = c if unary is None else unary + c
            keep = np.isfinite(unary)
            why = "every option has an infinite unary cost"
            for m in members:
                for pin in pins_on.get(m, ()):
                    s = sel[m] if sel[m] is not None else alive
                    keep &= np.isin(s, pin.allowed)
                    why = f"pin {pin.name!r} on {decs[m].name!r} allows {sorted(pin.allowed)}"
            if cause and removed_by_links:
                why = cause + "; " + why
            n_kept = int(keep.sum())
            self.stats.options_removed_forbidden += removed_by_links + len(keep) - n_kept
            if n_kept == 0:
                raise PresolveInfeasible(self._msg(g, why))
            if n_kept < len(keep):
                alive = alive[keep]
                unary = unary[keep]
                for m in members:
                    sel[m] = alive if sel[m] is None else sel[m][keep]
            self.alive.append(alive)
            self.unary.append(unary)
        n = len(self.groups)
        self.stats.merged_by_links = len(decs) - n
        self.active = [True] * n
        self.adj = [{} for _ in range(n)]
        self.res_of = [[] for _ in range(n)]
        self.queued = [False] * n
        self.dom_queued = [False] * n
        self.pair_queued = [False] * n
        self.dom_runs = [0] * n
        self.pair_runs = [0] * n

        for rc in p.resources:
            terms: dict[int, np.ndarray] = {}
            for name, weights in rc.terms.items():
                i = index[name]
                w = np.fromiter(weights, float, len(weights))
                w = w if sel[i] is None else w[sel[i]]
                g = group_of[i]
                terms[g] = terms[g] + w if g in terms else w
            res = _Resource(rc.name, terms, rc.low, rc.high)
            self.resources.append(res)
            for g in terms:
                self.res_of[g].append(res)
            self.res_dirty[id(res)] = res
        # Last: folding diagonals may restrict options, re-slicing what exists.
        self._merge_edges(index, group_of, sel)

    def _link_components(self, index: dict[str, int]) -> list[tuple]:
        """Per linked component: (members, omaps, valid root options, cause)."""
        p = self.p
        if not p.links:
            return []
        decs = p.decisions
        ranges: dict[int, list[int]] = {}
        adj: dict[int, list] = {}
        for k, link in enumerate(p.links):
            a, b = index[link.a], index[link.b]
            na = len(decs[a].options)
            ident = ranges.get(na) or ranges.setdefault(na, list(range(na)))
            if na == len(decs[b].options) and link.mapping == ident:
                mp = None  # identity: the common case (repeated layers)
            else:
                mp = np.array([-1 if o is None else o for o in link.mapping], dtype=np.int64)
            adj.setdefault(a, []).append((k, b, mp, True))
            adj.setdefault(b, []).append((k, a, mp, False))
        out = []
        seen: set[int] = set()
        # Connected components by BFS over links (networkx would cost 0.3 s to
        # import); starting from the lowest index makes it the component's root.
        for root in sorted(adj):
            if root in seen:
                continue
            n_root = len(decs[root].options)
            # omap[m][r]: option of m corresponding to root option r (-1: none).
            # Identity links share their parent's array.
            omap: dict[int, np.ndarray] = {root: np.arange(n_root)}
            tree: set[int] = set()
            queue = deque([root])
            while queue:
                x = queue.popleft()
                ox = omap[x]
                for k, y, mp, forward in adj[x]:
                    if y in omap:
                        continue
                    if mp is None:
                        oy = ox
                    elif forward:
                        oy = np.where(ox >= 0, mp[ox], -1)
                    else:
                        inv = np.full(len(decs[x].options), -1, dtype=np.int64)
                        ok = mp >= 0
                        inv[mp[ok]] = np.flatnonzero(ok)
                        oy = np.where(ox >= 0, inv[ox], -1)
                    omap[y] = oy
                    tree.add(k)
                    queue.append(y)
            members = sorted(omap)
            seen.update(members)
            valid = np.ones(n_root, dtype=bool)
            for arr in {id(o): o for o in omap.values()}.values():
                valid &= arr >= 0
            names = []
            for m in members:
                for k, y, mp, forward in adj[m]:
                    if not forward:
                        continue
                    names.append(p.links[k].name)
                    oa, ob = omap[m], omap[y]
                    if k in tree or (mp is None and oa is ob):
                        continue
                    if mp is None:
                        valid &= oa == ob
                    else:
                        valid &= (oa >= 0) & (mp[np.maximum(oa, 0)] == ob)
            names = list(dict.fromkeys(names))
            cause = (
                f"links {', '.join(map(repr, names))} leave no consistent "
                f"correspondence between the options of "
                f"{', '.join(repr(p.decisions[m].name) for m in members[:4])}"
                + (f" and {len(members) - 4} more" if len(members) > 4 else "")
            )
            base = omap[root]
            omaps = [
                None if omap[m] is base and len(decs[m].options) == n_root else omap[m]
                for m in members
            ]
            out.append((members, omaps, valid, cause))
        return out

    def _merge_edges(self, index, group_of, sel) -> None:
        decs = self.p.decisions
        buckets: dict[tuple, list] = {}
        first: dict[tuple[int, int], Edge] = {}
        diags: dict[int, np.ndarray] = {}  # group -> summed diagonals
        sigs: dict[int, bytes] = {}
        sig = [None if s is None else sigs.get(id(s)) or sigs.setdefault(id(s), s.tobytes())
               for s in sel]
        n_opt = [len(d.options) for d in decs]
        for e in self.p.edges:
            ip, ic = index[e.producer], index[e.consumer]
            gp, gc = group_of[ip], group_of[ic]
            if gp == gc:
                # Both ends take corresponding options: only the diagonal is paid.
                rows = sel[ip] if sel[ip] is not None else range(n_opt[ip])
                cols = sel[ic] if sel[ic] is not None else range(n_opt[ic])
                diag = [e.costs[r][c] for r, c in zip(rows, cols)]
                diag = np.array(diag, dtype=float)
                diags[gp] = diags[gp] + diag if gp in diags else diag
                continue
            key = (gp, gc) if gp < gc else (gc, gp)
            # Edges re-indexed the same way (identity: None) can be compared as is.
            sub = (key, sig[ip], n_opt[ip], sig[ic], n_opt[ic], gp > gc)
            items = buckets.get(sub)
            if items is None:
                buckets[sub] = [(e, ip, ic)]
                first.setdefault(key, e)
            else:
                items.append((e, ip, ic))
        by_key: dict[tuple[int, int], list] = {}
        for sub, items in buckets.items():
            by_key.setdefault(sub[0], []).append((sub, items))
        for key, subs in by_key.items():
            total = None
            for (_, _, n_p, _, n_c, flip), items in subs:
                e0, ip, ic = items[0]
                mats = [e0.costs]
                n_same = 1
                for e, _, _ in items[1:]:
                    # Repeated layers usually have equal matrices: count, don't add.
                    if e.costs is e0.costs or e.costs == e0.costs:
                        n_same += 1
                    else:
                        mats.append(e.costs)
                A = _matrix(e0.costs, n_p, n_c)
                if n_same > 1:
                    A = A * n_same
                if len(mats) > 1:
                    rest = np.fromiter(_chain(_chain(mats[1:])), float,
                                       (len(mats) - 1) * n_p * n_c)
                    A = A + rest.reshape(len(mats) - 1, n_p, n_c).sum(0)
                rows, cols = sel[ip], sel[ic]
                if rows is not None and cols is not None:
                    A = A[np.ix_(rows, cols)]
                elif rows is not None:
                    A = A[rows]
                elif cols is not None:
                    A = A[:, cols]
                if flip:
                    A = A.T
                total = A if total is None else total + A
            e0 = first[key]
            u, v = key
            self._add_edge(u, v, total, e0.arg_index, group_of[index[e0.producer]] != u)
        # Only now: restricting options re-slices edges, not ``sel``.
        for g, diag in diags.items():
            self._add_unary(g, diag, "an edge between two of its linked decisions forbids it")

    # ----------------------------------------------------------------- reduce

    def reduce(self) -> None:
        """Apply the reductions to a fixpoint.

        Cheap ones (arc consistency, separable edges, fixing, elimination)
        run first; dominance, the costly test, only once they have settled.
        """
        for g in range(len(self.groups)):
            self._push(g)
        while True:
            if self.queue:
                g = self.queue.popleft()
                self.queued[g] = False
                if self.active[g]:
                    self._process(g)
            elif self.res_dirty:
                dirty = list(self.res_dirty.values())
                self.res_dirty.clear()
                for res in dirty:
                    if res in self.resources:
                        self._propagate_resource(res)
            elif self.dom_queue:
                g = self.dom_queue.popleft()
                self.dom_queued[g] = False
                if self.active[g] and len(self.alive[g]) > 1 and self.dom_runs[g] < DOMINANCE_ROUNDS:
                    self.dom_runs[g] += 1
                    self._dominance(g, pairs=False)
            elif self.pair_queue:
                # Last: a forbidden pair in k's row keeps k from dominating.
                g = self.pair_queue.popleft()
                self.pair_queued[g] = False
                if self.active[g] and len(self.alive[g]) > 1 and self.pair_runs[g] < DOMINANCE_ROUNDS:
                    self.pair_runs[g] += 1
                    self._dominance(g, pairs=True)
            else:
                break

    def _push(self, g: int) -> None:
        if not self.queued[g]:
            self.queued[g] = True
            self.queue.append(g)
        if not self.dom_queued[g]:
            self.dom_queued[g] = True
            self.dom_queue.append(g)
        if not self.pair_queued[g]:
            self.pair_queued[g] = True
            self.pair_queue.append(g)

    def _process(self, g: int) -> None:
        for nb, eid in list(self.adj[g].items()):
            e = self.edges.get(eid)
            if e is None or e.clean:
                continue
            M = e.M
            if e.has_inf is not False:
                finite = np.isfinite(M)
                e.has_inf = not finite.all()
            if e.has_inf:
                # Arc consistency: an option with no finite pair is forbidden.
                why = (
                    f"edge {self._name(e.u)!r} ~ {self._name(e.v)!r} forbids "
                    f"every pair with the remaining options of the other end"
                )
                self._restrict(e.u, finite.any(1), why)
                self._restrict(e.v, finite.any(0), why)
                if eid in self.edges:
                    e.clean = True
                continue
            if _separable(M):
                self._drop_edge(eid)
                self.stats.edges_folded += 1
                self._add_unary(e.u, M[:, 0])
                self._add_unary(e.v, M[0, :] - M[0, 0])
            else:
                e.clean = True
        if not self.active[g]:
            return
        if len(self.alive[g]) == 1:
            self._fix(g, 0)
        elif not self.res_of[g] and len(self.adj[g]) <= 2:
            self._eliminate(g)

    def _restrict(self, g: int, keep: np.ndarray, why: str, dominated: bool = False) -> None:
        n_removed = len(keep) - int(np.count_nonzero(keep))
        if n_removed == 0:
            return
        if n_removed == len(keep):
            raise PresolveInfeasible(self._msg(g, why))
        if dominated:
            self.stats.options_removed_dominated += n_removed
        else:
            self.stats.options_removed_forbidden += n_removed
            logger.debug("%s: %d options forbidden: %s", self._name(g), n_removed, why)
        self.alive[g] = self.alive[g][keep]
        self.unary[g] = self.unary[g][keep]
        for nb, eid in self.adj[g].items():
            e = self.edges[eid]
            e.M = e.M[keep] if e.u == g else e.M[:, keep]
            e.clean = False
            if e.has_inf:
                e.has_inf = None  # may have lost its inf entries
            self._push(nb)
        for res in self.res_of[g]:
            res.terms[g] = res.terms[g][keep]
            self.res_dirty[id(res)] = res
        self._push(g)

    def _dominance(self, g: int, pairs: bool = True) -> None:
        """Drop options of ``g``, and option pairs on its edges, that no optimum needs.

        Switching ``g`` from ``i`` to ``k`` changes the cost by at most
        ``gain[k, i] = u[k] - u[i] + sum over edges of max_j (M[k][j] - M[i][j])``
        (pairs forbidden for ``i`` are ignored: no solution uses them). When
        the switch cannot break a resource bound:

        * ``gain[k, i] <= 0``: some optimum avoids ``i`` (option dominance);
        * the same bound with one edge's ``max_j`` replaced by its entry for
          the neighbour's option ``j`` is ``< 0``: no optimum pairs ``i`` with
          that ``j``, which becomes forbidden (conditional dominance). Strict,
          so all such pairs can go at once.
        """
        u = self.unary[g]
        n = len(u)
        gain = u[:, None] - u[None, :]  # gain[k, i]: worst cost change from i to k
        switch_ok = None  # switch_ok[k, i]: i -> k keeps every resource bound
        for res in self.res_of[g]:
            w = res.terms[g]
            if res.high is not None:
                switch_ok = _and(switch_ok, w[:, None] <= w[None, :])
            if res.low is not None:
                switch_ok = _and(switch_ok, w[:, None] >= w[None, :])
        incident = list(self.adj[g].values())
        mats = []
        has_inf = False
        for eid in incident:
            e = self.edges[eid]
            mats.append(e.M if e.u == g else e.M.T)
            has_inf = has_inf or e.has_inf is not False
        cuts = []
        if mats:
            C = np.hstack(mats) if len(mats) > 1 else mats[0]
            widths = [m.shape[1] for m in mats]
            starts = np.cumsum([0] + widths[:-1])
            # A pair forbidden for i must not count: with +inf in C[i] and a
            # huge finite value for inf in C[k], C[k] - C[i] is -inf there,
            # and still ~+inf where only k's pair is forbidden.
            Ck = np.where(np.isinf(C), 1e300, C) if has_inf else C
            if n * n * C.shape[1] <= 4_000_000:
                D = Ck[:, None, :] - C[None, :, :]  # D[k, i, j]
                worst = np.maximum.reduceat(D, starts, axis=2)  # [k, i, edge]
                if pairs:
                    cuts = self._pair_cuts(u, C, D, gain, worst, switch_ok, starts, widths)
                gain += worst.sum(2)
            else:
                for k in range(n):
                    D = Ck[k][None, :] - C
                    gain[k] += np.maximum.reduceat(D, starts, axis=1).sum(1)
        for eid, cut in zip(incident, cuts):
            if cut is None:
                continue
            e = self.edges[eid]
            M = e.M.copy()
            M[cut if e.u == g else cut.T] = np.inf
            e.M, e.has_inf, e.clean = M, True, False
            self.stats.pairs_removed_dominated += int(np.count_nonzero(cut))
            self._push(e.u)
            self._push(e.v)
        ok = gain <= 0.0  # nan (inf - inf across edges): not comparable
        if switch_ok is not None:
            ok &= switch_ok
        np.fill_diagonal(ok, False)
        if not ok.any():
            return
        # Remove i when an option still kept beats it strictly, or ties with it
        # and has a lower id. One at a time: float rounding may break
        # transitivity, and every removed option must keep a kept dominator.
        le = ok.tolist()
        keep = [True] * n
        for i in np.flatnonzero(ok.any(0)).tolist():
            for k in range(n):
                if keep[k] and le[k][i] and (k < i or not le[i][k]):
                    keep[i] = False
                    break
        self._restrict(g, np.array(keep), "dominated", dominated=True)

    @staticmethod
    def _pair_cuts(u, C, D, udiff, worst, switch_ok, starts, widths) -> list:
        """Per incident edge: the (i, j) pairs that no optimum uses, or None."""
        n = len(u)
        finite = np.isfinite(C)
        # Strictly below -tol: rounding can neither fake nor cycle a strict gain.
        scale = float(np.abs(u).max()) + sum(
            float(np.abs(np.where(finite[:, a:a + w], C[:, a:a + w], 0.0)).max())
            for a, w in zip(starts.tolist(), widths)
        )
        tol = PAIR_RTOL * scale
        allowed = ~np.eye(n, dtype=bool)
        if switch_ok is not None:
            allowed &= switch_ok
        # The bound without edge t's worst case, as udiff + (sum of the others):
        # subtracting worst[..., t] from the total would cancel huge values.
        n_edges = worst.shape[2]
        before = np.zeros((n, n, n_edges))
        after = np.zeros((n, n, n_edges))
        if n_edges > 1:
            before[:, :, 1:] = np.cumsum(worst[:, :, :-1], axis=2)
            after[:, :, :-1] = np.cumsum(worst[:, :, :0:-1], axis=2)[:, :, ::-1]
        out = []
        for t, (a, w) in enumerate(zip(starts.tolist(), widths)):
            rest = udiff + before[:, :, t] + after[:, :, t]
            cond = (rest[:, :, None] + D[:, :, a:a + w]) < -tol
            cond &= allowed[:, :, None]
            cut = cond.any(0) & finite[:, a:a + w]  # [i, j], newly forbidden only
            out.append(cut if cut.any() else None)
        return out

    def _fix(self, g: int, t: int) -> None:
        """Decide ``g`` as its alive option ``t``; fold everything it touches."""
        self.const += float(self.unary[g][t])
        self.active[g] = False
        self.steps.append(("fix", g, int(self.alive[g][t])))
        self.stats.decisions_fixed += 1
        folds = []
        for nb, eid in list(self.adj[g].items()):
            e = self.edges[eid]
            folds.append((nb, e.M[t, :] if e.u == g else e.M[:, t]))
            self._drop_edge(eid)
            self.stats.edges_folded += 1
        for res in self.res_of[g]:
            w = float(res.terms.pop(g)[t])
            res.fixed += w
            if res.low is not None:
                res.low -= w
            if res.high is not None:
                res.high -= w
            self.res_dirty[id(res)] = res
        self.res_of[g] = []
        for nb, vec in folds:
            self._add_unary(nb, vec)

    def _eliminate(self, g: int) -> None:
        """Fold a decision with at most two neighbours into them (min over its options)."""
        u = self.unary[g]
        nbs = list(self.adj[g].items())
        if not nbs:
            self._fix(g, int(np.argmin(u)))
            self.stats.decisions_fixed -= 1
            self.stats.decisions_eliminated += 1
            return
        mats = []
        for nb, eid in nbs:
            e = self.edges[eid]
            mats.append((nb, e.M if e.u == g else e.M.T))
        if len(mats) == 1:
            (a, Ma), = mats
            T = u[:, None] + Ma
            arg = T.argmin(0)
            best = T[arg, np.arange(T.shape[1])]
            table = dict(zip(self.alive[a].tolist(), self.alive[g][arg].tolist()))
            self.steps.append(("elim1", g, a, table))
            self._drop_edge(nbs[0][1])
            self.active[g] = False
            self.stats.decisions_eliminated += 1
            self._add_unary(a, best)
            return
        (a, Ma), (b, Mb) = mats
        n_g, n_a, n_b = len(u), Ma.shape[1], Mb.shape[1]
        existing = self.adj[a].get(b)
        if existing is None and n_a * n_b > n_g * (n_a + n_b):
            return  # would grow the number of pairs
        T = u[:, None, None] + Ma[:, :, None] + Mb[:, None, :]
        arg = T.argmin(0)
        best = np.take_along_axis(T, arg[None], 0)[0]
        pos_a = {int(r): i for i, r in enumerate(self.alive[a])}
        pos_b = {int(r): i for i, r in enumerate(self.alive[b])}
        self.steps.append(("elim2", g, a, b, pos_a, pos_b, self.alive[g][arg]))
        for _, eid in nbs:
            self._drop_edge(eid)
        self.active[g] = False
        self.stats.decisions_eliminated += 1
        if existing is not None:
            e = self.edges[existing]
            e.M = e.M + (best if e.u == a else best.T)
            e.clean = False
            e.has_inf = None
        else:
            self._add_edge(a, b, best, 0, False)
        self._push(a)
        self._push(b)

    def _propagate_resource(self, res: _Resource) -> None:
        if not res.terms:
            self.resources.remove(res)
            self._check_constant_resource(res)
            return
        lo = {g: float(w.min()) for g, w in res.terms.items()}
        hi = {g: float(w.max()) for g, w in res.terms.items()}
        sum_lo, sum_hi = sum(lo.values()), sum(hi.values())
        for g, w in list(res.terms.items()):
            keep = np.ones(len(w), dtype=bool)
            if res.high is not None:
                keep &= sum_lo - lo[g] + w <= res.high + _slack(res.high)
            if res.low is not None:
                keep &= sum_hi - hi[g] + w >= res.low - _slack(res.low)
            self._restrict(
                g, keep, f"resource constraint {res.name!r} cannot be met with these options"
            )

    def _check_constant_resource(self, res: _Resource) -> None:
        if (res.high is not None and 0.0 > res.high + _slack(res.high)) or (
            res.low is not None and 0.0 < res.low - _slack(res.low)
        ):
            low, high = res.orig
            raise PresolveInfeasible(
                f"resource constraint {res.name!r} cannot be met: the only options "
                f"left to its decisions sum to {res.fixed:g}, outside "
                f"[{low if low is not None else '-inf'}, "
                f"{high if high is not None else 'inf'}]"
            )

    # ---------------------------------------------------------------- helpers

    def _add_edge(self, u: int, v: int, M: np.ndarray, arg: int, flip: bool) -> None:
        eid = self.next_eid
        self.next_eid += 1
        self.edges[eid] = _Edge(u, v, M, arg, flip)
        self.adj[u][v] = eid
        self.adj[v][u] = eid

    def _drop_edge(self, eid: int) -> None:
        e = self.edges.pop(eid)
        del self.adj[e.u][e.v]
        del self.adj[e.v][e.u]
        self._push(e.u)
        self._push(e.v)

    def _add_unary(
        self, g: int, vec: np.ndarray, why: str = "a decided neighbour forbids it"
    ) -> None:
        self.unary[g] = self.unary[g] + vec
        self._push(g)
        bad = ~np.isfinite(self.unary[g])
        if bad.any():
            self._restrict(g, ~bad, why)

    def _name(self, g: int) -> str:
        return self.groups[g].members[0]

    def _msg(self, g: int, why: str) -> str:
        members = self.groups[g].members
        who = f"decision {members[0]!r}"
        if len(members) > 1:
            others = ", ".join(map(repr, members[1:4]))
            more = f" and {len(members) - 4} more" if len(members) > 4 else ""
            who += f" (linked with {others}{more})"
        return f"{who} has no option left: {why}"

    # ------------------------------------------------------------------- emit

    def emit(self) -> Presolved:
        p = self.p
        labels = {}
        decisions: list[Decision] = []
        final: dict[str, tuple[int, np.ndarray]] = {}
        for g, grp in enumerate(self.groups):
            if not self.active[g]:
                continue
            name = grp.members[0]
            labels = p.decisions[self._root_index(name)].options
            unary = self.unary[g]
            if not decisions and self.const:
                unary = unary + self.const  # the constant rides on one decision
            decisions.append(
                Decision(name, [labels[r] for r in self.alive[g].tolist()], unary.tolist())
            )
            final[name] = (g, self.alive[g])
        s = self.stats
        # Counted before the stand-in below: it decides nothing.
        s.decisions_after = len(decisions)
        s.options_after = sum(len(d.options) for d in decisions)
        if not decisions:
            name = CONSTANT_DECISION
            existing = {d.name for d in p.decisions}
            while name in existing:
                name += "_"
            decisions.append(Decision(name, ["const"], [self.const]))
        edges = []
        for e in sorted(self.edges.values(), key=lambda e: (e.u, e.v)):
            nu, nv = self._name(e.u), self._name(e.v)
            if e.flip:
                edges.append(Edge(nv, nu, e.arg, e.M.T.tolist()))
            else:
                edges.append(Edge(nu, nv, e.arg, e.M.tolist()))
        resources = []
        for res in self.resources:
            terms = {self._name(g): w.tolist() for g, w in sorted(res.terms.items())}
            resources.append(ResourceConstraint(res.name, terms, res.low, res.high))
        reduced = Problem(
            decisions=decisions,
            edges=edges,
            resources=resources,
            name=p.name,
            metadata=dict(p.metadata),
        )
        s.edges_after = len(edges)
        s.pairs_after = sum(e.M.size for e in self.edges.values())
        return Presolved(
            reduced,
            s,
            _groups=self.groups,
            _final=final,
            _steps=self.steps,
            _names=[d.name for d in p.decisions],
        )

    def _root_index(self, name: str) -> int:
        if not hasattr(self, "_index"):
            self._index = {d.name: i for i, d in enumerate(self.p.decisions)}
        return self._index[name]


def _matrix(rows: list[list[float]], n: int, m: int) -> np.ndarray:
    # fromiter over the flattened rows is ~3x faster than np.array(rows).
    return np.fromiter(_chain(rows), float, n * m).reshape(n, m)


def _and(a: np.ndarray | None, b: np.ndarray) -> np.ndarray:
    return b if a is None else a & b


def _separable(M: np.ndarray) -> bool:
    """``M[i][j] == a[i] + b[j]`` for all i, j (up to rounding)?"""
    n, m = M.shape
    if n == 1 or m == 1:
        return True
    # Quick rejection on one 2x2 minor (most matrices are not separable).
    c00, c0m, cn0, cnm = M[0, 0], M[0, -1], M[-1, 0], M[-1, -1]
    corner = max(abs(c00), abs(c0m), abs(cn0), abs(cnm))
    if abs(cnm - cn0 - c0m + c00) > SEPARABLE_RTOL * corner:
        return False
    tol = SEPARABLE_RTOL * float(np.abs(M).max())
    return float(np.abs(M - M[:, :1] - M[:1, :] + c00).max()) <= tol


def _slack(bound: float) -> float:
    return RESOURCE_RTOL * max(1.0, abs(bound)) if math.isfinite(bound) else 0.0
