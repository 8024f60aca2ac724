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
  Options whose rows (columns) of the matrix are equal are interchangeable
  for the edge: one pair variable per block of them (see
  :func:`~solver.ilp_edges.add_pairwise`).
* The objective is scaled to unit max coefficient (HiGHS' tolerances are
  absolute); the choice is re-evaluated on the problem by the caller.

Matrices are handled as numpy arrays and the constraint matrix is assembled
from whole blocks, so the Python work per option pair is a few C-level
operations.

With ``objective=False`` (feasibility checks for diagnosis) no edge costs are
encoded: an edge with forbidden pairs only says that choosing an option
requires one of its allowed partners (:func:`~solver.ilp_edges.add_support_rows`).

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

import numpy as np

from .ilp_assembler import Assembler
from .ilp_edges import add_pairwise, add_support_rows, separable
from .problem import INF, Problem

logger = logging.getLogger(__name__)

# Relative tolerance (to a matrix's largest entry) of the separability test.


def _empty(dtype=np.float64) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


@dataclass
class IlpModel:
    """An ILP in sparse row-wise (CSR) form, plus how to read a choice back.

    Columns ``[0, num_x)`` are the binary option variables, the rest are
    continuous pair variables; column ``c`` has bounds
    ``[0, col_upper[c]]``. Row ``r`` is ``row_lower[r] <= sum(value * col)
    <= row_upper[r]`` (bounds may be infinite) over
    ``row_index/row_value[row_start[r]:row_start[r + 1]]``. The true
    objective is ``objective_scale * (col_cost . x) + objective_offset``.
    """

    problem: Problem
    num_x: int = 0
    col_cost: np.ndarray = field(default_factory=_empty)
    col_upper: np.ndarray = field(default_factory=_empty)
    row_start: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    row_index: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    row_value: np.ndarray = field(default_factory=_empty)
    row_lower: np.ndarray = field(default_factory=_empty)
    row_upper: np.ndarray = field(default_factory=_empty)
    objective_scale: float = 1.0
    objective_offset: float = 0.0
    # Decoding: per decision, one column (or None: forbidden) per option;
    # fixed decisions map to their only allowed option instead.
    option_cols: dict[str, list[int | None]] = field(default_factory=dict)
    fixed: dict[str, int] = field(default_factory=dict)
    # Rows of the resource constraints (over option columns only).
    resource_rows: list[int] = field(default_factory=list)
    # Set when domain propagation alone proves the problem infeasible.
    infeasible: str | None = None
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def num_cols(self) -> int:
        return len(self.col_cost)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)

    def objective_value(self, values: Sequence[float]) -> float:
        """The true (unscaled) objective of column values."""
        x = np.asarray(values, dtype=np.float64)[: self.num_cols]
        return self.objective_scale * float(self.col_cost @ x) + self.objective_offset

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
        for c, ub in enumerate(self.col_upper.tolist()):
            binary = c < self.num_x
            cols.append(
                lp.add_variable(
                    f"{'x' if binary else 'y'}{c}",
                    0,
                    ub,
                    pulp.LpInteger if binary else pulp.LpContinuous,
                )
            )
        lp.setObjective(pulp.LpAffineExpression([(cols[c], v) for c, v in enumerate(self.col_cost.tolist()) if v]))
        EQ, LE, GE = pulp.LpConstraintEQ, pulp.LpConstraintLE, pulp.LpConstraintGE
        start = self.row_start.tolist()
        index = self.row_index.tolist()
        value = self.row_value.tolist()
        for r, (lo, hi) in enumerate(zip(self.row_lower.tolist(), self.row_upper.tolist())):
            terms = [(cols[c], v) for c, v in zip(index[start[r] : start[r + 1]], value[start[r] : start[r + 1]])]
            if lo == hi:
                bounds = [(EQ, lo)]
            else:
                bounds = [(s, v) for s, v in ((GE, lo), (LE, hi)) if math.isfinite(v)]
            for k, (sense, rhs) in enumerate(bounds):
                lp.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), sense, f"r{r}_{k}", rhs))
        return lp, cols


def _bitmasks(finite: np.ndarray) -> list[int]:
    """Per row of a boolean matrix, the int with bit ``j`` set when True."""
    n = finite.shape[1]
    if n <= 62:
        weights = np.left_shift(np.int64(1), np.arange(n, dtype=np.int64))
        return (finite.astype(np.int64) @ weights).tolist()
    packed = np.packbits(finite, axis=1, bitorder="little")
    return [int.from_bytes(row.tobytes(), "little") for row in packed]


