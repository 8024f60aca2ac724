"""Whole class grids computed with numpy (autoparallel/cost_model/class_costs.py)
are bit-identical to the per-pair costs, and the lazy matrices' min-plus
reductions equal brute force."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _MaskPartial, _StridedShard

from torch.testing._internal.distributed.fake_pg import FakeStore

from torch.distributed.tensor._ops._math_ops import _NormPartial

from autoparallel.cost_model import class_costs
from autoparallel import cost_model
from autoparallel.cost_model import comm
from autoparallel.cost_model.overlap import CommOverlapPolicy, HiddenComm
from autoparallel.problem.edge_matrices import EdgeMatrices, LazyClassMatrix, LazyKeyMatch, _ClassGrid


@pytest.fixture(autouse=True, scope="module")
def _world():
    """A fake world of 1024 ranks: every mesh here lies in it."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1024)
    yield
    dist.destroy_process_group()


def _mesh(shape) -> DeviceMesh:
    # planning only: no process groups per mesh dim
    return DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape), _init_backend=False)


def _meta(shape, dtype=torch.bfloat16):
    t = torch.empty(shape, dtype=dtype, device="meta")
    return TensorMeta(t.shape, t.stride(), t.dtype)


class _OtherPartial(Partial):
    """A Partial subclass the fast path does not know: goes pair by pair.
    Hashed apart from Partial (else comm's caches, keyed by placements,
    would take it for the Partial it equals)."""

    def __eq__(self, other):
        return isinstance(other, _OtherPartial) and self.reduce_op == other.reduce_op

    def __hash__(self):
        return 2 + hash(self.reduce_op)


# two embeddings' masked sums (equal only to themselves) and a norm's partial
_MASKED = [_MaskPartial(offset_shape=torch.Size([64, 8]), offset_dim=0) for _ in range(2)]


def _atoms(ndim_tensor):
    partials = [Partial(), Partial("avg"), Partial("max"), *_MASKED, _NormPartial(2)]
    return [Replicate(), *partials] + [Shard(d) for d in range(ndim_tensor)]


def _specs(mesh, meta, count, rng, odd=True):
    """``count`` distinct plain placements, and with ``odd`` specs the fast
    path leaves to the per-pair one: a strided shard, a non-default shard
    order (2-D meshes), an unknown Partial subclass."""
    n = mesh.ndim
    combos = list(itertools.product(_atoms(len(meta.shape)), repeat=n))
    specs = [DTensorSpec(mesh, tuple(p), tensor_meta=meta) for p in rng.sample(combos, min(count, len(combos)))]
    if odd:
        strided = (_StridedShard(0, split_factor=2),) + (Replicate(),) * (n - 1)
        specs.insert(len(specs) // 2, DTensorSpec(mesh, strided, tensor_meta=meta))
        specs.insert(1, DTensorSpec(mesh, (_OtherPartial(),) + (Replicate(),) * (n - 1), tensor_meta=meta))
        if n == 2:
            # tensor dim 0 sharded on mesh dims 0 and 1, inner one first
            # (DTensor's graph planner, ~0.1 s a pair on 3-D and 4-D meshes)
            order = (ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),)
            placements = (Shard(0), Shard(0)) + (Replicate(),) * (n - 2)
            specs.append(DTensorSpec(mesh, placements, tensor_meta=meta, shard_order=order))
    return specs


def _reference(src, dst, device, overlap, kind, keep_partial):
    """The per-pair costs (:func:`cost_model.edge_time`), inf where a kept Partial would be reduced."""
    out = np.empty((len(src), len(dst)))
    for i, s in enumerate(src):
        for j, d in enumerate(dst):
            reduces = any(a.is_partial() and not b.is_partial() for a, b in zip(s.placements, d.placements))
            out[i, j] = cost_model.edge_time(s, d, device, overlap, kind, keep_partial)
            if keep_partial and reduces:
                assert out[i, j] == math.inf, (s, d)
    return out


