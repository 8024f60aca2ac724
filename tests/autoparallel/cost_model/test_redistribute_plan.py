"""Min-cost redistribution plans (autoparallel/cost_model/redistribute_plan.py)
are never dearer than DTensor's greedy plan, strictly cheaper where the greedy
plan un-shards inner mesh dims first, legal step by step, and what the scalar,
per-pair and grid costs all read."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autoparallel.cost_model import class_costs
from autoparallel import cost_model
from autoparallel.cost_model import comm, redistribute_plan
from autoparallel.cost_model.devices import H100
from autoparallel.cost_model.steps import step_kinds
from test_class_costs import _mesh, _world  # noqa: F401 (_world: the fake world of 1024 ranks, autouse)


def _spec(mesh, placements, shape, dtype=torch.float32):
    t = torch.empty(shape, dtype=dtype, device="meta")
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))


def _greedy_time(src, dst, device=H100) -> float:
    return sum(step[-1] for step in comm.dtensor_plan_steps(src, dst, device))


def test_llama70b_activation_example():
    """A 70B activation, S(2) on all four dims to S(0)S(0)S(1)S(1): greedy
    12.3 ms (all-gathers and all-to-alls at up to 256 MiB, with the copies
    around them), min-cost six all-to-alls at the local size."""
    mesh = _mesh((4, 4, 8, 8))
    shape = (32, 8192, 8192)
    src = _spec(mesh, [Shard(2)] * 4, shape)
    dst = _spec(mesh, [Shard(0), Shard(0), Shard(1), Shard(1)], shape)
    greedy = _greedy_time(src, dst)
    assert greedy == pytest.approx(12.3e-3, rel=0.01)
    steps = cost_model.redistribute_steps(src, dst)
    local = 32 * 8192 * 8192 * 4 // 1024
    assert [s.kind.replace("pre_copy+", "").replace("+local_copy", "") for s in steps] == ["all_to_all"] * 6
    assert all(s.bytes_per_rank == local for s in steps)
    total = cost_model.redistribute_time(src, dst)
    assert total == sum(s.time for s in steps)
    assert total < greedy / 10


def _legal_path(mesh_shape, src, steps, shape):
    """Replay steps with shard orders (outer first): gathers and all-to-alls
    only from a tensor dim's innermost mesh dim, new shards innermost, even
    splits only. Returns the final order per tensor dim."""
    order = {d: [m for m, p in enumerate(src) if isinstance(p, Shard) and p.dim == d] for d in range(len(shape))}
    cur = list(src)
    for m, a, b in steps:
        assert cur[m] == a
        if isinstance(a, Shard):
            assert order[a.dim][-1] == m, f"mesh dim {m} is not the innermost shard of dim {a.dim}: {order}"
            order[a.dim].pop()
        if isinstance(b, Shard):
            order[b.dim].append(m)
            assert shape[b.dim] % math.prod(mesh_shape[k] for k in order[b.dim]) == 0
        if b.is_partial():
            assert a.is_replicate()
        cur[m] = b
    return cur, order


@pytest.mark.parametrize("mesh_shape,shape", [((2, 2, 2), (8, 4, 6)), ((4, 2, 2, 2), (16, 8, 4)), ((16, 8), (256, 64))])
def test_min_cost_never_dearer_and_legal(mesh_shape, shape):
    mesh = _mesh(mesh_shape)
    atoms = [Replicate(), Partial(), Partial("avg")] + [Shard(d) for d in range(len(shape))]
    combos = list(itertools.product(atoms, repeat=len(mesh_shape)))
    rng = random.Random(0)
    specs = [_spec(mesh, c, shape) for c in rng.sample(combos, min(60, len(combos)))]
    cheaper = 0
    for s in specs:
        for d in specs:
            greedy = _greedy_time(s, d)
            t = cost_model.redistribute_time(s, d)
            assert t <= greedy or (math.isinf(t) and math.isinf(greedy))
            steps = cost_model.redistribute_steps(s, d)
            assert t == sum(x.time for x in steps)
            if t < greedy:
                cheaper += 1
                final, order = _legal_path(mesh_shape, s.placements, [(x.mesh_dim, x.src, x.dst) for x in steps], shape)
                assert tuple(final) == d.placements
                assert all(o == sorted(o) for o in order.values()), "must end in default shard order"
    assert cheaper > 0


def test_per_pair_and_grid_paths_read_the_min_cost_plan():
    mesh = _mesh((4, 4, 8, 8))
    shape = (32, 8192, 1024)
    atoms = [Replicate(), Partial()] + [Shard(d) for d in range(3)]
    rng = random.Random(1)
    combos = rng.sample(list(itertools.product(atoms, repeat=4)), 80)
    specs = [_spec(mesh, c, shape) for c in combos]
    slow = np.array([[cost_model.redistribute_time(s, d) for d in specs] for s in specs])
    greedy = np.array([[_greedy_time(s, d) for d in specs] for s in specs])
    assert (slow < greedy).sum() > 100  # the min-cost plan is used a lot on 4-D meshes
    assert np.array_equal(class_costs.redistribution_grid(specs, specs, H100), slow)
    cost_model.clear_caches()
    assert np.array_equal(class_costs.redistribution_grid(specs, specs, H100), slow)


def test_uneven_and_masked_keep_todays_plan():
    mesh = _mesh((2, 2, 2))
    shape = (6, 4, 4)  # dim 0 splits in 2, not in 4
    src = _spec(mesh, [Shard(0), Shard(0), Replicate()], shape)
    assert redistribute_plan.min_cost_total(src, _spec(mesh, [Replicate()] * 3, shape), H100) is None
    # Shard -> Partial stays forbidden
    s = _spec(mesh, [Shard(1), Replicate(), Replicate()], (8, 8, 8))
    d = _spec(mesh, [Partial(), Replicate(), Replicate()], (8, 8, 8))
    assert redistribute_plan.min_cost_total(s, d, H100) is None
    assert cost_model.redistribute_time(s, d) == math.inf


def test_source_batches_do_not_change_distances(monkeypatch):
    """A source's distances are the same alone or batched with others (what
    makes scalar and grid figures bit-identical)."""
    mesh = _mesh((2, 2, 2, 2))
    graph = redistribute_plan.state_graph(mesh, (8, 8, 4), 2, H100)
    sources = graph.default_states[::7].tolist()
    batched = graph.distances(sources)
    graph.rows.clear()
    monkeypatch.setattr(redistribute_plan, "BATCH", 1)
    alone = graph.distances(sources)
    assert np.array_equal(batched, alone)


def test_greedy_plan_is_a_path_of_the_graph():
    """Why the min-cost plan is never dearer: every step of DTensor's greedy
    plan is an edge of the state graph (gathers and all-to-alls from the
    innermost shard only, new shards innermost), ending in default order."""
    mesh_shape = (2, 2, 2)
    shape = (16, 16, 16)  # every layout even
    atoms = [Replicate(), Partial()] + [Shard(d) for d in range(3)]
    combos = list(itertools.product(atoms, repeat=3))
    checked = 0
    for src in combos:
        for dst in combos:
            steps = comm.greedy_steps(mesh_shape, src, dst)
            if any(step_kinds(a, b) == ("forbidden",) for _, a, b in steps):
                continue
            final, order = _legal_path(mesh_shape, src, steps, shape)
            assert tuple(final) == dst
            assert all(o == sorted(o) for o in order.values())
            checked += 1
    assert checked > 10000


def test_scalar_tensor():
    """A 0-d tensor (a loss) has Replicate and Partial states only."""
    mesh = _mesh((2, 2, 2))
    src, dst = _spec(mesh, [Partial()] * 3, ()), _spec(mesh, [Replicate()] * 3, ())
    assert cost_model.redistribute_time(src, dst) <= _greedy_time(src, dst)
    assert class_costs.redistribution_grid([src], [dst, src], H100).tolist() == [
        [cost_model.redistribute_time(src, dst), 0.0]
    ]
