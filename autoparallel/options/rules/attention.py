"""Scaled-dot-product attention on CPU (the op tracing on a "cpu" mesh yields),
and the options every fused attention kernel shares
(:func:`batch_head_options`; the CUDA kernels' rules are in
:mod:`.fused_attention`).

DTensor has no rule for ``_scaled_dot_product_flash_attention_for_cpu`` and
its backward. Attention is independent per batch element and per head, so
on each mesh dim every attention tensor (q, k, v, output, logsumexp and
their gradients: dim 0 batch, dim 1 heads) is either sharded on the batch
dim, sharded on the head dim, or replicated, all alike. An attention mask
or bias broadcasts against ``(batch, heads, q_len, k_len)`` from the right:
it is sharded where it has the batch (heads) dim in full and replicated
where it broadcasts over it (a 2-D causal mask is replicated whatever q
holds). Tensors of fewer than three dims (random-number state, empty debug
masks) are replicated. The CPU kernel may also split the sequence over
one mesh dim (context parallelism): those options come from
:mod:`.context_parallel`, whose apply gathers K and V and runs causal
attention as blocks merged by their logsumexps.
"""

from __future__ import annotations

import itertools

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..strategies import Option, SpecPool, is_evenly_sharded, register_rule, tensor_inputs, tensor_meta_of
from .context_parallel import sequence_options

aten = torch.ops.aten

PER_DIM_CHOICES = (Replicate(), Shard(0), Shard(1))
# schema names of the inputs that broadcast against (batch, heads, q_len, k_len)
MASK_ARGUMENTS = ("attn_mask", "attn_bias")
# attention tensors have batch, heads and at least one more dim; smaller
# tensors are the kernels' random-number state and empty debug masks
_AUXILIARY_MAX_DIMS = 2


def _mask_placement(p: Placement, mask: torch.Tensor, q_shape: torch.Size, gradient: bool) -> Placement:
    """A mask's (or its gradient's) placement on a mesh dim where the
    attention tensors have ``p``: the same dim where the mask holds it in
    full; where it broadcasts, the mask itself is replicated and its
    gradient is a partial sum (each rank holds its shard's contribution)."""
    if not isinstance(p, Shard):
        return p
    dim = p.dim - (4 - mask.dim())
    if dim >= 0 and mask.shape[dim] == q_shape[p.dim]:
        return Shard(dim)
    return Partial() if gradient else Replicate()


def _mask_nodes(node: torch.fx.Node) -> set[torch.fx.Node]:
    schema = node.target._schema
    found = set()
    for i, arg in enumerate(schema.arguments):
        if arg.name not in MASK_ARGUMENTS:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, torch.fx.Node):
            found.add(value)
    return found


def batch_head_options(
    node: torch.fx.Node, mesh: DeviceMesh, query: torch.fx.Node, mask_grad_outputs: tuple[int, ...] = ()
) -> list[Option]:
    """Options of an attention op: per mesh dim, batch-sharded, head-sharded
    or replicated (see the module docstring for each kind of tensor).
    ``query`` is the node's query input (the shape masks broadcast
    against); ``mask_grad_outputs`` are the indices of outputs that are a
    mask's gradient (laid out as the mask, Partial where it broadcasts)."""
    inputs = tensor_inputs(node)
    masks = _mask_nodes(node)
    q_shape = query.meta["val"].shape
    out_val = node.meta["val"]
    outs = out_val if isinstance(out_val, (tuple, list)) else (out_val,)
    pool = SpecPool(mesh)
    options = []
    for combo in itertools.product(PER_DIM_CHOICES, repeat=mesh.ndim):

        def placements(t: torch.Tensor, mask: bool = False, gradient: bool = False):
            if mask:
                return tuple(_mask_placement(p, t, q_shape, gradient) for p in combo)
            if t.dim() <= _AUXILIARY_MAX_DIMS:
                return (Replicate(),) * mesh.ndim  # rng state, empty debug mask
            return combo

        in_placements = [placements(n.meta["val"], mask=n in masks) for n in inputs]
        out_placements = [
            placements(o, mask=i in mask_grad_outputs, gradient=True) if isinstance(o, torch.Tensor) else None
            for i, o in enumerate(outs)
        ]
        tensors = [(n.meta["val"], p) for n, p in zip(inputs, in_placements)]
        tensors += [(o, p) for o, p in zip(outs, out_placements) if p is not None]
        if not all(is_evenly_sharded(t.shape, p, mesh) for t, p in tensors):
            continue
        out_specs = tuple(
            pool.get(p, tensor_meta_of(o)) if p is not None else None for o, p in zip(outs, out_placements)
        )
        if not isinstance(out_val, (tuple, list)):
            out_specs = out_specs[0]
        in_specs = tuple(pool.get(p, tensor_meta_of(n.meta["val"])) for n, p in zip(inputs, in_placements))
        options.append(Option(out_specs, in_specs))
    return options


@register_rule(
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
)
def sdpa_cpu_rule(node, input_candidates, mesh):
    query = node.args[0] if node.target is aten._scaled_dot_product_flash_attention_for_cpu.default else node.args[1]
    options = batch_head_options(node, mesh, query)
    tensors = [n.meta["val"] for n in tensor_inputs(node)]
    return options + sequence_options(node, tensors, node.meta["val"], mesh, PER_DIM_CHOICES)
