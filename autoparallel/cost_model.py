"""Cost model: seconds for running an op under a placement and for moving a
tensor from one placement to another.

Everything here is a pure function of explicit, hashable inputs, so results
are cached: planning LLaMA-3 on a 16x8 mesh asks for tens of thousands of
(node, option) costs, and repeated layers make most of them repeats.

Three parts:

* **Compute** (roofline): ``max(flops / peak, bytes / hbm_bw, launch floor)``
  on the *local* (per-rank) shapes. FLOPs come from the per-op formulas of
  ``torch.utils.flop_counter`` called on shapes, so nothing is allocated.
* **Communication**: the steps DTensor itself would take for a
  redistribution (its own planner), each costed with a ring model per mesh
  dim; a mesh dim is intra-node when every group along it sits in one node.
* **Overlap**: a policy saying how much of an FSDP-style parameter
  all-gather / gradient reduce-scatter stays exposed.

Example::

    >>> dev = DeviceSpec.get("H100")
    >>> t = compute_time(2 * 4096**3, 3 * 4096 * 4096 * 2, torch.bfloat16, dev)
    >>> round(t * 1e6)  # a 4096^3 bf16 matmul: ~199 us at 70% of 989 TFLOP/s
    199
    >>> t = collective_time("all_gather", 64 * 2**20, 8, True, dev)
    >>> round(t * 1e6)  # gather 8 x 64 MiB shards over NVLink at 360 GB/s
    1317

All times are seconds (float); all sizes bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple, Sequence

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _is_shard_like,
    _StridedShard,
)
from torch.utils import flop_counter

logger = logging.getLogger(__name__)

aten = torch.ops.aten

__all__ = [
    "DeviceSpec",
    "H100",
    "A100",
    "H200",
    "B200",
    "TRANSITION_TIEBREAK",
    "TensorSig",
    "is_free_op",
    "compute_time",
    "op_flops_and_bytes",
    "op_cost_from_shapes",
    "op_compute_time",
    "node_compute_time",
    "local_shape",
    "MeshDimTopology",
    "mesh_dim_topology",
    "collective_time",
    "CommStep",
    "redistribute_steps",
    "redistribute_time",
    "CommOverlapPolicy",
    "PARAM_ALL_GATHER",
    "GRAD_REDUCE_SCATTER",
    "apply_discount",
    "clear_caches",
]

# Added by the caller to every non-identical transition so that, when costs
# tie (e.g. a free Replicate -> Shard slice), the ILP prefers fewer
# redistributions. 0.1 us: far below any real collective (>= ~5 us) and below
# the launch floor, so it only ever breaks ties.
TRANSITION_TIEBREAK = 1e-7


# --------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSpec:
    """Per-GPU performance figures. Dense (no 2:4 sparsity) datasheet peaks.

    ``peak_fp32`` is the plain FP32 (CUDA core) rate, which is what PyTorch's
    float32 matmuls get by default (``torch.backends.cuda.matmul.allow_tf32``
    is False by default). Set ``fp32_uses_tf32=True`` when training with
    ``torch.set_float32_matmul_precision("high")`` to cost fp32 at the TF32
    tensor-core rate instead.

    Bandwidths are per GPU, per direction. ``inter_node_bw`` is the GPU's own
    NIC (one NIC per GPU, rail-optimised fabric); a group spanning nodes with
    ``g`` members per node gets ``min(intra_node_bw, g * inter_node_bw)``
    (NCCL runs one ring per NIC).

    Efficiencies turn peaks into achievable rates and are fields so that
    users can calibrate them against measurements:

    * ``compute_efficiency`` 0.7: large bf16 GEMMs reach ~600-750 of H100's
      989 TFLOP/s; smaller or oddly shaped ones less.
    * ``memory_efficiency`` 0.8: copy/elementwise kernels reach ~80-85% of
      HBM peak.
    * ``comm_efficiency`` 0.8: nccl-tests all-gather/reduce-scatter busbw
      on 8x H100 NVLink is ~360 of 450 GB/s; IB gets ~45 of 50 GB/s, so
      0.8 is slightly pessimistic there.
    """

    name: str
    peak_bf16: float  # FLOP/s, also used for fp16
    peak_fp32: float  # FLOP/s, CUDA-core FP32 (no TF32)
    peak_tf32: float  # FLOP/s, TF32 tensor cores
    peak_fp8: float | None  # FLOP/s, None when the GPU has no fp8 tensor cores
    hbm_bw: float  # bytes/s
    intra_node_bw: float  # bytes/s per GPU per direction (NVLink)
    inter_node_bw: float  # bytes/s per GPU per direction (IB/RoCE NIC)
    # Per ring step (hop + synchronisation), NCCL-tuning-table order of size.
    intra_node_latency: float = 1e-6
    inter_node_latency: float = 3e-6
    # Smallest time of any kernel (launch + tail), also the fixed part of a
    # collective.
    launch_floor: float = 5e-6
    gpus_per_node: int = 8
    fp32_uses_tf32: bool = False
    compute_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    comm_efficiency: float = 0.8

    def __hash__(self) -> int:
        # Part of every cache key: hash the fields once, not per lookup.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(dataclasses.astuple(self))
            object.__setattr__(self, "_hash", h)
        return h

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Datasheet peak for matmul-like work in ``dtype`` (before efficiency)."""
        if dtype in (torch.bfloat16, torch.float16):
            return self.peak_bf16
        if dtype.is_floating_point and dtype.itemsize == 1:  # float8 variants
            # Without fp8 tensor cores the work runs upcast at bf16 speed.
            return self.peak_fp8 if self.peak_fp8 is not None else self.peak_bf16
        if dtype == torch.float32 and self.fp32_uses_tf32:
            return self.peak_tf32
        # float32, float64 and integer work: CUDA-core rate.
        return self.peak_fp32

    @staticmethod
    def get(name: str) -> "DeviceSpec":
        """A preset by (case-insensitive) name, e.g. ``DeviceSpec.get("h100")``."""
        try:
            return _PRESETS[name.upper()]
        except KeyError:
            raise ValueError(
                f"unknown device {name!r}; presets: {', '.join(sorted(_PRESETS))}. "
                "Build a DeviceSpec (or dataclasses.replace a preset) for others."
            ) from None


