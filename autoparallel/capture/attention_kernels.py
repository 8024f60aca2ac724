"""Trace ``F.scaled_dot_product_attention`` as a chosen fused CUDA kernel.

On a GPU, torch turns ``scaled_dot_product_attention`` into one of its fused
kernels (``aten._scaled_dot_product_{flash,efficient,cudnn}_attention``,
cuDNN on H100/H200 by default) and autograd into the matching backward;
traced on a "cpu" mesh it becomes ``_scaled_dot_product_flash_attention_for_cpu``.
A "cuda" mesh cannot be traced on a CPU-only build of torch (the fake CUDA
tensors' autograd needs CUDA's device guard, and the process aborts), so
to plan on a CPU machine with the kernel a GPU runs, trace on a "cpu" mesh
inside :func:`traced_attention_kernel`::

    with traced_attention_kernel("cudnn"), AutoParallel(model, mesh, inputs) as autop:
        ...

Every ``scaled_dot_product_attention`` call the model makes is then the
named kernel's aten op, called as torch's CUDA dispatch calls it (a boolean
mask made additive, masks expanded to ``(batch, heads, q_len, k_len)``,
the logsumexp computed when a gradient is needed), and autograd records
its backward; the kernels' meta functions need no GPU under fake tensors.
Not reproduced: torch's padding of head dims to a multiple of 8 (flash)
and of masks to a multiple of 16 (memory layout only), and its choice of
another kernel when the named one cannot take the call (flash takes no
mask: an error says so). ``enable_gqa`` repeats key and value heads, as
torch's math kernel does.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["FUSED_ATTENTION_KERNELS", "fused_attention", "traced_attention_kernel"]

aten = torch.ops.aten

FUSED_ATTENTION_KERNELS = ("flash", "efficient", "cudnn")


def fused_attention(
    kernel: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(query, key, value, ...)`` through the
    fused ``kernel`` (one of :data:`FUSED_ATTENTION_KERNELS`)."""
    if kernel not in FUSED_ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {kernel!r}: expected one of {', '.join(FUSED_ATTENTION_KERNELS)}")
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeats = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeats, dim=-3)
        value = value.repeat_interleave(repeats, dim=-3)
    if kernel == "flash":
        if attn_mask is not None:
            raise ValueError(
                "flash attention takes no attention mask (torch would run another kernel): trace this model "
                "with traced_attention_kernel('efficient') or ('cudnn')"
            )
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
        attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
    logsumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if kernel == "efficient":
        out = aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, logsumexp, dropout_p, is_causal, scale=scale
        )
    else:
        out = aten._scaled_dot_product_cudnn_attention(
            query, key, value, attn_mask, logsumexp, dropout_p, is_causal, False, scale=scale
        )
    return out[0]


class _FusedAttentionMode(TorchFunctionMode):
    def __init__(self, kernel: str):
        super().__init__()
        self.kernel = kernel

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return fused_attention(self.kernel, *args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def traced_attention_kernel(kernel: str | None) -> Iterator[None]:
    """Inside, ``F.scaled_dot_product_attention`` runs as the fused CUDA
    ``kernel`` ("flash", "efficient" or "cudnn"); None changes nothing (the
    kernel torch picks for the traced tensors' device)."""
    if kernel is None:
        yield
        return
    if kernel not in FUSED_ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {kernel!r}: expected None or one of {', '.join(FUSED_ATTENTION_KERNELS)}")
    with _FusedAttentionMode(kernel):
        yield
