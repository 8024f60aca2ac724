"""``local_map`` regions as custom ops, ``torch.ops.autoparallel.local_map_region*``.

A function wrapped with ``torch.distributed.tensor.experimental.local_map``
is written for local shards: its inputs arrive laid out as its declared
``in_placements``, its outputs leave as ``out_placements``. Traced on plain
(fake) global tensors, ``local_map`` would call it on the global tensors and
compute something else. While tracing, the call becomes one opaque node
instead (:mod:`autoparallel.capture.local_map`):

``local_map_region(inputs, region, local)`` runs region ``region``'s body
(a :class:`Region` of :data:`REGIONS`) on its tensor inputs. With
``local=False`` (the traced global graph) its fake implementation turns the
inputs' global shapes into the shards the declared placements give, runs the
body on those and turns its outputs back into global shapes; the planner
then offers exactly the declared layouts
(:mod:`autoparallel.options.rules.local_map`). The applied local graph runs
it with ``local=True``: the body on the rank's shards
(:mod:`autoparallel.apply.local_map`).

``local_map_region_backward(grads, inputs, region, local)`` is its
backward: autograd of the body on the local inputs (re-running the body),
one gradient per input, laid out as ``in_grad_placements``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..torch_compat import autograd_below_custom_op

__all__ = [
    "LOCAL_MAP_REGION",
    "LOCAL_MAP_REGION_BACKWARD",
    "REGIONS",
    "Region",
    "global_shape",
    "local_map_region",
    "local_map_region_backward",
    "local_shape",
]


@dataclass(frozen=True)
class Region:
    """One ``local_map`` call site as traced: ``func`` is the user's body,
    called as ``func(*args, **kwargs)`` with the tensor leaves of ``args``
    (``in_spec``; ``constants`` holds the other leaves, ``None`` at tensor
    slots) replaced by the op's inputs. Placements are per tensor input
    (``in_placements``, ``in_grad_placements``) and per tensor output
    (``out_placements``, in the order of ``out_spec``'s leaves), one entry
    per mesh dim of ``mesh_shape``. ``name`` says where it is for errors."""

    name: str
    func: Callable
    in_spec: TreeSpec
    constants: tuple
    kwargs: dict
    in_placements: tuple[tuple[Placement, ...], ...]
    in_grad_placements: tuple[tuple[Placement, ...], ...]
    out_placements: tuple[tuple[Placement, ...], ...]
    mesh_shape: tuple[int, ...]

    def call(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The body on ``tensors`` (local shards); its tensor outputs."""
        it = iter(tensors)
        leaves = [next(it) if c is None else c for c in self.constants]
        out = self.func(*tree_unflatten(leaves, self.in_spec), **self.kwargs)
        flat, _ = tree_flatten(out)
        if len(flat) != len(self.out_placements) or not all(isinstance(t, torch.Tensor) for t in flat):
            raise RuntimeError(
                f"local_map region {self.name}: the body returned {len(flat)} values "
                f"({', '.join(type(t).__name__ for t in flat)}), but {len(self.out_placements)} tensors were traced"
            )
        return flat


# Every region traced in this process, indexed by the op's ``region``
# argument (the applied module runs the same bodies).
REGIONS: list[Region] = []


def local_shape(shape, placements, mesh_shape) -> list[int]:
    """The shard of a global ``shape`` under ``placements`` (even splits)."""
    out = list(shape)
    for size, p in zip(mesh_shape, placements):
        if isinstance(p, Shard):
            out[p.dim] //= size
    return out


def global_shape(shape, placements, mesh_shape) -> list[int]:
    """The global shape of a local shard ``shape`` under ``placements``."""
    out = list(shape)
    for size, p in zip(mesh_shape, placements):
        if isinstance(p, Shard):
            out[p.dim] *= size
    return out


def grad_placements_of_output(placements) -> tuple[Placement, ...]:
    """The layout of an output's gradient: every rank's partial sum gets the
    whole gradient (``Partial()`` -> ``Replicate()``), shards stay shards."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _fresh(t: torch.Tensor, shape=None) -> torch.Tensor:
    return torch.empty(list(t.shape) if shape is None else shape, dtype=t.dtype, device=t.device)


def _global_only(region: Region, what: str):
    return RuntimeError(
        f"local_map region {region.name}: {what} ran on global tensors; a region only runs on the local "
        "shards of an applied plan (autoparallel's apply_placement)"
    )


@torch.library.custom_op("autoparallel::local_map_region", mutates_args=())
def local_map_region(inputs: list[torch.Tensor], region: int, local: bool) -> list[torch.Tensor]:
    """Region ``region``'s body on ``inputs`` (local shards: ``local`` must
    be true to run for real)."""
    r = REGIONS[region]
    if not local:
        raise _global_only(r, "its forward")
    with torch.no_grad():
        outs = r.call(list(inputs))
    # a custom op's outputs may not alias its inputs
    return [o.clone() for o in outs]


@local_map_region.register_fake
def _(inputs, region, local):
    r = REGIONS[region]
    if local:
        return [_fresh(o) for o in r.call([_fresh(x) for x in inputs])]
    shards = [_fresh(x, local_shape(x.shape, p, r.mesh_shape)) for x, p in zip(inputs, r.in_placements)]
    outs = r.call(shards)
    return [_fresh(o, global_shape(o.shape, p, r.mesh_shape)) for o, p in zip(outs, r.out_placements)]


@torch.library.custom_op("autoparallel::local_map_region_backward", mutates_args=())
def local_map_region_backward(
    grads: list[torch.Tensor], inputs: list[torch.Tensor], region: int, local: bool
) -> list[torch.Tensor]:
    """Gradients of region ``region``'s outputs (``grads``) with respect to
    its ``inputs``, by autograd of the body re-run on them (zeros for an
    input that is not floating point or not used)."""
    r = REGIONS[region]
    if not local:
        raise _global_only(r, "its backward")
    with autograd_below_custom_op():
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        outs = r.call(xs)
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        wrt = [x for x in xs if x.requires_grad]
        found = (
            torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
            if pairs and wrt
            else [None] * len(wrt)
        )
    by_input = iter(found)
    out = []
    for x in xs:
        g = next(by_input) if x.requires_grad else None
        # a custom op's outputs may not alias its inputs (a sum's gradient is a view of its grad)
        out.append(torch.zeros_like(x) if g is None else g.detach().clone())
    return out


@local_map_region_backward.register_fake
def _(grads, inputs, region, local):
    return [_fresh(x) for x in inputs]


def _setup_context(ctx, inputs, output) -> None:
    tensors, region, local = inputs
    ctx.save_for_backward(*tensors)
    ctx.region, ctx.local = region, local


def _backward(ctx, grads):
    xs = ctx.saved_tensors
    gx = local_map_region_backward(list(grads), list(xs), ctx.region, ctx.local)
    return [g if x.is_floating_point() else None for g, x in zip(gx, xs)], None, None


local_map_region.register_autograd(_backward, setup_context=_setup_context)


def region_of(node: Any) -> Region:
    """The :class:`Region` of a ``local_map_region*`` FX node."""
    return REGIONS[node.args[-2]]


# the OpOverloads the traced graphs hold
LOCAL_MAP_REGION = torch.ops.autoparallel.local_map_region.default
LOCAL_MAP_REGION_BACKWARD = torch.ops.autoparallel.local_map_region_backward.default
