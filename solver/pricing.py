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
   (:mod:`solver.pricing_rounds` picks one centred on the used options'
   duals). An option's reduced cost is ``r_q(o) = c_q(o) - u_q + sum_{E: q rows} alpha_Eo +
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
from dataclasses import dataclass

import numpy as np

from .diagnose import InfeasibleError
from .dual_bound import DualAscent
from .pricing_bisect import bisect_targets
from .pricing_proof import TREES, final_ascent, pairs_among, prefilter
from .pricing_quotient import build_quotient, evaluate_lazy
from .pricing_rounds import Pricer, Rounds, lp_rounds
from .pricing_stats import PricingStats
from .problem import Problem, Solution
from .tree_bound import eliminate
from .work import DEFAULT_NODE_LIMIT, SafetyCap, stopped_by

logger = logging.getLogger(__name__)

# Default cap on the options kept over all classes: reduced-cost fixing that
# would need more gives up proving (status "feasible" with the LP bound).
DEFAULT_MAX_OPTIONS = 20_000
# Relative gap under which the restricted ILP's objective is the optimum.
OPT_RTOL = 1e-9
# Pairs between the options left after tree elimination up to which the
# restricted ILP simply takes all of them (no pricing rounds).
DIRECT_PAIRS = 3_000_000


@dataclass
class PricingResult:
    """``solution.choice`` in the problem's option ids; ``kept``: per
    decision, the sorted option ids of the final subsets (the optimum over
    them is the optimum over all when ``solution.status == "optimal"``)."""

    solution: Solution
    kept: dict[str, list[int]]
    stats: PricingStats


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
    run = _PricingRun(problem, initial, backend, time_limit, max_options, node_limit)
    stats = run.stats
    ascent, upper, exhaustive = run.prefilter()
    # the ascent met its plan: that plan is optimal, no LP rounds
    closed = ascent is not None and upper - stats.ascent_bound <= OPT_RTOL * max(1.0, abs(upper))
    rounds = Rounds()
    if not exhaustive and not closed:
        rounds = lp_rounds(run.pr, stats, run.cap, run.clock, run.t_start)
    stats.lower_bound = rounds.lower_bound

    sol = run.first_ilp(rounds.growth)
    z = sol.objective
    tol = OPT_RTOL * max(1.0, abs(z))
    bound = max(rounds.lower_bound, stats.tree_bound)
    if sol.status == "optimal" and (exhaustive or z - bound <= tol):
        bound = z
    elif sol.status == "optimal" and (rounds.reduced is not None or ascent is not None):
        sol, bound = run.fix_reduced_costs(sol, bound, rounds.reduced, ascent, tol)
    return run.result(sol, bound)


