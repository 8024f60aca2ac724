"""Single-mesh-dim rules for pointwise ops, for DTensor releases whose
pointwise ops still use the whole-mesh strategy.

DTensor's newer pointwise rules are single-mesh-dim strategies (each tensor
dim sharded alike on output and inputs, plus the Partial placements each op
preserves: ``P(sum) * R -> P(sum)``, ``P(avg) + P(avg) -> P(avg)``, ...)
expanded over the mesh. The older whole-mesh rule follows the first input's
placements and offers far fewer options (no Partial second operand, no
``P(avg)``), so the planner finds worse plans. Where the running DTensor's
pointwise ops are not single-dim
(:func:`~autoparallel.torch_compat.pointwise_ops_are_single_dim`), the
planner expands the rules below instead; they are written as DTensor writes
its single-dim pointwise rules, so both releases offer the same options.
Elsewhere DTensor's own rules run and this module is not used.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder, _SingleDimStrategyInfo
from torch.distributed.tensor._ops.utils import infer_broadcast_dims_map
from torch.distributed.tensor.placement_types import Partial, Replicate

from ..torch_compat import dtensor_pointwise_rule, pointwise_ops_are_single_dim

aten = torch.ops.aten
prims = torch.ops.prims

_UNARY_LINEAR = [[Partial("sum"), Partial("sum")], [Partial("avg"), Partial("avg")]]
_BINARY_ADDITIVE = [
    [Partial("sum"), Partial("sum"), Partial("sum")],
    [Partial("avg"), Partial("avg"), Partial("avg")],
    # P(x) + R stays P(x) for avg/max/min (for sum, R would be added once per rank)
    [Partial("avg"), Partial("avg"), Replicate()],
    [Partial("max"), Partial("max"), Replicate()],
    [Partial("min"), Partial("min"), Replicate()],
    # R + alpha * P(avg): avg is linear for any alpha (max/min would flip with alpha < 0)
    [Partial("avg"), Replicate(), Partial("avg")],
]
# mul: a Partial passes through either operand; div: only through the numerator.
# The unary (length-2) rules cover a scalar promoted to a 0-dim tensor.
_MUL = _UNARY_LINEAR + [
    [Partial("sum"), Partial("sum"), Replicate()],
    [Partial("avg"), Partial("avg"), Replicate()],
    [Partial("sum"), Replicate(), Partial("sum")],
    [Partial("avg"), Replicate(), Partial("avg")],
]
_DIV = _UNARY_LINEAR + [
    [Partial("sum"), Partial("sum"), Replicate()],
    [Partial("avg"), Partial("avg"), Replicate()],
]
_NON_DECREASING = [[Partial("max"), Partial("max")], [Partial("min"), Partial("min")]]
_NON_INCREASING = [[Partial("min"), Partial("max")], [Partial("max"), Partial("min")]]
_ALL_PARTIALS_UNARY = [[Partial(r), Partial(r)] for r in ("sum", "avg", "max", "min")]
_ALL_PARTIALS_BINARY = [[Partial(r), Partial(r), Partial(r)] for r in ("sum", "avg", "max", "min")]
_MONOTONE_BINARY = [
    [Partial("max"), Partial("max"), Replicate()],
    [Partial("max"), Replicate(), Partial("max")],
    [Partial("min"), Partial("min"), Replicate()],
    [Partial("min"), Replicate(), Partial("min")],
]


def _variants(*names: str) -> list[str]:
    """``name.overload`` strings with the in-place and out variants of each base."""
    out = []
    for name in names:
        base, overload = name.split(".")
        out += [name, f"{base}_.{overload}", f"{base}.out" if overload in ("default", "Tensor") else None]
    return [n for n in out if n]


# op name (aten namespace unless "prims::") -> the Partial rules it adds
_PARTIAL_RULES_BY_NAME: dict[str, list] = {}
for _name in _variants("add.Tensor", "sub.Tensor"):
    _PARTIAL_RULES_BY_NAME[_name] = _BINARY_ADDITIVE
for _name in _variants("mul.Tensor"):
    _PARTIAL_RULES_BY_NAME[_name] = _MUL
for _name in _variants("div.Tensor"):
    _PARTIAL_RULES_BY_NAME[_name] = _DIV
for _name in ("div.Scalar", "div_.Scalar", "mul.Scalar", "mul_.Scalar"):
    _PARTIAL_RULES_BY_NAME[_name] = _UNARY_LINEAR
for _name in _variants(
    "asinh.default", "atan.default", "ceil.default", "deg2rad.default", "erf.default", "exp.default",
    "exp2.default", "expm1.default", "floor.default", "rad2deg.default", "sgn.default", "sigmoid.default",
    "sign.default", "sinh.default", "tanh.default", "trunc.default", "nan_to_num.default",
):  # fmt: skip
    _PARTIAL_RULES_BY_NAME[_name] = _NON_DECREASING
for _name in (
    "relu.default", "relu_.default", "round.decimals", "round.default", "round_.decimals", "round_.default",
    "round.decimals_out", "round.out", "hardshrink.default", "special_modified_bessel_i1.default",
    "threshold.default",
):  # fmt: skip
    _PARTIAL_RULES_BY_NAME[_name] = _NON_DECREASING
for _name in ("erfc.default", "erfc_.default", "erfc.out", "special_erfcx.default", "special_erfcx.out"):
    _PARTIAL_RULES_BY_NAME[_name] = _NON_INCREASING
for _name in (
    "special_modified_bessel_k0.default", "special_modified_bessel_k1.default",
    "special_scaled_modified_bessel_k0.default", "special_scaled_modified_bessel_k1.default",
):  # fmt: skip
    # defined for x > 0 only: P(min) offsets keep inputs positive, P(max) offsets may not
    _PARTIAL_RULES_BY_NAME[_name] = [[Partial("max"), Partial("min")]]
for _name in _variants("neg.default"):
    _PARTIAL_RULES_BY_NAME[_name] = _UNARY_LINEAR + _NON_INCREASING
for _name in ("special_xlog1py.default", "special_xlog1py.other_scalar"):
    _PARTIAL_RULES_BY_NAME[_name] = [
        [Partial("sum"), Partial("sum"), Replicate()],
        [Partial("avg"), Partial("avg"), Replicate()],
    ]
for _name in ("to.dtype", "positive.default"):
    _PARTIAL_RULES_BY_NAME[_name] = _ALL_PARTIALS_UNARY
for _name in ("copy_.default", "prims::copy_to.default"):
    _PARTIAL_RULES_BY_NAME[_name] = _ALL_PARTIALS_BINARY
for _name in ("logaddexp.default", "logaddexp.out", "logaddexp2.default", "logaddexp2.out"):
    _PARTIAL_RULES_BY_NAME[_name] = _MONOTONE_BINARY
for _name in (
    "clamp_min.Tensor", "fmax.default", "fmax.out", "maximum.default", "maximum.out", "prims::fmax.default",
):  # fmt: skip
    _PARTIAL_RULES_BY_NAME[_name] = _MONOTONE_BINARY + [[Partial("max"), Partial("max"), Partial("max")]]
for _name in (
    "clamp_max.Tensor", "fmin.default", "fmin.out", "minimum.default", "minimum.out", "prims::fmin.default",
):  # fmt: skip
    _PARTIAL_RULES_BY_NAME[_name] = _MONOTONE_BINARY + [[Partial("min"), Partial("min"), Partial("min")]]


def partial_rules(op) -> list:
    """The Partial placements ``op`` preserves over one mesh dim, as
    ``[output, *tensor inputs]`` rows (empty for ops preserving none)."""
    namespace, name = op.name().split("::")  # "aten::add.Tensor", "aten::relu"
    key = name if "." in name else f"{name}.default"
    if namespace != "aten":
        key = f"{namespace}::{key}"
    return _PARTIAL_RULES_BY_NAME.get(key, [])


def pointwise_single_dim_strategy(op, args_schema, kwargs_schema) -> list[list]:
    """Single-mesh-dim options of a pointwise op: every dim of the broadcast
    shape sharded on the output and on the inputs that have it (inputs
    broadcast along it replicated), then the op's Partial rules; tensor
    keyword arguments follow (``out`` as the output, others replicated)."""
    metas = [a for a in args_schema if isinstance(a, TensorMeta)]
    common_shape = torch.broadcast_shapes(*[m.shape for m in metas])
    num_outputs = sum(1 for r in op._schema.returns if "Tensor" in str(r.type))
    rows: list[list] = []
    for dim in range(len(common_shape)):
        row: list = [_ShardingPlaceholder(dim)] * num_outputs
        for meta in metas:
            arg_dim = infer_broadcast_dims_map(common_shape, meta.shape)[dim]
            row.append(_ShardingPlaceholder(arg_dim) if arg_dim >= 0 else Replicate())
        rows.append(row)
    # rules of another arity (mul's unary rules for a promoted scalar) do not apply
    rows += [rule for rule in partial_rules(op) if len(rule) == num_outputs + len(metas)]
    kw_names = [k for k, v in kwargs_schema.items() if isinstance(v, TensorMeta)]
    if kw_names:
        rows = [r + [r[0] if name == "out" else Replicate() for name in kw_names] for r in rows]
    return rows


@functools.cache
def _strategy_info() -> _SingleDimStrategyInfo:
    return _SingleDimStrategyInfo(func=pointwise_single_dim_strategy, allow_unbacked_sharding=True)


def pointwise_single_dim_rule(propagator, op) -> _SingleDimStrategyInfo | None:
    """The single-mesh-dim rule the planner expands for ``op``: None where
    DTensor's pointwise ops are single-dim already, or ``op`` is not one of
    DTensor's (non-list) pointwise ops."""
    if pointwise_ops_are_single_dim(propagator) or dtensor_pointwise_rule(propagator, op) is None:
        return None
    return _strategy_info()
