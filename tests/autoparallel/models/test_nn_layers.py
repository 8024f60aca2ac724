"""torch.nn's own layers plan, apply and match the single-device step on a
2x2 mesh (4 simulated ranks), with the plan forced to shard compute (a slow
compute device: batch over both mesh dims, heads over tp), which exercises
the local strides after redistributions (views after all-to-alls)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor.placement_types import Replicate

from _parity import check_step, plan_and_apply, sharded_matmul_fraction, slow_compute_device

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*enable_nested_tensor.*:UserWarning"),
]

B, S, D, H = 8, 8, 32, 4


class MeanSquare(nn.Module):
    """``body`` followed by a mean-square loss (a scalar per step)."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x):
        out = self.body(x)
        if isinstance(out, tuple):
            out = out[0]
        return out.float().pow(2).mean()


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class EmbeddingHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, D, padding_idx=0)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 16)

    def forward(self, tokens):
        return self.head(self.norm(self.emb(tokens)))


def _encoder(norm_first: bool):
    layer = nn.TransformerEncoderLayer(D, H, 2 * D, dropout=0.0, batch_first=True, norm_first=norm_first)
    # one layer: the encoder's ops are those of its layer
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)


def _float(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _tokens():
    t = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(1))
    t[:, -2:] = 0  # padding positions: no gradient to row 0
    return t


CASES = {
    "multihead_attention": (SelfAttention, lambda: (_float(B, S, D),)),
    "encoder_norm_first": (lambda: _encoder(True), lambda: (_float(B, S, D),)),
    "embedding_padding_idx": (EmbeddingHead, lambda: (_tokens(),)),
    "conv1d_groupnorm": (
        lambda: nn.Sequential(nn.Conv1d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.GELU(), nn.Conv1d(16, 8, 1)),
        lambda: (_float(B, 8, 16),),
    ),
    "conv2d_layernorm": (
        lambda: nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2), nn.Flatten(), nn.LayerNorm(72)
        ),
        lambda: (_float(B, 3, 8, 8),),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_nn_layer_sharded_compute(fake_world, name):
    fake_world(4)
    body, make_inputs = CASES[name]

    def build():
        return MeanSquare(body())

    inputs = make_inputs()
    parallel, plan, mesh = plan_and_apply(build, inputs, device=slow_compute_device())
    assert sharded_matmul_fraction(plan) > 0.5, plan.summary()
    check_step(parallel, mesh, build, inputs)


def test_encoder_default_cost_model(fake_world):
    fake_world(4)
    build = lambda: MeanSquare(_encoder(False))  # noqa: E731
    inputs = (_float(B, S, D),)
    parallel, plan, mesh = plan_and_apply(build, inputs)
    check_step(parallel, mesh, build, inputs)


def test_apply_error_names_node_module_and_placements(fake_world, monkeypatch):
    """An op that fails on the local shards is reported with its node, module
    path and the placements involved (here: the view after attention, with
    the contiguity fix switched off)."""
    import autoparallel.apply.local_graph as local_graph
    from autoparallel.apply.redistribute import ApplyError

    import autoparallel.options.rules.attention as attention_rules

    fake_world(4)
    monkeypatch.setattr(local_graph, "_viewable_args", lambda op, args, kwargs: args)
    # attention split by batch or heads only: with the sequence split offered
    # the pinned view's local input is a contiguous gathered tensor
    monkeypatch.setattr(attention_rules, "sequence_options", lambda *args: [])
    build = lambda: MeanSquare(_encoder(False))  # noqa: E731
    # the view replicated (its local input is then the whole permuted,
    # non-contiguous tensor), as the greedy redistribution costs planned it;
    # min-cost ones shard it, where the local view happens to work
    replicated = (Replicate(), Replicate())
    with pytest.raises(ApplyError) as info:
        plan_and_apply(build, (_float(B, S, D),), device=slow_compute_device(), pins={"view_7": replicated})
    msg = str(info.value)
    assert "Cannot view a tensor" in msg
    assert "in module body.layers.0.self_attn" in msg, msg
    assert "node view" in msg and "input layouts permute" in msg and "planned option: inputs (" in msg, msg
