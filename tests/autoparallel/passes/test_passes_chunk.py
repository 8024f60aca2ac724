"""chunk_regions: module regions of the joint graph split in two chunks.

Hand-built graphs (make_fx with module-path annotations): batch chunking of a
two-matmul region with a collective between them (parameter all-gather
chains shared, activation part duplicated and interleaved, outputs
concatenated, weight gradients summed once before their reduce-scatter);
bitwise equality with eager module-level chunking on 2 LocalTensorMode
ranks, fp32 tolerance against the unchunked graph; refusals with reasons.
Then the whole pipeline: tiny LLaMA-3 (2x2, compute sharded: TP + batch)
and tiny MoE (2x2, experts pinned FSDP x EP), chunked, match the
single-device step (loss and every gradient).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.fx.traceback as fxt
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel import AutoParallel
from autoparallel.passes import PassOptions
from autoparallel.passes.chunk_regions import CHUNK_KEY, chunk_graph, region_of

sys.path.insert(0, str(Path(__file__).parents[1]))
from _parity import batch_placement, check_step, slow_compute_device  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
AG, AR, RS = c10d.all_gather_into_tensor.default, c10d.all_reduce.default, c10d.reduce_scatter_tensor.default
B, D, H, WORLD = 8, 16, 32, 2


def _two_matmuls(group: str):
    """A joint-like step: forward y = allreduce(relu(x @ gather(w1))) @ w2,
    backward grad of w2 (a sum over the batch) reduce-scattered."""

    def step(x, w1_shard, w2, g):
        with fxt.annotate({"module_path": "layers.0.mlp"}):
            w1 = c10d.wait_tensor(c10d.all_gather_into_tensor(w1_shard, WORLD, group))
            h = torch.relu(x @ w1)
            h = c10d.wait_tensor(c10d.all_reduce(h, "sum", group))
            y = h @ w2
            gw2 = c10d.wait_tensor(c10d.reduce_scatter_tensor(h.t() @ g, "sum", WORLD, group))
        return y * 2, gw2

    return step


def _trace(fn, *shapes):
    with FakeTensorMode():
        args = [torch.randn(*s) for s in shapes]
        with fxt.preserve_node_meta():
            return make_fx(fn)(*args)


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.target is target)


def _placeholders(gm):
    return list(gm.graph.find_nodes(op="placeholder"))


def test_region_of():
    assert region_of("layers.3.moe.gate", "layers.*.moe") == "layers.3.moe"
    assert region_of("layers.3.moe", "layers.*.moe") == "layers.3.moe"
    assert region_of("layers.3.attention", "layers.*.moe") is None
    assert region_of("layers", "layers.*.moe") is None
    assert region_of(None, "layers.*") is None


def test_two_matmuls_batch_chunked(fake_world):
    fake_world(WORLD)
    step = _two_matmuls(dist.group.WORLD.group_name)
    gm = _trace(step, (B, D), (D // WORLD, H), (H, D), (B, D))
    x, w1, w2, g = _placeholders(gm)
    mm_before = _count(gm, aten.mm.default)
    n_before = len(gm.graph.nodes)
    stats = chunk_graph(gm, {"layers.*.mlp": "batch"}, {"batch": {x: 0, g: 0}})
    gm.graph.lint()
    assert stats.regions_chunked == 1 and not stats.refused
    assert stats.live_ins_split == 2  # x and the incoming gradient
    # the parameter's all-gather is shared, never duplicated; the
    # activation all-reduce is (one per chunk); the weight gradient is
    # summed once, before its single reduce-scatter
    assert _count(gm, AG) == 1 and _count(gm, AR) == 2 and _count(gm, RS) == 1
    assert _count(gm, aten.mm.default) == 2 * mm_before
    (ag,) = gm.graph.find_nodes(op="call_function", target=AG)
    assert CHUNK_KEY not in ag.meta
    (rs,) = gm.graph.find_nodes(op="call_function", target=RS)
    assert rs.args[0].target is aten.add.Tensor
    # chunk B's copy right after chunk A's node: the interleave the
    # scheduler turns into overlap (A's all-reduce issued before B's relu)
    nodes = list(gm.graph.nodes)
    ars = [nodes.index(n) for n in gm.graph.find_nodes(op="call_function", target=AR)]
    assert ars[1] == ars[0] + 1
    # the output is rebuilt by concatenation along the batch
    (out,) = gm.graph.find_nodes(op="output")
    y = out.args[0][0]
    assert y.args[0].target is aten.cat.default and y.args[0].args[1] == 0
    assert tuple(y.meta["val"].shape) == (B, D)
    # 2 splits (3 nodes each), 7 chunk-B copies (mm, relu, all_reduce, wait,
    # mm, t, mm), one cat, one add
    assert stats.nodes_added == len(nodes) - n_before == 2 * 3 + 7 + 2
    # the figures with their unit
    (said,) = stats.chunked.values()
    assert re.fullmatch(rf"\+{stats.nodes_added} nodes, exposed communication [\d.]+ (ms|us) -> [\d.]+ (ms|us)", said)


def test_late_gradient_sums_reduce_each_chunk(fake_world):
    """chunk_early_grad_sum=False: each chunk's weight gradient goes through
    its own reduce-scatter (A's can overlap B's compute), added after; the
    same numbers within fp32 rounding."""
    fake_world(WORLD)
    group = dist.group.WORLD.group_name
    step = _two_matmuls(group)
    gm = _trace(step, (B, D), (D // WORLD, H), (H, D), (B, D))
    ref_gm = _trace(step, (B, D), (D // WORLD, H), (H, D), (B, D))
    x, w1, w2, g = _placeholders(gm)
    stats = chunk_graph(gm, {"layers.*.mlp": "batch"}, {"batch": {x: 0, g: 0}}, early_sums=False)
    assert stats.regions_chunked == 1
    assert _count(gm, RS) == 2 and _count(gm, AG) == 1
    (out,) = gm.graph.find_nodes(op="output")
    gw = out.args[0][1]
    assert gw.target is aten.add.Tensor and all(a.target is c10d.wait_tensor.default for a in gw.args)
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(*s, generator=gen) for s in ((WORLD, B, D), (WORLD, D // WORLD, H), (H, D), (WORLD, B, D))]
    with LocalTensorMode(WORLD) as lm:
        args = [lm.rank_map(lambda r, t=t: t[r].clone()) for t in (full[0], full[1])]
        args += [lm.rank_map(lambda r: full[2].clone()), lm.rank_map(lambda r: full[3][r].clone())]
        for a, b in zip(gm(*args), ref_gm(*args)):
            for r in range(WORLD):
                torch.testing.assert_close(a._local_tensors[r], b._local_tensors[r], rtol=1e-5, atol=1e-5)


def _eager_chunked(x, w1, w2, g, group):
    """Eager module-level chunking: the region on each half, outputs
    concatenated, the weight gradient added before its reduce-scatter."""
    ys, gws = [], []
    for xh, gh in zip(x.chunk(2), g.chunk(2)):
        w = c10d.wait_tensor(c10d.all_gather_into_tensor(w1, WORLD, group))
        h = c10d.wait_tensor(c10d.all_reduce(torch.relu(xh @ w), "sum", group))
        ys.append(h @ w2)
        gws.append(h.t() @ gh)
    gw2 = c10d.wait_tensor(c10d.reduce_scatter_tensor(gws[0] + gws[1], "sum", WORLD, group))
    return torch.cat(ys) * 2, gw2


def test_chunked_bitwise_equals_eager_chunking_localtensor(fake_world):
    fake_world(WORLD)
    group = dist.group.WORLD.group_name
    step = _two_matmuls(group)
    gm = _trace(step, (B, D), (D // WORLD, H), (H, D), (B, D))
    ref_gm = _trace(step, (B, D), (D // WORLD, H), (H, D), (B, D))
    x, w1, w2, g = _placeholders(gm)
    chunk_graph(gm, {"layers.*.mlp": "batch"}, {"batch": {x: 0, g: 0}})
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(*s, generator=gen) for s in ((WORLD, B, D), (WORLD, D // WORLD, H), (H, D), (WORLD, B, D))]
    with LocalTensorMode(WORLD) as lm:
        args = [lm.rank_map(lambda r, t=t: t[r].clone()) for t in (full[0], full[1])]
        args += [lm.rank_map(lambda r: full[2].clone()), lm.rank_map(lambda r: full[3][r].clone())]
        got = gm(*args)
        eager = _eager_chunked(*args, group)
        unchunked = ref_gm(*args)
        for r in range(WORLD):
            for a, b, c in zip(got, eager, unchunked):
                a, b, c = a._local_tensors[r], b._local_tensors[r], c._local_tensors[r]
                assert torch.equal(a, b), (r, (a - b).abs().max())
                torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def _gathered_outside_and_inside(group: str):
    """Sequence-parallel shape: ``x`` (this rank's rows) is gathered before
    the region (a replicated activation), the incoming gradient ``g``
    inside it; the weight gradient pairs their rows, the output leaves
    with the gathered rows."""

    def step(x, w, g):
        xg = c10d.wait_tensor(c10d.all_gather_into_tensor(x, WORLD, group))
        with fxt.annotate({"module_path": "layers.0.mlp"}):
            gg = c10d.wait_tensor(c10d.all_gather_into_tensor(g, WORLD, group))
            return (xg @ w).relu(), xg.t() @ gg

    return step


def _scattered_inside(group: str):
    """The region reads every row (replicated) and reduce-scatters its
    result to this rank's rows, which leave it."""

    def step(x, w, b):
        with fxt.annotate({"module_path": "layers.0.mlp"}):
            h = c10d.wait_tensor(c10d.reduce_scatter_tensor(x @ w, "sum", WORLD, group))
            return h * b

    return step


def _sum_bound(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """What reordering the row sum of ``x.t() @ y`` may change, per entry
    (docs/chunking.md): ``2 * n * eps * (|x|.t() @ |y|)``, n the rows."""
    return 2 * x.shape[0] * torch.finfo(x.dtype).eps * (x.abs().t() @ y.abs())


def test_rows_gathered_inside_and_outside_the_region_line_up(fake_world):
    """The region gathers the gradient's rows over the mesh and pairs them
    with rows gathered before it: each chunk must hold every rank's half of
    both. Bitwise chunking (contiguous halves of every live-in) refuses;
    the default splits the gathered live-in rank by rank (and rebuilds the
    output rank by rank): the output equals the unchunked one bitwise, the
    weight gradient within the reordered-sum bound."""
    fake_world(WORLD)
    group = dist.group.WORLD.group_name
    step = _gathered_outside_and_inside(group)
    shapes = ((B // 2, D), (D, H), (B // 2, D))
    gm = _trace(step, *shapes)
    x, _, g = _placeholders(gm)
    stats = chunk_graph(gm, {"layers.*.mlp": "batch"}, {"batch": {x: 0, g: 0}}, exactness="bitwise")
    assert stats.regions_chunked == 0
    (why,) = stats.refused.values()
    assert "combines rows in different orders" in why and "chunk_exactness='tolerance'" in why, why
    stats = chunk_graph(gm, {"layers.*.mlp": "batch"}, {"batch": {x: 0, g: 0}})
    gm.graph.lint()
    assert stats.regions_chunked == 1 and not stats.refused, stats.refused
    assert _count(gm, AG) == 3  # the gradient's gathered per chunk, x's once outside
    ref_gm = _trace(step, *shapes)
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(WORLD, *s, generator=gen) for s in shapes]
    with LocalTensorMode(WORLD) as lm:
        args = [lm.rank_map(lambda r, t=t: t[r].clone()) for t in full]
        got, ref = gm(*args), ref_gm(*args)
    xg, gg = full[0].reshape(B, D), full[2].reshape(B, D)
    for r in range(WORLD):
        assert torch.equal(got[0]._local_tensors[r], ref[0]._local_tensors[r])
        diff = (got[1]._local_tensors[r] - ref[1]._local_tensors[r]).abs()
        assert (diff <= _sum_bound(xg, gg)).all(), diff.max()


def test_rows_scattered_inside_the_region_leave_it_whole(fake_world):
    """The region reduce-scatters its rows (each rank keeps its half): a
    contiguous half of the replicated input would scatter to rows of other
    ranks. The default splits the input rank by rank, so that each chunk
    holds half of this rank's rows after the scatter."""
    fake_world(WORLD)
    group = dist.group.WORLD.group_name
    step = _scattered_inside(group)
    shapes = ((B, D), (D, H), (B // WORLD, H))
    gm = _trace(step, *shapes)
    x, _, b = _placeholders(gm)
    seeds = {"batch": {x: 0, b: 0}}
    stats = chunk_graph(gm, {"layers.*.mlp": "batch"}, seeds, exactness="bitwise")
    assert stats.regions_chunked == 0, "bitwise chunking of scattered rows"
    stats = chunk_graph(gm, {"layers.*.mlp": "batch"}, seeds)
    assert stats.regions_chunked == 1 and not stats.refused, stats.refused
    ref_gm = _trace(step, *shapes)
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(WORLD, *s, generator=gen) for s in shapes]
    with LocalTensorMode(WORLD) as lm:
        args = [lm.rank_map(lambda r, t=t: t[r].clone()) for t in full]
        got, ref = gm(*args), ref_gm(*args)
    for r in range(WORLD):
        # row-wise work and a sum over ranks (not over the split rows): the same bits
        assert torch.equal(got._local_tensors[r], ref._local_tensors[r])


def _annotated(fn, path="layers.0.block"):
    def wrapped(*args):
        with fxt.annotate({"module_path": path}):
            return fn(*args)

    return wrapped


def _chunk_one(fn, shapes, seeds, mode="batch"):
    gm = _trace(_annotated(fn), *shapes)
    ph = _placeholders(gm)
    stats = chunk_graph(gm, {"layers.*.block": mode}, {mode: {ph[i]: d for i, d in seeds.items()}})
    return gm, stats


def test_coinciding_dims_are_told_apart():
    # batch == hidden == 16: the weight gradient x.t() @ g has the batch's
    # size on both dims but carries no batch dim (a sum over it)
    def step(x, w, g):
        y = x @ w
        return y.relu(), x.t() @ g

    gm, stats = _chunk_one(step, [(16, 16), (16, 16), (16, 16)], {0: 0, 2: 0})
    assert stats.regions_chunked == 1, stats.refused
    (out,) = gm.graph.find_nodes(op="output")
    assert out.args[0][0].target is aten.cat.default and out.args[0][0].args[1] == 0
    assert out.args[0][1].target is aten.add.Tensor
    x, w, g = (torch.randn(16, 16, generator=torch.Generator().manual_seed(k)) for k in range(3))
    for a, b in zip(gm(x, w, g), step(x, w, g)):
        torch.testing.assert_close(a, b)


def _mask_outside(q):
    """A causal mask built outside the region with the literal batch, as
    Hugging Face models build theirs, then attention inside it."""
    b, h, s, _ = q.shape
    mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s)
    with fxt.annotate({"module_path": "layers.0.block"}):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask) * 2


@pytest.mark.parametrize(
    "name, step, shapes, seeds",
    [
        ("bias built outside", _annotated(lambda x, t: x * 3 + t), [(8, 16), (8, 1)], {0: 0}),
        ("position table outside", _annotated(lambda x, t: (x + t).relu()), [(4, 8, 16), (8, 16)], {0: 1}),
        ("inferred view size", _annotated(lambda x: x.reshape(-1, 16).relu() * 2), [(4, 8, 16)], {0: 0}),
        ("mask outside", _mask_outside, [(4, 2, 8, 4)], {0: 0}),
    ],
)
def test_values_lining_up_with_the_split_are_split(name, step, shapes, seeds):
    """A value the region reads with the split dim (a bias, a position
    table under sequence chunking, an attention mask built outside the
    region with the literal batch) is split with it: each chunk reads its
    own half; ``-1`` view sizes resolve. Same numbers as unchunked."""
    mode = "seq" if name.startswith("position") else "batch"
    gm = _trace(step, *shapes)
    ph = _placeholders(gm)
    stats = chunk_graph(gm, {"layers.*.block": mode}, {mode: {ph[i]: d for i, d in seeds.items()}})
    gm.graph.lint()
    assert stats.regions_chunked == 1, stats.refused
    # the seeded input split, and the value lining up with it
    assert _count(gm, aten.split.Tensor) == (1 if "view" in name else 2)
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=gen) for s in shapes]
    torch.testing.assert_close(gm(*args), step(*args), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "name, fn, shapes, seeds, mode, reason",
    [
        ("norm over the batch", lambda x: (x - x.mean(0)) * 2, [(8, 16)], {0: 0}, "batch", "split dim"),
        ("sum used per chunk", lambda x: x * x.sum(0), [(8, 16)], {0: 0}, "batch", "sum over the split dim"),
        ("softmax over the batch", lambda x: x.softmax(0), [(8, 16)], {0: 0}, "batch", "acts along the split dim"),
        ("odd batch", lambda x: x.relu() * 2, [(7, 16)], {0: 0}, "batch", "odd size"),
        ("merge with an outer dim", lambda x: x.reshape(-1) * 2, [(4, 8)], {0: 1}, "batch", "mixes split dim"),
        (
            "attention under seq chunking",
            lambda q: F.scaled_dot_product_attention(q, q, q),
            [(2, 2, 8, 4)],
            {0: 2},
            "seq",
            "attention",
        ),
        ("dropout", lambda x: F.dropout(x, 0.5), [(8, 16)], {0: 0}, "batch", "random"),
    ],
)
def test_refusals(name, fn, shapes, seeds, mode, reason):
    gm, stats = _chunk_one(fn, shapes, seeds, mode)
    assert stats.regions_chunked == 0 and stats.regions_refused == 1, name
    (why,) = stats.refused.values()
    assert reason in why, (name, why)
    assert not any(CHUNK_KEY in n.meta for n in gm.graph.nodes)


