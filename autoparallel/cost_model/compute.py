"""Compute cost: roofline time of one op on local (per-rank) shapes."""

from __future__ import annotations

import logging
import math
import operator
from functools import lru_cache
from typing import Any, NamedTuple, Sequence

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement
from torch.utils import flop_counter

from ..torch_compat import is_shard_like as _is_shard_like

from .caches import register
from .devices import H100, DeviceSpec

logger = logging.getLogger(__name__)

aten = torch.ops.aten

# Ops that only produce a view/alias (or metadata): no kernel runs.
_FREE_PACKETS = frozenset(
    {
        aten.view,
        aten._unsafe_view,
        aten.reshape,
        aten._reshape_alias,
        aten.t,
        aten.transpose,
        aten.permute,
        aten.expand,
        aten.expand_as,
        aten.view_as,
        aten.alias,
        aten.detach,
        aten.lift_fresh,
        aten.slice,
        aten.select,
        aten.unsqueeze,
        aten.squeeze,
        aten.as_strided,
        aten.split,
        aten.split_with_sizes,
        aten.chunk,
        aten.unbind,
        aten.unflatten,
        aten.sym_size,
        aten.sym_stride,
        aten.sym_numel,
        aten.sym_storage_offset,
        torch.ops.prim.device,
    }
)
_FREE_FX_OPS = frozenset({"placeholder", "output", "get_attr"})


def is_free_op(op: Any) -> bool:
    """True for ops that launch no kernel: views, aliases, getitem, metadata.

    Accepts an ``OpOverload``/``OpOverloadPacket``, ``operator.getitem``, or an
    FX node kind (``"placeholder"``, ``"output"``, ``"get_attr"``).
    ``reshape`` counts as free although it copies non-contiguous inputs.
    """
    if op is operator.getitem or (isinstance(op, str) and op in _FREE_FX_OPS):
        return True
    if isinstance(op, torch._ops.OpOverload):
        return op.overloadpacket in _FREE_PACKETS or op.is_view
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op in _FREE_PACKETS
    return False


def compute_time(
    flops: float,
    bytes_moved: float,
    dtype: torch.dtype,
    device: DeviceSpec = H100,
    efficiency: float | None = None,
) -> float:
    """Roofline time of one kernel: the slower of math and memory, at least the
    launch floor. Zero work costs zero. ``efficiency`` overrides the device's
    ``compute_efficiency`` (fused attention uses ``attention_efficiency``).

    >>> compute_time(0, 1e3, torch.float32, H100) == H100.launch_floor
    True
    """
    if flops <= 0 and bytes_moved <= 0:
        return 0.0
    return max(
        flops / (device.peak_flops(dtype) * (efficiency or device.compute_efficiency)),
        bytes_moved / (device.hbm_bw * device.memory_efficiency),
        device.launch_floor,
    )


class TensorSig(NamedTuple):
    """Shape and dtype of a tensor: what costing needs, hashable."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def flop_formula(op: Any):
    """torch.utils.flop_counter's formula for ``op`` (or the CPU attention
    kernels' below), None when it has none."""
    packet = _packet(op)
    f = _EXTRA_FLOP_FORMULAS.get(packet)
    if f is None:
        f = flop_counter.flop_registry.get(packet)
    return f


# The CPU flash-attention ops appear when tracing on CPU fake tensors and are
# not in flop_counter's registry; their leading (grad_out,) q, k, v arguments
# match the generic SDPA formulas.
_EXTRA_FLOP_FORMULAS: dict[Any, Any] = {}
for _name, _f in (
    ("_scaled_dot_product_flash_attention_for_cpu", flop_counter.sdpa_flop),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", flop_counter.sdpa_backward_flop),
):
    if hasattr(aten, _name):
        _EXTRA_FLOP_FORMULAS[getattr(aten, _name)] = _f

# Fused attention kernels, forward and backward: costed at the device's
# attention_efficiency (measured far below GEMM efficiency, see DeviceSpec).
_ATTENTION_PACKETS = frozenset(
    getattr(aten, name)
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
    )
    if hasattr(aten, name)
)


def _packet(op: Any) -> Any:
    return op.overloadpacket if isinstance(op, torch._ops.OpOverload) else op


# Gather-like ops read only the selected rows of their first input: bytes are
# the indices plus the output read once and written once, not the whole table.
_GATHER_LIKE = frozenset({aten.embedding, aten.index_select, aten.gather, aten.index})


def _to_sig(x: torch.Tensor, spec: DTensorSpec | None) -> TensorSig:
    if spec is None:
        return TensorSig(tuple(x.shape), x.dtype)
    if spec.tensor_meta is not None:
        return spec_sig(spec)  # keyed on the spec's cached hash
    return TensorSig(_local_shape(tuple(x.shape), mesh_shape(spec.mesh), spec.placements), x.dtype)


