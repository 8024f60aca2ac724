"""Every form of the redistribution cost model gives the reference's figure.

The reference is :func:`autoparallel.cost_model.redistribute_time` (and the
steps :func:`redistribute_steps` lists); the fast forms are the vectorised
grid (:func:`class_costs.redistribution_grid`), the min-cost search read
per pair (:func:`redistribute_plan.min_cost_total`) and the greedy planner
run on placement keys. Random layouts (Replicate, Partials of several reduce
ops, masked and norm Partials, Shards of every tensor dim, strided shards)
on random 1-D to 4-D meshes and tensor shapes (uneven ones included):
figures bit for bit, steps that land on the target.
"""

from __future__ import annotations

import math
import random
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _MaskPartial, _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoparallel import cost_model
from autoparallel.cost_model import caches, class_costs, comm, placement_codes, redistribute_plan
from autoparallel.cost_model.devices import A100, H100
from autoparallel.cost_model.placement_codes import REPLICATE_KEY, key, key_shard_dim, kind, state_codes

_MASKED = _MaskPartial(offset_shape=torch.Size([64, 8]), offset_dim=0)


@pytest.fixture(autouse=True, scope="module")
def _world():
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=256)
    yield
    dist.destroy_process_group()


def _mesh(shape) -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape), _init_backend=False)


def _spec(mesh, placements, shape, dtype=torch.bfloat16):
    t = torch.empty(shape, dtype=dtype, device="meta")
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))


def _random_case(rng: random.Random):
    """A mesh of 1-4 dims, a tensor shape (some dims uneven), and layouts."""
    ndim_mesh = rng.randint(1, 4)
    mesh_shape = tuple(rng.choice((1, 2, 2, 3, 4)) for _ in range(ndim_mesh))
    ndim = rng.randint(0, 3)
    shape = tuple(rng.choice((1, 3, 4, 6, 8, 12, 16, 24)) for _ in range(ndim))
    atoms = [Replicate(), Partial(), Partial("avg"), Partial("max"), _MASKED, _NormPartial(2)]
    atoms += [Shard(d) for d in range(ndim)]
    if ndim:
        atoms.append(_StridedShard(0, split_factor=2))
    layouts = {tuple(rng.choice(atoms) for _ in mesh_shape) for _ in range(rng.randint(3, 14))}
    return mesh_shape, shape, sorted(layouts, key=repr)


def _apply(placements, steps):
    current = list(placements)
    for s in steps:
        assert current[s.mesh_dim] == s.src
        current[s.mesh_dim] = s.dst
    return tuple(current)


@pytest.mark.parametrize("seed", range(6))
def test_grid_and_steps_equal_the_reference(seed):
    rng = random.Random(seed)
    for _ in range(8):
        mesh_shape, shape, layouts = _random_case(rng)
        mesh = _mesh(mesh_shape)
        specs = [_spec(mesh, p, shape) for p in layouts]
        # a copies share below 1 is what an edge out of a value with several readers is costed on
        device = rng.choice((H100, A100, cost_model.copies_device(H100, 1 / 3)))
        reference = np.array([[cost_model.redistribute_time(s, d, device) for d in specs] for s in specs])
        grid = class_costs.redistribution_grid(specs, specs, device)
        assert np.array_equal(grid, reference), (mesh_shape, shape)
        for s, row in zip(specs, reference.tolist()):
            for d, t in zip(specs, row):
                steps = cost_model.redistribute_steps(s, d, device)
                assert comm.total_time([(x.time,) for x in steps]) == t
                if math.isfinite(t):
                    assert _apply(s.placements, steps) == d.placements
                found = redistribute_plan.min_cost_total(s, d, device)
                if found is not None and math.isfinite(found[0]):
                    # the min-cost figure is the sum of its path's steps, and
                    # the reference takes it exactly where strictly cheaper
                    path = redistribute_plan.min_cost_steps(s, d, device, math.inf)
                    assert comm.total_time(path) == found[0]
                    dtensor = comm.total_time(comm.dtensor_plan_steps(s, d, device))
                    assert t == (found[0] if found[0] < dtensor else dtensor)