# H100 SXM5 80GB: 989 TF bf16, 67 TF fp32, 495 TF tf32, 1979 TF fp8 (dense),
# HBM3 3.35 TB/s, NVLink4 900 GB/s bidirectional, ConnectX-7 400 Gb/s per GPU.
H100 = DeviceSpec(
    name="H100",
    peak_bf16=989e12,
    peak_fp32=67e12,
    peak_tf32=495e12,
    peak_fp8=1979e12,
    hbm_bw=3.35e12,
    intra_node_bw=450e9,
    inter_node_bw=50e9,
)
# A100 SXM4 80GB: 312 TF bf16, 19.5 TF fp32, 156 TF tf32, no fp8,
# HBM2e 2.04 TB/s, NVLink3 600 GB/s bidirectional, HDR 200 Gb/s per GPU.
A100 = DeviceSpec(
    name="A100",
    peak_bf16=312e12,
    peak_fp32=19.5e12,
    peak_tf32=156e12,
    peak_fp8=None,
    hbm_bw=2.039e12,
    intra_node_bw=300e9,
    inter_node_bw=25e9,
)
# H200 SXM 141GB: H100 compute, HBM3e 4.8 TB/s, same NVLink and NIC.
H200 = dataclasses.replace(H100, name="H200", hbm_bw=4.8e12)
# B200 (HGX/DGX B200, per GPU): 2.25 PF bf16, 75 TF fp32, 1.1 PF tf32, 4.5 PF
# fp8 (dense), HBM3e 8 TB/s, NVLink5 1.8 TB/s bidirectional. DGX B200 ships
# 8x ConnectX-7 at 400 Gb/s, i.e. 50 GB/s per GPU; use
# ``dataclasses.replace(B200, inter_node_bw=100e9)`` for 800 Gb/s
# (ConnectX-8) fabrics.
B200 = DeviceSpec(
    name="B200",
    peak_bf16=2250e12,
    peak_fp32=75e12,
    peak_tf32=1100e12,
    peak_fp8=4500e12,
    hbm_bw=8e12,
    intra_node_bw=900e9,
    inter_node_bw=50e9,
)
_PRESETS = {d.name: d for d in (H100, A100, H200, B200)}


