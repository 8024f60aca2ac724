"""``AutoParallel(..., attention_kernel=...)``: the model's attention traced
as the named fused CUDA kernel on a CPU mesh (what a GPU runs), planned with
that kernel's options; an unknown name fails at construction."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch.distributed.device_mesh import init_device_mesh

from autoparallel import AutoParallel

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]

aten = torch.ops.aten


class Attention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.transpose(1, 2) for y in self.qkv(x).view(b, t, 3, self.heads, c // self.heads).unbind(2))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


@pytest.mark.parametrize(
    "kernel, forward, backward",
    [
        (None, aten._scaled_dot_product_flash_attention_for_cpu.default, None),
        (
            "cudnn",
            aten._scaled_dot_product_cudnn_attention.default,
            aten._scaled_dot_product_cudnn_attention_backward.default,
        ),
        (
            "flash",
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_backward.default,
        ),
    ],
)
def test_attention_traced_as_the_named_kernel(fake_world, kernel, forward, backward):
    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Attention()
    x = torch.empty(4, 16, 32, device="meta")
    with AutoParallel(model, mesh, (x,), attention_kernel=kernel) as autop:
        targets = {n.target for n in autop.traced.gm.graph.nodes}
        autop.optimize_placement()
    assert forward in targets
    if backward is not None:
        assert backward in targets


def test_unknown_attention_kernel_is_refused(fake_world):
    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2))
    with pytest.raises(ValueError, match="attention_kernel must be None .* 'cudnn'.*got 'math'"):
        AutoParallel(Attention(), mesh, (torch.empty(4, 16, 32),), attention_kernel="math")
