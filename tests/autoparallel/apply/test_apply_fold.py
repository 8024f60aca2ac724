"""Layer folding (autoparallel.apply.fold / unfold): apply builds and
partitions four layers of a deep stack and copies the middle one; the
forward and backward graphs must be the ones a full apply gives, node for
node and in the same order, and the step must compute the reference's
loss and gradients."""

from __future__ import annotations

import collections
import dataclasses
import logging

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import autoparallel.apply_plan as apply_plan_mod
from autoparallel import AutoParallel
from autoparallel.apply.fingerprint import differences, fingerprint, node_hashes
from autoparallel.apply.fold import MIN_LAYERS, FoldRejected, fold_layers
from autoparallel.apply.unfold import FOLD_KEY, check_shift, layer_tags
from autoparallel.models import LLAMA3_CONFIGS, Transformer, apply_ac

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

ARGS = dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=MIN_LAYERS)
BATCH, SEQ = 8, 16


def _tokens():
    return torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _plan(mesh_shape, *, ac="selective", args=ARGS, mp_policy=None):
    mesh = init_device_mesh("cpu", mesh_shape)
    with torch.device("meta"):
        model = Transformer(args)
    if ac:
        apply_ac(model, ac)
    autop = AutoParallel(model, mesh, torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"), mp_policy=mp_policy)
    autop.__enter__()
    batch = (Shard(0),) * mesh.ndim
    autop.add_input_constraints([batch])
    autop.add_output_constraints([batch])
    return autop, autop.optimize_placement(), mesh


# -- structural equality -----------------------------------------------------------


@pytest.mark.parametrize(
    "passes_on, mixed_precision, ac",
    [
        (True, False, "selective"),
        # full AC: the backward recomputes attention, whose RNG-state wrapper
        # apply drops (dropout-free); the direct call keeps the op's stamps
        (True, False, "full"),
        # slow: the same fold-versus-full comparison as "passes", without the
        # rewrite passes, and with bf16 parameters (~10-15 s idle each;
        # test_apply_mixed_precision.py applies bf16 plans by default)
        pytest.param(False, False, "selective", marks=pytest.mark.slow),
        pytest.param(True, True, "selective", marks=pytest.mark.slow),
    ],
    ids=["passes", "full-ac", "no-passes", "bf16"],
)
def test_folded_graphs_equal_full_graphs(fake_world, passes_on, mixed_precision, ac):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fake_world(8)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    autop, plan, mesh = _plan((2, 4), mp_policy=mp, ac=ac)
    try:
        from autoparallel import passes

        disabled = () if passes_on else tuple(passes.pass_names())
        folded = autop.apply_placement(plan, disable_passes=disabled)
        folded_stats = dict(plan.pass_stats)
        full = autop.apply_placement(plan, disable_passes=disabled, fold_layers=False)
        full_stats = dict(plan.pass_stats)
    finally:
        autop.__exit__(None, None, None)
    assert folded.parallel_state.local.extra.get("folded")
    assert not full.parallel_state.local.extra.get("folded")
    a, b = fingerprint(folded.parallel_state.step.graphs), fingerprint(full.parallel_state.step.graphs)
    assert differences(a, b) == []
    assert str(folded_stats) == str(full_stats)
    # fused (and bucketed) gathers run on the whole mesh, and say so
    from autoparallel.apply import collectives

    groups = {c.group for c in collectives(folded.forward_graph, mesh)}
    assert groups <= {"0", "1", "0*1", "0*1 col-major"}
    fused = folded_stats.get("fuse_all_gathers", {}).get("forward")
    assert bool(groups & {"0*1", "0*1 col-major"}) == bool(fused and fused.fused)
    # the folded joint graph really is smaller
    assert len(folded.parallel_state.local.gm.graph.nodes) < 0.9 * len(full.parallel_state.local.gm.graph.nodes)


def test_folded_llama_matches_reference(fake_world):
    """Loss and every gradient (middle layers included) equal the
    single-device model's, on 8 simulated ranks."""
    fake_world(8)
    autop, plan, mesh = _plan((8,))
    try:
        parallel = autop.apply_placement(plan)
    finally:
        autop.__exit__(None, None, None)
    assert parallel.parallel_state.local.extra.get("folded")
    torch.manual_seed(0)
    ref = Transformer(ARGS)
    ref.init_weights()
    apply_ac(ref, "selective")
    x = _tokens()
    out = ref(x)
    loss = out.pow(2).sum() / out.numel()
    loss.backward()
    n = mesh.size()
    with LocalTensorMode(n) as lm:
        parallel.to_empty(device="cpu")
        parallel.init_weights()
        parallel.load_state_dict(ref.state_dict())
        per = BATCH // n
        local_out = parallel(lm.rank_map(lambda r: x[r * per : (r + 1) * per].clone()))
        (local_out.pow(2).sum() / out.numel()).backward()
        full_out = torch.cat([local_out._local_tensors[r] for r in range(n)])
        grads = {}
        for name, p in parallel.named_parameters():
            assert isinstance(p.grad, DTensor), name
            full = p.grad.full_tensor()
            grads[name] = full.reconcile() if hasattr(full, "reconcile") else full
    torch.testing.assert_close(full_out, out.detach(), rtol=1e-5, atol=1e-5)
    ref_grads = dict(ref.named_parameters())
    assert grads.keys() == ref_grads.keys()
    for name, p in ref_grads.items():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)


