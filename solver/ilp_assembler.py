"""The rows and pair columns of an ILP as :mod:`solver.ilp` and
:mod:`solver.ilp_edges` add them, laid out in CSR form at the end."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .problem import INF


class Assembler:
    """Collects rows (single ones, or whole blocks as COO arrays) and pair
    columns, then lays them out in an :class:`~solver.ilp.IlpModel`."""

    def __init__(self, num_x: int):
        self.num_x = num_x
        self.num_rows = 0
        self.num_pairs = 0
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.entries: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.single: tuple[list[int], list[int], list[float]] = ([], [], [])
        self.pair_costs: list[np.ndarray] = []

    def row(self, cols: Sequence[int], values: Sequence[float], lower, upper) -> None:
        r, c, v = self.single
        r.extend([self.num_rows] * len(cols))
        c.extend(cols)
        v.extend(values)
        self.lower.append(-INF if lower is None else lower)
        self.upper.append(INF if upper is None else upper)
        self.num_rows += 1

    def new_rows(self, n: int, lower: float, upper: float) -> int:
        """Reserve ``n`` rows with the same bounds; returns the first id."""
        first = self.num_rows
        self.lower.extend([lower] * n)
        self.upper.extend([upper] * n)
        self.num_rows += n
        return first

    def add(self, rows: np.ndarray, cols: np.ndarray, values: np.ndarray) -> None:
        self.entries.append((rows, cols, values))

    def new_pairs(self, costs: np.ndarray) -> int:
        """Add pair columns; returns the first one's id."""
        first = self.num_x + self.num_pairs
        self.pair_costs.append(costs)
        self.num_pairs += len(costs)
        return first

    def finish(self, model, x_cost: list[float], x_upper: list[float]) -> None:
        """Fill ``model`` (an :class:`~solver.ilp.IlpModel`) with the columns
        and rows collected, the option columns' costs and upper bounds first."""
        model.col_cost = np.concatenate([np.asarray(x_cost, dtype=np.float64), *self.pair_costs])
        model.col_upper = np.concatenate([np.asarray(x_upper, dtype=np.float64), np.ones(self.num_pairs)])
        r0, c0, v0 = self.single
        rows = np.concatenate([np.asarray(r0, dtype=np.int64), *(e[0] for e in self.entries)])
        cols = np.concatenate([np.asarray(c0, dtype=np.int64), *(e[1] for e in self.entries)])
        vals = np.concatenate([np.asarray(v0, dtype=np.float64), *(e[2] for e in self.entries)])
        order = np.lexsort((cols, rows))
        rows, cols, vals = rows[order], cols[order], vals[order]
        # Aliased (linked) options can put one column twice in a row.
        dup = (rows[1:] == rows[:-1]) & (cols[1:] == cols[:-1])
        if dup.any():
            starts = np.flatnonzero(np.concatenate(([True], ~dup)))
            vals = np.add.reduceat(vals, starts)
            rows, cols = rows[starts], cols[starts]
        keep = vals != 0
        rows, cols, vals = rows[keep], cols[keep], vals[keep]
        model.row_start = np.concatenate(([0], np.cumsum(np.bincount(rows, minlength=self.num_rows)))).astype(np.int64)
        model.row_index = cols
        model.row_value = vals
        model.row_lower = np.asarray(self.lower, dtype=np.float64)
        model.row_upper = np.asarray(self.upper, dtype=np.float64)