@pytest.mark.parametrize(
    "mesh_shape,tensor_shapes,count",
    [
        ((4,), [(8, 6), (3, 5, 7)], 12),
        ((2, 4), [(8, 6, 4), (3, 16, 5)], 40),
        ((2, 2, 2), [(8, 6, 4), (3, 16, 5)], 80),
        ((2, 1, 2, 2), [(8, 6, 4)], 80),
        # 4-D: 80 specs a side, 6,400 pairs per tensor shape and device
        ((2, 2, 2, 2), [(8, 6, 4), (3, 16, 5)], 80),
        ((4, 4, 8, 8), [(32, 8192, 1024), (5, 129, 7)], 80),
    ],
)
def test_raw_grid_equals_redistribute_time(mesh_shape, tensor_shapes, count):
    """Every entry, bit for bit (inf included), uneven shards (ceil
    division) and the specs that go pair by pair."""
    mesh = _mesh(mesh_shape)
    rng = random.Random(len(mesh_shape))
    for shape in tensor_shapes:
        meta = _meta(shape)
        src = _specs(mesh, meta, count, rng)
        dst = _specs(mesh, meta, count, rng)
        for device in (cost_model.H100, cost_model.A100):
            grid = class_costs.redistribution_grid(src, dst, device)
            slow = np.array([[comm.redistribute_time(s, d, device) for d in dst] for s in src])
            assert np.array_equal(grid, slow)
            assert np.isinf(grid).any() and (grid == 0).any()


def test_raw_grid_in_small_chunks_and_unique_lookup(monkeypatch):
    """The chunked loop and the np.unique step lookup give the same grid."""
    mesh = _mesh((2, 2, 2))
    meta = _meta((3, 16, 5))
    rng = random.Random(5)
    src, dst = _specs(mesh, meta, 60, rng), _specs(mesh, meta, 50, rng)
    slow = np.array([[comm.redistribute_time(s, d, cost_model.H100) for d in dst] for s in src])
    monkeypatch.setattr(class_costs, "CHUNK_PAIRS", 7)
    assert np.array_equal(class_costs.redistribution_grid(src, dst, cost_model.H100), slow)
    monkeypatch.setattr(class_costs, "_LUT_LIMIT", 1)
    assert np.array_equal(class_costs.redistribution_grid(src, dst, cost_model.H100), slow)


def test_mixed_metas_and_no_meta_go_pair_by_pair():
    mesh = _mesh((2, 2))
    rng = random.Random(2)
    a, b = _specs(mesh, _meta((8, 6)), 12, rng, odd=False), _specs(mesh, _meta((4, 6)), 12, rng, odd=False)
    mixed = a[:6] + b[:6]
    no_meta = [DTensorSpec(mesh, s.placements) for s in a[:3]]  # targets need no meta
    for src, dst in [(mixed, a), (a, no_meta + a[3:])]:
        grid = class_costs.redistribution_grid(src, dst, cost_model.H100)
        assert np.array_equal(grid, [[comm.redistribute_time(s, d, cost_model.H100) for d in dst] for s in src])


_WINDOWED = CommOverlapPolicy(compute_windows=True, regather_in_backward=True)


@pytest.mark.parametrize(
    "kind,overlap",
    [
        (None, CommOverlapPolicy()),
        (cost_model.PARAM_ALL_GATHER, CommOverlapPolicy()),
        (cost_model.GRAD_REDUCE_SCATTER, CommOverlapPolicy(network_fraction=None, grad_reduce_scatter_discount=0.6)),
        (cost_model.GRAD_REDUCE_SCATTER, CommOverlapPolicy(network_fraction=0.2, nvlink_fraction=0.5)),
        (cost_model.PARAM_ALL_GATHER, CommOverlapPolicy(enabled=False)),
        (HiddenComm(cost_model.PARAM_ALL_GATHER, 2e-5, 1e-5), _WINDOWED),
        (HiddenComm(cost_model.GRAD_REDUCE_SCATTER, 3e-5), _WINDOWED),
        (HiddenComm(cost_model.PARAM_ALL_GATHER, 2e-5, 1e-5), CommOverlapPolicy()),
    ],
)
@pytest.mark.parametrize("keep_partial", [False, True])
@pytest.mark.parametrize("mesh_shape", [(2, 4), (2, 1, 2, 2), (4, 4)])
def test_class_grid_equals_pairs(kind, overlap, keep_partial, mesh_shape):
    """Masking, discount and tiebreak as cost_model.edge_time, bit for bit;
    moves over a mesh dim of size 1 are free (tiebreak only)."""
    mesh = _mesh(mesh_shape)
    rng = random.Random(7)
    meta = _meta((8, 1, 5))
    src, dst = _specs(mesh, meta, 50, rng), _specs(mesh, meta, 50, rng)
    # a gather over mesh dim 1 (of size 1 in the 4-D mesh)
    src.append(DTensorSpec(mesh, (Replicate(), Shard(0)) + (Replicate(),) * (len(mesh_shape) - 2), tensor_meta=meta))
    dst.append(DTensorSpec(mesh, (Replicate(),) * len(mesh_shape), tensor_meta=meta))
    for device in (cost_model.H100, cost_model.A100):
        grid = class_costs.class_cost_grid(src, dst, device, overlap, kind, keep_partial)
        assert np.array_equal(grid, _reference(src, dst, device, overlap, kind, keep_partial))
        assert (grid == cost_model.TRANSITION_TIEBREAK).any() == (1 in mesh_shape)