# -- when folding does not apply ----------------------------------------------------


def test_too_few_layers_not_folded(fake_world):
    fake_world(4)
    autop, plan = _stack_plan(odd=None, n_layers=MIN_LAYERS - 1)
    try:
        choice = {k: v.option for k, v in plan.nodes.items()}
        with pytest.raises(FoldRejected, match="folding needs"):
            fold_layers(autop.traced, autop.built.strategies, choice, autop.repeats)
        parallel = autop.apply_placement(plan)
    finally:
        autop.__exit__(None, None, None)
    assert not parallel.parallel_state.local.extra.get("folded")


class _Stack(nn.Module):
    """Linear + activation blocks; one middle block uses another activation."""

    def __init__(self, n: int, odd: int | None, dim: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.GELU() if i == odd else nn.ReLU()) for i in range(n)
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def init_weights(self):
        for layer in self.layers:
            layer[0].reset_parameters()


def _stack_plan(odd, n_layers=MIN_LAYERS):
    mesh = init_device_mesh("cpu", (4,))
    with torch.device("meta"):
        model = _Stack(n_layers, odd)
    autop = AutoParallel(model, mesh, torch.empty(8, 16, device="meta"))
    autop.__enter__()
    autop.add_input_constraints([(Shard(0),)])
    autop.add_output_constraints([(Shard(0),)])
    return autop, autop.optimize_placement()


def _apply_stack(odd=None):
    autop, plan = _stack_plan(odd)
    try:
        return autop.apply_placement(plan)
    finally:
        autop.__exit__(None, None, None)


def test_middle_layer_that_differs_is_not_folded(fake_world, caplog):
    fake_world(4)
    autop, plan = _stack_plan(odd=3)
    try:
        choice = {k: v.option for k, v in plan.nodes.items()}
        with pytest.raises(FoldRejected):
            fold_layers(autop.traced, autop.built.strategies, choice, autop.repeats)
        with caplog.at_level(logging.INFO, logger="autoparallel.apply"):
            parallel = autop.apply_placement(plan)
    finally:
        autop.__exit__(None, None, None)
    assert not parallel.parallel_state.local.extra.get("folded")
    assert "layers not folded" in caplog.text


def test_uniform_stack_folds(fake_world):
    fake_world(4)
    parallel = _apply_stack()
    assert parallel.parallel_state.local.extra.get("folded")
    params = [n for n, _ in parallel.named_parameters()]
    assert params == [f"layers.{i}.0.{w}" for i in range(MIN_LAYERS) for w in ("weight", "bias")]


def test_failed_unfold_falls_back_to_full_graphs(fake_world, monkeypatch, caplog):
    fake_world(4)

    def refuse(*args, **kwargs):
        raise FoldRejected("refused for the test")

    monkeypatch.setattr(apply_plan_mod, "unfold_step", refuse)
    with caplog.at_level(logging.WARNING, logger="autoparallel.apply"):
        parallel = _apply_stack()
    assert not parallel.parallel_state.local.extra.get("folded")
    assert "refused for the test" in caplog.text
    assert len(list(parallel.parameters())) == 2 * MIN_LAYERS


# -- check_shift on hand-built graphs ---------------------------------------------


