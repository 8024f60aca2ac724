"""Presolve phase 1: links merge decisions into groups; edges between two
groups are re-indexed and summed (repeated layers collapse to one)."""

from __future__ import annotations

from collections import deque

import numpy as np

from ..problem import Edge, _matrix_ok
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
            if valid is None and len(members) > 1:
                # Identity links only (repeated layers): no re-indexing, and
                # usually equal cost lists, counted at C speed.
                costs = [decs[m].costs for m in members]
                count = costs.count(costs[0])
                if count == len(members):
                    for m in members:
                        group_of[m] = g
                    unary = np.fromiter(costs[0], float, len(costs[0])) * count
            same: dict[int, list] = {}  # id(sel) -> [sel, costs, count]
            for m, omap in zip(members, omaps) if unary is None else ():
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
        """Per linked component: (members, omaps, valid root options, cause).

        ``valid`` is None when all options are (identity links only: ``omaps``
        all None)."""
        p = self.p
        if not p.links:
            return []
        decs = p.decisions
        ranges: dict[int, list[int]] = {}
        # Connected components by union-find over links, the lowest index the
        # root (networkx would cost 0.3 s to import). Components of identity
        # links alone (repeated layers: the common case) need nothing else;
        # the others are walked link by link in _component().
        parent = list(range(len(decs)))
        linked = [False] * len(decs)
        general: set[int] = set()  # links that are not the identity
        for k, link in enumerate(p.links):
            a, b = index[link.a], index[link.b]
            linked[a] = linked[b] = True
            na = len(decs[a].options)
            ident = ranges.get(na) or ranges.setdefault(na, list(range(na)))
            if not (na == len(decs[b].options) and link.mapping == ident):
                general.add(k)
            while parent[a] != a:
                parent[a] = a = parent[parent[a]]
            while parent[b] != b:
                parent[b] = b = parent[parent[b]]
            if a < b:
                parent[b] = a
            elif b < a:
                parent[a] = b

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = x = parent[parent[x]]
            return x

        comps: dict[int, list[int]] = {}  # root -> members, in index order
        for x in [x for x, f in enumerate(linked) if f]:
            r = find(x)
            if r == x:
                comps[x] = [x]
            else:
                comps[r].append(x)
        adj: dict[int, list] = {}
        if general:
            roots = {find(index[p.links[k].a]) for k in general}
            for k, link in enumerate(p.links):
                a, b = index[link.a], index[link.b]
                if find(a) not in roots:
                    continue
                if k in general:
                    mp = np.array([-1 if o is None else o for o in link.mapping], dtype=np.int64)
                else:
                    mp = None  # identity
                adj.setdefault(a, []).append((k, b, mp, True))
                adj.setdefault(b, []).append((k, a, mp, False))
        out = []
        for root, members in comps.items():
            if root in adj:
                out.append(self._component(root, adj))
            else:  # identity links only: every member takes the root's option ids
                out.append((members, [None] * len(members), None, None))
        return out

    def _component(self, root: int, adj: dict[int, list]) -> tuple:
        """:meth:`_link_components`' tuple for the component of ``root``, by BFS."""
        decs = self.p.decisions
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
        omaps = [None if omap[m] is base and len(decs[m].options) == n_root else omap[m] for m in members]
        return members, omaps, valid, cause

    def _link_cause(self, members: list[int], adj: dict[int, list]) -> str:
        p = self.p
        names = list(dict.fromkeys(p.links[k].name for m in members for k, _, _, forward in adj[m] if forward))
        return (
            f"links {', '.join(map(repr, names))} leave no consistent "
            f"correspondence between the options of "
            f"{', '.join(repr(p.decisions[m].name) for m in members[:4])}"
            + (f" and {len(members) - 4} more" if len(members) > 4 else "")
        )

    def _merge_edges(self, index, group_of, sel) -> None:
        decs = self.p.decisions
        edges = self.p.edges
        n_opt = [len(d.options) for d in decs]
        # Decisions of one group whose options are re-indexed the same way
        # (``sel``; None: identity) form a class: matrices of edges between the
        # same two classes can be compared and summed as they are. Class ids:
        # the group's id for identity members, then one per other re-indexing.
        cls = list(group_of)
        cls_group = list(range(len(self.groups)))
        rep = [-1] * len(cls_group)  # class -> a member (for sel and n_opt)
        sigs: dict[int, bytes] = {}
        extra: dict[tuple, int] = {}
        for i in [i for i, s in enumerate(sel) if s is not None]:
            s = sel[i]
            sig = sigs.get(id(s)) or sigs.setdefault(id(s), s.tobytes())
            c = extra.setdefault((group_of[i], sig, n_opt[i]), len(cls_group))
            if c == len(cls_group):
                cls_group.append(group_of[i])
                rep.append(i)
            cls[i] = c
        for i, c in enumerate(cls):
            if rep[c] < 0:
                rep[c] = i
        cls_of = dict(zip(index, cls))  # name -> class (index: in decision order)

        buckets: dict[tuple[int, int], list[Edge]] = {}
        for e in edges:
            sub = (cls_of[e.producer], cls_of[e.consumer])
            items = buckets.get(sub)
            if items is None:
                buckets[sub] = [e]
            else:
                items.append(e)
        # In edge order of each key's first edge, as the sums below.
        by_key: dict[tuple[int, int], list] = {}
        has_diag = False
        pairs = 0
        for (cp, cc), items in buckets.items():
            pairs += n_opt[rep[cp]] * n_opt[rep[cc]] * len(items)
            gp, gc = cls_group[cp], cls_group[cc]
            if gp == gc:
                has_diag = True
                continue
            by_key.setdefault((gp, gc) if gp < gc else (gc, gp), []).append((cp, cc, items))
        self.stats.pairs_before = pairs

        diags: dict[int, np.ndarray] = {}  # group -> summed diagonals
        for e in edges if has_diag else ():
            cp, cc = cls_of[e.producer], cls_of[e.consumer]
            g = cls_group[cp]
            if g != cls_group[cc]:
                continue
            # Both ends take corresponding options: only the diagonal is paid.
            ip, ic = rep[cp], rep[cc]
            self._check_matrix(e.costs, n_opt[ip], n_opt[ic])
            rows = sel[ip] if sel[ip] is not None else range(n_opt[ip])
            cols = sel[ic] if sel[ic] is not None else range(n_opt[ic])
            diag = np.array([e.costs[r][c] for r, c in zip(rows, cols)], dtype=float)
            diags[g] = diags[g] + diag if g in diags else diag

        for (u, v), subs in by_key.items():
            total = None
            for cp, cc, items in subs:
                ip, ic = rep[cp], rep[cc]
                n_p, n_c = n_opt[ip], n_opt[ic]
                m0 = items[0].costs
                self._check_matrix(m0, n_p, n_c)
                mats = [m0]
                n_same = 1
                for e in items[1:]:
                    # Repeated layers usually have equal matrices: count, don't
                    # add (nor check: equal to a checked matrix).
                    if e.costs is m0 or e.costs == m0:
                        n_same += 1
                    else:
                        self._check_matrix(e.costs, n_p, n_c)
                        mats.append(e.costs)
                A = _matrix(m0, n_p, n_c)
                if n_same > 1:
                    A = A * n_same
                if len(mats) > 1:
                    rest = np.fromiter(_chain(_chain(mats[1:])), float, (len(mats) - 1) * n_p * n_c)
                    A = A + rest.reshape(len(mats) - 1, n_p, n_c).sum(0)
                rows, cols = sel[ip], sel[ic]
                if rows is not None and cols is not None:
                    A = A[np.ix_(rows, cols)]
                elif rows is not None:
                    A = A[rows]
                elif cols is not None:
                    A = A[:, cols]
                if cls_group[cp] > cls_group[cc]:
                    A = A.T
                total = A if total is None else total + A
            cp, _, items = subs[0]
            self._add_edge(u, v, total, items[0].arg_index, cls_group[cp] != u)
        self.check_costs = False  # all checked
        # Only now: restricting options re-slices edges, not ``sel``.
        for g, diag in diags.items():
            self._add_unary(g, diag, "an edge between two of its linked decisions forbids it")

    def _check_matrix(self, costs: list, n_rows: int, n_cols: int) -> None:
        """With ``check_costs``: :meth:`Problem.validate`'s check of one edge
        matrix, raising its error (the first in the problem) when malformed."""
        if self.check_costs and not _matrix_ok(costs, n_rows, n_cols):
            self.p.validate()
            self.check_costs = False  # well-formed (slow path): all checked now
