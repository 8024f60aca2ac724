"""Grouped matmuls of Hugging Face experts that are not ``moe_experts``.

transformers' ``"grouped_mm"`` experts implementation multiplies the tokens
sorted by expert, ``input [S, K]``, with the stacked weights ``weight
[E, K, N]``, rows ``offs[e-1]:offs[e]`` by expert ``e``. In bf16 that is
``aten._grouped_mm`` (DTensor has its rule); in other dtypes while compiling
it is the opaque custom op ``transformers::grouped_mm_fallback`` (and its
backward), which this module gives the same rule: per mesh dim

* ``R``    everything replicated;
* ``col``  weight ``Shard(2)``, input replicated -> output ``Shard(1)``;
* ``row``  input ``Shard(1)``, weight ``Shard(1)`` -> output ``Partial``.

``offs`` are global row offsets, so the token dim cannot be split (nor the
expert dim: a rank's rows are not contiguous per expert); such experts get
tensor parallelism at most. Experts that fit ``moe_experts`` are routed
there instead (:func:`autoparallel.capture.trace_wrappers.route_hf_experts`), which
can be expert parallel.

Both ops also get FLOP formulas (flop_counter has none): ``2 S K N`` for a
2-D x 3-D grouped matmul (each row meets one expert), twice that backward.

The transformers ops exist only once transformers is imported, so the rules
are registered by :func:`register_transformers_grouped_mm` (called by the
tracer when a Hugging Face model is traced), not at import.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils import flop_counter

from ..strategies import RULES, Option, is_evenly_sharded, register_rule, tensor_inputs, tensor_meta_of

R, P = Replicate(), Partial()

# (input, weight, offs) -> out ; (input, weight, offs, grad_out) -> (grad_input, grad_weight)
_FORWARD = {"R": ((R, R, R), (R,)), "col": ((R, Shard(2), R), (Shard(1),)), "row": ((Shard(1), Shard(1), R), (P,))}
_BACKWARD = {
    "R": ((R, R, R, R), (R, R)),
    "col": ((R, Shard(2), R, Shard(1)), (P, Shard(2))),
    "row": ((Shard(1), Shard(1), R, R), (Shard(1), Shard(1))),
}


def _options(node, mesh, modes) -> list[Option]:
    vals = [n.meta["val"] for n in tensor_inputs(node)]
    out = node.meta["val"]
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if len(vals) != len(next(iter(modes.values()))[0]) or vals[0].ndim != 2 or vals[1].ndim != 3:
        return []  # not the 2-D x 3-D form: no rule (runs replicated)
    options = []
    for combo in itertools.product(modes.values(), repeat=mesh.ndim):
        in_pl = [tuple(m[0][k] for m in combo) for k in range(len(vals))]
        out_pl = [tuple(m[1][k] for m in combo) for k in range(len(outs))]
        tensors = list(zip(vals, in_pl)) + list(zip(outs, out_pl))
        if not all(is_evenly_sharded(t.shape, pl, mesh) for t, pl in tensors):
            continue
        in_specs = tuple(DTensorSpec(mesh, pl, tensor_meta=tensor_meta_of(t)) for t, pl in zip(vals, in_pl))
        out_specs = tuple(DTensorSpec(mesh, pl, tensor_meta=tensor_meta_of(t)) for t, pl in zip(outs, out_pl))
        options.append(Option(out_specs if isinstance(out, (tuple, list)) else out_specs[0], in_specs))
    return options


def grouped_mm_fallback_rule(node, input_candidates, mesh):
    return _options(node, mesh, _FORWARD)


def grouped_mm_fallback_backward_rule(node, input_candidates, mesh):
    return _options(node, mesh, _BACKWARD)


def _grouped_mm_flops(input_shape, weight_shape) -> int:
    if len(input_shape) == 2 and len(weight_shape) == 3:
        return 2 * input_shape[0] * input_shape[1] * weight_shape[2]
    if len(input_shape) == 3 and len(weight_shape) == 3:  # one matmul per group
        return 2 * input_shape[0] * input_shape[1] * input_shape[2] * weight_shape[2]
    return 0  # other forms: costed by bytes only


def _forward_flop(input, weight, offs=None, *args, out_shape=None, **kwargs) -> int:
    return _grouped_mm_flops(input, weight)


def _backward_flop(input, weight, offs, grad_out, *args, out_shape=None, **kwargs) -> int:
    return 2 * _grouped_mm_flops(input, weight)


if torch.ops.aten._grouped_mm.default.overloadpacket not in flop_counter.flop_registry:
    flop_counter.register_flop_formula(torch.ops.aten._grouped_mm)(_forward_flop)


def register_transformers_grouped_mm() -> bool:
    """Register the rules and FLOP formulas of transformers' grouped-matmul
    fallback ops, if transformers defined them; idempotent. True if present."""
    ns = torch.ops.transformers if hasattr(torch.ops, "transformers") else None
    fwd = getattr(ns, "grouped_mm_fallback", None) if ns is not None else None
    bwd = getattr(ns, "grouped_mm_fallback_backward", None) if ns is not None else None
    if fwd is None or bwd is None:
        return False
    if fwd.default not in RULES:
        register_rule(fwd.default)(grouped_mm_fallback_rule)
        register_rule(bwd.default)(grouped_mm_fallback_backward_rule)
    for op, formula in ((fwd, _forward_flop), (bwd, _backward_flop)):
        if op not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(op)(formula)
    return True
