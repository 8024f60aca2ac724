"""Linear algebra ops in a traced step.

``torch.linalg.inv``, ``cholesky``, ``solve`` ... call
``aten._linalg_check_errors`` on their ``info`` result, which PyTorch
registers as a side-effectful op: AOT autograd then threads "effect tokens"
through the joint graph (an extra input and output, ``with_effects`` calls),
which the planner does not model. The check only raises on a singular or
non-positive-definite input; :func:`~autoparallel.capture.trace_wrappers.linalg_checks_without_effect_tokens`
traces it as the plain op it is, so the step plans (the check, which has no
output, is not kept: a singular input gives inf/nan instead of raising, as
under ``torch.compile`` with ``check_errors=False``).

The ops themselves have no sharding rule beyond replicate-only fallback
(see :mod:`autoparallel.options.strategies`), which is correct for any of them.
"""

from __future__ import annotations


import torch

# --------------------------------------------------------------------------
# Batched solves: DTensor's options, minus those that cannot run locally.
#
# DTensor's single-dim rule for these ops offers "A replicated, B sharded on
# a batch dim" (meant for an A without that batch dim). With a batched A the
# local shards no longer broadcast: apply fails on the local op. Keep only
# the options whose local shapes the op's own shape function accepts and
# maps to the planned local output shapes.

aten = torch.ops.aten

_BATCHED_SOLVES = (
    aten.linalg_solve_triangular.default,
    aten.triangular_solve.default,
    aten.cholesky_solve.default,
    aten.linalg_lu_solve.default,
    aten.linalg_ldl_solve.default,
    aten._linalg_solve_ex.default,
    aten.ormqr.default,
    aten.linalg_householder_product.default,
    aten.lu_unpack.default,
)


def _local_shape(spec) -> list[int]:
    from torch.distributed.tensor.placement_types import Shard

    shape = list(spec.tensor_meta.shape)
    for mesh_dim, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            shape[p.dim] //= spec.mesh.size(mesh_dim)
    return shape


def _runs_locally(node, option) -> bool:
    """The op, run on fake tensors of the option's local input shapes, gives
    the option's local output shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.utils._pytree import tree_leaves, tree_map

    specs = iter(option.input_specs)
    with unset_fake_temporarily(), FakeTensorMode():

        def local(a):
            if isinstance(a, torch.fx.Node):
                val = a.meta.get("val")
                if isinstance(val, torch.Tensor):
                    return torch.empty(_local_shape(next(specs)), dtype=val.dtype)
                return val
            return a

        args = tree_map(local, node.args)
        kwargs = tree_map(local, node.kwargs)
        try:
            out = node.target(*args, **kwargs)
        except (RuntimeError, ValueError, IndexError):
            return False
    outs = tree_leaves(out)
    out_specs = tree_leaves(option.output_specs, is_leaf=lambda s: s is None or hasattr(s, "placements"))
    return all(
        s is None or list(o.shape) == _local_shape(s) for o, s in zip(outs, out_specs) if isinstance(o, torch.Tensor)
    )


def _register_batched_solves() -> None:
    from ..strategies import SpecPool, dtensor_options, register_rule, replicate_options, tensor_inputs

    @register_rule(*_BATCHED_SOLVES)
    def batched_solve_rule(node, input_candidates, mesh):
        inputs = tensor_inputs(node)
        options = dtensor_options(node, inputs, input_candidates, SpecPool(mesh))
        kept = [o for o in options if _runs_locally(node, o)]
        return kept or replicate_options(node, inputs, mesh)


_register_batched_solves()