# --------------------------------------------------------------------------
# Compute
# --------------------------------------------------------------------------

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
    flops: float, bytes_moved: float, dtype: torch.dtype, device: DeviceSpec = H100
) -> float:
    """Roofline time of one kernel: the slower of math and memory, at least the
    launch floor. Zero work costs zero.

    >>> compute_time(0, 1e3, torch.float32, H100) == H100.launch_floor
    True
    """
    if flops <= 0 and bytes_moved <= 0:
        return 0.0
    return max(
        flops / (device.peak_flops(dtype) * device.compute_efficiency),
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


def _flop_formula(op: Any):
    packet = op.overloadpacket if isinstance(op, torch._ops.OpOverload) else op
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

# Gather-like ops read only the selected rows of their first input: bytes are
# the indices plus the output read once and written once, not the whole table.
_GATHER_LIKE = frozenset({aten.embedding, aten.index_select, aten.gather, aten.index})


def _to_sig(x: torch.Tensor, spec: DTensorSpec | None) -> TensorSig:
    if spec is None:
        return TensorSig(tuple(x.shape), x.dtype)
    if spec.tensor_meta is not None:
        return _spec_sig(spec)  # keyed on the spec's cached hash
    return TensorSig(_local_shape(tuple(x.shape), _mesh_shape(spec.mesh), spec.placements), x.dtype)


@lru_cache(maxsize=None)
def _spec_sig(spec: DTensorSpec) -> TensorSig:
    meta = spec.tensor_meta
    return TensorSig(_local_shape(tuple(meta.shape), _mesh_shape(spec.mesh), spec.placements), meta.dtype)


@lru_cache(maxsize=None)
def _mesh_shape(mesh: Any) -> tuple[int, ...]:
    return tuple(mesh.shape)


def _sig_tree(x: Any, specs: Sequence[Any] | None, pos: list[int]) -> Any:
    """Nested args -> hashable tree with tensors as TensorSig (local shapes when
    ``specs`` gives a spec for the k-th tensor leaf). Lists become tuples,
    dicts tuples of (key, value) pairs."""
    if isinstance(x, torch.Tensor):
        k = pos[0]
        pos[0] += 1
        return _to_sig(x, specs[k] if specs is not None and k < len(specs) else None)
    if isinstance(x, TensorSig):
        pos[0] += 1
        return x
    t = type(x)
    if t is tuple or t is list:
        return tuple([_sig_tree(v, specs, pos) for v in x])
    if t is dict:
        return tuple([(k, _sig_tree(v, specs, pos)) for k, v in x.items()])
    if t is torch.fx.Node:
        val = x.meta.get("val")
        return _sig_tree(val, specs, pos) if isinstance(val, torch.Tensor) else None
    if t in _PLAIN_TYPES:
        return x
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return x.node.hint if hasattr(x.node, "hint") else None
    if isinstance(x, (list, tuple)):
        return tuple([_sig_tree(v, specs, pos) for v in x])
    try:
        hash(x)
    except TypeError:
        return None
    return x


_PLAIN_TYPES = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout})


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


