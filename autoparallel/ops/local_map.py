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

``local_map_region_backward(grads, inputs, residuals, region, local)`` is
its backward, one gradient per input, laid out as ``in_grad_placements``;
``inputs`` are the inputs it reads (:attr:`Region.backward_inputs`), the
only ones the step keeps for it.
The body's forward and backward are traced apart once, on fake shards, when
the region is captured (:func:`body_graphs`, torch's default partitioner,
as AOT autograd splits a joint graph): the region's forward runs the
forward graph and puts out, after the body's outputs, the *residuals*, the
values the body's backward needs other than its inputs (a ``tanh``'s
output, a dropout mask); the backward runs the
backward graph on the inputs, the residuals and the outputs' gradients, so
the body's forward runs once per step. Residuals are rank-local values (the
shapes the body saw): the planner lays them out ``Replicate()``, which gives
their size per rank exactly and moves nothing. A body the tracer cannot
split (:class:`BodyGraphs` is then None, logged at capture) keeps no
residuals and its backward is autograd of the body re-run on the inputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..torch_compat import autograd_below_custom_op, forward_backward_graphs, storage_key

__all__ = [
    "BodyGraphs",
    "LOCAL_MAP_REGION",
    "LOCAL_MAP_REGION_BACKWARD",
    "REGIONS",
    "Region",
    "TENSOR",
    "body_graphs",
    "global_shape",
    "local_map_region",
    "local_map_region_backward",
    "local_shape",
]


class _TensorSlot:
    def __repr__(self) -> str:
        return "TENSOR"


# where a region's argument leaves hold a tensor input (None is a leaf of
# its own: a body may take None arguments)
TENSOR = _TensorSlot()


