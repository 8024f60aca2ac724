"""The restricted LP of :mod:`solver.pricing`, grown in place round by round.

Options in the LP are *exact* (``S``: every pair with them is a column) or
*relaxed* (``R``: pairs with exact options are columns; a pair of two
relaxed options is not read, it is charged ``floor``, a lower bound).

Rows: one per class (``sum_o x_qo = 1``, dual ``u``), one per resource
(``rho``), one "aggregate" row per quotient edge (``gamma``), then per edge
one marginal row per LP option at each end (``alpha``/``beta``), appended as
options enter. Columns: one ``x`` per LP option; one ``y`` per finite pair
with an exact end; per edge and relaxed option a ``z`` (row end: marginal
row +1, aggregate +1, cost ``floor``) or ``w`` (column end: marginal row +1,
aggregate -1, cost 0): relaxed-relaxed flow, any pairing of it costing
``floor``, so the LP is a relaxation of the problem over ``S`` and ``R``.
Its duals obey ``alpha_o <= floor - gamma`` for relaxed row options and
``beta_o <= gamma`` for relaxed column options: the caps the pricing uses
for options left out altogether. A promoted option (``R`` to ``S``) gets its
pairs with relaxed options as columns and its ``z``/``w`` fixed at 0.

New options add rows and columns to the same HiGHS model, which re-solves
from the previous basis (new rows basic, new columns at zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import logging

import numpy as np

from . import highs_quiet
from .pricing_quotient import Quotient, QuotientEdge

# HiGHS' dual feasibility tolerance (scaled objective: costs about 1).
DUAL_TOL = 1e-10


logger = logging.getLogger(__name__)


@dataclass
class LPSolution:
    """An optimum of the restricted LP, in true cost units. Arrays over a
    class's LP options are in the order of ``options[q]`` (sorted ids)."""

    objective: float
    options: list[np.ndarray]  # per class, its LP options (exact and relaxed)
    u: np.ndarray  # per class (one-hot rows)
    rho: np.ndarray  # per resource
    gamma: np.ndarray  # per quotient edge (aggregate rows)
    has_relaxed: np.ndarray  # per quotient edge: some relaxed option at an end
    alpha: list[np.ndarray]  # per quotient edge, over its row class's LP options
    beta: list[np.ndarray]  # per quotient edge, over its column class's LP options
    x: list[np.ndarray]  # per class
    x_reduced: list[np.ndarray]  # HiGHS' reduced costs (c - A^T y) of the x columns
    fake: list[np.ndarray]  # per class: relaxed-relaxed flow (z, w) of each LP option


