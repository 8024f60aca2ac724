"""Calling DTensor's sharding propagation for one FX node with every
candidate placement of every input at once (used by :mod:`.strategies`):
build the ``OpSchema`` from candidate strategies, pick DTensor's strategy
function (single-dim strategies expanded over the mesh, full-mesh strategy
functions, decomposition-based strategies), and skip the redistribution
costing that DTensor's strategy functions do and the planner does not read.
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.utils._pytree import tree_map

from ..torch_compat import (
    CODE_ERRORS,
    Swap,
    decomposition_strategy,
    qualified_name,
    reduction_linearity_leaks,
    strategy_function,
    swapped,
)
from .placements import tensor_meta_of

logger = logging.getLogger(__name__)


def propagator():
    """DTensor's sharding propagator (its op strategy registry)."""
    return DTensor._op_dispatcher.sharding_propagator


def dtensor_rule_name(op) -> str:
    """The qualified name of DTensor's rule for ``op`` (for errors)."""
    prop = propagator()
    rule = prop.op_single_dim_strategy_funcs.get(op) or prop.op_strategy_funcs.get(op)
    if rule is not None:
        return qualified_name(rule)
    return "DTensor's decomposition strategy"


def _zero_redistribute_cost(current_spec: DTensorSpec, target_spec: DTensorSpec) -> float:
    return 0.0


def _zero_redistribute_costs(src_strategy: OpStrategy, dst_spec: DTensorSpec) -> list[float]:
    """``generate_redistribute_costs`` with every cost zero, without a call
    per candidate (on a 4-D mesh: ~4K candidates per input and option,
    ~120M calls for one LLaMA-3 layer)."""
    return [0.0] * len(src_strategy.strategies)


_BINDING: dict[int, tuple] = {}  # id(function) -> (modules, number of modules scanned, function)


def _modules_binding(fn) -> list:
    """DTensor modules that bound ``fn`` by name at import (rule modules
    import ``generate_redistribute_costs`` from utils); rescanned only when
    new modules were imported (scanning costs ~2 ms, once per node)."""
    hit = _BINDING.get(id(fn))
    if hit is None or hit[1] != len(sys.modules):
        modules = [
            module
            for name, module in list(sys.modules.items())
            if name.startswith("torch.distributed.tensor")
            and getattr(module, "generate_redistribute_costs", None) is fn
        ]
        hit = _BINDING[id(fn)] = (modules, len(sys.modules), fn)
    return hit[0]


@contextlib.contextmanager
def without_dtensor_redistribute_costs():
    """Make DTensor's strategy functions skip costing their redistributions.

    Every strategy function fills ``OpSpec.redistribute_cost`` with
    ``generate_redistribute_costs(candidates, required)``: one call of
    DTensor's redistribution planner per (candidate input, option) pair, which
    for view ops with ``_StridedShard`` candidates runs its graph search.
    Given every candidate of a 2-D mesh at once, that is >95% of the
    enumeration time, and the numbers are thrown away (the cost model prices
    transitions itself; :func:`~.conversion.options_from_op_strategy` reads placements
    only). No strategy function uses the costs to choose or filter options,
    so swapping in a zero cost leaves the options unchanged.
    """
    from torch.distributed.tensor._ops import utils as ops_utils

    swaps = [Swap(ops_utils, "redistribute_cost", _zero_redistribute_cost)]
    swaps += [
        Swap(module, "generate_redistribute_costs", _zero_redistribute_costs)
        for module in _modules_binding(ops_utils.generate_redistribute_costs)
    ]
    with swapped(swaps, what="zero redistribution costs while enumerating"):
        yield


