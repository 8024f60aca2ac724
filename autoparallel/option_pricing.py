"""Stage 4, for problems too big for dense edge matrices (issue 13): solve
by option pricing, then narrow every node's options to the ones that matter.

On a 4-D mesh (LLaMA-3 70B on 4x4x8x8) a layer has ~143K options and ~114M
option pairs: the dense problem does not fit in memory, though almost every
option is one no optimum uses. :func:`solver.pricing.solve_by_pricing` starts
from a few options per node (:func:`seed_options`), asks the lazy edge
matrices (:mod:`autoparallel.edge_matrices`) only for the blocks it prices,
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

import torch.fx

import solver
from solver.pricing import PricingResult, solve_by_pricing

from .edge_costs import clear_caches as clear_edge_cost_caches
from .strategies import NodeStrategy, Option

logger = logging.getLogger(__name__)

# Per node, the options seeding the restricted problem: its cheapest by
# compute (ties by option id), which on a mesh are the fully sharded ones
# most plans use, plus its all-Replicate option, which makes any seed
# feasible (every layout reaches Replicate).
SEED_CHEAPEST = 4


def seed_options(problem: solver.Problem, strategies: dict[torch.fx.Node, NodeStrategy]) -> dict[str, list[int]]:
    """A small starting subset of options per decision."""
    by_name = {n.name: s for n, s in strategies.items()}
    seeds: dict[str, list[int]] = {}
    cache: dict[int, list[int]] = {}
    for d in problem.decisions:
        strat = by_name[d.name]
        key = id(strat.options)
        chosen = cache.get(key)
        if chosen is None:
            finite = [i for i, c in enumerate(d.costs) if math.isfinite(c)]
            chosen = sorted(finite, key=lambda i: (d.costs[i], i))[:SEED_CHEAPEST]
            replicated = next((i for i in finite if _all_replicate(strat.options[i])), None)
            if replicated is not None and replicated not in chosen:
                chosen.append(replicated)
            chosen = cache[key] = sorted(chosen)
        seeds[d.name] = chosen
    return seeds


def _all_replicate(option: Option) -> bool:
    specs = option.output_specs if isinstance(option.output_specs, tuple) else (option.output_specs,)
    specs = [s for s in specs if s is not None] + [s for s in option.input_specs if s is not None]
    return all(p.is_replicate() for s in specs for p in s.placements)


def release_caches() -> None:
    """Free the pair costs lazy matrices accumulated; call once no matrix of
    the problem will be asked for blocks again (interned placement ids,
    which its caches hold, start over)."""
    clear_edge_cost_caches()


def solve_lazy(problem: solver.Problem, strategies, *, backend=None, time_limit=None) -> PricingResult:
    """Solve a problem with lazy edge matrices by option pricing."""
    result = solve_by_pricing(problem, seed_options(problem, strategies), backend=backend, time_limit=time_limit)
    kept = sum(len(v) for v in result.kept.values())
    logger.info(
        "option pricing: %s, objective %.6g, bound %.6g, kept %d of %d options",
        result.solution.status, result.solution.objective, result.solution.bound or float("nan"),
        kept, sum(d.num_options for d in problem.decisions),
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
    out = {}
    for node, strat in full.items():
        picked = strat.options[choice[node.name]]
        out[node.name] = next(i for i, o in enumerate(narrowed[node].options) if o is picked)
    return out


def narrowed_solution(
    result: PricingResult, dense: solver.Problem, choice: dict[str, int]
) -> solver.Solution:
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
