"""``aten.stack``: one option per layout the inputs may arrive with.

DTensor's stack strategy derives a single layout to follow from all the
inputs' candidates at once (the most sharded one it can merge), so a stack
fed by tensors with many candidate layouts gets one option, often a
head-sharded one; the view that follows it (``unbind``'s backward stacks
q, k and v, then a view merges them back into the packed qkv gradient)
then has nothing it can propagate without a ``_StridedShard`` and ran
replicated. Here, as DTensor's ``cat`` strategy does, every candidate of
every input is an exemplar: all inputs take it, the output has it with
shard dims at or after the new dim shifted by one.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Shard

from ..strategies import Option, is_evenly_sharded, register_rule, tensor_inputs, tensor_meta_of

aten = torch.ops.aten


def _shifted(placements: tuple, dim: int) -> tuple:
    return tuple(Shard(p.dim + 1) if isinstance(p, Shard) and p.dim >= dim else p for p in placements)


@register_rule(aten.stack.default)
def stack_rule(node, input_candidates, mesh) -> list[Option]:
    inputs = tensor_inputs(node)
    out_val = node.meta["val"]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim = dim + out_val.dim() if dim < 0 else dim
    in_metas = [tensor_meta_of(n.meta["val"]) for n in inputs]
    out_meta = tensor_meta_of(out_val)
    options, seen = [], set()
    for candidates in input_candidates:
        for spec in candidates:
            p = tuple(spec.placements)
            if p in seen or any(type(x) not in (Shard,) and x.is_shard() for x in p):
                continue  # _StridedShard and friends: not offered (see strategies)
            seen.add(p)
            out_p = _shifted(p, dim)
            if not is_evenly_sharded(out_val.shape, out_p, mesh):
                continue
            if not all(is_evenly_sharded(m.shape, p, mesh) for m in in_metas):
                continue
            ins = tuple(DTensorSpec(mesh, p, tensor_meta=m) for m in in_metas)
            options.append(Option(DTensorSpec(mesh, out_p, tensor_meta=out_meta), ins))
    return options
