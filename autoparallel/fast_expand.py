"""DTensor's ``expand_to_full_mesh_op_strategy`` with specs built once per
(argument, placements) instead of once per combination (issue 13).

DTensor writes matmul, attention, embedding, ... rules for one mesh dim and
expands them over the mesh: every combination of per-dim rules gets new
DTensorSpecs (~35 us each: shard-order bookkeeping), 8^3 = 512 combinations
of 3 specs for ``mm`` on a 3-D mesh, 8^4 = 4096 on 4-D. Most of the options
stage on 3-D meshes went there, yet a combination's specs repeat the same
few placements per argument. Here each argument's spec for given placements
is built once (with the same arguments DTensor would pass) and shared; the
filters run in DTensor's order on the shared specs, so the strategy holds
the same options, in the same order.

Calls this version does not handle the same way (in-place and out= ops,
multi-mesh arguments, ``_StridedShard`` inputs)
go to DTensor's own function. :func:`fast_expansion` patches the function
where DTensor's rule modules bound it, for the duration of a ``with``.
"""

from __future__ import annotations

import contextlib
import itertools
import sys

from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
from torch.distributed.tensor.placement_types import Partial, _StridedShard

_ORIGINAL = None


def _mixed_partial(spec: DTensorSpec) -> bool:
    kinds = {(type(p), p.reduce_op) for p in spec.placements if isinstance(p, Partial)}
    if len(kinds) > 1:
        reduce_ops = {ro for _, ro in kinds}
        types = {t for t, _ in kinds}
        return not (len(types) == 1 and reduce_ops == {"sum", "avg"})
    return False


def expand_to_full_mesh_op_strategy(
    mesh,
    op_schema,
    single_mesh_dim_strategies,
    *,
    output_tensor_meta=None,
    input_index: int = 1,
    inplace_op: bool = False,
    allow_unbacked_sharding=None,
    allow_uneven_sharding: bool = False,
    is_valid_strategy_cb=None,
    different_mesh_args=None,
):
    from torch.distributed.tensor._ops import utils as ops_utils

    input_args_strategy = op_schema.args_strategy + op_schema.kwargs_strategy
    if (
        inplace_op
        or different_mesh_args
        or op_schema.is_out_variant_op()
        or input_index == 0
        or any(
            isinstance(p, _StridedShard)
            for s in input_args_strategy
            for p in s.strategies[0].output_spec.placements
        )
    ):
        return _ORIGINAL(
            mesh,
            op_schema,
            single_mesh_dim_strategies,
            output_tensor_meta=output_tensor_meta,
            input_index=input_index,
            inplace_op=inplace_op,
            allow_unbacked_sharding=allow_unbacked_sharding,
            allow_uneven_sharding=allow_uneven_sharding,
            is_valid_strategy_cb=is_valid_strategy_cb,
            different_mesh_args=different_mesh_args,
        )
    n_positions = len(single_mesh_dim_strategies[0]) if single_mesh_dim_strategies else 0
    # Per position: the tensor meta DTensor gives its spec (outputs from
    # output_tensor_meta, counting non-None outputs; inputs in order of the
    # non-None input positions), whether it is an input, and which input.
    memo: dict[tuple, tuple] = {}

    def counts(strategy) -> list[tuple[int, int]]:
        """Per position: non-None outputs / inputs before it (DTensor looks
        at the first mesh dim's entry to tell a None position)."""
        out_count = in_count = 0
        result = []
        for q, p in enumerate(strategy):
            result.append((out_count, in_count))
            if p is not None:
                if q < input_index:
                    out_count += 1
                else:
                    in_count += 1
        return result

    counts_of = [counts(s) for s in single_mesh_dim_strategies]

    def spec_at(position: int, placements: tuple, out_count: int, in_count: int) -> tuple:
        """(spec, mixed partial?, shardable?) for ``placements`` at ``position``."""
        key = (position, placements, out_count, in_count)
        hit = memo.get(key)
        if hit is None:
            meta, input_strategy = None, None
            if position < input_index:
                if output_tensor_meta is not None:
                    if isinstance(output_tensor_meta, TensorMeta):
                        meta = output_tensor_meta
                    elif isinstance(output_tensor_meta, (tuple, list)) and out_count < len(output_tensor_meta):
                        meta = output_tensor_meta[out_count]
            elif in_count < len(input_args_strategy):
                input_strategy = input_args_strategy[in_count]
                meta = input_strategy.tensor_meta
            spec = _shared_spec(mesh, placements, meta)
            shardable = True
            if input_strategy is not None:
                shardable = _shardable(input_strategy.shape, spec, allow_unbacked_sharding) or (
                    allow_uneven_sharding and input_strategy.strategies[0].output_spec.placements == placements
                )
            hit = memo[key] = (spec, _mixed_partial(spec), shardable)
        return hit

    all_strategies = []
    # (position, ids of the placement objects, counts) -> spec_at's answer:
    # ints hash much faster than Placements (equal placements under other
    # objects still meet in spec_at's memo)
    by_ids: dict[tuple, tuple] = {}
    indexed = list(enumerate(single_mesh_dim_strategies))
    for icomb in itertools.product(indexed, repeat=mesh.ndim):
        comb = [c for _, c in icomb]
        first_counts = counts_of[icomb[0][0]]
        spec_list = []
        skip = False
        for position in range(n_positions):
            if comb[0][position] is None:
                spec_list.append(None)
                continue
            key = (position, first_counts[position], *[id(c[position]) for c in comb])
            hit = by_ids.get(key)
            if hit is None:
                placements = tuple(c[position] for c in comb)
                hit = by_ids[key] = spec_at(position, placements, *first_counts[position])
            spec, mixed, shardable = hit
            if mixed:
                skip = True
                break
            spec_list.append((spec, shardable))
        if skip:
            continue
        inputs = [s for s in spec_list[input_index:] if s is not None]
        if len(inputs) != len(input_args_strategy):
            raise AssertionError(
                f"input_specs({len(inputs)}) != strategies({len(input_args_strategy)}: "
                f"{len(op_schema.args_strategy)} args + {len(op_schema.kwargs_strategy)} kwargs)"
            )
        if not all(ok for _, ok in inputs):
            continue
        input_specs = [s for s, _ in inputs]
        outs = [None if s is None else s[0] for s in spec_list[:input_index]]
        if input_index > 1:
            output_specs = tuple(outs)
        elif outs[0] is not None:
            output_specs = outs[0]
        else:
            raise RuntimeError("output spec is None")
        if is_valid_strategy_cb is not None and not is_valid_strategy_cb(input_specs, output_specs):
            continue
        redistribute_cost = [
            ops_utils.generate_redistribute_costs(strategy, spec)
            for strategy, spec in zip(input_args_strategy, input_specs)
        ]
        all_strategies.append(
            OpSpec(output_specs=output_specs, input_specs=input_specs, redistribute_cost=redistribute_cost)
        )
    return OpStrategy(all_strategies)


