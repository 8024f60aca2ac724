"""Elimination around the pricing rounds of :mod:`solver.pricing`.

Before the rounds (:func:`prefilter`): the seed's restricted ILP gives a
plan of cost ``upper``; options no choice meeting the resource rows can
take leave (:func:`solver.dual_bound.resource_filter`), then those whose
spanning-forest min-marginals exceed ``upper`` (:func:`solver.tree_bound.eliminate`),
then the dual ascent (:mod:`solver.dual_bound`) raises the bound over every
option, kills options against ``upper``, decodes plans (a cheaper one
becomes the known plan), and forests over its rewritten costs drop more.

After the rounds (:func:`final_ascent`): the restricted ILP's plan is
usually cheaper than the prefilter's, so the same ascent goes on against
it (its messages stay valid: any messages bound every choice) and its
forests give, per class, the options a cheaper plan may still use, which
the reduced-cost fixing of :func:`solver.pricing.solve_by_pricing`
intersects with its own. When few enough are left, the ILP over all of
them is the proof.

When fixing needs too many options, :mod:`solver.pricing_bisect` guesses
the optimum a little above the ascent's bound instead: forests keep what a
plan that cheap may use; the ILP over them proves the plan or the guess
becomes the bound.

Every test drops only options in no plan costing at most the known plan's
cost, so the bounds found hold for those plans: the optimum is at least
``min(upper, bound)``, and the known plan is kept whatever the rounding.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import numpy as np

from .dual_bound import DualAscent, resource_filter
from .tree_bound import MAX_PASSES, choice_cost, eliminate
from .work import MAX_ASCENT_SWEEPS

if TYPE_CHECKING:
    from .pricing_stats import PricingStats
    from .pricing_rounds import Pricer

logger = logging.getLogger(__name__)

# Spanning forests per elimination pass (solver.tree_bound.eliminate).
TREES = 3
# Whether the dual ascent runs before pricing, and its sweeps between two
# decoded plans (all its runs together stop at solver.work.MAX_ASCENT_SWEEPS,
# counted, never timed). On LLaMA-3 70B 4x4x8x8 the ascent alone meets the
# optimum (bound and decoded plan, 43 sweeps), where LP rounds between two
# runs of it found no better plan.
ASCENT = True
ASCENT_SWEEPS = 10
# Options per class, of least belief, that join the restricted ILP after
# an ascent (a plan near the dual's: its decoding alone rounds poorly on
# 4-D meshes).
ILP_PER_CLASS = 3
# Option pairs among the survivors of the forests after an ascent at which
# they stop: the restricted ILP over all of them is then cheap (~0.1-0.5 s)
# and is the proof (solver.pricing's exhaustive case, DIRECT_PAIRS).
FOREST_ENOUGH_PAIRS = 20_000
# Relative gap under which a bound proves a plan optimal (solver.pricing.OPT_RTOL).
OPT_RTOL = 1e-9


def prefilter(pr: Pricer, backend, deadline: float | None, stats: PricingStats) -> tuple[int, DualAscent | None, float]:
    """Narrow the pricer's classes to the options a plan no dearer than the
    seed's restricted ILP may use (module docstring). Returns how many
    options left, the dual ascent (None when it did not run) and the known
    plan's cost (inf without one); (0, None, inf) when some matrix cannot
    reduce whole rows or the seed has no plan. ``deadline``
    (``perf_counter``): the solve's safety cap."""
    t0 = time.perf_counter()
    try:
        if not all(t.cache.matrix_reduces for e in pr.q.edges for t in e.terms):
            return 0, None, math.inf
        sol = pr.solve_ilp(backend, None if deadline is None else max(deadline - time.perf_counter(), 1e-3))
        if sol is None:
            return 0, None, math.inf
        stats.restricted_objectives.append(sol.objective)
        classes = pr.q.classes
        before = sum(int(c.allowed.sum()) for c in classes)
        resource_filter(pr.q, [c.allowed for c in classes])
        ascend = ASCENT
        # one raw forest when the ascent follows (its forests drop the rest)
        el = eliminate(
            pr.q, sol.objective, trees=1 if ascend else TREES, max_passes=1 if ascend else MAX_PASSES, deadline=deadline
        )
        if el is None:
            return 0, None, math.inf
        plan = [sol.choice[q] for q in range(len(classes))] if el.plan is None else el.plan
        narrow(pr, el.keep, plan)
        stats.tree_bound = el.bound
        upper = el.upper
        ascent = None
        if ascend:
            ascent = DualAscent(pr.q)
            keep, upper, plan, bound = _ascend(pr, ascent, upper, plan, backend, deadline, stats)
            narrow(pr, keep, plan)
        pr.repair_arcs()
        dropped = before - sum(int(c.allowed.sum()) for c in classes)
        logger.info(
            "elimination before pricing: plan %.9g, forest bound %.9g, dual ascent bound %.9g "
            "(%d sweeps), %d of %d options dropped",
            upper,
            el.bound,
            stats.ascent_bound,
            stats.ascent_sweeps,
            dropped,
            stats.options_total,
        )
        return dropped, ascent, upper
    finally:
        stats.seconds["trees"] += time.perf_counter() - t0


