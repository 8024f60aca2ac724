"""Edge cost matrices of the planning problem: producer option x consumer
option, dense (lists of rows, each computed once per distinct block) or lazy.

Dense matrices hold every pair; on a 4-D mesh one layer's pointwise edges
alone hold ~100M pairs (LLaMA-3 70B, 4x4x8x8), more than any machine should
build. Lazy matrices (``lazy=True``) compute only the blocks the option
pricing solver (:func:`solver.pricing.solve_by_pricing`) asks for: its
options in play against every option of the other end. They implement the
solver's lazy-matrix interface: ``shape``, ``floor`` (a lower bound on every
entry: costs are times, >= 0) and ``block(rows, cols)`` (a float64 array,
``inf`` for a forbidden pair). Entries equal the dense matrices' exactly
(tests/autoparallel/cost_model/test_class_costs.py).

Both kinds also reduce over the whole matrix (optional in the solver's lazy
interface: a matrix without them is read block by block), exactly, over
every row and column option:

* ``min_plus_rows(col_values)``: shape (rows,), ``out[i] = min_j (C[i, j] -
  col_values[j])``;
* ``min_plus_cols(row_values)``: shape (cols,), ``out[j] = min_i (C[i, j] -
  row_values[i])``;

entries ``C = inf`` are skipped, so a row (column) of forbidden pairs gives
``inf``; values are finite. :class:`LazyClassMatrix` reduces per class:
the largest value of each column (row) class, a min over the class grid,
mapped back to options; :class:`LazyKeyMatch` per key, its rows with their
own cost function over their full rows.

Class grids are computed whole, with numpy (:mod:`autoparallel.cost_model.class_costs`,
~0.1-0.5 us an entry against ~10 us pair by pair on a 4-D mesh); lazy
grids of one tensor as blocks of one grid over their placements' union
(:class:`_GridFamily`: 10.6M entries instead of 18.0M on LLaMA-3 70B
4x4x8x8), and reduced in float32 for the dual ascent's first sweeps
(:meth:`LazyClassMatrix.min_plus_classes`).
"""

from __future__ import annotations

import math

import numpy as np

from .. import cost_model
from ..cost_model.class_costs import class_cost_grid
from ..options.strategies import Option, placements_of


