"""DeepSeek-V3-style mixture-of-experts decoder, built from the LLaMA-3 pieces.

The first ``n_dense_layers`` blocks use the dense SwiGLU feed-forward; the
rest replace it with :class:`MoE`: a token-choice top-k router (softmax or
sigmoid scores), ``n_shared_experts`` always-on experts (one SwiGLU of
``n_shared_experts * moe_hidden`` width, as in DeepSeek) and ``n_experts``
routed experts stored as stacked weights ``w1/w3 [E, dim, hidden]`` and
``w2 [E, hidden, dim]``.

Routed experts run as ONE opaque op, ``torch.ops.autoparallel.moe_experts``
(with its backward ``moe_experts_backward``; both in :mod:`autoparallel.ops.moe`). Its inputs and outputs have
static shapes (tokens ``[..., dim]``, expert ids ``[..., k]``, routing
weights ``[..., k]``, the stacked weights and an ``expert_ids`` buffer
``arange(E)``), so the step traces on fake tensors without data-dependent
sizes. Inside, dispatch is dropless: every (token, slot) routed to an expert
is computed, nothing is padded or dropped. The op only computes the experts
whose ids it is handed in ``expert_ids``, and leaves zero rows for tokens of
other experts: that is what makes expert parallelism an ordinary placement
(``Shard(0)`` of the weights *and* of ``expert_ids``, output ``Partial``);
see :mod:`autoparallel.options.rules.moe`.

Load balancing: the ``expert_bias`` buffer (DeepSeek-V3's aux-loss-free
bias) shifts which experts are *selected* but not the routing weights; it is
read-only inside the traced step (the tracer rejects input mutation), so a
trainer that wants to adapt it updates it between steps with
:meth:`MoE.update_expert_bias`. The sequence-wise auxiliary balance loss
(``aux_loss_alpha``) is added through :class:`AddAuxiliaryLoss`, which keeps
the model's output the logits alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autoparallel.models.llama3 import (
    Attention,
    FeedForward,
    ModelArgs,
    RMSNorm,
    trunc_normal,
    init_rope_buffers,
    register_rope_buffers,
)
from autoparallel.ops.moe import moe_experts

__all__ = [
    "MoEArgs",
    "MOE_CONFIGS",
    "MoE",
    "MoEBlock",
    "MoETransformer",
    "AddAuxiliaryLoss",
]


@dataclass(frozen=True)
class MoEArgs(ModelArgs):
    n_dense_layers: int = 1
    dense_hidden: int = 10944
    n_experts: int = 64
    top_k: int = 6
    n_shared_experts: int = 2
    moe_hidden: int = 1408
    score_func: str = "softmax"  # "softmax" or "sigmoid"
    route_norm: bool = False  # renormalise the top-k weights to sum to 1
    route_scale: float = 1.0
    aux_loss_alpha: float = 0.0
    bias_update_rate: float = 1e-3


MOE_CONFIGS: dict[str, MoEArgs] = {
    "debug": MoEArgs(
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        vocab_size=256,
        max_seq_len=64,
        n_dense_layers=1,
        dense_hidden=128,
        n_experts=8,
        top_k=2,
        n_shared_experts=1,
        moe_hidden=32,
        score_func="softmax",
        aux_loss_alpha=1e-2,
    ),
    # DeepSeek-V2-Lite / Moonlight-16B-A3B-like (MHA instead of MLA).
    "16B": MoEArgs(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=102400,
        max_seq_len=4096,
        n_dense_layers=1,
        dense_hidden=10944,
        n_experts=64,
        top_k=6,
        n_shared_experts=2,
        moe_hidden=1408,
        score_func="softmax",
    ),
    # DeepSeek-V3-671B-like (MHA with 128 heads instead of MLA): planning only.
    "671B": MoEArgs(
        dim=7168,
        n_layers=61,
        n_heads=128,
        vocab_size=129280,
        max_seq_len=4096,
        n_dense_layers=3,
        dense_hidden=18432,
        n_experts=256,
        top_k=8,
        n_shared_experts=1,
        moe_hidden=2048,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
    ),
}
MOE_CONFIGS["debug_sigmoid"] = replace(MOE_CONFIGS["debug"], score_func="sigmoid", route_norm=True, route_scale=2.0)


class AddAuxiliaryLoss(torch.autograd.Function):
    """Identity on ``x``; backward also sends gradient 1 into ``aux_loss``, so
    the balance loss is minimised without being a model output."""

    @staticmethod
    def forward(ctx, x, aux_loss):
        ctx.dtype = aux_loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=ctx.dtype, device=grad.device)


# --------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------


class MoE(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.args = args
        e, d, h = args.n_experts, args.dim, args.moe_hidden
        self.gate = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, d, h))
        self.w3 = nn.Parameter(torch.empty(e, d, h))
        self.w2 = nn.Parameter(torch.empty(e, h, d))
        # Initialised here, as nn.Linear initialises its weight: a model built
        # without init_weights() must not compute with uninitialised memory.
        for w in (self.w1, self.w3, self.w2):
            trunc_normal(w, 0.02)
        self.shared = FeedForward(d, h * args.n_shared_experts) if args.n_shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32))
        # Which experts this module holds; sharded with the weights under EP.
        self.register_buffer("expert_ids", torch.arange(e), persistent=False)
        # (token, slot) pairs routed to each expert since the last bias update,
        # counted inside the (traced, planned) step: a buffer mutation the
        # planned step writes back, for update_expert_bias between steps.
        self.register_buffer("tokens_per_expert_count", torch.zeros(e, dtype=torch.float32), persistent=False)

    def route(self, x: torch.Tensor):
        """(scores [.., E], topk_idx [.., k], topk_w [.., k]) for x [.., dim]."""
        a = self.args
        logits = self.gate(x).float()
        if a.score_func == "softmax":
            scores = logits.softmax(-1)
        elif a.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {a.score_func!r}")
        # The bias steers selection only (DeepSeek-V3); weights use raw scores.
        _, idx = torch.topk(scores + self.expert_bias, a.top_k, dim=-1)
        tw = scores.gather(-1, idx)
        if a.route_norm:
            tw = tw / (tw.sum(-1, keepdim=True) + 1e-20)
        return scores, idx, (tw * a.route_scale).type_as(x)

    def aux_loss(self, scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """DeepSeek's sequence-wise balance loss: alpha * sum_i f_i * P_i per
        sequence, averaged over the batch. scores [b, s, E], idx [b, s, k]."""
        a = self.args
        b, s, _ = scores.shape
        counts = torch.zeros(b, a.n_experts, dtype=scores.dtype, device=scores.device)
        counts = counts.scatter_add(
            1, idx.reshape(b, -1), torch.ones(b, s * a.top_k, dtype=scores.dtype, device=scores.device)
        )
        f = counts * (a.n_experts / (a.top_k * s))
        p = (scores / scores.sum(-1, keepdim=True)).mean(1)
        return a.aux_loss_alpha * (f * p).sum(-1).mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores, idx, tw = self.route(x)
        out = moe_experts(x, idx, tw, self.w1, self.w3, self.w2, self.expert_ids, self.args.n_experts)
        if self.shared is not None:
            out = out + self.shared(x)
        if self.args.aux_loss_alpha > 0 and self.training:
            out = AddAuxiliaryLoss.apply(out, self.aux_loss(scores, idx))
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_count.add_(self._count(idx))
        return out

    def _count(self, idx: torch.Tensor) -> torch.Tensor:
        # a compare-and-sum, not bincount: static shape, and a sum over
        # token-sharded rows is a Partial the planner can reduce
        hits = idx.unsqueeze(-1) == torch.arange(self.args.n_experts, device=idx.device)
        return hits.flatten(0, -2).sum(0, dtype=torch.float32)

    @torch.no_grad()
    def tokens_per_expert(self, x: torch.Tensor) -> torch.Tensor:
        """How many (token, slot) pairs go to each expert for input x (eager)."""
        _, idx, _ = self.route(x)
        return torch.bincount(idx.flatten(), minlength=self.args.n_experts)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing step (between training steps): raise the
        bias of under-loaded experts, lower over-loaded ones. Without an
        argument, uses and then clears the counts the steps accumulated."""
        counted = tokens_per_expert is None
        load = (self.tokens_per_expert_count if counted else tokens_per_expert).float()
        self.expert_bias.add_(self.args.bias_update_rate * torch.sign(load.mean() - load))
        if counted:
            self.tokens_per_expert_count.zero_()

    def init_weights(self, init_std: float) -> None:
        trunc_normal(self.gate.weight, init_std)
        trunc_normal(self.w1, 0.02)
        for w in (self.w2, self.w3):
            trunc_normal(w, init_std)
        if self.shared is not None:
            self.shared.init_weights(init_std)
        self.expert_bias.zero_()
        self.tokens_per_expert_count.zero_()
        ids = torch.arange(self.args.n_experts, device=self.expert_ids.device)
        if isinstance(self.expert_ids, DTensor):  # after apply: sharded like the experts
            ids = distribute_tensor(ids, self.expert_ids.device_mesh, self.expert_ids.placements)
        self.expert_ids.copy_(ids)


class MoEBlock(nn.Module):
    """Attention + (dense FFN if layer_id < n_dense_layers else MoE)."""

    def __init__(self, layer_id: int, args: MoEArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.dense_hidden)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x, rope_cos, rope_sin):
        h = x + self.attention(self.attention_norm(x), rope_cos, rope_sin)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        ffn.init_weights(self.weight_init_std)


class MoETransformer(nn.Module):
    """tokens [bsz, seqlen] int64 -> logits [bsz, seqlen, vocab]."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(MoEBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        register_rope_buffers(self, args)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        cos, sin = self.freqs_cos[:seqlen], self.freqs_sin[:seqlen]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def _init_buffers(self, buffer_device=None) -> None:
        init_rope_buffers(self, self.args, buffer_device)

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        self._init_buffers(buffer_device)
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers:
            layer.init_weights()
        self.norm.reset_parameters()
        std = self.args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    reset_parameters = init_weights
