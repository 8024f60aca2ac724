"""The modules the tracer wraps around the user's model (see :mod:`.tracing`).

* :class:`TraceRoot` is what AOT export traces: each parameter/buffer object
  once, tensor inputs only (non-tensor arguments are constants).
* :class:`ParamCastWrapper` casts parameters for mixed precision inside the
  traced step (:class:`MixedPrecisionCast` puts the gradient's reduction
  dtype on the graph).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map, tree_unflatten

__all__ = ["MixedPrecisionCast", "ParamCastWrapper", "TraceRoot"]


class MixedPrecisionCast(torch.autograd.Function):
    """Cast a parameter to ``param_dtype`` for compute; in backward, bring its
    gradient to ``reduce_dtype`` first, then to the parameter's dtype.

    The two backward casts put a node of dtype ``reduce_dtype`` on the
    gradient's path: the planner reduces partial gradients there or after it,
    never before, so the reduction runs in ``reduce_dtype`` (FSDP's
    ``MixedPrecisionPolicy.reduce_dtype`` semantics).
    """

    @staticmethod
    def forward(ctx, param, param_dtype, reduce_dtype):
        ctx.storage_dtype = param.dtype
        ctx.reduce_dtype = reduce_dtype
        return param.to(param_dtype or param.dtype)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_dtype is not None and ctx.reduce_dtype != grad.dtype:
            grad = grad.to(ctx.reduce_dtype)
            # A view after the cast gives the reduction a place in
            # reduce_dtype even when no cast to the storage dtype follows.
            grad = grad.to(ctx.storage_dtype) if grad.dtype != ctx.storage_dtype else grad.view(grad.shape)
        return grad.to(ctx.storage_dtype), None, None


class ParamCastWrapper(nn.Module):
    """Runs the model with parameters cast to ``param_dtype`` (mixed precision).

    The cast happens inside the traced graph, so parameters stay in their
    storage dtype as graph inputs and gradients flow back through the cast
    (in ``reduce_dtype`` when given). Registered as a plain attribute-free
    wrapper so FQNs are unchanged (``module.`` prefix stripped by the tracer).
    """

    def __init__(
        self,
        module: nn.Module,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        cast_inputs: bool = True,
    ):
        super().__init__()
        self.module = module
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.cast_inputs = cast_inputs

    def _cast_input(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(self.param_dtype)
        return x

    def forward(self, *args, **kwargs):
        if self.cast_inputs and self.param_dtype is not None:
            # FSDP's cast_forward_inputs: floating inputs run in param_dtype.
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
        params = {
            name: MixedPrecisionCast.apply(p, self.param_dtype, self.reduce_dtype)
            if p.is_floating_point()
            else p
            # each parameter object once: tie_weights gives its aliases the same cast
            for name, p in self.module.named_parameters()
        }
        return torch.func.functional_call(
            self.module, params, args, kwargs, tie_weights=True, strict=False
        )


class TraceRoot(nn.Module):
    """The module AOT export traces (see the module docstring).

    Parameters ``p<i>`` and buffers ``b<i>``: one per distinct tensor object
    of the model; ``names[attr]`` are every FQN that object has in ``inner``.
    ``forward`` takes the tensor leaves of the example inputs, puts the
    constants back, and runs ``inner`` with its state swapped for these.
    The model is held outside the module tree so that its own (possibly
    duplicated) parameters are not graph inputs.
    """

    def __init__(self, inner: nn.Module, model: nn.Module, prefix: str, leaves: list, in_spec):
        super().__init__()
        self.names: dict[str, list[str]] = {}
        seen: dict[int, str] = {}
        for kind, named in (("p", model.named_parameters(remove_duplicate=False)), ("b", model.named_buffers(remove_duplicate=False))):
            for fqn, t in named:
                attr = seen.get(id(t))
                if attr is None:
                    attr = seen[id(t)] = f"{kind}{len(seen)}"
                    if kind == "p":
                        self.register_parameter(attr, t)
                    else:
                        self.register_buffer(attr, t)
                self.names.setdefault(attr, []).append(prefix + fqn)
        object.__setattr__(self, "_inner", inner)
        self._leaves = leaves  # None where a tensor goes
        self._in_spec = in_spec

    def canonical(self, attr: str) -> str:
        """The FQN (without the wrapper prefix) a graph input is known by."""
        return self.names[attr][0]

    def forward(self, *tensors):
        it = iter(tensors)
        leaves = [next(it) if leaf is None else leaf for leaf in self._leaves]
        args, kwargs = tree_unflatten(leaves, self._in_spec)
        state = {fqn: getattr(self, attr) for attr, fqns in self.names.items() for fqn in fqns}
        return torch.func.functional_call(self._inner, state, tuple(args), kwargs, strict=False)
