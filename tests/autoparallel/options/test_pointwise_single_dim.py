"""The planner's single-mesh-dim pointwise rules (used where DTensor's
pointwise ops still have the whole-mesh rule) offer what DTensor's
single-dim pointwise rules offer."""

import pytest
import torch
import torch.fx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autoparallel.options import dtensor_query, pointwise
from autoparallel.options.strategies import dtensor_strategy_for
from autoparallel.torch_compat import pointwise_ops_are_single_dim

aten = torch.ops.aten

# (op, args: shapes for tensors, other values as they are)
CASES = [
    (aten.add.Tensor, [(8, 4, 6), (6,)]),
    (aten.sub.Tensor, [(8, 4, 6), (8, 4, 6)]),
    (aten.mul.Tensor, [(8, 4, 6), (8, 1, 6)]),
    (aten.mul.Tensor, [(8, 4, 6), ()]),
    (aten.div.Tensor, [(8, 4, 6), (8, 4, 1)]),
    (aten.mul.Scalar, [(8, 4), 0.5]),
    (aten.neg.default, [(8, 4)]),
    (aten.exp.default, [(8, 4)]),
    (aten.sigmoid.default, [(8, 4)]),
    (aten.silu.default, [(8, 4)]),
    (aten.rsqrt.default, [(8, 4)]),
    (aten.erfc.default, [(8, 4)]),
    (aten.maximum.default, [(8, 4), (8, 4)]),
    (aten.logaddexp.default, [(8, 4), (8, 4)]),
    (aten.pow.Tensor_Scalar, [(8, 4), 2]),
    (aten.where.self, [(8, 4), (8, 4), (8, 4)]),
]


def _meta(shape) -> TensorMeta:
    t = torch.empty(shape)
    return TensorMeta(t.shape, t.stride(), t.dtype)


def _metas(args):
    return tuple(_meta(a) if isinstance(a, tuple) else a for a in args)


@pytest.mark.skipif(
    not pointwise_ops_are_single_dim(DTensor._op_dispatcher.sharding_propagator),
    reason="this DTensor's pointwise ops have no single-dim rules to compare with",
)
@pytest.mark.parametrize("op,args", CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(CASES)])
def test_rules_match_dtensor_single_dim_rules(op, args):
    dtensor_rule = DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs[op]
    theirs = dtensor_rule(op, _metas(args), {})
    ours = pointwise.pointwise_single_dim_strategy(op, _metas(args), {})
    assert repr(ours) == repr(theirs)


def test_partial_rules_of_mul_add_div():
    assert [Partial("sum"), Replicate(), Partial("sum")] in pointwise.partial_rules(aten.mul.Tensor)
    assert [Partial("avg"), Replicate(), Partial("avg")] in pointwise.partial_rules(aten.add.Tensor)
    assert [Partial("sum"), Replicate(), Partial("sum")] not in pointwise.partial_rules(aten.div.Tensor)
    assert pointwise.partial_rules(aten.silu.default) == []


def _options(strategy) -> set:
    return {
        (tuple(s.output_spec.placements), tuple(tuple(i.placements) for i in s.input_specs))
        for s in strategy.strategies
    }


def test_forced_rules_give_dtensors_options(fake_world, monkeypatch):
    """With the planner's rule forced in place of DTensor's (whatever the
    running DTensor has), a 2-D mesh gets the options DTensor gives where its
    pointwise ops are single-dim, among them a Partial second operand of mul."""
    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    x.meta["val"], w.meta["val"] = torch.empty(8, 4, 6), torch.empty(8, 4, 6)
    node = graph.call_function(aten.mul.Tensor, (x, w))
    node.meta["val"] = torch.empty(8, 4, 6)
    candidates = [[DTensorSpec(mesh, (Replicate(), Replicate()), tensor_meta=_meta((8, 4, 6)))]] * 2

    prop = DTensor._op_dispatcher.sharding_propagator
    native = None
    if pointwise_ops_are_single_dim(prop):
        native = _options(dtensor_strategy_for(node, [x, w], candidates, mesh))
    monkeypatch.setattr(
        prop,
        "op_single_dim_strategy_funcs",
        {k: v for k, v in prop.op_single_dim_strategy_funcs.items() if k != node.target},
    )
    monkeypatch.setattr(pointwise, "pointwise_ops_are_single_dim", lambda propagator: False)
    monkeypatch.setattr(pointwise, "dtensor_pointwise_rule", lambda propagator, op: op)
    assert dtensor_query.single_dim_rule(node.target) is not None
    forced = _options(dtensor_strategy_for(node, [x, w], candidates, mesh))

    if native is not None:
        assert forced == native
    assert ((Replicate(), Partial("sum")), ((Replicate(), Replicate()), (Replicate(), Partial("sum")))) in forced
    assert ((Partial("avg"), Shard(2)), ((Partial("avg"), Shard(2)), (Replicate(), Shard(2)))) in forced
    # per mesh dim: R, S(0..2) on all three, and 4 Partial rows: 8 rows, 8 x 8 over two dims
    assert len(forced) == 64


def test_per_candidate_reduction_keeps_each_candidates_partial(fake_world):
    """``sum`` of a ``P(avg)`` candidate reduces the partial first; a later
    ``P(sum)`` candidate keeps its partial (one candidate's Partial does not
    change another's options)."""
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy

    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    meta = _meta((8, 4))
    candidates = OpStrategy(
        [
            OpSpec(DTensorSpec(mesh, placements, tensor_meta=meta))
            for placements in [(Partial("avg"), Shard(0)), (Partial("sum"), Shard(0))]
        ]
    )
    op = aten.sum.dim_IntList
    rule = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs[op]
    schema = OpSchema(op, (candidates, [1], False), {})
    options = [
        (tuple(s.input_specs[0].placements), tuple(s.output_spec.placements))
        for s in dtensor_query.per_candidate_reduction(rule, schema).strategies
    ]
    assert options == [
        ((Replicate(), Shard(0)), (Replicate(), Shard(0))),
        ((Partial("sum"), Shard(0)), (Partial("sum"), Shard(0))),
    ]
