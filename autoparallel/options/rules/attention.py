"""Scaled-dot-product attention on CPU (the op tracing on a "cpu" mesh yields).

DTensor has rules for the CUDA flash/efficient kernels but not for
``_scaled_dot_product_flash_attention_for_cpu`` and its backward. Attention
is independent per batch element and per head, so on each mesh dim every
tensor (q, k, v, output, logsumexp and their gradients) is either sharded on
the batch dim, sharded on the head dim, or replicated, all alike. Sharding
the sequence would need the causal mask's global offsets: not offered.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Replicate, Shard

from ..strategies import Option, is_evenly_sharded, register_rule, tensor_meta_of

aten = torch.ops.aten

_PER_DIM_CHOICES = (Replicate(), Shard(0), Shard(1))


def _uniform_options(node, inputs, mesh) -> list[Option]:
    in_vals = [n.meta["val"] for n in inputs]
    out_val = node.meta["val"]
    outs = out_val if isinstance(out_val, (tuple, list)) else (out_val,)
    options = []
    for combo in itertools.product(_PER_DIM_CHOICES, repeat=mesh.ndim):
        tensors = [*in_vals, *[o for o in outs if isinstance(o, torch.Tensor)]]
        if not all(is_evenly_sharded(t.shape, combo, mesh) for t in tensors):
            continue

        def spec(t):
            return DTensorSpec(mesh, combo, tensor_meta=tensor_meta_of(t))

        out_specs = tuple(spec(o) if isinstance(o, torch.Tensor) else None for o in outs)
        if not isinstance(out_val, (tuple, list)):
            out_specs = out_specs[0]
        options.append(Option(out_specs, tuple(spec(t) for t in in_vals)))
    return options


@register_rule(
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
)
def sdpa_cpu_rule(node, input_candidates, mesh):
    from ..strategies import tensor_inputs

    return _uniform_options(node, tensor_inputs(node), mesh)