# Specs and shardability shared across calls while fast_expansion() is
# entered: the ops of a layer expand over the same few tensor metas, and on
# a 4-D mesh each call would otherwise build ~10K specs (~35 us each).
_SPECS: dict[tuple, DTensorSpec] = {}
_SHARDABLE: dict[tuple, bool] = {}


def _shared_spec(mesh, placements: tuple, meta) -> DTensorSpec:
    key = (id(mesh), placements, meta)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _SPECS[key] = DTensorSpec(mesh, placements, tensor_meta=meta)
    return spec


def _shardable(shape, spec: DTensorSpec, allow_unbacked_sharding) -> bool:
    from torch.distributed.tensor._ops import utils as ops_utils

    key = (tuple(shape), id(spec), allow_unbacked_sharding)
    ok = _SHARDABLE.get(key)
    if ok is None:
        ok = _SHARDABLE[key] = ops_utils.is_tensor_shardable(shape, spec, allow_unbacked_sharding=allow_unbacked_sharding)
    return ok


@contextlib.contextmanager
def fast_expansion():
    """Use :func:`expand_to_full_mesh_op_strategy` in DTensor's rule modules."""
    global _ORIGINAL
    from torch.distributed.tensor._ops import utils as ops_utils

    original = _ORIGINAL = _ORIGINAL or ops_utils.expand_to_full_mesh_op_strategy
    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed.tensor") and getattr(module, "expand_to_full_mesh_op_strategy", None) is original:
            module.expand_to_full_mesh_op_strategy = expand_to_full_mesh_op_strategy
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            module.expand_to_full_mesh_op_strategy = original
        _SPECS.clear()
        _SHARDABLE.clear()
