"""remove_alias_round_trips on hand-built joint graphs and plan choices."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.fx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from autoparallel.passes import PassContext
from autoparallel.passes.alias_round_trips import remove_alias_round_trips
from autoparallel.plan import NodePlan
from autoparallel.options.strategies import NodeStrategy, Option

aten = torch.ops.aten
S0S1 = (Shard(0), Shard(1))
S0R = (Shard(0), Replicate())
RR = (Replicate(), Replicate())


@pytest.fixture
def mesh(fake_world):
    fake_world(4)
    return init_device_mesh("cpu", (2, 2))


def _spec(mesh, placements):
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size([4, 4]), (4, 1), torch.float32))


def _ctx(mesh, producer_out, alias_out, consumers):
    """x -> alias -> consumers; ``consumers``: name -> (op, n_alias_args, wanted placements per arg)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.alias.default, (x,))
    nodes = {"x": x, "alias": a}
    for name, (op, n_args, _) in consumers.items():
        nodes[name] = g.call_function(op, (a,) * n_args)
        nodes[name].name = name
    g.output(tuple(nodes[n] for n in consumers))
    a.name = "alias"
    strategies = {
        x: NodeStrategy(x, [], [Option(_spec(mesh, producer_out), ())], source="placeholder"),
        a: NodeStrategy(a, [x], [Option(_spec(mesh, alias_out), (_spec(mesh, producer_out),))]),
    }
    plan_nodes = {}
    for name, (op, n_args, wants) in consumers.items():
        node = nodes[name]
        specs = tuple(_spec(mesh, w) for w in wants)
        strategies[node] = NodeStrategy(node, [a] * n_args, [Option(specs[0], specs)])
        incoming = [("alias", "x", 1.0)] if producer_out != alias_out and wants[0] == producer_out else []
        plan_nodes[name] = NodePlan(
            name, str(op), None, "forward", [4, 4], "f32", [], "", 1, 0.0, 1.0, 0.0, incoming=incoming
        )
    for name in ("x", "alias"):
        plan_nodes[name] = NodePlan(name, "", None, "forward", [4, 4], "f32", [], "", 1, 0.0, 0.0, 0.0)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    ctx = PassContext(
        mesh=mesh,
        plan=SimpleNamespace(nodes=plan_nodes),
        traced=SimpleNamespace(gm=gm),
        strategies=strategies,
        choice={n.name: 0 for n in g.nodes if n.op != "output"},
    )
    return ctx, nodes


@pytest.mark.smoke
def test_rewires_consumers_wanting_the_producer_layout(mesh):
    ctx, nodes = _ctx(
        mesh,
        S0S1,
        S0R,
        {
            "back": (aten.neg.default, 1, (S0S1,)),  # S0S1 -> alias S0R -> back to S0S1
            "keeps": (aten.relu.default, 1, (S0R,)),  # genuinely wants the alias's layout
            "twice": (aten.add.Tensor, 2, (S0S1, S0S1)),  # x + x-style
        },
    )
    stats = remove_alias_round_trips(ctx)
    assert (stats.aliases, stats.round_trips, stats.rewired, stats.aliases_erased) == (1, 1, 2, [])
    x, a = nodes["x"], nodes["alias"]
    assert nodes["back"].args == (x,) and nodes["twice"].args == (x, x) and nodes["keeps"].args == (a,)
    assert ctx.strategies[nodes["back"]].inputs == [x] and ctx.strategies[nodes["twice"]].inputs == [x, x]
    assert ctx.strategies[nodes["keeps"]].inputs == [a]
    # the option stays valid: the wanted input spec is the producer's output spec
    back_opt = ctx.strategies[nodes["back"]].options[0]
    assert back_opt.input_specs[0].placements == ctx.strategies[x].options[0].output_specs.placements
    assert ctx.plan.nodes["back"].incoming == [] and ctx.plan.nodes["back"].comm_cost == 0.0
    assert "alias" in ctx.choice and "alias" in ctx.plan.nodes


def test_erases_alias_without_users(mesh):
    ctx, nodes = _ctx(mesh, S0S1, S0R, {"back": (aten.neg.default, 1, (S0S1,))})
    stats = remove_alias_round_trips(ctx)
    assert stats.aliases_erased == ["alias"] and stats.rewired == 1
    gm = ctx.traced.gm
    assert not gm.graph.find_nodes(op="call_function", target=aten.alias.default)
    assert "alias" not in ctx.choice and "alias" not in ctx.plan.nodes
    gm.graph.lint()
    assert torch.equal(gm(torch.ones(4, 4))[0], -torch.ones(4, 4))


@pytest.mark.parametrize(
    "producer, alias, consumers",
    [
        # same layout: no round-trip
        (S0S1, S0S1, {"c": (aten.neg.default, 1, (S0S1,))}),
        # consumer wants a third layout: the alias is on the way
        (S0S1, S0R, {"c": (aten.neg.default, 1, (RR,))}),
        # one slot wants the producer's layout, the other the alias's
        (S0S1, S0R, {"c": (aten.add.Tensor, 2, (S0S1, S0R))}),
    ],
)
def test_leaves_other_aliases_alone(mesh, producer, alias, consumers):
    ctx, nodes = _ctx(mesh, producer, alias, consumers)
    stats = remove_alias_round_trips(ctx)
    assert stats.rewired == 0 and not stats.aliases_erased
    assert all(a is nodes["alias"] for a in nodes["c"].args)
