"""Proof by target bisection, for plans the LP relaxation cannot prove (bf16).

Why: where communication dominates (bf16 compute on a 4-D mesh) the local
polytope relaxation that the dual ascent (:mod:`solver.dual_bound`)
climbs has a real integrality gap: its bound stops ~1-2% under the
optimum, and reduced-cost fixing at the known plan's cost keeps too many
options for one restricted ILP. The plan found by then is often not the
optimum either (LLaMA-3 70B on 4x4x8x8, 2 layers, bf16: plans 0.04332 to
0.04871 depending on the sweeps the ascent got; the optimum is 0.04297).

How: for a target ``t`` between the ascent's bound ``lo`` and the best
plan's cost ``hi``, keep per class the options a plan costing at most
``t`` may use: the ascent's live options whose belief leaves room under
``t`` (any choice with option ``o`` of class ``q`` costs at least ``D +
B_q(o) - min B_q``), then the spanning forests over the ascent's
rewritten costs (:func:`solver.tree_bound.eliminate`, which also prunes
iteratively). The restricted ILP over those options and the kept ones is
exact over them, so either

- its optimum ``z <= t``: every plan cheaper than ``z`` costs under ``t``
  and so lies among its options: ``z`` is the global optimum (proven); or
- ``z > t``: no plan costs ``t`` or less, ``t`` is a lower bound (``lo =
  t``), and ``z`` (when cheaper) the new best plan (``hi = z``).

Targets start just above ``lo`` (``FIRST_STEP``), the step doubling
after each target no plan meets and halving when a target keeps more
options or pairs than one restricted ILP may take, so the bound rises and
the plan improves until they meet or the time is spent; the bound
reported is always a proven one. Targets near
``lo`` keep few options (the ascent's bound is near the LP's, which is
near the optimum), so the proof needs ILPs of about the optimum's
neighbourhood only: 12,866 options and 1.4M pairs (2.6 s with presolve)
where fixing at the plan's cost needed 25,410 options and 7.9M pairs.

>>> from solver.problem import Decision, Edge, Problem
>>> from solver.pricing import PricingStats
>>> from solver.pricing_rounds import Pricer
>>> from solver.pricing_quotient import build_quotient
>>> from solver.dual_bound import DualAscent
>>> clash = [[1.0, 0.0], [0.0, 1.0]]  # equal options clash: an odd cycle is frustrated
>>> p = Problem([Decision(n, ["a", "b"], [0.0, 0.0]) for n in "xyz"],
...             [Edge("x", "y", 0, clash), Edge("y", "z", 0, clash), Edge("z", "x", 0, clash)])
>>> q = build_quotient(p)
>>> pr = Pricer(q); pr.seed(p, {n: [0] for n in "xyz"})
>>> ascent = DualAscent(q); lo = ascent.run(20)  # the LP's optimum: 0, every choice costs >= 1
>>> found, bound, proven = bisect_targets(pr, ascent, 3.0, lo, lambda _: pr.solve_ilp(None, None),
...                                       100, 10**6, None, PricingStats())
>>> round(lo, 6), found.objective, bound, proven
(0.0, 1.0, 1.0, True)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .pricing_proof import OPT_RTOL, pairs_among
from .tree_bound import eliminate

if TYPE_CHECKING:
    from .dual_bound import DualAscent
    from .pricing_stats import PricingStats
    from .pricing_rounds import Pricer
    from .problem import Solution

logger = logging.getLogger(__name__)

# The first target's distance above the bound, relative to the bound; the
# step doubles after a target no plan meets (the bound rises by it) and
# halves, down to MIN_STEP, when a target keeps too many options for one
# restricted ILP. Small first: the options kept grow fast with the target,
# and a bf16 optimum sits ~0.5-1.5% above the ascent's bound.
FIRST_STEP = 1 / 256
MIN_STEP = 1 / 4096
# Sweeps of the dual ascent (against the best plan) when a target keeps
# too many options, before the next target: on 80 layers the ascent has
# not converged by the time pricing reaches the bisection.
ASCENT_SWEEPS = 5
# Options per class, of least belief among those a target keeps, that join
# the restricted ILP when the target keeps too many for one: a plan near it.
NEAR_PER_CLASS = 6
# Most targets tried in one call.
MAX_PROBES = 12
# Seconds a restricted ILP of a target gets at least once past the safety
# cap (a restricted ILP stops on its MIP node count; this only matters
# when the clock has run out).
ILP_SECONDS = 10.0
# Spanning forests per elimination pass and the passes per target.
TREES = 3
PASSES = 4
# The options and pairs one restricted ILP of a target may take, as a
# multiple of the caller's limits for reduced-cost fixing (max_options,
# solver.pricing.DIRECT_PAIRS): the proof is worth a bigger ILP (25K
# options and 7.9M pairs: 22 s and ~0.8 GB with presolve).
SIZE_FACTOR = 2
# Options or pairs, as a multiple of what one restricted ILP may take,
# past which a target's first pass of forests ends it ("too many").
FAR_OVER = 3
# Relative slack on the belief test (sums taken in different orders).
BELIEF_RTOL = 1e-7


@dataclass
class Probe:
    """One target tried: the options and pairs it kept, and what came of it
    ("too many", "none cheaper" (t is a bound), "proven", "ilp stopped")."""

    target: float
    options: int
    pairs: int
    outcome: str
    objective: float | None = None
    seconds: float = 0.0


def plans_up_to(
    pr: Pricer, ascent: DualAscent, target: float, deadline: float | None, far_over=None
) -> tuple[list[np.ndarray], tuple[float, list[int]] | None]:
    """Per class, the options a plan costing at most ``target`` may use:
    live in the ascent, a belief within ``target - D`` of the class's best,
    and a min-marginal at most ``target`` on the forests over the ascent's
    rewritten costs (every plan costing at most ``target`` keeps its
    options; a cheaper forest plan, when one turns up, keeps its own).
    Also the cheapest forest plan priced (cost, class choices), if any:
    the forests over options near the target often give plans far
    cheaper than the restricted ILPs' (LLaMA-3 70B, 80 layers: 0.86
    against 1.33). ``far_over(keep)``: whether options kept after one
    pass of forests are so many that the other passes are not worth it."""
    d = ascent.bound()
    room = target - d + BELIEF_RTOL * max(1.0, abs(target))
    allowed = []
    for b, live in zip(ascent.belief, ascent.live):
        keep = live.copy()
        if live.any():
            keep &= b - b[live].min() <= room
        allowed.append(keep)
    reparam = ascent.reparam()
    # one pass first: when it leaves far too many options, more passes
    # (most of a target's time) would not bring them under the limit
    el = eliminate(pr.q, target, trees=TREES, reparam=reparam, max_passes=1, deadline=deadline, allowed=allowed)
    keep = [k & a for k, a in zip(el.keep, allowed)]
    cheapest, plan, upper = el.cheapest, el.plan, el.upper
    if PASSES > 1 and (far_over is None or not far_over(keep)):
        more = eliminate(
            pr.q, upper, trees=TREES, reparam=reparam, max_passes=PASSES - 1, deadline=deadline, allowed=keep
        )
        keep = [k & a for k, a in zip(more.keep, keep)]
        plan = more.plan or plan
        if more.cheapest is not None and (cheapest is None or more.cheapest[0] < cheapest[0]):
            cheapest = more.cheapest
    logger.debug(
        "target %.9g: %d options live, %d within the beliefs, %d on the forests",
        target,
        ascent.num_live(),
        sum(int(a.sum()) for a in allowed),
        sum(int(k.sum()) for k in keep),
    )
    for q, o in enumerate(plan or ()):
        keep[q][o] = True  # a forest plan cheaper than the target: the ILP finds it
    return keep, cheapest


def bisect_targets(
    pr: Pricer,
    ascent: DualAscent,
    upper: float,
    bound: float,
    solve_ilp,
    cap: int,
    max_pairs: int,
    deadline: float | None,
    stats: PricingStats,
) -> tuple[Solution | None, float, bool]:
    """Raise ``bound`` and lower ``upper`` (the best plan's cost, whose
    options ``pr`` keeps) by restricted ILPs at targets between them (module
    docstring). ``solve_ilp(seconds)``: the restricted ILP over ``pr``'s
    kept options (None if infeasible), given at least ``seconds``; at most
    ``cap`` options and ``max_pairs`` pairs (times SIZE_FACTOR) go into
    one. Runs until proven or MAX_PROBES targets (counted; ``deadline``, the
    safety cap, also ends it). Returns (the best restricted ILP solution found
    under ``upper``, or None; the proven bound; whether proven: that
    solution, or the plan of cost ``upper`` when None, is optimal)."""
    t_start = time.perf_counter()
    cap, max_pairs = int(cap * SIZE_FACTOR), int(max_pairs * SIZE_FACTOR)
    end = deadline
    lo, hi = bound, upper
    # (a bound near 0 says nothing of the scale: then a share of the gap)
    step = max(FIRST_STEP * abs(lo), (hi - lo) / 64)
    best = None
    probes: list[Probe] = []
    proven = False
    kept_before = [k.copy() for k in pr.kept]
    while len(probes) < MAX_PROBES:
        if hi - lo <= OPT_RTOL * max(1.0, abs(hi)):
            proven = True
            break
        if end is not None and time.perf_counter() > end:
            break
        t0 = time.perf_counter()
        target = min(lo + step, hi)
        keep, forest_plan = plans_up_to(pr, ascent, target, end, lambda k: _far_over(pr, k, cap, max_pairs))
        if (
            forest_plan is not None and forest_plan[0] < hi
        ):  # its options join the restricted ILP, which then finds it or better
            for q, o in enumerate(forest_plan[1]):
                pr.add(q, [o])
        with_them = [k | kept for k, kept in zip(keep, pr.kept)]
        n_opts, pairs = sum(int(k.sum()) for k in with_them), pairs_among(pr.q, with_them)
        probe = Probe(target, n_opts, pairs, "too many")
        probes.append(probe)
        if n_opts > cap or pairs > max_pairs:
            # a plan near the target: each class's NEAR_PER_CLASS options of
            # least belief among those the target keeps join the restricted ILP
            for q, (k, b) in enumerate(zip(keep, ascent.belief)):
                opts = np.flatnonzero(k & ~pr.kept[q])
                pr.add(q, opts[np.argsort(b[opts], kind="stable")[:NEAR_PER_CLASS]])
            sol = solve_ilp(ILP_SECONDS)
            if sol is not None and sol.objective < hi:
                best, hi = sol, sol.objective
            probe.seconds = time.perf_counter() - t0
            _log(probe, lo, hi)
            if not ascent.stalled and (end is None or time.perf_counter() < end):
                # sharper beliefs and rewritten costs keep fewer options at the same target
                plan = None if best is None else [best.choice[q] for q in range(len(pr.q.classes))]
                lo = max(lo, ascent.run(ASCENT_SWEEPS, upper=hi, keep=plan, deadline=end))
                step = max(FIRST_STEP * abs(lo), (hi - lo) / 64)
                continue
            if step <= MIN_STEP * max(abs(lo), hi - lo) or target <= lo:
                break
            step = min(step, target - lo) / 2
            continue
        for q, k in enumerate(keep):
            pr.add(q, np.flatnonzero(k))
        # what is left of the bisection's time: a restricted ILP cut short proves nothing
        sol = solve_ilp(ILP_SECONDS if end is None else max(ILP_SECONDS, end - time.perf_counter()))
        probe.seconds = time.perf_counter() - t0
        if sol is not None and sol.status != "optimal":
            probe.outcome, probe.objective = "ilp stopped", sol.objective
            _log(probe, lo, hi)
            break
        if sol is not None:
            probe.objective = sol.objective
            if sol.objective < hi:
                best, hi = sol, sol.objective
        tol = OPT_RTOL * max(1.0, abs(target))
        if sol is not None and sol.objective <= target + tol:
            probe.outcome = "proven"
            _log(probe, lo, hi)
            lo, proven = hi, True
            break
        probe.outcome = "none cheaper"
        lo = max(lo, target)  # no plan costs the target or less
        _log(probe, lo, hi)
        step *= 2
    stats.tree_bound = max(stats.tree_bound, lo)
    # The probes' options served their ILPs: the kept subsets go back to what
    # they were plus the best plan's, so the dense problem rebuilt over them
    # downstream (plan report, apply) stays small (2 layers: 42K options
    # kept, 90 s more under load, where ~6K did before).
    pr.kept[:] = kept_before
    for q, o in best.choice.items() if best is not None else ():
        pr.add(q, [o])
    logger.info(
        "target bisection: %d targets in %.1fs, plan %.9g, bound %.9g, %s",
        len(probes),
        time.perf_counter() - t_start,
        hi,
        lo,
        "proven" if proven else "not proven",
    )
    return best, lo, proven


def _far_over(pr: Pricer, keep: list[np.ndarray], cap: int, max_pairs: int) -> bool:
    with_them = [k | kept for k, kept in zip(keep, pr.kept)]
    return sum(int(k.sum()) for k in with_them) > FAR_OVER * cap or pairs_among(pr.q, with_them) > FAR_OVER * max_pairs


def _log(probe: Probe, lo: float, hi: float) -> None:
    logger.info(
        "target %.9g: %d options, %d pairs, %s%s in %.1fs; bound %.9g, plan %.9g",
        probe.target,
        probe.options,
        probe.pairs,
        probe.outcome,
        "" if probe.objective is None else f" (restricted ILP {probe.objective:.9g})",
        probe.seconds,
        lo,
        hi,
    )
