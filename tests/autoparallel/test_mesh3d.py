"""Planning on 3-D meshes (issue 13): a tiny LLaMA-3 on 2x2x2 planned,
applied on 8 LocalTensorMode ranks and checked against the single-device
model; HSDP emerging from the inter-node bandwidth; exact option pruning
(objective equal to the unpruned solve); the problem-size guard."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.models import FFN, LLAMA3_CONFIGS, Transformer

from test_apply import LOCAL_TENSOR_PASSES, _train_and_compare  # same directory

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

ARGS = LLAMA3_CONFIGS["debug"]
BATCH, SEQ = 8, 16


def test_llama_debug_3d_plan_apply(fake_world):
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    with torch.device("meta"):
        model = Transformer(ARGS)
    with AutoParallel(model, mesh, torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")) as autop:
        batch = (Shard(0),) * 3
        autop.add_input_constraints([batch])
        autop.add_output_constraints([batch])
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan, pass_options=LOCAL_TENSOR_PASSES)
    assert plan.solution.status == "optimal"
    for name, p in parallel.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh is mesh and len(p.placements) == 3, name
    _train_and_compare("llama", parallel, mesh, steps=1)


def test_size_guard_refuses_before_building(fake_world, monkeypatch):
    """A problem over the limit stops with its size, the reason and what to
    change, before a single cost matrix is built."""
    from autoparallel import ProblemTooLarge
    from autoparallel import problem_builder

    def no_matrices(*args, **kwargs):
        raise AssertionError("a cost matrix was built")

    monkeypatch.setattr(problem_builder._EdgeMatrices, "redistribution", no_matrices)
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2))
    with torch.device("meta"):
        model = Transformer(ARGS)
    inputs = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    with AutoParallel(model, mesh, inputs, max_problem_bytes=2**20) as autop:
        unpruned = problem_builder.estimate_problem_size(autop.traced, autop.strategies)
        with pytest.raises(ProblemTooLarge) as err:
            autop.optimize_placement()
    msg, size = str(err.value), err.value.size
    # the estimate is of the pruned problem, still far over 1 MiB
    assert 2**20 < size.estimated_bytes < unpruned.estimated_bytes
    assert size.distinct_pairs <= size.pairs < unpruned.pairs
    assert f"{size.pairs:,} option pairs" in msg and "limit of 0.00 GiB" in msg
    assert "3-D mesh (2, 2, 2)" in msg and "fewer mesh dims" in msg and "max_problem_bytes" in msg
    # the largest matrices are named by their nodes
    n, producer, consumer = size.largest[0]
    assert f"{producer} x {consumer}: {n:,} pairs" in msg


def test_size_estimate_counts_the_built_pairs(fake_world):
    """The estimate counts exactly the option pairs the builder creates."""
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2))
    with torch.device("meta"):
        model = FFN(16, 64, bias=True)
    with AutoParallel(model, mesh, torch.empty(8, 16, 16, device="meta")) as autop:
        built = autop.build_problem()
    p = built.problem
    assert built.size.edges == len(p.edges)
    assert built.size.pairs == sum(len(e.costs) * len(e.costs[0]) for e in p.edges)
    assert built.size.options == sum(len(d.costs) for d in p.decisions)
