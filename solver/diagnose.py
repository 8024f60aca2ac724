"""Explain infeasibility by naming the smallest conflicting set found.

Constraints sharing a ``name`` form a group (pins, links, resources).
:func:`diagnose` first looks for causes that involve no constraint at all (a
decision whose unary costs are all ``inf``; edges whose forbidden pairs leave
no assignment), then runs a deletion filter over the groups: starting from
all of them, groups are dropped for good while the problem stays infeasible
without them (in chunks of halving size, then one by one). What remains is
irreducible: removing any one of the remaining groups makes the problem
feasible.

Each step is a feasibility check that stops on counted work, like a solve
(:mod:`solver.work`): presolve's propagation (which merges linked layers, so
a 32-layer model is checked at one layer's size), then the LP relaxation,
then a branch and bound of at most :data:`~solver.work.DIAGNOSIS_NODE_LIMIT`
MIP nodes (a model over :data:`~solver.work.DIAGNOSIS_MAX_COLUMNS` columns
is not solved). A check that runs out of work is *unknown*: the filter
keeps the group it tested, so what it names still conflicts, but that group
is not proven needed and the error says the diagnosis is partial
(:attr:`InfeasibleError.unproven`). So does every check after
:data:`~solver.work.DIAGNOSIS_MAX_CHECKS` checks or the caller's safety cap.
The filter runs over the other groups with every link kept first (cheap,
merged checks), then settles the links with one check without them.

For every resource constraint in the conflict, the smallest (largest, for a
``low`` bound) sum any choice reaches under the other named constraints
(and the links) is bounded by one more solve, the row's sum as objective
(:attr:`InfeasibleError.reachable`): "the memory budget is 72e9, and no plan
under the other constraints gets below 75.6e9".

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
import enum
import logging
import math
import time

import numpy as np

from .backends import SolverError, get_backend
from .ilp import build
from .problem import Problem
from .work import DIAGNOSIS_MAX_CHECKS, DIAGNOSIS_MAX_COLUMNS, DIAGNOSIS_NODE_LIMIT, SafetyCap

try:
    from . import presolve as _presolve
except ModuleNotFoundError as _exc:  # presolve is optional, as for solve()
    if _exc.name != f"{__package__}.presolve":
        raise
    _presolve = None

logger = logging.getLogger(__name__)

# unproven groups a message names before "and N more" (links come by the hundred)
_MAX_NAMED = 8
# conflicting groups a message names before "and N more"
_MAX_LISTED = 24


class InfeasibleError(ValueError):
    """No assignment satisfies the problem.

    ``conflict`` lists the names of a conflicting set of constraint groups
    (empty when the cause involves no constraint); ``decisions`` and
    ``edges`` name decisions with no allowed option and edges
    (``"producer -> consumer"``) whose forbidden pairs conflict.
    ``unproven``: the groups of ``conflict`` whose removal could not be
    checked within the diagnosis' work limits (empty: the set is
    irreducible). ``reachable``: per resource constraint of the conflict,
    ``(bound, reached)``: no choice under the other groups of the conflict
    gets its sum below ``bound`` (above it, for a ``low`` bound), and one
    gets it to ``reached`` (``None``: none found within the limits).
    """

    def __init__(
        self,
        message: str,
        conflict: list[str] | None = None,
        decisions: list[str] | None = None,
        edges: list[str] | None = None,
        unproven: list[str] | None = None,
        reachable: dict[str, tuple[float, float | None]] | None = None,
    ):
        super().__init__(message)
        self.conflict = list(conflict or [])
        self.decisions = list(decisions or [])
        self.edges = list(edges or [])
        self.unproven = list(unproven or [])
        self.reachable = dict(reachable or {})


class Verdict(enum.Enum):
    FEASIBLE = "feasible"
    INFEASIBLE = "infeasible"
    UNKNOWN = "unknown"  # the check ran out of work (or the safety cap came)


class FeasibilityChecker:
    """Feasibility checks of sub-problems, each stopping on counted work:
    presolve, the LP relaxation, :data:`DIAGNOSIS_NODE_LIMIT` MIP nodes.
    Past ``max_checks`` checks or the safety ``cap``, every check is
    :attr:`Verdict.UNKNOWN` without work."""

    def __init__(self, backend=None, cap: SafetyCap | None = None, max_checks: int = DIAGNOSIS_MAX_CHECKS):
        self.solver = get_backend(backend)
        self.cap = cap or SafetyCap(None)
        self.max_checks = max_checks
        self.checks = 0
        self.unknown = 0
        self.cache: dict = {}  # edge matrices of unpresolved problems, converted once

    def out_of_work(self) -> bool:
        return self.checks >= self.max_checks or self.cap.reached()

    def __call__(self, p: Problem) -> Verdict:
        if self.out_of_work():
            self.unknown += 1
            return Verdict.UNKNOWN
        self.checks += 1
        t = time.perf_counter()
        how, verdict = self._check(p)
        self.unknown += verdict is Verdict.UNKNOWN
        logger.debug("diagnose: check %d: %s (%s) in %.3fs", self.checks, verdict.value, how, time.perf_counter() - t)
        return verdict

    def _check(self, p: Problem) -> tuple[str, Verdict]:
        reduced, cache = p, self.cache
        if _presolve is not None:
            try:
                reduced, cache = _presolve.presolve(p).problem, None
            except _presolve.PresolveInfeasible:
                return "presolve", Verdict.INFEASIBLE
        model = build(reduced, objective=False, cache=cache)
        if model.infeasible is not None:
            return "propagation", Verdict.INFEASIBLE
        if model.num_cols > DIAGNOSIS_MAX_COLUMNS:  # its LP alone could take minutes
            return f"{model.num_cols} columns, over {DIAGNOSIS_MAX_COLUMNS}", Verdict.UNKNOWN
        result = self.solver.solve(model, node_limit=DIAGNOSIS_NODE_LIMIT, time_limit=self.cap.left())
        what = f"{model.num_x} x columns"
        if result.status == "infeasible":
            return what, Verdict.INFEASIBLE
        if result.status in ("optimal", "feasible"):
            return what, Verdict.FEASIBLE
        return what, Verdict.UNKNOWN

    def reachable(self, p: Problem, name: str, sense: int) -> tuple[float, float | None] | None:
        """``(bound, reached)`` of resource ``name``'s sum over the choices
        ``p`` without it allows: its minimum (``sense=1``) or maximum
        (``sense=-1``) as the objective of the feasibility model (edges
        only forbid pairs there, links share columns), solved within the
        node limit; ``None`` when out of work or the rest is infeasible."""
        res = next(r for r in p.resources if r.name == name)
        if self.out_of_work():
            return None
        self.checks += 1
        rest = dataclasses.replace(p, resources=[r for r in p.resources if r.name != name])
        model = build(rest, objective=False, cache=self.cache)
        if model.infeasible is not None or model.num_cols > DIAGNOSIS_MAX_COLUMNS:
            return None
        cost = np.zeros(model.num_cols)
        const = 0.0
        for decision, weights in res.terms.items():
            if decision in model.fixed:
                const += weights[model.fixed[decision]]
                continue
            for option, col in enumerate(model.option_cols.get(decision, ())):
                if col is not None:  # linked decisions share a column: their weights add up
                    cost[col] += sense * weights[option]
        scale = float(np.abs(cost).max()) if model.num_cols else 0.0
        model.objective_scale = scale if scale > 0 else 1.0
        model.col_cost = cost / model.objective_scale
        model.objective_offset = sense * const
        result = self.solver.solve(model, node_limit=DIAGNOSIS_NODE_LIMIT, time_limit=self.cap.left())
        bound = result.objective if result.status == "optimal" else result.bound
        if result.status not in ("optimal", "feasible") or bound is None:
            return None
        reached = None if result.objective is None else sense * result.objective
        return sense * bound, reached


def diagnose(
    problem: Problem,
    *,
    backend=None,
    cap: SafetyCap | None = None,
    known_infeasible: bool = False,
    max_checks: int = DIAGNOSIS_MAX_CHECKS,
) -> InfeasibleError | None:
    """An :class:`InfeasibleError` explaining why ``problem`` is infeasible,
    or ``None`` if it is feasible. ``backend`` is a backend name (default:
    the default backend). ``cap``: the caller's wall-clock safety cap;
    ``max_checks``: feasibility checks at most (see the module docstring).
    ``known_infeasible``: the caller proved the problem infeasible (the
    whole problem is not checked again).

    Raises :class:`~solver.backends.SolverError` when the problem's own
    feasibility cannot be decided within the limits (and it is not known)."""
    t0 = time.perf_counter()
    check = FeasibilityChecker(backend, cap, max_checks)
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
        if not known_infeasible:
            verdict = check(problem)
            if verdict is Verdict.FEASIBLE:
                return None
            if verdict is Verdict.UNKNOWN:
                raise SolverError(
                    f"diagnosis of {problem.name!r}: its feasibility was not decided within "
                    f"{DIAGNOSIS_NODE_LIMIT} MIP nodes (solver.work.DIAGNOSIS_NODE_LIMIT)"
                )
        keep, unproven = _filter_links_last(problem, groups, check)
        if not keep:  # infeasible without any constraint: forbidden pairs
            bare = dataclasses.replace(problem, pins=[], links=[], resources=[])
            edges, unproven = _edge_conflict(bare, check)
            names = ", ".join(edges)
            if len(edges) == 1:
                msg = f"Infeasible: edge {names} forbids every pair of allowed options"
            else:
                msg = (
                    f"Infeasible: forbidden option pairs on edges {names} conflict, "
                    "even without any constraint (lifting the forbidden pairs of "
                    "any one of them makes the problem feasible)"
                )
            return InfeasibleError(msg + _partial(unproven, check), edges=edges, unproven=unproven)
        reachable = _reachable(problem, keep, check)
        names = ", ".join(repr(g) for g in keep[:_MAX_LISTED])
        if len(keep) > _MAX_LISTED:
            names += f" and {len(keep) - _MAX_LISTED} more (InfeasibleError.conflict lists them)"
        if len(keep) == 1:
            msg = f"Infeasible: constraint {names} cannot be satisfied (removing it makes the problem feasible)"
        elif unproven:
            msg = f"Infeasible: constraints conflict: {names}"
        else:
            msg = f"Infeasible: constraints conflict: {names} (removing any one of them makes the problem feasible)"
        msg += "".join(_reachable_text(problem, n, r) for n, r in reachable.items())
        return InfeasibleError(msg + _partial(unproven, check), conflict=keep, unproven=unproven, reachable=reachable)
    finally:
        logger.debug(
            "diagnose: %d feasibility checks (%d unknown) in %.3fs",
            check.checks,
            check.unknown,
            time.perf_counter() - t0,
        )


def _link_groups(problem: Problem) -> list[str]:
    """The groups made of links only."""
    other = {c.name for c in [*problem.pins, *problem.resources]}
    return [g for g in dict.fromkeys(c.name for c in problem.links) if g not in other]


def _filter_links_last(problem: Problem, groups: list[str], check) -> tuple[list[str], list[str]]:
    """The deletion filter over the groups with the link groups kept, then
    over the links: linked decisions merge in presolve (32 linked layers are
    checked at one layer's size), so checks with every link are cheap,
    while a check without them can be 30x larger. A conflict rarely needs a
    link: one check without any settles that. Irreducible as a whole: each
    other group was needed with all links, hence with fewer."""
    links = _link_groups(problem)
    others = [g for g in groups if g not in set(links)]
    keep, unproven = _deletion_filter(others, lambda kept: check(_with_groups(problem, set(kept) | set(links))))
    if not links:
        return keep, unproven
    verdict = check(_with_groups(problem, set(keep)))
    if verdict is Verdict.INFEASIBLE:
        kept_links, links_unproven = [], []
    elif verdict is Verdict.FEASIBLE:
        kept_links, links_unproven = _deletion_filter(
            links, lambda kept: check(_with_groups(problem, set(keep) | set(kept)))
        )
    else:  # not decided: the links stay, unproven
        kept_links, links_unproven = links, links
    chosen = set(keep) | set(kept_links)
    unproven_set = set(unproven) | set(links_unproven)
    return [g for g in groups if g in chosen], [g for g in groups if g in unproven_set]


def _reachable(problem: Problem, keep: list[str], check: FeasibilityChecker) -> dict:
    """Per resource group of ``keep`` (one row), the bound its sum cannot
    pass under the other groups of ``keep`` and the links (see
    :meth:`FeasibilityChecker.reachable`): the minimum of a row with a
    ``high`` bound, or the maximum when that is what misses ``low``. The
    links are the problem's structure (repeated layers planned alike), and
    with them the solve runs at one layer's size."""
    out = {}
    rest = _with_groups(problem, set(keep) | set(_link_groups(problem)))
    for res in rest.resources:
        if sum(r.name == res.name for r in rest.resources) != 1:
            continue  # a group of several rows has no one sum
        found = None
        if res.high is not None:
            found = check.reachable(rest, res.name, 1)
            if found is not None and res.low is not None and found[0] <= res.high:
                found = None  # the high bound can be met: the low one may not
        if found is None and res.low is not None:
            found = check.reachable(rest, res.name, -1)
            if found is not None and res.high is not None and found[0] >= res.low:
                found = None  # neither bound alone is missed (e.g. an equality)
        if found is not None:
            out[res.name] = found
    return out


def _reachable_text(problem: Problem, name: str, found: tuple[float, float | None]) -> str:
    res = next(r for r in problem.resources if r.name == name)
    bound = found[0]
    if res.high is not None and (res.low is None or bound > res.high):
        return f"; {name!r}: no choice under the others gets its sum below {bound:.6g} (high {res.high:.6g})"
    return f"; {name!r}: no choice under the others gets its sum above {bound:.6g} (low {res.low:.6g})"


def _partial(unproven: list[str], check: FeasibilityChecker) -> str:
    if not unproven:
        return ""
    why = (
        f"its limit of {check.max_checks} checks or the time limit was reached"
        if check.out_of_work()
        else f"their checks reached {DIAGNOSIS_NODE_LIMIT} MIP nodes (solver.work.DIAGNOSIS_NODE_LIMIT)"
    )
    names = ", ".join(repr(n) for n in unproven[:_MAX_NAMED])
    if len(unproven) > _MAX_NAMED:
        names += f" and {len(unproven) - _MAX_NAMED} more"
    return (
        f" [partial diagnosis: these conflict together, but {names} may not be needed: {why}; "
        "the groups not named are proven not needed]"
    )


def _deletion_filter(items: list, check) -> tuple[list, list]:
    """A conflicting subset of ``items`` (all infeasible together), and
    which of its items were not proven needed.

    ``check(kept)`` is a :class:`Verdict`. Drops chunks of halving size
    while the rest stays (proven) infeasible, ending with single items, so
    a small conflict among many groups costs about ``k log n`` checks
    instead of ``n``. Each survivor was tested alone against a superset of
    the result: when dropping it made that superset feasible, it makes the
    result feasible too (the survivor is needed); when that check was
    unknown, the survivor is returned as unproven.
    """
    seen: dict[tuple, Verdict] = {}

    def verdict(kept: list) -> Verdict:
        key = tuple(kept)
        if key not in seen:
            seen[key] = check(kept)
        return seen[key]

    keep = list(items)
    unproven: set = set()
    chunk = max(1, len(keep) // 2)
    while True:
        i = 0
        while i < len(keep):
            trial = keep[:i] + keep[i + chunk :]
            v = verdict(trial)
            if v is Verdict.INFEASIBLE:
                keep = trial
                continue
            if chunk == 1 and v is Verdict.UNKNOWN:
                unproven.add(keep[i])
            i += chunk
        if chunk == 1:
            return keep, [x for x in keep if x in unproven]
        chunk = max(1, min(chunk // 2, len(keep) // 2))


def _with_groups(problem: Problem, keep: set[str]) -> Problem:
    return dataclasses.replace(
        problem,
        pins=[c for c in problem.pins if c.name in keep],
        links=[c for c in problem.links if c.name in keep],
        resources=[c for c in problem.resources if c.name in keep],
    )


def _edge_conflict(bare: Problem, check) -> tuple[list[str], list[str]]:
    """Deletion filter over the edges holding forbidden pairs: the
    conflicting edges and those of them not proven needed."""
    candidates = [k for k, e in enumerate(bare.edges) if any(math.inf in r for r in e.costs)]
    others = [e for e in bare.edges if not any(math.inf in r for r in e.costs)]
    keep, unproven = _deletion_filter(
        candidates,
        lambda kept: check(dataclasses.replace(bare, edges=others + [bare.edges[j] for j in kept])),
    )

    def name(k: int) -> str:
        return f"{bare.edges[k].producer!r} -> {bare.edges[k].consumer!r}"

    return [name(k) for k in keep], [name(k) for k in unproven]
