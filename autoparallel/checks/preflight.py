"""Checks that need no trace: run in the first second of a call, before
tracing spends its minute on a mistake the arguments already show.

* :func:`check_input_constraints`: the example inputs' shapes against the
  placements asked for them and the mesh (a batch of 32 does not split over
  3 ranks);
* :func:`read_plan` / :func:`check_plan_for`: a plan file exists, is a plan,
  and was made for this mesh and these input shapes (the model graph is
  compared when the plan is applied);
* pass options: :func:`autoparallel.passes.chunk_options.check_chunk_modules`.

Messages follow the ones raised after the trace (``add_input_constraints``)
so a user sees the same words wherever the mistake is caught.

>>> # with AutoParallel(model, mesh, inputs, input_constraints=[(Shard(0), Replicate())]) as autop:
"""

from __future__ import annotations

import gzip
import json
import math
import os
from typing import Any, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Shard
from torch.utils._pytree import tree_flatten

from ..validation import ConstraintError, check_constraint_list, describe_placements, mesh_dim_name


class PlanFileError(ValueError):
    """A plan file is missing, unreadable or not a plan."""


# -- example inputs ---------------------------------------------------------------


def example_input_shapes(inputs: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each tensor input, in the flattened ``(args,
    kwargs)`` order that constraints use. A callable is called on the meta
    device (as tracing does), so nothing is allocated."""
    from ..capture.tracing import normalize_inputs

    if callable(inputs) and not isinstance(inputs, (torch.Tensor, nn.Module)):
        with torch.device("meta"):
            inputs = inputs()
    args, kwargs = normalize_inputs(inputs)
    leaves, _ = tree_flatten((args, kwargs))
    return [(tuple(leaf.shape), leaf.dtype) for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _mesh_dims_text(mesh: DeviceMesh, dims: list[int]) -> str:
    return f"{' x '.join(mesh_dim_name(mesh, d) for d in dims)} ({math.prod(mesh.size(d) for d in dims)} ranks)"


def check_input_layout(i: int, shape: tuple[int, ...], placements: Any, mesh: DeviceMesh, what: str) -> None:
    """One input's placements fit its shape and the mesh: one Placement per
    mesh dim, Shard dims within range and dividing evenly, no Partial()."""
    example = ", ".join(["Shard(0)"] + ["Replicate()"] * (mesh.ndim - 1))
    if isinstance(placements, Placement) or not isinstance(placements, (tuple, list)):
        raise ConstraintError(
            f"{what}: placements must be a tuple with one Placement per mesh dim, e.g. ({example},); got {placements!r}"
        )
    if len(placements) != mesh.ndim:
        raise ConstraintError(
            f"{what}: {len(placements)} placements given for a {mesh.ndim}-D mesh {tuple(mesh.shape)}; "
            f"give one per mesh dim, e.g. ({example},)"
        )
    ndim = len(shape)
    by_dim: dict[int, list[int]] = {}
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise ConstraintError(
                f"{what}: {p!r} is not a Placement (use Shard(d), Replicate() or Partial() "
                "from torch.distributed.tensor)"
            )
        if isinstance(p, Partial):
            raise ConstraintError(
                f"{what}: input {i} cannot be Partial() on {mesh_dim_name(mesh, mesh_dim)}: "
                "a graph input is a whole value, never a pending sum"
            )
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                valid = f"Shard(0) .. Shard({ndim - 1}) or Replicate()" if ndim else "Replicate()"
                raise ConstraintError(
                    f"{what}: Shard({p.dim}) is out of range for input {i}, a {ndim}-D tensor of shape {list(shape)}; "
                    f"valid: {valid}"
                )
            if mesh.size(mesh_dim) > 1:
                by_dim.setdefault(p.dim % ndim, []).append(mesh_dim)
    for dim, mesh_dims in by_dim.items():
        ranks = math.prod(mesh.size(d) for d in mesh_dims)
        if shape[dim] % ranks:
            raise ConstraintError(
                f"{what}: input {i} has size {shape[dim]} on dim {dim}, which Shard({dim}) cannot split over "
                f"{_mesh_dims_text(mesh, mesh_dims)}: dims must divide evenly; pick a size divisible by {ranks} "
                f"or another mesh (asked {describe_placements(placements)})"
            )


def check_input_constraints(inputs: Any, constraints: Sequence[Any], mesh: DeviceMesh) -> None:
    """``constraints`` (one placement tuple or None per tensor input, as
    ``add_input_constraints`` takes) hold for the example inputs' shapes."""
    shapes = example_input_shapes(inputs)
    for i, placements in enumerate(check_constraint_list(constraints, len(shapes), "input constraint")):
        if placements is not None:
            check_input_layout(i, shapes[i][0], placements, mesh, f"input constraint {i}")


# -- plan files ---------------------------------------------------------------------


def read_plan(path: str):
    """The :class:`~autoparallel.plan.Plan` in ``path`` (``.gz``: gzip), or a
    :class:`PlanFileError` saying in one line why it cannot be read."""
    from ..plan import Plan

    if not os.path.exists(path):
        raise PlanFileError(f"plan file {path}: no such file")
    if os.path.isdir(path):
        raise PlanFileError(f"plan file {path}: is a directory, not a plan (Plan.dump_json writes one file)")
    if not os.access(path, os.R_OK):
        raise PlanFileError(f"plan file {path}: not readable (permission denied)")
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise PlanFileError(f"plan file {path}: not valid JSON ({exc})") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise PlanFileError(f"plan file {path}: cannot be read ({type(exc).__name__}: {exc})") from None
    try:
        return Plan.from_json(data)
    except (ValueError, KeyError, TypeError) as exc:
        raise PlanFileError(f"plan file {path}: not a plan written by Plan.dump_json ({exc})") from None


def check_plan_for(plan, mesh: DeviceMesh, inputs: Any = None, *, source: str = "the plan") -> None:
    """What ``plan`` records (mesh, input shapes) matches ``mesh`` and the
    example ``inputs``; raises :class:`~autoparallel.provenance.PlanMismatch`.
    The traced graph is compared when the plan is applied."""
    from .provenance import PlanMismatch

    names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    if [int(s) for s in plan.mesh_shape] != list(mesh.shape) or (
        plan.mesh_dim_names is not None and names is not None and list(plan.mesh_dim_names) != names
    ):
        raise PlanMismatch(
            f"{source} was made for mesh {_named_mesh(plan.mesh_shape, plan.mesh_dim_names)}, "
            f"but the mesh is {_named_mesh(list(mesh.shape), names)}: plan again for this mesh"
        )
    recorded = (plan.provenance or {}).get("input_shapes")
    if inputs is None or recorded is None:
        return
    shapes = [list(s) for s, _ in example_input_shapes(inputs)]
    want = [r[0] if r is not None else None for r in recorded]
    if len(want) != len(shapes):
        raise PlanMismatch(f"{source} was made for {len(want)} tensor inputs, the model is given {len(shapes)}")
    for i, (a, b) in enumerate(zip(want, shapes)):
        if a is not None and a != b:
            raise PlanMismatch(
                f"{source} was made for input {i} of shape {a}, but input {i} has shape {b}: "
                "plan again for this input shape"
            )


def load_plan_for(path: str, mesh: DeviceMesh, inputs: Any = None):
    """:func:`read_plan`, then :func:`check_plan_for`: a plan file that can
    be applied here, or a one-line error before any tracing."""
    plan = read_plan(path)
    check_plan_for(plan, mesh, inputs, source=f"plan file {path}")
    return plan


def _named_mesh(shape: list[int], names: list[str] | None) -> str:
    if not names:
        return " x ".join(str(s) for s in shape)
    return " x ".join(f"{n} {s}" for n, s in zip(names, shape))


__all__ = [
    "PlanFileError",
    "check_input_constraints",
    "check_input_layout",
    "check_plan_for",
    "example_input_shapes",
    "load_plan_for",
    "read_plan",
]
