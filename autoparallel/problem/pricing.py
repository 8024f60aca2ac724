"""Stage 4, for problems too big for dense edge matrices: solve
by option pricing, then narrow every node's options to the ones that matter.

On a 4-D mesh (LLaMA-3 70B on 4x4x8x8) a layer has ~143K options and ~114M
option pairs: the dense problem does not fit in memory, though almost every
option is one no optimum uses. :func:`solver.pricing.solve_by_pricing` starts
from a few options per node (:func:`seed_options`), asks the lazy edge
matrices (:mod:`autoparallel.problem.edge_matrices`) only for the blocks it prices,
and proves with LP duals that no left-out option can improve the plan (or
reports its gap). Everything downstream (plan report, runner-ups, dumps,
apply) then works on an ordinary dense problem over the kept options:
:func:`narrow_strategies` keeps, per shared option list, the union of what
pricing kept for the nodes sharing it, and the caller rebuilds the problem
from those lists and maps the choice into them (:func:`map_choice`).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import torch.fx

import solver
from solver.pricing import PricingResult, solve_by_pricing
from solver.pricing_quotient import is_lazy

from ..cost_model import clear_caches as clear_cost_caches
from .edge_matrices import LazyKeyMatch
from ..progress import gc_paused
from ..options.strategies import NodeStrategy, Option

logger = logging.getLogger(__name__)

# Per node, the options seeding the restricted problem: its cheapest by
# compute (ties by option id), which on a mesh are the fully sharded ones
# most plans use, plus its all-Replicate option, which makes any seed
# feasible (every layout reaches Replicate).
SEED_CHEAPEST = 4
# Seconds for the whole pricing (rounds, restricted ILPs) when the caller
# gives the ILP a time limit (AutoParallel's time_limit bounds ILP search;
# pricing is a longer process); past it the plan reports its gap.
PRICING_TIME_LIMIT = 60.0
# Whether the optimal plans of coarser meshes (autoparallel.problem.coarse_seed)
# join the seed. Off: on LLaMA-3 70B 4x4x8x8 (80 layers) they cost ~18 s
# idle and the seed's restricted ILP found the same plan without them
# (3.99216 with, 3.99215 without; the optimum, 3.67768, comes from the dual
# ascent and its restricted ILPs either way).
COARSE_SEEDS = False
# Cap on the options pricing may keep (None: the solver's default): past it
# the plan reports its gap instead of growing the restricted problem.
MAX_KEPT_OPTIONS: int | None = None


def seed_options(
    problem: solver.Problem, strategies: dict[torch.fx.Node, NodeStrategy], plans: list[dict[str, int]] = ()
) -> dict[str, list[int]]:
    """A small starting subset of options per decision (within its pins),
    closed over structural edges (a gradient takes its parameter's layout,
    a getitem its parent's element, a tangent its output's): every seeded
    option there has a seeded partner, so the seed can hold a plan."""
    by_name = {n.name: s for n, s in strategies.items()}
    allowed = pinned_options(problem)
    seeds: dict[str, set[int]] = {}
    cache: dict[tuple, set[int]] = {}
    for d in problem.decisions:
        strat = by_name[d.name]
        ok = allowed.get(d.name)
        key = (id(strat.options), None if ok is None else tuple(sorted(ok)))
        chosen = cache.get(key)
        if chosen is None:
            finite = [i for i, c in enumerate(d.costs) if math.isfinite(c) and (ok is None or i in ok)]
            chosen = set(sorted(finite, key=lambda i: (d.costs[i], i))[:SEED_CHEAPEST])
            chosen.update(i for i in finite if _all_replicate(strat.options[i]))
            cache[key] = chosen
        seeds[d.name] = set(chosen)
    # per bounded resource (the parameter memory budget: by default every
    # parameter at its most sharded), each term's lightest option
    costs = {d.name: d.costs for d in problem.decisions}
    for r in problem.resources:
        if r.high is None:
            continue
        for name, weights in r.terms.items():
            ok = allowed.get(name)
            finite = [i for i, c in enumerate(costs[name]) if math.isfinite(c) and (ok is None or i in ok)]
            if finite:
                seeds[name].add(min(finite, key=lambda i: (weights[i], costs[name][i], i)))
    for plan in [greedy_plan(problem, allowed), *plans]:
        for name, option in plan.items():
            if allowed.get(name) is None or option in allowed[name]:
                seeds[name].add(option)
    _close_over_structural_edges(problem, seeds, allowed)
    return {name: sorted(ids) for name, ids in seeds.items()}


def pinned_options(problem: solver.Problem) -> dict[str, set[int]]:
    """Per pinned decision, the options every pin on it allows."""
    allowed: dict[str, set[int]] = {}
    for pin in problem.pins:
        allowed[pin.decision] = allowed.get(pin.decision, set(pin.allowed)) & set(pin.allowed)
    return allowed


def greedy_plan(problem: solver.Problem, allowed: dict[str, set[int]] | None = None) -> dict[str, int]:
    """Per decision in graph order, the option cheapest in compute plus the
    redistributions from / to the neighbours already chosen: a plan (not an
    optimal one) the seed can hold, so pricing starts near good layouts
    rather than from arbitrary ties of compute. Decisions linked to a
    reference (repeated layers) are skipped: they take its options."""
    allowed = pinned_options(problem) if allowed is None else allowed
    linked = {link.b for link in problem.links}
    edges_of: dict[str, list] = {}
    for e in problem.edges:
        edges_of.setdefault(e.producer, []).append(e)
        edges_of.setdefault(e.consumer, []).append(e)
    chosen: dict[str, int] = {}
    for d in problem.decisions:
        if d.name in linked:
            continue
        total = np.asarray(d.costs, dtype=np.float64).copy()
        ok = allowed.get(d.name)
        if ok is not None:
            mask = np.full(len(total), np.inf)
            mask[sorted(ok)] = 0.0
            total += mask
        everything = np.arange(len(total), dtype=np.int64)
        for e in edges_of.get(d.name, ()):
            if e.producer == d.name and e.consumer in chosen:
                total += _block(e.costs, everything, np.asarray([chosen[e.consumer]]))[:, 0]
            elif e.consumer == d.name and e.producer in chosen:
                total += _block(e.costs, np.asarray([chosen[e.producer]]), everything)[0]
        best = int(np.argmin(total))
        if math.isfinite(total[best]):
            chosen[d.name] = best
    return chosen


def _block(costs, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """A block of a lazy or a dense (list of rows) edge matrix."""
    if is_lazy(costs):
        return costs.block(rows, cols)
    return np.asarray(costs, dtype=np.float64)[np.ix_(rows, cols)]


def _close_over_structural_edges(problem: solver.Problem, seeds: dict[str, set[int]], allowed: dict) -> None:
    """Add, for every seeded option at an end of a structural edge (finite
    only between matching layouts) that has no seeded partner, its first
    allowed partner, until nothing changes."""
    structural = [e for e in problem.edges if isinstance(e.costs, LazyKeyMatch)]
    for _ in range(len(structural) + 1):
        changed = False
        for e in structural:
            m = e.costs
            for mine, other, by_row in ((e.producer, e.consumer, True), (e.consumer, e.producer, False)):
                have = np.asarray(sorted(seeds[mine]), dtype=np.int64)
                theirs = np.asarray(sorted(seeds[other]), dtype=np.int64)
                block = m.block(have, theirs) if by_row else m.block(theirs, have).T
                ok = allowed.get(other)
                for k in np.flatnonzero(~np.isfinite(block).any(axis=1)):
                    everything = np.arange(m.shape[1] if by_row else m.shape[0], dtype=np.int64)
                    row = (
                        m.block(have[k : k + 1], everything)[0]
                        if by_row
                        else m.block(everything, have[k : k + 1])[:, 0]
                    )
                    partner = next((int(j) for j in np.flatnonzero(np.isfinite(row)) if ok is None or j in ok), None)
                    if partner is not None:
                        seeds[other].add(partner)
                        changed = True
        if not changed:
            return


def _all_replicate(option: Option) -> bool:
    specs = option.output_specs if isinstance(option.output_specs, tuple) else (option.output_specs,)
    specs = [s for s in specs if s is not None] + [s for s in option.input_specs if s is not None]
    return all(p.is_replicate() for s in specs for p in s.placements)


def release_caches() -> None:
    """Free the pair costs lazy matrices accumulated; call once no matrix of
    the problem will be asked for blocks again (interned placement ids,
    which its caches hold, start over)."""
    clear_cost_caches()


def solve_lazy(problem: solver.Problem, strategies, *, plans=(), backend=None, time_limit=None) -> PricingResult:
    """Solve a problem with lazy edge matrices by option pricing, seeded
    with ``plans`` (option per decision) among others."""
    limit = None if time_limit is None else max(time_limit, PRICING_TIME_LIMIT)
    extra = {} if MAX_KEPT_OPTIONS is None else {"max_options": MAX_KEPT_OPTIONS}
    # the collector off: the sweeps allocate many small objects, and each
    # full collection walks the millions of options and specs (~0.5 s each
    # on 70B 4x4x8x8)
    with gc_paused():
        seeds = seed_options(problem, strategies, plans)
        result = solve_by_pricing(problem, seeds, backend=backend, time_limit=limit, **extra)
    if not result.solution.optimal:  # a proven plan needs no weaker bound (a pass over every option)
        result = dataclasses.replace(result, solution=_with_compute_bound(result.solution, compute_bound(problem)))
    kept = sum(len(v) for v in result.kept.values())
    logger.info(
        "option pricing: %s, objective %.6g, bound %.6g, kept %d of %d options",
        result.solution.status,
        result.solution.objective,
        result.solution.bound or float("nan"),
        kept,
        sum(d.num_options for d in problem.decisions),
    )
    return result


def narrow_strategies(
    strategies: dict[torch.fx.Node, NodeStrategy], kept: dict[str, list[int]]
) -> dict[torch.fx.Node, NodeStrategy]:
    """Strategies whose option lists hold only kept options. Nodes sharing
    a list (repeated layers, forward and backward twins) keep sharing one,
    holding what pricing kept for any of them, so links and the builder's
    per-list caches work as before."""
    union: dict[int, set[int]] = {}
    for node, strat in strategies.items():
        union.setdefault(id(strat.options), set()).update(kept[node.name])
    lists: dict[int, list[Option]] = {}
    out = {}
    for node, strat in strategies.items():
        key = id(strat.options)
        new = lists.get(key)
        if new is None:
            new = lists[key] = [strat.options[i] for i in sorted(union[key])]
        out[node] = dataclasses.replace(strat, options=new)
    return out


def map_choice(
    full: dict[torch.fx.Node, NodeStrategy], narrowed: dict[torch.fx.Node, NodeStrategy], choice: dict[str, int]
) -> dict[str, int]:
    """A choice of option ids in the full lists as ids in the narrowed ones."""
    position: dict[int, dict[int, int]] = {}  # per narrowed list (shared by layers): id(option) -> index
    out = {}
    for node, strat in full.items():
        options = narrowed[node].options
        index = position.get(id(options))
        if index is None:
            index = position[id(options)] = {id(o): i for i, o in enumerate(options)}
        out[node.name] = index[id(strat.options[choice[node.name]])]
    return out


def compute_bound(problem: solver.Problem) -> float:
    """A lower bound on any plan's cost, from compute alone: every decision
    at its cheapest option allowed by its pins (edge costs are >= 0). Weak
    where plans differ in communication, but it holds when pricing's dual
    bound has not closed yet."""
    allowed = pinned_options(problem)
    total = 0.0
    for d in problem.decisions:
        ok = allowed.get(d.name)
        total += min((c for i, c in enumerate(d.costs) if ok is None or i in ok), default=0.0)
    return total + sum(getattr(e.costs, "floor", 0.0) for e in problem.edges)


def _with_compute_bound(sol: solver.Solution, bound: float) -> solver.Solution:
    """``sol`` with the better of its bound and ``bound``."""
    if sol.optimal or (sol.bound is not None and sol.bound >= bound):
        return sol
    gap = (sol.objective - bound) / abs(sol.objective) if sol.objective else None
    return dataclasses.replace(sol, bound=bound, gap=gap)


def narrowed_solution(result: PricingResult, dense: solver.Problem, choice: dict[str, int]) -> solver.Solution:
    """The pricing solution over the narrowed dense problem: its choice
    mapped, its cost re-evaluated there (it must equal the priced one: the
    narrowed problem holds the same costs), status and bound from pricing."""
    unary, edge = solver.evaluate(dense, choice)
    sol = result.solution
    if not math.isclose(unary + edge, sol.objective, rel_tol=1e-9, abs_tol=1e-12):
        raise solver.SolverError(
            f"internal error: the plan costs {unary + edge!r} on the narrowed problem but {sol.objective!r} priced"
        )
    return dataclasses.replace(sol, choice=choice, unary_cost=unary, edge_cost=edge)


def solve_and_narrow(built, lifted, *, backend, time_limit, stage, rebuild) -> tuple:
    """Solve ``built`` (a lazy problem) by option pricing under the step's
    memory budget (inside the context ``stage``), then rebuild it densely
    over the kept options with ``rebuild(narrowed strategies)`` (what the
    plan, its report and the dumps read) and map the choice into it:
    (dense built problem, its solution). ``lifted``: coarse-mesh plans
    seeding the pricing."""
    from . import memory_budget

    results: list[PricingResult] = []

    def price(p: solver.Problem) -> solver.Solution:
        results.append(solve_lazy(p, built.strategies, plans=lifted, backend=backend, time_limit=time_limit))
        return results[-1].solution

    # ilp_only: pricing's restricted problems go to the ILP, not back to pricing
    with stage, solver.ilp_only():
        try:
            memory_budget.solve_within_budget(built.problem, price)
        finally:
            release_caches()
    result = results[-1]
    narrowed = narrow_strategies(built.strategies, result.kept)
    dense = rebuild(narrowed)
    dense.priced_size, dense.size_unpruned, dense.pruning = built.size, built.size_unpruned, built.pruning
    choice = map_choice(built.strategies, narrowed, result.solution.choice)
    return dense, narrowed_solution(result, dense.problem, choice)
