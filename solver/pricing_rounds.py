"""The LP rounds of option pricing (:func:`solver.pricing.solve_by_pricing`).

:class:`Pricer` holds, per class of the quotient
(:mod:`solver.pricing_quotient`), the *exact* options (every pair read) and
the *relaxed* ones (pairs within them charged the edge's floor); it solves
the restricted LP over them (:mod:`solver.pricing_lp`), extends its duals to
every option left out (reduced costs, steps 1-3 of the method in
:mod:`solver.pricing`) and solves the restricted ILP over the exact ones.
:func:`lp_rounds` prices options in, round by round, until no left-out
option is cheaper or the counted work (``solver.work.MAX_PRICING_ROUNDS``,
``max_options``) runs out.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .diagnose import InfeasibleError
from .ilp_route import solve_by_ilp
from .problem import Decision, Edge, Problem, ResourceConstraint, Solution
from .pricing_lp import LPSolution, RestrictedLP
from .pricing_quotient import Quotient
from .tree_bound import Reparam
from .work import DEFAULT_NODE_LIMIT, MAX_PRICING_ROUNDS, SafetyCap

if TYPE_CHECKING:
    from .pricing_stats import PricingStats

logger = logging.getLogger(__name__)

# Options priced in per class and round (the most negative reduced costs),
# and per round overall (at least ROUND_CAP_MIN, else 2 per class).
ADD_PER_CLASS = 8
ROUND_CAP_MIN = 256
# Left-out options enter when their reduced cost is below -PRICE_TOL in
# scaled units (costs divided by the largest seen, so about 1; HiGHS' own
# dual feasibility tolerance is solver.pricing_lp.DUAL_TOL).
PRICE_TOL = 1e-9


class Pricer:
    """The subsets, the restricted LP and the pricing of one quotient."""

    def __init__(self, quotient: Quotient):
        self.q = quotient
        # exact options (S: every pair read) and relaxed ones (R: pairs with
        # S read, pairs within R charged the edge's floor); disjoint
        self.kept = [np.zeros(c.num_options, dtype=bool) for c in quotient.classes]
        self.relaxed = [np.zeros(c.num_options, dtype=bool) for c in quotient.classes]
        self.scale: float | None = None
        self.lp: RestrictedLP | None = None
        self.reparam: Reparam | None = None  # the last reduced costs and extended duals
        self.node_limit: int | None = DEFAULT_NODE_LIMIT  # MIP nodes per restricted ILP

    # -- subsets ----------------------------------------------------------
    def subsets(self) -> list[np.ndarray]:
        return [np.flatnonzero(k) for k in self.kept]

    def num_kept(self) -> int:
        return int(sum(k.sum() for k in self.kept))

    def num_relaxed(self) -> int:
        return int(sum(k.sum() for k in self.relaxed))

    def add(self, q: int, options) -> int:
        opts = np.asarray(options, dtype=np.int64)
        opts = opts[self.q.classes[q].allowed[opts] & ~self.kept[q][opts]]
        self.kept[q][opts] = True
        self.relaxed[q][opts] = False
        return len(opts)

    def seed(self, problem: Problem, initial: dict[str, list[int]] | None) -> None:
        classes = self.q.classes
        if initial is not None:
            known = problem.decision_index()
            unknown = sorted(set(initial) - known.keys())
            if unknown:
                raise KeyError(f"initial options for unknown decisions {unknown}")
            for q, cls in enumerate(classes):
                for name, omap in cls.members:
                    ids = np.asarray(initial.get(name, ()), dtype=np.int64).reshape(-1)
                    if not len(ids):
                        continue
                    n = known[name].num_options
                    if ids.min() < 0 or ids.max() >= n:
                        raise ValueError(
                            f"initial options {sorted(ids.tolist())} for {name!r}: option ids are 0..{n - 1}"
                        )
                    self.add(q, ids if omap is None else np.flatnonzero(np.isin(omap, ids)))
        for q, cls in enumerate(classes):
            if initial is None or not self.kept[q].any():
                self.add(q, [self.cheapest(q)])
        if initial is None:
            self.add_resource_extremes()
        self.repair_arcs()

    def cheapest(self, q: int, k: int = 1) -> np.ndarray:
        """The ``k`` allowed options of lowest unary cost (ties: lowest id)."""
        cls = self.q.classes[q]
        opts = np.flatnonzero(cls.allowed)
        return opts[np.lexsort((opts, cls.unary[opts]))][:k]

    def add_resource_extremes(self) -> int:
        """Per resource and class, its lightest option (heaviest for a lower
        bound): what a restricted LP needs to meet the bounds."""
        added = 0
        for r in self.q.resources:
            for q, w in r.weights.items():
                cls = self.q.classes[q]
                opts = np.flatnonzero(cls.allowed)
                for sign, bound in ((1.0, r.high), (-1.0, r.low)):
                    if bound is not None:
                        best = opts[np.lexsort((opts, cls.unary[opts], sign * w[opts]))][:1]
                        added += self.add(q, best)
        return added

    def repair_arcs(self, passes: int = 8) -> int:
        """Give every kept option a finite partner on each edge (the cheapest
        by pair plus unary cost), to a fixpoint or ``passes`` passes."""
        classes = self.q.classes
        added = 0
        for _ in range(passes):
            before = added
            for e in self.q.edges:
                sp, sc = np.flatnonzero(self.kept[e.p]), np.flatnonzero(self.kept[e.c])
                rows = e.rows(sp)  # |S_p| x all column options
                lonely = ~np.isfinite(rows[:, sc]).any(axis=1)
                for k in np.flatnonzero(lonely):
                    j = _argmin_finite(rows[k] + classes[e.c].unary)
                    if j is not None:
                        added += self.add(e.c, [j])
                cols = e.cols(sc)
                lonely = ~np.isfinite(cols[sp]).any(axis=0)
                for k in np.flatnonzero(lonely):
                    i = _argmin_finite(cols[:, k] + classes[e.p].unary)
                    if i is not None:
                        added += self.add(e.p, [i])
            if added == before:
                break
        return added

    def grow(self, level: int) -> int:
        """Seed growth for an infeasible restricted problem: resource
        extremes, then the ``2**level`` cheapest options per class, the
        level raised until some option is new (unless all are kept).
        Returns the level reached."""
        before = self.num_kept()
        self.add_resource_extremes()
        total = sum(int(c.allowed.sum()) for c in self.q.classes)
        while True:
            for q in range(len(self.q.classes)):
                self.add(q, self.cheapest(q, 2**level))
            self.repair_arcs()
            if self.num_kept() > before or self.num_kept() >= total:
                return level
            level += 1

    # -- the restricted LP ------------------------------------------------
    def _scale(self, S: list[np.ndarray]) -> float:
        if self.scale is None:
            big = max((float(np.abs(c.unary[s]).max()) for c, s in zip(self.q.classes, S)), default=0.0)
            for e in self.q.edges:
                b = e.block(S[e.p], S[e.c])
                b = b[np.isfinite(b)]
                if b.size:
                    big = max(big, float(np.abs(b).max()))
            self.scale = 1.0 / big if big > 0 else 1.0
        return self.scale

    def solve_lp(self, time_limit: float | None) -> LPSolution | None:
        """The restricted LP's optimum and duals (true units); ``None`` when
        it is infeasible. Raises TimeoutError when it runs out of time."""
        if self.lp is None:
            self.lp = RestrictedLP(self.q, self._scale(self.subsets()))
        self.lp.sync(self.kept, self.relaxed)
        return self.lp.solve(time_limit)

    # -- pricing ----------------------------------------------------------
    def reduced_costs(self, lp: LPSolution) -> list[np.ndarray]:
        """``r_q(o)`` for every option of every class (inf: not allowed),
        with the restricted duals extended to the options left out of the
        LP (module docstring): a left-out column option of edge E first gets
        ``beta_o = min(gamma, min_{i in S_p} C(i,o) - alpha_i)``; a left-out
        row option then its best partner over every column,
        ``alpha_o = min_j C(o,j) - beta_j``, and a left-out column option in
        turn ``beta_o = min_i C(i,o) - alpha_i`` over every row (each step
        keeps every pair dual feasible and raises no dual). When the matrix
        cannot reduce whole rows, the row option gets ``min(floor - gamma,
        min_{j in S_c} C(o,j) - beta_j)``: the floor for pairs of two
        left-out options."""
        classes = self.q.classes
        L = lp.options
        acc = [c.unary - lp.u[q] for q, c in enumerate(classes)]
        alphas, betas = [], []
        for k, e in enumerate(self.q.edges):
            a, b = lp.alpha[k], lp.beta[k]
            exact_p, exact_c = self.kept[e.p][L[e.p]], self.kept[e.c][L[e.c]]
            gamma = _gamma(e.floor, lp, k, a, b, ~exact_p, ~exact_c, lp.x[e.p], lp.x[e.c])
            ext_b = np.minimum(gamma, (e.rows(L[e.p][exact_p]) - a[exact_p][:, None]).min(axis=0))
            ext_b[L[e.c]] = b
            # left-out pairs at the floor
            ext_a = np.minimum(e.floor - gamma, (e.cols(L[e.c][exact_c]) - b[exact_c]).min(axis=1))
            whole = e.min_plus(_usable(classes[e.c].allowed, ext_b), along_rows=True)
            if whole is not None:
                # every partner read (a lower bound on it for edges of several
                # matrices): each of the two is dual feasible, so their max is
                ext_a = np.maximum(ext_a, whole)
            ext_a[L[e.p]] = a
            if whole is not None:
                # the best column duals given those row duals (never lower)
                ext_b = np.maximum(ext_b, e.min_plus(_usable(classes[e.p].allowed, ext_a), along_rows=False))
                ext_b[L[e.c]] = b
            acc[e.p] += ext_a
            acc[e.c] += ext_b
            alphas.append(ext_a)
            betas.append(ext_b)
        for r, rho in zip(self.q.resources, lp.rho):
            if rho:
                for q, w in r.weights.items():
                    acc[q] -= rho * w
        for q, c in enumerate(classes):
            acc[q][~c.allowed] = math.inf
        self.reparam = Reparam(lp.objective, acc, alphas, betas)
        return acc

    def select(self, reduced: list[np.ndarray], tol: float) -> list[tuple[float, int, int]]:
        """Options left out of the LP to price in (as relaxed): per class the ADD_PER_CLASS most
        negative below ``-tol``, at most a round cap overall; (r, class, option)."""
        picks = []
        for q, r in enumerate(reduced):
            cand = np.flatnonzero((r < -tol) & ~self.kept[q] & ~self.relaxed[q])
            cand = cand[np.lexsort((cand, r[cand]))][:ADD_PER_CLASS]
            picks += [(float(r[o]), q, int(o)) for o in cand]
        picks.sort()
        return picks[: max(ROUND_CAP_MIN, 2 * len(reduced))]

    def relax(self, q: int, o: int) -> None:
        if not self.kept[q][o]:
            self.relaxed[q][o] = True

    def promotions(self, lp: LPSolution, values: list[np.ndarray]) -> list[tuple[int, np.ndarray]]:
        """Relaxed options whose ``values`` (per LP option) exceed 1e-9."""
        out = []
        for q, (opts, v) in enumerate(zip(lp.options, values)):
            up = opts[(v > 1e-9) & self.relaxed[q][opts]]
            if len(up):
                out.append((q, up))
        return out

    # -- the restricted ILP ------------------------------------------------
    def restricted_problem(self) -> Problem:
        classes = self.q.classes
        S = self.subsets()
        return Problem(
            decisions=[Decision(c.name, [c.labels[o] for o in s], c.unary[s].tolist()) for c, s in zip(classes, S)],
            edges=[
                Edge(classes[e.p].name, classes[e.c].name, 0, e.block(S[e.p], S[e.c]).tolist()) for e in self.q.edges
            ],
            resources=[
                ResourceConstraint(
                    r.name, {classes[q].name: w[S[q]].tolist() for q, w in r.weights.items()}, r.low, r.high
                )
                for r in self.q.resources
            ],
            name="pricing-restricted",
        )

    def solve_ilp(self, backend, time_limit) -> Solution | None:
        """The restricted ILP's solution with class choices in root option
        ids (``choice`` keyed by class index); ``None`` if infeasible. It
        stops on ``node_limit`` MIP nodes (counted), ``time_limit`` being
        the safety cap."""
        try:
            # the ILP alone: a restricted problem never goes back to pricing
            sol = solve_by_ilp(
                self.restricted_problem(), backend=backend, time_limit=time_limit, node_limit=self.node_limit
            )
        except InfeasibleError as exc:
            logger.info("restricted ILP over %d options infeasible: %s", self.num_kept(), exc)
            return None
        S = self.subsets()
        sol.choice = {q: int(S[q][sol.choice[c.name]]) for q, c in enumerate(self.q.classes)}
        return sol


def _gamma(
    floor: float,
    lp: LPSolution,
    k: int,
    alpha: np.ndarray,
    beta: np.ndarray,
    relaxed_p: np.ndarray,
    relaxed_c: np.ndarray,
    x_p: np.ndarray,
    x_c: np.ndarray,
) -> float:
    """Edge ``k``'s split of its floor between the caps of left-out options
    (``floor - gamma`` at the row end, ``gamma`` at the column end).

    The LP's relaxed options need ``max beta_R <= gamma <= floor - max
    alpha_R`` (their z/w columns); within that any value is valid. The LP's
    duals are degenerate (a constant moves freely between an edge's two
    ends), so its own gamma, or a fixed split like ``floor/2``, can leave
    every left-out option looking cheaper than the kept ones: the split is
    centred on the duals of the options the LP uses (weighted by x; any
    excess over the floor shared equally), then clamped into that range."""
    top_a = float(alpha @ x_p) / max(float(x_p.sum()), 1e-300)
    top_b = float(beta @ x_c) / max(float(x_c.sum()), 1e-300)
    gamma = top_b - (top_a + top_b - floor) / 2
    lo = float(beta[relaxed_c].max()) if relaxed_c.any() else -math.inf
    hi = floor - float(alpha[relaxed_p].max()) if relaxed_p.any() else math.inf
    if lo > hi:  # tolerances: HiGHS' own value is feasible
        return float(lp.gamma[k])
    return min(max(gamma, lo), hi)


def _usable(allowed: np.ndarray, duals: np.ndarray) -> np.ndarray:
    """Duals of the options a min-plus reduction may pair with: -inf (left
    out) where the option is not allowed or has no finite partner (+inf)."""
    return np.where(allowed & (duals < math.inf), duals, -math.inf)


def _argmin_finite(values: np.ndarray) -> int | None:
    if not np.isfinite(values).any():
        return None
    return int(np.argmin(values))  # first of the minima: lowest id


@dataclass
class Rounds:
    """What the LP rounds leave: the last round's reduced costs (None when no
    round ran), the best lower bound of all rounds, and how far the seed was
    grown (:meth:`Pricer.grow`)."""

    reduced: list[np.ndarray] | None = None
    lower_bound: float = -math.inf
    growth: int = 0


def lp_rounds(pr: Pricer, stats: PricingStats, cap: int, clock: SafetyCap, t_start: float) -> Rounds:
    """Price options in until the restricted LP's optimum uses exact pairs
    only and no left-out option has a negative reduced cost (``stats.converged``:
    its value is the full LP's), or the rounds, ``cap`` options or the safety
    cap run out. What the last LP used becomes exact, for the restricted ILP."""
    out = Rounds()
    sec = stats.seconds
    lp_last = None
    while True:
        t0 = time.perf_counter()
        try:
            lp = pr.solve_lp(clock.left())
        except TimeoutError as exc:
            logger.info("pricing stopped: %s", exc)
            sec["lp"] += time.perf_counter() - t0
            break
        sec["lp"] += time.perf_counter() - t0
        if lp is None:  # the seed cannot support any choice: grow it
            out.growth = _grow_for_lp(pr, stats, cap, out.growth)
            continue
        t0 = time.perf_counter()
        out.reduced = pr.reduced_costs(lp)
        lp_last = lp
        violation = sum(min(0.0, float(r.min())) for r in out.reduced)
        out.lower_bound = max(out.lower_bound, lp.objective + violation)
        picks = pr.select(out.reduced, PRICE_TOL / pr.scale)
        # relaxed options carrying relaxed-relaxed flow become exact
        promote = pr.promotions(lp, lp.fake)
        _record_round(pr, stats, lp, violation, picks, promote)
        sec["pricing"] += time.perf_counter() - t0
        _log_round(pr, stats, lp, violation, len(picks), t_start)
        if not picks and not promote:
            stats.converged = True  # an LP optimum using exact pairs only, no left-out option cheaper
            break
        # counted: the rounds end at the same point on every run (the cap is a safety net)
        if pr.num_kept() + pr.num_relaxed() + len(picks) > cap or stats.rounds >= MAX_PRICING_ROUNDS or clock.reached():
            break
        for _, q, o in picks:
            pr.relax(q, o)
        for q, opts in promote:
            pr.add(q, opts)
    if lp_last is not None:  # what the last LP used becomes exact: the ILP may use it
        for q, opts in pr.promotions(lp_last, lp_last.x):
            pr.add(q, opts)
    return out


def _grow_for_lp(pr: Pricer, stats: PricingStats, cap: int, growth: int) -> int:
    """Grow a seed over which the restricted LP is infeasible; raises
    :class:`InfeasibleError` when every option is in, or more than ``cap``."""
    if pr.num_kept() >= stats.options_total:
        raise InfeasibleError(
            f"Infeasible: the LP relaxation over all {stats.options_total} options has no "
            "solution, so the problem has none"
        )
    growth = pr.grow(growth + 1)
    logger.info("restricted LP infeasible: seed grown to %d options", pr.num_kept())
    if pr.num_kept() > cap:
        raise InfeasibleError(
            f"Infeasible restricted LP: the seed could not be made feasible within "
            f"max_options={cap} options ({pr.num_kept()} kept); raise max_options"
        )
    return growth


def _record_round(pr: Pricer, stats: PricingStats, lp: LPSolution, violation: float, picks, promote) -> None:
    stats.rounds += 1
    stats.kept_per_round.append(pr.num_kept())
    stats.relaxed_per_round.append(pr.num_relaxed())
    stats.priced_per_round.append(len(picks))
    stats.promoted_per_round.append(sum(len(o) for _, o in promote))
    stats.lp_objective_per_round.append(lp.objective)
    stats.bound_per_round.append(lp.objective + violation)


def _log_round(pr: Pricer, stats: PricingStats, lp: LPSolution, violation: float, picked: int, t_start: float) -> None:
    logger.info(
        "pricing round %d: %d exact + %d relaxed options, %d priced in, %d promoted, LP %.12g, bound %.12g, %.2fs",
        stats.rounds,
        pr.num_kept(),
        pr.num_relaxed(),
        picked,
        stats.promoted_per_round[-1],
        lp.objective,
        lp.objective + violation,
        time.perf_counter() - t_start,
    )
