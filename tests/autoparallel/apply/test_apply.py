"""apply_placement on 8 simulated ranks (LocalTensorMode): the parallel module
computes the same loss, gradients and AdamW steps as the single-device model,
for FSDP-like and replication-allowed plans on 1-D and 2-D meshes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from autoparallel import ApplyError, AutoParallel, cost_model
from autoparallel.passes import PassOptions
from autoparallel.models import FFN, LLAMA3_CONFIGS, BlockModel, Transformer, apply_ac

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

# LocalTensorMode simulates sorted process groups only: fuse column-major
# all-gather chains (tp-outer parameters) on the row-major group + a reorder.
LOCAL_TENSOR_PASSES = PassOptions(column_major_all_gather="reorder")

ARGS = LLAMA3_CONFIGS["debug"]
BATCH, SEQ = 8, 16


def _ffn():
    return FFN(16, 64, bias=True)


def _block():
    return BlockModel(ARGS)


def _llama():
    return Transformer(ARGS)


def _float_input(g):
    return torch.randn(BATCH, SEQ, ARGS.dim if g == "block" else 16, generator=torch.Generator().manual_seed(1))


def _tokens():
    return torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


MODELS = {
    "ffn": (_ffn, lambda: _float_input("ffn")),
    "block": (_block, lambda: _float_input("block")),
    "llama": (_llama, _tokens),
}


# Parameter gathers across nodes count 10% (CommOverlapPolicy): FSDP layouts
# for the small test models, whose gathers within a node would cost more
# than replicating the weights.
ONE_GPU_PER_NODE = dataclasses.replace(cost_model.H100, gpus_per_node=1)


def _apply(kind: str, mesh_shape, *, high=None, ac=None, partitioner="min_cut", device="H100"):
    build, _ = MODELS[kind]
    mesh = init_device_mesh("cpu", mesh_shape)
    with torch.device("meta"):
        model = build()
    if ac:
        apply_ac(model, ac)
    example = MODELS[kind][1]()
    with AutoParallel(model, mesh, torch.empty_like(example, device="meta"), device=device) as autop:
        batch = (Shard(0),) * mesh.ndim
        autop.add_input_constraints([batch])
        autop.add_output_constraints([batch])
        autop.add_parameter_memory_constraint(high=high)
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan, partitioner=partitioner, pass_options=LOCAL_TENSOR_PASSES)
    return parallel, mesh, plan


def _reference(kind: str, ac=None):
    torch.manual_seed(0)
    ref = MODELS[kind][0]()
    ref.init_weights()
    if ac:
        apply_ac(ref, ac)
    return ref


def _local_batch(lm: LocalTensorMode, x: torch.Tensor, n: int) -> LocalTensor:
    per = x.shape[0] // n
    return lm.rank_map(lambda r: x[r * per : (r + 1) * per].clone())


def _loss(out: torch.Tensor, global_numel: int) -> torch.Tensor:
    # sum over ranks of the local losses = the global loss
    return out.float().pow(2).sum() / global_numel


def _rank_sum(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, LocalTensor):
        return sum(t._local_tensors.values())
    return t


def _full(t: DTensor) -> torch.Tensor:
    full = t.full_tensor()
    return full.reconcile() if isinstance(full, LocalTensor) else full


def _train_and_compare(kind: str, parallel, mesh, *, ac=None, steps=3, atol=1e-5):
    ref = _reference(kind, ac)
    x = MODELS[kind][1]()
    n = mesh.size()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_losses = []
    for step in range(steps):
        out = ref(x)
        loss = _loss(out, out.numel())
        ref_opt.zero_grad()
        loss.backward()
        if step == 0:
            ref_grads = {name: p.grad.clone() for name, p in ref.named_parameters()}
            ref_out = out.detach()
        ref_opt.step()
        ref_losses.append(loss.item())

    start = _reference(kind, ac)
    with LocalTensorMode(n) as lm:
        parallel.to_empty(device="cpu")
        parallel.init_weights()  # also computes non-persistent buffers (RoPE)
        parallel.load_state_dict(start.state_dict())
        opt = torch.optim.AdamW(parallel.parameters(), lr=1e-3)
        losses = []
        for step in range(steps):
            out = parallel(_local_batch(lm, x, n))
            loss = _loss(out, ref_out.numel())
            opt.zero_grad()
            loss.backward()
            if step == 0:
                full_out = torch.cat([out._local_tensors[r] for r in range(n)])
                grads = {}
                for name, p in parallel.named_parameters():
                    assert isinstance(p.grad, DTensor), name
                    assert p.grad.placements == p.placements, name
                    grads[name] = _full(p.grad)
            opt.step()
            losses.append(_rank_sum(loss).item())
    torch.testing.assert_close(full_out, ref_out, rtol=1e-5, atol=atol)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=atol, msg=name)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    return losses


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)])
@pytest.mark.smoke
def test_ffn_fsdp_like(fake_world, mesh_shape):
    fake_world(8)
    parallel, mesh, _ = _apply("ffn", mesh_shape)
    for name, p in parallel.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh is mesh, name
        assert any(isinstance(q, Shard) for q in p.placements), (name, p.placements)
    _train_and_compare("ffn", parallel, mesh)


def test_ffn_replication_allowed(fake_world):
    fake_world(8)
    parallel, mesh, plan = _apply("ffn", (8,), high=1.0)
    _train_and_compare("ffn", parallel, mesh)


def test_ffn_default_partitioner(fake_world):
    fake_world(8)
    parallel, mesh, _ = _apply("ffn", (2, 4), partitioner="default")
    _train_and_compare("ffn", parallel, mesh)


# Under LocalTensorMode every op runs 8 times through Python: a LLaMA step
# takes ~7 s. The default suite checks one step (output, loss, every
# gradient) of the LLaMA, whose layers are the block's; the slow suite runs
# the block alone and three AdamW steps on both meshes (and the 2-D plans,
# whose option enumeration is slow).


# slow: test_llama_debug_1d_selective_ac plans and steps the same blocks on (8,)
@pytest.mark.slow
def test_transformer_block_1d(fake_world):
    fake_world(8)
    parallel, mesh, _ = _apply("block", (8,))
    _train_and_compare("block", parallel, mesh, steps=1)


@pytest.mark.smoke
def test_llama_debug_1d_selective_ac(fake_world):
    fake_world(8)
    parallel, mesh, _ = _apply("llama", (8,), ac="selective")
    stats = parallel.parallel_state.local.ac_stats
    assert stats.regions == ARGS.n_layers and stats.must_save > 0
    _train_and_compare("llama", parallel, mesh, ac="selective", steps=1)


def test_llama_debug_1d_full_ac(fake_world):
    # Full AC recomputes the attention op, which is tagged random (dropout_p):
    # the partitioner saves its RNG state for the backward under another name.
    # 4 simulated ranks: half the LocalTensorMode work of 8, same plan family.
    fake_world(4)
    parallel, mesh, _ = _apply("llama", (4,), ac="full")
    _train_and_compare("llama", parallel, mesh, ac="full", steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)])
def test_transformer_block_adamw(fake_world, mesh_shape):
    fake_world(8)
    parallel, mesh, _ = _apply("block", mesh_shape)
    _train_and_compare("block", parallel, mesh, steps=3)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)])
@pytest.mark.parametrize("ac", [None, "selective"])
def test_llama_debug_adamw(fake_world, mesh_shape, ac):
    # planning the tiny LLaMA on 2x4 spends ~90 s enumerating options
    fake_world(8)
    parallel, mesh, _ = _apply("llama", mesh_shape, ac=ac)
    _train_and_compare("llama", parallel, mesh, ac=ac, steps=3)


# ---------------------------------------------------------------------------
# module surface: names, state dicts, init, graphs


def test_names_state_dict_and_init(fake_world):
    fake_world(8)
    parallel, mesh, _ = _apply("block", (8,))
    ref = _reference("block")
    assert [n for n, _ in parallel.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(parallel.state_dict()) == list(ref.state_dict())
    assert type(parallel).__name__ == "ParallelBlockModel" and isinstance(parallel, BlockModel)
    assert all(p.is_meta for p in parallel.parameters())
    with LocalTensorMode(8):
        parallel.to_empty(device="cpu")
        parallel.init_weights()
        for name, p in parallel.named_parameters():
            assert isinstance(p, DTensor) and not p.to_local().is_meta, name
        norm = _full(parallel.layers[0].attention_norm.weight)
        assert torch.equal(norm, torch.ones_like(norm))
        wq = _full(parallel.layers[0].attention.wq.weight)
        assert 0.01 < wq.std().item() < 0.03
        parallel.load_state_dict(ref.state_dict())
        sd = parallel.state_dict()
        for key, value in ref.state_dict().items():
            assert isinstance(sd[key], DTensor), key
            torch.testing.assert_close(_full(sd[key]), value, rtol=0, atol=0, msg=key)


def test_parallel_graph_has_collectives(fake_world):
    fake_world(8)
    # one GPU per node: gathers cross nodes and hide, so the plan is FSDP
    parallel, _, _ = _apply("ffn", (8,), device=ONE_GPU_PER_NODE)
    targets = {str(n.target) for n in parallel.parallel_graph.graph.nodes if n.op == "call_function"}
    assert "_c10d_functional.all_gather_into_tensor.default" in targets
    assert "_c10d_functional.wait_tensor.default" in targets
    fw = {str(n.target) for n in parallel.forward_graph.graph.nodes}
    bw = {str(n.target) for n in parallel.backward_graph.graph.nodes}
    assert "_c10d_functional.all_gather_into_tensor.default" in fw
    assert "_c10d_functional.reduce_scatter_tensor.default" in bw


# ---------------------------------------------------------------------------
# bad use


@pytest.fixture
def ffn_parallel(fake_world):
    fake_world(8)
    parallel, mesh, _ = _apply("ffn", (8,))
    return parallel


def test_before_to_empty(ffn_parallel):
    with LocalTensorMode(8) as lm:
        x = _local_batch(lm, _float_input("ffn"), 8)
        with pytest.raises(ApplyError, match="to_empty"):
            ffn_parallel(x)


@pytest.mark.parametrize(
    "make_input, message",
    [
        (
            lambda: torch.randn(BATCH, SEQ, 16),
            r"input args\[0\]: local shape \(8, 16, 16\), expected the local shard \(1, 16, 16\)",
        ),
        (
            lambda: torch.randn(1, SEQ, 16, dtype=torch.float64),
            r"input args\[0\]: dtype torch.float64, expected torch.float32",
        ),
        (lambda: torch.empty(1, SEQ, 16, device="meta"), r"input args\[0\]: on device meta"),
    ],
)
@pytest.mark.smoke
def test_bad_inputs(ffn_parallel, make_input, message):
    with LocalTensorMode(8):
        ffn_parallel.to_empty(device="cpu")
        ffn_parallel.init_weights()
        with pytest.raises(ValueError, match=message):
            ffn_parallel(make_input())


def test_wrong_structure(ffn_parallel):
    with LocalTensorMode(8):
        ffn_parallel.to_empty(device="cpu")
        ffn_parallel.init_weights()
        with pytest.raises(TypeError, match="inputs structured as"):
            ffn_parallel(torch.randn(1, SEQ, 16), torch.randn(1, SEQ, 16))


@pytest.mark.smoke
def test_wrong_world_size(ffn_parallel):
    dist.destroy_process_group()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    ffn_parallel.to_empty(device="cpu")
    with pytest.raises(ApplyError, match="mesh of 8 ranks .* process group has 4"):
        ffn_parallel(torch.randn(1, SEQ, 16))


def test_mesh_on_a_subset_of_ranks(fake_world):
    """A mesh may cover part of the world (other ranks run other stages);
    a rank outside it gets an error naming the mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    fake_world(8)
    mesh = DeviceMesh("cpu", torch.arange(4))
    with torch.device("meta"):
        model = _ffn()
    with AutoParallel(model, mesh, torch.empty(BATCH, SEQ, 16, device="meta")) as autop:
        autop.add_input_constraints([(Shard(0),)])
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan)
    st = parallel.parallel_state
    parallel._check_world(st)  # world 8, mesh ranks 0..3, rank 0: fine
    dist.destroy_process_group()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=6, world_size=8)
    with pytest.raises(ApplyError, match=r"rank 6 is not in the plan's mesh \(4,\)"):
        parallel._check_world(st)


def test_parameters_live_on_the_current_mesh(fake_world):
    """Planning again after re-creating the process group and an equal mesh:
    the parameters are on the new mesh object, not one that DTensor's
    sharding caches remember from before."""
    fake_world(8)
    first, first_mesh, _ = _apply("ffn", (8,))
    fake_world(8)
    second, second_mesh, _ = _apply("ffn", (8,))
    assert first_mesh == second_mesh and first_mesh is not second_mesh
    for name, p in second.named_parameters():
        assert p.device_mesh is second_mesh, name


def test_collective_summary(fake_world):
    from autoparallel.apply import collectives, summarize

    fake_world(8)
    parallel, mesh, _ = _apply("ffn", (2, 4), device=ONE_GPU_PER_NODE)  # FSDP, as above
    items = collectives(parallel.parallel_graph, mesh)
    assert items and all(c.mesh_dim in (0, 1) for c in items)
    table = summarize(items)
    assert ("forward", "all_gather_into_tensor", 0) in table or ("forward", "all_gather_into_tensor", 1) in table
    assert any(kind == "reduce_scatter_tensor" and phase == "backward" for phase, kind, _ in table)
    assert all(count > 0 and size > 0 for count, size in table.values())