class EdgeMatrices:
    """Edge cost matrices, each computed once per distinct block (dense),
    or lazy objects computing the blocks asked for (``lazy=True``).

    * Per (producer option list, consumer option list, argument, overlap
      kind), by identity: repeated layers share option lists, so every
      repeat of an edge gets the same matrix object, which the solver then
      reads once (it memoises matrices by id in validation and presolve).
    * Per (distinct source placements, distinct target placements, tensor
      shape and dtype, overlap kind), by value: the option grid repeats
      placements (options differ in their other inputs), and many edges of
      a layer carry tensors of one shape (q/k/v, gate/up, residuals).
    """

    def __init__(self, device, overlap, lazy: bool = False):
        self.device = device
        self.overlap = overlap
        self.lazy = lazy
        self._grids: dict = {}  # class key -> _ClassGrid (lazy)
        self._families: dict = {}  # (mesh, metas, kind, keep_partial) -> _GridFamily (lazy)
        self._sides: dict = {}  # (id(option list), arg) -> distinct specs
        self._placement_ids: dict = {}  # distinct placements -> small int
        self._matrices: dict = {}
        self._classes: dict = {}

    def _side(self, options: list[Option], arg: int | None):
        """Distinct specs (by placements) of the options' output (``arg``
        None) or input ``arg``, each option's index among them, and an id
        of those placements: once per option list (edges share lists)."""
        key = (id(options), arg)
        hit = self._sides.get(key)
        if hit is None:
            specs, classes = _spec_classes([o.output_spec if arg is None else o.input_specs[arg] for o in options])
            placements = tuple((s.placements, s.shard_order) for s in specs)
            ident = self._placement_ids.setdefault(placements, len(self._placement_ids))
            hit = self._sides[key] = (specs, classes, ident, options)  # options: keep the id theirs
        return hit[:3]

    def _class_specs(self, prod: list[Option], cons: list[Option], arg: int, kind, keep_partial: bool, copies=1.0):
        """Distinct producer outputs and consumer inputs ``arg`` (by
        placements), each option's index among them, and the key of the
        costs between them (placements, shapes, dtype, overlap kind)."""
        src_specs, row_class, src_id = self._side(prod, None)
        dst_specs, col_class, dst_id = self._side(cons, arg)
        src_meta, dst_meta = src_specs[0].tensor_meta, dst_specs[0].tensor_meta
        class_key = (
            src_id,
            dst_id,
            tuple(src_meta.shape),
            src_meta.dtype,
            tuple(dst_meta.shape),
            kind,
            keep_partial,
            copies,
        )
        return src_specs, row_class, dst_specs, col_class, class_key

    def classes(
        self,
        prod: list[Option],
        cons: list[Option],
        arg: int,
        kind: str | None,
        keep_partial: bool = False,
        copies: float = 1.0,
    ):
        """The redistribution costs between distinct placements: rows (lists)
        over (distinct producer outputs) x (distinct consumer inputs ``arg``),
        and each producer / consumer option's row / column index in it."""
        src_specs, row_class, dst_specs, col_class, class_key = self._class_specs(
            prod, cons, arg, kind, keep_partial, copies
        )
        class_rows = self._classes.get(class_key)
        if class_rows is None:
            # as lists: dense rows then share these float objects (one per
            # class pair, not one per option pair)
            class_rows = self._classes[class_key] = self._class_matrix(
                src_specs, dst_specs, kind, keep_partial, copies
            ).tolist()
        return class_rows, row_class, col_class

    def drop_pair_cache(self) -> None:
        """Drop the class grids dense matrices were read from (kept per class
        key while building: edges of one tensor shape share them); lazy
        matrices keep theirs in their own :class:`_ClassGrid`."""
        self._classes = {}

    def _class_matrix(self, src_specs, dst_specs, kind, keep_partial, copies=1.0) -> np.ndarray:
        """:func:`cost_model.edge_time` of every (source, target) spec
        (``inf`` where ``keep_partial`` forbids reducing a Partial), computed
        whole with numpy (:func:`class_costs.class_cost_grid`, bit-identical)."""
        device = cost_model.copies_device(self.device, copies)
        return class_cost_grid(src_specs, dst_specs, device, self.overlap, kind, keep_partial)

    def _family_member(self, src_specs, dst_specs, kind, keep_partial, copies=1.0):
        """The function computing one lazy class grid: from its tensor's
        :class:`_GridFamily` (grids of one tensor share most placements),
        or on its own when its specs do not share one meta."""
        src_meta, dst_meta = src_specs[0].tensor_meta, dst_specs[0].tensor_meta
        if any(s.tensor_meta != src_meta for s in src_specs) or any(d.tensor_meta != dst_meta for d in dst_specs):
            return lambda: self._class_matrix(src_specs, dst_specs, kind, keep_partial, copies)
        key = (src_specs[0].mesh, src_meta, dst_meta, kind, keep_partial, copies)
        family = self._families.get(key)
        if family is None:
            family = self._families[key] = _GridFamily(
                lambda src, dst: self._class_matrix(src, dst, kind, keep_partial, copies)
            )
        return family.member(src_specs, dst_specs)

    def redistribution(
        self,
        prod: list[Option],
        cons: list[Option],
        arg: int,
        kind: str | None,
        keep_partial: bool = False,
        copies: float = 1.0,
    ):
        """Producer option x consumer option: time to bring the producer's
        output to what the consumer's option needs for argument ``arg``
        (``keep_partial``: reducing a Partial mesh dim is forbidden;
        ``copies``: the share of its local copies counted,
        :func:`autoparallel.cost_model.copies_device`)."""
        key = (id(prod), id(cons), arg, kind, keep_partial, copies)
        hit = self._matrices.get(key)
        if hit is not None:
            return hit[0]
        if self.lazy:
            src_specs, row_class, dst_specs, col_class, class_key = self._class_specs(
                prod, cons, arg, kind, keep_partial, copies
            )
            grid = self._grids.get(class_key)
            if grid is None:
                grid = self._grids[class_key] = _ClassGrid(
                    self._family_member(src_specs, dst_specs, kind, keep_partial, copies),
                    len(src_specs),
                    len(dst_specs),
                )
            matrix = LazyClassMatrix(grid, row_class, col_class)
            self._matrices[key] = (matrix, prod, cons)
            return matrix
        class_rows, row_class, col_class = self.classes(prod, cons, arg, kind, keep_partial, copies)
        # Options with the same output placements get the same row object.
        rows_by_class: dict[int, list[float]] = {}
        rows = []
        for r in row_class:
            row = rows_by_class.get(r)
            if row is None:
                costs = class_rows[r]
                row = rows_by_class[r] = [costs[c] for c in col_class]
            rows.append(row)
        # keep prod/cons alive so their ids stay unique while cached
        self._matrices[key] = (rows, prod, cons)
        return rows

    def _structural(self, key, make, a: list[Option], b: list[Option]):
        """The matrix ``make()`` (a :class:`LazyKeyMatch`) under ``key``:
        lazy as it is, dense as its rows (one implementation per kind)."""
        hit = self._matrices.get(key)
        if hit is None:
            matrix = make()
            if not self.lazy:
                matrix = matrix.block(np.arange(matrix.shape[0]), np.arange(matrix.shape[1])).tolist()
            hit = self._matrices[key] = (matrix, a, b)  # a, b: keep their ids theirs
        return hit[0]

    def gradient(self, param: list[Option], grad: list[Option], kind: str):
        """Parameter option x gradient option: 0 where the gradient already
        has the parameter's placements; for a tp-outer parameter, the time
        to bring the gradient to it (a reduce-scatter of kind ``kind``,
        priced per distinct gradient placements: a tp-outer pair goes through
        DTensor's planner, ~100 us); inf otherwise."""

        def make() -> LazyKeyMatch:
            grad_specs, grad_class = _spec_classes([go.output_spec for go in grad])
            keys: dict = {}
            col_keys = [keys.setdefault(gs.placements, len(keys)) for gs in grad_specs]
            row_keys, special = [], {}
            for i, po in enumerate(param):
                ps = po.output_spec
                row_keys.append(keys.setdefault(ps.placements, len(keys)))
                if cost_model.is_tp_outer(ps.placements, tuple(ps.mesh.shape)):
                    special[i] = ps
            classes = np.asarray(grad_class, dtype=np.int64)

            def row_costs(i: int) -> np.ndarray:
                ps = special[i]
                by_class = [
                    0.0
                    if gs.placements == ps.placements
                    else cost_model.edge_time(gs, ps, self.device, self.overlap, kind)
                    for gs in grad_specs
                ]
                return np.asarray(by_class, dtype=np.float64)[classes]

            return LazyKeyMatch(row_keys, [col_keys[c] for c in grad_class], {i: row_costs for i in special})

        return self._structural(("gradient", id(param), id(grad), kind), make, param, grad)

    def getitem(self, parent: list[Option], item: list[Option], idx: int):
        """0 where the parent option's ``idx``-th output is the item's option, else inf."""

        def make() -> LazyKeyMatch:
            keys: dict = {}
            return LazyKeyMatch(
                [keys.setdefault(po.output_specs[idx], len(keys)) for po in parent],
                [keys.setdefault(co.output_specs, len(keys)) for co in item],
            )

        return self._structural(("getitem", id(parent), id(item), idx), make, parent, item)

    def equal_placements(self, a: list[Option], b: list[Option]):
        """0 where both options' outputs have the same placements, else inf."""

        def make() -> LazyKeyMatch:
            keys: dict = {}
            return LazyKeyMatch(
                [keys.setdefault(placements_of(x.output_specs), len(keys)) for x in a],
                [keys.setdefault(placements_of(y.output_specs), len(keys)) for y in b],
            )

        return self._structural(("equal", id(a), id(b)), make, a, b)