def _layered_graph(second_op=torch.ops.aten.relu.default, skip=False):
    """x -> [layer 1: mm(x, w1) -> op] -> [layer 2: mm(., w2) -> op] -> out."""
    g = fx.Graph()
    x = g.placeholder("x")
    w1 = g.placeholder("w1")
    w2 = g.placeholder("w2")
    w1.meta[FOLD_KEY] = (1, (0, 0))
    w2.meta[FOLD_KEY] = (2, (0, 0))
    m1 = g.call_function(torch.ops.aten.mm.default, (x, w1))
    m1.meta[FOLD_KEY] = (1, (1, 0))
    r1 = g.call_function(torch.ops.aten.relu.default, (m1,))
    r1.meta[FOLD_KEY] = (1, (2, 0))
    m2 = g.call_function(torch.ops.aten.mm.default, (x if skip else r1, w2))
    m2.meta[FOLD_KEY] = (2, (1, 0))
    r2 = g.call_function(second_op, (m2,))
    r2.meta[FOLD_KEY] = (2, (2, 0))
    g.output((r2,))
    return g


def test_check_shift_rejects_reads_that_are_not_shifted():
    g = _layered_graph()
    # layer 2's mm reads layer 1's relu where layer 1's reads the global x:
    # not a shift of each other
    with pytest.raises(FoldRejected, match="reads"):
        check_shift(g, layer_tags(g), "test")


def test_check_shift_rejects_other_ops():
    g = _layered_graph(second_op=torch.ops.aten.gelu.default, skip=True)
    with pytest.raises(FoldRejected, match="different ops"):
        check_shift(g, layer_tags(g), "test")


def test_check_shift_identical_layers_pass():
    g = _layered_graph(skip=True)
    check_shift(g, layer_tags(g), "test")  # both layers read x, same ops


def test_layer_tags_global_values():
    g = fx.Graph()
    coords = g.placeholder("coords")
    w = g.placeholder("w")
    w.meta[FOLD_KEY] = (1, (0, 0))
    idx = g.call_function(torch.ops.aten.add.Tensor, (coords, 1))
    idx.meta[FOLD_KEY] = (1, (1, 0))  # made in layer 1 from a global value only
    use = g.call_function(torch.ops.aten.mul.Tensor, (w, idx))
    use.meta[FOLD_KEY] = (1, (2, 0))
    g.output((use,))
    tags = layer_tags(g)
    assert tags[idx] is None and tags[use] == (1, (2, 0)) and tags[coords] is None


def test_node_hashes_see_a_difference():
    """The structural comparison used above can fail: a changed op changes it."""
    g1, g2 = _layered_graph(skip=True), _layered_graph(second_op=torch.ops.aten.gelu.default, skip=True)
    h1 = collections.Counter(node_hashes(fx.GraphModule({}, g1), str).values())
    h2 = collections.Counter(node_hashes(fx.GraphModule({}, g2), str).values())
    assert h1 != h2
    # names do not matter
    g3 = _layered_graph(skip=True)
    for n in g3.nodes:
        if n.op == "call_function":
            n.name = n.name + "_renamed"
    assert collections.Counter(node_hashes(fx.GraphModule({}, g3), str).values()) == h1


def test_folded_module_compiles_like_eager(fake_world):
    """torch.compile through autoparallel_backend() of a folded module: the
    second partition saves what the first saved and the numbers match eager
    (the fake process group's collectives are deterministic)."""
    from test_compile import _compiled_matches_eager

    from autoparallel.apply.partition import SAVE_TAG
    from autoparallel.apply.compile import LAST_PARTITION

    fake_world(4)
    parallel = _apply_stack()
    assert parallel.parallel_state.local.extra.get("folded")
    torch.manual_seed(0)
    ref = _Stack(MIN_LAYERS, None)
    parallel.to_empty(device="cpu")
    parallel.load_state_dict(ref.state_dict())
    _compiled_matches_eager(parallel, torch.randn(2, 16))
    graphs = parallel.parallel_state.step.graphs
    (fw_out,) = graphs.fw.graph.find_nodes(op="output")
    first = [n for n in fw_out.args[0][graphs.num_fwd_outputs :] if n.op != "placeholder"]
    second = [n for n in LAST_PARTITION.saved if n.meta.get("custom", {}).get(SAVE_TAG)]
    assert first and len(second) == len(first) and LAST_PARTITION.untagged_saved == []
