"""recompute_all_gathers on hand-built joint graphs: it tags a parameter's
all-gather chain (cast, gather, wait, layout ops) and nothing else, and the
partitioner then gathers again in backward instead of saving the weight."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel.passes import PassContext, PassOptions
from autoparallel.passes.recompute_all_gathers import recompute_all_gathers, saved_for_backward

c10d = torch.ops._c10d_functional


def _gather(x, n=4):
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, n, "0"))


def _joint(primals, tangents):
    w_shard, b, x, coords = primals
    (tan,) = tangents
    w = _gather(w_shard.to(torch.bfloat16)).float()  # cast, gather, wait, cast
    wt = w.t()  # layout op after the wait
    xa = _gather(x)  # an activation gather: not a parameter
    y = xa @ wt + b.t()  # b: a parameter used without a gather
    grad_x = tan @ w  # backward needs the gathered weight
    grad_w = tan.t() @ xa
    grad_w_shard = c10d.wait_tensor(c10d.reduce_scatter_tensor(grad_w, "sum", 4, "0"))
    return [y, grad_w_shard, tan.sum(0, keepdim=True).t(), grad_x]


def _trace():
    with FakeTensorMode():
        primals = [torch.randn(2, 8), torch.randn(8, 1), torch.randn(2, 8), torch.zeros(1, dtype=torch.int64)]
        tangents = [torch.randn(8, 8)]
        gm = make_fx(_joint)(primals, tangents)
    return gm


def _ctx(reshard=True):
    local = SimpleNamespace(param_fqns=["w", "b"], buffer_fqns=[], num_primals=4)
    return PassContext(mesh=None, plan=None, options=PassOptions(reshard_after_forward=reshard), local=local)


def _tags(gm):
    return {n.name: n.meta.get("recompute") for n in gm.graph.nodes if "recompute" in n.meta}


@pytest.mark.smoke
def test_tags_the_parameter_chain_only():
    gm = _trace()
    stats = recompute_all_gathers(gm, _ctx())
    assert stats.chains == 1 and stats.all_gathers == 1
    tags = _tags(gm)
    tagged = {name for name, t in tags.items() if t == CheckpointPolicy.MUST_RECOMPUTE}
    targets = {str(n.target) for n in gm.graph.nodes if n.name in tagged}
    assert "_c10d_functional.all_gather_into_tensor.default" in targets
    assert "_c10d_functional.wait_tensor.default" in targets
    assert "aten.t.default" in targets  # the layout chain after the wait
    assert any("to_copy" in t or "convert_element_type" in t for t in targets)  # the casts
    # the activation gather, the mm, b's transpose and the backward are left alone
    for n in gm.graph.nodes:
        if n.name in tagged:
            assert n.meta["ac_graph_id"] > 1000
            assert all(a.name in tagged or a.name == "primals_1" for a in n.all_input_nodes), n.name
    assert "mm" not in " ".join(tagged)
    assert stats.nodes_tagged == len(tagged)


def _partition(gm):
    return min_cut_rematerialization_partition(gm, None, num_fwd_outputs=1)


def test_partitioner_regathers_in_backward():
    ag = c10d.all_gather_into_tensor.default
    fw0, bw0 = _partition(_trace())
    gm = _trace()
    recompute_all_gathers(gm, _ctx())
    chain = set(_tags(gm))
    fw, bw = _partition(gm)
    saved0 = dict(saved_for_backward(fw0, 1))
    saved = dict(saved_for_backward(fw, 1))
    # without the pass the gathered weight (or its view) is saved; with it, only the shard
    assert sum(1 for n in bw0.graph.nodes if n.target is ag) == 0
    assert sum(1 for n in bw.graph.nodes if n.target is ag) == 1
    assert sum(saved.values()) < sum(saved0.values())
    assert not chain & set(saved), sorted(chain & set(saved))
    assert chain & set(saved0)  # before: the gathered weight or its view was saved


def test_zero2_keeps_gathered_weights():
    gm = _trace()
    stats = recompute_all_gathers(gm, _ctx(reshard=False))
    assert stats.mode == "save" and stats.chains == 1
    assert all(t == CheckpointPolicy.MUST_SAVE for t in _tags(gm).values())
    fw, bw = _partition(gm)
    assert sum(1 for n in bw.graph.nodes if n.target is c10d.all_gather_into_tensor.default) == 0


def test_no_parameters_gathered_no_tags():
    def joint(primals, tangents):
        w, x = primals
        (tan,) = tangents
        return [x @ w.t(), tan.t() @ x]

    with FakeTensorMode():
        gm = make_fx(joint)([torch.randn(8, 8), torch.randn(4, 8)], [torch.randn(4, 8)])
    local = SimpleNamespace(param_fqns=["w"], buffer_fqns=[], num_primals=2)
    stats = recompute_all_gathers(gm, PassContext(mesh=None, plan=None, local=local))
    assert stats.chains == 0 and not _tags(gm)


def _joint_backward_relayout(primals, tangents):
    w_shard, x, coords = primals
    (tan,) = tangents
    wt = _gather(w_shard).t()
    y = x @ wt
    # backward: the weight read in another layout, gathered again from the
    # forward's transposed weight (a function of the parameter alone; the
    # copy and reshape as apply emits them)
    w_other = torch.ops.aten._unsafe_view(_gather(wt.contiguous()), [4, 8, 8])[0]
    grad_x = tan @ w_other
    grad_w = c10d.wait_tensor(c10d.reduce_scatter_tensor(tan.t() @ x, "sum", 4, "0"))
    return [y, grad_w, grad_x]


def _trace_tagged():
    """The joint graph with AOT autograd's forward/backward tags: what
    follows the forward's matmul is backward."""
    with FakeTensorMode():
        primals = [torch.randn(2, 8), torch.randn(8, 8), torch.zeros(1, dtype=torch.int64)]
        gm = make_fx(_joint_backward_relayout)(primals, [torch.randn(8, 8)])
    backward = False
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        n.meta["partitioner_tag"] = "is_backward" if backward else "is_forward"
        backward = backward or n.target is torch.ops.aten.mm.default
    return gm


def test_backward_relayout_of_a_weight_is_gathered_in_backward():
    ag = c10d.all_gather_into_tensor.default
    fw0, _ = min_cut_rematerialization_partition(_trace_tagged(), None, num_fwd_outputs=1)
    gm = _trace_tagged()
    stats = recompute_all_gathers(gm, PassContext(mesh=None, plan=None, local=_ctx().local))
    assert stats.all_gathers == 2
    chain = set(_tags(gm))
    fw, bw = min_cut_rematerialization_partition(gm, None, num_fwd_outputs=1)
    # untagged, the backward's gather runs in the forward and what it gathered is saved
    assert sum(1 for n in fw0.graph.nodes if n.target is ag) == 2
    assert chain & set(dict(saved_for_backward(fw0, 1)))
    # tagged, both gathers run again in the backward from the 2 x 8 shard
    assert sum(1 for n in bw.graph.nodes if n.target is ag) == 2
    assert not chain & set(dict(saved_for_backward(fw, 1)))
    # the extraction also copies the backward's gather into the forward, dead
    # there: apply drops it (it would run on the link for nothing)
    from autoparallel.apply.partition import drop_dead_collectives

    assert sum(1 for n in fw.graph.nodes if n.target is ag) == 2
    drop_dead_collectives(fw, bw)
    assert sum(1 for n in fw.graph.nodes if n.target is ag) == 1
    assert sum(1 for n in bw.graph.nodes if n.target is ag) == 2
