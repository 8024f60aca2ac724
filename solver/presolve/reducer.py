"""The mutable working state of one presolve run, and emitting the result."""

from __future__ import annotations

from collections import deque

import numpy as np

from ..problem import Decision, Edge, PresolveStats, Problem, ResourceConstraint
from .model import CONSTANT_DECISION, Presolved, _Edge, _Group, _Resource
from .merge import MergePhase
from .reduce import ReducePhase


class Reducer(MergePhase, ReducePhase):
    """The mutable working state of one presolve run.

    The phases are split by file (merge.py, reduce.py) but share this state;
    the helpers below are what they use to change it.
    """

    def __init__(self, problem: Problem, check_costs: bool = False):
        self.p = problem
        # Check the edge matrices while merging (see presolve()).
        self.check_costs = check_costs
        self.stats = PresolveStats(
            decisions_before=len(problem.decisions),
            options_before=sum(len(d.options) for d in problem.decisions),
            edges_before=len(problem.edges),
            # pairs_before: counted by merge
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

    def _add_unary(self, g: int, vec: np.ndarray, why: str = "a decided neighbour forbids it") -> None:
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
            decisions.append(Decision(name, [labels[r] for r in self.alive[g].tolist()], unary.tolist()))
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
