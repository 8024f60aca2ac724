"""The problem build's shared work gives what the per-option /
per-layer work gave. Compute costs asked once per distinct local shapes
equal the cost model's per option; a repeated layer's link mappings shared
across layers equal the per-layer mapping; the coarse seeds' option index
finds what a scan by placements finds (tiny LLaMA-3, 2 layers, 2x2x2)."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.placement_types import Replicate, Shard

from autoparallel import AutoParallel, cost_model
from autoparallel.problem import builder as problem_builder
from autoparallel.problem.coarse_seed import _OptionIndex
from autoparallel.problem.param_budget import option_mapping
from autoparallel.problem.recompute import recomputed_forward_nodes
from autoparallel.options.placements import placements_of


def _planned(fake_world):
    from autoparallel.models import LLAMA3_CONFIGS, Transformer, apply_ac

    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    config = dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=2)
    with torch.device("meta"):
        model = Transformer(config)
    apply_ac(model, mode="selective")
    example = torch.empty(8, 16, dtype=torch.long, device="meta")
    with AutoParallel(model, mesh, example, option_pricing=False) as autop:
        autop.add_input_constraints([(Shard(0), Shard(0), Replicate())])
        built = autop.build_problem()
    return autop, built, mesh


def test_shared_build_work_equals_the_per_option_work(fake_world):
    # one build (tracing takes most of the time) for the three checks
    planned = _planned(fake_world)
    _check_compute_costs(planned)
    _check_links(planned)
    _check_coarse_option_index(planned)


def _check_compute_costs(planned):
    """Compute costs asked once per distinct local shapes equal the cost
    model's per option (and the built problem's)."""
    autop, built, mesh = planned
    shapes = problem_builder._LocalShapeCodes()
    # the backward reruns these under activation checkpointing: priced twice
    recomputed = recomputed_forward_nodes(autop.traced.gm)
    assert recomputed
    checked = deduplicated = 0
    seen: set[int] = set()
    for node, strat in built.strategies.items():
        if node.op != "call_function" or strat.getitem_index is not None or id(strat.options) in seen:
            continue
        seen.add(id(strat.options))
        costs = problem_builder._compute_costs(node, strat.options, shapes, mesh, autop.device)
        expected = [
            cost_model.node_compute_time(node, o.input_specs, o.output_specs, autop.device)
            + problem_builder._in_op_time(o.in_op, mesh, autop.device)
            for o in strat.options
        ]
        assert costs == expected, node.name
        factor = 2 if node in recomputed else 1
        assert built.compute[node.name] == [factor * c for c in expected], node.name
        checked += len(costs)
        deduplicated += len(costs) - len(set(costs))
    assert checked > 1000 and deduplicated > 0


def _check_links(planned):
    """Link mappings shared across layers map each option to the repeat's
    option with its placements."""
    autop, built, _ = planned
    by_name = {n.name: s for n, s in built.strategies.items()}
    links = built.problem.links
    assert links, "the two layers are linked"
    for link in links:
        ref, other = by_name[link.a].options, by_name[link.b].options
        assert link.mapping == option_mapping(ref, other)
        for i, j in enumerate(link.mapping):
            if j is not None:
                assert placements_of(other[j].output_specs) == placements_of(ref[i].output_specs)


def _check_coarse_option_index(planned):
    """The coarse seeds' index finds the first option with the placements
    asked for, and none for placements no option has."""
    _, built, _ = planned
    index = _OptionIndex()
    for node, strat in list(built.strategies.items())[:200]:
        opts = strat.options
        for o in opts[:: max(1, len(opts) // 25)]:
            out, ins = placements_of(o.output_specs), tuple(placements_of(s) for s in o.input_specs)
            first = next(
                k
                for k, p in enumerate(opts)
                if placements_of(p.output_specs) == out and tuple(placements_of(s) for s in p.input_specs) == ins
            )
            assert index.find(opts, out, ins) == first, node.name
    # placements no option of the list has
    strat = next(s for s in built.strategies.values() if s.options and s.options[0].input_specs)
    o = strat.options[0]
    bogus = tuple(Shard(7) for _ in placements_of(o.output_specs))
    assert index.find(strat.options, bogus, tuple(placements_of(s) for s in o.input_specs)) is None