def gradient_partners(param: list[Option], grad: list[Option]) -> list[bool]:
    """Per parameter option: whether some gradient option pairs with it at a
    finite cost in :meth:`EdgeMatrices.gradient` (the gradient already laid
    out as the parameter, or a tp-outer parameter it is reduce-scattered
    to). A parameter whose gradient only comes ``Replicate`` or ``Partial``
    (a norm's weight: its backward reduces over the batch) cannot be
    sharded except tp-outer, whatever its own options say."""
    held = {go.output_spec.placements for go in grad}
    return [
        po.output_spec.placements in held
        or cost_model.is_tp_outer(po.output_spec.placements, tuple(po.output_spec.mesh.shape))
        for po in param
    ]


def _spec_classes(specs: list) -> tuple[list, list[int]]:
    """Distinct specs (by placements) and, per input spec, its class index."""
    index: dict = {}
    # id(spec) -> class: options repeat a few pooled spec objects, and
    # hashing placements runs Python per placement
    by_id: dict[int, int] = {}
    distinct: list = []
    classes: list[int] = []
    for spec in specs:
        cls = by_id.get(id(spec))
        if cls is None:
            cls = by_id[id(spec)] = index.setdefault(spec.placements, len(index))
            if cls == len(distinct):
                distinct.append(spec)
        classes.append(cls)
    return distinct, classes