def node_out_meta(node: torch.fx.Node):
    """``node``'s output tensor meta (a tuple of them for a multi-output op; None for a non-tensor)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tensor_meta_of(val)
    if isinstance(val, (tuple, list)):
        return tuple(tensor_meta_of(v) if isinstance(v, torch.Tensor) else None for v in val)
    return None


def build_schema(
    node: torch.fx.Node,
    candidates: dict[torch.fx.Node, OpStrategy],
) -> OpSchema:
    """The ``OpSchema`` DTensor's strategy function takes for ``node``, with ``candidates``' strategies for its tensor inputs."""
    op = node.target
    prop = propagator()

    def convert(a):
        if isinstance(a, torch.fx.Node):
            if a in candidates:
                return candidates[a]
            return a.meta.get("val")
        return a

    args = tree_map(convert, node.args)
    kwargs = tree_map(convert, node.kwargs)

    # Lists of tensors become TupleStrategy, as DTensor expects.
    def tuple_wrap(a):
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, OpStrategy) for x in a):
            return TupleStrategy(list(a) if isinstance(a, list) else tuple(a))
        return a

    args = tuple(tuple_wrap(a) for a in args)
    kwargs = {k: tuple_wrap(v) for k, v in kwargs.items()}
    # single-dim strategies keep theirs apart (index.Tensor's needs_pytree:
    # its list of optional index tensors holds strategies)
    info = prop.op_to_schema_info.get(op) or prop.op_to_schema_info_for_single_dim_strategy.get(op)
    return OpSchema(op, args, kwargs, schema_info=info)


def single_dim_rule(op):
    """The single-mesh-dim rule expanded over the mesh for ``op``: DTensor's,
    or for a pointwise op whose DTensor rule is the older whole-mesh one,
    the same rule written here (:mod:`.pointwise`); None where ``op`` has
    a whole-mesh rule or none."""
    from .pointwise import pointwise_single_dim_rule

    prop = propagator()
    return prop.op_single_dim_strategy_funcs.get(op) or pointwise_single_dim_rule(prop, op)


def dtensor_strategy(node: torch.fx.Node, schema: OpSchema, mesh: DeviceMesh):
    """OpStrategy/TupleStrategy from DTensor for ``schema``, or None if no rule."""
    from torch.distributed.tensor._ops.single_dim_strategy import (
        _expand_single_dim_strategy_to_mesh,
    )

    op = node.target
    single = single_dim_rule(op)
    if single is not None:
        # Single-dim strategies are expanded over the whole mesh independently
        # of the input placements; DTensor only looks at the inputs to learn
        # which shard types exist. Give it one representative spec per input,
        # with a plain Shard so that sharding placeholders expand to Shard.
        schema = _representative_schema(schema, mesh)
        fn = _expand_single_dim_strategy_to_mesh(mesh, schema, single, node_out_meta(node))
        return fn(op, schema.args_meta, schema.kwargs_meta)
    func = propagator().op_strategy_funcs.get(op)
    if func is not None:
        if _reduction_per_candidate(func):
            return per_candidate_reduction(func, schema)
        return func(schema)
    return _decomp_strategy(node, schema, mesh)


def _reduction_per_candidate(func) -> bool:
    """Whether ``func`` is DTensor's linear reduction rule in a release
    whose rule lets one candidate's Partial turn off the linear case of the
    later ones (then each candidate is asked on its own)."""
    fn = strategy_function(func)
    return (
        getattr(fn, "__module__", None) == "torch.distributed.tensor._ops._math_ops"
        and getattr(fn, "__qualname__", None) == "linear_reduction_strategy"
        and reduction_linearity_leaks()
    )


def per_candidate_reduction(func, schema: OpSchema) -> OpStrategy:
    """DTensor's linear reduction rule called with one input candidate at a
    time: each candidate's options as if it were the only one (a ``P(avg)``
    candidate of ``sum`` needs its partial reduced, a ``P(sum)`` one keeps
    its partial whatever came before), as newer DTensor rules give them."""
    first, *rest = schema.args_schema
    strategies: list[OpSpec] = []
    for spec in first.strategies:
        one = OpSchema(schema.op, (OpStrategy([spec]), *rest), schema.kwargs_schema, schema_info=schema.schema_info)
        strategies += func(one).strategies
    return OpStrategy(strategies)


def _representative_schema(schema: OpSchema, mesh: DeviceMesh) -> OpSchema:
    marked = False

    def rep(a):
        nonlocal marked
        if isinstance(a, OpStrategy):
            spec = a.strategies[0].output_spec
            placements = [Replicate()] * mesh.ndim
            if not marked and spec.tensor_meta is not None and len(spec.tensor_meta.shape) > 0:
                placements[0] = Shard(0)
                marked = True
            return OpStrategy([OpSpec(DTensorSpec(mesh, tuple(placements), tensor_meta=spec.tensor_meta))])
        if isinstance(a, TupleStrategy):
            return TupleStrategy([rep(c) for c in a.children])
        return a

    return OpSchema(
        schema.op,
        tuple(rep(a) for a in schema.args_schema),
        {k: rep(v) for k, v in schema.kwargs_schema.items()},
        schema_info=schema.schema_info,
    )


def _decomp_strategy(node: torch.fx.Node, schema: OpSchema, mesh: DeviceMesh):
    from torch.distributed.tensor._decompositions import DecompShardingStrategy

    prop = propagator()
    op = node.target
    if not DecompShardingStrategy.has_decomp(op):
        return None
    decomp = decomposition_strategy(prop)
    if decomp is None:
        return None
    decomp.ensure_schema_info(op)

    # The decomposition path wants one concrete spec per input: give it the
    # first candidate (it enumerates placements itself).
    def first_spec(a):
        if isinstance(a, OpStrategy):
            return a.strategies[0].output_spec
        if isinstance(a, TupleStrategy):
            return [c.strategies[0].output_spec for c in a.children]
        return a

    spec_schema = OpSchema(
        op,
        tuple(first_spec(a) for a in schema.args_schema),
        {k: first_spec(v) for k, v in schema.kwargs_schema.items()},
        schema_info=prop.op_to_schema_info.get(op),
    )
    try:
        return decomp.propagate_strategy(spec_schema)
    except CODE_ERRORS:
        raise
    except Exception as e:  # noqa: BLE001 - any other failure means "no rule"
        logger.debug("decomposition strategy failed for %s: %s", op, e)
        return None


def dtensor_strategy_for(node, inputs, candidates, mesh: DeviceMesh):
    """DTensor's strategy for ``node`` given the candidate specs per input
    (None: no rule); raises whatever DTensor's strategy function raises."""
    cand_strategies: dict[torch.fx.Node, OpStrategy] = {}
    for n, c in zip(inputs, candidates):
        # A node used twice (mul(x, x)) has one strategy: the first wins.
        cand_strategies.setdefault(n, OpStrategy([OpSpec(s) for s in c]))
    schema = build_schema(node, cand_strategies)
    with without_dtensor_redistribute_costs():
        return dtensor_strategy(node, schema, mesh)