@lru_cache(maxsize=None)
def _flops_and_bytes_cached(op: Any, args: tuple, kwargs: tuple, out: Any) -> tuple[float, float]:
    kw = dict(kwargs)
    if op in _GATHER_LIKE or getattr(op, "overloadpacket", None) in _GATHER_LIKE:
        ins = list(_sig_leaves((args[1:], kwargs)))
        nbytes = sum(t.nbytes for t in ins) + 2 * sum(t.nbytes for t in _sig_leaves(out))
    else:
        nbytes = sum(t.nbytes for t in _sig_leaves((args, kwargs, out)))

    flops = 0.0
    formula = _flop_formula(op)
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

    >>> local_shape((10, 7), (4, 2), (Shard(0), Shard(1)))
    (3, 4)
    """
    return _local_shape(tuple(global_shape), tuple(mesh_shape), tuple(placements))


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


@lru_cache(maxsize=None)
def _op_time_cached(op: Any, args: tuple, kwargs: tuple, out: Any, device: DeviceSpec) -> float:
    flops, nbytes = _flops_and_bytes_cached(op, args, kwargs, out)
    return compute_time(flops, nbytes, _first_dtype(args, kwargs, out), device)


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
    return op_compute_time(
        node.target, node.args, node.kwargs, node.meta.get("val"), input_specs, output_specs, device
    )


# --------------------------------------------------------------------------
# Communication
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class MeshDimTopology:
    """How the process groups along one mesh dim sit on nodes."""

    group_size: int
    intra_node: bool  # every group lies within one node
    ranks_per_node: int  # fewest group members sharing a node (NICs in use)


def mesh_dim_topology(mesh: Any, gpus_per_node: int = 8) -> tuple[MeshDimTopology, ...]:
    """Per mesh dim: group size, whether it is intra-node, members per node.

    Derived from the rank layout ``mesh.mesh`` with node = rank // gpus_per_node;
    for a 16x8 mesh with 8 GPUs per node, dim 0 is inter-node (1 rank per
    node) and dim 1 intra-node.
    """
    return _mesh_dim_topology(mesh, gpus_per_node)


@lru_cache(maxsize=None)
def _mesh_dim_topology(mesh: Any, gpus_per_node: int) -> tuple[MeshDimTopology, ...]:
    ranks = mesh.mesh
    result = []
    for d in range(ranks.ndim):
        n = ranks.shape[d]
        groups = (ranks.movedim(d, -1).reshape(-1, n) // gpus_per_node).tolist()
        intra = all(len(set(g)) == 1 for g in groups)
        per_node = min(min(g.count(x) for x in set(g)) for g in groups)
        result.append(MeshDimTopology(n, intra, per_node))
    return tuple(result)


_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def collective_time(
    kind: str,
    bytes_per_rank: float,
    group_size: int,
    intra_node: bool,
    device: DeviceSpec = H100,
    ranks_per_node: int = 1,
) -> float:
    """Seconds for one NCCL-style collective (ring algorithm).

    ``bytes_per_rank`` is each rank's INPUT buffer: the shard for
    ``all_gather`` (output is ``group_size`` times larger), the full
    unreduced buffer for ``reduce_scatter`` and ``all_reduce``, the buffer
    being exchanged for ``all_to_all``. With ``n = group_size``, bandwidth
    ``bw`` and per-step latency ``lat``::

        all_gather      floor + (n-1) lat + (n-1) * bytes / bw
        reduce_scatter  floor + (n-1) lat + (n-1)/n * bytes / bw
        all_reduce      floor + 2 (n-1) lat + 2 (n-1)/n * bytes / bw
        all_to_all      floor + lat + (n-1)/n * bytes / bw

    Inter-node groups with ``ranks_per_node`` members on each node drive that
    many NICs: ``bw = min(intra_node_bw, ranks_per_node * inter_node_bw)``.
    """
    if group_size <= 1 or bytes_per_rank <= 0:
        return 0.0
    n = group_size
    if intra_node:
        bw, lat = device.intra_node_bw, device.intra_node_latency
    else:
        bw = min(device.intra_node_bw, max(ranks_per_node, 1) * device.inter_node_bw)
        lat = device.inter_node_latency
    bw *= device.comm_efficiency
    if kind == "all_gather":
        return device.launch_floor + (n - 1) * lat + (n - 1) * bytes_per_rank / bw
    if kind == "reduce_scatter":
        return device.launch_floor + (n - 1) * lat + (n - 1) / n * bytes_per_rank / bw
    if kind == "all_reduce":
        return device.launch_floor + 2 * ((n - 1) * lat + (n - 1) / n * bytes_per_rank / bw)
    if kind == "all_to_all":
        return device.launch_floor + lat + (n - 1) / n * bytes_per_rank / bw
    raise ValueError(f"unknown collective {kind!r}; expected one of {_COLLECTIVES}")


def _local_copy_time(out_bytes: float, device: DeviceSpec) -> float:
    # Slicing a shard out of a replica (clone) or zeroing for Partial: read +
    # write of the result. No launch floor: it is kept tiny on purpose, so
    # that a free-ish local reshard never looks like a collective.
    return 2 * out_bytes / (device.hbm_bw * device.memory_efficiency)


@dataclass(frozen=True)
class CommStep:
    """One step of a redistribution on one mesh dim."""

    mesh_dim: int
    src: Placement
    dst: Placement
    kind: str  # a collective, "local_copy", or "forbidden"
    bytes_per_rank: int  # local bytes before the step
    time: float


def _kind(p: Placement) -> str:
    """Placement kind: "R" replicate, "P" partial, "S" plain shard, "X"
    strided shard. Exact type checks first: isinstance on the C++-backed
    placements is slow."""
    t = type(p)
    if t is Replicate:
        return "R"
    if t is Shard:
        return "S"
    if t is Partial:
        return "P"
    if t is _StridedShard:
        return "X"
    if p.is_partial():
        return "P"
    if p.is_replicate():
        return "R"
    if _is_shard_like(p):
        return "S" if p.is_shard() else "X"
    return "?"


# What DTensor's ``redistribute_local_tensor`` runs for one mesh dim, by
# (src kind, dst kind) of two different placements. Strided shards go
# through Replicate; Shard -> Partial and Partial(op1) -> Partial(op2) are
# unsupported. Replicate -> anything is a local slice or scale.
_STEP_KINDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("P", "R"): ("all_reduce",),
    ("P", "S"): ("reduce_scatter",),
    ("P", "X"): ("all_reduce", "local_copy"),
    ("P", "P"): ("forbidden",),
    ("S", "R"): ("all_gather",),
    ("S", "S"): ("all_to_all",),
    ("S", "X"): ("all_gather", "local_copy"),
    ("S", "P"): ("forbidden",),
    ("X", "R"): ("all_gather", "local_copy"),
    ("X", "S"): ("all_gather", "local_copy"),
    ("X", "X"): ("all_gather", "local_copy"),
    ("X", "P"): ("forbidden",),
    ("R", "S"): ("local_copy",),
    ("R", "X"): ("local_copy",),
    ("R", "P"): ("local_copy",),
}


def _step_kinds(a: Placement, b: Placement) -> tuple[str, ...]:
    if a == b:
        return ()
    return _STEP_KINDS.get((_kind(a), _kind(b)), ("forbidden",))


def _greedy_steps(
    mesh_shape: tuple[int, ...], src: tuple[Placement, ...], dst: tuple[Placement, ...]
) -> list[tuple[int, Placement, Placement]]:
    """DTensor's greedy redistribution planner
    (``DTensorRedistributePlanner.generate_greedy_transform_infos``) over
    placements alone, for default shard order and plain Shards; much faster
    than building specs and asking torch, and tested step for step against it.

    First, inner to outer mesh dims, a Shard target whose tensor dim is
    sharded differently on the outer mesh dims goes to Replicate (nested
    sharding must be undone from the inside); then, outer to inner, every
    mesh dim still off target moves to it.
    """
    if len(mesh_shape) == 1:
        return [(0, src[0], dst[0])] if src[0] != dst[0] else []
    # Tensor dim of each plain Shard (DTensor's is_shard(); not strided).
    cur_dims = [p.dim if _kind(p) == "S" else None for p in src]
    dst_dims = [p.dim if _kind(p) == "S" else None for p in dst]
    current, steps = list(src), []
    if math.prod(n for n, p in zip(mesh_shape, src) if _kind(p) in ("S", "X")) > 1:  # src.num_shards
        for mesh_dim in reversed(range(len(current))):
            cur, tgt = current[mesh_dim], dst[mesh_dim]
            d = dst_dims[mesh_dim]
            if d is not None and [i for i in range(mesh_dim) if cur_dims[i] == d] != [
                i for i in range(mesh_dim) if dst_dims[i] == d
            ]:
                tgt = Replicate()
            if cur != tgt:
                steps.append((mesh_dim, cur, tgt))
                current[mesh_dim] = tgt
                cur_dims[mesh_dim] = tgt.dim if _kind(tgt) == "S" else None
    for mesh_dim, (cur, tgt) in enumerate(zip(current, dst)):
        if cur != tgt:
            steps.append((mesh_dim, cur, tgt))
            current[mesh_dim] = tgt
    return steps


def _strided_steps(
    mesh_shape: tuple[int, ...], src: tuple[Placement, ...], dst: tuple[Placement, ...]
) -> list[tuple[int, Placement, Placement]]:
    """Plan with _StridedShard: DTensor has no direct strided collective, so
    source strided dims are gathered first (inner to outer), then the greedy
    plan runs from there (a strided target is sliced out of a replica).
    DTensor's graph planner costs ~ms a call here, and upstream
    ``redistribute_cost`` gives up with inf."""
    steps, current = [], list(src)
    for d in reversed(range(len(src))):
        p = src[d]
        if p != dst[d] and _kind(p) == "X":
            steps.append((d, p, Replicate()))
            current[d] = Replicate()
    return steps + _greedy_steps(mesh_shape, tuple(current), dst)


def _via_replicate_steps(
    src: tuple[Placement, ...], dst: tuple[Placement, ...]
) -> list[tuple[int, Placement, Placement]]:
    """Upper bound: differing mesh dims go to Replicate (inner first), then
    to the target (outer first)."""
    steps = [(d, a, Replicate()) for d, (a, b) in reversed(list(enumerate(zip(src, dst)))) if a != b and not a.is_replicate()]
    steps += [(d, Replicate(), b) for d, (a, b) in enumerate(zip(src, dst)) if a != b and not b.is_replicate()]
    return steps


def _transform_steps(src: DTensorSpec, dst: DTensorSpec) -> list[tuple[int, Placement, Placement]]:
    """DTensor's own (graph-based) plan, for non-default shard orders."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

    try:
        infos = _gen_transform_infos_non_cached(src, dst)
        return [(i.mesh_dim, *i.src_dst_placements) for i in infos]
    except Exception as e:
        logger.debug("DTensor planner failed for %s -> %s (%s); costing via Replicate", src, dst, e)
        return _via_replicate_steps(src.placements, dst.placements)


