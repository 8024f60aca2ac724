"""Stage 1: trace one training step into a joint forward+backward FX graph.

The model (usually on the meta device) is copied, its parameters and buffers
replaced by fake tensors on the mesh's device type, and the step is exported
with AOT autograd's ``aot_export_joint_with_descriptors``. The descriptors on
placeholders and outputs tell which graph input is which parameter, buffer,
user input or tangent, and which output is which gradient.

Nothing of the user's model is modified: the copy holds the fake tensors.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn as nn
from torch._functorch._aot_autograd.descriptors import (
    BufferAOTInput,
    GradAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from . import activation_checkpointing
from .rules.linalg import linalg_checks_without_effect_tokens

logger = logging.getLogger(__name__)


@dataclass
class TracedStep:
    """The joint graph of one training step and what its inputs/outputs mean."""

    gm: torch.fx.GraphModule
    joint: Any  # torch JointWithDescriptors (kept for the apply stage)
    fake_mode: FakeTensorMode
    # FQN -> placeholder node (tied parameters appear once, under the first FQN).
    param_nodes: dict[str, torch.fx.Node]
    buffer_nodes: dict[str, torch.fx.Node]
    # User inputs in flattened (args, kwargs) order; None where the leaf
    # was not a tensor.
    input_nodes: list[torch.fx.Node | None]
    # Input placements given by DTensor leaves (None for plain tensors).
    input_placements: list[tuple | None]
    # Forward outputs in flattened order (the graph node producing each).
    output_nodes: list[torch.fx.Node]
    tangent_nodes: dict[int, torch.fx.Node]  # forward output index -> tangent
    grad_nodes: dict[str, torch.fx.Node | None]  # param FQN -> gradient node
    # Aliases of tied parameters: alias FQN -> FQN used in param_nodes.
    tied_params: dict[str, str] = field(default_factory=dict)
    # Recompute tags that module-level activation checkpointing left.
    ac_stats: activation_checkpointing.ACTagStats | None = None
    trace_seconds: float = 0.0


def _fake_like(t: torch.Tensor, fake_mode: FakeTensorMode, device: str) -> torch.Tensor:
    """A fake tensor with ``t``'s global shape/dtype on ``device``."""
    # DTensor reports its global shape and stride, which is what we trace.
    with fake_mode:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    out.requires_grad_(t.requires_grad)
    return out


def fake_model_copy(
    model: nn.Module, fake_mode: FakeTensorMode, device: str
) -> tuple[nn.Module, dict[str, str]]:
    """Copy ``model`` with every parameter/buffer replaced by a fake tensor.

    Tied parameters stay tied. Returns the copy and the tied-alias map.
    """
    # Deep-copying a meta model is cheap; a real one would duplicate memory,
    # so copy the structure with parameters swapped out first.
    fakes: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None and id(p) not in fakes:
                fakes[id(p)] = nn.Parameter(
                    _fake_like(p.detach(), fake_mode, device),
                    requires_grad=p.requires_grad,
                )
        for name, b in mod._buffers.items():
            if b is not None and id(b) not in fakes:
                fakes[id(b)] = _fake_like(b, fake_mode, device)
    model_copy = copy.deepcopy(model, memo=dict(fakes))

    tied: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            tied[name] = first_name[id(p)]
        else:
            first_name[id(p)] = name
    return model_copy, tied


