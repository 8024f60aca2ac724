"""Presolve phases 2-4: forbidden options, dominance and folding, to a fixpoint."""

from __future__ import annotations

import logging

import numpy as np

from .model import (
    DENSE_DOMINANCE_MAX,
    DOMINANCE_ROUNDS,
    PAIR_RTOL,
    SPARSE_GAIN_RTOL,
    PresolveInfeasible,
    _Resource,
    _and,
    _separable,
    _slack,
)

logger = logging.getLogger(__name__)


class ReducePhase:
    """Reduction steps of :class:`~solver.presolve.reducer.Reducer`."""

    def reduce(self) -> None:
        """Apply the reductions to a fixpoint.

        Cheap ones (arc consistency, separable edges, fixing, elimination)
        run first; dominance, the costly test, only once they have settled.
        """
        for g in range(len(self.groups)):
            self._push(g)
        while True:
            if self.queue:
                g = self.queue.popleft()
                self.queued[g] = False
                if self.active[g]:
                    self._process(g)
            elif self.res_dirty:
                dirty = list(self.res_dirty.values())
                self.res_dirty.clear()
                for res in dirty:
                    if res in self.resources:
                        self._propagate_resource(res)
            elif self.dom_queue:
                g = self.dom_queue.popleft()
                self.dom_queued[g] = False
                if self.active[g] and len(self.alive[g]) > 1 and self.dom_runs[g] < DOMINANCE_ROUNDS:
                    self.dom_runs[g] += 1
                    self._dominance(g, pairs=False)
            elif self.pair_queue:
                # Last: a forbidden pair in k's row keeps k from dominating.
                g = self.pair_queue.popleft()
                self.pair_queued[g] = False
                if self.active[g] and len(self.alive[g]) > 1 and self.pair_runs[g] < DOMINANCE_ROUNDS:
                    self.pair_runs[g] += 1
                    self._dominance(g, pairs=True)
            else:
                break

    def _push(self, g: int) -> None:
        if not self.queued[g]:
            self.queued[g] = True
            self.queue.append(g)
        if not self.dom_queued[g]:
            self.dom_queued[g] = True
            self.dom_queue.append(g)
        if not self.pair_queued[g]:
            self.pair_queued[g] = True
            self.pair_queue.append(g)

    def _process(self, g: int) -> None:
        for nb, eid in list(self.adj[g].items()):
            e = self.edges.get(eid)
            if e is None or e.clean:
                continue
            M = e.M
            if e.has_inf is not False:
                finite = np.isfinite(M)
                e.has_inf = not finite.all()
            if e.has_inf:
                # Arc consistency: an option with no finite pair is forbidden.
                why = (
                    f"edge {self._name(e.u)!r} ~ {self._name(e.v)!r} forbids "
                    f"every pair with the remaining options of the other end"
                )
                self._restrict(e.u, finite.any(1), why)
                self._restrict(e.v, finite.any(0), why)
                if eid in self.edges:
                    e.clean = True
                continue
            if _separable(M):
                self._drop_edge(eid)
                self.stats.edges_folded += 1
                self._add_unary(e.u, M[:, 0])
                self._add_unary(e.v, M[0, :] - M[0, 0])
            else:
                e.clean = True
        if not self.active[g]:
            return
        if len(self.alive[g]) == 1:
            self._fix(g, 0)
        elif not self.res_of[g] and len(self.adj[g]) <= 2:
            self._eliminate(g)

    def _restrict(self, g: int, keep: np.ndarray, why: str, dominated: bool = False) -> None:
        n_removed = len(keep) - int(np.count_nonzero(keep))
        if n_removed == 0:
            return
        if n_removed == len(keep):
            raise PresolveInfeasible(self._msg(g, why))
        if dominated:
            self.stats.options_removed_dominated += n_removed
        else:
            self.stats.options_removed_forbidden += n_removed
            logger.debug("%s: %d options forbidden: %s", self._name(g), n_removed, why)
        self.alive[g] = self.alive[g][keep]
        self.unary[g] = self.unary[g][keep]
        for nb, eid in self.adj[g].items():
            e = self.edges[eid]
            e.M = e.M[keep] if e.u == g else e.M[:, keep]
            e.clean = False
            if e.has_inf:
                e.has_inf = None  # may have lost its inf entries
            self._push(nb)
        for res in self.res_of[g]:
            res.terms[g] = res.terms[g][keep]
            self.res_dirty[id(res)] = res
        self._push(g)

    def _dominance(self, g: int, pairs: bool = True) -> None:
        """Drop options of ``g``, and option pairs on its edges, that no optimum needs.

        Switching ``g`` from ``i`` to ``k`` changes the cost by at most
        ``gain[k, i] = u[k] - u[i] + sum over edges of max_j (M[k][j] - M[i][j])``
        (pairs forbidden for ``i`` are ignored: no solution uses them). When
        the switch cannot break a resource bound:

        * ``gain[k, i] <= 0``: some optimum avoids ``i`` (option dominance);
        * the same bound with one edge's ``max_j`` replaced by its entry for
          the neighbour's option ``j`` is ``< 0``: no optimum pairs ``i`` with
          that ``j``, which becomes forbidden (conditional dominance). Strict,
          so all such pairs can go at once.
        """
        u = self.unary[g]
        n = len(u)
        gain = u[:, None] - u[None, :]  # gain[k, i]: worst cost change from i to k
        switch_ok = None  # switch_ok[k, i]: i -> k keeps every resource bound
        for res in self.res_of[g]:
            w = res.terms[g]
            if res.high is not None:
                switch_ok = _and(switch_ok, w[:, None] <= w[None, :])
            if res.low is not None:
                switch_ok = _and(switch_ok, w[:, None] >= w[None, :])
        incident = list(self.adj[g].values())
        mats = []
        has_inf = False
        for eid in incident:
            e = self.edges[eid]
            mats.append(e.M if e.u == g else e.M.T)
            has_inf = has_inf or e.has_inf is not False
        cuts = []
        if mats:
            C = np.hstack(mats) if len(mats) > 1 else mats[0]
            widths = [m.shape[1] for m in mats]
            starts = np.cumsum([0] + widths[:-1])
            # A pair forbidden for i must not count: with +inf in C[i] and a
            # huge finite value for inf in C[k], C[k] - C[i] is -inf there,
            # and still ~+inf where only k's pair is forbidden.
            Ck = np.where(np.isinf(C), 1e300, C) if has_inf else C
            if n * n * C.shape[1] <= DENSE_DOMINANCE_MAX:
                D = Ck[:, None, :] - C[None, :, :]  # D[k, i, j]
                worst = np.maximum.reduceat(D, starts, axis=2)  # [k, i, edge]
                if pairs:
                    cuts = self._pair_cuts(u, C, D, gain, worst, switch_ok, starts, widths)
                gain += worst.sum(2)
            else:
                gain = self._sparse_gain(gain, C, Ck, starts, widths, switch_ok)
        for eid, cut in zip(incident, cuts):
            if cut is None:
                continue
            e = self.edges[eid]
            M = e.M.copy()
            M[cut if e.u == g else cut.T] = np.inf
            e.M, e.has_inf, e.clean = M, True, False
            self.stats.pairs_removed_dominated += int(np.count_nonzero(cut))
            self._push(e.u)
            self._push(e.v)
        ok = gain <= 0.0  # nan (inf - inf across edges): not comparable
        if switch_ok is not None:
            ok &= switch_ok
        np.fill_diagonal(ok, False)
        if not ok.any():
            return
        # Remove i when an option still kept beats it strictly, or ties with it
        # and has a lower id. One at a time: float rounding may break
        # transitivity, and every removed option must keep a kept dominator.
        le = ok.tolist()
        keep = [True] * n
        for i in np.flatnonzero(ok.any(0)).tolist():
            for k in range(n):
                if keep[k] and le[k][i] and (k < i or not le[i][k]):
                    keep[i] = False
                    break
        self._restrict(g, np.array(keep), "dominated", dominated=True)

    @staticmethod
    def _sparse_gain(udiff, C, Ck, starts, widths, switch_ok) -> np.ndarray:
        """``gain`` of :meth:`_dominance` where it may be ``<= 0``, ``+inf``
        elsewhere, for decisions too big for the dense ``[k, i, j]`` array.

        Computing every ``max_j (C[k][j] - C[i][j])`` costs ``n * n * W``
        (3-D meshes: 340 options, 900 partner options: 0.1 s per decision).
        Any single entry ``C[k][j] - C[i][j]`` bounds that max from below, so
        two probes per edge, ``j`` = the cheapest partner of ``i`` and ``j`` =
        the dearest of ``k``, give a lower bound of the gain in ``n * n`` per
        edge; only pairs whose bound can still be ``<= 0`` get the exact sum,
        computed as the dense path computes it (identical results).
        """
        n = len(udiff)
        lb = udiff.copy()
        rows = np.arange(n)
        scale = float(np.abs(udiff[np.isfinite(udiff)]).max(initial=0.0))
        for a, w in zip(starts.tolist(), widths):
            Ce, Cke = C[:, a : a + w], Ck[:, a : a + w]
            finite = Ce[np.isfinite(Ce)]
            scale += float(np.abs(finite).max(initial=0.0))
            ji = np.argmin(Ce, axis=1)  # i's cheapest partner
            jk = np.argmax(Cke, axis=1)  # k's dearest partner
            probe = np.maximum(
                Cke[:, ji] - Ce[rows, ji][None, :],  # [k, i]: j = ji[i]
                Cke[rows, jk][:, None] - Ce[:, jk].T,  # [k, i]: j = jk[k]
            )
            lb += probe
        # The exact gain sums the same entries in another order: a margin far
        # above rounding keeps every pair the exact test could accept.
        cand = lb <= SPARSE_GAIN_RTOL * scale
        np.fill_diagonal(cand, False)
        if switch_ok is not None:
            cand &= switch_ok
        gain = np.full((n, n), np.inf)
        kc, ic = np.nonzero(cand)
        width = C.shape[1]
        step = max(1, DENSE_DOMINANCE_MAX // max(1, width))
        for s in range(0, len(kc), step):
            k, i = kc[s : s + step], ic[s : s + step]
            D = Ck[k] - C[i]
            gain[k, i] = udiff[k, i] + np.maximum.reduceat(D, starts, axis=1).sum(1)
        return gain

    @staticmethod
    def _pair_cuts(u, C, D, udiff, worst, switch_ok, starts, widths) -> list:
        """Per incident edge: the (i, j) pairs that no optimum uses, or None."""
        n = len(u)
        finite = np.isfinite(C)
        # Strictly below -tol: rounding can neither fake nor cycle a strict gain.
        scale = float(np.abs(u).max()) + sum(
            float(np.abs(np.where(finite[:, a : a + w], C[:, a : a + w], 0.0)).max())
            for a, w in zip(starts.tolist(), widths)
        )
        tol = PAIR_RTOL * scale
        allowed = ~np.eye(n, dtype=bool)
        if switch_ok is not None:
            allowed &= switch_ok
        # The bound without edge t's worst case, as udiff + (sum of the others):
        # subtracting worst[..., t] from the total would cancel huge values.
        n_edges = worst.shape[2]
        before = np.zeros((n, n, n_edges))
        after = np.zeros((n, n, n_edges))
        if n_edges > 1:
            before[:, :, 1:] = np.cumsum(worst[:, :, :-1], axis=2)
            after[:, :, :-1] = np.cumsum(worst[:, :, :0:-1], axis=2)[:, :, ::-1]
        out = []
        for t, (a, w) in enumerate(zip(starts.tolist(), widths)):
            rest = udiff + before[:, :, t] + after[:, :, t]
            cond = (rest[:, :, None] + D[:, :, a : a + w]) < -tol
            cond &= allowed[:, :, None]
            cut = cond.any(0) & finite[:, a : a + w]  # [i, j], newly forbidden only
            out.append(cut if cut.any() else None)
        return out

    def _fix(self, g: int, t: int) -> None:
        """Decide ``g`` as its alive option ``t``; fold everything it touches."""
        self.const += float(self.unary[g][t])
        self.active[g] = False
        self.steps.append(("fix", g, int(self.alive[g][t])))
        self.stats.decisions_fixed += 1
        folds = []
        for nb, eid in list(self.adj[g].items()):
            e = self.edges[eid]
            folds.append((nb, e.M[t, :] if e.u == g else e.M[:, t]))
            self._drop_edge(eid)
            self.stats.edges_folded += 1
        for res in self.res_of[g]:
            w = float(res.terms.pop(g)[t])
            res.fixed += w
            if res.low is not None:
                res.low -= w
            if res.high is not None:
                res.high -= w
            self.res_dirty[id(res)] = res
        self.res_of[g] = []
        for nb, vec in folds:
            self._add_unary(nb, vec)

    def _eliminate(self, g: int) -> None:
        """Fold a decision with at most two neighbours into them (min over its options)."""
        u = self.unary[g]
        nbs = list(self.adj[g].items())
        if not nbs:
            self._fix(g, int(np.argmin(u)))
            self.stats.decisions_fixed -= 1
            self.stats.decisions_eliminated += 1
            return
        mats = []
        for nb, eid in nbs:
            e = self.edges[eid]
            mats.append((nb, e.M if e.u == g else e.M.T))
        if len(mats) == 1:
            ((a, Ma),) = mats
            T = u + Ma.T  # [a, g]
            arg = T.argmin(1)
            best = T[np.arange(T.shape[0]), arg]
            table = dict(zip(self.alive[a].tolist(), self.alive[g][arg].tolist()))
            self.steps.append(("elim1", g, a, table))
            self._drop_edge(nbs[0][1])
            self.active[g] = False
            self.stats.decisions_eliminated += 1
            self._add_unary(a, best)
            return
        (a, Ma), (b, Mb) = mats
        n_g, n_a, n_b = len(u), Ma.shape[1], Mb.shape[1]
        existing = self.adj[a].get(b)
        if existing is None and n_a * n_b > n_g * (n_a + n_b):
            return  # would grow the number of pairs
        # min over g of T[g] = u[g] + Ma[g][:, None] + Mb[g][None, :], one g
        # at a time (the first minimum on ties, as argmin): the whole
        # [g, a, b] array (200^3 on 3-D meshes) cost 5x more to allocate
        # and reduce than these cache-sized passes.
        best = (u[0] + Ma[0][:, None]) + Mb[0][None, :]
        arg = np.zeros(best.shape, dtype=np.int64)
        better = np.empty(best.shape, dtype=bool)
        for t in range(1, n_g):
            cur = (u[t] + Ma[t][:, None]) + Mb[t][None, :]
            np.less(cur, best, out=better)
            np.copyto(best, cur, where=better)
            arg[better] = t
        pos_a = {int(r): i for i, r in enumerate(self.alive[a])}
        pos_b = {int(r): i for i, r in enumerate(self.alive[b])}
        self.steps.append(("elim2", g, a, b, pos_a, pos_b, self.alive[g][arg]))
        for _, eid in nbs:
            self._drop_edge(eid)
        self.active[g] = False
        self.stats.decisions_eliminated += 1
        if existing is not None:
            e = self.edges[existing]
            e.M = e.M + (best if e.u == a else best.T)
            e.clean = False
            e.has_inf = None
        else:
            self._add_edge(a, b, best, 0, False)
        self._push(a)
        self._push(b)

    def _propagate_resource(self, res: _Resource) -> None:
        if not res.terms:
            self.resources.remove(res)
            self._check_constant_resource(res)
            return
        lo = {g: float(w.min()) for g, w in res.terms.items()}
        hi = {g: float(w.max()) for g, w in res.terms.items()}
        sum_lo, sum_hi = sum(lo.values()), sum(hi.values())
        for g, w in list(res.terms.items()):
            keep = np.ones(len(w), dtype=bool)
            if res.high is not None:
                keep &= sum_lo - lo[g] + w <= res.high + _slack(res.high)
            if res.low is not None:
                keep &= sum_hi - hi[g] + w >= res.low - _slack(res.low)
            self._restrict(g, keep, f"resource constraint {res.name!r} cannot be met with these options")

    def _check_constant_resource(self, res: _Resource) -> None:
        if (res.high is not None and 0.0 > res.high + _slack(res.high)) or (
            res.low is not None and 0.0 < res.low - _slack(res.low)
        ):
            low, high = res.orig
            raise PresolveInfeasible(
                f"resource constraint {res.name!r} cannot be met: the only options "
                f"left to its decisions sum to {res.fixed:g}, outside "
                f"[{low if low is not None else '-inf'}, "
                f"{high if high is not None else 'inf'}]"
            )
