"""The ILP route of :func:`solver.solve`, with option pricing plugged in
from outside (:class:`PricingHook`), so that pricing's restricted problems
(:mod:`solver.pricing_rounds`) are solved here without importing
:mod:`solver.api`, which routes big problems to pricing.

    problem --validate--> presolve --[pricing hook]--> build --> ILP --backend--> columns
            --decode--> reduced choice --expand--> choice --evaluate--> Solution

See :mod:`solver.api` for what a solve promises (objective, infeasibility,
determinism, limits).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from .backends import SolverError, get_backend
from .diagnose import InfeasibleError, diagnose
from .evaluate import evaluate, violations
from .ilp import build
from .problem import Problem, ProblemError, Solution
from .work import SafetyCap, stopped_by

# solve()'s messages, under the logger name they always had.
logger = logging.getLogger("solver.api")

# Set while a solve runs option pricing: pricing's own restricted ILPs
# (solver.solve again) go to the ILP, not back to pricing.
_IN_PRICING: contextvars.ContextVar[bool] = contextvars.ContextVar("solver_in_pricing", default=False)


@contextlib.contextmanager
def ilp_only():
    """Within this block, :func:`solver.solve` never routes a problem to
    option pricing (for callers that run pricing themselves and solve its
    restricted problems with :func:`solver.solve`)."""
    token = _IN_PRICING.set(True)
    try:
        yield
    finally:
        _IN_PRICING.reset(token)


def pricing_running() -> bool:
    """Whether this runs inside :func:`ilp_only` (option pricing's own solves)."""
    return _IN_PRICING.get()


@dataclass(frozen=True)
class PricingHook:
    """Option pricing as :func:`solve_by_ilp` calls it on the presolved
    problem: ``wanted(reduced)`` says whether to, ``run(reduced, backend,
    time_limit, node_limit)`` returns pricing's solution of it (choice in its
    option ids), or ``None`` when it found none (the ILP then decides)."""

    wanted: Callable[[Problem], bool]
    run: Callable[[Problem, str | None, float | None, int | None], Solution | None]


def solve_by_ilp(
    problem: Problem,
    *,
    backend: str | None = None,
    time_limit: float | None = None,
    rel_gap: float | None = None,
    presolve: bool = True,
    node_limit: int | None = None,
    pricing: PricingHook | None = None,
) -> Solution:
    """:func:`solver.solve` with option pricing only through ``pricing``
    (``None``: the ILP alone); the other arguments as there."""
    _check_limits(time_limit, rel_gap)
    t_start = time.perf_counter()
    solution = _solve(problem, backend, time_limit, rel_gap, presolve, pricing, node_limit, t_start)
    solution.stopped_by = stopped_by(
        optimal=solution.optimal, elapsed=time.perf_counter() - t_start, time_limit=time_limit
    )
    if solution.stopped_by == "time limit":
        # once, for the caller's solve (option pricing's restricted ILPs say it through pricing's)
        (logger.info if _IN_PRICING.get() else logger.warning)(
            "solve of %r reached its time limit (%s s) before its work limits: the plan may differ between "
            "runs and ranks; give it more time or set a smaller node_limit",
            problem.name,
            time_limit,
        )
    return solution


def _solve(
    problem, backend, time_limit, rel_gap, presolve, pricing: PricingHook | None, node_limit, t_start
) -> Solution:
    cap = SafetyCap(time_limit, t_start)  # the diagnosis of an infeasible problem stays under it too
    pre_mod = _presolve_module() if presolve else None
    if pre_mod is None:
        problem.validate()
    else:
        # Presolve checks the edge matrices: merging reads them anyway, and
        # repeated layers' equal matrices need reading only once then.
        try:
            problem._validate(edge_costs=False)
        except ProblemError:
            problem.validate()  # the first error, which may be a matrix's
            raise
    try:
        solver = get_backend(backend)
    except Exception:
        if pre_mod is not None:
            problem.validate()  # a malformed problem says so first
        raise
    timings: dict[str, float] = {}

    reduced, expand, stats = problem, None, None
    if presolve:
        t0 = time.perf_counter()
        if pre_mod is not None:
            try:
                pre = pre_mod.presolve(problem, check_costs=True)
            except pre_mod.PresolveInfeasible as exc:
                logger.info("presolve found the problem infeasible: %s", exc)
                raise _infeasible(problem, solver.name, cap) from None
            reduced, expand, stats = pre.problem, pre.expand, pre.stats
        timings["presolve"] = time.perf_counter() - t0

    priced = None  # pricing's answer that did not prove its plan
    if pricing is not None and pricing.wanted(reduced):
        t0 = time.perf_counter()
        priced = pricing.run(reduced, backend, time_limit, node_limit)
        timings["pricing"] = time.perf_counter() - t0
        out_of_time = time_limit is not None and time.perf_counter() - t_start >= time_limit
        if priced is not None and (priced.status == "optimal" or out_of_time):
            return _priced_solution(problem, priced, expand, stats, timings, t_start)
        if time_limit is not None:  # the ILP gets what is left
            time_limit = max(time_limit - (time.perf_counter() - t_start), 1e-3)

    t0 = time.perf_counter()
    model = build(reduced)
    timings["build"] = time.perf_counter() - t0
    logger.info(
        "ILP %r: %d variables (%d binary), %d constraints, built in %.3fs",
        problem.name,
        model.num_cols,
        model.num_x,
        model.num_rows,
        timings["build"],
    )
    if model.infeasible is not None:
        logger.info("infeasible before solving: %s", model.infeasible)
        raise _infeasible(problem, solver.name, cap)

    result = solver.solve(model, time_limit=time_limit, rel_gap=rel_gap, node_limit=node_limit)
    timings["build"] += result.timings.get("build", 0.0)
    timings["solve"] = result.timings.get("solve", 0.0)
    if result.status == "infeasible":
        raise _infeasible(problem, solver.name, cap)
    if result.status == "unknown" and priced is not None:
        return _priced_solution(problem, priced, expand, stats, timings, t_start)
    if result.status == "unknown":
        raise SolverError(
            f"{solver.name} found no feasible solution within its limits (time_limit {time_limit} s, "
            f"node_limit {node_limit} MIP nodes); raise them (None: no limit)"
        )

    t0 = time.perf_counter()
    choice = model.decode(result.values)
    if expand is not None:
        choice = expand(choice)
    timings["extract"] = result.timings.get("extract", 0.0)
    ilp = _checked_solution(
        problem,
        choice,
        result.status,
        result.bound,
        result.gap,
        solver.name,
        model.num_cols,
        model.num_rows,
        stats,
        timings,
        t0,
        t_start,
    )
    if priced is not None and result.status != "optimal":
        # both stopped short: the better plan, the higher bound
        bound = max((b for b in (ilp.bound, priced.bound) if b is not None), default=None)
        if priced.objective < ilp.objective:
            return _priced_solution(problem, priced, expand, stats, timings, t_start, bound)
        if bound is not None and bound != ilp.bound:
            ilp.bound = min(bound, ilp.objective)
            ilp.gap = (ilp.objective - ilp.bound) / abs(ilp.objective) if ilp.objective else None
    return ilp


def _checked_solution(
    problem: Problem,
    choice: dict[str, int],
    status: str,
    bound: float | None,
    gap: float | None,
    backend: str,
    num_variables: int,
    num_constraints: int,
    stats,
    timings: dict[str, float],
    t_extract: float,
    t_start: float,
) -> Solution:
    """``choice`` (of ``problem``) re-evaluated and checked against its
    constraints, as a Solution. ``bound``: the solver's proven bound (kept
    at most the re-evaluated objective; the objective when optimal)."""
    unary, edge = evaluate(problem, choice)
    objective = unary + edge
    bad = violations(problem, choice, costs_finite=math.isfinite(objective))
    if bad:
        raise SolverError(f"internal error: the solution of {backend} violates {bad}")
    timings["extract"] = timings.get("extract", 0.0) + time.perf_counter() - t_extract
    timings["total"] = time.perf_counter() - t_start
    logger.info(
        "solved %r with %s: %s, objective %.6g, gap %s, %.3fs",
        problem.name,
        backend,
        status,
        objective,
        gap,
        timings["total"],
    )
    if status == "optimal":
        bound = objective
    elif bound is None or not math.isfinite(bound):
        bound = None
    else:  # never above the re-evaluated objective
        bound = min(bound, objective)
    return Solution(
        choice=choice,
        objective=objective,
        bound=bound,
        unary_cost=unary,
        edge_cost=edge,
        status=status,
        optimal=status == "optimal",
        gap=gap,
        backend=backend,
        timings=timings,
        num_variables=num_variables,
        num_constraints=num_constraints,
        presolve=stats,
    )


def _priced_solution(
    problem: Problem,
    priced: Solution,
    expand,
    stats,
    timings: dict[str, float],
    t_start: float,
    bound: float | None = None,
) -> Solution:
    """``priced`` (a solution of the presolved problem) as a solution of
    ``problem``: expanded, re-evaluated and checked like the ILP's.
    ``bound``: a proven bound to report instead of pricing's own."""
    t0 = time.perf_counter()
    choice = expand(priced.choice) if expand is not None else dict(priced.choice)
    if bound is None:
        bound = priced.bound
    timings["solve"] = timings.get("solve", 0.0) + timings.get("pricing", 0.0)
    s = _checked_solution(
        problem,
        choice,
        priced.status,
        bound,
        None,
        priced.backend,
        priced.num_variables,
        priced.num_constraints,
        stats,
        timings,
        t0,
        t_start,
    )
    if s.optimal:
        s.gap = 0.0
    elif s.bound is not None and s.objective:
        s.gap = (s.objective - s.bound) / abs(s.objective)
    return s


def _check_limits(time_limit, rel_gap) -> None:
    """Reject limits a backend would misread (nan, negative) before any work."""
    for name, value, ok, valid in (
        ("time_limit", time_limit, lambda v: v > 0, "a positive number of seconds or None"),
        ("rel_gap", rel_gap, lambda v: 0 <= v < 1, "a number in [0, 1) (e.g. 0.01) or None"),
    ):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be {valid}, got {type(value).__name__} {value!r}")
        if not ok(value):  # nan fails every comparison
            raise ValueError(f"{name} must be {valid}, got {value!r}")


def _presolve_module():
    try:
        from . import presolve as pre_mod
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.presolve":
            raise
        logger.info("solver.presolve is not available; solving without presolve")
        return None
    return pre_mod


def _infeasible(problem: Problem, backend: str, cap: SafetyCap) -> InfeasibleError:
    """The diagnosis of ``problem``, which the solve proved infeasible,
    within what is left of the solve's safety cap."""
    err = diagnose(problem, backend=backend, cap=cap, known_infeasible=True)
    if err is None:  # should not happen: the reduced problem was infeasible
        return InfeasibleError(
            "Infeasible: the solver found no solution, but no conflicting constraint set could be isolated"
        )
    return err