def _brute_rows(matrix, col_values):
    full = matrix.block(np.arange(matrix.shape[0]), np.arange(matrix.shape[1]))
    return np.where(np.isinf(full), math.inf, full - col_values[None, :]).min(axis=1, initial=math.inf)


def _brute_cols(matrix, row_values):
    full = matrix.block(np.arange(matrix.shape[0]), np.arange(matrix.shape[1]))
    return np.where(np.isinf(full), math.inf, full - row_values[:, None]).min(axis=0, initial=math.inf)


def _assert_same(ours, brute):
    assert ours.shape == brute.shape
    assert np.array_equal(np.isinf(ours), np.isinf(brute))
    finite = np.isfinite(brute)
    assert np.allclose(ours[finite], brute[finite], rtol=1e-12, atol=0)


def _random_costs(rng, shape, inf_share):
    costs = rng.uniform(0, 5, size=shape)
    costs[rng.random(shape) < inf_share] = math.inf
    return costs


@pytest.mark.parametrize("seed", range(6))
def test_class_matrix_min_plus_equals_brute_force(seed):
    """Over option indices: classes repeat options, some grid classes have
    no option (a grid is shared by matrices), whole rows of the grid inf."""
    rng = np.random.default_rng(seed)
    n_src, n_dst = rng.integers(1, 9), rng.integers(1, 9)
    costs = _random_costs(rng, (n_src, n_dst), 0.3)
    costs[0] = math.inf
    calls = []
    grid = _ClassGrid(lambda: calls.append(1) or costs, n_src, n_dst)
    rows, cols = rng.integers(3, 40), rng.integers(3, 40)
    row_class = rng.integers(0, n_src, size=rows)
    row_class[0] = 0
    col_class = rng.integers(0, max(1, n_dst - 1), size=cols)  # maybe not the last class
    matrix = LazyClassMatrix(grid, row_class.tolist(), col_class.tolist())
    col_values, row_values = rng.normal(0, 3, size=cols), rng.normal(0, 3, size=rows)
    ours = matrix.min_plus_rows(col_values)
    _assert_same(ours, _brute_rows(matrix, col_values))
    assert np.isinf(ours[0]) and np.isfinite(ours).any()
    _assert_same(matrix.min_plus_cols(row_values), _brute_cols(matrix, row_values))
    assert len(calls) == 1  # the grid is computed once, whole


def test_class_matrix_min_plus_in_chunks(monkeypatch):
    from autoparallel.problem import edge_matrices

    monkeypatch.setattr(edge_matrices, "_MIN_PLUS_CHUNK", 5)
    rng = np.random.default_rng(11)
    costs = _random_costs(rng, (13, 7), 0.2)
    row_class, col_class = rng.integers(0, 13, 30).tolist(), rng.integers(0, 7, 25).tolist()
    matrix = LazyClassMatrix(_ClassGrid(lambda: costs, 13, 7), row_class, col_class)
    col_values, row_values = rng.normal(size=25), rng.normal(size=30)
    _assert_same(matrix.min_plus_rows(col_values), _brute_rows(matrix, col_values))
    _assert_same(matrix.min_plus_cols(row_values), _brute_cols(matrix, row_values))


