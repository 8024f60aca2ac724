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
pytestmark = pytest.mark.slow


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
def by_ac():
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield {ac: _built(ac) for ac in ("none", "selective", "full")}
    finally:
        dist.destroy_process_group()


def test_full_ac_reruns_more_than_selective(by_ac):
    none, selective, full = (by_ac[ac][1] for ac in ("none", "selective", "full"))
    assert none == set()
    assert selective and selective < full
    # selective AC saves the attention output; full AC reruns it
    attention = {n for n in full if "attention" in n}
    assert attention - selective


def test_recomputed_ops_cost_twice(by_ac):
    plain = by_ac["none"][2]
    for ac in ("selective", "full"):
        _, recomputed, costs = by_ac[ac]
        for name, row in costs.items():
            if name not in plain or len(plain[name]) != len(row):
                continue  # AC changes some node names
            factor = 2.0 if name in recomputed else 1.0
            assert row == pytest.approx([factor * c for c in plain[name]]), name


def test_objective_grows_with_recomputation(by_ac):
    cheapest = {ac: sum(min(d.costs) for d in by_ac[ac][0].problem.decisions) for ac in by_ac}
    assert cheapest["none"] < cheapest["selective"] < cheapest["full"]
