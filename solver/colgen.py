"""The LP relaxation by column generation over pair columns.

Why: after presolve, a 3-D mesh problem (LLaMA-3 70B on 8x16x8) is one
layer plus glue, but its pairwise encoding still has ~900k pair columns on
~29k rows; HiGHS' dual simplex then spends its time pricing columns that
never enter the basis (30 s CPU, 17.8k iterations, for the 80-layer 70B
LP; primal simplex and the interior point solvers were slower still). By
column generation: 5.8 s CPU for the whole solve (presolve included). Almost all pairs are expensive
redistributions no optimum uses.

How (exact): solve the LP over every option column and a small set of pair
columns (per marginal row, its few cheapest pairs), read the row duals, and
compute every left-out pair column's reduced cost ``c - A^T y`` with one
sparse product. Columns with a negative reduced cost are added (the most
negative first, a bounded number per round) and the LP re-solved warm, until
none is left: the restricted optimum is then an optimum of the full LP (its
duals are feasible for every column), with the left-out columns at 0. The
caller treats it exactly like the full LP's optimum (an integral one is a
proven MIP optimum).

If the restricted LP is infeasible (its few pairs cannot support any
choice), or it does not finish, :func:`solve_lp` returns ``None`` and the
caller solves the full LP, so nothing is lost but the attempt.

Example::

    >>> from solver.problem import Decision, Edge, Problem
    >>> from solver.ilp import build
    >>> p = Problem(
    ...     decisions=[Decision("a", ["R", "S0"], [1.0, 0.5]),
    ...                Decision("b", ["R", "S0"], [1.0, 0.5])],
    ...     edges=[Edge("a", "b", 0, [[0.0, 1.0], [2.0, 0.0]])],
    ... )
    >>> lp = solve_lp(build(p))
    >>> lp.values[:4], lp.rounds
    ([0.0, 1.0, 0.0, 1.0], 1)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from . import highs_quiet
from .ilp import IlpModel

logger = logging.getLogger(__name__)

# Models with fewer pair columns go straight to the full LP: column
# generation's rounds cost more than they save there.
MIN_PAIR_COLUMNS = 50_000
# HiGHS' dual feasibility tolerance on the restricted LP (its default is
# 1e-7), and the reduced cost below which a left-out column enters (scaled
# objective, unit max coefficient). On the 70B 8x16x8 LP the default let
# the restricted optimum end 7.5e-7 (relative) above the full LP's; at
# 1e-10 it ends 4.8e-6 below it (the full LP's own tolerance shows), in
# fewer rounds.
DUAL_TOL = 1e-10
PRICE_TOL = 1e-10
# Pair columns per marginal row to start from (its cheapest). On the 70B
# 8x16x8 LP: 1 or 2 leave the restricted LP infeasible or take 11 rounds
# of slow warm re-solves (added columns are dual infeasible, so HiGHS
# re-solves with primal simplex); 10 took 3 rounds, 2.4 s CPU against
# 5.4 s for the full LP (4-layer model); 20, 3.1 s.
INITIAL_PER_ROW = 10
# Columns added per round: at most this many times the number of rows.
ADD_PER_ROW = 2


@dataclass
class ColgenLP:
    """An optimum of the full LP relaxation: ``values`` over every column of
    the model (left-out pair columns 0), its scaled ``objective``, and how
    many pair columns the restricted LP ended with and in how many rounds."""

    values: list[float]
    objective: float
    columns: int
    rounds: int


def _csc(model: IlpModel) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Column-wise copy of the model's matrix: (start, row index, value),
    and the row of every CSR entry."""
    n_rows, n_cols = model.num_rows, model.num_cols
    rows = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(model.row_start))
    cols = model.row_index
    order = np.argsort(cols, kind="stable")
    start = np.zeros(n_cols + 1, dtype=np.int64)
    np.cumsum(np.bincount(cols, minlength=n_cols), out=start[1:])
    return start, rows[order], model.row_value[order], rows


def _gather(start: np.ndarray, index: np.ndarray, value: np.ndarray, cols: np.ndarray):
    """CSC arrays (start, index, value) of the columns ``cols``."""
    lengths = start[cols + 1] - start[cols]
    out_start = np.zeros(len(cols) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out_start[1:])
    pos = np.repeat(start[cols] - out_start[:-1], lengths) + np.arange(out_start[-1], dtype=np.int64)
    return out_start, index[pos], value[pos]


