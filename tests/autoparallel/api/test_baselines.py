"""Hand layouts (autoparallel.baselines) are pinned through the planner's
own constraints and estimated like the plan; the plan's table shows them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoparallel import AutoParallel, baselines
from autoparallel.models import LLAMA3_CONFIGS, Transformer
from autoparallel.plan import Plan

SHAPES = {
    "tok_embeddings.weight": (256, 64),
    "layers.0.attention.wq.weight": (64, 64),
    "layers.0.attention.wo.weight": (64, 64),
    "layers.0.attention_norm.weight": (64,),
    "layers.0.moe.w1": (8, 64, 32),
    "output.weight": (256, 64),
}


def _layouts(names):
    return {h.name: {f: h.layout(f, s) for f, s in SHAPES.items()} for h in baselines.hand_layouts(names, SHAPES)}


def test_layouts_on_dp_tp():
    got = _layouts(("dp", "tp"))
    assert set(got) == {"DDP", "FSDP", "FSDP x TP + SP", "FSDP x EP"}
    assert got["DDP"]["layers.0.attention.wq.weight"] == (None, None)
    assert got["FSDP"]["layers.0.attention.wo.weight"] == (0, 0)
    tp = got["FSDP x TP + SP"]
    assert tp["layers.0.attention.wq.weight"] == (0, 0)  # column parallel: output dim over tp
    assert tp["layers.0.attention.wo.weight"] == (0, 1)  # row parallel: input dim over tp
    assert tp["layers.0.attention_norm.weight"] == (0, None)  # norms replicated over tp
    assert tp["tok_embeddings.weight"] == (0, 0)  # vocabulary over tp
    # experts over the last dim when none is named ep, their next dim FSDP
    assert got["FSDP x EP"]["layers.0.moe.w1"] == (1, 0)


def test_layouts_on_hsdp_mesh():
    got = _layouts(("dp_replicate", "dp_shard", "tp"))
    assert "HSDP x TP + SP" in got
    hsdp = got["HSDP x TP + SP"]
    assert hsdp["layers.0.attention.wq.weight"] == (None, 0, 0)
    assert hsdp["layers.0.attention_norm.weight"] == (None, 0, None)
    assert got["FSDP x EP"]["layers.0.moe.w1"] == (1, 1, 0)
    ep = _layouts(("dp", "ep"))["FSDP x EP"]
    assert ep["layers.0.moe.w1"] == (1, 0) and ep["output.weight"] == (0, 0)
    assert "FSDP x TP + SP" not in _layouts(("dp", "ep"))


@pytest.fixture(scope="module")
def tiny_llama_plan():
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        config = dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=1)
        with torch.device("meta"):
            model = Transformer(config)
        data = [(Shard(0), Replicate())]
        with AutoParallel(model, mesh, torch.empty(8, 64, dtype=torch.long, device="meta")) as autop:
            autop.add_input_constraints(data)
            autop.add_output_constraints(data)
            # the search space of the baselines: parameters may replicate
            autop.add_parameter_memory_constraint(high=1.0)
            plan = autop.optimize_placement()
            results = baselines.compare(autop, plan, apply=False)
            pins_after = dict(autop._constraints.pins)
        yield plan, results, pins_after
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # one trace and four solves: ~45 s
def test_baselines_pinned_and_no_better_than_the_plan(tiny_llama_plan):
    plan, results, pins_after = tiny_llama_plan
    by_name = {r.name: r for r in results}
    assert set(by_name) == {"DDP", "FSDP", "FSDP x TP + SP"}
    for r in results:
        assert r.pinned > 0 and r.solver_s is not None and r.memory_bytes > 0, r
    # under the same constraints the plan is optimal over a superset of
    # every baseline: none costs less in the solver's figure
    for r in results:
        assert plan.compute_cost + plan.comm_cost <= r.solver_s * (1 + 1e-6), r.name
        assert r.note == "", r
    # DDP holds every parameter whole: more memory per rank
    assert by_name["DDP"].memory_bytes > by_name["FSDP"].memory_bytes
    # the baselines' pins did not stay on the planner
    assert not any(name.startswith("node constraint") for name, _ in pins_after.values())


@pytest.mark.slow
def test_table_in_summary_and_json(tiny_llama_plan):
    plan = tiny_llama_plan[0]
    text = plan.summary(legend=False)
    assert "hand layouts under the same estimate (solver)" in text
    assert "vs FSDP x TP + SP" in text
    from autoparallel.report.html import render

    assert "vs FSDP x TP + SP" in render(plan)
    again = Plan.from_json(plan.to_json())
    assert [r["name"] for r in again.baselines] == [r["name"] for r in plan.baselines]
    assert baselines.table_lines(again) == baselines.table_lines(plan)
