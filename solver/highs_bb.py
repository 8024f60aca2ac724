"""A small best-first branch and bound over decisions, on HiGHS' LP.

Why: on placement problems whose LP relaxation is fractional, HiGHS' MIP
spends its time at the root (cut rounds, restarts, sub-MIP heuristics) on a
large LP: the 1-layer debug LLaMA on 4x2 took 50-65 s to prove a plan that
is optimal after 15 LP re-solves when branching on *decisions*: pick the
decision whose largest option is furthest from 1, and make one child per
option it uses fractionally (that option chosen) plus one for all its other
options. Decisions whose fractional options weigh differently in a resource
row come first: with a binding memory budget the LP mixes a plan that fits
with one that does not, and other fractional decisions are often ties
between equally good options (70B 16x8: 16 nodes instead of 268; the tiny
LLaMA under a 2 MB budget proven where 200 nodes and HiGHS' MIP stopped at
the 10 s limit with a 0.3% gap). Each child is the parent's LP with some option columns' upper
bounds set to 0, re-solved warm by dual simplex. Best-first order, so the
smallest open LP value is a proven bound at any time.

It is not a replacement for the MIP solver: on random grids (frustrated
everywhere) it needs thousands of nodes where cuts help. So it runs with a
node budget (deterministic) and, if given, a deadline, and hands its
incumbent and bound to HiGHS' MIP when it runs out.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass

import numpy as np

from .ilp import IlpModel

logger = logging.getLogger(__name__)

# Nodes (LP re-solves) before handing over to the MIP solver. The 1-layer
# debug LLaMA needs 15; a 10x10 random grid 19. Counted, not timed, so a
# solve without a time limit stays deterministic.
NODE_BUDGET = 200
# Relative tolerance of pruning against the incumbent.
PRUNE_RTOL = 1e-9
# An option column at or below this is not used by an LP solution.
ZERO_TOL = 1e-9


@dataclass
class BBResult:
    """Scaled-objective results: ``values`` (full columns) of the best
    integral solution found (``None``: none), its ``objective``, the proven
    ``bound`` and whether the search finished (``proven``)."""

    values: np.ndarray | None
    objective: float
    bound: float
    proven: bool
    nodes: int


def branch_and_bound(
    h,
    model: IlpModel,
    root_value: float,
    start: np.ndarray | None,
    deadline: float | None,
    rel_gap: float | None = None,
    node_budget: int = NODE_BUDGET,
) -> BBResult:
    """Search from the solved LP relaxation in ``h`` (value ``root_value``),
    with ``start`` (binary option values) as the first incumbent; stop when
    proven, at ``rel_gap`` (relative to the scaled objective, which has no
    offset: fixed costs are outside it), or out of nodes or time.

    Leaves ``h`` holding the relaxation's bounds again."""
    import highspy

    optimal = highspy.HighsModelStatus.kOptimal
    nx = model.num_x
    idx = np.arange(nx, dtype=np.int32)
    lower = np.zeros(nx)
    upper = np.asarray(model.col_upper[:nx], dtype=np.float64)
    # Linked decisions share their columns: branch on each column set once.
    groups = list({tuple(c for c in cols if c is not None): None for cols in model.option_cols.values()})
    groups = [np.asarray(g, dtype=np.int64) for g in groups if len(g) > 1]

    # Per option column, its weights in the resource rows: a decision whose
    # fractionally used options weigh differently is where a binding row
    # splits the LP (a knapsack item); branch on those first.
    weight = np.zeros((len(model.resource_rows), nx))
    for k, r in enumerate(model.resource_rows):
        a, b = model.row_start[r], model.row_start[r + 1]
        weight[k, model.row_index[a:b]] = model.row_value[a:b]

    current = [lower.copy(), upper.copy()]  # the bounds h holds now

    def resolve(lo, ub):
        # Change only the bounds that differ: HiGHS then keeps more of
        # the previous basis warm.
        diff = np.flatnonzero((current[0] != lo) | (current[1] != ub)).astype(np.int32)
        if len(diff):
            h.changeColsBounds(len(diff), diff, lo[diff], ub[diff])
            current[0], current[1] = lo.copy(), ub.copy()
        h.run()
        if h.getModelStatus() != optimal:
            return None, None
        return h.getInfo().objective_function_value, np.asarray(h.getSolution().col_value)

    best_values, best = None, np.inf
    if start is not None:  # the start's value: the LP with every option fixed
        best, best_values = resolve(start, np.minimum(start, upper))
        if best is None:
            best = np.inf
    heap: list = [(root_value, 0, ())]
    count = nodes = 0
    try:
        while heap:
            if nodes >= node_budget or (deadline is not None and time.perf_counter() >= deadline):
                break
            if rel_gap and best - heap[0][0] <= rel_gap * abs(best):
                break
            value, _, off = heapq.heappop(heap)
            if value >= best - PRUNE_RTOL * abs(best):
                continue
            ub = upper.copy()
            ub[list(off)] = 0.0
            value, v = resolve(lower, ub)
            nodes += 1
            if value is None or value >= best - PRUNE_RTOL * abs(best):
                continue  # infeasible or no better than the incumbent
            x = v[:nx]
            worst, branch = (False, ZERO_TOL), None
            for cols in groups:
                f = 1.0 - x[cols].max()
                if f <= ZERO_TOL:
                    continue
                w = weight[:, cols[x[cols] > ZERO_TOL]]
                key = (bool(w.size) and bool((w.max(1) > w.min(1)).any()), f)
                if key > worst:
                    worst, branch = key, cols
            if branch is None:  # integral: a new incumbent
                best, best_values = value, v
                continue
            used = branch[x[branch] > ZERO_TOL]
            for c in used:  # one child per fractionally used option
                count += 1
                heapq.heappush(heap, (value, -count, off + tuple(int(o) for o in branch if o != c)))
            if len(used) < len(branch):  # and one for all the unused ones
                count += 1
                heapq.heappush(heap, (value, -count, off + tuple(int(o) for o in used)))
    finally:
        h.changeColsBounds(nx, idx, lower, upper)
    open_bound = min((n[0] for n in heap), default=np.inf)
    proven = not heap or open_bound >= best - PRUNE_RTOL * abs(best)
    bound = best if proven else min(open_bound, best)
    logger.debug(
        "branch and bound: %d nodes, %s, objective %s, bound %s",
        nodes,
        "proven" if proven else f"{len(heap)} open",
        best,
        bound,
    )
    return BBResult(best_values, float(best), float(bound), proven and best_values is not None, nodes)
