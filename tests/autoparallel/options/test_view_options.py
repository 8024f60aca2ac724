"""Reshapes that split or merge dims get DTensor's valid options.

An own attention block packs q, k and v in one matmul and splits them with
``qkv.view(B, T, 3, heads, head_dim)``; its backward stacks the three
gradients (``unbind``'s backward) and merges them back with a view. Both
views must get DTensor's options (batch-sharded and others), not the
replicate-only fallback, and the planned step must equal single device.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _parity import check_step, plan_and_apply
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from autoparallel import AutoParallel

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]

B, T, C, HEADS, VOCAB = 4, 8, 32, 4, 64


class PackedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)

    def forward(self, x):
        b, t, c = x.shape
        qkv = self.qkv(x).view(b, t, 3, HEADS, c // HEADS)
        q, k, v = (y.transpose(1, 2) for y in qkv.unbind(2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, C)
        self.blocks = nn.ModuleList(PackedAttention() for _ in range(layers))
        self.head = nn.Linear(C, VOCAB)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).reshape(-1, VOCAB).float().pow(2).mean()


def _tokens():
    return (torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0)),)


def _is_view(node) -> bool:
    return node.target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def test_packed_qkv_views_get_dtensor_options(fake_world, caplog):
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = TinyGPT()
    with caplog.at_level(logging.WARNING, logger="autoparallel.options.strategies"):
        with AutoParallel(model, mesh, (torch.empty(B, T, dtype=torch.long, device="meta"),)) as autop:
            strategies = autop.strategies
    assert not [r for r in caplog.records if "view" in r.getMessage()], caplog.text
    five_d = [n for n in strategies if _is_view(n) and 5 in (n.meta["val"].dim(), n.args[0].meta["val"].dim())]
    # split (forward) and merge (backward) of the packed qkv, per layer
    assert len(five_d) >= 4, [n.name for n in five_d]
    for node in five_d:
        strategy = strategies[node]
        assert strategy.source == "dtensor", (node.name, strategy.source)
        outs = {tuple(o.output_specs.placements) for o in strategy.options}
        # the batch over dp, with tp replicated, sharded or partial
        assert any(p[0] == Shard(0) for p in outs), (node.name, outs)
        assert len(outs) > 2, (node.name, outs)
    stacks = [n for n in strategies if n.target is torch.ops.aten.stack.default]
    assert stacks and all(len(strategies[n].options) > 1 for n in stacks)


def test_packed_qkv_step_matches_single_device(fake_world):
    fake_world(4)
    parallel, plan, mesh = plan_and_apply(lambda: TinyGPT(layers=1), _tokens())
    check_step(parallel, mesh, lambda: TinyGPT(layers=1), _tokens(), rel=1e-5)
