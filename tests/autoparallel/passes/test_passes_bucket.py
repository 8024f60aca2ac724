"""bucket_collectives: small same-group parameter all-gathers become one
all-gather of the concatenated shards, on hand-built graphs (fires / must not
fire; numerics on 4 LocalTensorMode ranks) and on the tiny LLaMA-3 plan on a
2x2 mesh (loss and gradients equal the single-device model)."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.fx.experimental.proxy_tensor import make_fx

from _hand_plan import pin_hand_layout
from autoparallel.passes import PassContext, PassOptions
from autoparallel.passes.bucket_collectives import bucket_collectives
from autoparallel.passes.schedule_overlap import check_topological, schedule_overlap

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

_c10d = torch.ops._c10d_functional
AG = _c10d.all_gather_into_tensor.default


@pytest.fixture
def mesh(fake_world):
    fake_world(4)
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _ag(x, mesh, dim):
    return _c10d.wait_tensor(_c10d.all_gather_into_tensor(x, mesh.size(dim), mesh.get_group(dim).group_name))


def _ag_world(x, group):
    return _c10d.wait_tensor(_c10d.all_gather_into_tensor(x, 4, group))


def _trace(fn, *inputs):
    return make_fx(fn, tracing_mode="fake")(*inputs)


def _count(gm):
    return len(gm.graph.find_nodes(op="call_function", target=AG))


def _ctx(**options):
    # tiny graphs: any bucket raises the peak by far more than 5% (its gathered
    # buffer lives from the first member's use); the memory guard has its own test
    options.setdefault("bucket_peak_growth", 10.0)
    return PassContext(mesh=None, plan=None, options=PassOptions(**options))


def _bucket(gm, ctx):
    out = copy.deepcopy(gm)
    stats = bucket_collectives(out, ctx)
    out.graph.lint()
    check_topological(out)
    return out, stats


def _run(gm, inputs_of_rank):
    """Outputs of ``gm`` per rank (4 LocalTensorMode ranks)."""
    with LocalTensorMode(4) as lm:
        ins = [lm.rank_map(lambda r, k=k: inputs_of_rank(r)[k]) for k in range(len(inputs_of_rank(0)))]
        outs = gm(*ins)
        outs = outs if isinstance(outs, (tuple, list)) else [outs]
        return [{r: o._local_tensors[r].clone() for r in range(4)} for o in outs]


def _check_same(gm, bucketed, inputs_of_rank):
    for before, after in zip(_run(gm, inputs_of_rank), _run(bucketed, inputs_of_rank)):
        for r in range(4):
            torch.testing.assert_close(after[r], before[r], rtol=0, atol=0)


def _inputs(*shapes, dtypes=None):
    dtypes = dtypes or [torch.float32] * len(shapes)

    def of_rank(r):
        g = torch.Generator().manual_seed(r)
        return [torch.randn(s, generator=g).to(d) for s, d in zip(shapes, dtypes)]

    return of_rank


def _fakes(*shapes, dtypes=None):
    dtypes = dtypes or [torch.float32] * len(shapes)
    return [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes)]


def _layer_fn(mesh):
    # two norm-like weights (1-D, 2-D) and an activation: each weight is
    # gathered on the whole 4-rank group and used at a different point
    group = mesh._flatten().get_group().group_name

    def fn(a, b, x):
        y = x * _ag_world(a, group)  # (8,) * (8,)
        z = y.sum() * _ag_world(b.clone(), group)  # b's input: a cheap chain, after a's consumer
        return y, z

    return fn


@pytest.mark.smoke
def test_merges_same_group_gathers_exactly(mesh):
    gm = _trace(_layer_fn(mesh), *_fakes((2,), (1, 3), (8,)))
    bucketed, stats = _bucket(gm, _ctx())
    assert (stats.buckets, stats.collectives_merged, stats.by_kind) == (1, 2, {"all_gather": 2})
    assert (_count(gm), _count(bucketed)) == (2, 1)
    (ag,) = bucketed.graph.find_nodes(op="call_function", target=AG)
    assert tuple(ag.meta["val"].shape) == (4 * (2 + 3),)
    _check_same(gm, bucketed, _inputs((2,), (1, 3), (8,)))


def test_same_layer_only(mesh):
    group = mesh._flatten().get_group().group_name

    def fn(a, b, c, x):
        return x * _ag_world(a, group), x * _ag_world(b, group), x * _ag_world(c, group)

    gm = _trace(fn, *_fakes((2,), (2,), (2,), (8,)))
    bucketed = copy.deepcopy(gm)
    names = [p.name for p in bucketed.graph.find_nodes(op="placeholder")][:3]
    ctx = _ctx()
    # parameters a and c of layer 0, b of layer 1 (what apply's LocalJoint says)
    ctx.local = types.SimpleNamespace(
        param_fqns=["layers.0.n1", "layers.1.n1", "layers.0.n2"], buffer_fqns=[], primal_names=lambda: names
    )
    stats = bucket_collectives(bucketed, ctx)
    check_topological(bucketed)
    assert (stats.buckets, stats.collectives_merged, _count(bucketed)) == (1, 2, 2)
    merged = next(n for n in bucketed.graph.find_nodes(op="call_function", target=AG) if n.meta["val"].shape == (16,))
    flats = merged.args[0].args[0]
    assert [f.args[0].name for f in flats] == [names[0], names[2]]
    _check_same(gm, bucketed, _inputs((2,), (2,), (2,), (8,)))


@pytest.mark.parametrize("case", ["group", "dtype", "size", "dependent_input", "threshold", "off"])
def test_does_not_fire(mesh, case):
    flat = mesh._flatten().get_group().group_name
    shapes, dtypes, options = [(2,), (2,), (8,)], None, {}
    if case == "group":  # the second weight on another group (2 ranks, tp)

        def fn(a, b, x):
            return x * _ag_world(a, flat), x[:4] * _ag(b, mesh, 1)

    elif case == "dtype":
        dtypes = [torch.float32, torch.float64, torch.float32]

        def fn(a, b, x):
            return x * _ag_world(a, flat), x.double() * _ag_world(b, flat)

    elif case == "size":  # same group name, another group size (malformed, but not equivalent)

        def fn(a, b, x):
            w = _c10d.wait_tensor(_c10d.all_gather_into_tensor(b, 2, flat))
            return x * _ag_world(a, flat), x[:4] * w

    elif case == "dependent_input":
        # b's gathered input is computed from a's gathered result through a
        # consumer: merging would need the merged gather before itself

        def fn(a, b, x):
            wa = _ag_world(a, flat)
            y = x * wa
            return y, x * _ag_world(b * y[:2], flat)

    else:
        options = {"bucket_bytes": 4} if case == "threshold" else {"bucket_bytes": 0}

        def fn(a, b, x):
            return x * _ag_world(a, flat), x * _ag_world(b, flat)

    gm = _trace(fn, *_fakes(*shapes, dtypes=dtypes))
    bucketed, stats = _bucket(gm, _ctx(**options))
    assert stats.buckets == 0 and _count(bucketed) == _count(gm) == 2


def test_schedule_overlap_treats_a_bucket_as_a_parameter_gather(mesh):
    """After bucketing, schedule_overlap still sees the layer's gathers (one
    bucket) and keeps the graph valid and equal."""
    gm = _trace(_layer_fn(mesh), *_fakes((2,), (1, 3), (8,)))
    bucketed, _ = _bucket(gm, _ctx())
    stats = schedule_overlap(bucketed, _ctx())
    check_topological(bucketed)
    assert stats.all_gathers == 1 and stats.layers == 1
    _check_same(gm, bucketed, _inputs((2,), (1, 3), (8,)))


RS = _c10d.reduce_scatter_tensor.default
AR = _c10d.all_reduce.default


def _rs(x, group):
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(x, "sum", 4, group))


def _ar(x, group):
    return _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group))


def _n(gm, target):
    return len(gm.graph.find_nodes(op="call_function", target=target))


def test_merges_reduce_scatters_and_all_reduces_exactly(mesh):
    """Gradient-like reductions of one (bare) layer: two reduce-scatters in
    one flat buffer (results are views of it), two all-reduces in another."""
    group = mesh._flatten().get_group().group_name

    def fn(a, b, x):
        ga = a * x.sum()  # (8,) -> (2,) per rank
        gb = b * 2.0  # (4, 3) -> (1, 3)
        return _rs(ga, group), _rs(gb, group), _ar(ga * 3.0, group), _ar(gb.t().contiguous(), group)

    gm = _trace(fn, *_fakes((8,), (4, 3), (5,)))
    bucketed, stats = _bucket(gm, _ctx())
    assert stats.by_kind == {"reduce_scatter": 2, "all_reduce": 2} and stats.buckets == 2
    assert (_n(bucketed, RS), _n(bucketed, AR)) == (1, 1)
    (rs,) = bucketed.graph.find_nodes(op="call_function", target=RS)
    assert tuple(rs.meta["val"].shape) == (2 + 3,)
    # no copy out of the reduce-scatter's result (split + views only), and
    # the all-reduced transpose is written into the buffer straight from
    # gb.t(): its contiguous copy is gone
    clone = torch.ops.aten.clone.default
    assert _n(gm, clone) == 1 and _n(bucketed, clone) == 0 and stats.copies_removed == 1
    assert _n(bucketed, torch.ops.aten._chunk_cat.default) == 2
    assert stats.comm_time_saved_s > 0
    _check_same(gm, bucketed, _inputs((8,), (4, 3), (5,)))


def test_reduction_needed_before_the_next_is_not_merged(mesh):
    # the second reduce-scatter's input depends on the first's result
    group = mesh._flatten().get_group().group_name

    def fn(a, b):
        ra = _rs(a, group)
        return ra, _rs(b * ra.sum(), group)

    gm = _trace(fn, *_fakes((8,), (8,)))
    bucketed, stats = _bucket(gm, _ctx())
    assert stats.buckets == 0 and _n(bucketed, RS) == 2


def test_byte_limit_cuts_buckets(mesh):
    group = mesh._flatten().get_group().group_name

    def fn(a, b, c, x):
        return x * _ag_world(a, group), x * _ag_world(b, group), x * _ag_world(c, group)

    gm = _trace(fn, *_fakes((2,), (2,), (2,), (8,)))
    bucketed, stats = _bucket(gm, _ctx(bucket_bytes=16))  # two 8-byte inputs per bucket
    assert (stats.buckets, stats.collectives_merged, _count(bucketed)) == (1, 2, 2)
    _check_same(gm, bucketed, _inputs((2,), (2,), (2,), (8,)))


def test_peak_memory_guard(mesh):
    """Bucketing that would raise the estimated peak by more than
    bucket_peak_growth is undone (tiny graphs: any bucket does)."""
    gm = _trace(_layer_fn(mesh), *_fakes((2,), (1, 3), (8,)))
    loose, s_loose = _bucket(gm, _ctx())
    assert s_loose.buckets == 1 and s_loose.peak_memory_after > s_loose.peak_memory_before * 1.05
    strict, s_strict = _bucket(gm, _ctx(bucket_peak_growth=0.05))
    assert s_strict.buckets == 0 and _count(strict) == 2
    assert s_strict.peak_memory_after == s_strict.peak_memory_before == s_loose.peak_memory_before


# ---------------------------------------------------------------------------
# the tiny LLaMA-3 plan on dp x tp = 2 x 2


def _plan_and_apply(mesh, variants):
    from test_apply import MODELS

    from autoparallel import AutoParallel

    build, tokens = MODELS["llama"]
    with torch.device("meta"):
        model = build()
    out = {}
    with AutoParallel(model, mesh, torch.empty_like(tokens(), device="meta")) as autop:
        batch = (Shard(0), Shard(0))
        autop.add_input_constraints([batch])
        autop.add_output_constraints([batch])
        pin_hand_layout(autop, "FSDP")  # the gathers bucketing merges (the toy model may plan TP)
        plan = autop.optimize_placement()
        # LocalTensorMode simulates only sorted groups: column-major chains of
        # tp-outer parameters gather on the row-major group and reorder
        options = PassOptions(column_major_all_gather="reorder")
        for name, disabled in variants.items():
            out[name] = (
                autop.apply_placement(plan, disable_passes=disabled, pass_options=options),
                dict(plan.pass_stats),
            )
    return out


def test_llama_debug_2x2_buckets_and_matches_reference(fake_world):
    from test_apply import _train_and_compare

    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    v = _plan_and_apply(mesh, {"on": (), "off": ("bucket_collectives",)})
    parallel, pass_stats = v["on"]
    stats = pass_stats["bucket_collectives"]
    for kind, attr in (("forward", "forward_graph"), ("backward", "backward_graph")):
        s = stats[kind]
        assert s.buckets >= 2 and s.collectives_merged > s.buckets, (kind, s)
        assert s.by_kind == {"all_gather": s.collectives_merged}
        before, after = _count(getattr(v["off"][0], attr)), _count(getattr(parallel, attr))
        assert after == before - (s.collectives_merged - s.buckets), kind
        check_topological(getattr(parallel, attr))
    # schedule_overlap prefetches the buckets like the gathers they replace
    sched = pass_stats["schedule_overlap"]["forward"]
    assert sched.prefetched_all_gathers > 0
    _train_and_compare("llama", parallel, mesh, steps=1)


def test_two_stage_gathers_bucket_both_stages(mesh):
    """Parameters sharded on both mesh dims are gathered on dp, then the
    results on tp: the first stages share one bucket, the second stages
    (inputs: views of the first bucket's outputs) another, in a later round."""

    def fn(a, b, x):
        ga = _ag(_ag(a, mesh, 0), mesh, 1)  # (2,) -> (4,) -> (8,)
        gb = _ag(_ag(b, mesh, 0).t().contiguous(), mesh, 1)  # (1, 3) -> (2, 3) -> (3, 2) -> (6, 2)
        return x * ga, gb * x.sum()

    gm = _trace(fn, *_fakes((2,), (1, 3), (8,)))
    bucketed = copy.deepcopy(gm)
    names = [p.name for p in bucketed.graph.find_nodes(op="placeholder")][:2]
    ctx = _ctx()
    ctx.local = types.SimpleNamespace(
        param_fqns=["layers.0.a", "layers.0.b"], buffer_fqns=[], primal_names=lambda: names
    )
    stats = bucket_collectives(bucketed, ctx)
    bucketed.graph.lint()
    check_topological(bucketed)
    assert (stats.buckets, stats.collectives_merged, _count(gm), _count(bucketed)) == (2, 4, 4, 2)
    # the second stage reads the first buffer's parts as they are: neither
    # the contiguous copy out of the first buffer (ga) nor gb's transpose
    # copy is made; each parameter is copied out of the second buffer
    assert (stats.copies_removed, stats.copies_out) == (2, 4)
    _check_same(gm, bucketed, _inputs((2,), (1, 3), (8,)))
    # without parameter names a gather of a collective's result is not known
    # to be a parameter's: only the first stages bucket
    _, bare = _bucket(gm, _ctx())
    assert (bare.buckets, bare.collectives_merged) == (1, 2)


def test_reduce_scatters_before_a_local_reorder_bucket(mesh):
    """Two-stage reduce-scatters of dim-1 gradients: the first stage (tp)
    result is reordered locally (split + cat) before the second stage (dp).
    The reorder moves after the merged first-stage wait, so both stages
    bucket: 4 reductions -> 2, same results."""
    dp, tp = (mesh.get_group(d).group_name for d in (0, 1))

    def rs(x, size, group):
        return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(x, "sum", size, group))

    def two_stage(g):  # g: (4, 8), reduced and sharded on dim 1 over tp, then dim 0 over dp
        chunks = torch.cat(torch.split(g, 4, 1))  # (8, 4): tp chunks of dim 1 stacked
        r = rs(chunks, 2, tp)  # (4, 4)
        r = torch.cat(torch.split(r, 2, 0), 1)  # a local reorder, (2, 8)
        return rs(r.contiguous(), 2, dp)  # (1, 8)

    def fn(a, b, x):
        return two_stage(a * x.sum()), two_stage(b * 2.0)

    gm = _trace(fn, *_fakes((4, 8), (4, 8), (5,)))
    bucketed, stats = _bucket(gm, _ctx())
    assert stats.by_kind == {"reduce_scatter": 4} and stats.buckets == 2, stats
    assert _n(bucketed, RS) == 2
    _check_same(gm, bucketed, _inputs((4, 8), (4, 8), (5,)))