def _initial_pairs(model: IlpModel, entry_rows: np.ndarray) -> np.ndarray:
    """Per row holding pair columns, its INITIAL_PER_ROW cheapest ones
    (ties: lowest id)."""
    cols = model.row_index
    pair = cols >= model.num_x
    r, c = entry_rows[pair], cols[pair]
    # One sort on one float key, row * 4 + cost (the scaled costs lie in
    # [-1, 1]), is 4x faster than lexsort by (row, cost, id). Rounding may
    # order near-equal costs of a row by id rather than by cost: any initial
    # set gives the same LP optimum, this one is only a good guess. Stable,
    # and the entries are in row-major order with ascending columns (the
    # model's CSR): ties keep the lowest id first.
    order = np.argsort(r * 4.0 + model.col_cost[c], kind="stable")
    r, c = r[order], c[order]
    first = np.ones(len(r), dtype=bool)
    first[1:] = r[1:] != r[:-1]
    rank = np.arange(len(r)) - np.maximum.accumulate(np.where(first, np.arange(len(r)), 0))
    chosen = np.zeros(model.num_cols, dtype=bool)
    chosen[c[rank < INITIAL_PER_ROW]] = True
    return np.flatnonzero(chosen)


def solve_lp(model: IlpModel, deadline: float | None = None) -> ColgenLP | None:
    """The model's LP relaxation by column generation (see the module
    docstring); ``None`` when the restricted LP is infeasible or stops
    without an optimum (time limit: ``deadline``, a ``perf_counter`` value),
    in which case the caller solves the full LP."""
    import highspy

    S = highspy.HighsModelStatus
    nx, n_cols, n_rows = model.num_x, model.num_cols, model.num_rows
    start, index, value, entry_rows = _csc(model)
    chosen = np.concatenate([np.arange(nx, dtype=np.int64), _initial_pairs(model, entry_rows)])
    in_model = np.zeros(n_cols, dtype=bool)
    in_model[chosen] = True

    lp = highspy.HighsLp()
    lp.num_col_ = len(chosen)
    lp.num_row_ = n_rows
    lp.col_cost_ = model.col_cost[chosen]
    lp.col_lower_ = np.zeros(len(chosen))
    lp.col_upper_ = model.col_upper[chosen]
    lp.row_lower_ = model.row_lower
    lp.row_upper_ = model.row_upper
    a = lp.a_matrix_
    a.format_ = highspy.MatrixFormat.kColwise
    a.num_col_ = len(chosen)
    a.num_row_ = n_rows
    s, i, v = _gather(start, index, value, chosen)
    a.start_, a.index_, a.value_ = s.astype(np.int32), i.astype(np.int32), v

    h = highs_quiet.new_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("presolve", "off")
    h.setOptionValue("dual_feasibility_tolerance", DUAL_TOL)
    h.passModel(lp)
    cap = max(1000, ADD_PER_ROW * n_rows)
    rounds = 0
    t_start = time.perf_counter()
    while True:
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left <= 0:
                return None
            h.setOptionValue("time_limit", float(left))
        h.run()
        rounds += 1
        if h.getModelStatus() != S.kOptimal:
            logger.debug(
                "column generation: restricted LP %s after %d rounds", h.modelStatusToString(h.getModelStatus()), rounds
            )
            return None
        dual = np.asarray(h.getSolution().row_dual)
        # HiGHS' reduced cost of a column: c - A^T y
        reduced = model.col_cost - np.bincount(
            model.row_index, weights=model.row_value * dual[entry_rows], minlength=n_cols
        )
        reduced[in_model] = 0.0
        enter = np.flatnonzero(reduced < -PRICE_TOL)
        logger.debug(
            "column generation round %d: %d columns, %d priced in, LP %.12g, %d iterations, %.2fs",
            rounds,
            len(chosen),
            len(enter),
            h.getInfo().objective_function_value,
            h.getInfo().simplex_iteration_count,
            time.perf_counter() - t_start,
        )
        if not len(enter):
            break
        if len(enter) > cap:
            enter = enter[np.argpartition(reduced[enter], cap)[:cap]]
        enter.sort()
        s, i, v = _gather(start, index, value, enter)
        h.addCols(
            len(enter),
            model.col_cost[enter],
            np.zeros(len(enter)),
            model.col_upper[enter],
            len(i),
            s[:-1].astype(np.int32),
            i.astype(np.int32),
            v,
        )
        chosen = np.concatenate([chosen, enter])
        in_model[enter] = True
    values = np.zeros(n_cols)
    values[chosen] = h.getSolution().col_value
    return ColgenLP(values.tolist(), h.getInfo().objective_function_value, len(chosen) - nx, rounds)
