"""``local_map`` regions (:mod:`autoparallel.ops.local_map`): one option each.

A region is a kernel written for the layouts its author declared, so its
only option is that layout: inputs as ``in_placements``, outputs as
``out_placements``. Its backward takes each output's gradient as the output
was laid out (a ``Partial()`` output's gradient whole: ``Replicate()``),
the inputs it reads (``Region.backward_inputs``) as declared, and gives
each input's gradient as
``in_grad_placements``. Producers and consumers around it are redistributed
by the plan like around any op (unless ``redistribute_inputs=False``:
:mod:`autoparallel.problem.local_map`). The body's residuals (values its
backward needs, put out by the forward after its outputs) are rank-local:
``Replicate()`` on every mesh dim, forward output and backward input.
"""

from __future__ import annotations

from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Replicate

from ...ops.local_map import LOCAL_MAP_REGION, LOCAL_MAP_REGION_BACKWARD, grad_placements_of_output, region_of
from ..strategies import Option, register_rule, tensor_meta_of


def _spec(mesh, placements, node) -> DTensorSpec:
    return DTensorSpec(mesh, tuple(placements), tensor_meta=tensor_meta_of(node.meta["val"]))


def _check_mesh(region, mesh) -> None:
    if tuple(mesh.shape) != tuple(region.mesh_shape):
        raise ValueError(
            f"local_map region {region.name} was traced for a mesh of shape {region.mesh_shape}, "
            f"but the plan's mesh is {tuple(mesh.shape)}"
        )


def _replicated(region, mesh) -> tuple:
    """The residuals' layouts: each rank's own values, replicated (their
    global shape is the local one, so sizes per rank are exact)."""
    return tuple((Replicate(),) * mesh.ndim for _ in region.residuals)


def _outputs(node, mesh, placements) -> tuple:
    vals = node.meta["val"]
    return tuple(
        DTensorSpec(mesh, tuple(p), tensor_meta=tensor_meta_of(v)) for v, p in zip(vals, placements, strict=True)
    )


@register_rule(LOCAL_MAP_REGION)
def local_map_region_rule(node, input_candidates, mesh) -> list[Option]:
    region = region_of(node)
    _check_mesh(region, mesh)
    inputs = node.args[0]
    in_specs = tuple(_spec(mesh, p, x) for x, p in zip(inputs, region.in_placements, strict=True))
    return [Option(_outputs(node, mesh, region.out_placements + _replicated(region, mesh)), in_specs)]


@register_rule(LOCAL_MAP_REGION_BACKWARD)
def local_map_region_backward_rule(node, input_candidates, mesh) -> list[Option]:
    region = region_of(node)
    _check_mesh(region, mesh)
    grads, inputs, residuals = node.args[0], node.args[1], node.args[2]
    grad_in = [grad_placements_of_output(p) for p in region.out_placements]
    in_specs = tuple(_spec(mesh, p, g) for g, p in zip(grads, grad_in, strict=True))
    kept = [region.in_placements[k] for k in region.backward_inputs]
    in_specs += tuple(_spec(mesh, p, x) for x, p in zip(inputs, kept, strict=True))
    in_specs += tuple(_spec(mesh, p, r) for r, p in zip(residuals, _replicated(region, mesh), strict=True))
    return [Option(_outputs(node, mesh, region.in_grad_placements), in_specs)]
