"""Stage 1: trace one training step into a joint forward+backward FX graph.

The model (usually on the meta device) is copied, its parameters and buffers
replaced by fake tensors on the mesh's device type, and the step is exported
with AOT autograd's ``aot_export_joint_with_descriptors``. The descriptors on
placeholders and outputs tell which graph input is which parameter, buffer,
user input or tangent, and which output is which gradient or mutated input.

What is exported is a :class:`~.trace_wrappers.TraceRoot` around the copy: it holds each
parameter and buffer OBJECT once (tied/shared parameters are one graph input,
one decision, one gradient summing every use; ``tied_params`` lists the other
names), and its forward takes only the TENSOR leaves of the flattened
``(args, kwargs)``: non-tensor leaves (floats, ints, bools, strings) are
constants of the traced step, baked into the graph. User inputs are indexed
by their position among the tensor leaves (``input_nodes``; input
constraints use the same index). In-place updates of buffers and inputs
(BatchNorm's running statistics, ``x.mul_(2)``) are listed in ``mutations``:
the graph outputs the new value, and the parallel module writes it back.

Nothing of the user's model is modified: the copy holds the fake tensors.

Library code sees that it is being traced. Hugging Face transformers (and
torchtitan, and any model written for ``torch.compile``/``torch.export``)
guard data-dependent checks with ``torch.compiler.is_compiling()`` /
``is_exporting()`` (transformers' ``is_tracing``; e.g. ``masking_utils``
skips ``(mask[:, -1] == 0).all()`` when tracing). The export runs under
``torch._export.utils._compiling_state_context``, the state that
``torch.export(strict=False)`` sets for its own make_fx trace, which is what
this tracer is: the same Python runs on fake tensors, so the same library
branches are taken as under non-strict export.

Why not capture through dynamo first (``_dynamo_graph_capture_for_export``,
then the joint of the captured graph)? Tried on our LLaMA-3 and on Hugging
Face Llama: it traces, but (1) our module-path annotations come from forward
pre/post hooks that enter ``fx.traceback.annotate``, which dynamo refuses
(graph break); dynamo's own ``nn_module_stack`` covers only forward nodes
(about 40% of the call nodes), so the backward nodes that the planner's
repeated-layer detection and the passes key on lose their module; (2)
parameter and buffer names come back mangled (``L__self___layers_0_...``)
and need restoring; (3) it adds a second set of failure modes (graph
breaks) for no gain here: setting the flag alone made every model tried
(Hugging Face Llama, GPT-2, BERT, T5) trace, with every node keeping its
module path.

Python control flow that genuinely depends on tensor data (``if x.sum() >
0:``) cannot be traced either way; it raises :class:`DataDependentTraceError`
naming the module path and the source line, and saying what to do.
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
    InputMutationAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._export.utils import _compiling_state_context
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from . import activation_checkpointing
from ..errors import DataDependentTraceError
from ..graph_vocab import MODULE_PATH_KEY, module_path  # noqa: F401 - module_path re-exported
from .local_map import capture_local_map
from .trace_wrappers import ParamCastWrapper, TraceRoot, linalg_checks_without_effect_tokens, route_hf_experts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mutation:
    """The step updates a buffer (``kind="buffer"``, ``target`` its FQN) or a
    user tensor input (``kind="input"``, ``target`` its tensor index) in
    place; ``node`` computes the new value."""

    kind: str
    target: str | int
    node: torch.fx.Node


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
    # In-place updates the step makes, in graph output order.
    mutations: list["Mutation"] = field(default_factory=list)
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


def fake_model_copy(model: nn.Module, fake_mode: FakeTensorMode, device: str) -> tuple[nn.Module, dict[str, str]]:
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


def make_fake_inputs(inputs: Any, fake_mode: FakeTensorMode, device: str) -> tuple[tuple, dict, list[tuple | None]]:
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


_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


def _user_frame(tb) -> str:
    """``file:line (code)`` of the innermost traceback frame outside torch."""
    import os
    import traceback

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    ours = {__file__, os.path.join(os.path.dirname(__file__), "trace_wrappers.py")}
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(torch_dir) and f.filename not in ours]
    if not frames:
        return "an unknown line"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} ({(f.line or '').strip()})"


def _data_dependent_error(e: BaseException, running: list[str]) -> DataDependentTraceError:
    where = running[-1] if running else None
    module = f"module {where!r}" if where else "the root module"
    return DataDependentTraceError(
        f"the traced step depends on the value of a tensor in {module}, at {_user_frame(e.__traceback__)}: "
        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
        "autoparallel traces on fake tensors (no data), like torch.export: make the branch static "
        "(decide it from shapes or a Python flag), express it with torch.where / torch.cond, or "
        "guard it with `if not torch.compiler.is_compiling():` if it is only a check."
    )


@contextlib.contextmanager
def _module_path_annotations(model: nn.Module, running: list[str] | None = None):
    """Annotate every traced node with the FQN of the module running it.

    Forward pre/post hooks enter and leave ``torch.fx.traceback.annotate``;
    AOT autograd copies the annotation onto the backward nodes of each
    forward op, so backward nodes know their module too.
    """
    import torch.fx.traceback as fx_traceback

    open_contexts: list = []
    # FQNs of the modules whose forward is running, innermost last (for errors)
    running = running if running is not None else []

    def pre_hook(name):
        def hook(module, args):
            ctx = fx_traceback.annotate({MODULE_PATH_KEY: name})
            ctx.__enter__()
            open_contexts.append(ctx)
            running.append(name)

        return hook

    def post_hook(module, args, output):
        open_contexts.pop().__exit__(None, None, None)
        running.pop()

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


def _check_device_traceable(device_type: str) -> None:
    """A CPU-only build of torch cannot trace on fake CUDA tensors: autograd
    asks CUDA's device guard about them and the process aborts (a C++
    ``terminate``, no Python error). Say so before it happens, and what to
    do instead."""
    if torch.device(device_type).type == "cuda" and not torch.backends.cuda.is_built():
        raise RuntimeError(
            "the mesh's device type is 'cuda' but this torch is a CPU-only build, which cannot trace on CUDA "
            "tensors. Plan on a 'cpu' mesh of the same shape (the cost model's device is set apart, with "
            "AutoParallel(device=...)); to trace the fused attention kernel a GPU would run, pass "
            "AutoParallel(..., attention_kernel='cudnn') (or 'flash', 'efficient')"
        )


def trace_training_step(
    model: nn.Module,
    inputs: Any,
    device_type: str,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cast_inputs: bool = True,
    stack: contextlib.ExitStack,
    mesh_shape: tuple[int, ...] | None = None,
) -> TracedStep:
    """Trace forward+backward of ``model(*inputs)`` into a joint FX graph.

    ``mesh_shape``: the plan's mesh, which ``local_map`` regions are laid out
    on (:mod:`.local_map`).

    ``stack`` must stay open as long as the joint graph is used (AOT autograd
    keeps contexts on it); the caller closes it.
    """
    t0 = time.perf_counter()
    _check_device_traceable(device_type)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_model, tied = fake_model_copy(model, fake_mode, device_type)
    # Hugging Face MoE experts: traceable and shardable by expert, same math.
    route_hf_experts(fake_model)
    args, kwargs, placements = make_fake_inputs(inputs, fake_mode, device_type)

    inner: nn.Module = fake_model
    prefix = ""
    if param_dtype is not None or reduce_dtype is not None:
        inner = ParamCastWrapper(fake_model, param_dtype, reduce_dtype, cast_inputs)
        prefix = "module."
    leaves, in_spec = tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    to_trace = TraceRoot(
        inner, fake_model, prefix, [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], in_spec
    )

    running: list[str] = []
    with (
        fake_mode,
        activation_checkpointing.graph_ac_tracing(),
        _module_path_annotations(fake_model, running),
        capture_local_map(mesh_shape, running, fake_mode),
        _compiling_state_context(),
        linalg_checks_without_effect_tokens(),
    ):
        try:
            joint = aot_export_joint_with_descriptors(stack, to_trace, tuple(tensors), {})
        except _DATA_DEPENDENT as e:
            raise _data_dependent_error(e, running) from e
        except RuntimeError as e:
            if "in output, which is not a known type" in str(e):
                raise RuntimeError(
                    f"{e}\nThe model returns an object that is not a tensor pytree. For a Hugging Face "
                    "model this is usually the KV cache: trace the training step with use_cache=False "
                    "(in the config or as a keyword input)."
                ) from e
            raise
    gm = joint.graph_module
    # Checkpointed modules reach the graph as annotations; turn them into the
    # partitioner's recompute tags now, so the plan and its dumps see them.
    ac_stats = activation_checkpointing.tag_recompute(gm)

    def fqn(target: str) -> str:
        name = to_trace.canonical(target)
        return name[len(prefix) :] if prefix and name.startswith(prefix) else name

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
    mutations: list[Mutation] = []
    for value, desc in zip(output_node.args[0], descs):
        if isinstance(desc, PlainAOTOutput):
            outputs[desc.idx] = value
        elif isinstance(desc, InputMutationAOTOutput):
            target = desc.mutated_input
            if isinstance(target, BufferAOTInput):
                mutations.append(Mutation("buffer", fqn(target.target), value))
            elif isinstance(target, PlainAOTInput):
                mutations.append(Mutation("input", target.idx, value))
            else:
                raise NotImplementedError(
                    f"the step updates {target!r} in place ({value}); autoparallel writes back "
                    "in-place updates of buffers and tensor inputs only (not of parameters)"
                )
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
        mutations=mutations,
        ac_stats=ac_stats,
        trace_seconds=seconds,
    )
