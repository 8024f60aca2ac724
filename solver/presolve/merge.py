"""Presolve phase 1: links merge decisions into groups; edges between two
groups are re-indexed and summed (repeated layers collapse to one)."""

from __future__ import annotations

from collections import deque

import numpy as np

from ..problem import Edge
from .model import PresolveInfeasible, _Group, _Resource, _chain, _matrix


class MergePhase:
    """Merge step of :class:`~solver.presolve.reducer.Reducer`."""

    def merge(self) -> None:
        p = self.p
        decs = p.decisions
        index = {d.name: i for i, d in enumerate(decs)}
        group_of = [-1] * len(decs)
        # Per decision: its option for each alive option of its group (None:
        # identity, all options alive).
        sel: list[np.ndarray | None] = [None] * len(decs)
        pins_on: dict[int, list] = {}
        for pin in p.pins:
            pins_on.setdefault(index[pin.decision], []).append(pin)

        comps = self._link_components(index)
        in_comp = {i for comp in comps for i in comp[0]}
        plan: list[tuple] = []  # group -> (root idx, members, omaps, valid, cause)
        for i in range(len(decs)):
            if i in in_comp:
                continue
            plan.append((i, [i], [None], None, None))
        for members, omaps, valid, cause in comps:
            plan.append((members[0], members, omaps, valid, cause))
        plan.sort(key=lambda t: t[0])

        for g, (root, members, omaps, valid, cause) in enumerate(plan):
            self.groups.append(_Group([decs[m].name for m in members], omaps))
            n_root = len(decs[root].options)
            removed_by_links = 0
            if valid is None:
                alive = np.arange(n_root)
            else:
                alive = np.flatnonzero(valid)
                removed_by_links = n_root - len(alive)
                if not len(alive):
                    raise PresolveInfeasible(self._msg(g, cause))
            # Member option per alive option, unary costs summed over members
            # (repeated layers: equal cost lists are counted, not added).
            unary = None
            same: dict[int, list] = {}  # id(sel) -> [sel, costs, count]
            for m, omap in zip(members, omaps):
                group_of[m] = g
                s = None if omap is None else omap[alive]
                if s is not None or removed_by_links:
                    s = alive if s is None else s
                sel[m] = s
                costs = decs[m].costs
                if omap is not None or s is None:  # s is shared by all users of omap
                    entry = same.get(id(omap))
                    if entry is None:
                        same[id(omap)] = [s, costs, 1]
                        continue
                    if costs is entry[1] or costs == entry[1]:
                        entry[2] += 1
                        continue
                c = np.fromiter(costs, float, len(costs))
                c = c if s is None else c[s]
                unary = c if unary is None else unary + c
            for s, costs, count in same.values():
                c = np.fromiter(costs, float, len(costs))
                c = (c if s is None else c[s]) * count
                unary = c if unary is None else unary + c
            keep = np.isfinite(unary)
            why = "every option has an infinite unary cost"
            for m in members:
                for pin in pins_on.get(m, ()):
                    s = sel[m] if sel[m] is not None else alive
                    keep &= np.isin(s, pin.allowed)
                    why = f"pin {pin.name!r} on {decs[m].name!r} allows {sorted(pin.allowed)}"
            if cause and removed_by_links:
                why = cause + "; " + why
            n_kept = int(keep.sum())
            self.stats.options_removed_forbidden += removed_by_links + len(keep) - n_kept
            if n_kept == 0:
                raise PresolveInfeasible(self._msg(g, why))
            if n_kept < len(keep):
                alive = alive[keep]
                unary = unary[keep]
                for m in members:
                    sel[m] = alive if sel[m] is None else sel[m][keep]
            self.alive.append(alive)
            self.unary.append(unary)
        n = len(self.groups)
        self.stats.merged_by_links = len(decs) - n
        self.active = [True] * n
        self.adj = [{} for _ in range(n)]
        self.res_of = [[] for _ in range(n)]
        self.queued = [False] * n
        self.dom_queued = [False] * n
        self.pair_queued = [False] * n
        self.dom_runs = [0] * n
        self.pair_runs = [0] * n

        for rc in p.resources:
            terms: dict[int, np.ndarray] = {}
            for name, weights in rc.terms.items():
                i = index[name]
                w = np.fromiter(weights, float, len(weights))
                w = w if sel[i] is None else w[sel[i]]
                g = group_of[i]
                terms[g] = terms[g] + w if g in terms else w
            res = _Resource(rc.name, terms, rc.low, rc.high)
            self.resources.append(res)
            for g in terms:
                self.res_of[g].append(res)
            self.res_dirty[id(res)] = res
        # Last: folding diagonals may restrict options, re-slicing what exists.
        self._merge_edges(index, group_of, sel)

    def _link_components(self, index: dict[str, int]) -> list[tuple]:
        """Per linked component: (members, omaps, valid root options, cause)."""
        p = self.p
        if not p.links:
            return []
        decs = p.decisions
        ranges: dict[int, list[int]] = {}
        adj: dict[int, list] = {}
        for k, link in enumerate(p.links):
            a, b = index[link.a], index[link.b]
            na = len(decs[a].options)
            ident = ranges.get(na) or ranges.setdefault(na, list(range(na)))
            if na == len(decs[b].options) and link.mapping == ident:
                mp = None  # identity: the common case (repeated layers)
            else:
                mp = np.array([-1 if o is None else o for o in link.mapping], dtype=np.int64)
            adj.setdefault(a, []).append((k, b, mp, True))
            adj.setdefault(b, []).append((k, a, mp, False))
        out = []
        seen: set[int] = set()
        # Connected components by BFS over links (networkx would cost 0.3 s to
        # import); starting from the lowest index makes it the component's root.
        for root in sorted(adj):
            if root in seen:
                continue
            n_root = len(decs[root].options)
            # omap[m][r]: option of m corresponding to root option r (-1: none).
            # Identity links share their parent's array.
            omap: dict[int, np.ndarray] = {root: np.arange(n_root)}
            tree: set[int] = set()
            queue = deque([root])
            while queue:
                x = queue.popleft()
                ox = omap[x]
                for k, y, mp, forward in adj[x]:
                    if y in omap:
                        continue
                    if mp is None:
                        oy = ox
                    elif forward:
                        oy = np.where(ox >= 0, mp[ox], -1)
                    else:
                        inv = np.full(len(decs[x].options), -1, dtype=np.int64)
                        ok = mp >= 0
                        inv[mp[ok]] = np.flatnonzero(ok)
                        oy = np.where(ox >= 0, inv[ox], -1)
                    omap[y] = oy
                    tree.add(k)
                    queue.append(y)
            members = sorted(omap)
            seen.update(members)
            valid = np.ones(n_root, dtype=bool)
            for arr in {id(o): o for o in omap.values()}.values():
                valid &= arr >= 0
            for m in members:
                for k, y, mp, forward in adj[m]:
                    if not forward:
                        continue
                    oa, ob = omap[m], omap[y]
                    if k in tree or (mp is None and oa is ob):
                        continue
                    if mp is None:
                        valid &= oa == ob
                    else:
                        valid &= (oa >= 0) & (mp[np.maximum(oa, 0)] == ob)
            if valid.all():
                cause = None  # only read when links remove options
            else:
                cause = self._link_cause(members, adj)
            base = omap[root]
            omaps = [
                None if omap[m] is base and len(decs[m].options) == n_root else omap[m]
                for m in members
            ]
            out.append((members, omaps, valid, cause))
        return out

    def _link_cause(self, members: list[int], adj: dict[int, list]) -> str:
        p = self.p
        names = list(dict.fromkeys(
            p.links[k].name for m in members for k, _, _, forward in adj[m] if forward
        ))
        return (
            f"links {', '.join(map(repr, names))} leave no consistent "
            f"correspondence between the options of "
            f"{', '.join(repr(p.decisions[m].name) for m in members[:4])}"
            + (f" and {len(members) - 4} more" if len(members) > 4 else "")
        )

    def _merge_edges(self, index, group_of, sel) -> None:
        decs = self.p.decisions
        buckets: dict[tuple, list] = {}
        first: dict[tuple[int, int], Edge] = {}
        diags: dict[int, np.ndarray] = {}  # group -> summed diagonals
        sigs: dict[int, bytes] = {}
        sig = [None if s is None else sigs.get(id(s)) or sigs.setdefault(id(s), s.tobytes())
               for s in sel]
        n_opt = [len(d.options) for d in decs]
        for e in self.p.edges:
            ip, ic = index[e.producer], index[e.consumer]
            gp, gc = group_of[ip], group_of[ic]
            if gp == gc:
                # Both ends take corresponding options: only the diagonal is paid.
                rows = sel[ip] if sel[ip] is not None else range(n_opt[ip])
                cols = sel[ic] if sel[ic] is not None else range(n_opt[ic])
                diag = [e.costs[r][c] for r, c in zip(rows, cols)]
                diag = np.array(diag, dtype=float)
                diags[gp] = diags[gp] + diag if gp in diags else diag
                continue
            key = (gp, gc) if gp < gc else (gc, gp)
            # Edges re-indexed the same way (identity: None) can be compared as is.
            sub = (key, sig[ip], n_opt[ip], sig[ic], n_opt[ic], gp > gc)
            items = buckets.get(sub)
            if items is None:
                buckets[sub] = [(e, ip, ic)]
                first.setdefault(key, e)
            else:
                items.append((e, ip, ic))
        by_key: dict[tuple[int, int], list] = {}
        for sub, items in buckets.items():
            by_key.setdefault(sub[0], []).append((sub, items))
        for key, subs in by_key.items():
            total = None
            for (_, _, n_p, _, n_c, flip), items in subs:
                e0, ip, ic = items[0]
                mats = [e0.costs]
                n_same = 1
                for e, _, _ in items[1:]:
                    # Repeated layers usually have equal matrices: count, don't add.
                    if e.costs is e0.costs or e.costs == e0.costs:
                        n_same += 1
                    else:
                        mats.append(e.costs)
                A = _matrix(e0.costs, n_p, n_c)
                if n_same > 1:
                    A = A * n_same
                if len(mats) > 1:
                    rest = np.fromiter(_chain(_chain(mats[1:])), float,
                                       (len(mats) - 1) * n_p * n_c)
                    A = A + rest.reshape(len(mats) - 1, n_p, n_c).sum(0)
                rows, cols = sel[ip], sel[ic]
                if rows is not None and cols is not None:
                    A = A[np.ix_(rows, cols)]
                elif rows is not None:
                    A = A[rows]
                elif cols is not None:
                    A = A[:, cols]
                if flip:
                    A = A.T
                total = A if total is None else total + A
            e0 = first[key]
            u, v = key
            self._add_edge(u, v, total, e0.arg_index, group_of[index[e0.producer]] != u)
        # Only now: restricting options re-slices edges, not ``sel``.
        for g, diag in diags.items():
            self._add_unary(g, diag, "an edge between two of its linked decisions forbids it")