def final_ascent(
    pr: Pricer, ascent: DualAscent, upper: float, plan: list[int], backend, deadline: float | None, stats: PricingStats
) -> tuple[list[np.ndarray], float, list[int], float]:
    """The ascent of :func:`prefilter` continued against a plan of cost
    ``upper`` (class choices ``plan``) until ``deadline``: per class the
    options a plan costing at most ``upper`` may use, the best plan's cost
    and choices (``upper``/``plan`` or a decoded one) and the bound (for
    plans costing at most that)."""
    return _ascend(pr, ascent, upper, plan, backend, deadline, stats)


def _ascend(
    pr: Pricer, ascent: DualAscent, upper: float, plan: list[int], backend, deadline: float | None, stats: PricingStats
) -> tuple[list[np.ndarray], float, list[int], float]:
    """Sweeps until the bound meets the best plan, stalls, or the ascent
    has made MAX_ASCENT_SWEEPS sweeps (counted: the same stop on every run;
    ``deadline``, the safety cap, also ends it), decoding a plan every
    ASCENT_SWEEPS; then the restricted ILP with each class's ILP_PER_CLASS
    live options of least belief added, and forests over the rewritten
    costs. Returns (keep per class, best cost, its plan, bound); no forests
    when the bound meets the plan (it is optimal)."""
    ascent.restrict([c.allowed for c in pr.q.classes])  # what forests dropped since
    while True:
        sweeps = min(ASCENT_SWEEPS, MAX_ASCENT_SWEEPS - ascent.stats.sweeps)
        bound = ascent.run(sweeps, upper=upper, keep=plan, deadline=deadline) if sweeps > 0 else ascent.bound()
        found = ascent.decode()
        cost = choice_cost(pr.q, found)
        if cost < upper:
            upper, plan = cost, found
        if (
            bound >= upper - OPT_RTOL * max(1.0, abs(upper))
            or ascent.stalled
            or ascent.stats.sweeps >= MAX_ASCENT_SWEEPS
            or (deadline is not None and time.perf_counter() > deadline)
        ):
            break
    if bound < upper - OPT_RTOL * max(1.0, abs(upper)):
        upper, plan = _ilp_near_duals(pr, ascent, upper, plan, backend, deadline)
    stats.ascent_bound = max(stats.ascent_bound, bound)
    stats.ascent_sweeps = ascent.stats.sweeps
    if bound >= upper - OPT_RTOL * max(1.0, abs(upper)):
        # proven: no forests; the live options kept so far stay
        stats.tree_bound = max(stats.tree_bound, bound)
        keep = [k & live for k, live in zip(pr.kept, ascent.live)]
        for q, o in enumerate(plan):
            keep[q][o] = True
        return keep, upper, plan, bound
    el = eliminate(
        pr.q,
        upper,
        trees=TREES,
        reparam=ascent.reparam(),
        deadline=deadline,
        enough=lambda keep: pairs_among(pr.q, [k & live for k, live in zip(keep, ascent.live)]) <= FOREST_ENOUGH_PAIRS,
    )
    if el.plan is not None:
        upper, plan = el.upper, el.plan
    stats.tree_bound = max(stats.tree_bound, bound, el.bound)
    keep = [k & live for k, live in zip(el.keep, ascent.live)]
    for q, o in enumerate(plan):
        keep[q][o] = True
    return keep, upper, plan, max(bound, el.bound)


def _ilp_near_duals(
    pr: Pricer, ascent: DualAscent, upper: float, plan: list[int], backend, deadline: float | None
) -> tuple[float, list[int]]:
    """The restricted ILP with each class's ILP_PER_CLASS live options of
    least belief added: the plan near the dual's (its decoding alone
    rounds poorly on 4-D meshes) when cheaper than ``upper``/``plan``."""
    t0 = time.perf_counter()
    for q, (b, live) in enumerate(zip(ascent.belief, ascent.live)):
        opts = np.flatnonzero(live & ~pr.kept[q])
        # the known plan too (a decoded one is not yet kept): the ILP is no dearer
        pr.add(q, [plan[q], *opts[np.argsort(b[opts], kind="stable")[:ILP_PER_CLASS]]])
    pr.repair_arcs()
    left = None if deadline is None else max(deadline - time.perf_counter(), 1.0)
    sol = pr.solve_ilp(backend, left)
    logger.info(
        "restricted ILP near the ascent's duals over %d options: %s in %.1fs (plan was %.9g)",
        pr.num_kept(),
        "none" if sol is None else f"{sol.objective:.9g} ({sol.status})",
        time.perf_counter() - t0,
        upper,
    )
    if sol is not None and sol.objective < upper:
        return sol.objective, [sol.choice[q] for q in range(len(pr.q.classes))]
    return upper, plan


def narrow(pr: Pricer, keep: list[np.ndarray], plan: list[int]) -> None:
    """Allow only ``keep`` (and ``plan``'s options, whatever the rounding);
    the restricted problems hold ``plan``."""
    for q, (cls, k) in enumerate(zip(pr.q.classes, keep)):
        cls.allowed &= k
        cls.allowed[plan[q]] = True
        cls.unary[~cls.allowed] = math.inf
        pr.kept[q] &= cls.allowed
        pr.add(q, [plan[q]])


def pairs_among(quotient, allowed: list[np.ndarray]) -> int:
    """Option pairs over the quotient's edges between the ``allowed`` options."""
    counts = [int(a.sum()) for a in allowed]
    return sum(counts[e.p] * counts[e.c] for e in quotient.edges)
