"""Small models for planner and pass tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoparallel.models.llama3 import (
    ModelArgs,
    TransformerBlock,
    init_rope_buffers,
    register_rope_buffers,
)

__all__ = ["FFN", "BlockModel"]


class FFN(nn.Module):
    """x [..., dim] -> w2(act(w1 x)) [..., dim]; act is "relu" or "gelu"."""

    def __init__(self, dim: int, hidden: int, activation: str = "relu", bias: bool = False):
        super().__init__()
        if activation not in ("relu", "gelu"):
            raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")
        self.activation = activation
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = F.relu if self.activation == "relu" else F.gelu
        return self.w2(act(self.w1(x)))

    def init_weights(self, std: float = 0.02) -> None:
        for linear in (self.w1, self.w2):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std, a=-2.0, b=2.0)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    reset_parameters = init_weights


class BlockModel(nn.Module):
    """``args.n_layers`` LLaMA blocks on float input [b, s, dim] -> [b, s, dim].

    No embedding or output head; owns its RoPE buffers like ``Transformer``.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        register_rope_buffers(self, args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seqlen = x.shape[1]
        cos = self.freqs_cos[:seqlen]
        sin = self.freqs_sin[:seqlen]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x

    def _init_buffers(self, buffer_device=None) -> None:
        init_rope_buffers(self, self.args, buffer_device)

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        self._init_buffers(buffer_device)
        for layer in self.layers:
            layer.init_weights()

    reset_parameters = init_weights
