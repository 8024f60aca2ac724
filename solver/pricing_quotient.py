"""The quotient problem that :mod:`solver.pricing` works on, over lazy matrices.

Links merge decisions into *classes* that take corresponding options (the
same union-find as :mod:`solver.presolve`'s merge, reused from there). A
class's option ids are its root decision's (the lowest-index member); an
option is *allowed* when every member has it (mapped by every link, finite
unary cost, allowed by every pin) and every edge inside the class allows its
diagonal pair. Member unary costs, resource weights and the diagonals of
edges inside the class sum into the class's; edges between two classes sum
into one :class:`QuotientEdge` (rows: the lower class index).

Edge matrices may be lazy: any object with ``shape``, ``floor`` (a lower
bound on every entry) and ``block(rows, cols) -> ndarray`` (``inf``: a
forbidden pair), and optionally ``min_plus_rows(col_values)`` /
``min_plus_cols(row_values)``: per row ``min_j C[i, j] - col_values[j]``
over ALL columns (per column, over all rows), which lets pricing charge a
left-out option its true cheapest partner instead of the edge's floor.
A matrix whose options share rows and columns by class may also offer
``reduction_classes(own_rows) -> (result classes, value classes, number
of value classes)`` and ``min_plus_classes(best, own_rows, lower=False)``
(the same reduction over classes, ``best`` the largest value per value
class; ``lower``: a lower bound of each result may do, ``inf`` exactly
where the result is): :meth:`Term.min_plus` then maps its options to those
classes directly. A
dense ``list[list[float]]`` is wrapped by :class:`DenseMatrix`. Entries are read through one :class:`BlockCache` per
matrix object (edges sharing an object share it): whole columns or rows of
the options that some subset holds, each asked for once, so the work is
(options) x (subset size) per distinct object, not per round nor per edge.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

from .diagnose import InfeasibleError
from .presolve.merge import MergePhase
from .problem import Problem, ProblemError

logger = logging.getLogger(__name__)

# Pairs read one by one (diagonals of edges inside a class, the final
# evaluation) come from square blocks of this many rows and columns when
# the matrix has no ``entries(rows, cols)`` method: fewer calls, more entries.
PAIR_CHUNK = 16


class DenseMatrix:
    """The lazy-matrix interface over a dense ``costs[i][j]`` list of lists."""

    def __init__(self, costs, n_rows: int, n_cols: int, where: str):
        try:
            arr = np.array(costs, dtype=float)
        except (TypeError, ValueError) as exc:
            raise ProblemError(f"{where}: cost matrix is not {n_rows} x {n_cols} numbers ({exc})") from None
        if arr.shape != (n_rows, n_cols):
            raise ProblemError(f"{where}: cost matrix has shape {arr.shape}, expected ({n_rows}, {n_cols})")
        if np.isnan(arr).any() or (arr == -math.inf).any():
            raise ProblemError(f"{where}: cost matrix holds NaN or -inf (costs are numbers or +inf)")
        self.array = arr
        self.shape = (n_rows, n_cols)
        finite = arr[np.isfinite(arr)]
        self.floor = float(finite.min()) if finite.size else 0.0

    def block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        return self.array[np.ix_(rows, cols)]

    def entries(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        return self.array[rows, cols]

    def min_plus_rows(self, col_values: np.ndarray) -> np.ndarray:
        return _min_plus(self.array, col_values)

    def min_plus_cols(self, row_values: np.ndarray) -> np.ndarray:
        return _min_plus(self.array.T, row_values)


# Rows per chunk of a dense min-plus reduction (bounds the temporary).
MIN_PLUS_CHUNK = 1024


def _min_plus(array: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``min_j (array[i, j] - values[j])`` per row i; ``values`` may hold
    -inf (that column is left out: inf - (-inf) = inf), never +inf."""
    out = np.empty(array.shape[0])
    if not array.shape[1]:
        out.fill(math.inf)
        return out
    for s in range(0, array.shape[0], MIN_PLUS_CHUNK):
        out[s : s + MIN_PLUS_CHUNK] = (array[s : s + MIN_PLUS_CHUNK] - values[None, :]).min(axis=1)
    return out