class RestrictedLP:
    """The LP over the options :meth:`sync` was given (costs times ``scale``)."""

    def __init__(self, quotient: Quotient, scale: float):
        import highspy

        self._highspy = highspy
        self.q = quotient
        self.scale = scale
        classes, edges, res = quotient.classes, quotient.edges, quotient.resources
        self.exact = [np.zeros(c.num_options, dtype=bool) for c in classes]
        self.relaxed = [np.zeros(c.num_options, dtype=bool) for c in classes]
        self.xcol = [np.full(c.num_options, -1, dtype=np.int64) for c in classes]
        self.arow = [np.full(classes[e.p].num_options, -1, dtype=np.int64) for e in edges]
        self.brow = [np.full(classes[e.c].num_options, -1, dtype=np.int64) for e in edges]
        self.zcol = [np.full(classes[e.p].num_options, -1, dtype=np.int64) for e in edges]
        self.wcol = [np.full(classes[e.c].num_options, -1, dtype=np.int64) for e in edges]
        self.out_edges = [[] for _ in classes]
        self.in_edges = [[] for _ in classes]
        for k, e in enumerate(edges):
            self.out_edges[e.p].append(k)
            self.in_edges[e.c].append(k)
        n_cls, n_res = len(classes), len(res)
        self.res_terms = [[] for _ in classes]  # class -> [(row, weights)]
        for k, r in enumerate(res):
            for q, w in r.weights.items():
                self.res_terms[q].append((n_cls + k, w))
        self.agg_row = n_cls + n_res + np.arange(len(edges))
        h = highs_quiet.new_highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("presolve", "off")
        h.setOptionValue("dual_feasibility_tolerance", DUAL_TOL)
        inf = highspy.kHighsInf
        lower = [1.0] * n_cls + [-inf if r.low is None else float(r.low) for r in res] + [0.0] * len(edges)
        upper = [1.0] * n_cls + [inf if r.high is None else float(r.high) for r in res] + [0.0] * len(edges)
        self.h = h
        self._add_rows(np.array(lower), np.array(upper))
        self.num_rows = len(lower)
        self.num_cols = 0

    def _add_rows(self, lower: np.ndarray, upper: np.ndarray) -> None:
        n = len(lower)
        if n:
            self.h.addRows(n, lower, upper, 0, np.zeros(n, dtype=np.int32), np.zeros(0, dtype=np.int32), np.zeros(0))

    def _add_cols(self, costs: list, cols: list, rows: list, vals: list) -> None:
        """Columns ``num_cols + k``; entries given as (local column, row, value) arrays."""
        if not costs:
            return
        costs = np.concatenate(costs)
        cols, rows, vals = (np.concatenate(a) for a in (cols, rows, vals))
        n = len(costs)
        if not n:
            return
        order = np.lexsort((rows, cols))
        start = np.zeros(n, dtype=np.int64)
        np.cumsum(np.bincount(cols, minlength=n)[:-1], out=start[1:])
        self.h.addCols(
            n,
            costs,
            np.zeros(n),
            np.full(n, self._highspy.kHighsInf),
            len(rows),
            start.astype(np.int32),
            rows[order].astype(np.int32),
            vals[order].astype(float),
        )
        self.num_cols += n

    def sync(self, exact: list[np.ndarray], relaxed: list[np.ndarray]) -> int:
        """Bring the LP to the given exact and relaxed options (bool per
        class option; disjoint). Options only ever enter (as exact or
        relaxed) or move from relaxed to exact. Returns how many changed."""
        classes, edges = self.q.classes, self.q.edges
        was_exact = [e.copy() for e in self.exact]
        was_in = [e | r for e, r in zip(self.exact, self.relaxed)]
        new = [np.flatnonzero((s | r) & ~w) for s, r, w in zip(exact, relaxed, was_in)]
        promoted = [np.flatnonzero(s & r) for s, r in zip(exact, self.relaxed)]
        n_changed = sum(len(n) for n in new) + sum(len(p) for p in promoted)
        if not n_changed:
            return 0
        for mine, given in zip(self.exact, exact):
            mine |= given
        for mine, given, s in zip(self.relaxed, relaxed, exact):
            mine |= given
            mine &= ~s
        # marginal rows of the new options, per edge end
        count = 0
        for k, e in enumerate(edges):
            for rows, q in ((self.arow[k], e.p), (self.brow[k], e.c)):
                rows[new[q]] = self.num_rows + count + np.arange(len(new[q]))
                count += len(new[q])
        self._add_rows(np.zeros(count), np.zeros(count))
        self.num_rows += count
        # x columns of the new options
        costs, cols, rows, vals = [], [], [], []
        base = self.num_cols
        for q, opts in enumerate(new):
            if not len(opts):
                continue
            idx = sum(len(c) for c in costs) + np.arange(len(opts))
            self.xcol[q][opts] = base + idx
            costs.append(classes[q].unary[opts] * self.scale)
            ones = np.ones(len(opts))
            parts = [(q + 0 * opts, ones, idx)]
            parts += [(self.arow[k][opts], -ones, idx) for k in self.out_edges[q]]
            parts += [(self.brow[k][opts], -ones, idx) for k in self.in_edges[q]]
            for row, w in self.res_terms[q]:
                wq = w[opts]
                nz = np.flatnonzero(wq)
                parts.append((np.full(len(nz), row), wq[nz], idx[nz]))
            for r_, v_, c_ in parts:
                rows.append(r_)
                vals.append(v_)
                cols.append(c_)
        self._add_cols(costs, cols, rows, vals)
        # z / w columns of the new relaxed options
        costs, cols, rows, vals = [], [], [], []
        base = self.num_cols
        for k, e in enumerate(edges):
            for q, marg, fake, cost, sign in (
                (e.p, self.arow[k], self.zcol[k], e.floor, 1.0),
                (e.c, self.brow[k], self.wcol[k], 0.0, -1.0),
            ):
                opts = new[q][self.relaxed[q][new[q]]]
                if not len(opts):
                    continue
                idx = sum(len(c) for c in costs) + np.arange(len(opts))
                fake[opts] = base + idx
                costs.append(np.full(len(opts), cost * self.scale))
                rows += [marg[opts], np.full(len(opts), self.agg_row[k])]
                vals += [np.ones(len(opts)), np.full(len(opts), sign)]
                cols += [idx, idx]
        self._add_cols(costs, cols, rows, vals)
        # promoted options: their relaxed-relaxed flow closed
        fixed = np.concatenate(
            [np.zeros(0, dtype=np.int64)]
            + [
                f[p][f[p] >= 0]
                for k, e in enumerate(edges)
                for f, p in ((self.zcol[k], promoted[e.p]), (self.wcol[k], promoted[e.c]))
            ]
        )
        if len(fixed):
            self.h.changeColsBounds(len(fixed), fixed.astype(np.int32), np.zeros(len(fixed)), np.zeros(len(fixed)))
        # y columns: pairs with an exact end, not there before
        costs, cols, rows, vals = [], [], [], []
        for k, e in enumerate(edges):
            p, c = e.p, e.c
            fresh_p = np.zeros(classes[p].num_options, dtype=bool)
            fresh_p[new[p]] = True
            fresh_p[promoted[p]] = True
            fresh_c = np.zeros(classes[c].num_options, dtype=bool)
            fresh_c[new[c]] = True
            fresh_c[promoted[c]] = True
            if not (fresh_p.any() or fresh_c.any()):
                continue
            in_p = np.flatnonzero(self.exact[p] | self.relaxed[p])
            in_c = np.flatnonzero(self.exact[c] | self.relaxed[c])
            for I, J in ((in_p[fresh_p[in_p]], in_c), (in_p[~fresh_p[in_p]], in_c[fresh_c[in_c]])):
                if not (len(I) and len(J)):
                    continue
                block = _known_block(e, I, J, self.exact[p], self.exact[c])
                before = (
                    was_in[p][I][:, None]
                    & was_in[c][J][None, :]
                    & (was_exact[p][I][:, None] | was_exact[c][J][None, :])
                )
                ii, jj = np.nonzero(np.isfinite(block) & ~before)
                idx = sum(len(x) for x in costs) + np.arange(len(ii))
                costs.append(block[ii, jj] * self.scale)
                rows += [self.arow[k][I[ii]], self.brow[k][J[jj]]]
                vals += [np.ones(len(ii)), np.ones(len(ii))]
                cols += [idx, idx]
        self._add_cols(costs, cols, rows, vals)
        return n_changed

    def solve(self, time_limit: float | None) -> LPSolution | None:
        """The optimum over the synced options; ``None`` when infeasible.
        Raises TimeoutError when HiGHS stops without an optimum."""
        h, M = self.h, self._highspy.HighsModelStatus
        h.setOptionValue("time_limit", self._highspy.kHighsInf if time_limit is None else max(float(time_limit), 1e-3))
        run_status = h.run()
        st = h.getModelStatus()
        if st == M.kNotset:
            # HiGHS gave up on the warm start (seen after many added
            # columns on LLaMA-3 70B 4x4x8x8, run status error): once more
            # from scratch before reporting the stop
            logger.info("restricted LP: HiGHS returned %s without a model status; re-solving cold", run_status)
            h.clearSolver()
            run_status = h.run()
            st = h.getModelStatus()
        if st in (M.kInfeasible, M.kUnboundedOrInfeasible):
            return None
        if st != M.kOptimal:
            raise TimeoutError(f"restricted LP stopped: {h.modelStatusToString(st)} ({run_status})")
        sol = h.getSolution()
        s = self.scale
        y = np.asarray(sol.row_dual) / s
        dj = np.asarray(sol.col_dual) / s
        xv = np.asarray(sol.col_value)
        edges = self.q.edges
        L = [np.flatnonzero(e | r) for e, r in zip(self.exact, self.relaxed)]
        n_cls = len(self.q.classes)
        fake = [np.zeros(len(opts)) for opts in L]
        has_relaxed = np.zeros(len(edges), dtype=bool)
        for k, e in enumerate(edges):
            for q, col in ((e.p, self.zcol[k]), (e.c, self.wcol[k])):
                idx = col[L[q]]
                there = idx >= 0
                has_relaxed[k] |= bool(self.relaxed[q].any())
                fake[q][there] += xv[idx[there]]
        n_res = len(self.q.resources)
        return LPSolution(
            objective=h.getInfo().objective_function_value / s,
            options=L,
            u=y[:n_cls],
            rho=y[n_cls : n_cls + n_res],
            gamma=y[self.agg_row],
            has_relaxed=has_relaxed,
            alpha=[y[self.arow[k][L[e.p]]] for k, e in enumerate(edges)],
            beta=[y[self.brow[k][L[e.c]]] for k, e in enumerate(edges)],
            x=[xv[self.xcol[q][L[q]]] for q in range(n_cls)],
            x_reduced=[dj[self.xcol[q][L[q]]] for q in range(n_cls)],
            fake=fake,
        )


def _known_block(e: QuotientEdge, I: np.ndarray, J: np.ndarray, exact_p: np.ndarray, exact_c: np.ndarray) -> np.ndarray:
    """``C[I, J]`` where the row or the column option is exact (read from
    the cached full rows and columns), ``inf`` elsewhere."""
    out = np.full((len(I), len(J)), np.inf)
    rows = exact_p[I]
    cols = exact_c[J]
    if cols.any():
        out[:, cols] = e.cols(J[cols])[I]
    if rows.any():
        out[rows, :] = e.rows(I[rows])[:, J]
    return out
