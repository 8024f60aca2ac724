"""Hashable keys of what an op's options depend on (values' shapes, strides
and dtypes; non-tensor arguments), for the caches of the option enumeration."""

from __future__ import annotations

import torch
import torch.fx


def val_key(val):
    """Hashable shape, stride and dtype of a fake value (nested for tuples): what a strategy depends on."""
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), tuple(val.stride()), val.dtype)
    if isinstance(val, (tuple, list)):
        return tuple(val_key(v) for v in val)
    return None


def arg_key(a):
    """Hashable structure of non-tensor arguments; tensor args become markers."""
    if isinstance(a, torch.fx.Node):
        return "T"
    if isinstance(a, (list, tuple)):
        return tuple(arg_key(x) for x in a)
    if isinstance(a, dict):
        return tuple(sorted((k, arg_key(v)) for k, v in a.items()))
    if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(a)
    return a