def build(problem: Problem, *, objective: bool = True, cache: dict | None = None) -> IlpModel:
    """Build the ILP of a (validated) problem; see the module docstring.

    ``cache``: a dict kept across calls on problems sharing ``Edge``
    objects (diagnosis builds many), to convert each matrix once.
    """
    return _IlpBuilder(problem, objective, {} if cache is None else cache).build()


class _IlpBuilder:
    """The phases of :func:`build` in order, over the state they share:
    allowed options (domains), columns, unary costs and the row assembler."""

    def __init__(self, problem: Problem, objective: bool, cache: dict):
        self.problem = problem
        self.objective = objective
        self.cache = cache
        self.model = IlpModel(problem)
        self.decisions = problem.decisions
        self.index = {d.name: k for k, d in enumerate(self.decisions)}
        # how edges were encoded, for the model's stats
        self.counts = dict.fromkeys(("folded_fixed", "sep", "diag", "pair", "support", "blocks", "pairs_full"), 0)

    def build(self) -> IlpModel:
        model = self.model
        allowed = self.allowed_options()
        if allowed is None:
            return model
        self.make_columns(allowed)
        self.add_onehots()
        groups = self.group_edges()
        for (pkey, ckey), m in groups.items():
            self.encode_edge(pkey, ckey, m)
        if not self.add_resources():
            return model
        self.finish(len(groups))
        return model

    def edge_data(self, k: int) -> tuple:
        """(cost array, support masks of both ends or None if no inf)."""
        e = self.problem.edges[k]
        hit = self.cache.get(id(e))
        if hit is None or hit[0] is not e:
            a = np.asarray(e.costs, dtype=np.float64)
            finite = np.isfinite(a)
            masks = None if finite.all() else (_bitmasks(finite), _bitmasks(finite.T))
            hit = self.cache[id(e)] = (e, a, masks)
        return hit[1], hit[2]

    # ---- allowed options, propagated to a fixpoint ------------------------

    def allowed_options(self) -> list[int] | None:
        """Per decision, the bitmask of its allowed options (bit ``o`` set:
        option ``o`` allowed), propagated to a fixpoint (arc consistency);
        None, with ``model.infeasible`` saying why, when a decision has
        none left."""
        problem, decisions, index = self.problem, self.decisions, self.index
        allowed = [sum(1 << o for o, c in enumerate(d.costs) if c != INF) for d in decisions]
        for pin in problem.pins:
            k = index[pin.decision]
            allowed[k] &= sum(1 << o for o in set(pin.allowed))
        props = self._propagators()
        empty = _propagate(allowed, props, len(decisions))
        if empty:
            name = decisions[empty[0]].name
            self.model.infeasible = f"decision {name!r} has no allowed option left"
            logger.debug("build: %s", self.model.infeasible)
            return None
        return allowed

    def _propagators(self) -> list[tuple[int, int, list[int], list[int]]]:
        """Constraints that can remove options: links, and edges holding an
        inf. ``(u, v, support_u, support_v)``: ``support_u[i]`` is the mask
        of v's options compatible with u's option i, and vice versa."""
        index, decisions = self.index, self.decisions
        props: list[tuple[int, int, list[int], list[int]]] = []
        for link in self.problem.links:
            a, b = index[link.a], index[link.b]
            sup_a = [0 if j is None else 1 << j for j in link.mapping]
            sup_b = [0] * decisions[b].num_options
            for i, j in enumerate(link.mapping):
                if j is not None:
                    sup_b[j] = 1 << i
            props.append((a, b, sup_a, sup_b))
        for k, e in enumerate(self.problem.edges):
            masks = self.edge_data(k)[1]
            if masks is not None:
                props.append((index[e.producer], index[e.consumer], *masks))
        return props

    # ---- columns: one per allowed option, linked options share one -------

    def make_columns(self, allowed: list[int]) -> None:
        """Domains, fixed decisions (one allowed option) and the column of
        every other allowed option; sets up the unary costs and the
        assembler over them."""
        decisions = self.decisions
        find = self._linked_option_roots(allowed)
        self.domain = [[o for o in range(d.num_options) if allowed[k] >> o & 1] for k, d in enumerate(decisions)]
        self.fixed: list[int | None] = [dom[0] if len(dom) == 1 else None for dom in self.domain]
        col_of_root: dict[int, int] = {}
        self.option_cols: list[list[int | None]] = []
        base = 0
        for k, d in enumerate(decisions):
            cols: list[int | None] = [None] * d.num_options
            if self.fixed[k] is None:
                for o in self.domain[k]:
                    cols[o] = col_of_root.setdefault(find(base + o), len(col_of_root))
            self.option_cols.append(cols)
            base += d.num_options
        self.num_x = self.model.num_x = len(col_of_root)
        self.cost = [0.0] * self.num_x
        self.upper = [1.0] * self.num_x
        self.offset = 0.0
        self.asm = Assembler(self.num_x)

    def _linked_option_roots(self, allowed: list[int]):
        """Union-find over all options (numbered decision by decision):
        a link makes ``a``'s option ``i`` and ``b``'s ``mapping[i]`` one.
        Returns ``find``: option number -> its root."""
        index = self.index
        base = [0] * (len(self.decisions) + 1)
        for k, d in enumerate(self.decisions):
            base[k + 1] = base[k] + d.num_options
        parent = list(range(base[-1]))

        def find(u: int) -> int:
            while parent[u] != u:
                parent[u] = parent[parent[u]]
                u = parent[u]
            return u

        for link in self.problem.links:
            a, b = index[link.a], index[link.b]
            for i, j in enumerate(link.mapping):
                if allowed[a] >> i & 1:
                    ra, rb = find(base[a] + i), find(base[b] + j)
                    if ra != rb:
                        parent[max(ra, rb)] = min(ra, rb)
        return find

    # ---- one-hot rows and unary costs -------------------------------------

    def add_onehots(self) -> None:
        """One ``sum == 1`` row per distinct set of columns, unary costs on
        the columns; fixed decisions add their cost to the offset."""
        seen_onehots: set[tuple[int, ...]] = set()
        for k, d in enumerate(self.decisions):
            fixed = self.fixed[k]
            if fixed is not None:
                self.offset += d.costs[fixed]
                self.model.fixed[d.name] = fixed
                continue
            cols = self.option_cols[k]
            key = tuple(sorted(cols[o] for o in self.domain[k]))
            if key not in seen_onehots:
                seen_onehots.add(key)
                self.asm.row(key, [1.0] * len(key), 1.0, 1.0)
            if self.objective:
                dc = d.costs
                for o in self.domain[k]:
                    self.cost[cols[o]] += dc[o]

    # ---- edges --------------------------------------------------------------

    def group_edges(self) -> dict[tuple, np.ndarray]:
        """Edges over the same columns grouped: key (producer cols, consumer
        cols), both sorted, matrix permuted to match and summed. Edges with a
        fixed end are folded into unary costs instead."""
        groups: dict[tuple, np.ndarray] = {}
        index, fixed = self.index, self.fixed
        for k, e in enumerate(self.problem.edges):
            p, c = index[e.producer], index[e.consumer]
            if fixed[p] is not None or fixed[c] is not None:
                self.counts["folded_fixed"] += 1
                if self.objective:
                    self._fold_fixed_edge(e.costs, p, c)
                continue
            array, masks = self.edge_data(k)
            if not self.objective and masks is None:
                continue  # no inf anywhere: irrelevant to feasibility
            key, m = self._edge_block(array, p, c)
            acc = groups.get(key)
            groups[key] = m if acc is None else acc + m
        return groups

    def _fold_fixed_edge(self, costs, p: int, c: int) -> None:
        """An edge with a fixed end: a constant, or unary costs of the other."""
        fp, fc = self.fixed[p], self.fixed[c]
        cost, domain, option_cols = self.cost, self.domain, self.option_cols
        if fp is not None and fc is not None:
            self.offset += costs[fp][fc]
        elif fp is not None:
            row, cols = costs[fp], option_cols[c]
            for j in domain[c]:
                cost[cols[j]] += row[j]
        else:
            cols = option_cols[p]
            for i in domain[p]:
                cost[cols[i]] += costs[i][fc]

    def _edge_block(self, array: np.ndarray, p: int, c: int) -> tuple[tuple, np.ndarray]:
        """The edge's group key and its matrix over allowed options, rows and
        columns in column order, transposed when the key is."""
        domain, option_cols = self.domain, self.option_cols
        pdom = sorted(domain[p], key=option_cols[p].__getitem__)
        cdom = sorted(domain[c], key=option_cols[c].__getitem__)
        pkey = tuple(option_cols[p][i] for i in pdom)
        ckey = tuple(option_cols[c][j] for j in cdom)
        m = array  # never modified in place: shared with the cache
        if pdom != list(range(m.shape[0])):
            m = m[pdom]
        if cdom != list(range(m.shape[1])):
            m = m[:, cdom]
        if pkey <= ckey:
            return (pkey, ckey), m
        return (ckey, pkey), m.T

    def encode_edge(self, pkey: tuple, ckey: tuple, m: np.ndarray) -> None:
        """One group of edges: diagonal, separable or pairwise (see the
        module docstring); only its forbidden pairs without an objective."""
        finite = np.isfinite(m)
        has_inf = not finite.all()
        diagonal = pkey == ckey and len(set(pkey)) == len(pkey)
        if not self.objective:
            if not has_inf:
                return
            if diagonal:
                self._encode_diagonal(pkey, m)
            else:
                self.counts["support"] += add_support_rows(self.asm, pkey, ckey, finite)
            return
        if diagonal:
            # Same columns on both sides: only the diagonal can be chosen.
            self.counts["diag"] += 1
            self._encode_diagonal(pkey, m)
            return
        if not has_inf:
            sep = separable(m)
            if sep is not None:
                self.counts["sep"] += 1
                r, s = sep
                for col, v in zip(pkey, r):
                    self.cost[col] += v
                for col, v in zip(ckey, s):
                    self.cost[col] += v
                return
        self.counts["pair"] += 1
        self.counts["pairs_full"] += int(finite.sum())
        self.counts["blocks"] += add_pairwise(self.asm, pkey, ckey, m)

    def _encode_diagonal(self, key: tuple, m: np.ndarray) -> None:
        """Forbidden diagonal entries close their column; finite ones are
        unary costs (without an objective only the former)."""
        for t, v in enumerate(np.diagonal(m).tolist()):
            if v == INF:
                self.upper[key[t]] = 0.0
            elif self.objective:
                self.cost[key[t]] += v

    # ---- resources ----------------------------------------------------------

    def add_resources(self) -> bool:
        """One scaled row per bounded resource constraint; False, with
        ``model.infeasible`` saying why, when one cannot be met."""
        model, asm = self.model, self.asm
        for res in self.problem.resources:
            if res.low is None and res.high is None:
                continue
            const, terms = self._resource_terms(res)
            lo = None if res.low is None else res.low - const
            hi = None if res.high is None else res.high - const
            if not terms:
                tol = 1e-9 * max(1.0, abs(const))
                if (lo is not None and lo > tol) or (hi is not None and hi < -tol):
                    model.infeasible = f"resource constraint {res.name!r} cannot be met"
                    logger.debug("build: %s", model.infeasible)
                    return False
                continue
            scale = max(abs(w) for w in terms.values())
            cols = sorted(terms)
            model.resource_rows.append(asm.num_rows)
            asm.row(
                cols,
                [terms[col] / scale for col in cols],
                None if lo is None else lo / scale,
                None if hi is None else hi / scale,
            )
        return True

    def _resource_terms(self, res) -> tuple[float, dict[int, float]]:
        """``(constant, column -> weight)`` of a resource's sum: fixed
        decisions and options of equal weight are constants."""
        const = 0.0
        terms: dict[int, float] = {}
        for name, weights in res.terms.items():
            k = self.index[name]
            fixed = self.fixed[k]
            if fixed is not None:
                const += weights[fixed]
                continue
            ws = [weights[o] for o in self.domain[k]]
            if min(ws) == max(ws):
                const += ws[0]  # one-hot: the same weight whatever the choice
                continue
            cols = self.option_cols[k]
            for o, w in zip(self.domain[k], ws):
                if w:
                    col = cols[o]
                    terms[col] = terms.get(col, 0.0) + w
        return const, {col: w for col, w in terms.items() if w}

    # ---- objective ----------------------------------------------------------

    def finish(self, num_groups: int) -> None:
        """Lay the rows out, scale the objective, record decoding and stats."""
        model, decisions, counts = self.model, self.decisions, self.counts
        self.asm.finish(model, self.cost, self.upper)
        big = float(np.abs(model.col_cost).max()) if model.num_cols else 0.0
        if big > 0 and math.isfinite(big):
            model.objective_scale = big
            model.col_cost = model.col_cost / big
        model.objective_offset = self.offset
        model.option_cols = {d.name: self.option_cols[k] for k, d in enumerate(decisions) if self.fixed[k] is None}
        model.stats = {
            "decisions": len(decisions),
            "fixed_decisions": len(model.fixed),
            "x_columns": self.num_x,
            "pair_columns": model.num_cols - self.num_x,
            "rows": model.num_rows,
            "edges": len(self.problem.edges),
            "edges_folded_fixed": counts["folded_fixed"],
            "edge_groups": num_groups,
            "edges_separable": counts["sep"],
            "edges_diagonal": counts["diag"],
            "edges_pairwise": counts["pair"],
            # finite pairs of pairwise edges, and pair columns after merging
            # interchangeable options (equal rows or columns)
            "finite_pairs": counts["pairs_full"],
            "pair_blocks": counts["blocks"],
            "support_rows": counts["support"],
        }
        logger.debug("build: %s", model.stats)


def _propagate(allowed: list[int], props: list[tuple[int, int, list[int], list[int]]], n: int) -> list[int]:
    """Shrink the domains ``allowed`` (bitmasks, in place) until every
    propagator's options have a partner (arc consistency); returns the
    decisions left with no option (empty when none)."""
    incident: list[list[int]] = [[] for _ in range(n)]
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
    return empty
