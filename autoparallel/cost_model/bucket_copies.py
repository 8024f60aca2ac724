"""The copies in and out of the flat buffers of bucketed collectives.

Apply's ``bucket_collectives`` pass merges a layer's parameter gathers (and
its gradient reductions) into one collective of one flat buffer, as FSDP2
does, which the overlap scheduler then prices:

* a parameter gather: the shards are concatenated into the buffer (one
  ``cat`` per bucket: its bytes, its launch shared by the members), and
  each parameter is copied out of the gathered buffer (one ``clone`` per
  parameter: rank ``r``'s rows of a parameter are not adjacent there);
* a gradient reduction: the unreduced gradients are written into the buffer
  (one ``_chunk_cat`` per bucket), the results are views of it.

An edge of the planning problem that gathers a parameter (kind
:data:`~autoparallel.cost_model.overlap.PARAM_ALL_GATHER`) or reduces a
gradient (:data:`~autoparallel.cost_model.overlap.GRAD_REDUCE_SCATTER`)
counts its member's part: the bytes of its copy in, and for a gather the
copy out at least a kernel launch, both at the device's
``copies_counted`` share. :func:`bucket_copy_time` is the scalar form,
:func:`bucket_copy_grid` the same figures for a grid of placements, equal
bit for bit.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .compute import mesh_shape as _mesh_shape
from .devices import DeviceSpec
from .overlap import GRAD_REDUCE_SCATTER, PARAM_ALL_GATHER, PARAM_BACKWARD_GATHER, HiddenComm
from .placement_codes import partial_mask
from .steps import local_bytes, local_copy_time, shard_divisors


def _kind_name(kind) -> str | None:
    name = kind.kind if isinstance(kind, HiddenComm) else kind
    # a backward op's gather of a parameter copies as the forward's does
    return PARAM_ALL_GATHER if name == PARAM_BACKWARD_GATHER else name


def _copy_in_time(nbytes: float, device: DeviceSpec) -> float:
    # a member's bytes of the bucket's one copy in; its launch is shared
    time = 2 * nbytes / (device.hbm_bw * device.memory_efficiency)
    return time if device.copies_counted == 1.0 else time * device.copies_counted


def _bytes(spec) -> int:
    meta = spec.tensor_meta
    return local_bytes(tuple(meta.shape), shard_divisors(_mesh_shape(spec.mesh), spec.placements), meta.dtype.itemsize)


def bucket_copy_time(src, dst, kind, device: DeviceSpec) -> float:
    """Seconds of bucket copies an edge of ``kind`` moving ``src`` to
    ``dst`` (DTensorSpecs with tensor metas) counts: for a parameter gather
    (the local shard grows) its copy in and copy out, for a gradient
    reduction (a Partial mesh dim of ``src`` is reduced) its copy in; 0
    otherwise."""
    name = _kind_name(kind)
    if name == PARAM_ALL_GATHER:
        src_bytes, dst_bytes = _bytes(src), _bytes(dst)
        if dst_bytes > src_bytes:
            return _copy_in_time(src_bytes, device) + local_copy_time(dst_bytes, device)
    elif name == GRAD_REDUCE_SCATTER:
        if partial_mask(src.placements) & ~partial_mask(dst.placements):
            return _copy_in_time(_bytes(src), device)
    return 0.0


def bucket_copy_grid(src_specs: Sequence, dst_specs: Sequence, kind, device: DeviceSpec) -> np.ndarray | None:
    """:func:`bucket_copy_time` for every source x target spec (None when
    ``kind`` buckets nothing)."""
    name = _kind_name(kind)
    if name not in (PARAM_ALL_GATHER, GRAD_REDUCE_SCATTER):
        return None
    src_bytes = [_bytes(s) for s in src_specs]
    copy_in = np.array([_copy_in_time(b, device) for b in src_bytes], dtype=np.float64)
    if name == PARAM_ALL_GATHER:
        dst_bytes = [_bytes(d) for d in dst_specs]
        copy_out = np.array([local_copy_time(b, device) for b in dst_bytes], dtype=np.float64)
        grows = np.array(dst_bytes, dtype=np.int64)[None, :] > np.array(src_bytes, dtype=np.int64)[:, None]
        return np.where(grows, copy_in[:, None] + copy_out[None, :], 0.0)
    src_partial = np.array([partial_mask(s.placements) for s in src_specs], dtype=np.int64)
    dst_whole = np.array([~partial_mask(d.placements) for d in dst_specs], dtype=np.int64)
    reduces = (src_partial[:, None] & dst_whole[None, :]) != 0
    return np.where(reduces, copy_in[:, None], 0.0)
