"""Sharded parameter init that equals the single-device init of the same seed.

The parallel module's parameters are DTensors, and the model's own
``init_weights`` runs on them unchanged. Deterministic ops (``ones_``,
``zeros_``, ``mul_``, ``clamp_``, ...) act elementwise on each shard and need
nothing. Random ops do: on CPU, DTensor has no offset-based RNG, so every
shard would draw the first numbers of the seed (all shards equal, none equal
to the single-device tensor); on CUDA its Philox offsets give each shard
*different* numbers, but not the ones the single-device tensor would hold at
those positions (a shard along dim 1 is not a contiguous run of the full
tensor, and Philox offsets count per-thread draws, not elements).

:func:`full_tensor_rng` makes every random op on a DTensor (``uniform_``,
``normal_``, ``bernoulli_``, ``random_``, ``exponential_``, ..., and
``rand_like``/``randn_like``/``randint_like``) draw the FULL tensor from the
(identically seeded) generator, as the single-device op would, and keep this
rank's shard. So

* the result equals the single-device init of the same seed, on every
  device type and for every placement (Shard on any dim, Replicate);
* every rank consumes the generator exactly as the single-device model
  does, so ranks stay in RNG lockstep and later draws (dropout masks, the
  next parameter) agree across ranks.

Trade-off: each random op materialises one full parameter (transiently,
freed before the next op) and every rank generates all of it: init costs
``numel`` draws per rank instead of ``numel / shards``, and peak memory grows
by the largest single parameter. No communication. For models whose largest
parameter does not fit on one device this is the wrong tool (use a
checkpoint instead).

The parallel module's ``init_weights``/``reset_parameters`` run the model's
own method inside :func:`full_tensor_rng`; wrap any other init code in it
yourself::

    with full_tensor_rng():
        model.layers[0].init_weights()
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["full_tensor_rng", "wrap_init"]

aten = torch.ops.aten

# in-place random fills: arg 0 is the tensor filled
_RANDOM_INPLACE = {
    aten.uniform_,
    aten.normal_,
    aten.bernoulli_,
    aten.random_,
    aten.exponential_,
    aten.geometric_,
    aten.cauchy_,
    aten.log_normal_,
}
# random factories shaped like arg 0
_RANDOM_LIKE = {aten.rand_like, aten.randn_like, aten.randint_like}

_active = threading.local()


class _FullTensorRNG(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if (packet in _RANDOM_INPLACE or packet in _RANDOM_LIKE) and args and isinstance(args[0], DTensor):
            return _full_then_shard(func, args, kwargs, inplace=packet in _RANDOM_INPLACE)
        if func is aten._local_scalar_dense.default and isinstance(args[0], DTensor):
            return _item(args[0])
        if func is aten.copy_.default and isinstance(args[0], DTensor) and not isinstance(args[1], DTensor):
            return _copy_full(args[0], args[1])
        return func(*args, **kwargs)


def _copy_full(dt: DTensor, src: torch.Tensor) -> DTensor:
    """``dt.copy_(full)`` with a plain tensor: an init computing a whole
    buffer (Hugging Face's ``init.copy_(module.position_ids, torch.arange(...))``)
    keeps this rank's shard of it."""
    local = dt._local_tensor
    if local.is_meta:
        return dt
    full = src.to(dtype=dt.dtype, device=local.device).expand(dt.shape).contiguous()
    local.copy_(distribute_tensor(full, dt.device_mesh, dt.placements, src_data_rank=None)._local_tensor)
    return dt


def _item(dt: DTensor):
    """``dt.item()``, e.g. ``trunc_normal_``'s global "any sample out of
    range?" test (DTensor reduces it over the mesh). Done here because under
    LocalTensorMode the per-rank scalar cannot pass back through this mode."""
    from torch.distributed._local_tensor import LocalTensor, enabled_local_tensor_mode

    full = dt.full_tensor()
    lm = enabled_local_tensor_mode()
    if lm is not None and isinstance(full, LocalTensor):
        with lm.disable():
            return full.reconcile().item()
    return full.item()


def _full_then_shard(func, args, kwargs, *, inplace: bool):
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    dt: DTensor = args[0]
    rest = (args[1:], kwargs)
    if any(isinstance(a, DTensor) for a in tree_flatten(rest)[0]):
        raise NotImplementedError(f"{func}: a DTensor among the non-self arguments is not supported")
    spec = dt._spec
    if any(p.is_partial() for p in spec.placements):
        raise NotImplementedError(f"{func} on a DTensor with Partial placements {spec.placements}")
    local = dt._local_tensor
    if local.is_meta:  # nothing to draw (the single-device op on meta draws nothing either)
        return dt if inplace else func(*args, **kwargs)

    def empty_full(_rank=None):
        return torch.empty(dt.shape, dtype=dt.dtype, device=local.device)

    lm = enabled_local_tensor_mode()
    # Under LocalTensorMode each simulated rank has its own generator state:
    # draw the full tensor once per rank, as separate processes would.
    full = lm.rank_map(empty_full) if lm is not None else empty_full()
    full = func(full, *args[1:], **kwargs)
    shard = distribute_tensor(full, spec.mesh, spec.placements, src_data_rank=None)._local_tensor
    del full
    if inplace:
        local.copy_(shard)
        return dt
    return DTensor.from_local(shard, spec.mesh, spec.placements, run_check=False, shape=dt.shape, stride=dt.stride())


@contextlib.contextmanager
def full_tensor_rng():
    """Random ops on DTensors draw the full tensor and keep this rank's shard
    (see the module docstring). Re-entrant.

    >>> # torch.manual_seed(0); with full_tensor_rng(): nn.init.normal_(dtensor_param)
    >>> # == the matching shard of torch.manual_seed(0); nn.init.normal_(full_param)
    """
    if getattr(_active, "on", False):
        yield
        return
    _active.on = True
    try:
        with _FullTensorRNG():
            yield
    finally:
        _active.on = False


def wrap_init(method):
    """``method`` (e.g. a model's ``init_weights``) run inside :func:`full_tensor_rng`."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with full_tensor_rng():
            return method(self, *args, **kwargs)

    return wrapped