def test_a_layout_change_to_one_row_per_rank_is_named():
    """A live-in that a layout change (a redistribution's slice to this
    rank's rows) left with one row on the split dim cannot be halved: the
    refusal says where the split dim was lost and why."""
    from autoparallel.apply.redistribute import REDISTRIBUTE_KEY

    def step(x):
        y = x[0:1]  # this rank's row of a batch split over a mesh dim of 2
        with fxt.annotate({"module_path": "layers.0.block"}):
            return y.relu() * 2

    gm = _trace(step, (2, 16))
    (sliced,) = gm.graph.find_nodes(op="call_function", target=aten.slice.Tensor)
    sliced.meta[REDISTRIBUTE_KEY] = ("x->relu", "to S(0)")
    stats = chunk_graph(gm, {"layers.*.block": "batch"}, {"batch": {_placeholders(gm)[0]: 0}})
    assert stats.regions_chunked == 0
    (why,) = stats.refused.values()
    assert why.startswith(f"cannot tell the split dim of live-in {sliced.name} (feeding "), why
    assert f"a layout change ({sliced.name}) leaves size 1 per rank on the split dim 0, which does not halve" in why


def test_nothing_chunked_is_said_in_one_line_per_reason(caplog):
    """Every region refused: one warning saying nothing was chunked, one
    line per distinct reason (not one per region, not one giant line)."""
    import logging

    def step(x):
        for k in range(4):
            with fxt.annotate({"module_path": f"layers.{k}.block"}):
                x = x.softmax(0) * 2
        return x

    gm = _trace(step, (8, 16))
    with caplog.at_level(logging.INFO, logger="autoparallel.passes.chunk_regions"):
        stats = chunk_graph(gm, {"layers.*.block": "batch"}, {"batch": {_placeholders(gm)[0]: 0}})
    assert stats.regions_chunked == 0 and stats.regions_refused == 4
    assert stats.summary() == "chunk_regions: nothing chunked: all 4 matching region(s) refused"
    (reason,) = stats.refusal_lines()
    assert reason.startswith("  refused 4 (layers.0.block ... layers.3.block): _softmax (aten._softmax.default) acts")
    (record,) = [r for r in caplog.records if r.levelname == "WARNING"]
    lines = record.getMessage().splitlines()
    assert lines[0] == stats.summary() and len(lines) == 1 + len(stats.refusal_lines())
    assert all(len(line) < 200 for line in lines), lines


