"""The joint/graphs rewrite passes on tiny LLaMA-3 plans (8 LocalTensorMode
ranks): with recompute_all_gathers and schedule_overlap on, loss and
gradients equal the single-device model; no gathered weight (or a view of
it) is saved for backward; backward runs at most ``max_consecutive_compute``
compute ops before a reduce-scatter; both graphs stay topologically valid.

The "debug" config is widened to dim 256 and fed 32 x 64 tokens: at dim 64
the solver replicates activations in backward (no reduce-scatters at all);
at 256, with one GPU per node (every gather crosses nodes and hides), the
plan is FSDP-like (every parameter sharded and gathered, gradients
reduce-scattered)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import AutoParallel, cost_model, passes
from autoparallel.models import LLAMA3_CONFIGS, Transformer, apply_ac
from autoparallel.passes.recompute_all_gathers import param_gather_chains, saved_for_backward
from autoparallel.passes.schedule_overlap import check_topological, longest_compute_run

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

ARGS = dataclasses.replace(LLAMA3_CONFIGS["debug"], dim=256, multiple_of=256)
BATCH, SEQ = 32, 64
# passes switched off in every variant: bucket_collectives (tested in
# test_passes_bucket.py) would merge gathers and blur the fused counts
_OTHERS = ("bucket_collectives",)


def _tokens():
    return torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _init_world(n):
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)


def _plan(mesh_shape, ac=None):
    mesh = init_device_mesh("cpu", mesh_shape)
    with torch.device("meta"):
        model = Transformer(ARGS)
    if ac:
        apply_ac(model, ac)
    autop = AutoParallel(
        model,
        mesh,
        torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),
        device=dataclasses.replace(cost_model.H100, gpus_per_node=1),
    )
    autop.__enter__()
    batch = (Shard(0),) * mesh.ndim
    autop.add_input_constraints([batch])
    autop.add_output_constraints([batch])
    autop.add_parameter_memory_constraint(high=None)
    return autop, mesh, autop.optimize_placement()


def _saved_names(parallel):
    st = parallel.parallel_state
    return {name for name, _ in saved_for_backward(parallel.forward_graph, st.step.graphs.num_fwd_outputs)}


def _saved_bytes(parallel):
    st = parallel.parallel_state
    return sum(b for _, b in saved_for_backward(parallel.forward_graph, st.step.graphs.num_fwd_outputs))


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.target is target)


def _check_structure(parallel, pass_stats, cap=8):
    local = parallel.parallel_state.local
    chains = param_gather_chains(local.gm, passes.PassContext(mesh=None, plan=None, local=local))
    assert len(chains) >= len(local.param_fqns) - 1  # every parameter is gathered (embedding may not be)
    chain_names = {n.name for chain in chains.values() for n in chain}
    saved = _saved_names(parallel)
    assert not saved & chain_names, f"gathered weights saved for backward: {sorted(saved & chain_names)}"
    for gm in (parallel.forward_graph, parallel.backward_graph):
        check_topological(gm)
    bw = parallel.backward_graph
    assert _count(bw, torch.ops._c10d_functional.reduce_scatter_tensor.default) > 0
    assert _count(bw, torch.ops._c10d_functional.all_gather_into_tensor.default) > 0  # re-gathered
    assert longest_compute_run(bw.graph.nodes) <= cap
    stats = pass_stats["schedule_overlap"]
    assert stats["backward"].longest_compute_run_after <= cap
    # overlap must not cost much memory, nor expose more communication
    for kind in ("forward", "backward"):
        s = stats[kind]
        assert s.peak_memory_after <= 1.1 * s.peak_memory_before, (kind, s)
        assert s.exposed_comm_after_s <= s.exposed_comm_before_s, (kind, s)


def _loss(out, numel):
    return out.float().pow(2).sum() / numel


def _compare_one_step(parallel, mesh, ac=None):
    torch.manual_seed(0)
    ref = Transformer(ARGS)
    ref.init_weights()
    if ac:
        apply_ac(ref, ac)
    start_state = {k: v.clone() for k, v in ref.state_dict().items()}
    x = _tokens()
    out = ref(x)
    loss = _loss(out, out.numel())
    loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    n = mesh.size()
    per = BATCH // n
    with LocalTensorMode(n) as lm:
        parallel.to_empty(device="cpu")
        parallel.init_weights()
        parallel.load_state_dict(start_state)
        pout = parallel(lm.rank_map(lambda r: x[r * per : (r + 1) * per].clone()))
        ploss = _loss(pout, out.numel())
        ploss.backward()
        full_out = torch.cat([pout._local_tensors[r] for r in range(n)])
        grads = {}
        for name, p in parallel.named_parameters():
            g = p.grad.full_tensor()
            grads[name] = g.reconcile() if isinstance(g, LocalTensor) else g
        total = sum(ploss._local_tensors.values()).item()
    torch.testing.assert_close(full_out, out.detach(), rtol=1e-5, atol=1e-5)
    assert total == pytest.approx(loss.item(), rel=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)


def _apply_variants(mesh_shape, ac=None, variants=("all",)):
    """Plan once, apply with several pass settings (inside the AutoParallel
    context, which is closed before any numerics run)."""
    # LocalTensorMode runs the graphs: column-major all-gather chains
    # (tp-outer parameters) fuse on the row-major group + a local reorder
    local = passes.PassOptions(column_major_all_gather="reorder")
    zero2 = passes.PassOptions(reshard_after_forward=False, column_major_all_gather="reorder")
    options = {
        "all": dict(disable_passes=_OTHERS, pass_options=local),
        "none": dict(disable_passes=_OTHERS + ("recompute_all_gathers", "schedule_overlap"), pass_options=local),
        "nofuse": dict(disable_passes=_OTHERS + ("fuse_all_gathers",), pass_options=local),
        "zero2": dict(disable_passes=_OTHERS + ("schedule_overlap",), pass_options=zero2),
    }
    autop, mesh, plan = _plan(mesh_shape, ac)
    out = {}
    try:
        for name in variants:
            out[name] = autop.apply_placement(plan, **options[name])
            out[name + "_stats"] = dict(plan.pass_stats)
    finally:
        autop.__exit__(None, None, None)
    return mesh, plan, out


@pytest.fixture(scope="module")
def llama_1d():
    _init_world(8)
    yield _apply_variants((8,), variants=("none", "all"))
    if dist.is_initialized():
        dist.destroy_process_group()


def test_llama_1d_passes(llama_1d):
    mesh, plan, v = llama_1d
    parallel, stats = v["all"], v["all_stats"]
    _check_structure(parallel, stats)
    rstats = stats["recompute_all_gathers"]
    assert rstats.chains >= 20 and rstats.mode == "recompute"


@pytest.mark.slow
def test_llama_1d_numerics(llama_1d):
    # ~40 s: one LocalTensorMode step of the widened model on 8 ranks
    mesh, plan, v = llama_1d
    _compare_one_step(v["all"], mesh)


def test_llama_1d_saved_bytes_drop(llama_1d):
    mesh, plan, v = llama_1d
    ag = torch.ops._c10d_functional.all_gather_into_tensor.default
    assert _saved_bytes(v["all"]) < _saved_bytes(v["none"])
    assert _count(v["all"].backward_graph, ag) > _count(v["none"].backward_graph, ag)


@pytest.mark.slow
def test_llama_1d_zero2():
    _init_world(8)
    try:
        mesh, plan, v = _apply_variants((8,), variants=("none", "zero2", "all"))
    finally:
        dist.destroy_process_group()
    ag = torch.ops._c10d_functional.all_gather_into_tensor.default
    # ZeRO-2: gathered weights kept, backward gathers no parameter again
    assert _count(v["zero2"].backward_graph, ag) <= _count(v["none"].backward_graph, ag)
    assert _saved_bytes(v["zero2"]) > _saved_bytes(v["all"])


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 4)])
@pytest.mark.parametrize("ac", [None, "selective"])
def test_llama_2d_passes(mesh_shape, ac):
    n = mesh_shape[0] * mesh_shape[1]
    _init_world(n)
    try:
        mesh, plan, v = _apply_variants(mesh_shape, ac, variants=("all", "nofuse"))
        _check_structure(v["all"], v["all_stats"])
        # fused chains: each removes one all-gather, forward and backward
        # (where recompute_all_gathers re-gathers the weights)
        fstats = v["all_stats"]["fuse_all_gathers"]
        ag = torch.ops._c10d_functional.all_gather_into_tensor.default
        assert fstats["forward"].fused > 0 and fstats["backward"].fused > 0
        for kind, attr in (("forward", "forward_graph"), ("backward", "backward_graph")):
            before = _count(getattr(v["nofuse"], attr), ag)
            assert _count(getattr(v["all"], attr), ag) == before - fstats[kind].all_gathers_removed, kind
        _compare_one_step(v["all"], mesh, ac)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_llama_selective_ac_recomputes_matmuls():
    """A matmul selective AC marks PREFER_RECOMPUTE runs again in backward."""
    _init_world(8)
    try:
        mesh, plan, v = _apply_variants((8,), "selective")
        parallel = v["all"]
        local = parallel.parallel_state.local
        mm = torch.ops.aten.mm.default
        fwd_mm = [n for n in local.gm.graph.nodes if n.target is mm and "recompute" in n.meta]
        recomputed = [n for n in fwd_mm if n.meta["recompute"] == CheckpointPolicy.PREFER_RECOMPUTE]
        assert recomputed
        bw_names = {n.name for n in parallel.backward_graph.graph.nodes if n.target is mm}
        fw_names = {n.name for n in parallel.forward_graph.graph.nodes if n.target is mm}
        saved = _saved_names(parallel)
        for n in recomputed:
            assert n.name not in saved, n.name
            # the backward graph holds a copy of the forward matmul (same name
            # when it is not also in the forward, else a suffixed one)
            assert n.name in bw_names or any(b.startswith(n.name) for b in bw_names), n.name
        assert all(n.name in fw_names for n in fwd_mm)
        _compare_one_step(parallel, mesh, "selective")
    finally:
        dist.destroy_process_group()