@pytest.mark.parametrize("seed", range(4))
def test_min_plus_with_infinite_values(monkeypatch, seed):
    """Values of +-inf: an inf entry is skipped even against a +inf value
    (inf - inf), a finite entry against +inf is -inf; chunked or not,
    float32 grids too."""
    from autoparallel.problem import edge_matrices

    monkeypatch.setattr(edge_matrices, "_MIN_PLUS_CHUNK", 7 if seed % 2 else 1 << 18)
    rng = np.random.default_rng(seed)
    costs = _random_costs(rng, (17, 9), 0.4).astype(np.float32 if seed > 1 else np.float64)
    costs[3] = math.inf
    values = rng.normal(size=9)
    values[rng.random(9) < 0.3] = math.inf
    values[rng.random(9) < 0.2] = -math.inf
    brute = np.where(np.isinf(costs), math.inf, costs - values[None, :]).min(axis=1, initial=math.inf)
    ours = edge_matrices._min_plus(costs, values)
    assert np.array_equal(ours, brute) and not np.isnan(ours).any()
    assert edge_matrices._min_plus(costs[:, :0], values[:0]).tolist() == [math.inf] * 17


@pytest.mark.parametrize("seed", range(8))
def test_min_plus_cols_equals_brute_force(monkeypatch, seed):
    """The column reduction (axis 0 over row chunks) against the brute force
    over the transpose, bit for bit: inf entries, +-inf values, chunks of
    one row, a few rows or all of them, float32 grids too."""
    from autoparallel.problem import edge_matrices

    monkeypatch.setattr(edge_matrices, "_MIN_PLUS_CHUNK", (1, 20, 1 << 18)[seed % 3])
    rng = np.random.default_rng(50 + seed)
    shape = (int(rng.integers(1, 40)), int(rng.integers(1, 30)))
    costs = _random_costs(rng, shape, 0.4).astype(np.float32 if seed > 5 else np.float64)
    costs[:, rng.integers(shape[1])] = math.inf  # a column of inf entries
    values = rng.normal(size=shape[0])
    if seed % 2:
        values[rng.random(shape[0]) < 0.3] = math.inf
    values[rng.random(shape[0]) < 0.2] = -math.inf
    brute = np.where(np.isinf(costs), math.inf, costs - values[:, None]).min(axis=0, initial=math.inf)
    ours = edge_matrices._min_plus_cols(costs, values)
    assert np.array_equal(ours, brute) and not np.isnan(ours).any()
    assert np.array_equal(ours, edge_matrices._min_plus(costs.T, values))
    assert edge_matrices._min_plus_cols(costs[:0], values[:0]).tolist() == [math.inf] * shape[1]


@pytest.mark.parametrize("seed", range(6))
def test_key_match_min_plus_equals_brute_force(seed):
    """Keys only rows have (inf rows), keys only columns have (inf
    columns), rows with their own costs (inf entries among them)."""
    rng = np.random.default_rng(100 + seed)
    rows, cols = int(rng.integers(3, 30)), int(rng.integers(3, 30))
    row_keys = rng.integers(0, 6, size=rows).tolist()
    col_keys = rng.integers(1, 8, size=cols).tolist()  # key 0: rows only; 6, 7: columns only
    row_keys[0] = 0
    own = {int(r): _random_costs(rng, (cols,), 0.3) for r in 1 + rng.choice(rows - 1, size=2, replace=False)}
    matrix = LazyKeyMatch(row_keys, col_keys, {r: (lambda i, c=c: c) for r, c in own.items()})
    col_values, row_values = rng.normal(0, 3, size=cols), rng.normal(0, 3, size=rows)
    ours = matrix.min_plus_rows(col_values)
    _assert_same(ours, _brute_rows(matrix, col_values))
    assert np.isinf(ours[0]) and np.isfinite(ours).any()
    _assert_same(matrix.min_plus_cols(row_values), _brute_cols(matrix, row_values))