@register
@lru_cache(maxsize=None)
def spec_sig(spec: DTensorSpec) -> TensorSig:
    """The cost model's view of a spec with a tensor meta: local (rank 0)
    shape and dtype. Specs with equal signatures cost the same in every
    op; cached per spec (its hash is cached too)."""
    meta = spec.tensor_meta
    return TensorSig(_local_shape(tuple(meta.shape), mesh_shape(spec.mesh), spec.placements), meta.dtype)


@register
@lru_cache(maxsize=None)
def mesh_shape(mesh: Any) -> tuple[int, ...]:
    """``tuple(mesh.shape)``, cached per mesh (DeviceMesh.shape is a property
    that builds a new tuple)."""
    return tuple(mesh.shape)


def _sig_tree(x: Any, specs: Sequence[Any] | None, pos: list[int]) -> Any:
    """Nested args -> hashable tree with tensors as TensorSig (local shapes when
    ``specs`` gives a spec for the k-th tensor leaf). Lists become tuples,
    dicts tuples of (key, value) pairs."""
    t = type(x)
    # the common leaves first: argument nodes (holding a tensor) and plain
    # values; a node or plain value is none of the types tested below them
    if t is torch.fx.Node:
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        k = pos[0]
        pos[0] += 1
        return _to_sig(val, specs[k] if specs is not None and k < len(specs) else None)
    if t in _PLAIN_TYPES:
        return x
    if isinstance(x, torch.Tensor):
        k = pos[0]
        pos[0] += 1
        return _to_sig(x, specs[k] if specs is not None and k < len(specs) else None)
    if isinstance(x, TensorSig):
        pos[0] += 1
        return x
    if t is tuple or t is list:
        return tuple([_sig_tree(v, specs, pos) for v in x])
    if t is dict:
        return tuple([(k, _sig_tree(v, specs, pos)) for k, v in x.items()])
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return x.node.hint if hasattr(x.node, "hint") else None
    if isinstance(x, (list, tuple)):
        return tuple([_sig_tree(v, specs, pos) for v in x])
    try:
        hash(x)
    except TypeError:
        return None
    return x


_PLAIN_TYPES = frozenset(
    {int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout}
)


def _sig_leaves(x: Any):
    if isinstance(x, TensorSig):
        yield x
    elif isinstance(x, tuple):
        for v in x:
            yield from _sig_leaves(v)


def _as_shapes(x: Any) -> Any:
    if isinstance(x, TensorSig):
        return x.shape
    if isinstance(x, tuple):
        return tuple(_as_shapes(v) for v in x)
    return x


def _as_meta(x: Any) -> Any:
    if isinstance(x, TensorSig):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    if isinstance(x, tuple):
        return tuple(_as_meta(v) for v in x)
    return x


def _is_causal(op: Any, args: tuple, kwargs: dict) -> bool:
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    for i, a in enumerate(schema.arguments):
        if a.name == "is_causal":
            if "is_causal" in kwargs:
                return kwargs["is_causal"] is True
            return i < len(args) and args[i] is True
    return False


@register
@lru_cache(maxsize=None)
def _flops_and_bytes_cached(op: Any, args: tuple, kwargs: tuple, out: Any) -> tuple[float, float]:
    kw = dict(kwargs)
    if op in _GATHER_LIKE or getattr(op, "overloadpacket", None) in _GATHER_LIKE:
        ins = list(_sig_leaves((args[1:], kwargs)))
        nbytes = sum(t.nbytes for t in ins) + 2 * sum(t.nbytes for t in _sig_leaves(out))
    else:
        nbytes = sum(t.nbytes for t in _sig_leaves((args, kwargs, out)))

    flops = 0.0
    formula = flop_formula(op)
    if formula is not None:
        try:
            if hasattr(formula, "__wrapped__"):  # shape_wrapper'd: takes shapes
                flops = formula.__wrapped__(
                    *_as_shapes(args), out_shape=_as_shapes(out), **{k: _as_shapes(v) for k, v in kw.items()}
                )
            else:  # "raw" formulas want tensors; meta ones allocate nothing
                flops = formula(*_as_meta(args), out_val=_as_meta(out), **{k: _as_meta(v) for k, v in kw.items()})
        except Exception as e:  # a formula that chokes on odd args: bytes only
            logger.debug("flop formula for %s failed (%s); costing by bytes", op, e)
            flops = 0.0
        if flops and _is_causal(op, args, kw):
            # Causal flash/efficient kernels skip the masked upper triangle.
            flops *= 0.5
    return float(flops), float(nbytes)


