"""apply_placement with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
on 8 simulated ranks: same loss and gradients (bf16 tolerance) as a
single-device model whose forward casts its parameters (and floating inputs)
to bf16 with autograd-tracked casts; parameters and gradients stay fp32."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.models import FFN, LLAMA3_CONFIGS, BlockModel

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

ARGS = LLAMA3_CONFIGS["debug"]
BATCH, SEQ = 8, 16
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

MODELS = {
    "ffn": (lambda: FFN(16, 64, bias=True), 16),
    "block": (lambda: BlockModel(ARGS), ARGS.dim),
}


def _full(t: DTensor) -> torch.Tensor:
    full = t.full_tensor()
    return full.reconcile() if isinstance(full, LocalTensor) else full


def _bf16_reference(ref: torch.nn.Module, x: torch.Tensor):
    """Loss and fp32 gradients of ``ref`` run FSDP-style in bf16."""
    params = {n: p.to(torch.bfloat16) for n, p in ref.named_parameters()}  # tracked casts
    out = torch.func.functional_call(ref, params, (x.to(torch.bfloat16),))
    loss = out.float().pow(2).sum() / out.numel()
    loss.backward()
    return out.detach(), loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.parametrize(
    "kind, mesh_shape",
    [("ffn", (2, 4)), pytest.param("block", (8,), marks=pytest.mark.slow)],  # block: ~10 s
)
def test_bf16_params_fp32_reduce(fake_world, kind, mesh_shape):
    fake_world(8)
    build, dim = MODELS[kind]
    mesh = init_device_mesh("cpu", mesh_shape)
    x = torch.randn(BATCH, SEQ, dim, generator=torch.Generator().manual_seed(1))
    with torch.device("meta"):
        model = build()
    with AutoParallel(model, mesh, torch.empty_like(x, device="meta"), mp_policy=MP) as autop:
        batch = (Shard(0),) + (Replicate(),) * (mesh.ndim - 1)
        autop.add_input_constraints([batch])
        autop.add_output_constraints([batch])
        parallel = autop.apply_placement(autop.optimize_placement())

    ref = build()
    torch.manual_seed(0)
    ref.init_weights()
    ref_out, ref_loss, ref_grads = _bf16_reference(ref, x)
    assert ref_out.dtype == torch.bfloat16

    n = mesh.size()
    per = BATCH // mesh.size(0)
    with LocalTensorMode(n) as lm:
        parallel.to_empty(device="cpu")
        parallel.init_weights()
        parallel.load_state_dict(ref.state_dict())
        coord = {r: (mesh.mesh == r).nonzero()[0].tolist() for r in range(n)}
        local_x = lm.rank_map(lambda r: x[coord[r][0] * per : (coord[r][0] + 1) * per].clone())
        out = parallel(local_x)
        assert out.dtype == torch.bfloat16
        loss = out.float().pow(2).sum() / ref_out.numel()
        loss.backward()
        # each dp slice counts once (ranks that differ only on other mesh
        # dims hold the same rows)
        losses = {tuple(c[:1]): loss._local_tensors[r] for r, c in coord.items()}
        total = sum(losses.values())
        grads = {}
        for name, p in parallel.named_parameters():
            assert p.dtype == torch.float32, name
            assert isinstance(p.grad, DTensor) and p.grad.dtype == torch.float32, name
            grads[name] = _full(p.grad)
    torch.testing.assert_close(total, ref_loss, rtol=1e-3, atol=1e-7)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        # bf16 matmuls over differently split contractions round differently
        scale = g.abs().max().item()
        torch.testing.assert_close(grads[name], g, rtol=5e-2, atol=1e-2 * scale + 1e-7, msg=name)
