"""The modules the tracer wraps around the user's model (see :mod:`.tracing`).

* :class:`TraceRoot` is what AOT export traces: each parameter/buffer object
  once, tensor inputs only (non-tensor arguments are constants).
* :class:`ParamCastWrapper` casts parameters for mixed precision inside the
  traced step (:class:`MixedPrecisionCast` puts the gradient's reduction
  dtype on the graph).
* :func:`route_hf_experts` makes Hugging Face MoE experts traceable and
  shardable by expert (see its docstring).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map, tree_unflatten

__all__ = ["MixedPrecisionCast", "ParamCastWrapper", "TraceRoot", "route_hf_experts"]

logger = logging.getLogger(__name__)


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
            name: MixedPrecisionCast.apply(p, self.param_dtype, self.reduce_dtype) if p.is_floating_point() else p
            # each parameter object once: tie_weights gives its aliases the same cast
            for name, p in self.module.named_parameters()
        }
        return torch.func.functional_call(self.module, params, args, kwargs, tie_weights=True, strict=False)


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
        for kind, named in (
            ("p", model.named_parameters(remove_duplicate=False)),
            ("b", model.named_buffers(remove_duplicate=False)),
        ):
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


# --------------------------------------------------------------------------
# Hugging Face mixture-of-experts
# --------------------------------------------------------------------------


def _hf_experts_reason(module: nn.Module) -> str | None:
    """Why ``module`` (a class decorated with transformers'
    ``@use_experts_implementation``) cannot run as ``moe_experts``; None if
    it can: gated SiLU experts (``act(gate) * up``, gate and up halves
    concatenated in ``gate_up_proj``), no biases, no post-expert norm."""
    from transformers.integrations.moe import _default_apply_gate

    if not getattr(module, "has_gate", False):
        return "its experts have no gate (up_proj only)"
    if getattr(module, "has_bias", False):
        return "its experts have biases"
    if getattr(module, "has_post_expert_norm", False):
        return "its experts have a post-expert norm"
    if getattr(type(module), "_apply_gate", None) is not _default_apply_gate:
        return "it defines its own gating (_apply_gate)"
    if not getattr(module, "is_concatenated", True):
        return "its gate and up projections are interleaved"
    if not isinstance(getattr(module, "act_fn", None), nn.SiLU) and type(module.act_fn).__name__ != "SiLUActivation":
        return f"its activation is {type(getattr(module, 'act_fn', None)).__name__}, not SiLU"
    if getattr(module, "_is_expert_parallel", False):
        return "it is already expert-parallel (transformers' own EP)"
    return None


def _experts_as_moe_op(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """transformers' experts forward, as one ``autoparallel::moe_experts`` op.

    The stacked weights are passed as views (no copies): with
    ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (``linear``
    layout), ``w1 = gate_up_proj[:, :I].mT``, ``w3 = gate_up_proj[:, I:].mT``
    and ``w2 = down_proj.mT``; with ``is_transposed`` they are slices as
    stored. Slicing and transposing keep dim 0, so expert parallelism
    (``Shard(0)`` of the op's weights) is ``Shard(0)`` of the parameters.
    ``expert_ids`` is built in the graph (a factory: the planner gives each
    rank its slice under EP).
    """
    from autoparallel.ops.moe import moe_experts

    w = self.gate_up_proj
    if self.is_transposed:  # gate_up_proj [E, H, 2I], down_proj [E, I, H]
        inter = w.shape[-1] // 2
        w1, w3, w2 = w[..., :inter], w[..., inter:], self.down_proj
    else:
        inter = w.shape[1] // 2
        w1, w3, w2 = w[:, :inter].transpose(1, 2), w[:, inter:].transpose(1, 2), self.down_proj.transpose(1, 2)
    expert_ids = torch.arange(self.num_experts, device=hidden_states.device)
    # transformers' routing weights are fp32 (softmax in fp32); the experts
    # run in the activations' dtype, as its batched/grouped forwards return.
    weights = top_k_weights.to(hidden_states.dtype)
    return moe_experts(hidden_states, top_k_index, weights, w1, w3, w2, expert_ids, self.num_experts)


def route_hf_experts(model: nn.Module) -> dict[str, str]:
    """Swap the forward of every Hugging Face experts module in ``model``
    (classes decorated with ``@use_experts_implementation``: Mixtral,
    Qwen2/3-MoE, DeepSeek, ...) for one the planner can trace and shard.
    ``model`` is the tracer's fake copy; the user's model is not touched.

    Every ``experts_implementation`` computes the same function: for each
    token, the routing-weighted sum of its top-k experts' outputs. Their code
    differs in what traces: ``"eager"`` loops over ``nonzero()`` of the
    routing mask (data-dependent: cannot be traced on fake tensors),
    ``"grouped_mm"`` becomes an opaque custom op in fp32 while compiling
    (tensor parallel at most: :mod:`autoparallel.options.rules.grouped_mm`),
    ``"batched_mm"`` gathers one weight matrix per (token, slot) (traces,
    but cannot be expert parallel). So, whatever the implementation:

    * gated SiLU experts without biases (Mixtral, Qwen-MoE, DeepSeek, most
      models) run as ``autoparallel::moe_experts``, whose sharding rule
      offers expert parallelism beside token-parallel, tensor-parallel and
      replicated experts (see :mod:`autoparallel.options.rules.moe`);
    * other experts (biases, own gating, no gate, post-expert norm) whose
      implementation cannot be traced (``"eager"``, GPU-only kernels) run
      transformers' ``"batched_mm"`` forward, the same math.

    The parallel module then runs the traced graph: ``moe_experts``'s own
    kernels, not the transformers kernel the config named.
    Returns {module FQN: what it now runs} and logs one line per kind.
    """
    if "transformers" not in sys.modules:  # not a Hugging Face model: do not import it
        return {}
    try:
        from transformers.integrations.moe import batched_mm_experts_forward
    except ImportError:  # a transformers without the experts interface
        return {}
    from ..options.rules.grouped_mm import register_transformers_grouped_mm

    # experts left on transformers' grouped_mm (fp32 fallback op) get TP rules
    register_transformers_grouped_mm()
    routed: dict[str, str] = {}
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if not hasattr(module, "_apply_gate") or not hasattr(config, "_experts_implementation"):
            continue
        impl = config._experts_implementation or "eager"
        reason = _hf_experts_reason(module)
        if reason is None:
            module.forward = types.MethodType(_experts_as_moe_op, module)
            routed[name] = f"moe_experts (was {impl})"
        elif impl not in ("batched_mm", "grouped_mm"):
            module.forward = types.MethodType(batched_mm_experts_forward, module)
            routed[name] = f"batched_mm (was {impl}; not moe_experts: {reason})"
        else:
            logger.info("experts %r keep transformers' %r forward: %s", name, impl, reason)
    by_kind: dict[str, list[str]] = {}
    for name, kind in routed.items():
        by_kind.setdefault(kind, []).append(name)
    for kind, names in by_kind.items():
        logger.info("Hugging Face experts traced as %s: %s", kind, ", ".join(names))
    return routed


# ops PyTorch marks effectful that are only run-time checks
_CHECK_OPS = ("aten::_linalg_check_errors",)


@contextlib.contextmanager
def linalg_checks_without_effect_tokens():
    """While tracing, treat ``aten._linalg_check_errors`` as an ordinary op."""
    from torch._library.simple_registry import singleton

    holders = [singleton.find(name).effect for name in _CHECK_OPS]
    saved = [h.effect for h in holders]
    for h in holders:
        h.register(None)
    try:
        yield
    finally:
        for h, effect in zip(holders, saved):
            h.register(effect)
