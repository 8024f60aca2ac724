"""Checks at the API boundary: every bad argument named before tracing or solving.

Each check raises with a short message: what is wrong, where (argument,
input index, output index, node, constraint) and what would be valid.
Wrong types are ``TypeError``; wrong values ``ValueError`` (constraints:
:class:`ConstraintError`, a ``ValueError``).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any, Iterator, Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Shard
from torch.utils._pytree import TreeSpec, tree_flatten

from .capture.attention_kernels import FUSED_ATTENTION_KERNELS
from .errors import ConstraintError
from .options.placements import format_placement, on_mesh


# -- AutoParallel(...) arguments ---------------------------------------------------


def _type_error(name: str, expected: str, value: Any) -> TypeError:
    return TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}"[:300])


def check_number(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    minimum_inclusive: bool = True,
    maximum: float | None = None,
    integer: bool = False,
) -> None:
    """``value`` is a finite real (an int when ``integer``) within bounds.

    Booleans are refused: ``True`` as a time limit is a mistake, not 1 s.
    """
    kind = "an int" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        raise _type_error(name, kind, value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and (value < minimum or (value == minimum and not minimum_inclusive)):
        bound = ">=" if minimum_inclusive else ">"
        raise ValueError(f"{name} must be {bound} {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")


def check_mp_policy(mp_policy: Any) -> None:
    """``MixedPrecisionPolicy`` or any object whose ``param_dtype`` /
    ``reduce_dtype`` attributes are dtypes or None (a string such as "bf16"
    would otherwise be ignored, leaving the plan in fp32)."""
    if mp_policy is None:
        return
    expected = (
        "None or a torch.distributed.fsdp.MixedPrecisionPolicy, e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
    )
    fields = ("param_dtype", "reduce_dtype")
    if isinstance(mp_policy, (str, torch.dtype)) or not any(hasattr(mp_policy, f) for f in fields):
        raise _type_error("mp_policy", expected, mp_policy)
    for f in fields:
        dtype = getattr(mp_policy, f, None)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise _type_error(f"mp_policy.{f}", "None or a torch.dtype such as torch.bfloat16", dtype)
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"mp_policy.{f} must be a floating dtype, got {dtype}")


def check_arguments(
    *,
    model: Any,
    mesh: Any,
    mp_policy: Any,
    device: Any,
    gpus_per_node: Any,
    overlap: Any,
    link_repeated_layers: Any,
    backend: Any,
    time_limit: Any,
    rel_gap: Any,
    attention_kernel: Any = None,
) -> None:
    """Types and ranges of ``AutoParallel(...)``'s arguments (inputs are
    checked where they are flattened, in tracing)."""
    import torch.nn as nn

    from . import cost_model

    if not isinstance(model, nn.Module):
        raise _type_error("model", "an nn.Module", model)
    if not isinstance(mesh, DeviceMesh):
        raise _type_error("mesh", "a DeviceMesh (torch.distributed.device_mesh.init_device_mesh)", mesh)
    check_mp_policy(mp_policy)
    if isinstance(device, str):
        cost_model.DeviceSpec.get(device)  # names the presets when unknown
    elif not isinstance(device, cost_model.DeviceSpec):
        raise _type_error("device", 'a DeviceSpec or a preset name such as "H100"', device)
    if gpus_per_node is not None:
        check_number("gpus_per_node", gpus_per_node, minimum=1, integer=True)
    if overlap is not None and not isinstance(overlap, cost_model.CommOverlapPolicy):
        raise _type_error("overlap", "None or a cost_model.CommOverlapPolicy", overlap)
    if not isinstance(link_repeated_layers, bool):
        raise _type_error("link_repeated_layers", "a bool", link_repeated_layers)
    if backend is not None:
        if not isinstance(backend, str):
            raise _type_error("backend", "None or a solver backend name (solver.available_backends())", backend)
        import solver.backends

        solver.backends.get_backend(backend)  # names the known and available ones
    if time_limit is not None:
        check_number("time_limit", time_limit, minimum=0, minimum_inclusive=False)
    if rel_gap is not None:
        check_number("rel_gap", rel_gap, minimum=0, maximum=1)
    if attention_kernel is not None and attention_kernel not in FUSED_ATTENTION_KERNELS:
        raise ValueError(
            f"attention_kernel must be None (the kernel torch picks for the mesh's device) or one of "
            f"{', '.join(map(repr, FUSED_ATTENTION_KERNELS))} (the fused CUDA kernels, traced on any mesh), "
            f"got {attention_kernel!r}"
        )


def check_dtensor_inputs(inputs: Any, mesh: DeviceMesh) -> None:
    """DTensor example inputs must live on the mesh being planned for."""
    if callable(inputs) and not isinstance(inputs, torch.Tensor):
        return  # built while tracing; the placement count is checked there
    leaves, _ = tree_flatten(inputs)
    index = 0
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            continue
        if isinstance(leaf, DTensor) and leaf.device_mesh != mesh:
            raise ValueError(
                f"DTensor input {index} lives on mesh {_mesh_str(leaf.device_mesh)}, but AutoParallel plans for "
                f"mesh {_mesh_str(mesh)}: redistribute it onto that mesh, or pass a plain tensor and "
                "use add_input_constraints"
            )
        index += 1


def _mesh_str(mesh: DeviceMesh) -> str:
    names = f" {tuple(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
    return f"{tuple(mesh.shape)}{names}"


def mesh_dim_name(mesh: DeviceMesh, dim: int) -> str:
    """``'dp'`` for a named mesh dim, ``mesh dim 0`` otherwise."""
    if mesh.mesh_dim_names:
        return repr(mesh.mesh_dim_names[dim])
    return f"mesh dim {dim}"


# -- the traced step ---------------------------------------------------------------


def check_outputs(output_nodes: Sequence[Any]) -> None:
    """A training step needs a tensor to differentiate."""
    if not any(isinstance(n, torch.fx.Node) for n in output_nodes):
        got = ", ".join(repr(n) for n in output_nodes) or "nothing"
        raise ValueError(
            f"the model's forward returned no tensor ({got}): autoparallel plans a training step, so forward "
            "must return the tensor(s) the loss is computed from"
        )


# -- constraints -------------------------------------------------------------------


def describe_placements(placements: Sequence[Any]) -> str:
    return "(" + ", ".join(format_placement(p) if isinstance(p, Placement) else repr(p) for p in placements) + ")"


def check_placements(placements: Any, node: Any, mesh: DeviceMesh, what: str) -> tuple:
    """One Placement per mesh dim, Shard dims within the tensor's rank
    (normalised to non-negative). ``node`` is the graph node constrained, or
    whatever the traced step has in that slot (an int output, None)."""
    example = ", ".join(["Shard(0)"] + ["Replicate()"] * (mesh.ndim - 1))
    if not isinstance(node, torch.fx.Node):
        raise ConstraintError(
            f"{what}: the traced value there is {node!r}, not a tensor; pass None for it (only tensors have placements)"
        )
    if isinstance(placements, Placement) or not isinstance(placements, (tuple, list)):
        raise ConstraintError(
            f"{what}: placements must be a tuple with one Placement per mesh dim, e.g. ({example},); got {placements!r}"
        )
    if len(placements) != mesh.ndim and what.startswith("DTensor input"):
        raise ConstraintError(
            f"{what}: a DTensor with {len(placements)} placements lives on another mesh than the "
            f"{mesh.ndim}-D mesh {_mesh_str(mesh)} being planned for: redistribute it onto that mesh, or pass "
            "a plain tensor and use add_input_constraints"
        )
    if len(placements) != mesh.ndim:
        raise ConstraintError(
            f"{what}: {len(placements)} placements given for a {mesh.ndim}-D mesh {_mesh_str(mesh)}; "
            f"give one per mesh dim, e.g. ({example},)"
        )
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ConstraintError(f"{what}: node {node.name} is not a tensor ({type(val).__name__}); pass None for it")
    ndim = val.ndim
    for p in placements:
        if not isinstance(p, Placement):
            raise ConstraintError(
                f"{what}: {p!r} is not a Placement (use Shard(d), Replicate() or Partial() "
                "from torch.distributed.tensor)"
            )
        if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
            valid = (
                f"Shard(0) .. Shard({ndim - 1}) or Replicate()"
                if ndim
                else "Replicate() or Partial() (a scalar cannot be sharded)"
            )
            raise ConstraintError(
                f"{what}: {p} is out of range for a {ndim}-D tensor (node {node.name}); valid: {valid}"
            )
    # Shard over a mesh dim of size 1 keeps the whole tensor: it is
    # Replicate(), the only layout the planner offers there (see
    # placements.is_evenly_sharded), so (Shard(0),) * 3 pins the batch on a
    # 1x4x2 mesh as it does on 2x2x2.
    return on_mesh(tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements), tuple(mesh.shape))


def check_constraint_list(constraints: Any, n: int, what: str) -> list:
    if isinstance(constraints, (str, bytes)) or not isinstance(constraints, Sequence):
        raise _type_error(f"{what}s", f"a list with one placement tuple (or None) per {what.split()[0]}", constraints)
    if len(constraints) != n:
        raise ConstraintError(
            f"{len(constraints)} {what}s given for {n} {what.split()[0]}s: give one placement tuple "
            f"(or None) per {what.split()[0]}"
        )
    return list(constraints)


def check_memory_bounds(low: Any, high: Any) -> None:
    """Fractions of the replicated parameter size: 0 <= low <= high, low <= 1."""
    for name, v in (("low", low), ("high", high)):
        if v is not None:
            try:
                check_number(f"parameter memory constraint {name}", v, minimum=0)
            except (TypeError, ValueError) as e:
                kind = type(e)
                raise kind(f"{e} (a fraction of the replicated parameter size, e.g. 0.5)") from None
    if low is not None and low > 1:
        raise ConstraintError(
            f"parameter memory constraint: low={low} exceeds 1.0, the fully replicated size (the most a rank can hold)"
        )
    if low is not None and high is not None and low > high:
        raise ConstraintError(f"parameter memory constraint: low={low} > high={high}")


def conflicting_pin(existing: tuple[str, tuple] | None, cname: str, placements: tuple, node: str) -> None:
    """Two constraints pinning one node to different placements: an error
    naming both (the later would otherwise silently replace the earlier)."""
    if existing is None:
        return
    old_name, old = existing
    if tuple(old) != tuple(placements):
        raise ConstraintError(
            f"{cname} pins node {node} to {describe_placements(placements)}, but {old_name} already pins it to "
            f"{describe_placements(old)}: a node takes one layout; drop one of them"
        )


# -- the parallel module's call structure ------------------------------------------


def describe_call(spec: TreeSpec) -> str:
    """``2 positional args and keyword args ['mask']`` for the TreeSpec of an
    ``(args, kwargs)`` pair; the raw spec when it has another shape."""
    try:
        args_spec, kwargs_spec = spec.children()
        n_args = args_spec.num_children
        keys = list(kwargs_spec.context or [])
    except (AttributeError, ValueError, TypeError):
        return str(spec)
    pos = f"{n_args} positional arg{'s' if n_args != 1 else ''}"
    kw = f"keyword args {keys}" if keys else "no keyword args"
    return f"{pos} and {kw}"


# -- fake mode scope ---------------------------------------------------------------


@contextlib.contextmanager
def outside_tracing() -> Iterator[None]:
    """Leave, for the user's ``with AutoParallel(...)`` body, the tracing state
    AOT export keeps entered on the context's stack: its FakeTensorMode
    (``torch.randn`` in the body would return a FakeTensor) and the deferral
    of saved-tensor hooks (activation checkpointing in the body would ignore
    its hooks). Planning code that needs fake tensors enters their own mode.
    """
    prior = torch._C._autograd._saved_tensors_hooks_set_tracing(False)
    try:
        with unset_fake_temporarily():
            yield
    finally:
        torch._C._autograd._saved_tensors_hooks_set_tracing(prior)


__all__ = [
    "ConstraintError",
    "check_arguments",
    "check_constraint_list",
    "check_dtensor_inputs",
    "check_memory_bounds",
    "check_mp_policy",
    "check_number",
    "check_outputs",
    "check_placements",
    "conflicting_pin",
    "describe_call",
    "describe_placements",
    "mesh_dim_name",
    "outside_tracing",
]