@dataclass(frozen=True)
class BodyGraphs:
    """A region's body split into forward and backward on its local shards.

    ``forward``: inputs -> the body's outputs, then the saved values;
    ``backward``: the saved values, then the gradients of the outputs in
    ``tangent_outputs`` -> the gradients of the inputs in ``grad_inputs``
    (None where unused). Per saved value, ``saved_inputs`` holds the input it
    is (passed to the backward as that input) or None: a *residual*, put out
    by the region. ``residuals``: their (local shape, dtype); ``clone``:
    whether each shares storage with an input or an earlier residual (a
    custom op's outputs may alias neither)."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    saved_inputs: tuple[int | None, ...]
    residuals: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    clone: tuple[bool, ...]
    tangent_outputs: tuple[int, ...]
    grad_inputs: tuple[int, ...]


@dataclass(frozen=True)
class Region:
    """One ``local_map`` call site as traced: ``func`` is the user's body,
    called as ``func(*args, **kwargs)`` with the tensor leaves of ``args``
    (``in_spec``; ``constants`` holds the other leaves, :data:`TENSOR` at tensor
    slots) replaced by the op's inputs. Placements are per tensor input
    (``in_placements``, ``in_grad_placements``) and per tensor output
    (``out_placements``, in the order of ``out_spec``'s leaves), one entry
    per mesh dim of ``mesh_shape``. ``name`` says where it is for errors.
    ``redistribute_inputs``: local_map's flag; False (its default) means an
    input must reach the region already laid out as declared (the planner
    pins its producer to that layout, :mod:`autoparallel.problem.local_map`)."""

    name: str
    func: Callable
    in_spec: TreeSpec
    constants: tuple
    kwargs: dict
    in_placements: tuple[tuple[Placement, ...], ...]
    in_grad_placements: tuple[tuple[Placement, ...], ...]
    out_placements: tuple[tuple[Placement, ...], ...]
    mesh_shape: tuple[int, ...]
    redistribute_inputs: bool = False
    # per tensor input: (local shape, dtype), the shard the body sees
    input_shards: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()
    graphs: BodyGraphs | None = None

    @property
    def residuals(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        return self.graphs.residuals if self.graphs is not None else ()

    @property
    def backward_inputs(self) -> tuple[int, ...]:
        """The inputs the backward reads (so the step keeps them for it):
        those its backward graph saved, or all where the body re-runs."""
        if self.graphs is None:
            return tuple(range(len(self.in_placements)))
        return tuple(sorted({k for k in self.graphs.saved_inputs if k is not None}))

    def tensor_positions(self) -> list[int]:
        """The position of each tensor input among the flattened arguments
        (what errors call "input k", as local_map's ``in_placements`` count)."""
        return [k for k, c in enumerate(self.constants) if c is TENSOR]

    def call(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The body on ``tensors`` (local shards); its tensor outputs."""
        it = iter(tensors)
        leaves = [next(it) if c is TENSOR else c for c in self.constants]
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


def body_graphs(region: Region, shards: list[torch.Tensor]) -> BodyGraphs:
    """``region``'s body split into forward and backward graphs, traced on
    ``shards`` (fake tensors of its inputs' local shapes, in the fake mode
    they belong to). Gradients flow to the floating-point inputs from the
    outputs that depend on them, as autograd of the body would."""
    primals = [x.detach().requires_grad_(x.is_floating_point()) for x in shards]
    with torch.enable_grad():
        outs = region.call(primals)
    tangent_outputs = tuple(k for k, o in enumerate(outs) if o.requires_grad)
    grad_inputs = tuple(k for k, x in enumerate(primals) if x.requires_grad)
    tangents = [torch.empty_like(outs[k]).detach() for k in tangent_outputs]

    def joint(primals, tangents):
        with torch.enable_grad():
            outs = region.call(list(primals))
            wrt = [primals[k] for k in grad_inputs]
            found = [None] * len(wrt)
            if tangent_outputs and wrt:
                found = torch.autograd.grad([outs[k] for k in tangent_outputs], wrt, list(tangents), allow_unused=True)
        return [*outs, *found]

    forward, backward = forward_backward_graphs(joint, primals, tangents, len(outs))
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    output = next(n for n in forward.graph.nodes if n.op == "output")
    saved = list(output.args[0][len(outs) :])
    takes = [n.name for n in backward.graph.nodes if n.op == "placeholder"]
    if takes[: len(saved)] != [n.name for n in saved] or len(takes) != len(saved) + len(tangents):
        raise NotImplementedError(f"the backward graph takes {takes}, not the saved values then the tangents")
    saved_inputs = tuple(placeholders.index(n) if n in placeholders else None for n in saved)
    residuals, clone, seen = [], [], {storage_key(n.meta["val"]) for n in placeholders}
    for node, source in zip(saved, saved_inputs):
        if source is not None:
            continue
        val = node.meta["val"]
        if not isinstance(val, torch.Tensor):
            raise NotImplementedError(f"the body's backward saves a {type(val).__name__}, not a tensor")
        residuals.append((tuple(val.shape), val.dtype))
        clone.append(storage_key(val) in seen)
        seen.add(storage_key(val))
    return BodyGraphs(forward, backward, saved_inputs, tuple(residuals), tuple(clone), tangent_outputs, grad_inputs)


def with_body_graphs(region: Region, shards: list[torch.Tensor]) -> Region:
    """``region`` with its :class:`BodyGraphs` (see :func:`body_graphs`)."""
    return dataclasses.replace(region, graphs=body_graphs(region, shards))


@torch.library.custom_op("autoparallel::local_map_region", mutates_args=())
def local_map_region(inputs: list[torch.Tensor], region: int, local: bool) -> list[torch.Tensor]:
    """Region ``region``'s body on ``inputs`` (local shards: ``local`` must
    be true to run for real): its outputs, then its residuals."""
    r = REGIONS[region]
    if not local:
        raise _global_only(r, "its forward")
    if r.graphs is None:
        with torch.no_grad():
            outs = r.call(list(inputs))
        # a custom op's outputs may not alias its inputs
        return [o.clone() for o in outs]
    g = r.graphs
    found = g.forward(*inputs)
    n = len(r.out_placements)
    residuals = [v for v, source in zip(found[n:], g.saved_inputs) if source is None]
    return [o.clone() for o in found[:n]] + [v.clone() if c else v for v, c in zip(residuals, g.clone)]


@local_map_region.register_fake
def _(inputs, region, local):
    r = REGIONS[region]
    device = inputs[0].device
    residuals = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in r.residuals]
    if local:
        return [_fresh(o) for o in r.call([_fresh(x) for x in inputs])] + residuals
    shards = [_fresh(x, local_shape(x.shape, p, r.mesh_shape)) for x, p in zip(inputs, r.in_placements)]
    outs = r.call(shards)
    return [_fresh(o, global_shape(o.shape, p, r.mesh_shape)) for o, p in zip(outs, r.out_placements)] + residuals


@torch.library.custom_op("autoparallel::local_map_region_backward", mutates_args=())
def local_map_region_backward(
    grads: list[torch.Tensor], inputs: list[torch.Tensor], residuals: list[torch.Tensor], region: int, local: bool
) -> list[torch.Tensor]:
    """Gradients of region ``region``'s outputs (``grads``) with respect to
    its ``inputs``: its backward graph on the inputs and the forward's
    ``residuals``, or (no graphs) autograd of the body re-run on the inputs;
    zeros for an input that is not floating point or not used."""
    r = REGIONS[region]
    if not local:
        raise _global_only(r, "its backward")
    if r.graphs is None:
        found = _recomputed_grads(r, grads, inputs)
    else:
        g = r.graphs
        given, left = dict(zip(r.backward_inputs, inputs)), iter(residuals)
        saved = [given[source] if source is not None else next(left) for source in g.saved_inputs]
        by_input = dict(zip(g.grad_inputs, g.backward(*saved, *[grads[k] for k in g.tangent_outputs])))
        found = [by_input.get(k) for k in range(len(r.input_shards))]
    # a custom op's outputs may not alias its inputs (a sum's gradient is a view of its grad)
    return [
        grads[0].new_zeros(shape, dtype=dtype) if g is None else g.detach().clone()
        for g, (shape, dtype) in zip(found, r.input_shards)
    ]


def _recomputed_grads(r: Region, grads, inputs) -> list[torch.Tensor | None]:
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
    return [next(by_input) if x.requires_grad else None for x in xs]


@local_map_region_backward.register_fake
def _(grads, inputs, residuals, region, local):
    r = REGIONS[region]
    return [
        grads[0].new_empty(shape if local else global_shape(shape, p, r.mesh_shape), dtype=dtype)
        for (shape, dtype), p in zip(r.input_shards, r.in_placements)
    ]


def _setup_context(ctx, inputs, output) -> None:
    tensors, region, local = inputs
    r = REGIONS[region]
    n = len(r.out_placements)
    # only the inputs the backward reads stay alive for it
    ctx.save_for_backward(*[tensors[k] for k in r.backward_inputs], *output[n:])
    ctx.region, ctx.local, ctx.kept, ctx.outputs = region, local, len(r.backward_inputs), n


def _backward(ctx, grads):
    saved = ctx.saved_tensors
    xs, residuals = saved[: ctx.kept], saved[ctx.kept :]
    gx = local_map_region_backward(list(grads[: ctx.outputs]), list(xs), list(residuals), ctx.region, ctx.local)
    differentiable = [dtype.is_floating_point for _, dtype in REGIONS[ctx.region].input_shards]
    return [g if d else None for g, d in zip(gx, differentiable)], None, None


local_map_region.register_autograd(_backward, setup_context=_setup_context)


def region_of(node: Any) -> Region:
    """The :class:`Region` of a ``local_map_region*`` FX node."""
    return REGIONS[node.args[-2]]


# the OpOverloads the traced graphs hold
LOCAL_MAP_REGION = torch.ops.autoparallel.local_map_region.default
LOCAL_MAP_REGION_BACKWARD = torch.ops.autoparallel.local_map_region_backward.default
