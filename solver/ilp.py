"""The placement problem as a mixed-integer linear program.

:func:`build` turns a :class:`~solver.problem.Problem` into an
:class:`IlpModel`: a sparse, solver-neutral matrix form that backends
(:mod:`solver.backends`) hand to HiGHS directly or, through
:meth:`IlpModel.to_pulp`, to any PuLP solver.

Formulation
-----------

* One binary ``x[d][o]`` per *allowed* option of each decision, and
  ``sum_o x[d][o] == 1``. An option is allowed when its unary cost is finite,
  every pin on the decision allows it, every link maps it, and every edge
  with forbidden (``inf``) pairs leaves it a partner (propagated to a
  fixpoint, as arc consistency). Forbidden options get no variable.
  A decision left with one option is *fixed*: it gets no variable at all and
  its costs become constants or unary costs of its neighbours.
* Links are substitutions, not constraints: ``x[a][i]`` and
  ``x[b][mapping[i]]`` are the same column (union-find over options).
* Edges. Matrices are restricted to allowed options, and edges over the
  same columns (parallel edges, repeated linked layers) are summed into one.
  Then, in order of preference, all exact:

  - a *separable* matrix ``c[i][j] == r[i] + s[j]`` (zero, constant rows or
    columns, one fixed endpoint, ...) is folded into unary costs;
  - a matrix between two decisions sharing all their columns (linked and
    connected) only ever pays its diagonal, folded into unary costs;
  - otherwise the pairwise (local polytope) encoding: a continuous
    ``y[i][j]`` in [0, 1] per *finite* pair, with ``sum_j y[i][j] ==
    x[p][i]`` for every producer option and ``sum_i y[i][j] == x[c][j]`` for
    every consumer option but one (implied by the others and the one-hots).
    With binary ``x`` the marginals force ``y`` to the indicator of the
    chosen pair, so this is exact; it is also the tightest standard LP
    relaxation (integral on trees).
* Resource constraints: ``low <= sum w * x <= high`` over non-fixed
  decisions; fixed ones shift the bounds; rows are scaled to unit max weight.
* The objective is scaled to unit max coefficient (HiGHS' tolerances are
  absolute); the choice is re-evaluated on the problem by the caller.

With ``objective=False`` (feasibility checks for diagnosis) no edge costs are
encoded: edges only contribute ``x[p][i] + x[c][j] <= 1`` per forbidden pair.

Example::

    >>> from solver.problem import Decision, Edge, Problem
    >>> p = Problem(
    ...     decisions=[Decision("a", ["R", "S0"], [1.0, 0.5]),
    ...                Decision("b", ["R", "S0"], [1.0, 0.5])],
    ...     edges=[Edge("a", "b", 0, [[0.0, 1.0], [2.0, 0.0]])],
    ... )
    >>> m = build(p)
    >>> m.num_x, m.num_cols, m.num_rows
    (4, 8, 5)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Sequence

from .problem import INF, Problem

logger = logging.getLogger(__name__)

# Relative tolerance (to a matrix's largest entry) of the separability test.
SEPARABLE_RTOL = 1e-12


@dataclass
class IlpModel:
    """An ILP in sparse row-wise form, plus how to read a choice back.

    Columns ``[0, num_x)`` are the binary option variables, the rest are
    continuous pair variables; every column has bounds ``[0, col_upper]``.
    Row ``r`` is ``row_lower[r] <= sum(value * col) <= row_upper[r]`` over
    ``row_index/row_value[row_start[r]:row_start[r + 1]]`` (``None`` bounds
    are infinite). The true objective is
    ``objective_scale * (col_cost . x) + objective_offset``.
    """

    problem: Problem
    num_x: int = 0
    col_cost: list[float] = field(default_factory=list)
    col_upper: list[float] = field(default_factory=list)
    row_start: list[int] = field(default_factory=lambda: [0])
    row_index: list[int] = field(default_factory=list)
    row_value: list[float] = field(default_factory=list)
    row_lower: list[float | None] = field(default_factory=list)
    row_upper: list[float | None] = field(default_factory=list)
    objective_scale: float = 1.0
    objective_offset: float = 0.0
    # Decoding: per decision, one column (or None: forbidden) per option;
    # fixed decisions map to their only allowed option instead.
    option_cols: dict[str, list[int | None]] = field(default_factory=dict)
    fixed: dict[str, int] = field(default_factory=dict)
    # Set when domain propagation alone proves the problem infeasible.
    infeasible: str | None = None
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def num_cols(self) -> int:
        return len(self.col_cost)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)

    def add_row(
        self,
        cols: Sequence[int],
        values: Sequence[float],
        lower: float | None,
        upper: float | None,
    ) -> None:
        self.row_index.extend(cols)
        self.row_value.extend(values)
        self.row_start.append(len(self.row_index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    def objective_value(self, values: Sequence[float]) -> float:
        """The true (unscaled) objective of column values."""
        s = math.fsum(c * v for c, v in zip(self.col_cost, values) if c)
        return self.objective_scale * s + self.objective_offset

    def decode(self, values: Sequence[float]) -> dict[str, int]:
        """Choice per decision from (near-)integral column values."""
        choice: dict[str, int] = {}
        for name, cols in self.option_cols.items():
            best, best_v = -1, -1.0
            for o, c in enumerate(cols):
                if c is not None and values[c] > best_v:
                    best, best_v = o, values[c]
            choice[name] = best
        choice.update(self.fixed)
        return {d.name: choice[d.name] for d in self.problem.decisions}

    def to_pulp(self):
        """The same model as a ``pulp.LpProblem``; returns ``(lp, columns)``."""
        import pulp

        lp = pulp.LpProblem(self.problem.name or "placement", pulp.LpMinimize)
        cols = []
        for c in range(self.num_cols):
            binary = c < self.num_x
            cols.append(
                lp.add_variable(
                    f"{'x' if binary else 'y'}{c}",
                    0,
                    self.col_upper[c],
                    pulp.LpInteger if binary else pulp.LpContinuous,
                )
            )
        lp.setObjective(
            pulp.LpAffineExpression(
                [(cols[c], v) for c, v in enumerate(self.col_cost) if v]
            )
        )
        EQ, LE, GE = pulp.LpConstraintEQ, pulp.LpConstraintLE, pulp.LpConstraintGE
        for r in range(self.num_rows):
            lo, hi = self.row_lower[r], self.row_upper[r]
            a, b = self.row_start[r], self.row_start[r + 1]
            terms = [(cols[c], v) for c, v in zip(self.row_index[a:b], self.row_value[a:b])]
            bounds = (
                [(EQ, lo)]
                if lo is not None and lo == hi
                else [(s, v) for s, v in ((GE, lo), (LE, hi)) if v is not None]
            )
            for k, (sense, rhs) in enumerate(bounds):
                lp.addConstraint(
                    pulp.LpConstraint(
                        pulp.LpAffineExpression(terms), sense, f"r{r}_{k}", rhs
                    )
                )
        return lp, cols


def build(problem: Problem, *, objective: bool = True) -> IlpModel:
    """Build the ILP of a (validated) problem; see the module docstring."""
    model = IlpModel(problem)
    decisions = problem.decisions
    index = {d.name: k for k, d in enumerate(decisions)}
    n = len(decisions)

    # ---- allowed options, propagated to a fixpoint ------------------------
    # Domains are bitmasks (bit o set: option o allowed).
    allowed = [
        sum(1 << o for o, c in enumerate(d.costs) if c != INF) for d in decisions
    ]
    for pin in problem.pins:
        k = index[pin.decision]
        allowed[k] &= sum(1 << o for o in set(pin.allowed))

    # Constraints that can remove options: links, and edges holding an inf.
    # (u, v, support_u, support_v): support_u[i] is the mask of v's options
    # compatible with u's option i, and vice versa.
    props: list[tuple[int, int, list[int], list[int]]] = []
    incident: list[list[int]] = [[] for _ in range(n)]
    for link in problem.links:
        a, b = index[link.a], index[link.b]
        sup_a = [0 if j is None else 1 << j for j in link.mapping]
        sup_b = [0] * decisions[b].num_options
        for i, j in enumerate(link.mapping):
            if j is not None:
                sup_b[j] = 1 << i
        props.append((a, b, sup_a, sup_b))
    for e in problem.edges:
        costs = e.costs
        if any(INF in row for row in costs):
            p, c = index[e.producer], index[e.consumer]
            # Rows are mostly finite: only the inf entries cost any work.
            full_p, full_c = (1 << len(costs[0])) - 1, (1 << len(costs)) - 1
            sup_p = [full_p] * len(costs)
            sup_c = [full_c] * len(costs[0])
            for i, row in enumerate(costs):
                if INF in row:
                    for j, v in enumerate(row):
                        if v == INF:
                            sup_p[i] &= ~(1 << j)
                            sup_c[j] &= ~(1 << i)
            props.append((p, c, sup_p, sup_c))
    for k, (u, v, _, _) in enumerate(props):
        incident[u].append(k)
        incident[v].append(k)

    pending = list(range(len(props)))
    queued = [True] * len(props)
    empty = [k for k in range(n) if not allowed[k]]
    while pending and not empty:
        k = pending.pop()
        queued[k] = False
        u, v, sup_u, sup_v = props[k]
        au, av = allowed[u], allowed[v]
        nu = 0
        for i, s in enumerate(sup_u):
            if s & av and au >> i & 1:
                nu |= 1 << i
        nv = 0
        for j, s in enumerate(sup_v):
            if s & nu and av >> j & 1:
                nv |= 1 << j
        for d, old, new in ((u, au, nu), (v, av, nv)):
            if new != old:
                allowed[d] = new
                if not new:
                    empty.append(d)
                for k2 in incident[d]:
                    if not queued[k2]:
                        queued[k2] = True
                        pending.append(k2)
    if empty:
        name = decisions[empty[0]].name
        model.infeasible = f"decision {name!r} has no allowed option left"
        logger.debug("build: %s", model.infeasible)
        return model

    # ---- columns: one per allowed option, linked options share one -------
    base = [0] * (n + 1)
    for k, d in enumerate(decisions):
        base[k + 1] = base[k] + d.num_options
    parent = list(range(base[n]))

    def find(u: int) -> int:
        while parent[u] != u:
            parent[u] = parent[parent[u]]
            u = parent[u]
        return u

    for link in problem.links:
        a, b = index[link.a], index[link.b]
        for i, j in enumerate(link.mapping):
            if allowed[a] >> i & 1:
                ra, rb = find(base[a] + i), find(base[b] + j)
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)

    domain = [
        [o for o in range(d.num_options) if allowed[k] >> o & 1]
        for k, d in enumerate(decisions)
    ]
    fixed: list[int | None] = [dom[0] if len(dom) == 1 else None for dom in domain]
    col_of_root: dict[int, int] = {}
    option_cols: list[list[int | None]] = []
    for k, d in enumerate(decisions):
        cols: list[int | None] = [None] * d.num_options
        if fixed[k] is None:
            for o in domain[k]:
                cols[o] = col_of_root.setdefault(find(base[k] + o), len(col_of_root))
        option_cols.append(cols)
    num_x = len(col_of_root)
    model.num_x = num_x
    cost = [0.0] * num_x
    upper = [1.0] * num_x
    offset = 0.0

    # ---- one-hot rows and unary costs -------------------------------------
    seen_onehots: set[tuple[int, ...]] = set()
    for k, d in enumerate(decisions):
        if fixed[k] is not None:
            offset += d.costs[fixed[k]]
            model.fixed[d.name] = fixed[k]
            continue
        cols = option_cols[k]
        key = tuple(sorted(cols[o] for o in domain[k]))
        if key not in seen_onehots:
            seen_onehots.add(key)
            _add_summed_row(model, key, [1.0] * len(key), 1.0, 1.0)
        if objective:
            dc = d.costs
            for o in domain[k]:
                cost[cols[o]] += dc[o]

    # ---- edges --------------------------------------------------------------
    # Group edges over the same columns: key (producer cols, consumer cols),
    # both sorted, matrix permuted to match and summed.
    groups: dict[tuple, list[list[float]]] = {}
    n_folded_fixed = 0
    for e in problem.edges:
        p, c = index[e.producer], index[e.consumer]
        fp, fc = fixed[p], fixed[c]
        costs = e.costs
        if fp is not None or fc is not None:
            n_folded_fixed += 1
            if not objective:
                continue
            if fp is not None and fc is not None:
                offset += costs[fp][fc]
            elif fp is not None:
                row, cols = costs[fp], option_cols[c]
                for j in domain[c]:
                    cost[cols[j]] += row[j]
            else:
                cols = option_cols[p]
                for i in domain[p]:
                    cost[cols[i]] += costs[i][fc]
            continue
        pdom = sorted(domain[p], key=option_cols[p].__getitem__)
        cdom = sorted(domain[c], key=option_cols[c].__getitem__)
        pkey = tuple(option_cols[p][i] for i in pdom)
        ckey = tuple(option_cols[c][j] for j in cdom)
        if pkey <= ckey:
            key = (pkey, ckey)
            m = [[row[j] for j in cdom] for row in (costs[i] for i in pdom)]
        else:
            key = (ckey, pkey)
            m = [[costs[i][j] for i in pdom] for j in cdom]
        acc = groups.get(key)
        if acc is None:
            groups[key] = m
        else:
            for arow, mrow in zip(acc, m):
                for t, v in enumerate(mrow):
                    arow[t] += v

    n_sep = n_diag = n_pair = n_conflict = n_blocks = n_pairs_full = 0
    for (pkey, ckey), m in groups.items():
        has_inf = any(INF in row for row in m)
        if not objective:
            if not has_inf:
                continue
            if pkey == ckey and len(set(pkey)) == len(pkey):
                for t, col in enumerate(pkey):
                    if m[t][t] == INF:
                        upper[col] = 0.0
                continue
            for a, row in enumerate(m):
                for b, v in enumerate(row):
                    if v == INF:
                        n_conflict += 1
                        _add_summed_row(model, (pkey[a], ckey[b]), (1.0, 1.0), None, 1.0)
            continue

        if pkey == ckey and len(set(pkey)) == len(pkey):
            # Same columns on both sides: only the diagonal can be chosen.
            n_diag += 1
            for t, col in enumerate(pkey):
                if m[t][t] == INF:
                    upper[col] = 0.0
                else:
                    cost[col] += m[t][t]
            continue
        if not has_inf:
            sep = _separable(m)
            if sep is not None:
                n_sep += 1
                r, s = sep
                for col, v in zip(pkey, r):
                    cost[col] += v
                for col, v in zip(ckey, s):
                    cost[col] += v
                continue
        n_pair += 1
        n_blocks += _add_pairwise(model, pkey, ckey, m, cost)
        n_pairs_full += sum(len(row) - row.count(INF) for row in m)

    # ---- resources ----------------------------------------------------------
    for res in problem.resources:
        if res.low is None and res.high is None:
            continue
        const = 0.0
        terms: dict[int, float] = {}
        for name, weights in res.terms.items():
            k = index[name]
            if fixed[k] is not None:
                const += weights[fixed[k]]
                continue
            ws = [weights[o] for o in domain[k]]
            if min(ws) == max(ws):
                const += ws[0]  # one-hot: the same weight whatever the choice
                continue
            cols = option_cols[k]
            for o, w in zip(domain[k], ws):
                if w:
                    col = cols[o]
                    terms[col] = terms.get(col, 0.0) + w
        terms = {col: w for col, w in terms.items() if w}
        lo = None if res.low is None else res.low - const
        hi = None if res.high is None else res.high - const
        if not terms:
            tol = 1e-9 * max(1.0, abs(const))
            if (lo is not None and lo > tol) or (hi is not None and hi < -tol):
                model.infeasible = f"resource constraint {res.name!r} cannot be met"
                logger.debug("build: %s", model.infeasible)
                return model
            continue
        scale = max(abs(w) for w in terms.values())
        cols = sorted(terms)
        model.add_row(
            cols,
            [terms[col] / scale for col in cols],
            None if lo is None else lo / scale,
            None if hi is None else hi / scale,
        )

    # ---- objective ----------------------------------------------------------
    model.col_cost = cost + model.col_cost
    model.col_upper = upper + model.col_upper
    big = max((abs(v) for v in model.col_cost), default=0.0)
    if big > 0 and math.isfinite(big):
        model.objective_scale = big
        model.col_cost = [v / big for v in model.col_cost]
    model.objective_offset = offset
    model.option_cols = {
        d.name: option_cols[k] for k, d in enumerate(decisions) if fixed[k] is None
    }
    model.stats = {
        "decisions": n,
        "fixed_decisions": len(model.fixed),
        "x_columns": num_x,
        "pair_columns": model.num_cols - num_x,
        "rows": model.num_rows,
        "edges": len(problem.edges),
        "edges_folded_fixed": n_folded_fixed,
        "edge_groups": len(groups),
        "edges_separable": n_sep,
        "edges_diagonal": n_diag,
        "edges_pairwise": n_pair,
        # finite pairs of pairwise edges, and pair columns after merging
        # interchangeable options (equal rows or columns)
        "finite_pairs": n_pairs_full,
        "pair_blocks": n_blocks,
        "conflict_rows": n_conflict,
    }
    logger.debug("build: %s", model.stats)
    return model


def _add_summed_row(model, cols, values, lower, upper) -> None:
    """Add a row, merging repeated columns (aliased options)."""
    if len(set(cols)) != len(cols):
        acc: dict[int, float] = {}
        for c, v in zip(cols, values):
            acc[c] = acc.get(c, 0.0) + v
        cols, values = list(acc), list(acc.values())
    model.add_row(cols, values, lower, upper)


def _separable(m: list[list[float]]) -> tuple[list[float], list[float]] | None:
    """``(r, s)`` with ``m[i][j] == r[i] + s[j]`` if the matrix is separable."""
    first = m[0]
    r = [row[0] for row in m]
    s = [v - first[0] for v in first]
    big = max(max(map(abs, row)) for row in m)
    tol = SEPARABLE_RTOL * big
    for ri, row in zip(r, m):
        for sj, v in zip(s, row):
            if abs(v - ri - sj) > tol:
                return None
    return r, s


def _classes(vectors) -> list[list[int]]:
    """Indices grouped by equal vector, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for t, vec in enumerate(vectors):
        groups.setdefault(tuple(vec), []).append(t)
    return list(groups.values())