class _ClassGrid:
    """Costs between the distinct source and target specs of one tensor,
    computed whole on first use (numpy, ~0.1 us an entry: pricing asks each
    option in play against all others, and exact pricing every option
    against every partner) and kept."""

    _single: tuple[np.ndarray, float] | None = None  # float32 copy, largest finite |cost|

    def __init__(self, compute, sources: int, targets: int):
        self._compute = compute  # () -> (sources, targets) float64 array
        self.shape = (sources, targets)
        self._costs: np.ndarray | None = None

    @property
    def costs(self) -> np.ndarray:
        if self._costs is None:
            self._costs = self._compute()
        return self._costs

    @property
    def single(self) -> tuple[np.ndarray, float]:
        """The costs in float32 (half the memory traffic of a min-plus
        reduction) and the largest finite ``|cost|`` (its rounding bound)."""
        if self._single is None:
            costs = self.costs
            finite = np.abs(costs[np.isfinite(costs)])
            self._single = (costs.astype(np.float32), float(finite.max()) if finite.size else 0.0)
        return self._single

    def block(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Costs of the sources ``src`` x the targets ``dst`` (class ids)."""
        return self.costs[np.ix_(src, dst)]


class _GridFamily:
    """The class grids of one tensor (source and target metas, overlap kind,
    keep-partial) on one mesh, computed together: grids of one tensor
    shape share most of their placements (LLaMA-3 70B on 4x4x8x8: 136
    grids of 18.0M entries over 10.6M distinct (source, target)
    placements), so the first member asked for computes the grid over the
    union of every registered member's placements, when that is smaller
    than the members together, and each member is its block. An entry
    depends only on its own pair (:mod:`autoparallel.cost_model.class_costs` is
    bit-identical to the per-pair costs), so blocks equal the members'
    own grids. The union is dropped once every member has its block;
    members registered after it was computed get their own grid."""

    def __init__(self, compute):
        self._compute = compute  # (source specs, target specs) -> array
        self._src: dict = {}  # (placements, shard order) -> index
        self._dst: dict = {}
        self._src_specs: list = []
        self._dst_specs: list = []
        self._pending = 0  # members without their grid yet
        self._pending_entries = 0
        self._union: np.ndarray | None = None
        self._union_shape = (0, 0)  # sources x targets the union covers (0: none computed)

    @staticmethod
    def _index(specs, index: dict, distinct: list) -> np.ndarray:
        out = []
        for spec in specs:
            key = (spec.placements, spec.shard_order)
            i = index.get(key)
            if i is None:
                i = index[key] = len(distinct)
                distinct.append(spec)
            out.append(i)
        return np.asarray(out, dtype=np.int64)

    def member(self, src_specs, dst_specs):
        """Register a grid; returns the function computing it."""
        rows = self._index(src_specs, self._src, self._src_specs)
        cols = self._index(dst_specs, self._dst, self._dst_specs)
        self._pending += 1
        self._pending_entries += len(rows) * len(cols)
        return lambda: self._grid(rows, cols, src_specs, dst_specs)

    def _grid(self, rows: np.ndarray, cols: np.ndarray, src_specs, dst_specs) -> np.ndarray:
        if self._union_shape == (0, 0):
            union = len(self._src_specs) * len(self._dst_specs)
            if self._pending > 1 and union < self._pending_entries:
                self._union = self._compute(self._src_specs, self._dst_specs)
            self._union_shape = (len(self._src_specs), len(self._dst_specs))
        if self._union is not None and rows.max() < self._union_shape[0] and cols.max() < self._union_shape[1]:
            out = self._union[np.ix_(rows, cols)]
        else:
            out = self._compute(src_specs, dst_specs)
        self._pending -= 1
        if not self._pending:
            self._union = None
        return out


# Grid rows per chunk of a min-plus reduction: bounds its temporaries.
_MIN_PLUS_CHUNK = 1 << 18


def _min_plus(costs: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``min_j (costs[i, j] - values[j])`` per row, ``inf`` entries skipped
    (``inf`` for a row of them, or without columns), a chunk of rows at a time.

    The dual ascent calls this for every matrix of every sweep (most of a
    sweep's time), so it allocates one chunk buffer and makes no mask: an
    ``inf`` entry minus a finite value stays ``inf``, and the only ``inf -
    inf`` (a ``nan``) comes from a ``+inf`` value, skipped by ``fmin``."""
    out = np.full(costs.shape[0], math.inf)
    if costs.shape[1] == 0 or costs.shape[0] == 0:
        return out
    values = np.asarray(values)
    skip_nan = bool(np.isposinf(values).any())
    reduce = np.fmin.reduce if skip_nan else np.minimum.reduce
    rows = max(1, _MIN_PLUS_CHUNK // costs.shape[1])
    buf = np.empty((min(rows, costs.shape[0]), costs.shape[1]), dtype=np.result_type(costs, values))
    for r0 in range(0, costs.shape[0], rows):
        chunk = costs[r0 : r0 + rows]
        diff = buf[: chunk.shape[0]]
        with np.errstate(invalid="ignore"):  # inf - inf: skipped by fmin
            np.subtract(chunk, values, out=diff)
        out[r0 : r0 + rows] = reduce(diff, axis=1)
    if skip_nan:
        out[np.isnan(out)] = math.inf  # a row with only inf - inf entries
    return out


def _min_plus_cols(costs: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``min_i (costs[i, j] - values[i])`` per column: :func:`_min_plus` of
    ``costs.T``, equal bit for bit (a min of the same differences), but
    reducing contiguous row chunks along axis 0 (an elementwise minimum of
    whole rows) where the transpose would read the grid with a stride: about
    half the time on 4-D mesh grids, the larger share of a dual-ascent sweep."""
    out = np.full(costs.shape[1], math.inf)
    if costs.shape[0] == 0 or costs.shape[1] == 0:
        return out
    values = np.asarray(values)
    skip_nan = bool(np.isposinf(values).any())
    reduce, combine = (np.fmin.reduce, np.fmin) if skip_nan else (np.minimum.reduce, np.minimum)
    rows = max(1, _MIN_PLUS_CHUNK // costs.shape[1])
    dtype = np.result_type(costs, values)
    buf = np.empty((min(rows, costs.shape[0]), costs.shape[1]), dtype=dtype)
    part = np.empty(costs.shape[1], dtype=dtype)
    for r0 in range(0, costs.shape[0], rows):
        chunk = costs[r0 : r0 + rows]
        diff = buf[: chunk.shape[0]]
        with np.errstate(invalid="ignore"):  # inf - inf: skipped by fmin
            np.subtract(chunk, values[r0 : r0 + rows, None], out=diff)
        reduce(diff, axis=0, out=part)
        combine(out, part, out=out)
    if skip_nan:
        out[np.isnan(out)] = math.inf  # a column with only inf - inf entries
    return out


def _max_per_class(values, classes: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The largest of ``values`` per class (of ``count``), and which classes have any."""
    best = np.full(count, -math.inf)
    np.maximum.at(best, classes, np.asarray(values, dtype=np.float64))
    present = np.zeros(count, dtype=bool)
    present[classes] = True
    return best, present


class LazyClassMatrix:
    """A redistribution matrix over options, by the classes (distinct
    placements) of its rows and columns in a shared :class:`_ClassGrid`."""

    floor = 0.0

    def __init__(self, grid: _ClassGrid, row_class: list[int], col_class: list[int]):
        self._grid = grid
        self._row_class = np.asarray(row_class, dtype=np.int64)
        self._col_class = np.asarray(col_class, dtype=np.int64)
        self.shape = (len(row_class), len(col_class))

    def min_plus_rows(self, col_values) -> np.ndarray:
        """Per row option i: ``min_j (C[i, j] - col_values[j])`` over all
        columns, ``inf`` entries skipped. Options of one column class share
        their costs, so only the largest value of each class counts."""
        best, present = _max_per_class(col_values, self._col_class, self._grid.shape[1])
        costs = self._grid.costs
        if not present.all():  # classes of the grid no option of ours has
            costs, best = costs[:, present], best[present]
        return _min_plus(costs, best)[self._row_class]

    def min_plus_cols(self, row_values) -> np.ndarray:
        """Per column option j: ``min_i (C[i, j] - row_values[i])`` over all rows."""
        best, present = _max_per_class(row_values, self._row_class, self._grid.shape[0])
        costs = self._grid.costs
        if not present.all():
            costs, best = costs[present], best[present]
        return _min_plus_cols(costs, best)[self._col_class]

    def reduction_classes(self, own_rows: bool) -> tuple[np.ndarray, np.ndarray, int]:
        """(class per result option, class per value option, value classes)
        of :meth:`min_plus_classes` (``own_rows``: results per row)."""
        if own_rows:
            return self._row_class, self._col_class, self._grid.shape[1]
        return self._col_class, self._row_class, self._grid.shape[0]

    def min_plus_classes(self, best: np.ndarray, own_rows: bool, lower: bool = False) -> np.ndarray:
        """:meth:`min_plus_rows` (``own_rows``) or :meth:`min_plus_cols` over
        classes: ``best`` the largest value per column (row) class, -inf
        for a class without options (its entries are then never the
        minimum), the result per row (column) class.

        ``lower``: a lower bound of each result instead, from float32 costs
        and values (about twice as fast) less their rounding bound: each
        difference is off by at most ``3u (|C| + |v|)``, ``u = 2**-24`` (two
        roundings to float32, one subtraction), so the minimum less
        ``2**-21 (max |C| + max |v|)`` (finite ones) is never above the
        exact one; infinite results stay as they are (an entry of ``inf``
        or a value of ``-inf`` gives ``inf`` either way)."""
        if not lower:
            costs = self._grid.costs
            return _min_plus(costs, best) if own_rows else _min_plus_cols(costs, best)
        costs, top = self._grid.single
        finite = np.abs(best[np.isfinite(best)])
        slack = 2.0**-21 * (top + (float(finite.max()) if finite.size else 0.0))
        single = best.astype(np.float32)
        out = _min_plus(costs, single) if own_rows else _min_plus_cols(costs, single)
        return out - slack  # inf - slack == inf

    def block(self, rows, cols) -> np.ndarray:
        rc = self._row_class[np.asarray(rows, dtype=np.int64)]
        cc = self._col_class[np.asarray(cols, dtype=np.int64)]
        ur, rinv = np.unique(rc, return_inverse=True)
        uc, cinv = np.unique(cc, return_inverse=True)
        return self._grid.block(ur, uc)[np.ix_(rinv, cinv)]


class LazyKeyMatch:
    """0 where a row's key equals a column's, ``inf`` elsewhere (structural
    pairs: getitem, tangent = output, gradient = parameter), except rows
    priced by their own function (a tp-outer parameter's gradient)."""

    floor = 0.0

    def __init__(self, row_keys: list[int], col_keys: list[int], row_costs: dict | None = None):
        self._row_keys = np.asarray(row_keys, dtype=np.int64)
        self._col_keys = np.asarray(col_keys, dtype=np.int64)
        self._row_costs = row_costs or {}
        self._rows: dict[int, np.ndarray] = {}
        self.shape = (len(row_keys), len(col_keys))
        self._keys = int(max(self._row_keys.max(initial=-1), self._col_keys.max(initial=-1))) + 1

    def _row(self, r: int) -> np.ndarray:
        """The full row of a row with its own cost function, kept."""
        row = self._rows.get(r)
        if row is None:
            row = self._rows[r] = self._row_costs[r](r)
        return row

    def block(self, rows, cols) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        cols = np.asarray(cols, dtype=np.int64)
        out = np.where(self._row_keys[rows][:, None] == self._col_keys[cols][None, :], 0.0, math.inf)
        for k, r in enumerate(rows.tolist()):
            if r in self._row_costs:
                out[k] = self._row(r)[cols]
        return out

    def min_plus_rows(self, col_values) -> np.ndarray:
        """Per row i: ``min_j (C[i, j] - col_values[j])`` over all columns,
        ``inf`` entries skipped: minus the largest value among the columns
        with the row's key (``inf`` if none), or over its own row."""
        values = np.asarray(col_values, dtype=np.float64)
        best, present = _max_per_class(values, self._col_keys, self._keys)
        out = np.where(present[self._row_keys], 0.0 - best[self._row_keys], math.inf)
        for r in self._row_costs:
            out[r] = _min_plus(self._row(r)[None, :], values)[0]
        return out

    def min_plus_cols(self, row_values) -> np.ndarray:
        """Per column j: ``min_i (C[i, j] - row_values[i])`` over all rows."""
        values = np.asarray(row_values, dtype=np.float64)
        keyed = np.ones(self.shape[0], dtype=bool)
        keyed[list(self._row_costs)] = False
        best, present = _max_per_class(values[keyed], self._row_keys[keyed], self._keys)
        out = np.where(present[self._col_keys], 0.0 - best[self._col_keys], math.inf)
        for r in self._row_costs:
            out = np.minimum(out, _min_plus(self._row(r)[:, None], values[r : r + 1]))
        return out
