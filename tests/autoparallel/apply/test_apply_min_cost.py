"""Apply's redistribute() runs the min-cost plan the cost model
priced (intermediate non-default shard orders included), rank-generic, and
gets DTensor's own local shards on every rank of 2x2x2 and 2x2x2x2 meshes
(LocalTensorMode)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autoparallel import cost_model
from autoparallel.apply.local_graph import local_shape
from autoparallel.apply.redistribute import redistribute
from autoparallel.cost_model import comm
from autoparallel.cost_model.devices import H100

pytestmark = [pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning")]

R, P = Replicate(), Partial()


def _coords(lm, mesh):
    return lm.rank_map(lambda r: (mesh.mesh == r).nonzero()[0].to(torch.int64))


def _even(spec) -> bool:
    shape = list(spec.tensor_meta.shape)
    for mesh_dim, p in enumerate(spec.placements):
        if p.is_shard():
            if shape[p.dim] % spec.mesh.size(mesh_dim):
                return False
            shape[p.dim] //= spec.mesh.size(mesh_dim)
    return True


def _pairs(n_mesh, ndim, count, seed):
    atoms = [R, P] + [Shard(d) for d in range(ndim)]
    combos = list(itertools.product(atoms, repeat=n_mesh))
    rng = random.Random(seed)
    return [(rng.choice(combos), rng.choice(combos)) for _ in range(count)]


# 16 simulated ranks per 4-D pair: fewer pairs there
@pytest.mark.parametrize("mesh_shape,shape,count", [((2, 2, 2), (8, 8, 4), 150), ((2, 2, 2, 2), (16, 8, 4), 80)])
def test_redistribute_runs_the_priced_plan_and_matches_dtensor(fake_world, mesh_shape, shape, count):
    pairs = _pairs(len(mesh_shape), len(shape), count, seed=len(mesh_shape))
    assert len(_check(fake_world, mesh_shape, shape, pairs)) > 10  # the min-cost plans were exercised


def test_intermediate_non_default_shard_order(fake_world):
    """A plan through a tensor dim sharded inner mesh dim first (non-default
    order: slice tensor dim 2 on mesh dims 2 then 1, all-to-all mesh dim 1
    to dim 0 before mesh dim 0 slices it) and apply following it."""
    src, dst = (R, R, R, Shard(0)), (Shard(0), Shard(0), R, Shard(1))
    # bandwidth only (no latency), where this plan is the cheapest
    device = dataclasses.replace(H100, launch_floor=0.0, intra_node_latency=0.0, inter_node_latency=0.0)
    (plan,) = _check(fake_world, (2, 2, 2, 2), (4, 4, 64), [(src, dst)], device)
    orders, non_default = {0: [3], 1: [], 2: []}, False
    for mesh_dim, a, b, *_ in plan:
        if a.is_shard():
            assert orders[a.dim][-1] == mesh_dim  # only the innermost shard moves
            orders[a.dim].pop()
        if b.is_shard():
            orders[b.dim].append(mesh_dim)
        non_default |= any(o != sorted(o) for o in orders.values())
    assert non_default and orders == {0: [0, 1], 1: [3], 2: []}


def _check(fake_world, mesh_shape, shape, pairs, device=H100) -> list:
    """Apply's redistribute() == DTensor's local shards for each pair, on
    every rank; returns the min-cost plans met (checked to be what the cost
    model priced)."""
    world = math.prod(mesh_shape)
    fake_world(world)
    mesh = init_device_mesh("cpu", mesh_shape)
    cost_model.clear_caches()
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    min_cost = []
    with LocalTensorMode(world) as lm:
        coords = _coords(lm, mesh)
        # rank r holds r + 1 times the tensor where a source is Partial
        partial_full = lm.rank_map(lambda r: full * (r + 1))
        for src, dst in pairs:
            if any(p.is_partial() for p in src):
                local = distribute_tensor(
                    partial_full, mesh, [R if p.is_partial() else p for p in src], src_data_rank=None
                )
                a = DTensor.from_local(local.to_local(), mesh, src, run_check=False)
            else:
                a = distribute_tensor(full, mesh, src, src_data_rank=None)
            dst_spec = DTensorSpec(mesh, dst, tensor_meta=a._spec.tensor_meta)
            if math.isinf(cost_model.redistribute_time(a._spec, dst_spec, device)) or not (
                _even(a._spec) and _even(dst_spec)
            ):
                continue  # forbidden (Shard -> Partial), or uneven (apply raises, as planning avoids)
            plan = comm.min_cost_plan(a._spec, dst_spec, device)
            if plan is not None:
                min_cost.append(plan)
                priced = cost_model.redistribute_steps(a._spec, dst_spec, device)
                assert [(s.mesh_dim, s.src, s.dst) for s in priced] == [step[:3] for step in plan]
            try:
                got = redistribute(a.to_local(), a._spec, dst_spec, coords, device=device)
            except Exception as e:
                raise AssertionError(f"{src} -> {dst} ({'min-cost' if plan else 'DTensor'} plan): {e}") from e
            # DTensor's own redistribution (its greedy plan; internal, as
            # the public one refuses Partial targets)
            want = redistribute_local_tensor(a.to_local(), a._spec, dst_spec)
            assert got.shape == local_shape(dst_spec)
            if not any(p.is_partial() for p in (*src, *dst)):
                want = distribute_tensor(full, mesh, dst, src_data_rank=None).to_local()
            for r in range(world):
                torch.testing.assert_close(
                    got._local_tensors[r], want._local_tensors[r], rtol=0, atol=0, msg=f"{src} -> {dst} rank {r}"
                )
    return min_cost
