"""The restricted LP of :mod:`solver.pricing`, grown in place round by round.

Rows: one per class (``sum_o x_qo = 1``), one per resource, then per
quotient edge one marginal row per kept option at each end (``sum_j y_ij -
x_i = 0``), appended as options enter. Columns: one ``x`` per kept option,
one ``y`` per finite pair of kept options. New options add their rows and
columns to the same HiGHS model, which re-solves from the previous basis
(new rows basic, new columns at zero) instead of from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .pricing_quotient import Quotient

# HiGHS' dual feasibility tolerance (scaled objective: costs about 1).
DUAL_TOL = 1e-10


@dataclass
class LPSolution:
    """An optimum of the restricted LP, in true cost units, over the kept
    options (each array in the order of the class's sorted kept options)."""

    objective: float
    u: np.ndarray  # per class (one-hot rows)
    alpha: list[np.ndarray]  # per quotient edge, over its row class's kept options
    beta: list[np.ndarray]  # per quotient edge, over its column class's kept options
    rho: np.ndarray  # per resource
    x: list[np.ndarray]  # per class
    x_reduced: list[np.ndarray]  # HiGHS' reduced costs (c - A^T y) of the x columns


class RestrictedLP:
    """The LP over the options :meth:`sync` was given (all costs times
    ``scale``)."""

    def __init__(self, quotient: Quotient, scale: float):
        import highspy

        self._highspy = highspy
        self.q = quotient
        self.scale = scale
        classes, res = quotient.classes, quotient.resources
        self.kept = [np.zeros(c.num_options, dtype=bool) for c in classes]
        self.xcol = [np.full(c.num_options, -1, dtype=np.int64) for c in classes]
        self.arow = [np.full(classes[e.p].num_options, -1, dtype=np.int64) for e in quotient.edges]
        self.brow = [np.full(classes[e.c].num_options, -1, dtype=np.int64) for e in quotient.edges]
        self.out_edges = [[] for _ in classes]
        self.in_edges = [[] for _ in classes]
        for k, e in enumerate(quotient.edges):
            self.out_edges[e.p].append(k)
            self.in_edges[e.c].append(k)
        self.res_terms = [[] for _ in classes]  # class -> [(row, weights)]
        for k, r in enumerate(res):
            for q, w in r.weights.items():
                self.res_terms[q].append((len(classes) + k, w))
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("presolve", "off")
        h.setOptionValue("dual_feasibility_tolerance", DUAL_TOL)
        inf = highspy.kHighsInf
        lower = [1.0] * len(classes) + [-inf if r.low is None else float(r.low) for r in res]
        upper = [1.0] * len(classes) + [inf if r.high is None else float(r.high) for r in res]
        self._add_rows(h, np.array(lower), np.array(upper))
        self.h = h
        self.num_rows = len(lower)
        self.num_cols = 0

    @staticmethod
    def _add_rows(h, lower: np.ndarray, upper: np.ndarray) -> None:
        n = len(lower)
        if n:
            h.addRows(n, lower, upper, 0, np.zeros(n, dtype=np.int32),
                      np.zeros(0, dtype=np.int32), np.zeros(0))

    def _add_cols(self, costs: np.ndarray, cols: np.ndarray, rows: np.ndarray, vals: np.ndarray) -> None:
        """Columns ``num_cols + k`` for k < len(costs); entries (local col, row, value)."""
        n = len(costs)
        if not n:
            return
        order = np.lexsort((rows, cols))
        start = np.zeros(n, dtype=np.int64)
        np.cumsum(np.bincount(cols, minlength=n)[:-1], out=start[1:])
        self.h.addCols(n, costs, np.zeros(n), np.full(n, self._highspy.kHighsInf), len(rows),
                       start.astype(np.int32), rows[order].astype(np.int32), vals[order].astype(float))
        self.num_cols += n

    def sync(self, kept: list[np.ndarray]) -> int:
        """Add the options of ``kept`` (bool per class option) not in the LP
        yet; returns how many."""
        classes, edges = self.q.classes, self.q.edges
        new = [np.flatnonzero(k & ~mine) for k, mine in zip(kept, self.kept)]
        n_new = sum(len(n) for n in new)
        if not n_new:
            return 0
        # marginal rows of the new options, per edge end
        count = 0
        for k, e in enumerate(edges):
            for rows, q in ((self.arow[k], e.p), (self.brow[k], e.c)):
                rows[new[q]] = self.num_rows + count + np.arange(len(new[q]))
                count += len(new[q])
        self._add_rows(self.h, np.zeros(count), np.zeros(count))
        self.num_rows += count
        # x columns
        costs, cols, rows, vals = [], [], [], []
        local = 0
        for q, opts in enumerate(new):
            if not len(opts):
                continue
            idx = local + np.arange(len(opts))
            self.xcol[q][opts] = self.num_cols + idx
            costs.append(classes[q].unary[opts] * self.scale)
            parts = [(np.full(len(opts), q), np.ones(len(opts)))]
            parts += [(self.arow[k][opts], -np.ones(len(opts))) for k in self.out_edges[q]]
            parts += [(self.brow[k][opts], -np.ones(len(opts))) for k in self.in_edges[q]]
            for row, w in self.res_terms[q]:
                wq = w[opts]
                nz = np.flatnonzero(wq)
                parts.append((np.full(len(nz), row), wq[nz], idx[nz]))
            for part in parts:
                rows.append(part[0])
                vals.append(part[1])
                cols.append(part[2] if len(part) == 3 else idx)
            local += len(opts)
        self._add_cols(np.concatenate(costs), *map(np.concatenate, (cols, rows, vals)))
        for k, n in zip(self.kept, new):
            k[n] = True
        # y columns: finite pairs with at least one new end
        costs, cols, rows, vals = [], [], [], []
        local = 0
        for k, e in enumerate(edges):
            if not (len(new[e.p]) or len(new[e.c])):
                continue
            sp, sc = np.flatnonzero(self.kept[e.p]), np.flatnonzero(self.kept[e.c])
            block = e.block(sp, sc)
            fresh = np.isin(sp, new[e.p])[:, None] | np.isin(sc, new[e.c])[None, :]
            ii, jj = np.nonzero(fresh & np.isfinite(block))
            idx = local + np.arange(len(ii))
            local += len(ii)
            costs.append(block[ii, jj] * self.scale)
            cols += [idx, idx]
            rows += [self.arow[k][sp[ii]], self.brow[k][sc[jj]]]
            vals += [np.ones(len(ii)), np.ones(len(ii))]
        if costs:
            self._add_cols(np.concatenate(costs), *map(np.concatenate, (cols, rows, vals)))
        return n_new

    def solve(self, time_limit: float | None) -> LPSolution | None:
        """The optimum over the synced options; ``None`` when infeasible.
        Raises TimeoutError when HiGHS stops without an optimum."""
        h, M = self.h, self._highspy.HighsModelStatus
        h.setOptionValue("time_limit", self._highspy.kHighsInf if time_limit is None
                         else max(float(time_limit), 1e-3))
        h.run()
        st = h.getModelStatus()
        if st in (M.kInfeasible, M.kUnboundedOrInfeasible):
            return None
        if st != M.kOptimal:
            raise TimeoutError(f"restricted LP stopped: {h.modelStatusToString(st)}")
        sol = h.getSolution()
        s = self.scale
        y = np.asarray(sol.row_dual) / s
        dj = np.asarray(sol.col_dual) / s
        xv = np.asarray(sol.col_value)
        S = [np.flatnonzero(k) for k in self.kept]
        n_cls = len(self.q.classes)
        return LPSolution(
            objective=h.getInfo().objective_function_value / s,
            u=y[:n_cls],
            alpha=[y[self.arow[k][S[e.p]]] for k, e in enumerate(self.q.edges)],
            beta=[y[self.brow[k][S[e.c]]] for k, e in enumerate(self.q.edges)],
            rho=y[n_cls:n_cls + len(self.q.resources)],
            x=[xv[self.xcol[q][S[q]]] for q in range(n_cls)],
            x_reduced=[dj[self.xcol[q][S[q]]] for q in range(n_cls)],
        )
