"""``local_map`` calls traced as regions, not as global ops.

A function wrapped with ``torch.distributed.tensor.experimental.local_map``
is a kernel the user wrote for local shards. On the tracer's plain fake
tensors ``local_map`` would run it on global tensors, and a body that reads
its input's local size or reduces over its shard would compute something
else than its author meant, silently. While tracing, :func:`capture_local_map`
turns each call into one ``autoparallel::local_map_region`` node
(:mod:`autoparallel.ops.local_map`) whose only layout is the declared one;
the planner plans around it and the applied plan runs the body on the
rank's shards. With local_map's ``redistribute_inputs=False`` (its default)
the plan may not redistribute in front of the region: each input's producer
is pinned to the declared layout (:mod:`autoparallel.problem.local_map`).
The body's forward and backward are traced apart here, once, on fake shards
(:func:`autoparallel.ops.local_map.body_graphs`), so the applied backward
reuses what the forward saved instead of re-running the body; a body that
cannot be split is logged and keeps the re-running backward.

What cannot be honoured is refused with :class:`LocalMapError`, naming the
function and the module calling it: tensor keyword arguments, non-tensor
outputs, a tensor input without placements, placements for another mesh,
shards that do not divide evenly, and any local_map call at all on a torch
whose local_map wrapper cannot be intercepted.

Example::

    @local_map(out_placements=[(Shard(0), Replicate())],
               in_placements=[(Shard(0), Replicate())], device_mesh=mesh)
    def center(x):  # each rank centres its own rows
        return x - x.mean(0, keepdim=True)
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import AutoParallelError
from ..ops.local_map import REGIONS, TENSOR, Region, local_map_region, local_shape, with_body_graphs
from ..torch_compat import intercept_local_map, outside_tracing

__all__ = ["LocalMapError", "capture_local_map"]

logger = logging.getLogger(__name__)


class LocalMapError(AutoParallelError, NotImplementedError):
    """A ``local_map`` region the planner cannot honour as declared."""


def _placements(value: Any, count: int, what: str, name: str) -> list[tuple[Placement, ...] | None]:
    """``value`` (one placement tuple, or one per item) as ``count`` entries."""
    if value is None:
        return [None] * count
    items = list(value)
    if items and isinstance(items[0], Placement):  # one placement tuple for a single item
        items = [tuple(items)]
    if len(items) != count:
        raise LocalMapError(f"local_map region {name}: {len(items)} {what} for {count} values")
    return [None if p is None else tuple(p) for p in items]


def _check_layout(name: str, what: str, placements, mesh_shape, shape=None) -> tuple[Placement, ...]:
    if placements is None:
        raise LocalMapError(f"local_map region {name}: {what} has no placements; give one per mesh dim")
    if len(placements) != len(mesh_shape):
        raise LocalMapError(
            f"local_map region {name}: {what} has placements ({', '.join(map(str, placements))}) for a "
            f"{len(placements)}-dim mesh, "
            f"but the plan's mesh is {tuple(mesh_shape)}"
        )
    for size, p in zip(mesh_shape, placements):
        if not isinstance(p, (Shard, Replicate, Partial)) or (isinstance(p, Shard) and type(p) is not Shard):
            raise LocalMapError(f"local_map region {name}: {what} has placement {p}; Shard, Replicate, Partial only")
        if isinstance(p, Shard) and shape is not None:
            dim = p.dim if p.dim >= 0 else p.dim + len(shape)
            if not 0 <= dim < len(shape) or shape[dim] % size:
                raise LocalMapError(
                    f"local_map region {name}: {what} of shape {tuple(shape)} cannot be split by {p} over "
                    f"{size} ranks (the plan splits evenly)"
                )
    return tuple(Shard(p.dim % len(shape)) if isinstance(p, Shard) and shape else p for p in placements)


def _kind(value) -> str:
    return "Tensor" if isinstance(value, torch.Tensor) else type(value).__name__


def _region_name(func, running: Sequence[str]) -> str:
    what = getattr(func, "__qualname__", None) or repr(func)
    module = getattr(func, "__module__", None)
    where = running[-1] if running and running[-1] else "the root module"
    return f"{module + '.' if module else ''}{what} (called in {where})"


@contextlib.contextmanager
def capture_local_map(mesh_shape: Sequence[int] | None, running: Sequence[str], fake_mode):
    """While open, ``local_map`` calls are traced as region nodes.
    ``mesh_shape``: the plan's mesh (``None``: the region's ``device_mesh``
    must give it); ``running``: the module paths being run (for errors);
    ``fake_mode``: the tracer's."""

    def handler(func, out_placements, in_placements, in_grad_placements, device_mesh, redistribute, args, kwargs):
        name = _region_name(func, running)
        shape = tuple(device_mesh.shape) if device_mesh is not None else mesh_shape
        if shape is None:
            raise LocalMapError(f"local_map region {name}: no mesh to lay it out on; pass device_mesh to local_map")
        if mesh_shape is not None and tuple(shape) != tuple(mesh_shape):
            raise LocalMapError(
                f"local_map region {name}: declared on a mesh of shape {tuple(shape)}, but the plan's mesh is "
                f"{tuple(mesh_shape)}"
            )
        if any(isinstance(v, torch.Tensor) for v in tree_flatten(kwargs)[0]):
            raise LocalMapError(f"local_map region {name}: tensor keyword arguments; pass tensors positionally")
        leaves, in_spec = tree_flatten(args)
        ins = _placements(in_placements, len(leaves), "in_placements", name)
        grads = _placements(in_grad_placements, len(leaves), "in_grad_placements", name)
        tensors, constants, in_pl, grad_pl = [], [], [], []
        for k, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                constants.append(leaf)
                continue
            constants.append(TENSOR)
            tensors.append(leaf)
            lay = _check_layout(name, f"input {k}", ins[k], shape, leaf.shape)
            in_pl.append(lay)
            grad = grads[k] if grads[k] is not None else lay
            grad_pl.append(_check_layout(name, f"the gradient of input {k}", grad, shape, leaf.shape))
        if not tensors:
            raise LocalMapError(f"local_map region {name}: no tensor input; nothing to lay out")
        # the body on fake shards says how many values to lay out, and their structure
        with outside_tracing(), fake_mode, torch.no_grad():
            shards = [
                torch.empty(local_shape(t.shape, p, shape), dtype=t.dtype, device=t.device)
                for t, p in zip(tensors, in_pl)
            ]
            it = iter(shards)
            probe = func(*tree_unflatten([next(it) if c is TENSOR else c for c in constants], in_spec), **kwargs)
        flat_out, out_spec = tree_flatten(probe)
        if not flat_out or not all(isinstance(o, torch.Tensor) for o in flat_out):
            raise LocalMapError(
                f"local_map region {name}: returns {', '.join(_kind(o) for o in flat_out) or 'nothing'}; "
                "the planner lays out tensor outputs only"
            )
        outs = _placements(out_placements, len(flat_out), "out_placements", name)
        out_pl = tuple(_check_layout(name, f"output {k}", p, shape) for k, p in enumerate(outs))
        region = Region(
            name,
            func,
            in_spec,
            tuple(constants),
            dict(kwargs),
            tuple(in_pl),
            tuple(grad_pl),
            out_pl,
            shape,
            redistribute_inputs=bool(redistribute),
            input_shards=tuple((tuple(x.shape), x.dtype) for x in shards),
        )
        try:
            with outside_tracing(), fake_mode:
                region = with_body_graphs(region, shards)
        except Exception as exc:  # the body then re-runs in its backward: correct, slower
            logger.warning(
                "local_map region %s: its forward and backward could not be traced apart (%s: %s); its backward "
                "re-runs the body",
                name,
                type(exc).__name__,
                exc,
            )
        REGIONS.append(region)
        results = local_map_region(tensors, len(REGIONS) - 1, False)
        return tree_unflatten(list(results[: len(flat_out)]), out_spec)

    def refuse(func, why: str) -> None:
        where = running[-1] if running and running[-1] else "the root module"
        name = _region_name(func, running) if func is not None else f"a local_map function (called in {where})"
        raise LocalMapError(
            f"local_map region {name}: this torch release is not supported for local_map regions ({why}), so "
            "the call cannot be traced as a region; traced as global ops, a body written for local shards "
            "would compute something else. Use a torch release whose local_map wrapper the planner can intercept "
            "(checked on 2.13), or call the body without local_map"
        )

    with intercept_local_map(handler, refuse):
        yield