def _add_pairwise(model, pkey, ckey, m, cost) -> int:
    """Pair columns for finite entries, tied to both sides' one-hots.

    Options with equal rows (columns) of ``m`` are interchangeable for this
    edge: ``m`` is constant on each block (row class x column class), so one
    pair variable per block, with marginals over the classes' summed
    one-hots, is exact and has the same LP relaxation (the local polytope
    projected onto block sums). Returns the number of pair columns added.
    """
    rows = _classes(m)
    cols = _classes(zip(*m))
    # Pair columns are numbered after the x columns: they live at the end of
    # model.col_cost (which holds only pair columns until build() finishes).
    first = len(cost) + len(model.col_cost)
    pair_cost = model.col_cost
    col_members: list[list[int]] = [[] for _ in cols]
    y = first
    for members_a in rows:
        row = m[members_a[0]]
        members = []
        for b, members_b in enumerate(cols):
            v = row[members_b[0]]
            if v != INF:
                pair_cost.append(v)
                members.append(y)
                col_members[b].append(y)
                y += 1
        xs = [pkey[a] for a in members_a]
        _add_summed_row(model, members + xs, [1.0] * len(members) + [-1.0] * len(xs), 0.0, 0.0)
    model.col_upper.extend([1.0] * (y - first))
    # The last consumer marginal is implied by the others plus both one-hots.
    for b in range(len(cols) - 1):
        members = col_members[b]
        xs = [ckey[j] for j in cols[b]]
        _add_summed_row(model, members + xs, [1.0] * len(members) + [-1.0] * len(xs), 0.0, 0.0)
    return y - first
