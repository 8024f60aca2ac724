"""Exact plans over a few options per decision: option pricing with LP duals.

Why: on a 4-D mesh one transformer layer has ~143K options and ~114M option
pairs; the dense :class:`~solver.problem.Problem` cannot even be built, yet
almost no option ever matters. :func:`solve_by_pricing` solves over a small
subset of options per decision and proves, with LP duals, that no left-out
option can improve the plan ("price and branch" with reduced-cost fixing).

First, when every matrix reduces whole rows (``min_plus_rows``), the
seed's restricted ILP gives a plan and spanning-forest min-marginals
(:mod:`solver.tree_bound`) and the dual ascent (:mod:`solver.dual_bound`,
which reaches about the LP's optimum over every option) drop every option
that is in no cheaper plan (:mod:`solver.pricing_proof`); when the options
left have few enough pairs (``DIRECT_PAIRS``) the ILP over all of them is
the answer, proven optimal, with no LP rounds (random placement problem of
200 decisions x 1024 options: 96% dropped, optimal in 78 s where the
rounds alone stopped at a 7% gap). The ascent runs up to
``solver.work.MAX_ASCENT_SWEEPS`` sweeps; when its bound meets its plan (the
LP is tight: LLaMA-3 70B on 4x4x8x8, 80 layers, 43 sweeps) that plan is
proven optimal and no LP round runs. Otherwise the rounds look for a
cheaper plan, the ascent goes on against the restricted ILP's plan and its
forests filter reduced-cost fixing (step 4); where fixing needs too many
options, a target bisection (:mod:`solver.pricing_bisect`) solves
restricted ILPs at targets a little above the ascent's bound, which
prove the plan or raise the bound (where the LP relaxation is loose: bf16).

How (on the quotient by links, :mod:`solver.pricing_quotient`): per class
``q`` a set ``S_q`` of *exact* options (all their pairs read: whole rows and
columns of the lazy matrices) and a set ``R_q`` of *relaxed* ones (pairs
with exact options read, pairs of two relaxed options charged the edge's
``floor``, a lower bound, through one aggregate flow per edge), see
:mod:`solver.pricing_lp`.

1. The restricted LP (local polytope) over ``S`` and ``R``: ``min sum
   c_q(o) x_qo + sum C_E(i,j) y_Eij + floor_E z_E`` s.t. ``sum_o x_qo = 1``
   (dual ``u_q``), ``sum_j y_Eij (+ z_Ei) - x_pi = 0`` (``alpha_Ei``), ``sum_i
   y_Eij (+ w_Ej) - x_cj = 0`` (``beta_Ej``), ``sum z_E = sum w_E``
   (``gamma_E``), resource rows (``rho_r``). HiGHS' reduced cost of a column
   is ``c - A^T y``. It is a relaxation of the problem over ``S`` and ``R``.
2. Its duals extend to every option left out: at the row end of ``E``,
   ``alpha_Eo = min(floor_E - gamma_E, min_{j in S_c} C(o,j) - beta_Ej)``, at
   the column end ``beta_Eo = min(gamma_E, min_{i in S_p} C(i,o) -
   alpha_Ei)``; every pair column is then dual feasible (a pair with no exact
   end: ``alpha + beta <= floor <= C``, the z/w columns enforcing the caps on
   relaxed options). ``gamma_E`` may be any value the relaxed options allow
   (:func:`_gamma` picks one centred on the used options' duals). An option's
   reduced cost is ``r_q(o) = c_q(o) - u_q + sum_{E: q rows} alpha_Eo +
   sum_{E: q cols} beta_Eo - sum_r rho_r w_r(o)``; lowering ``u_q`` by ``v_q
   = max(0, -min_o r_q(o))`` makes the whole dual feasible for the full LP:
   ``LB = LP - sum_q v_q`` bounds the optimum from below, in every round.
3. Left-out options with ``r < 0`` enter as relaxed (the most negative few
   per class: no matrix entry read); relaxed options the LP sends flow
   through the aggregate (a pair of two relaxed options) become exact. When
   neither happens, the LP's optimum uses exact pairs only, so it is feasible
   for the full LP, and ``LB`` equals its value: the full LP's optimum.
4. The options the LP uses become exact and the restricted ILP (a dense
   problem over ``S``, :func:`solver.solve`) gives ``z_R``. Any choice costs
   at least ``LB + sum_q r'_q(o_q)`` with ``r' = r + v >= 0``, so a cheaper
   one uses only options outside ``S`` with ``r' <= z_R - LB`` ("reduced-cost
   fixing"): with those made exact, the restricted optimum is the full
   optimum. If that would exceed ``max_options``, the result is ``z_R`` with
   bound LB, status "feasible".

Example::

    >>> from solver.problem import Decision, Edge, Problem
    >>> p = Problem(
    ...     decisions=[Decision("a", ["R", "S0", "S1"], [1.0, 0.5, 9.0]),
    ...                Decision("b", ["R", "S0", "S1"], [1.0, 0.5, 9.0])],
    ...     edges=[Edge("a", "b", 0, [[0, 1, 1], [2, 0, 1], [1, 1, 0]])],
    ... )
    >>> r = solve_by_pricing(p, {"a": [0], "b": [0]})
    >>> r.solution.choice, r.solution.objective, r.solution.status
    ({'a': 1, 'b': 1}, 1.0, 'optimal')
    >>> r.kept  # option 0 left with the forests: in no plan as cheap
    {'a': [1], 'b': [1]}
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from .api import solve
from .diagnose import InfeasibleError
from .problem import Decision, Edge, Problem, ResourceConstraint, Solution
from .pricing_lp import LPSolution, RestrictedLP
from .pricing_quotient import Quotient, build_quotient, evaluate_lazy
from .pricing_bisect import bisect_targets
from .pricing_proof import TREES, final_ascent, pairs_among, prefilter
from .tree_bound import Reparam, eliminate
from .work import DEFAULT_NODE_LIMIT, MAX_PRICING_ROUNDS, SafetyCap, stopped_by

logger = logging.getLogger(__name__)

# Default cap on the options kept over all classes: reduced-cost fixing that
# would need more gives up proving (status "feasible" with the LP bound).
DEFAULT_MAX_OPTIONS = 20_000
# Options priced in per class and round (the most negative reduced costs),
# and per round overall (at least ROUND_CAP_MIN, else 2 per class).
ADD_PER_CLASS = 8
ROUND_CAP_MIN = 256
# Left-out options enter when their reduced cost is below -PRICE_TOL in
# scaled units (costs divided by the largest seen, so about 1; HiGHS' own
# dual feasibility tolerance is solver.pricing_lp.DUAL_TOL).
PRICE_TOL = 1e-9
# Relative gap under which the restricted ILP's objective is the optimum.
OPT_RTOL = 1e-9
# Pairs between the options left after tree elimination up to which the
# restricted ILP simply takes all of them (no pricing rounds).
DIRECT_PAIRS = 3_000_000


@dataclass
class PricingStats:
    """How the pricing went; seconds per phase: setup (quotient), lp,
    pricing, ilp, evaluate."""

    classes: int = 0
    options_total: int = 0  # allowed options over all classes
    rounds: int = 0
    kept_per_round: list[int] = field(default_factory=list)  # exact options
    relaxed_per_round: list[int] = field(default_factory=list)
    promoted_per_round: list[int] = field(default_factory=list)
    priced_per_round: list[int] = field(default_factory=list)
    lp_objective_per_round: list[float] = field(default_factory=list)
    bound_per_round: list[float] = field(default_factory=list)
    lower_bound: float = -math.inf
    restricted_objectives: list[float] = field(default_factory=list)
    fixed_in: int = 0  # options added by reduced-cost fixing
    tree_bound: float = -math.inf  # best spanning-forest bound (solver.tree_bound)
    eliminated: int = 0  # options dropped by tree min-marginals before pricing
    ascent_bound: float = -math.inf  # the dual ascent's (solver.dual_bound)
    ascent_sweeps: int = 0
    entries_read: int = 0  # matrix entries materialised (pairs)
    converged: bool = False  # the LP reached the full LP's optimum
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class PricingResult:
    """``solution.choice`` in the problem's option ids; ``kept``: per
    decision, the sorted option ids of the final subsets (the optimum over
    them is the optimum over all when ``solution.status == "optimal"``)."""

    solution: Solution
    kept: dict[str, list[int]]
    stats: PricingStats


class _Pricer:
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
            sol = solve(self.restricted_problem(), backend=backend, time_limit=time_limit, node_limit=self.node_limit)
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


def solve_by_pricing(
    problem: Problem,
    initial: dict[str, list[int]] | None = None,
    *,
    backend: str | None = None,
    time_limit: float | None = None,
    max_options: int | None = None,
    node_limit: int | None = DEFAULT_NODE_LIMIT,
) -> PricingResult:
    """An optimal choice of ``problem`` (dense or lazy edge matrices) found
    over small option subsets; see the module docstring.

    ``initial``: per decision, option ids to start from (default: per class
    its cheapest option and its lightest per resource). ``max_options``: the
    most options over all classes in the restricted LP (exact and relaxed)
    and in the final exact subsets (default DEFAULT_MAX_OPTIONS); when the
    proof would need more, the result is "feasible" with a gap.
    Where it stops is counted work (``solver.work``: LP rounds, ascent
    sweeps, bisection targets, ``node_limit`` MIP nodes per restricted ILP);
    ``time_limit`` (seconds) is a safety cap over all of it.

    Raises :class:`InfeasibleError` when no choice satisfies the problem
    (or no restricted problem within ``max_options`` is feasible).
    """
    t_start = time.perf_counter()
    clock = SafetyCap(time_limit, t_start)
    deadline = clock.deadline
    cap = DEFAULT_MAX_OPTIONS if max_options is None else max_options
    stats = PricingStats()
    sec = stats.seconds
    for phase in ("setup", "lp", "pricing", "ilp", "trees", "evaluate"):
        sec[phase] = 0.0

    left = clock.left
    quotient = build_quotient(problem)
    pr = _Pricer(quotient)
    pr.node_limit = node_limit
    pr.seed(problem, initial)
    stats.classes = len(quotient.classes)
    stats.options_total = int(sum(c.allowed.sum() for c in quotient.classes))
    sec["setup"] = time.perf_counter() - t_start
    stats.eliminated, ascent, upper = prefilter(pr, backend, deadline, stats)
    survivors = sum(int(c.allowed.sum()) for c in quotient.classes)
    pairs = pairs_among(quotient, [c.allowed for c in quotient.classes])
    # Few enough options left: the ILP over all of them is the proof.
    exhaustive = bool(stats.eliminated) and survivors <= cap and pairs <= DIRECT_PAIRS
    if exhaustive:
        logger.info(
            "pricing: %d options and %d pairs left after tree elimination: solving over all of them", survivors, pairs
        )
        for q, c in enumerate(quotient.classes):
            pr.add(q, np.flatnonzero(c.allowed))

    growth = 0
    reduced = None
    lb = -math.inf
    # the ascent met its plan: that plan is optimal, no LP rounds
    closed = ascent is not None and upper - stats.ascent_bound <= OPT_RTOL * max(1.0, abs(upper))
    while not exhaustive and not closed:
        t0 = time.perf_counter()
        try:
            lp = pr.solve_lp(left())
        except TimeoutError as exc:
            logger.info("pricing stopped: %s", exc)
            sec["lp"] += time.perf_counter() - t0
            break
        sec["lp"] += time.perf_counter() - t0
        if lp is None:  # the seed cannot support any choice: grow it
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
            continue
        t0 = time.perf_counter()
        reduced = pr.reduced_costs(lp)
        lp_last = lp
        violation = sum(min(0.0, float(r.min())) for r in reduced)
        lb = max(lb, lp.objective + violation)
        picks = pr.select(reduced, PRICE_TOL / pr.scale)
        # relaxed options carrying relaxed-relaxed flow become exact
        promote = pr.promotions(lp, lp.fake)
        stats.rounds += 1
        stats.kept_per_round.append(pr.num_kept())
        stats.relaxed_per_round.append(pr.num_relaxed())
        stats.priced_per_round.append(len(picks))
        stats.promoted_per_round.append(sum(len(o) for _, o in promote))
        stats.lp_objective_per_round.append(lp.objective)
        stats.bound_per_round.append(lp.objective + violation)
        sec["pricing"] += time.perf_counter() - t0
        logger.info(
            "pricing round %d: %d exact + %d relaxed options, %d priced in, %d promoted, LP %.12g, bound %.12g, %.2fs",
            stats.rounds,
            pr.num_kept(),
            pr.num_relaxed(),
            len(picks),
            stats.promoted_per_round[-1],
            lp.objective,
            lp.objective + violation,
            time.perf_counter() - t_start,
        )
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
    stats.lower_bound = lb
    if stats.rounds:  # what the last LP used becomes exact: the ILP may use it
        for q, opts in pr.promotions(lp_last, lp_last.x):
            pr.add(q, opts)

    def run_ilp(at_least: float = 1.0) -> Solution | None:
        t0 = time.perf_counter()
        # past the deadline the ILP still gets ``at_least`` seconds: an answer beats none
        sol = pr.solve_ilp(backend, left(at_least))
        sec["ilp"] += time.perf_counter() - t0
        if sol is not None:
            stats.restricted_objectives.append(sol.objective)
        return sol

    sol = run_ilp()
    while sol is None:  # LP-feasible but no integral choice over the subsets
        if pr.num_kept() >= stats.options_total:
            raise InfeasibleError(f"Infeasible: no choice over all {stats.options_total} options")
        growth = pr.grow(growth + 1)
        if pr.num_kept() > cap:
            raise InfeasibleError(
                f"no feasible choice over {pr.num_kept()} of {stats.options_total} options; "
                f"raise max_options={cap} to look further"
            )
        sol = run_ilp()

    z = sol.objective
    tol = OPT_RTOL * max(1.0, abs(z))
    bound = max(lb, stats.tree_bound)
    if sol.status == "optimal" and (exhaustive or z - bound <= tol):
        bound = z
    elif sol.status == "optimal" and (reduced is not None or ascent is not None):
        # Reduced-cost fixing with the last round's duals (any round's are
        # valid): a cheaper choice uses only options with r' = r + v_q <= z - LB;
        # and, where the matrices reduce whole rows, only options whose
        # spanning-tree min-marginal is at most z (solver.tree_bound), the
        # forests over the costs the dual ascent rewrote (solver.pricing_proof)
        t0 = time.perf_counter()
        tree_keep = None
        if ascent is not None:
            plan = [sol.choice[q] for q in range(len(quotient.classes))]
            tree_keep, upper, plan, _ = final_ascent(pr, ascent, z, plan, backend, deadline, stats)
            if upper < z:  # a decoded plan is cheaper: the restricted ILP finds it
                for q, o in enumerate(plan):
                    pr.add(q, [o])
                better = run_ilp()
                if better is not None and better.objective < sol.objective:
                    sol = better
        else:
            # forests of the raw costs, then of the costs rewritten by the last
            # duals (bound at least the LP's); an option must pass both
            trees = eliminate(quotient, z, trees=TREES)
            if trees is not None:
                dual_trees = eliminate(quotient, min(z, trees.upper), trees=TREES, reparam=pr.reparam)
                # (a forest plan cheaper than z keeps its options: the ILP below finds it)
                tree_keep = [a & b for a, b in zip(trees.keep, dual_trees.keep)]
                stats.tree_bound = max(stats.tree_bound, trees.bound, dual_trees.bound)
                for plan in (trees.plan, dual_trees.plan):
                    for q, o in enumerate(plan or ()):
                        tree_keep[q][o] = True
        bound = max(bound, stats.tree_bound)
        sec["trees"] += time.perf_counter() - t0
        fix = []
        for q, c in enumerate(quotient.classes):
            mask = c.allowed & ~pr.kept[q]
            if reduced is not None:
                r = reduced[q]
                mask &= r - min(0.0, float(r.min())) <= z - stats.bound_per_round[-1] + tol
            fix.append(np.flatnonzero(mask if tree_keep is None else mask & tree_keep[q]))
        if sol.objective - bound <= tol:
            fix = []  # the bound meets the plan
        n_fix = sum(len(f) for f in fix)
        with_fix = [k.copy() for k in pr.kept]
        for k, f in zip(with_fix, fix):
            k[f] = True
        fix_pairs = pairs_among(quotient, with_fix)  # the dense restricted ILP holds them all
        logger.info(
            "reduced-cost fixing: gap %.6g, %d options within it (%d kept, %d pairs with them)",
            sol.objective - bound,
            n_fix,
            pr.num_kept(),
            fix_pairs,
        )
        if pr.num_kept() + n_fix <= cap and fix_pairs <= DIRECT_PAIRS:
            for q, f in enumerate(fix):
                pr.add(q, f)
            stats.fixed_in = n_fix
            if n_fix:
                better = run_ilp()
                proven = better is not None and better.status == "optimal"
                if better is not None and better.objective < sol.objective:
                    sol = better
            else:
                proven = True
            if proven:
                bound = sol.objective
        else:
            logger.info(
                "reduced-cost fixing needs %d options (max_options=%d) and %d pairs (at most %d)",
                pr.num_kept() + n_fix,
                cap,
                fix_pairs,
                DIRECT_PAIRS,
            )
            if ascent is not None:
                found, bound, proven = bisect_targets(
                    pr, ascent, sol.objective, bound, run_ilp, cap, DIRECT_PAIRS, deadline, stats
                )
                if found is not None and found.objective < sol.objective:
                    sol = found
                if proven:
                    bound = sol.objective
    t0 = time.perf_counter()
    choice = quotient.expand(sol.choice)
    unary, edge = evaluate_lazy(problem, quotient, choice)
    sec["evaluate"] = time.perf_counter() - t0
    objective = unary + edge
    bound = min(bound, objective)
    optimal = objective - bound <= OPT_RTOL * max(1.0, abs(objective))
    stats.entries_read = quotient.entries_read()
    sec["total"] = time.perf_counter() - t_start
    S = pr.subsets()
    kept = {}
    for q, c in enumerate(quotient.classes):
        for name, omap in c.members:
            kept[name] = sorted(int(o if omap is None else omap[o]) for o in S[q])
    logger.info(
        "solve_by_pricing %r: objective %.12g, bound %.12g, %s; %d of %d options kept, %d entries read, %.2fs",
        problem.name,
        objective,
        bound,
        "optimal" if optimal else "feasible",
        pr.num_kept(),
        stats.options_total,
        stats.entries_read,
        sec["total"],
    )
    solution = Solution(
        choice={d.name: choice[d.name] for d in problem.decisions},
        objective=objective,
        unary_cost=unary,
        edge_cost=edge,
        status="optimal" if optimal else "feasible",
        optimal=optimal,
        # relative to the objective (plans cost fractions of a second:
        # a max(1, |objective|) denominator would report an absolute gap)
        gap=0.0 if optimal else (objective - bound) / abs(objective) if math.isfinite(bound) and objective else None,
        backend=f"pricing+{sol.backend}",
        bound=bound if math.isfinite(bound) else None,
        timings=dict(sec),
        num_variables=sol.num_variables,
        num_constraints=sol.num_constraints,
        stopped_by=stopped_by(optimal=optimal, elapsed=time.perf_counter() - t_start, time_limit=time_limit),
    )
    return PricingResult(solution, {d.name: kept[d.name] for d in problem.decisions}, stats)