# A plan: the shard divisors of the source, then per step (mesh_dim, src
# placement, dst placement, kinds, shard divisors after the step). Divisors
# are (tensor dim, mesh dim size) pairs: all a local shape needs.
_Divs = tuple[tuple[int, int], ...]
_Plan = tuple[_Divs, tuple[tuple[int, Placement, Placement, tuple[str, ...], _Divs], ...]]
_PLAN_CACHE: dict[tuple, Any] = {}
_SHAPE_DEPENDENT = object()


def _divisors(mesh_shape: tuple[int, ...], placements: Sequence[Placement]) -> _Divs:
    return tuple((p.dim, n) for n, p in zip(mesh_shape, placements) if _kind(p) in ("S", "X"))


def _local_bytes(shape: tuple[int, ...], divs: _Divs, itemsize: int) -> int:
    if not divs:
        return math.prod(shape) * itemsize
    local = list(shape)
    for d, n in divs:
        d %= len(local)
        local[d] = -(-local[d] // n)  # ceil: rank 0 holds the largest shard
    return math.prod(local) * itemsize


def _plan(src: DTensorSpec, dst: DTensorSpec) -> _Plan:
    """The redistribution steps, cached per placements.

    * Default shard order, plain Shards: DTensor's greedy planner, which
      looks at placements only (reimplemented in :func:`_greedy_steps`).
    * Any _StridedShard: :func:`_strided_steps`.
    * Explicit non-default shard order: DTensor's graph planner, which may
      look at the shape, so cached per shape.
    """
    mesh_shape = _mesh_shape(src.mesh)
    key = (mesh_shape, src.placements, src.shard_order, dst.placements, dst.shard_order)
    plan = _PLAN_CACHE.get(key)
    if plan is _SHAPE_DEPENDENT:
        key = (key, src.mesh, tuple(src.tensor_meta.shape))
        plan = _PLAN_CACHE.get(key)
    if plan is not None:
        return plan
    if any(_kind(p) == "X" for p in (*src.placements, *dst.placements)):
        raw = _strided_steps(mesh_shape, src.placements, dst.placements)
    elif DTensorSpec.is_default_device_order(src.shard_order) and DTensorSpec.is_default_device_order(
        dst.shard_order
    ):
        raw = _greedy_steps(mesh_shape, src.placements, dst.placements)
    else:
        _PLAN_CACHE[key] = _SHAPE_DEPENDENT
        key = (key, src.mesh, tuple(src.tensor_meta.shape))
        raw = _transform_steps(src, dst)
    current, steps = list(src.placements), []
    for mesh_dim, a, b in raw:
        current[mesh_dim] = b
        steps.append((mesh_dim, a, b, _step_kinds(a, b), _divisors(mesh_shape, current)))
    plan = _PLAN_CACHE[key] = (_divisors(mesh_shape, src.placements), tuple(steps))
    return plan


def _costed_steps(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec):
    """Yield (mesh_dim, src placement, dst placement, kinds, bytes before, time)."""
    meta = src.tensor_meta
    if meta is None:
        raise ValueError("redistribute cost needs src.tensor_meta (global shape and dtype)")
    src_divs, plan = _plan(src, dst)
    if not plan:
        return
    topo = _mesh_dim_topology(src.mesh, device.gpus_per_node)
    shape = tuple(meta.shape)
    itemsize = meta.dtype.itemsize
    cur_bytes = _local_bytes(shape, src_divs, itemsize)
    for mesh_dim, a, b, kinds, divs in plan:
        new_bytes = _local_bytes(shape, divs, itemsize)
        t = topo[mesh_dim]
        time = 0.0
        if t.group_size > 1:
            for kind in kinds:
                if kind == "forbidden":
                    time = math.inf
                elif kind == "local_copy":
                    time += _local_copy_time(new_bytes, device)
                else:
                    time += collective_time(kind, cur_bytes, t.group_size, t.intra_node, device, t.ranks_per_node)
        yield mesh_dim, a, b, kinds, cur_bytes, time
        cur_bytes = new_bytes


def redistribute_steps(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec = H100) -> list[CommStep]:
    """The steps DTensor would run to turn ``src`` into ``dst``, each costed.

    Local bytes are tracked step by step (rank 0, the largest shard): an
    all-gather grows them by the group size, a reduce-scatter shrinks them.
    """
    return [
        CommStep(mesh_dim, a, b, "+".join(kinds) or "noop", nbytes, time)
        for mesh_dim, a, b, kinds, nbytes, time in _costed_steps(src, dst, device)
    ]


_REDISTRIBUTE_CACHE: dict[tuple, float] = {}


def redistribute_time(src: DTensorSpec, dst: DTensorSpec, device: DeviceSpec = H100) -> float:
    """Seconds to redistribute a tensor from ``src`` to ``dst`` (same tensor,
    same mesh): the sum of :func:`redistribute_steps`. 0 for identical
    layouts, ``inf`` for Shard -> Partial, mixed Partial ops, or different
    meshes. Cached per (src, dst, device); the step plan per placements.
    """
    if src.tensor_meta is None:
        raise ValueError("redistribute cost needs src.tensor_meta (global shape and dtype)")
    key = (src, dst, device)  # DTensorSpec caches its hash; equal specs share entries
    try:
        return _REDISTRIBUTE_CACHE[key]
    except KeyError:
        pass
    if src.mesh is not dst.mesh and src.mesh != dst.mesh:
        return math.inf  # cross-mesh moves are not DTensor redistributions
    cost = _REDISTRIBUTE_CACHE[key] = sum(step[-1] for step in _costed_steps(src, dst, device))
    return cost


# --------------------------------------------------------------------------
# Overlap
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class CommOverlapPolicy:
    """Fraction of FSDP-style parameter/gradient collectives still counted.

    FSDP prefetches layer i+1's parameter all-gather while layer i computes
    and reduce-scatters layer i's gradients while layer i-1's backward runs,
    so in steady state these collectives hide behind compute whenever they
    are shorter than it. What stays exposed is the first/last layer (not
    overlappable), the SM and HBM bandwidth NCCL kernels take from
    concurrent compute (~10-20% slowdown), and layers where comm exceeds
    compute. 0.25 keeps that residual, and keeps the ILP from treating
    parameter sharding as free (it would then shard and re-gather
    everything, and cross-node all-gathers can really exceed a layer's
    compute). The backward has ~2x the compute window of the forward, but
    gradient reduce-scatters are often in fp32 (2x the bytes), so both
    default to the same fraction. ``enabled=False`` counts everything.
    """

    enabled: bool = True
    param_allgather_discount: float = 0.25
    grad_reduce_scatter_discount: float = 0.25


PARAM_ALL_GATHER = "param_all_gather"
GRAD_REDUCE_SCATTER = "grad_reduce_scatter"


def apply_discount(time: float, kind: str, policy: CommOverlapPolicy = CommOverlapPolicy()) -> float:
    """``time`` scaled by the policy's fraction for ``kind``
    (``"param_all_gather"`` or ``"grad_reduce_scatter"``); other kinds and a
    disabled policy leave it unchanged. The caller decides what a parameter
    all-gather is."""
    if not policy.enabled:
        return time
    if kind == PARAM_ALL_GATHER:
        return time * policy.param_allgather_discount
    if kind == GRAD_REDUCE_SCATTER:
        return time * policy.grad_reduce_scatter_discount
    return time


def clear_caches() -> None:
    """Drop all memoised costs (e.g. after building a new mesh)."""
    _REDISTRIBUTE_CACHE.clear()
    _PLAN_CACHE.clear()
    _mesh_shape.cache_clear()
    _spec_sig.cache_clear()
    _flops_and_bytes_cached.cache_clear()
    _op_time_cached.cache_clear()
    _local_shape.cache_clear()
    _mesh_dim_topology.cache_clear()
