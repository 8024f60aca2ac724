import contextlib
import copy
import itertools
import operator
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch._functorch._aot_autograd.utils import make_boxed_func
from torch._functorch.aot_autograd import (
    aot_compile_joint_with_descriptors,
    aot_export_joint_with_descriptors,
)
from torch._functorch.partitioners import (
    default_partition,
    min_cut_rematerialization_partition,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel.capture.activation_checkpointing import (
    ACConfig,
    SACPolicy,
    apply_ac,
    graph_ac_tracing,
    is_graph_ac_tracing,
    recomputes_op,
    remove_ac,
    tag_recompute,
)
from autoparallel.models import FFN, LLAMA3_CONFIGS, BlockModel, Transformer

# deepcopy of traced GraphModules trips a pytree deprecation warning
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")

aten = torch.ops.aten
ARGS = LLAMA3_CONFIGS["debug"]  # dim 64, 2 layers, 4 heads / 2 kv heads
MM_PER_BLOCK = 7  # wq wk wv wo w1 w3 w2
PARTITIONERS = {"min_cut": min_cut_rematerialization_partition, "default": default_partition}


def _block_model(mode, seed=0):
    torch.manual_seed(seed)
    model = BlockModel(ARGS)
    model.init_weights()
    return apply_ac(model, mode)


class _FFNStack(nn.Module):
    """The mm -> gelu -> mm layer of pytorch/pytorch#178935, as AC blocks."""

    def __init__(self, n=1):
        super().__init__()
        self.layers = nn.ModuleList(FFN(8, 16, "gelu") for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _trace(model, x):
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with contextlib.ExitStack() as stack, graph_ac_tracing():
        return aot_export_joint_with_descriptors(stack, model, (fake.from_tensor(x),))


X = torch.randn(2, 16, ARGS.dim, generator=torch.Generator().manual_seed(0))
_traced_cache = {}


def _traced(mode):
    """(jd, fresh untagged copy of its joint graph) for the 2-block model.

    Tracing dominates test time, so each mode is traced once per session;
    tag_recompute and the partitioners mutate graphs, hence the copies.
    """
    if mode not in _traced_cache:
        jd = _trace(_block_model(mode), X)
        _traced_cache[mode] = (jd, copy.deepcopy(jd.graph_module))
    jd, pristine = _traced_cache[mode]
    return jd, copy.deepcopy(pristine)


def _num_fwd_outputs(gm):
    (out,) = gm.graph.find_nodes(op="output")
    # forward outputs come first; gradients (or None for inputs without
    # grad) follow
    return len(
        list(
            itertools.takewhile(
                lambda d: d is not None and type(d).__name__ != "GradAOTOutput",
                out.meta["desc"],
            )
        )
    )


def _partition(gm, partitioner, fake_mode):
    nfw = _num_fwd_outputs(gm)
    # recomputed random ops make the partitioner build RNG-state inputs, for
    # which it looks up the ambient fake mode
    with fake_mode:
        fw, bw = PARTITIONERS[partitioner](gm, None, num_fwd_outputs=nfw)
    (fw_out,) = fw.graph.find_nodes(op="output")
    saved = {
        n.name
        for n in fw_out.args[0][nfw:]
        if isinstance(n, torch.fx.Node) and n.op != "placeholder" and not _is_rng_state(n)
    }
    return fw, bw, saved


def _is_rng_state(node):
    # recomputed random ops (SDPA counts as one) get their RNG state saved by
    # the partitioner's functionalize_rng_ops
    return node.target is operator.getitem and node.args[0].target is torch.ops.higher_order.run_and_save_rng_state


def _live_names(gm, target=None):
    return {
        n.name
        for n in gm.graph.nodes
        if n.op == "call_function"
        and (target is None or n.target == target)
        and (n.users or n.target is torch.ops.higher_order.run_with_rng_state)
    }


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.target == target)


# ---------------------------------------------------------------------------
# graph_ac_tracing / annotations / tags
# ---------------------------------------------------------------------------


def test_graph_ac_tracing_flag_restored_even_on_exception():
    assert not is_graph_ac_tracing()
    with pytest.raises(RuntimeError):
        with graph_ac_tracing():
            assert is_graph_ac_tracing()
            with graph_ac_tracing():
                pass
            assert is_graph_ac_tracing()  # nested exit keeps the outer one
            raise RuntimeError
    assert not is_graph_ac_tracing()


def test_annotation_reaches_forward_and_backward_nodes_tags_only_forward():
    _, gm = _traced("full")
    fwd = [n for n in gm.graph.nodes if n.meta.get("partitioner_tag") == "is_forward"]
    bwd = [n for n in gm.graph.nodes if n.meta.get("partitioner_tag") == "is_backward"]
    regions = {n.meta.get("custom", {}).get("ac_region") for n in fwd if n.op == "call_function"}
    assert regions == {None, 0, 1}  # None: the RoPE slices outside the blocks
    # AOT autograd copies the forward node's meta (incl. "custom") onto the
    # backward nodes it generates: annotations alone don't mark the forward.
    assert any(n.meta.get("custom", {}).get("ac_region") is not None for n in bwd)
    assert not any("recompute" in n.meta for n in gm.graph.nodes)

    stats = tag_recompute(gm)
    assert stats.regions == 2 and stats.region_ids == [0, 1]
    assert stats.must_save == 0 and stats.prefer_recompute > 0
    for n in fwd:
        region = n.meta.get("custom", {}).get("ac_region")
        if region is not None and n.op == "call_function":
            assert n.meta["recompute"] == CheckpointPolicy.PREFER_RECOMPUTE
            assert n.meta["ac_graph_id"] == region
    assert not any("recompute" in n.meta or "ac_graph_id" in n.meta for n in bwd)


def test_selective_tags_follow_the_eager_policy_in_graph_order():
    _, gm = _traced("selective")
    stats = tag_recompute(gm)
    assert stats.regions == 2
    for region in (0, 1):
        nodes = [n for n in gm.graph.nodes if n.meta.get("ac_graph_id") == region]
        mm_tags = [n.meta["recompute"] for n in nodes if n.target == aten.mm.default]
        # 1st, 3rd, 5th, 7th mm saved; every second one recomputed
        assert mm_tags == [
            CheckpointPolicy.MUST_SAVE if i % 2 == 0 else CheckpointPolicy.PREFER_RECOMPUTE for i in range(MM_PER_BLOCK)
        ]
        (sdpa,) = [n for n in nodes if n.target == aten._scaled_dot_product_flash_attention_for_cpu.default]
        assert sdpa.meta["recompute"] == CheckpointPolicy.MUST_SAVE
        assert all(u.meta["recompute"] == CheckpointPolicy.MUST_SAVE for u in sdpa.users)  # getitems
        others = [n for n in nodes if n.target not in (aten.mm.default, sdpa.target) and n not in sdpa.users]
        assert others and all(n.meta["recompute"] == CheckpointPolicy.PREFER_RECOMPUTE for n in others)


@pytest.mark.parametrize("mode", ["full", "selective", "none"])
def test_recomputes_op_follows_the_region_policy(mode):
    """What apply's collectives next to a matmul get from tag_recompute:
    recomputed in a full region, in a selective one unless the policy saves
    the op (reduce-scatter, by default), never outside AC."""
    _, gm = _traced(mode)
    mms = [n for n in gm.graph.nodes if n.target == aten.mm.default and n.meta.get("partitioner_tag") == "is_forward"]
    assert mms
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    scatter = torch.ops._c10d_functional.reduce_scatter_tensor.default
    for mm in mms:
        assert recomputes_op(mm, gather) == (mode != "none")
        assert recomputes_op(mm, scatter) == (mode == "full")
    custom = SACPolicy(save_ops=frozenset({"aten.mm.default", str(gather)}))
    if mode == "selective":
        for mm in mms:
            mm.meta["custom"]["ac_policy"] = custom.to_annotation()
            assert not recomputes_op(mm, gather)


def test_sac_policy_decider():
    decide = SACPolicy().decider()
    assert [decide(aten.mm.default) for _ in range(4)] == [
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.PREFER_RECOMPUTE,
    ] * 2
    assert decide(aten.max.default) == CheckpointPolicy.MUST_SAVE
    assert decide(aten.add.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE
    save_all = SACPolicy(recompute_every=0).decider()
    assert {save_all(aten.mm.default) for _ in range(4)} == {CheckpointPolicy.MUST_SAVE}


# ---------------------------------------------------------------------------
# the partitioner honours the tags
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("partitioner", sorted(PARTITIONERS))
def test_selective_partition_recomputes_exactly_the_prefer_recompute_mms(partitioner):
    jd, gm = _traced("selective")
    tag_recompute(gm)
    mm_nodes = [n for n in gm.graph.nodes if n.target == aten.mm.default and "recompute" in n.meta]
    mms = {n.name: n.meta["recompute"] for n in mm_nodes}
    last_mm = {[n for n in mm_nodes if n.meta["ac_graph_id"] == r][-1].name for r in (0, 1)}
    fw, bw, saved = _partition(gm, partitioner, jd.fake_mode)
    must_save = {m for m, p in mms.items() if p == CheckpointPolicy.MUST_SAVE}
    recompute = {m for m, p in mms.items() if p == CheckpointPolicy.PREFER_RECOMPUTE}
    assert len(must_save) == 8 and len(recompute) == 6
    recomputed = _live_names(bw, aten.mm.default) & _live_names(fw, aten.mm.default)
    # the last mm of each block (w2, 7th: MUST_SAVE) has no backward use;
    # w3/wo/wk (PREFER_RECOMPUTE) all feed a gradient and are recomputed
    assert recomputed == recompute
    assert not (saved & recompute)
    # MUST_SAVE mms are saved when backward needs them: all but the last of
    # each block (w2), whose output only feeds the residual add
    assert must_save - saved == last_mm
    # attention is saved, not recomputed
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert not _live_names(bw, sdpa)
    assert _count(bw, aten.mm.default) == 2 * 2 * MM_PER_BLOCK + 6


@pytest.mark.parametrize("partitioner", sorted(PARTITIONERS))
def test_full_partition_saves_only_block_inputs(partitioner):
    jd, gm = _traced("full")
    tag_recompute(gm)
    joint = {n.name: n for n in gm.graph.nodes}
    region = {name: (n.meta.get("custom") or {}).get("ac_region") for name, n in joint.items()}
    fw, bw, saved = _partition(gm, partitioner, jd.fake_mode)
    saved_tensors = saved
    assert saved_tensors, "expected the block boundary to be saved"
    for name in saved_tensors:
        r = region[name]
        users = {region.get(u.name) for u in joint[name].users}
        # either computed outside every block (the RoPE table slices) or the
        # output of block r feeding block r + 1
        assert r is None or (r + 1) in users, (name, r, users)
    assert {region[s] for s in saved_tensors} == {None, 0}
    # whole blocks rerun (but the last mm of each, whose output backward
    # never needs), attention included
    assert _count(bw, aten.mm.default) == 2 * 2 * MM_PER_BLOCK + 2 * (MM_PER_BLOCK - 1)
    assert _count(bw, torch.ops.higher_order.run_with_rng_state) == 2  # sdpa is "random"


def test_memory_model_saves_the_block_boundary_like_the_partitioner():
    """Full AC: the step-memory model's saved set is what min-cut saves
    (the block boundary, its cleanup_recompute_tags rule, and the values
    computed outside the blocks)."""
    from autoparallel.capture.saved_activations import saved_activation_nodes

    jd, gm = _traced("full")
    tag_recompute(gm)
    estimated = {n.name for n in saved_activation_nodes(gm)}
    _, _, saved = _partition(gm, "min_cut", jd.fake_mode)
    joint = {n.name: n for n in gm.graph.nodes}
    boundary = {s for s in saved if joint[s].meta.get("ac_graph_id") == 0}
    assert boundary and boundary <= estimated  # block 0's output
    # the rest min-cut saves are views of graph inputs (the RoPE table's
    # slices), held with the inputs anyway and not counted
    for name in saved ^ estimated:
        assert name in saved and all(a.op == "placeholder" for a in joint[name].all_input_nodes), name


@pytest.mark.parametrize("partitioner", sorted(PARTITIONERS))
def test_no_ac_recomputes_nothing(partitioner):
    jd, gm = _traced("none")
    stats = tag_recompute(gm)
    fw, bw, saved = _partition(gm, partitioner, jd.fake_mode)
    assert stats.regions == 0 and stats.must_save == stats.prefer_recompute == 0
    assert not any("recompute" in n.meta for n in gm.graph.nodes)
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert not _live_names(bw, aten.mm.default) & _live_names(fw, aten.mm.default)
    assert not _live_names(bw, sdpa)
    assert _count(bw, aten.mm.default) == 2 * 2 * MM_PER_BLOCK
    if partitioner == "default":
        # the default partitioner saves everything: no op at all is rerun
        assert not _live_names(bw) & _live_names(fw)


def test_seed_mm_gelu_mm_prefer_recompute_is_recomputed():
    # pytorch/pytorch#178935: eager SAC traced by make_fx marks mm
    # PREFER_RECOMPUTE yet gelu_backward uses the saved mm. With graph AC the
    # recomputed mm is what the backward consumes.
    model = _FFNStack(1)
    apply_ac(model, "selective", policy=SACPolicy(recompute_every=1))  # recompute every mm
    jd = _trace(model, torch.randn(2, 4, 8))
    tag_recompute(jd.graph_module)
    fw, bw, saved = _partition(jd.graph_module, "min_cut", jd.fake_mode)
    (gelu_bwd,) = bw.graph.find_nodes(op="call_function", target=aten.gelu_backward.default)
    # gelu_backward's input is the recomputed first mm (viewed back to 3-d)
    src = gelu_bwd.args[1]
    while src.op == "call_function" and src.target != aten.mm.default:
        src = src.args[0]
    assert src.op == "call_function" and src.target == aten.mm.default
    assert not any(s.startswith("mm") for s in saved)


# ---------------------------------------------------------------------------
# end to end: graph AC decisions == eager AC decisions, numerics intact
# ---------------------------------------------------------------------------


class _CountMM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func == aten.mm.default
        return func(*args, **(kwargs or {}))


def _eager_backward_mms(mode, x):
    model = _block_model(mode)
    loss = model(x).pow(2).sum()
    with _CountMM() as c:
        loss.backward()
    return c.n


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compiled_graph_ac_matches_eager_ac(mode):
    x = X
    ref = _block_model("none")
    ref_out = ref(x)
    ref_out.pow(2).sum().backward()

    model = _block_model(mode)  # same weights as the traced one
    graphs = {}

    def capture(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm)

        return compiler

    jd, gm = _traced(mode)
    tag_recompute(gm)
    jd.graph_module = gm
    # aot_compile_joint_with_descriptors partitions with default_partition
    step = aot_compile_joint_with_descriptors(jd, fw_compiler=capture("fw"), bw_compiler=capture("bw"))
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    out = step(*(params[n] for n in jd.params_spec), *(buffers[n] for n in jd.buffers_spec), x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=name)
    # same amount of recomputation as eager checkpointing
    assert _count(graphs["bw"], aten.mm.default) == _eager_backward_mms(mode, x)


# ---------------------------------------------------------------------------
# eager AC
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_eager_ac_same_loss_and_grads_and_fqns(mode):
    torch.manual_seed(0)
    ref = Transformer(ARGS)
    ref.init_weights()
    model = copy.deepcopy(ref)
    keys = list(ref.state_dict())
    names = [n for n, _ in ref.named_parameters()]
    apply_ac(model, mode)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == names
    assert all(type(b).__name__ == "ACTransformerBlock" for b in model.layers)
    assert [b._ac_config for b in model.layers] == [ACConfig(mode, i) for i in range(ARGS.n_layers)]

    tok = torch.randint(0, ARGS.vocab_size, (2, 16))
    losses = []
    for m in (ref, model):
        loss = m(tok).float().logsumexp(-1).mean()
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)

    # eager AC really recomputes (and SAC less than full)
    x = torch.randn(2, 16, ARGS.dim)
    n_none = _eager_backward_mms("none", x)
    n_mode = _eager_backward_mms(mode, x)
    assert n_mode == n_none + (6 if mode == "selective" else 12)


def test_apply_ac_is_idempotent_and_reversible():
    model = BlockModel(ARGS)
    block_cls = type(model.layers[0])
    apply_ac(model, "full")
    ac_cls = type(model.layers[0])
    apply_ac(model, "selective")
    assert type(model.layers[0]) is ac_cls  # one wrapping level, class cached
    assert model.layers[1]._ac_config == ACConfig("selective", 1)
    apply_ac(model, "none")
    assert type(model.layers[0]) is block_cls and not hasattr(model.layers[0], "_ac_config")
    apply_ac(model, "full")
    remove_ac(model)
    assert all(type(b) is block_cls for b in model.layers)
    with pytest.raises(ValueError):
        apply_ac(model, "bogus")
    with pytest.raises(ValueError):
        apply_ac(model, "full", policy=SACPolicy())


def test_eager_ac_under_tracer_warns():
    model = _FFNStack(1)
    apply_ac(model, "full")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with contextlib.ExitStack() as stack, warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        aot_export_joint_with_descriptors(stack, model, (fake.from_tensor(torch.randn(2, 8)),))
    assert any("graph_ac_tracing" in str(x.message) for x in w)


def test_apply_ac_to_explicit_blocks():
    model = _FFNStack(3)
    apply_ac(model, "full", blocks=[model.layers[0], model.layers[2]])
    assert [getattr(b, "_ac_config", None) for b in model.layers] == [
        ACConfig("full", 0),
        None,
        ACConfig("full", 1),
    ]
    with pytest.raises(ValueError):
        apply_ac(nn.Linear(2, 2), "full")


def test_meta_model_with_ac_traces():
    # The planner's setting: model on meta, traced under FakeTensorMode.
    with torch.device("meta"):
        model = Transformer(replace(ARGS, n_layers=1))
    apply_ac(model, "selective")
    jd = _trace(model, torch.zeros(2, 16, dtype=torch.long, device="meta"))
    stats = tag_recompute(jd.graph_module)
    assert stats.regions == 1
    # On meta, SDPA decomposes to the math path (bmm + softmax): no fused
    # attention op to save, only the 4 odd-numbered of the 7 mms.
    assert stats.must_save == 4
    ops = {n.target for n in jd.graph_module.graph.nodes}
    assert aten.bmm.default in ops
    assert aten._scaled_dot_product_flash_attention_for_cpu.default not in ops