def normalize_inputs(inputs: Any) -> tuple[tuple, dict]:
    """Accept a tensor, a tuple/list of args, a dict of kwargs or (args, kwargs)."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if (
        isinstance(inputs, tuple)
        and len(inputs) == 2
        and isinstance(inputs[0], (tuple, list))
        and isinstance(inputs[1], dict)
    ):
        return tuple(inputs[0]), dict(inputs[1])
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    raise TypeError(
        "inputs must be a tensor, a tuple/list of tensors (positional args), "
        f"a dict (keyword args), or a callable returning one; got {type(inputs).__name__}"
    )


def make_fake_inputs(
    inputs: Any, fake_mode: FakeTensorMode, device: str
) -> tuple[tuple, dict, list[tuple | None]]:
    """Fake, global-shaped copies of the example inputs, and DTensor placements."""
    if callable(inputs) and not isinstance(inputs, (torch.Tensor, nn.Module)):
        with torch.device("meta"):
            inputs = inputs()
    args, kwargs = normalize_inputs(inputs)
    leaves, _ = tree_flatten((args, kwargs))
    placements = [
        tuple(leaf.placements) if isinstance(leaf, DTensor) else None
        for leaf in leaves
        if isinstance(leaf, torch.Tensor)
    ]

    def to_fake(x):
        if isinstance(x, torch.Tensor):
            return _fake_like(x, fake_mode, device)
        return x

    return tree_map(to_fake, args), tree_map(to_fake, kwargs), placements


class _MixedPrecisionCast(torch.autograd.Function):
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


class _ParamCastWrapper(nn.Module):
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
            name: _MixedPrecisionCast.apply(p, self.param_dtype, self.reduce_dtype)
            if p.is_floating_point()
            else p
            for name, p in self.module.named_parameters(remove_duplicate=False)
        }
        return torch.func.functional_call(
            self.module, params, args, kwargs, tie_weights=True, strict=False
        )


MODULE_PATH_KEY = "module_path"


def module_path(node: torch.fx.Node) -> str | None:
    """FQN of the innermost module whose forward produced ``node`` (or whose
    forward's backward did), as recorded while tracing."""
    custom = node.meta.get("custom")
    return custom.get(MODULE_PATH_KEY) if custom else None


@contextlib.contextmanager
def _module_path_annotations(model: nn.Module):
    """Annotate every traced node with the FQN of the module running it.

    Forward pre/post hooks enter and leave ``torch.fx.traceback.annotate``;
    AOT autograd copies the annotation onto the backward nodes of each
    forward op, so backward nodes know their module too.
    """
    import torch.fx.traceback as fx_traceback

    open_contexts: list = []

    def pre_hook(name):
        def hook(module, args):
            ctx = fx_traceback.annotate({MODULE_PATH_KEY: name})
            ctx.__enter__()
            open_contexts.append(ctx)

        return hook

    def post_hook(module, args, output):
        open_contexts.pop().__exit__(None, None, None)

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre_hook(name)))
        handles.append(module.register_forward_hook(post_hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while open_contexts:
            open_contexts.pop().__exit__(None, None, None)


def trace_training_step(
    model: nn.Module,
    inputs: Any,
    device_type: str,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cast_inputs: bool = True,
    stack: contextlib.ExitStack,
) -> TracedStep:
    """Trace forward+backward of ``model(*inputs)`` into a joint FX graph.

    ``stack`` must stay open as long as the joint graph is used (AOT autograd
    keeps contexts on it); the caller closes it.
    """
    t0 = time.perf_counter()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_model, tied = fake_model_copy(model, fake_mode, device_type)
    args, kwargs, placements = make_fake_inputs(inputs, fake_mode, device_type)

    to_trace: nn.Module = fake_model
    prefix = ""
    if param_dtype is not None or reduce_dtype is not None:
        to_trace = _ParamCastWrapper(fake_model, param_dtype, reduce_dtype, cast_inputs)
        prefix = "module."

    with fake_mode, activation_checkpointing.graph_ac_tracing(), _module_path_annotations(
        fake_model
    ), linalg_checks_without_effect_tokens():
        joint = aot_export_joint_with_descriptors(stack, to_trace, args, kwargs)
    gm = joint.graph_module
    # Checkpointed modules reach the graph as annotations; turn them into the
    # partitioner's recompute tags now, so the plan and its dumps see them.
    ac_stats = activation_checkpointing.tag_recompute(gm)

    def fqn(target: str) -> str:
        return target[len(prefix) :] if prefix and target.startswith(prefix) else target

    param_nodes: dict[str, torch.fx.Node] = {}
    buffer_nodes: dict[str, torch.fx.Node] = {}
    input_slots: dict[int, torch.fx.Node] = {}
    tangent_by_output: dict[int, torch.fx.Node] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        if isinstance(desc, ParamAOTInput):
            param_nodes[fqn(desc.target)] = node
        elif isinstance(desc, BufferAOTInput):
            buffer_nodes[fqn(desc.target)] = node
        elif isinstance(desc, PlainAOTInput):
            input_slots[desc.idx] = node
        elif isinstance(desc, TangentAOTInput):
            out = desc.output
            if isinstance(out, PlainAOTOutput):
                tangent_by_output[out.idx] = node
        else:
            raise NotImplementedError(
                f"graph input {node.name} has descriptor {desc!r}, which autoparallel "
                "does not handle (input mutation or tensor subclass input?)"
            )

    output_node = gm.graph.output_node()
    outputs: dict[int, torch.fx.Node] = {}
    grad_nodes: dict[str, torch.fx.Node | None] = {}
    descs = output_node.meta.get("desc") or []
    for value, desc in zip(output_node.args[0], descs):
        if isinstance(desc, PlainAOTOutput):
            outputs[desc.idx] = value
        elif isinstance(desc, GradAOTOutput):
            grad_of = desc.grad_of
            if isinstance(grad_of, ParamAOTInput):
                grad_nodes[fqn(grad_of.target)] = value
    n_inputs = len(placements)
    input_nodes = [input_slots.get(i) for i in range(n_inputs)]
    seconds = time.perf_counter() - t0
    logger.info(
        "traced joint graph: %d nodes, %d parameters, %d inputs in %.2fs",
        len(gm.graph.nodes),
        len(param_nodes),
        n_inputs,
        seconds,
    )
    return TracedStep(
        gm=gm,
        joint=joint,
        fake_mode=fake_mode,
        param_nodes=param_nodes,
        buffer_nodes=buffer_nodes,
        input_nodes=input_nodes,
        input_placements=placements,
        output_nodes=[outputs[i] for i in sorted(outputs)],
        tangent_nodes=tangent_by_output,
        grad_nodes=grad_nodes,
        tied_params=tied,
        ac_stats=ac_stats,
        trace_seconds=seconds,
    )