def test_unknown_mode_is_an_error():
    gm = _trace(_annotated(lambda x: x * 2), (8, 4))
    with pytest.raises(ValueError, match="mode must be one of"):
        chunk_graph(gm, {"layers.*.block": "heads"}, {})


# ---------------------------------------------------------------------------
# the whole pipeline: tiny models on 2x2 (4 LocalTensorMode ranks)

LOCAL = dict(column_major_all_gather="reorder")


@pytest.mark.parametrize("n_layers", [2, pytest.param(6, marks=pytest.mark.slow)])
def test_llama3_tp_chunked_matches_single_device(fake_world, n_layers):
    """2 layers: the full graph; 6: layer folding (chunked on the folded
    graph, then unfolded)."""
    from autoparallel.models import LLAMA3_CONFIGS, Transformer

    fake_world(4)
    args = dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=n_layers)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = Transformer(args)

        def forward(self, tokens):
            return self.body(tokens).float().pow(2).mean()

    tokens = torch.randint(0, args.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Loss()
    # a slow compute device: the plan shards heads over tp and batch over both
    with AutoParallel(model, mesh, (tokens.to("meta"),), device=slow_compute_device()) as autop:
        autop.add_input_constraints([batch_placement(tokens, mesh)])
        plan = autop.optimize_placement()
        modules = {"body.layers.*.attention": "batch", "body.layers.*.feed_forward": "batch"}
        parallel = autop.apply_placement(plan, pass_options=PassOptions(**LOCAL, chunk_modules=modules))
    stats = plan.pass_stats["chunk_regions"]
    # every feed-forward chunks; an attention region whose plan gathers
    # along the split dim inside it is refused, naming why
    assert stats.regions_chunked >= args.n_layers, stats.refused
    assert stats.regions_chunked + stats.regions_refused == 2 * args.n_layers
    assert all("feed_forward" not in region for region in stats.refused), stats.refused
    assert stats.nodes_added > 0 and stats.live_ins_split > 0
    assert bool(parallel.parallel_state.local.extra.get("folded")) == (n_layers > 4)
    check_step(parallel, mesh, Loss, (tokens,))


def _moe_chunked(args, modules, a2a: bool = False, batch: int = 8, local_tensor: bool = True):
    """Tiny MoE on 2x2, experts pinned FSDP x EP; ``a2a``: the routed ops'
    outputs pinned token-sharded, so EP runs as all-to-all dispatch (split
    into phases by split_moe_a2a) instead of gather/reduce-scatter;
    ``local_tensor=False``: for real (gloo) processes."""
    from autoparallel.api import DEFAULT_TIME_LIMIT
    from autoparallel.models import MoETransformer

    mesh = init_device_mesh("cpu", (2, 2))
    with torch.device("meta"):
        model = MoETransformer(args)
    x = torch.empty(batch, 8, dtype=torch.long, device="meta")
    # real processes each solve, sharing the cores: give HiGHS time
    # a2a: the role 'ep' on mesh dim 1 asks for all-to-all expert dispatch there
    roles = {1: "ep"} if a2a else None
    limit = DEFAULT_TIME_LIMIT if local_tensor else 300
    with AutoParallel(model, mesh, x, time_limit=limit, mesh_roles=roles) as autop:
        autop.add_input_constraints([(Shard(0), Shard(0))])
        autop.add_output_constraints([(Shard(0), Shard(0))])
        for fqn, n in autop.traced.param_nodes.items():
            if fqn.endswith(("moe.w1", "moe.w2", "moe.w3")):
                autop.add_node_constraint(n, (Shard(2), Shard(0)))  # FSDP x EP
        if a2a:
            # At this toy size the solver keeps tokens replicated around the
            # routed op and gathers or reduce-scatters them inside the MoE
            # region (collectives along the split dim, which chunking refuses
            # or cannot rebuild): pin the region's input token-sharded, as a
            # real-size plan has it.
            from autoparallel.capture.tracing import module_path

            for n in autop.strategies:
                if n.target is torch.ops.autoparallel.moe_experts.default:
                    autop.add_node_constraint(n, (Shard(0), Shard(0)))
                if (module_path(n) or "").endswith(".moe"):
                    for a in n.all_input_nodes:
                        if (module_path(a) or "").endswith(".ffn_norm"):
                            autop.add_node_constraint(a, (Shard(0), Shard(0)))
        plan = autop.optimize_placement()
        options = PassOptions(**LOCAL, chunk_modules=modules) if local_tensor else PassOptions(chunk_modules=modules)
        parallel = autop.apply_placement(plan, pass_options=options)
    return parallel, plan, mesh


@pytest.mark.slow  # 30-110 s: the tiny MoE planned, applied chunked and compared
def test_moe_ep_chunked_matches_single_device(fake_world, monkeypatch):
    import test_moe
    from autoparallel.models import MOE_CONFIGS

    fake_world(4)
    # the balance loss off; with it on: test_moe_with_balance_loss_chunked_matches_single_device
    args = dataclasses.replace(MOE_CONFIGS["debug"], n_layers=2, aux_loss_alpha=0.0)
    parallel, plan, mesh = _moe_chunked(args, {"layers.*.moe": "batch"})
    stats = plan.pass_stats["chunk_regions"]
    assert stats.regions_chunked == 1 and not stats.refused
    monkeypatch.setattr(test_moe, "BATCH", 8)
    test_moe._compare_one_step(parallel, mesh, args)


@pytest.mark.slow  # 30-110 s: the tiny MoE planned, applied chunked and compared
def test_moe_a2a_chunked_matches_single_device(fake_world, monkeypatch):
    """All-to-all EP on mesh dim 1, the MoE region chunked along the batch:
    each chunk routes, exchanges and combines its own tokens (the phases of
    split_moe_a2a), the expert weight gradients are summed once; loss and
    every gradient equal single device."""
    import test_moe
    from autoparallel.models import MOE_CONFIGS

    fake_world(4)
    args = dataclasses.replace(MOE_CONFIGS["debug"], n_layers=2, aux_loss_alpha=0.0)
    # 4 sequences per rank: the all-to-all's [group 2, per-rank 2] rows halve per chunk
    parallel, plan, mesh = _moe_chunked(args, {"layers.*.moe": "batch"}, a2a=True, batch=16)
    stats = plan.pass_stats["chunk_regions"]
    assert stats.regions_chunked == 1 and not stats.refused, stats.refused
    ops = torch.ops.autoparallel
    targets = [n.target for n in parallel.parallel_graph.graph.nodes]
    # two chunks: every phase twice per MoE layer, forward and backward
    assert targets.count(ops.moe_a2a_exchange.default) == 2 * 2 * 2
    assert targets.count(ops.moe_a2a_expert_rows_backward.default) == 2
    monkeypatch.setattr(test_moe, "BATCH", 16)
    test_moe._compare_one_step(parallel, mesh, args)


@pytest.mark.slow
def test_moe_with_balance_loss_chunked_matches_single_device(fake_world, monkeypatch):
    """The sequence-wise balance loss on: the MoE region chunked along the
    batch still equals single device (loss and every gradient), so
    chunking it is allowed, not refused."""
    import test_moe
    from autoparallel.models import MOE_CONFIGS

    fake_world(4)
    args = dataclasses.replace(MOE_CONFIGS["debug"], n_layers=2)
    assert args.aux_loss_alpha > 0
    parallel, plan, mesh = _moe_chunked(args, {"layers.*.moe": "batch"})
    stats = plan.pass_stats["chunk_regions"]
    assert stats.regions_chunked == 1 and not stats.refused, stats.refused
    monkeypatch.setattr(test_moe, "BATCH", 8)
    test_moe._compare_one_step(parallel, mesh, args)


# ---------------------------------------------------------------------------
# real processes: 4 gloo ranks, 2x2 mesh, chunked MoE (slow: every rank plans)


def _chunked_moe_gloo_step(rank: int, world: int) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message="DTensor random operators")
    from autoparallel.models import MOE_CONFIGS, MoETransformer

    args = dataclasses.replace(MOE_CONFIGS["debug"], n_layers=2, aux_loss_alpha=0.0)
    mesh = init_device_mesh("cpu", (2, 2))
    batch, seq = 8, 8
    with torch.device("meta"):
        model = MoETransformer(args)
    # four processes each solve, sharing the cores: give HiGHS time
    with AutoParallel(model, mesh, torch.empty(batch, seq, dtype=torch.long, device="meta"), time_limit=300) as autop:
        autop.add_input_constraints([(Shard(0), Shard(0))])
        autop.add_output_constraints([(Shard(0), Shard(0))])
        for fqn, n in autop.traced.param_nodes.items():
            if fqn.endswith(("moe.w1", "moe.w2", "moe.w3")):
                autop.add_node_constraint(n, (Shard(2), Shard(0)))
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan, pass_options=PassOptions(chunk_modules={"layers.*.moe": "batch"}))
    assert plan.pass_stats["chunk_regions"].regions_chunked == 1, plan.pass_stats["chunk_regions"].refused
    from _moe_parity import check_moe_step

    check_moe_step(parallel, args, batch, seq, rank, world, buffers=False)


