"""Recomputation under activation checkpointing is priced in the objective:
the backward reruns the forward ops tagged for recomputation that it reads,
so their compute counts twice; full AC reruns more of the forward than
selective AC, and no AC reruns nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoparallel import AutoParallel
from autoparallel.models import LLAMA3_CONFIGS, Transformer
from autoparallel.models.llama3 import apply_ac
from autoparallel.problem.recompute import recomputed_forward_nodes


# three traces of a one-layer model: ~35 s
traced = pytest.mark.slow


def _built(ac: str):
    config = dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=1)
    with torch.device("meta"):
        model = Transformer(config)
    if ac != "none":
        apply_ac(model, mode=ac)
    mesh = init_device_mesh("cpu", (2, 2))
    with AutoParallel(model, mesh, torch.empty(8, 64, dtype=torch.long, device="meta")) as autop:
        built = autop.build_problem()
        recomputed = {n.name for n in recomputed_forward_nodes(autop.traced.gm)}
        base = {d.name: list(d.costs) for d in built.problem.decisions}
    return built, recomputed, base


@pytest.fixture(scope="module")
def by_ac():  # the tests that use it are marked slow
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield {ac: _built(ac) for ac in ("none", "selective", "full")}
    finally:
        dist.destroy_process_group()


@traced
def test_full_ac_reruns_more_than_selective(by_ac):
    none, selective, full = (by_ac[ac][1] for ac in ("none", "selective", "full"))
    assert none == set()
    assert selective and selective < full
    # selective AC saves the attention output; full AC reruns it
    attention = {n for n in full if "attention" in n}
    assert attention - selective


@traced
def test_recomputed_ops_cost_twice(by_ac):
    plain = by_ac["none"][2]
    for ac in ("selective", "full"):
        _, recomputed, costs = by_ac[ac]
        for name, row in costs.items():
            if name not in plain or len(plain[name]) != len(row):
                continue  # AC changes some node names
            factor = 2.0 if name in recomputed else 1.0
            assert row == pytest.approx([factor * c for c in plain[name]]), name


@traced
def test_objective_grows_with_recomputation(by_ac):
    cheapest = {ac: sum(min(d.costs) for d in by_ac[ac][0].problem.decisions) for ac in by_ac}
    assert cheapest["none"] < cheapest["selective"] < cheapest["full"]


def _tagged_chain() -> torch.fx.GraphModule:
    """x -> a (region 0) -> b (region 0) -> c (region 1) -> backward reads c
    and b: the partitioner saves b, the boundary read by a later region."""
    from torch.utils.checkpoint import CheckpointPolicy

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.ops.aten.mm.default, (x, x))
    b = graph.call_function(torch.ops.aten.add.Tensor, (a, a))
    c = graph.call_function(torch.ops.aten.mm.default, (b, b))
    grad = graph.call_function(torch.ops.aten.mul.Tensor, (c, b))
    graph.output((grad,))
    for node, region in ((a, 0), (b, 0), (c, 1)):
        node.meta.update(recompute=CheckpointPolicy.PREFER_RECOMPUTE, ac_graph_id=region)
        node.meta["partitioner_tag"] = "is_forward"
    grad.meta["partitioner_tag"] = "is_backward"
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_region_boundary_runs_once():
    gm = _tagged_chain()
    a, b, c = (n for n in gm.graph.nodes if n.op == "call_function" and "recompute" in n.meta)
    # b feeds region 1's c: saved, so neither b nor a (read only through b) reruns
    assert recomputed_forward_nodes(gm) == {c}
