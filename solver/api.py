"""``solve``: the solver's one entry point.

    problem --validate--> presolve --build--> ILP --backend--> columns
            --decode--> reduced choice --expand--> choice --evaluate--> Solution

A presolved problem with at least ``PRICING_MIN_PAIRS`` option pairs goes to
option pricing (:func:`solver.pricing.solve_by_pricing`) first; its reduced
choice is expanded and evaluated the same way, and the ILP runs only when
pricing did not prove its plan optimal (with what is left of a time limit;
the better of the two plans is returned, with the higher bound).

The objective reported is :func:`solver.evaluate.evaluate` of the expanded
choice on the original problem; the ILP's own objective only steers the
search. An infeasible problem raises :class:`InfeasibleError` naming the
conflicting constraints (diagnosed on the original problem's constraint groups,
within counted work and the safety cap: :mod:`solver.diagnose`).

Determinism: the same problem and options give the same solution, whatever
the machine's load. Both backends are deterministic, the model is built in a
fixed order (ties between equally good choices break the same way every
time, by option order within the model), and every normal stop is counted
work (:mod:`solver.work`: MIP nodes, pricing rounds, ascent sweeps), never
the clock. ``time_limit`` is a safety cap: a solution that reached it says
so (``stopped_by == "time limit"``) and may differ between runs. Plans from
option pricing (big problems) may break ties differently from the ILP's.

Example::

    >>> from solver.problem import Decision, Edge, Problem
    >>> p = Problem(
    ...     decisions=[Decision("a", ["R", "S0"], [1.0, 0.5]),
    ...                Decision("b", ["R", "S0"], [1.0, 0.5])],
    ...     edges=[Edge("a", "b", 0, [[0.0, 0.0], [2.0, 0.0]])],
    ... )
    >>> s = solve(p, presolve=False)
    >>> s.choice, s.objective, s.status
    ({'a': 1, 'b': 1}, 1.0, 'optimal')
"""

from __future__ import annotations

import logging

from . import pricing as option_pricing
from .diagnose import InfeasibleError
from .ilp_route import PricingHook, ilp_only, pricing_running, solve_by_ilp
from .problem import Problem, Solution

logger = logging.getLogger(__name__)

# Presolved problems with at least this many option pairs (finite or not,
# over all edges) go to option pricing (solver.pricing) before the ILP.
# Why: on 3-D meshes the pairwise ILP's LP relaxation alone is the cost
# (tiny LLaMA-3 on 2x2x2: 880K pair columns, 23K dual simplex iterations,
# 17 s CPU), while pricing's dual ascent proves the same optimum from the
# whole problem in ~1 s CPU and its restricted ILP is tiny (T5 on 2x2x2:
# 3.3M pairs, 1.6 s CPU against ~37 s). Below this the ILP takes about a
# second (the 2-D zoo: <= 0.8M pairs before presolve) and is kept: its
# plans (tie-breaks) stay what they were.
PRICING_MIN_PAIRS = 1_000_000


def solve(
    problem: Problem,
    *,
    backend: str | None = None,
    time_limit: float | None = None,
    rel_gap: float | None = None,
    presolve: bool = True,
    pricing: bool | None = None,
    node_limit: int | None = None,
) -> Solution:
    """Find a minimum-cost choice for ``problem``.

    ``backend``: a name from :func:`solver.available_backends` (default:
    the first, fastest). ``node_limit`` (MIP nodes, counted: the same plan
    on every run; e.g. :data:`solver.work.DEFAULT_NODE_LIMIT`), ``rel_gap``
    (e.g. ``0.01``) and ``time_limit`` (seconds of wall clock: a safety cap,
    see :mod:`solver.work`) let the backend stop early with
    ``status="feasible"`` and ``stopped_by`` saying which.
    ``presolve``: shrink the problem first (links merged, dominated options
    dropped) with :mod:`solver.presolve`. ``pricing``: solve the presolved
    problem by option pricing (:func:`solver.pricing.solve_by_pricing`)
    first, the ILP only if pricing does not prove its plan optimal in time;
    ``None`` (default): when it has at least ``PRICING_MIN_PAIRS`` option
    pairs.

    Raises :class:`InfeasibleError` when no choice satisfies the problem,
    :class:`~solver.problem.ProblemError` when it is malformed, and
    :class:`SolverError` when the backend stops without any solution.
    """
    return solve_by_ilp(
        problem,
        backend=backend,
        time_limit=time_limit,
        rel_gap=rel_gap,
        presolve=presolve,
        node_limit=node_limit,
        pricing=PricingHook(wanted=lambda reduced: _use_pricing(pricing, reduced), run=_try_pricing),
    )


def _use_pricing(pricing: bool | None, reduced: Problem) -> bool:
    if pricing_running() or not reduced.decisions or pricing is False:
        return False
    if pricing:
        return True
    pairs = 0
    for e in reduced.edges:
        pairs += len(e.costs) * (len(e.costs[0]) if len(e.costs) else 0)
    return pairs >= PRICING_MIN_PAIRS


def _try_pricing(
    reduced: Problem, backend: str | None, time_limit: float | None, node_limit: int | None
) -> Solution | None:
    """Option pricing's solution of the presolved problem (choice in its
    option ids), or ``None`` when it found none (its restricted problems
    infeasible): the ILP then decides, and diagnoses an infeasible problem."""
    with ilp_only():
        try:
            limits = {} if node_limit is None else {"node_limit": node_limit}
            result = option_pricing.solve_by_pricing(reduced, backend=backend, time_limit=time_limit, **limits)
        except InfeasibleError as exc:
            logger.info("option pricing found no plan (%s); solving the ILP", exc)
            return None
    solution = result.solution
    logger.info(
        "option pricing of %r: %s, objective %.6g, bound %s, %d of %d options kept, %.3fs",
        reduced.name,
        solution.status,
        solution.objective,
        solution.bound,
        sum(len(k) for k in result.kept.values()),
        result.stats.options_total,
        result.stats.seconds.get("total", 0.0),
    )
    return solution