def _first_dtype(*trees: Any) -> torch.dtype:
    first = None
    for t in _sig_leaves(trees):
        if t.dtype.is_floating_point:
            return t.dtype
        first = first or t.dtype
    return first or torch.float32


def op_cost_from_shapes(op: Any, args: Any, kwargs: Any, out: Any) -> tuple[float, float]:
    """(FLOPs, bytes) of ``op`` where tensors are given as :class:`TensorSig`
    (local shapes). Ops without a FLOP formula get 0 FLOPs; bytes are inputs
    read plus outputs written.

    >>> a = TensorSig((128, 64), torch.bfloat16); b = TensorSig((64, 32), torch.bfloat16)
    >>> op_cost_from_shapes(aten.mm.default, (a, b), {}, TensorSig((128, 32), torch.bfloat16))
    (524288.0, 28672.0)
    """
    pos = [0]
    return _flops_and_bytes_cached(
        op, _sig_tree(tuple(args), None, pos), _sig_tree(dict(kwargs or {}), None, pos), _sig_tree(out, None, [0])
    )


def op_flops_and_bytes(op: Any, args: Any, kwargs: Any, out: Any) -> tuple[float, float]:
    """(FLOPs, bytes) of ``op(*args, **kwargs) -> out`` where the (fake/meta)
    tensors already have LOCAL per-rank shapes. Nothing is executed."""
    return op_cost_from_shapes(op, args, kwargs, out)


def local_shape(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[int, ...]:
    """Shape of rank 0's shard (the largest: ``torch.chunk`` ceil division),
    as DTensor's ``compute_local_shape_and_global_offset`` gives on rank 0.

    >>> from torch.distributed.tensor import Shard
    >>> local_shape((10, 7), (4, 2), (Shard(0), Shard(1)))
    (3, 4)
    """
    return _local_shape(tuple(global_shape), tuple(mesh_shape), tuple(placements))


@register
@lru_cache(maxsize=None)
def _local_shape(global_shape: tuple, mesh_shape: tuple, placements: tuple) -> tuple[int, ...]:
    shape = list(global_shape)
    for n, p in zip(mesh_shape, placements):
        if _is_shard_like(p):
            d = p.dim % len(shape)
            # ceil(ceil(x/a)/b) == ceil(x/(a*b)): nesting order does not matter.
            shape[d] = -(-shape[d] // n)
    return tuple(shape)


def _specs_tuple(specs: Any) -> tuple | None:
    if specs is None:
        return None
    if isinstance(specs, DTensorSpec):
        return (specs,)
    return tuple(specs)


def op_compute_time(
    op: Any,
    args: Any,
    kwargs: Any,
    out: Any,
    input_specs: Sequence[DTensorSpec | None] | None,
    output_specs: Any,
    device: DeviceSpec = H100,
) -> float:
    """Seconds to run ``op`` on one rank under a sharding option.

    ``args``/``kwargs``/``out`` hold tensors with GLOBAL shapes (e.g. fake
    tensors from ``node.meta["val"]``). ``input_specs[k]`` is the spec of the
    k-th tensor leaf of ``(args, kwargs)`` in pytree order; ``output_specs``
    is a DTensorSpec or a tuple aligned with the tensor leaves of ``out``.
    A missing/None spec means the tensor is used whole (replicated).
    """
    if is_free_op(op):
        return 0.0
    in_specs = _specs_tuple(input_specs)
    pos = [0]
    a = _sig_tree(tuple(args), in_specs, pos)
    k = _sig_tree(dict(kwargs or {}), in_specs, pos)
    o = _sig_tree(out, _specs_tuple(output_specs), [0])
    return _op_time_cached(op, a, k, o, device)


@register
@lru_cache(maxsize=None)
def _op_time_cached(op: Any, args: tuple, kwargs: tuple, out: Any, device: DeviceSpec) -> float:
    flops, nbytes = _flops_and_bytes_cached(op, args, kwargs, out)
    efficiency = device.attention_efficiency if _packet(op) in _ATTENTION_PACKETS else None
    return compute_time(flops, nbytes, _first_dtype(args, kwargs, out), device, efficiency)


def node_compute_time(
    node: torch.fx.Node,
    input_specs: Sequence[DTensorSpec | None] | None,
    output_specs: Any,
    device: DeviceSpec = H100,
) -> float:
    """:func:`op_compute_time` for an FX ``call_function`` node: argument
    nodes stand for their ``meta["val"]``; ``input_specs`` follow the node's
    tensor inputs in argument order."""
    if node.op != "call_function" or is_free_op(node.target):
        return 0.0
    return op_compute_time(node.target, node.args, node.kwargs, node.meta.get("val"), input_specs, output_specs, device)