class _PricingRun:
    """One call of :func:`solve_by_pricing`: the problem, its quotient and
    pricer, the limits, and the stats every phase adds to."""

    def __init__(self, problem: Problem, initial, backend, time_limit, max_options, node_limit):
        self.t_start = time.perf_counter()
        self.clock = SafetyCap(time_limit, self.t_start)
        self.problem, self.backend, self.time_limit = problem, backend, time_limit
        self.cap = DEFAULT_MAX_OPTIONS if max_options is None else max_options
        self.stats = stats = PricingStats()
        self.sec = stats.seconds
        for phase in ("setup", "lp", "pricing", "ilp", "trees", "evaluate"):
            self.sec[phase] = 0.0
        self.quotient = quotient = build_quotient(problem)
        self.pr = Pricer(quotient)
        self.pr.node_limit = node_limit
        self.pr.seed(problem, initial)
        stats.classes = len(quotient.classes)
        stats.options_total = int(sum(c.allowed.sum() for c in quotient.classes))
        self.sec["setup"] = time.perf_counter() - self.t_start

    def prefilter(self) -> tuple[DualAscent | None, float, bool]:
        """Tree elimination and the dual ascent (:func:`prefilter`): returns
        the ascent, its plan's cost and whether the options left are few
        enough to take them all (then they are all kept)."""
        quotient, stats = self.quotient, self.stats
        stats.eliminated, ascent, upper = prefilter(self.pr, self.backend, self.clock.deadline, stats)
        survivors = sum(int(c.allowed.sum()) for c in quotient.classes)
        pairs = pairs_among(quotient, [c.allowed for c in quotient.classes])
        # Few enough options left: the ILP over all of them is the proof.
        exhaustive = bool(stats.eliminated) and survivors <= self.cap and pairs <= DIRECT_PAIRS
        if exhaustive:
            logger.info(
                "pricing: %d options and %d pairs left after tree elimination: solving over all of them",
                survivors,
                pairs,
            )
            for q, c in enumerate(quotient.classes):
                self.pr.add(q, np.flatnonzero(c.allowed))
        return ascent, upper, exhaustive

    def run_ilp(self, at_least: float = 1.0) -> Solution | None:
        """The restricted ILP over the exact options (None if infeasible)."""
        t0 = time.perf_counter()
        # past the deadline the ILP still gets ``at_least`` seconds: an answer beats none
        sol = self.pr.solve_ilp(self.backend, self.clock.left(at_least))
        self.sec["ilp"] += time.perf_counter() - t0
        if sol is not None:
            self.stats.restricted_objectives.append(sol.objective)
        return sol

    def first_ilp(self, growth: int) -> Solution:
        """The restricted ILP's plan, the exact options grown until it has
        one; raises :class:`InfeasibleError` when no growth within the cap
        gives one."""
        pr, stats, cap = self.pr, self.stats, self.cap
        sol = self.run_ilp()
        while sol is None:  # LP-feasible but no integral choice over the subsets
            if pr.num_kept() >= stats.options_total:
                raise InfeasibleError(f"Infeasible: no choice over all {stats.options_total} options")
            growth = pr.grow(growth + 1)
            if pr.num_kept() > cap:
                raise InfeasibleError(
                    f"no feasible choice over {pr.num_kept()} of {stats.options_total} options; "
                    f"raise max_options={cap} to look further"
                )
            sol = self.run_ilp()
        return sol

    # -- reduced-cost fixing -------------------------------------------------
    def fix_reduced_costs(self, sol: Solution, bound: float, reduced, ascent, tol: float) -> tuple[Solution, float]:
        """Prove ``sol`` optimal or find a cheaper plan: reduced-cost fixing
        with the last round's duals (any round's are valid): a cheaper choice
        uses only options with r' = r + v_q <= z - LB; and, where the
        matrices reduce whole rows, only options whose spanning-tree
        min-marginal is at most z (solver.tree_bound), the forests over the
        costs the dual ascent rewrote (solver.pricing_proof). Returns the
        plan and its bound (the plan's cost when proven)."""
        z = sol.objective
        t0 = time.perf_counter()
        tree_keep, sol = self._tree_filter(sol, z, ascent)
        bound = max(bound, self.stats.tree_bound)
        self.sec["trees"] += time.perf_counter() - t0
        fix = self._fixing_candidates(reduced, tree_keep, z, tol)
        if sol.objective - bound <= tol:
            fix = []  # the bound meets the plan
        return self._fix_in(sol, bound, fix, ascent)

    def _tree_filter(self, sol: Solution, z: float, ascent) -> tuple[list[np.ndarray] | None, Solution]:
        """Per class, the options some spanning-forest plan as cheap as ``z``
        may use (None: no forest filter), and the plan, cheaper when the
        final ascent decoded a cheaper one."""
        quotient, pr, stats = self.quotient, self.pr, self.stats
        if ascent is not None:
            plan = [sol.choice[q] for q in range(len(quotient.classes))]
            tree_keep, upper, plan, _ = final_ascent(pr, ascent, z, plan, self.backend, self.clock.deadline, stats)
            if upper < z:  # a decoded plan is cheaper: the restricted ILP finds it
                for q, o in enumerate(plan):
                    pr.add(q, [o])
                better = self.run_ilp()
                if better is not None and better.objective < sol.objective:
                    sol = better
            return tree_keep, sol
        # forests of the raw costs, then of the costs rewritten by the last
        # duals (bound at least the LP's); an option must pass both
        trees = eliminate(quotient, z, trees=TREES)
        if trees is None:
            return None, sol
        dual_trees = eliminate(quotient, min(z, trees.upper), trees=TREES, reparam=pr.reparam)
        # (a forest plan cheaper than z keeps its options: the ILP below finds it)
        tree_keep = [a & b for a, b in zip(trees.keep, dual_trees.keep)]
        stats.tree_bound = max(stats.tree_bound, trees.bound, dual_trees.bound)
        for plan in (trees.plan, dual_trees.plan):
            for q, o in enumerate(plan or ()):
                tree_keep[q][o] = True
        return tree_keep, sol

    def _fixing_candidates(self, reduced, tree_keep, z: float, tol: float) -> list[np.ndarray]:
        """Per class, the options left out that a plan cheaper than ``z`` may
        use: reduced cost within the gap and, with forests, kept by them."""
        fix = []
        for q, c in enumerate(self.quotient.classes):
            mask = c.allowed & ~self.pr.kept[q]
            if reduced is not None:
                r = reduced[q]
                mask &= r - min(0.0, float(r.min())) <= z - self.stats.bound_per_round[-1] + tol
            fix.append(np.flatnonzero(mask if tree_keep is None else mask & tree_keep[q]))
        return fix

    def _fix_in(self, sol: Solution, bound: float, fix: list[np.ndarray], ascent) -> tuple[Solution, float]:
        """Make the ``fix`` options exact and solve again, which proves the
        plan; when they are too many, the target bisection
        (:func:`bisect_targets`) where the ascent ran."""
        pr, stats, cap = self.pr, self.stats, self.cap
        n_fix = sum(len(f) for f in fix)
        with_fix = [k.copy() for k in pr.kept]
        for k, f in zip(with_fix, fix):
            k[f] = True
        fix_pairs = pairs_among(self.quotient, with_fix)  # the dense restricted ILP holds them all
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
            proven = True
            if n_fix:
                better = self.run_ilp()
                proven = better is not None and better.status == "optimal"
                if better is not None and better.objective < sol.objective:
                    sol = better
            return sol, sol.objective if proven else bound
        logger.info(
            "reduced-cost fixing needs %d options (max_options=%d) and %d pairs (at most %d)",
            pr.num_kept() + n_fix,
            cap,
            fix_pairs,
            DIRECT_PAIRS,
        )
        if ascent is not None:
            found, bound, proven = bisect_targets(
                pr, ascent, sol.objective, bound, self.run_ilp, cap, DIRECT_PAIRS, self.clock.deadline, stats
            )
            if found is not None and found.objective < sol.objective:
                sol = found
            if proven:
                bound = sol.objective
        return sol, bound

    # -- the answer -----------------------------------------------------------
    def result(self, sol: Solution, bound: float) -> PricingResult:
        """The restricted plan in the problem's option ids, evaluated on the
        problem, with the kept subsets and the stats."""
        problem, pr, stats, sec = self.problem, self.pr, self.stats, self.sec
        t0 = time.perf_counter()
        choice = self.quotient.expand(sol.choice)
        unary, edge = evaluate_lazy(problem, self.quotient, choice)
        sec["evaluate"] = time.perf_counter() - t0
        objective = unary + edge
        bound = min(bound, objective)
        optimal = objective - bound <= OPT_RTOL * max(1.0, abs(objective))
        stats.entries_read = self.quotient.entries_read()
        sec["total"] = time.perf_counter() - self.t_start
        kept = self._kept_options()
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
            gap=0.0
            if optimal
            else (objective - bound) / abs(objective)
            if math.isfinite(bound) and objective
            else None,
            backend=f"pricing+{sol.backend}",
            bound=bound if math.isfinite(bound) else None,
            timings=dict(sec),
            num_variables=sol.num_variables,
            num_constraints=sol.num_constraints,
            stopped_by=stopped_by(
                optimal=optimal, elapsed=time.perf_counter() - self.t_start, time_limit=self.time_limit
            ),
        )
        return PricingResult(solution, {d.name: kept[d.name] for d in problem.decisions}, stats)

    def _kept_options(self) -> dict[str, list[int]]:
        """Per decision, the sorted option ids of the final exact subsets."""
        S = self.pr.subsets()
        kept = {}
        for q, c in enumerate(self.quotient.classes):
            for name, omap in c.members:
                kept[name] = sorted(int(o if omap is None else omap[o]) for o in S[q])
        return kept
