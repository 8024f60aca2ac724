"""A saved matmul output laid out Partial that the backward reads only
through ops it recomputes, each taking it through a reduce-scatter the AC
policy saves: the partitioned forward keeps the reduce-scattered tensor, not
the Partial one, and the memory model counts that (LLaMA-3 8B at 131072
tokens on dp 4 x 8 x tp 4: each layer's query projection, Partial over tp,
134 MB per rank counted where 34 MB is saved;
autoparallel/problem/memory_peaks.py, reduce_scattered_saves)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.distributed.device_mesh import init_device_mesh

from autoparallel import AutoParallel
from autoparallel.capture.saved_activations import saved_and_needed
from autoparallel.models import LLAMA3_CONFIGS, Transformer, apply_ac
from autoparallel.problem.builder import forward_param_chain
from autoparallel.problem.memory_budget import StepMemoryModel, budget_constraint, step_memory_model
from autoparallel.problem.memory_peaks import reduce_scattered_factor

MESH = [4, 8, 4]


def test_the_kept_copy_is_sharded_as_after_the_reduce_scatter():
    assert reduce_scattered_factor("S(0)S(1)P", ["S(0)S(2)S(2)"], MESH) == 128
    assert reduce_scattered_factor("S(0)S(1)P", ["S(0)S(2)P"], MESH) is None  # nothing reduced
    assert reduce_scattered_factor("S(0)S(1)P", ["S(0)S(2)R"], MESH) is None  # an all-reduce
    assert reduce_scattered_factor("S(0)S(1)P", ["S(0)RS(2)"], MESH) is None  # an all-gather too
    assert reduce_scattered_factor("S(0)S(1)P", ["S(0)S(2)S(2)", "S(0)S(1)S(1)"], MESH) is None  # readers differ
    assert reduce_scattered_factor("S(0)RP", ["S(0)S(1)S(1)"], MESH) == 16  # the slice over dim 1 not counted


def _model() -> StepMemoryModel:
    # a query projection's output (1 GiB replicated), read through a view
    # by the rotary embedding's first op; the reduce-scatter over tp on
    # either edge (table "0": matmul -> view, "1": view -> its reader)
    table = {"S(0)S(1)P|S(0)S(2)S(2)": 128, "S(0)S(1)P|S(0)S(1)S(2)": 128}
    edges = [["mm", "view:in:0", "0"], ["view", "rope:in:0", "1"]]
    return StepMemoryModel(
        {"mm": {"activations": 2.0**30}},
        reduce_scattered={"mm": [edges]},
        reduce_scatter_tables={"0": table, "1": table},
    )


def _node(out: str, ins: tuple[str, ...] = ()):
    return SimpleNamespace(output_placements=out, input_placements=list(ins))


def test_the_estimate_counts_the_reduce_scattered_copy_and_the_row_the_partial_one():
    model = _model()
    partial, reduced = "S(0)S(1)P", "S(0)S(2)S(2)"
    # reduced between the view and its reader
    nodes = {"mm": _node(partial), "view": _node(partial, (partial,)), "rope": _node(reduced, (reduced,))}
    assert model.estimate(nodes, MESH)["activations"] == 2.0**30 / 128
    assert model.estimate(nodes, MESH, row=True)["activations"] == 2.0**30 / 32  # Partial: 4 x 8 ways
    # reduced between the matmul and the view
    nodes["view"] = _node("S(0)S(1)S(2)", ("S(0)S(1)S(2)",))
    nodes["rope"] = _node(reduced, ("S(0)S(1)S(2)",))
    assert model.estimate(nodes, MESH)["activations"] == 2.0**30 / 128
    # all-reduced (not in the table): kept as produced
    nodes["view"] = _node(partial, (partial,))
    nodes["rope"] = _node("S(0)S(2)R", ("S(0)S(2)R",))
    assert model.estimate(nodes, MESH)["activations"] == 2.0**30 / 32
    # two edges move it: kept as produced
    nodes["view"] = _node(partial, ("S(0)S(1)S(2)",))
    nodes["rope"] = _node(reduced, (reduced,))
    assert model.estimate(nodes, MESH)["activations"] == 2.0**30 / 32
    # the model survives its JSON form (the plan's constraint log)
    assert StepMemoryModel.from_json(model.to_json()) == model


def test_the_traced_llama_finds_its_candidates_and_the_row_bounds_them(fake_world):
    """Tiny LLaMA-3 under selective AC on a fake 2 x 2 mesh: each layer's
    matmuls with a Partial option that the backward reads only through
    recomputed ops are candidates; at every plan the estimate is at most
    the row, and the budget's exact peak evaluates them without error."""
    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Transformer(LLAMA3_CONFIGS["debug"])
    apply_ac(model, "selective")
    with AutoParallel(model, mesh, torch.empty(4, 64, dtype=torch.long, device="meta")) as autop:
        plan = autop.optimize_placement()
        mem = step_memory_model(autop.traced, autop.strategies)
        _, remade = saved_and_needed(autop.traced.gm, forward_param_chain(autop.traced))
        by_name = {n.name: n for n in autop.traced.gm.graph.nodes}
        row = budget_constraint(mem, autop.strategies, [2, 2], 80e9)
        choice = plan.solution.choice
    assert mem.reduce_scattered, "no candidate in a selective-AC LLaMA"
    # a reduced copy is charged only for a reader the backward recomputes:
    # the block's last residual add is saved, and keeps nothing of its input
    assert mem.reduced_inputs
    assert all(by_name[mem.site(key)[0]] in remade for key in mem.reduced_inputs)
    for key, readers in mem.reduce_scattered.items():
        assert "activations" in mem.terms[key]
        for edges in readers:
            assert any(mem.reduce_scatter_tables[tid] for _, _, tid in edges)
    assert all(f in (2, 4) for table in mem.reduce_scatter_tables.values() for f in table.values())
    est = mem.estimate(plan.nodes, plan.mesh_shape)
    assert est["activations"] <= mem.estimate(plan.nodes, plan.mesh_shape, row=True)["activations"]
    assert row.exact(choice) <= sum(w[choice[n]] for n, w in row.terms.items()) * (1 + 1e-9)
