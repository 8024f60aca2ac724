"""Options and costs are computed once per distinct block and shared by
object across repeated layers; planning is deterministic; views that split a
sharded dim get real options (not replicate-only)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autoparallel.problem.recompute import recomputed_forward_nodes
from autoparallel import AutoParallel, cost_model
from autoparallel.models.llama3 import LLAMA3_CONFIGS, Transformer, apply_ac
from autoparallel.options.strategies import format_specs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _llama(n_layers: int) -> Transformer:
    config = LLAMA3_CONFIGS["debug"]
    config = type(config)(**{**config.__dict__, "n_layers": n_layers})
    with torch.device("meta"):
        model = Transformer(config)
    apply_ac(model, mode="selective")
    return model


def _plan_llama(n_layers: int, mesh):
    """Plan a debug LLaMA (2 kv heads, so unflattening heads on a 4-way mesh
    dim is impossible); returns (plan, autop) with the problem built."""
    model = _llama(n_layers)
    tokens = torch.randint(0, 256, (8, 64), device="meta")
    with AutoParallel(model, mesh, tokens) as autop:
        autop.add_input_constraints([(Shard(0), Replicate())])
        autop.add_output_constraints([(Shard(0), Replicate())])
        plan = autop.optimize_placement()
    return plan, autop


@pytest.fixture
def mesh_4x2(fake_world):
    fake_world(8)
    cost_model.clear_caches()
    return init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))


def test_repeated_layers_share_options_costs_and_matrices(mesh_4x2):
    plan, autop = _plan_llama(3, mesh_4x2)
    assert plan.solution.optimal
    strategies, groups = autop.strategies, autop.repeats.groups
    assert autop.repeats.mismatched == []
    # Layers 1 and 2 both read a layer's output (layer 0 reads the embedding,
    # whose options differ), so their nodes are computed alike.
    twin = dict(zip(groups[("layers", 2)], groups[("layers", 1)]))
    decisions = {d.name: d for d in autop.built.problem.decisions}
    recomputed = recomputed_forward_nodes(autop.traced.gm)
    for node, ref in twin.items():
        # The same objects, not equal copies: downstream caches key on them.
        assert strategies[node].options is strategies[ref].options, node.name
        assert decisions[node.name].options is decisions[ref.name].options
        if (node in recomputed) == (ref in recomputed):
            assert decisions[node.name].costs is decisions[ref.name].costs
        else:
            # the last block's output is recomputed (no later block saves
            # it, as the partitioner does): its compute counts twice
            assert node in recomputed and decisions[node.name].costs == [2 * c for c in decisions[ref.name].costs]
    # Every edge inside layer 2 has the very matrix of its twin in layer 1.
    matrix = {(e.producer, e.consumer, e.arg_index): e.costs for e in autop.built.problem.edges}
    shared = 0
    for (producer, consumer, arg), costs in matrix.items():
        p = next((n for n in twin if n.name == producer), None)
        c = next((n for n in twin if n.name == consumer), None)
        if p is not None and c is not None:
            assert costs is matrix[(twin[p].name, twin[c].name, arg)], (producer, consumer)
            shared += 1
    assert shared > 100
    # Strided shards are dropped, except the tp-outer layout of parameters
    # (offered by the parameter only: no op takes or produces it).
    params = set(autop.traced.param_nodes.values())
    for strat in strategies.values():
        for o in strat.options:
            if strat.node in params:
                assert "_S(" not in o.label or cost_model.is_tp_outer(o.output_spec.placements, (4, 2)), o.label
            else:
                assert "_S(" not in o.label, (strat.node.name, o.label)


def test_work_does_not_grow_with_layers(mesh_4x2):
    """Option lists and cost matrices are computed per distinct block, and
    the linked problem presolves to the same size for 2 and 4 layers."""
    counts, presolved = [], []
    for n_layers in (2, 4):
        cost_model.clear_caches()
        plan, autop = _plan_llama(n_layers, mesh_4x2)
        problem = autop.built.problem
        counts.append(
            (
                autop.strategy_stats.computed,
                len({id(e.costs) for e in problem.edges}),
                len({id(d.costs) for d in problem.decisions}),
            )
        )
        presolved.append(plan.solution.presolve.decisions_after)
        # Autograd's gradient-accumulation adds (no module path) join their
        # layer, so every layer has the same nodes and all are linked.
        sizes = {len(nodes) for nodes in autop.repeats.groups.values()}
        assert len(sizes) == 1
        assert len(autop.repeats.reference) == (n_layers - 1) * sizes.pop()
    assert counts[0] == counts[1]
    # Presolve may fold one decision more or less at the stack's ends; before
    # the accumulation adds were linked it grew by ~11 per layer.
    assert abs(presolved[1] - presolved[0]) <= 2, presolved


class _HeadSplit(nn.Module):
    """A projection to 2 heads of 16, as LLaMA's k/v: the view unflattens
    the feature dim, which a 4-way shard of that dim cannot go through."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        return self.proj(x).view(b, s, 2, 16).sum(dim=3)


def test_view_splitting_sharded_dim_gets_options(mesh_4x2, caplog):
    x = torch.empty(8, 16, 64, device="meta")
    with AutoParallel(_HeadSplit(), mesh_4x2, x) as autop:
        strategies = autop.strategies
        assert autop.strategy_stats.fallback_ops == {}
    views = [n for n in strategies if n.target is torch.ops.aten.view.default and n.args[1] == [8, 16, 2, 16]]
    assert views
    for node in views:
        strat = strategies[node]
        assert strat.source == "dtensor"
        labels = {o.label for o in strat.options}
        # Heads split over the 2-way mesh dim, batch over the 4-way one.
        assert "S(0)S(2)->S(0)S(2)" in labels, labels
        # 2 heads cannot be split 4 ways: that input layout has no option.
        assert not any(format_specs(o.input_specs[0]).startswith("S(2)") for o in strat.options)
    assert "no sharding rule" not in caplog.text


def _plan_json(plan) -> str:
    data = plan.to_json()
    data.pop("timings", None)
    data["solver"].pop("timings", None)
    return json.dumps(data, sort_keys=True, default=str)


def test_plan_identical_across_runs(mesh_4x2):
    dumps = []
    for _ in range(2):
        cost_model.clear_caches()
        plan, _ = _plan_llama(2, mesh_4x2)
        dumps.append(_plan_json(plan))
    assert dumps[0] == dumps[1]


_SUBPROCESS_PLAN = """
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
sys.path.insert(0, {tests!r})
from test_strategies_sharing import _plan_llama, _plan_json
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
plan, _ = _plan_llama(2, mesh)
print(_plan_json(plan))
"""


@pytest.mark.slow
def test_plan_identical_across_processes_and_hash_seeds():
    outs = []
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        code = _SUBPROCESS_PLAN.format(tests=os.path.dirname(os.path.abspath(__file__)))
        res = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
        )
        outs.append(res.stdout.strip().splitlines()[-1])
    assert outs[0] == outs[1]