@pytest.mark.slow
def test_chunked_moe_gloo_2x2():
    from _dist_utils import run_ranks

    run_ranks(_chunked_moe_gloo_step, 4, timeout=600)


def _chunked_a2a_moe_gloo_step(rank: int, world: int) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message="DTensor random operators")
    from autoparallel.models import MOE_CONFIGS

    args = dataclasses.replace(MOE_CONFIGS["debug"], n_layers=2, aux_loss_alpha=0.0)
    parallel, plan, _ = _moe_chunked(args, {"layers.*.moe": "batch"}, a2a=True, batch=16, local_tensor=False)
    assert plan.pass_stats["chunk_regions"].regions_chunked == 1, plan.pass_stats["chunk_regions"].refused
    exchanges = [
        n for n in parallel.parallel_graph.graph.nodes if n.target is torch.ops.autoparallel.moe_a2a_exchange.default
    ]
    assert len(exchanges) == 8  # 2 chunks x (out, back) x (forward, backward)
    from _moe_parity import check_moe_step

    check_moe_step(parallel, args, 16, 8, rank, world, buffers=False)


@pytest.mark.slow
def test_chunked_a2a_moe_gloo_2x2():
    """All-to-all EP split into phases and chunked, on 4 gloo processes:
    asynchronous variable-size all_to_all_single per chunk, waited on by
    wait_tensor; loss and gradients equal single device."""
    from _dist_utils import run_ranks

    run_ranks(_chunked_a2a_moe_gloo_step, 4, timeout=600)
