"""The fused attention kernels torch picks on a GPU: flash, memory-efficient
and cuDNN attention, forward and backward.

``F.scaled_dot_product_attention`` on CUDA tensors becomes one of
``aten._scaled_dot_product_{flash,efficient,cudnn}_attention`` (cuDNN on
H100/H200 by default) and autograd's matching ``*_backward``. Their options
are the CPU kernel's (:func:`.attention.batch_head_options`): per mesh dim,
batch-sharded, head-sharded or replicated, all attention tensors alike
(q, k, v, output, logsumexp, a returned debug mask and their gradients;
the logsumexp is ``(B, H, Lq)`` for flash, ``(B, H, Lq padded to 32)``
for efficient and ``(B, H, Lq, 1)`` for cuDNN attention, dims 0 and 1
batch and heads in each); an attention bias (efficient and cuDNN) follows
where it holds the batch or head dim in full and is replicated where it
broadcasts, its gradient (the efficient backward's fourth output) then a
partial sum; the random-number state (philox seed and offset, flash's
``rng_state``), empty debug masks and the SymInt/None outputs (max_q/k,
cum_seq_q/k) replicated or without a spec. Each rank's kernel draws its
own philox state and its backward reads that same local state, so
"replicated" there moves nothing. Variable-length attention (cum_seq_q/k
given: dim 0 holds the packed tokens of every sequence) runs replicated.
Like the CPU kernel's, every kernel's rule also offers the sequence split
over one mesh dim (context parallelism, :mod:`.context_parallel`; the
efficient kernel's only where the sequence is a multiple of 32, as its
logsumexp is padded to one).

Why rules of our own, when DTensor has strategies for all six ops
(``torch/distributed/tensor/_ops/_matrix_ops.py``)? Their placements are
the same three per mesh dim, and they do plan once
:meth:`~autoparallel.options.strategies.StrategyEnumerator` gives a spec to
the tensor outputs they leave without one (their philox seed/offset: the
getitems of those outputs offered no spec, and the backward's strategy,
handed that None as its candidate, raised "function output_spec expects a
single DTensorSpec but got: None", the failure seen on a GPU). But they are
per-kernel lists of placements by argument position that change between
torch releases, and the cuDNN forward's lists omit the attention bias
(with a bias it raises IndexError on torch 2.13 and runs replicated). One
shape-driven rule for every kernel, the CPU one included, offers the same
layouts with any bias, on every supported release.
"""

from __future__ import annotations

import torch
import torch.fx

from ..strategies import Option, register_rule, tensor_inputs
from .attention import PER_DIM_CHOICES, batch_head_options
from .context_parallel import sequence_options

aten = torch.ops.aten

_VARLEN_ARGUMENTS = ("cum_seq_q", "cum_seq_k")


def _argument(node: torch.fx.Node, name: str):
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name)
    return None


def _variable_length(node: torch.fx.Node) -> bool:
    """Whether the op takes or returns packed sequences (cum_seq_q/k tensors)."""
    if any(isinstance(_argument(node, name), torch.fx.Node) for name in _VARLEN_ARGUMENTS):
        return True
    returns = node.target._schema.returns
    val = node.meta["val"]
    return isinstance(val, (tuple, list)) and any(
        r.name in _VARLEN_ARGUMENTS and isinstance(v, torch.Tensor) for r, v in zip(returns, val)
    )


def _options(node: torch.fx.Node, mesh, query_index: int, mask_grad_outputs: tuple[int, ...] = ()) -> list[Option]:
    options = batch_head_options(node, mesh, node.args[query_index], mask_grad_outputs)
    if _variable_length(node):
        return options[:1]  # the first combination is the replicated one
    tensors = [n.meta["val"] for n in tensor_inputs(node)]
    return options + sequence_options(node, tensors, node.meta["val"], mesh, PER_DIM_CHOICES)


@register_rule(
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
)
def fused_attention_rule(node, input_candidates, mesh) -> list[Option]:
    return _options(node, mesh, query_index=0)


@register_rule(
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
)
def fused_attention_backward_rule(node, input_candidates, mesh) -> list[Option]:
    return _options(node, mesh, query_index=1)


@register_rule(aten._scaled_dot_product_efficient_attention_backward.default)
def efficient_attention_backward_rule(node, input_candidates, mesh) -> list[Option]:
    # outputs: grad_query, grad_key, grad_value, grad_bias
    return _options(node, mesh, query_index=1, mask_grad_outputs=(3,))
