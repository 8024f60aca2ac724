"""Explain infeasibility by naming the smallest conflicting set found.

Constraints sharing a ``name`` form a group (pins, links, resources).
:func:`diagnose` first looks for causes that involve no constraint at all (a
decision whose unary costs are all ``inf``; edges whose forbidden pairs leave
no assignment), then runs a deletion filter over the groups: starting from
all of them, groups are dropped for good while the problem stays infeasible
without them (in chunks of halving size, then one by one). What remains is
irreducible: removing any one of the remaining groups makes the problem
feasible.

Each step is a feasibility check (:func:`solver.ilp.build` with
``objective=False``), most of them settled by domain propagation alone.

Example::

    >>> from solver.problem import Decision, Pin, Problem
    >>> p = Problem(
    ...     decisions=[Decision("a", ["R", "S0"], [1.0, 0.5])],
    ...     pins=[Pin("want R", "a", [0]), Pin("want S0", "a", [1]),
    ...           Pin("anything", "a", [0, 1])],
    ... )
    >>> err = diagnose(p)
    >>> err.conflict
    ['want R', 'want S0']
    >>> print(err)
    Infeasible: constraints conflict: 'want R', 'want S0' (removing any one of them makes the problem feasible)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from .ilp import build
from .problem import Problem

logger = logging.getLogger(__name__)


class InfeasibleError(ValueError):
    """No assignment satisfies the problem.

    ``conflict`` lists the names of an irreducible set of conflicting
    constraint groups (empty when the cause involves no constraint);
    ``decisions`` and ``edges`` name decisions with no allowed option and
    edges (``"producer -> consumer"``) whose forbidden pairs conflict.
    """

    def __init__(
        self,
        message: str,
        conflict: list[str] | None = None,
        decisions: list[str] | None = None,
        edges: list[str] | None = None,
    ):
        super().__init__(message)
        self.conflict = list(conflict or [])
        self.decisions = list(decisions or [])
        self.edges = list(edges or [])


def diagnose(problem: Problem, *, backend=None) -> InfeasibleError | None:
    """An :class:`InfeasibleError` explaining why ``problem`` is infeasible,
    or ``None`` if it is feasible. ``backend`` is a backend name (default:
    the default backend)."""
    from .backends import get_backend

    solver = get_backend(backend)
    t0 = time.perf_counter()
    checks = 0

    cache: dict = {}  # edge matrices, converted once for all checks

    def feasible(p: Problem) -> bool:
        nonlocal checks
        checks += 1
        t = time.perf_counter()
        model = build(p, objective=False, cache=cache)
        if model.infeasible is not None:
            ok = False
        else:
            ok = solver.solve(model).status != "infeasible"
        logger.debug(
            "diagnose: check %d (%d x columns): %s in %.3fs",
            checks,
            model.num_x,
            "feasible" if ok else "infeasible",
            time.perf_counter() - t,
        )
        return ok

    try:
        dead = [d.name for d in problem.decisions if all(math.isinf(c) for c in d.costs)]
        if dead:
            names = ", ".join(repr(n) for n in dead)
            what = "decision" if len(dead) == 1 else "decisions"
            return InfeasibleError(
                f"Infeasible: {what} {names} {'has' if len(dead) == 1 else 'have'} "
                "no allowed option (every unary cost is inf)",
                decisions=dead,
            )

        groups = problem.constraint_names()
        if feasible(problem):
            return None
        keep = _deletion_filter(groups, lambda kept: feasible(_with_groups(problem, set(kept))))
        if not keep:  # infeasible without any constraint: forbidden pairs
            bare = dataclasses.replace(problem, pins=[], links=[], resources=[])
            edges = _edge_conflict(bare, feasible)
            names = ", ".join(edges)
            if len(edges) == 1:
                msg = f"Infeasible: edge {names} forbids every pair of allowed options"
            else:
                msg = (
                    f"Infeasible: forbidden option pairs on edges {names} conflict, "
                    "even without any constraint (lifting the forbidden pairs of "
                    "any one of them makes the problem feasible)"
                )
            return InfeasibleError(msg, edges=edges)
        names = ", ".join(repr(g) for g in keep)
        if len(keep) == 1:
            msg = f"Infeasible: constraint {names} cannot be satisfied (removing it makes the problem feasible)"
        else:
            msg = f"Infeasible: constraints conflict: {names} (removing any one of them makes the problem feasible)"
        return InfeasibleError(msg, conflict=keep)
    finally:
        logger.debug("diagnose: %d feasibility checks in %.3fs", checks, time.perf_counter() - t0)


def _deletion_filter(items: list, feasible) -> list:
    """An irreducible infeasible subset of ``items`` (all infeasible together).

    Drops chunks of halving size while the rest stays infeasible, ending
    with single items, so a small conflict among many groups costs about
    ``k log n`` checks instead of ``n``. Each survivor was tested alone
    against a superset of the result: dropping it made that superset
    feasible, so it makes the result feasible too.
    """
    seen: dict[tuple, bool] = {}

    def check(kept: list) -> bool:
        key = tuple(kept)
        if key not in seen:
            seen[key] = feasible(kept)
        return seen[key]

    keep = list(items)
    chunk = max(1, len(keep) // 2)
    while True:
        i = 0
        while i < len(keep):
            trial = keep[:i] + keep[i + chunk :]
            if not check(trial):
                keep = trial
            else:
                i += chunk
        if chunk == 1:
            return keep
        chunk = max(1, min(chunk // 2, len(keep) // 2))


def _with_groups(problem: Problem, keep: set[str]) -> Problem:
    return dataclasses.replace(
        problem,
        pins=[c for c in problem.pins if c.name in keep],
        links=[c for c in problem.links if c.name in keep],
        resources=[c for c in problem.resources if c.name in keep],
    )


def _edge_conflict(bare: Problem, feasible) -> list[str]:
    """Deletion filter over the edges holding forbidden pairs."""
    candidates = [k for k, e in enumerate(bare.edges) if any(math.inf in r for r in e.costs)]
    others = [e for e in bare.edges if not any(math.inf in r for r in e.costs)]
    keep = _deletion_filter(
        candidates,
        lambda kept: feasible(dataclasses.replace(bare, edges=others + [bare.edges[j] for j in kept])),
    )
    return [f"{bare.edges[k].producer!r} -> {bare.edges[k].consumer!r}" for k in keep]
