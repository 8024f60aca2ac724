"""The routed-experts custom ops, ``torch.ops.autoparallel.*``.

``moe_experts(x, topk_idx, topk_w, w1, w3, w2, expert_ids, n_experts)``
runs every (token, slot) routed to one of the experts in ``expert_ids``
through that expert's SwiGLU (stacked weights ``w1/w3 [E, dim, hidden]``,
``w2 [E, hidden, dim]``) and sums them with the routing weights: dropless,
with static shapes, so a step using it traces on fake tensors. Its backward
is ``moe_experts_backward``; ``moe_grad_layout`` (an identity on an expert
weight gradient) gives the planner a node where that gradient may change
layout. :class:`autoparallel.models.moe.MoE` calls it, and Hugging Face
MoE experts are routed through it while tracing
(:mod:`autoparallel.capture.trace_wrappers`); its sharding rules are in
:mod:`autoparallel.options.rules.moe` and its all-to-all lowering in
:mod:`autoparallel.apply.moe_dispatch`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["moe_experts", "moe_experts_backward", "moe_grad_layout", "swiglu_backward"]


def _flat(x, idx, tw):
    d = x.shape[-1]
    k = idx.shape[-1]
    return x.reshape(-1, d), idx.reshape(-1, k), tw.reshape(-1, k)


@torch.library.custom_op("autoparallel::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    n_experts: int,
) -> torch.Tensor:
    """sum_k topk_w[t,k] * SwiGLU_{topk_idx[t,k]}(x[t]) over the experts in
    ``expert_ids`` (``w*[j]`` is expert ``expert_ids[j]``); other (token,
    slot) pairs contribute nothing. ``n_experts`` is the global count (for
    the cost model)."""
    xt, idx, tw = _flat(x, topk_idx, topk_w)
    out = torch.zeros_like(xt)
    for j, e in enumerate(expert_ids.tolist()):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xs = xt[tok]
        h = F.silu(xs @ w1[j]) * (xs @ w3[j])
        out.index_add_(0, tok, (h @ w2[j]) * tw[tok, slot, None])
    return out.view(x.shape)


@moe_experts.register_fake
def _(x, topk_idx, topk_w, w1, w3, w2, expert_ids, n_experts):
    return torch.empty_like(x)


@torch.library.custom_op("autoparallel::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    n_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (x, topk_w, w1, w3, w2) of :func:`moe_experts`, recomputing
    the expert activations."""
    xt, idx, tw = _flat(x, topk_idx, topk_w)
    g = grad_out.reshape(xt.shape)
    gx = torch.zeros_like(xt)
    gtw = torch.zeros_like(tw)
    gw1, gw3, gw2 = torch.zeros_like(w1), torch.zeros_like(w3), torch.zeros_like(w2)
    for j, e in enumerate(expert_ids.tolist()):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gs = g[tok]
        gxs, y, gw1[j], gw3[j], gw2[j] = swiglu_backward(xt[tok], gs * tw[tok, slot, None], w1[j], w3[j], w2[j])
        gtw[tok, slot] = (y * gs).sum(-1)
        gx.index_add_(0, tok, gxs)
    return gx.view(x.shape), gtw.view(topk_w.shape), gw1, gw3, gw2


def swiglu_backward(xs, gy, w1, w3, w2):
    """For rows ``xs`` through one expert ``(w1, w3, w2)`` and the gradient
    ``gy`` of its output: (grad xs, the expert's output, grad w1, grad w3,
    grad w2), recomputing the activations."""
    a, b = xs @ w1, xs @ w3
    sa = torch.sigmoid(a)
    act = a * sa
    h = act * b
    gh = gy @ w2.t()
    ga = gh * b * (sa * (1 + a * (1 - sa)))
    gb = gh * act
    return ga @ w1.t() + gb @ w3.t(), h @ w2, xs.t() @ ga, xs.t() @ gb, h.t() @ gy


@moe_experts_backward.register_fake
def _(grad_out, x, topk_idx, topk_w, w1, w3, w2, expert_ids, n_experts):
    return (
        torch.empty_like(x),
        torch.empty_like(topk_w),
        torch.empty_like(w1),
        torch.empty_like(w3),
        torch.empty_like(w2),
    )


@torch.library.custom_op("autoparallel::moe_grad_layout", mutates_args=())
def moe_grad_layout(g: torch.Tensor) -> torch.Tensor:
    """Identity (a copy) on an expert weight gradient. It gives the planner a
    node between the backward op and the gradient output that may take any
    layout, so a Partial weight gradient (token-parallel experts) can be
    reduce-scattered to an FSDP-sharded parameter's layout on its input edge."""
    return g.clone()


@moe_grad_layout.register_fake
def _(g):
    return torch.empty_like(g)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7])
    ctx.n_experts = inputs[7]


def _backward(ctx, grad_out):
    x, idx, tw, w1, w3, w2, ids = ctx.saved_tensors
    gx, gtw, gw1, gw3, gw2 = moe_experts_backward(grad_out, x, idx, tw, w1, w3, w2, ids, ctx.n_experts)
    gw1, gw3, gw2 = (moe_grad_layout(g) for g in (gw1, gw3, gw2))
    return gx, None, gtw, gw1, gw3, gw2, None, None


moe_experts.register_autograd(_backward, setup_context=_setup_context)
