"""Tiny MoE with expert parallelism on 4 real gloo processes: every rank
plans (EP pinned on the expert weights), applies, and one forward/backward
gives the single-device loss and gradients (router, shared and routed
experts). Slow: 4 processes each plan the model."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from _dist_utils import run_ranks
from _moe_parity import check_moe_step

BATCH, SEQ = 4, 8

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]


def _config():
    import dataclasses

    from autoparallel.models import MOE_CONFIGS

    return dataclasses.replace(MOE_CONFIGS["debug"], n_layers=2)


def _ep_step(rank: int, world: int, mesh_shape, pin, a2a_dim=None) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message="DTensor random operators")
    from autoparallel import AutoParallel
    from autoparallel.models import MoETransformer

    args = _config()
    mesh = init_device_mesh("cpu", mesh_shape)
    # the role 'ep' on a2a_dim: all-to-all expert dispatch there (at this
    # toy size the solver would rather gather the tiny expert weights)
    roles = {a2a_dim: "ep"} if a2a_dim is not None else None
    with torch.device("meta"):
        model = MoETransformer(args)
    # four processes each solve, sharing the cores: give HiGHS time
    x = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    with AutoParallel(model, mesh, x, time_limit=300, mesh_roles=roles) as autop:
        batch = (Shard(0),) * mesh.ndim
        autop.add_input_constraints([batch])
        autop.add_output_constraints([batch])
        for fqn, n in autop.traced.param_nodes.items():
            if fqn.endswith(("moe.w1", "moe.w2", "moe.w3")):
                autop.add_node_constraint(n, pin)
        parallel = autop.apply_placement(autop.optimize_placement())
    if a2a_dim is not None:
        # lowered to the all-to-all ops and split into phases (async row exchanges)
        from autoparallel.apply.moe_a2a_phases import PHASE_OPS

        targets = {n.target for n in parallel.parallel_graph.graph.nodes}
        assert PHASE_OPS <= targets
    check_moe_step(parallel, args, BATCH, SEQ, rank, world)


@pytest.mark.slow
def test_moe_ep_gloo_1d():
    run_ranks(_ep_step, 4, (4,), (Shard(0),), timeout=600)


@pytest.mark.slow
def test_moe_a2a_gloo_2x2():
    """FSDP on mesh dim 0 x all-to-all EP on dim 1: variable split sizes
    all_to_all_single on gloo (CPU) gives the single-device step."""
    run_ranks(_ep_step, 4, (2, 2), (Shard(2), Shard(0)), 1, timeout=600)