def test_cached_figures_survive_a_clear():
    rng = random.Random(7)
    mesh_shape, shape = (2, 2, 2), (8, 12, 4)
    atoms = [Replicate(), Partial(), Shard(0), Shard(1), Shard(2)]
    layouts = [tuple(rng.choice(atoms) for _ in mesh_shape) for _ in range(20)]
    mesh = _mesh(mesh_shape)
    specs = [_spec(mesh, p, shape) for p in layouts]
    first = class_costs.redistribution_grid(specs, specs, H100)
    cost_model.clear_caches()
    assert np.array_equal(class_costs.redistribution_grid(specs, specs, H100), first)


def test_keys_and_state_codes_encode_placements():
    """Keys of plain placements are equal exactly when the placements are;
    the greedy planner on keys takes the steps it takes on placements."""
    plain = [Replicate(), Partial(), Partial("avg"), Partial("max"), Shard(0), Shard(1), Shard(2)]
    for a in plain:
        for b in plain:
            assert (key(a) == key(b)) == (a == b)
        assert key(a)[0] == kind(a)
    assert key(Replicate()) is REPLICATE_KEY
    assert key(None) is None  # an option slot without a layout (a non-tensor output)
    assert kind(_MASKED) == kind(_NormPartial(2)) == "P" and kind(_StridedShard(0, split_factor=2)) == "X"
    assert key(_MASKED) != key(Partial())  # Partial subclasses compare apart from a plain Partial
    assert state_codes((Replicate(), Partial(), Shard(2), Shard(-1)), 3) == (0, 1, 4, 4)
    assert state_codes((_MASKED, Shard(0)), 2) is None
    rng = random.Random(3)
    for _ in range(400):
        mesh_shape = tuple(rng.choice((2, 3, 4)) for _ in range(rng.randint(1, 4)))
        src = tuple(rng.choice(plain) for _ in mesh_shape)
        dst = tuple(rng.choice(plain) for _ in mesh_shape)
        on_keys = comm.greedy_steps(
            mesh_shape,
            [key(p) for p in src],
            [key(p) for p in dst],
            letter=lambda k: k[0],
            shard_dim=key_shard_dim,
            replicate=REPLICATE_KEY,
        )
        on_placements = comm.greedy_steps(mesh_shape, src, dst)
        assert on_keys == [(m, key(a), key(b)) for m, a, b in on_placements]


# module-level tables that are constants, not caches
_CONSTANT_TABLES = {"STEP_KINDS", "KIND_EFFICIENCY", "_SWEEP_ORDER", "_PRESETS", "_EXTRA_FLOP_FORMULAS"}


def test_one_clear_empties_every_cost_cache():
    """After costing, ``cost_model.clear_caches()`` leaves no cache of any
    cost_model module holding entries: every dict, list and lru_cache at
    module level is registered, or a constant table."""
    mesh = _mesh((2, 2, 2))
    specs = [_spec(mesh, p, (8, 8)) for p in [(Replicate(),) * 3, (Shard(0), Shard(1), Partial()), (Shard(1),) * 3]]
    class_costs.redistribution_grid(specs, specs, H100)
    [cost_model.redistribute_time(s, d) for s in specs for d in specs]
    cost_model.local_shape((8, 8), (2, 2, 2), specs[1].placements)
    cost_model.mesh_dim_topology(mesh)
    cost_model.clear_caches()
    modules = [m for name, m in sys.modules.items() if name.startswith("autoparallel.cost_model")]
    assert placement_codes in modules and caches in modules
    left = []
    for module in modules:
        for name, value in vars(module).items():
            if name in _CONSTANT_TABLES or name.startswith("__") or value is caches._REGISTERED:
                continue
            if hasattr(value, "cache_info") and value.cache_info().currsize:
                left.append(f"{module.__name__}.{name}")
            elif type(value) in (dict, list) and value:
                left.append(f"{module.__name__}.{name}")
    assert not left, f"caches not registered with cost_model.caches: {left}"