def test_min_plus_on_a_real_grid():
    """A redistribution matrix of EdgeMatrices (lazy), options repeating
    placements: the reductions equal brute force over its block."""
    from autoparallel.options.strategies import Option

    mesh = _mesh((2, 2, 2))
    meta = _meta((8, 6, 4))
    rng = random.Random(3)
    specs = _specs(mesh, meta, 40, rng, odd=False)
    options = [Option(specs[i % len(specs)], (specs[(i * 7) % len(specs)],)) for i in range(90)]
    matrices = EdgeMatrices(cost_model.H100, CommOverlapPolicy(), lazy=True)
    matrix = matrices.redistribution(options, options[:60], 0, None, keep_partial=True)
    assert isinstance(matrix, LazyClassMatrix)
    values = np.random.default_rng(0)
    col_values, row_values = values.normal(0, 1e-4, size=60), values.normal(0, 1e-4, size=90)
    _assert_same(matrix.min_plus_rows(col_values), _brute_rows(matrix, col_values))
    _assert_same(matrix.min_plus_cols(row_values), _brute_cols(matrix, row_values))


def test_masked_and_norm_partials_take_the_vectorised_path(monkeypatch):
    """An embedding's masked sum and a norm's partial are planned with the
    rest (on LLaMA they are a third of the 4-D grids' per-pair time)."""
    mesh = _mesh((2, 2, 2))
    meta = _meta((8, 6, 4))
    specs = _specs(mesh, meta, 80, random.Random(9), odd=False)
    assert any(type(p) in (_MaskPartial, _NormPartial) for s in specs for p in s.placements)
    slow = np.array([[comm.redistribute_time(s, d, cost_model.H100) for d in specs] for s in specs])

    def per_pair(*args, **kwargs):
        raise AssertionError("no pair should go pair by pair")

    monkeypatch.setattr(class_costs, "_pairwise", per_pair)
    assert np.array_equal(class_costs.redistribution_grid(specs, specs, cost_model.H100), slow)


@pytest.mark.parametrize("keep_partial", [False, True])
def test_grid_family_blocks_equal_own_grids(monkeypatch, keep_partial):
    """Lazy grids of one tensor come from their family's union grid (or on
    their own: a union larger than its members, a member registered after
    the union was computed, mixed metas), equal bit for bit to the grid
    each would compute alone."""
    from autoparallel.options.strategies import Option

    mesh = _mesh((2, 2, 2))
    meta, other = _meta((8, 6, 4)), _meta((8, 6, 4), torch.float32)
    rng = random.Random(5)
    specs = _specs(mesh, meta, 60, rng, odd=True)
    unions = []
    real = class_costs.class_cost_grid

    def counted(src, dst, *args):
        unions.append((len(src), len(dst)))
        return real(src, dst, *args)

    monkeypatch.setattr("autoparallel.problem.edge_matrices.class_cost_grid", counted)
    matrices = EdgeMatrices(cost_model.H100, CommOverlapPolicy(), lazy=True)

    def options(lo, hi, step=1):
        return [Option(specs[i], (specs[(i * 7) % len(specs)],)) for i in range(lo, hi, step)]

    lists = [options(0, 40), options(10, 50), options(20, 60), options(5, 45, 2)]
    mats = [matrices.redistribution(a, b, 0, None, keep_partial) for a in lists for b in lists[:2]]
    mixed = options(0, 30) + [Option(DTensorSpec(mesh, (Replicate(),) * 3, tensor_meta=other), (specs[0],))]
    mats.append(matrices.redistribution(mixed, lists[1], 0, None, keep_partial))  # mixed metas: its own
    for m in mats:
        full = m.block(np.arange(m.shape[0]), np.arange(m.shape[1]))
        grid = m._grid.costs
        src, dst = _grid_specs(m)
        assert np.array_equal(grid, real(src, dst, cost_model.H100, CommOverlapPolicy(), None, keep_partial))
        assert full.shape == m.shape
    assert unions[0][0] > 40 and len(unions) == 2  # one union for the family, one grid alone
    late = matrices.redistribution(options(1, 60, 3), lists[0], 0, None, keep_partial)
    src, dst = _grid_specs(late)
    assert np.array_equal(late._grid.costs, real(src, dst, cost_model.H100, CommOverlapPolicy(), None, keep_partial))
    assert len(unions) == 3  # computed alone


def _grid_specs(matrix):
    """The source and target specs a lazy grid was registered with."""
    fn = matrix._grid._compute
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
    return cells["src_specs"], cells["dst_specs"]


