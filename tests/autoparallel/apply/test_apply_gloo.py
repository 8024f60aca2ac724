"""apply_placement on 4 real processes (gloo, CPU).

Every rank plans on its own (the plans must agree), builds its own parallel
module (process-group names differ per rank, so each rank traces its own
graph), and runs one forward/backward of the tiny LLaMA-3: loss and every
parameter gradient equal the single-device reference. Also: sharded init
equals the single-device init of the same seed, the shard-to-shard
all-to-all of apply/redistribute.py on gloo, and a DCP checkpoint saved
under one plan and loaded under another.

The 2x2 agreement run is in the default suite (~40 s on an idle 2-core
machine: 4 processes each plan the model); the rest is marked slow.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from _dist_utils import run_ranks

WORLD = 4
BATCH, SEQ = 8, 16

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
]


# ---------------------------------------------------------------------------
# rank-side helpers (run in the child processes)


def _quiet():
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message="DTensor random operators")


def _config(n_layers=None):
    import dataclasses

    from autoparallel.models import LLAMA3_CONFIGS

    config = LLAMA3_CONFIGS["debug"]
    return dataclasses.replace(config, n_layers=n_layers) if n_layers else config


def _plan_and_apply(mesh, *, high=None, n_layers=None):
    from autoparallel import AutoParallel
    from autoparallel.models import Transformer

    with torch.device("meta"):
        model = Transformer(_config(n_layers))
    batch = (Shard(0),) + (Replicate(),) * (mesh.ndim - 1)
    with AutoParallel(model, mesh, torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")) as autop:
        autop.add_input_constraints([batch])
        autop.add_output_constraints([batch])
        autop.add_parameter_memory_constraint(high=high)
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan)
    digest = hashlib.sha256(
        json.dumps(
            {name: [n.option, n.input_placements, n.output_placements] for name, n in sorted(plan.nodes.items())}
        ).encode()
    ).hexdigest()
    return parallel, digest


def _check_same_on_all_ranks(value, what: str) -> None:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    assert all(v == values[0] for v in values), f"{what} differs across ranks: {values}"


def _reference(n_layers=None):
    from autoparallel.models import Transformer

    ref = Transformer(_config(n_layers))
    torch.manual_seed(0)
    ref.init_weights()
    return ref


def _tokens():
    from autoparallel.models import LLAMA3_CONFIGS

    vocab = LLAMA3_CONFIGS["debug"].vocab_size
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).sum() / (BATCH * SEQ * out.shape[-1])


def _check_shard_to_shard(mesh) -> None:
    """redistribute()'s S(i) -> S(j) all_to_all_single on every mesh dim, and
    both mesh dims at once, against DTensor's own layouts."""
    from autoparallel.apply.redistribute import redistribute

    full = torch.arange(8 * 8 * 4, dtype=torch.float32).reshape(8, 8, 4)
    coords = torch.tensor(mesh.get_coordinate(), dtype=torch.int64)
    cases = []
    for d in range(mesh.ndim):
        src = [Replicate()] * mesh.ndim
        dst = [Replicate()] * mesh.ndim
        src[d], dst[d] = Shard(0), Shard(1)
        cases.append((src, dst))
        cases.append((dst, src))
    if mesh.ndim == 2:
        cases.append(([Shard(0), Shard(2)], [Shard(1), Shard(0)]))
    for src, dst in cases:
        a = distribute_tensor(full, mesh, src, src_data_rank=None)
        b = distribute_tensor(full, mesh, dst, src_data_rank=None)
        got = redistribute(a.to_local(), a._spec, b._spec, coords)
        assert torch.equal(got, b.to_local()), (src, dst)