class BlockCache:
    """Entries of one (lazy) matrix object, read as whole columns and rows."""

    def __init__(self, matrix):
        self.matrix = matrix
        self.shape = tuple(int(n) for n in matrix.shape)
        self.floor = float(matrix.floor)
        self._cols: dict[int, np.ndarray] = {}  # column id -> all rows
        self._rows: dict[int, np.ndarray] = {}  # row id -> all columns
        self.entries_read = 0
        # whole-row min-plus reductions available (pricing and tree bounds use them)
        self.matrix_reduces = hasattr(matrix, "min_plus_rows") and hasattr(matrix, "min_plus_cols")

    def _block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        out = np.asarray(self.matrix.block(rows, cols), dtype=float)
        if out.shape != (len(rows), len(cols)):
            raise ProblemError(
                f"lazy matrix {type(self.matrix).__name__}.block returned shape {out.shape} "
                f"for {len(rows)} rows x {len(cols)} columns"
            )
        self.entries_read += out.size
        return out

    def cols(self, ids: np.ndarray) -> np.ndarray:
        """``matrix[:, ids]`` (all rows)."""
        missing = sorted({int(i) for i in ids} - self._cols.keys())
        if missing:
            b = self._block(np.arange(self.shape[0]), np.array(missing, dtype=np.int64))
            for k, j in enumerate(missing):
                self._cols[j] = np.ascontiguousarray(b[:, k])
        if not len(ids):
            return np.empty((self.shape[0], 0))
        return np.stack([self._cols[int(j)] for j in ids], axis=1)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """``matrix[ids, :]`` (all columns)."""
        missing = sorted({int(i) for i in ids} - self._rows.keys())
        if missing:
            b = self._block(np.array(missing, dtype=np.int64), np.arange(self.shape[1]))
            for k, i in enumerate(missing):
                self._rows[i] = np.ascontiguousarray(b[k])
        if not len(ids):
            return np.empty((0, self.shape[1]))
        return np.stack([self._rows[int(i)] for i in ids], axis=0)

    def pairs(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """``matrix[rows[k], cols[k]]`` for each k: from cached columns or
        rows where there are, else ``entries`` or small square blocks."""
        out = np.empty(len(rows))
        pending = []
        for k, (i, j) in enumerate(zip(rows.tolist(), cols.tolist())):
            if j in self._cols:
                out[k] = self._cols[j][i]
            elif i in self._rows:
                out[k] = self._rows[i][j]
            else:
                pending.append(k)
        if pending:
            pend = np.array(pending, dtype=np.int64)
            r, c = rows[pend], cols[pend]
            if hasattr(self.matrix, "entries"):
                out[pend] = np.asarray(self.matrix.entries(r, c), dtype=float)
                self.entries_read += len(pend)
            else:
                for s in range(0, len(pend), PAIR_CHUNK):
                    out[pend[s : s + PAIR_CHUNK]] = np.diagonal(
                        self._block(r[s : s + PAIR_CHUNK], c[s : s + PAIR_CHUNK])
                    )
        return out


@dataclass
class Term:
    """One matrix object's share of a quotient edge: ``count`` member edges
    with the same object and option maps. ``rmap``/``cmap`` give the object
    ids of the quotient edge's row/column class options (root option ids);
    ``transposed``: the object's rows are the quotient edge's columns."""

    cache: BlockCache
    rmap: np.ndarray
    cmap: np.ndarray
    transposed: bool
    count: int = 1

    def __post_init__(self):
        # identity maps (the common case) need no re-indexing copy
        n_rows, n_cols = self.cache.shape
        if self.transposed:
            n_rows, n_cols = n_cols, n_rows
        self._r = None if _is_identity(self.rmap, n_rows) else self.rmap
        self._c = None if _is_identity(self.cmap, n_cols) else self.cmap
        self._reductions: dict[bool, tuple] = {}  # own_rows -> class maps (matrices reducing by class)

    def cols(self, J: np.ndarray) -> np.ndarray:
        if self.transposed:
            out = self.cache.rows(self.cmap[J])
            return (out if self._r is None else out[:, self._r]).T
        out = self.cache.cols(self.cmap[J])
        return out if self._r is None else out[self._r]

    def rows(self, I: np.ndarray) -> np.ndarray:
        if self.transposed:
            out = self.cache.cols(self.rmap[I])
            return (out if self._c is None else out[self._c]).T
        out = self.cache.rows(self.rmap[I])
        return out if self._c is None else out[:, self._c]

    def min_plus(self, values: np.ndarray, along_rows: bool, lower: bool = False) -> np.ndarray | None:
        """``count * C(i, j) - values[j]`` minimised over every column j,
        per row option i (``along_rows``; else the transpose: per column j,
        over every row i), over the WHOLE matrix; None when the matrix
        object has no ``min_plus_rows`` / ``min_plus_cols``. ``lower``: a
        lower bound of each result may do (``inf`` exactly where the result
        is), which matrices reducing by class compute in lower precision.

        ``values`` is over the quotient side's options, -inf for those to
        leave out. Options mapped to one object id take the largest value
        (the smallest difference)."""
        own_rows = along_rows != self.transposed  # the object's rows are the result's side
        matrix = self.cache.matrix
        result_map, value_map = (self.rmap, self.cmap) if along_rows else (self.cmap, self.rmap)
        if hasattr(matrix, "reduction_classes"):
            # straight from our options to the matrix's classes: one
            # scatter-max and one gather a call (the dual ascent's sweeps
            # make thousands of these calls)
            maps = self._reductions.get(own_rows)
            if maps is None:
                result_class, value_class, n_classes = matrix.reduction_classes(own_rows)
                maps = self._reductions[own_rows] = (result_class[result_map], value_class[value_map], n_classes)
            result_class, value_class, n_classes = maps
            best = np.full(n_classes, -math.inf)
            values = np.asarray(values, dtype=float)
            np.maximum.at(best, value_class, values if self.count == 1 else values / self.count)
            reduced = matrix.min_plus_classes(best, own_rows, lower=lower)
            out = np.asarray(reduced, dtype=float)[result_class]
            return out if self.count == 1 else self.count * out
        method = getattr(matrix, "min_plus_rows" if own_rows else "min_plus_cols", None)
        if method is None:
            return None
        n_values = self.cache.shape[1] if own_rows else self.cache.shape[0]
        per_object = np.full(n_values, -math.inf)
        np.maximum.at(per_object, value_map, np.asarray(values, dtype=float) / self.count)
        out = np.asarray(method(per_object), dtype=float)
        return self.count * out[result_map]


def _is_identity(ids: np.ndarray, n: int) -> bool:
    """``ids`` is 0..n-1 (re-indexing by it would only copy)."""
    return len(ids) == n and bool((ids == np.arange(n)).all())


@dataclass
class QuotientEdge:
    """Sum of the member edges between classes ``p`` (rows) and ``c``."""

    p: int
    c: int
    terms: list[Term]
    floor: float = 0.0
    names: list[str] = field(default_factory=list)  # member edges, for messages
    _cols: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _rows: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def cols(self, J: np.ndarray) -> np.ndarray:
        """(all row-class options) x ``J``, summed over the terms; cached
        here unless one term alone (its matrix's cache holds it then)."""
        if len(self.terms) == 1 and self.terms[0].count == 1:
            return self.terms[0].cols(J)
        missing = np.array(sorted({int(j) for j in J} - self._cols.keys()), dtype=np.int64)
        if len(missing):
            total = sum(t.count * t.cols(missing) if t.count != 1 else t.cols(missing) for t in self.terms)
            for k, j in enumerate(missing.tolist()):
                self._cols[j] = np.ascontiguousarray(total[:, k])
        n_p = len(self.terms[0].rmap)
        if not len(J):
            return np.empty((n_p, 0))
        return np.stack([self._cols[int(j)] for j in J], axis=1)

    def rows(self, I: np.ndarray) -> np.ndarray:
        """``I`` x (all column-class options), summed over the terms; cached
        here unless one term alone."""
        if len(self.terms) == 1 and self.terms[0].count == 1:
            return self.terms[0].rows(I)
        missing = np.array(sorted({int(i) for i in I} - self._rows.keys()), dtype=np.int64)
        if len(missing):
            total = sum(t.count * t.rows(missing) if t.count != 1 else t.rows(missing) for t in self.terms)
            for k, i in enumerate(missing.tolist()):
                self._rows[i] = np.ascontiguousarray(total[k])
        n_c = len(self.terms[0].cmap)
        if not len(I):
            return np.empty((0, n_c))
        return np.stack([self._rows[int(i)] for i in I], axis=0)

    def block(self, I: np.ndarray, J: np.ndarray) -> np.ndarray:
        """``I`` x ``J`` (from the cached columns ``J``)."""
        return self.cols(J)[I]

    def min_plus(self, values: np.ndarray, along_rows: bool) -> np.ndarray | None:
        """A lower bound on ``min_j C_E(i, j) - values[j]`` per row option i
        (``along_rows``; else per column option j, over rows i), over every
        option of the other end; exact for an edge of one term. Terms of
        several matrix objects each take a share of ``values`` (by count):
        the sum of their minima is at most the minimum of their sum. None
        when some term's matrix cannot reduce whole rows (see
        :meth:`Term.min_plus`)."""
        total = sum(t.count for t in self.terms)
        out = 0.0
        for t in self.terms:
            part = t.min_plus(values * (t.count / total), along_rows)
            if part is None:
                return None
            out = out + part
        return out


@dataclass
class OptionClass:
    """Decisions merged by links; option ids are the root decision's."""

    name: str  # root decision's name
    members: list[tuple[str, np.ndarray | None]]  # (decision, root option -> its option; None: same ids)
    allowed: np.ndarray  # bool per root option
    unary: np.ndarray  # summed unary costs (+ diagonals); inf where not allowed
    labels: list[str]

    @property
    def num_options(self) -> int:
        return len(self.allowed)


@dataclass
class ClassResource:
    name: str
    low: float | None
    high: float | None
    weights: dict[int, np.ndarray]  # class -> weight per root option


@dataclass
class Quotient:
    classes: list[OptionClass]
    edges: list[QuotientEdge]
    resources: list[ClassResource]
    caches: dict[int, BlockCache]  # id(matrix object) -> its cache
    edge_caches: list[BlockCache]  # per edge of the problem, its matrix's cache

    def entries_read(self) -> int:
        return sum(c.entries_read for c in self.caches.values())

    def expand(self, choice: dict[int, int]) -> dict[str, int]:
        """Per original decision, its option for class choices (root ids)."""
        out: dict[str, int] = {}
        for q, o in choice.items():
            for name, omap in self.classes[q].members:
                out[name] = int(o if omap is None else omap[o])
        return out


class _Links(MergePhase):
    """Presolve's link union-find (:meth:`MergePhase._link_components`),
    without the rest of presolve."""

    def __init__(self, problem: Problem):
        self.p = problem


def is_lazy(costs) -> bool:
    return hasattr(costs, "block") and hasattr(costs, "shape")


def build_quotient(problem: Problem) -> Quotient:
    """The quotient of ``problem`` by its links (see the module docstring).

    Raises :class:`~solver.problem.ProblemError` when the problem is
    malformed and :class:`InfeasibleError` when a class has no allowed option.
    """
    problem._validate(edge_costs=False)  # names, pins, links, resources
    b = _QuotientBuilder(problem)
    b.make_classes()
    resources = b.class_resources()
    grouped, diagonals = b.group_edges()
    b.fold_diagonals(diagonals)
    b.check_allowed()
    edges = []
    for (p, c), terms in grouped.items():
        ts = list(terms.values())
        edges.append(QuotientEdge(p, c, ts, sum(t.count * t.cache.floor for t in ts), b.edge_names[(p, c)]))
    logger.debug(
        "quotient: %d decisions -> %d classes, %d edges -> %d, %d matrix objects",
        len(b.decs),
        len(b.classes),
        len(problem.edges),
        len(edges),
        len(b.caches),
    )
    return Quotient(b.classes, edges, resources, b.caches, b.edge_caches)


class _QuotientBuilder:
    """The steps of :func:`build_quotient` over what they share: per
    decision its class and option map, the classes, and the arrays and
    matrix caches (shared cost lists and matrices read once)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.decs = problem.decisions
        self.index = {d.name: i for i, d in enumerate(self.decs)}
        self.arrays: dict[int, np.ndarray] = {}  # id(list) -> array (shared cost lists read once)
        self.class_of = [-1] * len(self.decs)
        self.member_map: list[np.ndarray | None] = [None] * len(self.decs)
        self.classes: list[OptionClass] = []
        self.why: list[str] = []  # per class, why an option may be forbidden
        self.caches: dict[int, BlockCache] = {}  # id(matrix) -> its cache
        self.edge_caches: list[BlockCache] = []  # per edge of the problem
        self.edge_names: dict[tuple[int, int], list[str]] = {}

    def as_array(self, values: list) -> np.ndarray:
        a = self.arrays.get(id(values))
        if a is None:
            a = self.arrays[id(values)] = np.fromiter(values, float, len(values))
        return a

    def ids(self, m: int) -> np.ndarray:
        """Decision ``m``'s option id per option of its class."""
        s = self.member_map[m]
        return np.arange(len(self.decs[m].options)) if s is None else s

    def make_classes(self) -> None:
        """One class per linked group (or unlinked decision): its allowed
        options (valid across links, pins, finite summed unary cost)."""
        decs, index = self.decs, self.index
        comps = _Links(self.problem)._link_components(index)
        in_comp = {i for comp in comps for i in comp[0]}
        plan = [([i], [None], None, None) for i in range(len(decs)) if i not in in_comp]
        plan += comps
        plan.sort(key=lambda t: t[0][0])
        pins_on: dict[int, list] = {}
        for pin in self.problem.pins:
            pins_on.setdefault(index[pin.decision], []).append(pin)
        for q, (members, omaps, valid, cause) in enumerate(plan):
            root = decs[members[0]]
            n = len(root.options)
            allowed = np.ones(n, dtype=bool) if valid is None else np.asarray(valid, dtype=bool).copy()
            reason = cause or "every option has an infinite unary cost"
            unary = np.zeros(n)
            for m, omap in zip(members, omaps):
                self.class_of[m] = q
                sel = None if omap is None else np.where(omap >= 0, omap, 0)
                self.member_map[m] = sel
                c = self.as_array(decs[m].costs)
                unary = unary + (c if sel is None else c[sel])
                for pin in pins_on.get(m, ()):
                    ids = np.arange(n) if sel is None else sel
                    allowed &= np.isin(ids, pin.allowed)
                    reason = f"pin {pin.name!r} on {decs[m].name!r} allows {sorted(pin.allowed)}"
            allowed &= np.isfinite(unary)
            unary[~allowed] = math.inf
            members_maps = [(decs[m].name, self.member_map[m]) for m in members]
            self.classes.append(OptionClass(root.name, members_maps, allowed, unary, list(root.options)))
            self.why.append(reason)

    def class_resources(self) -> list[ClassResource]:
        """Resource weights per class option, summed over its members."""
        resources = []
        for rc in self.problem.resources:
            weights: dict[int, np.ndarray] = {}
            for name, w in rc.terms.items():
                m = self.index[name]
                q = self.class_of[m]
                arr = self.as_array(w)[self.ids(m)]
                weights[q] = weights[q] + arr if q in weights else arr
            resources.append(ClassResource(rc.name, rc.low, rc.high, weights))
        return resources

    def group_edges(self) -> tuple[dict[tuple[int, int], dict[tuple, Term]], list[tuple]]:
        """Edges between two classes grouped by (row class, column class),
        equal terms counted once; edges inside a class returned apart
        (``(class, cache, a, b, where)``) to fold into its unary costs."""
        decs, index = self.decs, self.index
        dense: dict[int, DenseMatrix] = {}
        diagonals: list[tuple[int, BlockCache, int, int, str]] = []
        grouped: dict[tuple[int, int], dict[tuple, Term]] = {}
        for k, e in enumerate(self.problem.edges):
            a, b = index[e.producer], index[e.consumer]
            where = f"edge #{k} ({e.producer!r} -> {e.consumer!r})"
            shape = (len(decs[a].options), len(decs[b].options))
            matrix = e.costs
            if not is_lazy(matrix):
                matrix = dense.get(id(e.costs))
                if matrix is None or matrix.shape != shape:
                    matrix = dense[id(e.costs)] = DenseMatrix(e.costs, *shape, where)
            elif tuple(matrix.shape) != shape:
                raise ProblemError(f"{where}: lazy matrix has shape {tuple(matrix.shape)}, expected {shape}")
            cache = self.caches.get(id(matrix))
            if cache is None:
                cache = self.caches[id(matrix)] = BlockCache(matrix)
            self.edge_caches.append(cache)
            qa, qb = self.class_of[a], self.class_of[b]
            if qa == qb:
                diagonals.append((qa, cache, a, b, where))
                continue
            transposed = qa > qb
            key = (qb, qa) if transposed else (qa, qb)
            rm, cm = (b, a) if transposed else (a, b)
            sig = (id(cache), id(self.member_map[rm]), id(self.member_map[cm]), transposed)
            terms = grouped.setdefault(key, {})
            self.edge_names.setdefault(key, []).append(f"{e.producer} -> {e.consumer}")
            if sig in terms:
                terms[sig].count += 1
            else:
                terms[sig] = Term(cache, self.ids(rm), self.ids(cm), transposed)
        return grouped, diagonals

    def fold_diagonals(self, diagonals: list[tuple]) -> None:
        """An edge inside a linked group only ever pays its diagonal: a
        unary cost of the class (an infinite one forbids the option)."""
        for q, cache, a, b, where in diagonals:
            cls = self.classes[q]
            opts = np.flatnonzero(cls.allowed)
            diag = cache.pairs(self.ids(a)[opts], self.ids(b)[opts])
            cls.unary[opts] += diag
            bad = ~np.isfinite(cls.unary)
            if bad[opts].any():
                self.why[q] = f"{where}, inside the linked group, forbids its diagonal pairs"
            cls.allowed &= ~bad
            cls.unary[bad] = math.inf

    def check_allowed(self) -> None:
        """Raise :class:`InfeasibleError` naming every class without an
        allowed option, and why."""
        classes = self.classes
        empty = [q for q, c in enumerate(classes) if not c.allowed.any()]
        if empty:
            names = [classes[q].name for q in empty]
            raise InfeasibleError(
                "Infeasible: no allowed option left for "
                + "; ".join(f"{classes[q].name!r} ({self.why[q]})" for q in empty),
                decisions=names,
            )


def evaluate_lazy(problem: Problem, quotient: Quotient, choice: dict[str, int]) -> tuple[float, float]:
    """``(unary_cost, edge_cost)`` of a full choice, like
    :func:`solver.evaluate.evaluate`, reading the edge matrices through the
    quotient's caches (one request per matrix object)."""
    unary = math.fsum(d.costs[choice[d.name]] for d in problem.decisions)
    wanted: dict[int, tuple[BlockCache, list, list]] = {}
    for e, cache in zip(problem.edges, quotient.edge_caches):
        entry = wanted.setdefault(id(cache), (cache, [], []))
        entry[1].append(choice[e.producer])
        entry[2].append(choice[e.consumer])
    values = []
    for cache, rows, cols in wanted.values():
        values.extend(cache.pairs(np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64)).tolist())
    return unary, math.fsum(values)