class _RowsColsOnly:
    """A lazy class matrix seen only through min_plus_rows / min_plus_cols
    (Term.min_plus's general path)."""

    def __init__(self, matrix):
        self._m = matrix
        self.shape, self.floor = matrix.shape, matrix.floor
        self.block, self.min_plus_rows, self.min_plus_cols = matrix.block, matrix.min_plus_rows, matrix.min_plus_cols


@pytest.mark.parametrize("seed", range(8))
def test_term_min_plus_by_classes_equals_general_path(seed):
    """Term.min_plus through the matrix's classes (one scatter-max, one
    gather) equals its general path and brute force: repeated and missing
    option maps, transposed terms, counts > 1, inf entries, -inf values."""
    from solver.pricing_quotient import BlockCache, Term

    rng = np.random.default_rng(200 + seed)
    n_rc, n_cc = int(rng.integers(1, 12)), int(rng.integers(1, 12))
    costs = _random_costs(rng, (n_rc, n_cc), 0.3)
    rows, cols = int(rng.integers(1, 25)), int(rng.integers(1, 25))
    matrix = LazyClassMatrix(
        _ClassGrid(lambda: costs, n_rc, n_cc),
        rng.integers(0, n_rc, rows).tolist(),
        rng.integers(0, n_cc, cols).tolist(),
    )
    transposed, count = bool(seed % 2), int(rng.integers(1, 4))
    obj_rows, obj_cols = (cols, rows) if transposed else (rows, cols)  # the term's sides, in object ids
    rmap, cmap = (
        rng.integers(0, obj_rows, int(rng.integers(1, 20))),
        rng.integers(0, obj_cols, int(rng.integers(1, 20))),
    )
    fast = Term(BlockCache(matrix), rmap, cmap, transposed, count)
    general = Term(BlockCache(_RowsColsOnly(matrix)), rmap, cmap, transposed, count)
    full = matrix.block(np.arange(rows), np.arange(cols))
    full = full.T if transposed else full
    full = count * full[np.ix_(rmap, cmap)]
    for along_rows in (True, False):
        values = rng.normal(size=len(cmap) if along_rows else len(rmap))
        values[rng.random(len(values)) < 0.2] = -math.inf
        ours = fast.min_plus(values, along_rows)
        assert np.array_equal(ours, general.min_plus(values, along_rows))
        c = full if along_rows else full.T
        brute = np.where(np.isinf(c), math.inf, c - values[None, :]).min(axis=1, initial=math.inf)
        _assert_same(ours, brute)


@pytest.mark.parametrize("seed", range(8))
def test_lower_min_plus_is_a_close_lower_bound(seed):
    """min_plus_classes(lower=True) (float32) is never above the exact
    reduction, within its rounding bound of it, inf exactly where it is:
    inf entries, -inf values, costs spread over orders of magnitude."""
    rng = np.random.default_rng(300 + seed)
    n_rc, n_cc = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    costs = _random_costs(rng, (n_rc, n_cc), 0.3) * 10.0 ** rng.integers(-6, 1, (n_rc, n_cc))
    if seed % 3 == 0:
        costs[:, 0] = math.inf  # a class with no finite partner
    matrix = LazyClassMatrix(_ClassGrid(lambda: costs, n_rc, n_cc), list(range(n_rc)), list(range(n_cc)))
    for own_rows in (True, False):
        best = rng.normal(0, 1e-3, size=n_cc if own_rows else n_rc) + rng.uniform(0, 1e-6)
        best[rng.random(len(best)) < 0.2] = -math.inf
        exact = matrix.min_plus_classes(best, own_rows)
        low = matrix.min_plus_classes(best, own_rows, lower=True)
        assert np.array_equal(np.isinf(low), np.isinf(exact)) and np.array_equal(
            low[np.isinf(low)], exact[np.isinf(exact)]
        )
        finite = np.isfinite(exact)
        assert (low[finite] <= exact[finite]).all()
        top = np.abs(costs[np.isfinite(costs)]).max(initial=0.0) + np.abs(best[np.isfinite(best)]).max(initial=0.0)
        assert (exact[finite] - low[finite] <= 2.0**-20 * top).all()