def _agreement(rank: int, world: int, mesh_shape, use_init: bool, n_layers=None) -> None:
    """Plan, apply, init or load, one forward/backward vs the reference."""
    _quiet()
    mesh = init_device_mesh("cpu", mesh_shape)
    _check_shard_to_shard(mesh)
    parallel, digest = _plan_and_apply(mesh, n_layers=n_layers)
    _check_same_on_all_ranks(digest, "the plan")
    if n_layers:
        from autoparallel.apply.fold import MIN_LAYERS

        assert bool(parallel.parallel_state.local.extra.get("folded")) == (n_layers >= MIN_LAYERS)
    ref = _reference(n_layers)
    ref_after = torch.rand(4)  # the generator after the single-device init
    x = _tokens()
    dp = mesh.get_coordinate()[0]
    per = BATCH // mesh.size(0)
    local_x = x[dp * per : (dp + 1) * per]
    # bad use raises on every rank before any collective: nothing hangs
    with pytest.raises(RuntimeError, match="call to_empty"):
        parallel(local_x)
    parallel.to_empty(device="cpu")
    if use_init:
        torch.manual_seed(0)
        parallel.init_weights()
        after = torch.rand(4)
        assert torch.equal(after, ref_after), "init_weights consumed the RNG differently from the single-device init"
        sharded = 0
        for name, p in parallel.named_parameters():
            sharded += any(isinstance(q, Shard) for q in p.placements)
            assert torch.equal(p.full_tensor(), ref.get_parameter(name)), f"init of {name}"
        assert sharded > 0
    else:
        parallel.init_weights()  # RoPE buffers
        parallel.load_state_dict(ref.state_dict())

    with pytest.raises(
        ValueError, match=rf"input args\[0\]: local shape \({BATCH}, {SEQ}\), expected the local shard \({per}, {SEQ}\)"
    ):
        parallel(x)
    with pytest.raises(ValueError, match=r"input args\[0\]: dtype torch.int32"):
        parallel(local_x.int())
    with pytest.raises(ValueError, match=r"input args\[0\]: DTensor placements"):
        parallel(distribute_tensor(x, mesh, [Replicate()] * mesh.ndim, src_data_rank=None))

    ref_out = ref(x)
    ref_loss = _loss(ref_out)
    ref_loss.backward()

    out = parallel(local_x)
    torch.testing.assert_close(out, ref_out[dp * per : (dp + 1) * per], rtol=1e-5, atol=1e-5)
    loss = _loss(out)
    loss.backward()
    # the global loss: one local loss per dp slice
    total = loss.detach().clone()
    if mesh.ndim > 1 and mesh.get_coordinate()[1] != 0:
        total.zero_()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss.detach(), rtol=1e-5, atol=1e-7)
    for name, p in parallel.named_parameters():
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
        torch.testing.assert_close(p.grad.full_tensor(), ref.get_parameter(name).grad, rtol=1e-4, atol=1e-6, msg=name)


def _dcp_reshard(rank: int, world: int, ckpt_dir: str) -> None:
    """Save under the FSDP-like plan on (4,), load under the DDP-allowed plan
    on (2, 2)."""
    import torch.distributed.checkpoint as dcp

    _quiet()
    mesh_a = init_device_mesh("cpu", (WORLD,))
    a, _ = _plan_and_apply(mesh_a)
    a.to_empty(device="cpu")
    torch.manual_seed(0)
    a.init_weights()
    saved = {k: v.full_tensor() for k, v in a.state_dict().items()}
    assert all(isinstance(v, DTensor) for v in a.state_dict().values())
    dcp.save(a.state_dict(), checkpoint_id=ckpt_dir)

    mesh_b = init_device_mesh("cpu", (2, 2))
    b, _ = _plan_and_apply(mesh_b, high=1.0)
    b.to_empty(device="cpu")
    torch.manual_seed(1)  # different values, overwritten by the load
    b.init_weights()
    layouts_a = {k: tuple(v.placements) for k, v in a.state_dict().items()}
    layouts_b = {k: tuple(v.placements) for k, v in b.state_dict().items()}
    assert layouts_a != layouts_b
    sd = b.state_dict()
    dcp.load(sd, checkpoint_id=ckpt_dir)
    b.load_state_dict(sd)
    for k, v in b.state_dict().items():
        assert torch.equal(v.full_tensor(), saved[k]), k


# ---------------------------------------------------------------------------
# tests (parent process)


def test_llama_2x2_init_forward_backward():
    """Default suite: plans agree, init equals the reference, loss and every
    gradient equal the reference, shard-to-shard all-to-all on gloo."""
    run_ranks(_agreement, WORLD, (2, 2), True, timeout=240)


@pytest.mark.slow
def test_llama_1d_load_state_dict_forward_backward():
    run_ranks(_agreement, WORLD, (WORLD,), False, timeout=300)


@pytest.mark.slow
def test_folded_llama_2x2_forward_backward():
    """Six layers: apply folds the middle layers (autoparallel.apply.fold);
    the unfolded graphs run on real processes and match the reference."""
    run_ranks(_agreement, WORLD, (2, 2), False, 6, timeout=400)


@pytest.mark.slow
def test_dcp_save_fsdp_load_other_plan(tmp_path):
    run_ranks(_dcp_reshard, WORLD, str(tmp_path / "ckpt"), timeout=400)


def _fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # the others wait for rank 1, which never comes


def _hangs(rank: int, world: int) -> None:
    import time

    time.sleep(3600)


@pytest.mark.slow
def test_child_failure_surfaces():
    from torch.multiprocessing import ProcessRaisedException

    with pytest.raises(ProcessRaisedException, match="boom on rank 1"):
        run_ranks(_fails, 2, timeout=60)


@pytest.mark.slow
def test_child_hang_times_out():
    with pytest.raises(TimeoutError, match="did not finish"):
        run_ranks(_hangs, 2, timeout=15)
