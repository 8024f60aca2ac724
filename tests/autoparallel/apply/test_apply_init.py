"""Sharded init of the parallel module equals the single-device init of the
same seed (8 simulated ranks, LocalTensorMode); the real-process version is in
test_apply_gloo.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from autoparallel import AutoParallel
from autoparallel.apply.init import full_tensor_rng
from autoparallel.models import FFN, LLAMA3_CONFIGS, Transformer

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

ARGS = LLAMA3_CONFIGS["debug"]


def _full(t: DTensor) -> torch.Tensor:
    full = t.full_tensor()
    return full.reconcile() if isinstance(full, LocalTensor) else full


def _parallel(build, example, mesh_shape, high=None):
    mesh = init_device_mesh("cpu", mesh_shape)
    with torch.device("meta"):
        model = build()
    with AutoParallel(model, mesh, example) as autop:
        autop.add_input_constraints([(Shard(0),) + (Replicate(),) * (mesh.ndim - 1)])
        autop.add_parameter_memory_constraint(high=high)
        return autop.apply_placement(autop.optimize_placement()), mesh


def _check_init_equal(build, parallel, n, method="init_weights"):
    ref = build()
    torch.manual_seed(0)
    getattr(ref, method)()
    after_ref = torch.rand(4)
    with LocalTensorMode(n):
        parallel.to_empty(device="cpu")
        torch.manual_seed(0)
        getattr(parallel, method)()
        after = torch.rand(4)  # every simulated rank's generator advanced like the reference's
        for r in range(n):
            torch.testing.assert_close(after._local_tensors[r], after_ref, rtol=0, atol=0)
        sharded = 0
        for name, p in parallel.named_parameters():
            assert isinstance(p, DTensor), name
            sharded += any(isinstance(q, Shard) for q in p.placements)
            torch.testing.assert_close(_full(p), ref.get_parameter(name), rtol=0, atol=0, msg=name)
    assert sharded > 0


@pytest.mark.parametrize("mesh_shape, method", [((8,), "init_weights"), ((2, 4), "reset_parameters")])
def test_ffn_init_matches_single_device(fake_world, mesh_shape, method):
    fake_world(8)
    build = lambda: FFN(16, 64, bias=True)  # noqa: E731
    parallel, mesh = _parallel(build, torch.empty(8, 16, 16, device="meta"), mesh_shape)
    _check_init_equal(build, parallel, 8, method)


# ~10 s; the default suite checks the LLaMA init on real gloo processes
# (test_apply_gloo.py)
@pytest.mark.slow
def test_llama_init_matches_single_device(fake_world):
    # normal_ (embedding), trunc_normal_ (uniform_ + elementwise ops) and
    # ones_ on shards of several layouts
    fake_world(8)
    build = lambda: Transformer(ARGS)  # noqa: E731
    parallel, mesh = _parallel(build, torch.empty(8, 16, dtype=torch.long, device="meta"), (8,))
    _check_init_equal(build, parallel, 8)


@pytest.mark.parametrize("placements", [(Shard(0), Shard(1)), (Shard(1), Replicate()), (Shard(0), Shard(0))])
def test_full_tensor_rng_on_any_layout(fake_world, placements):
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 4))
    torch.manual_seed(3)
    ref = torch.empty(8, 16)
    nn.init.kaiming_uniform_(ref)
    ref_like = torch.randn_like(ref)
    with LocalTensorMode(8):
        torch.manual_seed(3)
        dt = distribute_tensor(torch.zeros(8, 16), mesh, placements)
        with full_tensor_rng():
            nn.init.kaiming_uniform_(dt)
            like = torch.randn_like(dt)
        assert isinstance(like, DTensor) and like.placements == placements
        torch.testing.assert_close(_full(dt), ref, rtol=0, atol=0)
        torch.testing.assert_close(_full(like), ref_like, rtol=0, atol=0)
