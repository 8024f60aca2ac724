"""Context parallelism on 4 real gloo processes: the LLaMA-3 debug model on a
2x2 ("dp", "cp") mesh, attention sequence-sharded over "cp" (K/V all-gathered,
dK/dV reduce-scattered by gloo, the sequence in the balanced layout), gives
the single-device loss and gradients; three AdamW steps equal the
single-device steps, with and without activation checkpointing.
Slow: 4 processes each plan the model."""

from __future__ import annotations

import pytest
import torch

from _dist_utils import run_ranks

SEQ = 64

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]


def _cp_step(rank: int, world: int) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message="DTensor random operators")
    from _parity import check_step_on_rank, plan_and_apply
    from test_context_parallel import SDPA, LlamaLoss

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, SEQ))
    targets = torch.randint(0, 256, (2, SEQ))

    def build():
        return LlamaLoss(SEQ)

    parallel, plan, mesh = plan_and_apply(build, (tokens, targets), mesh_dim_names=("dp", "cp"), time_limit=300)
    assert all("S(2)" in n.output_placements for n in plan.nodes.values() if n.op == SDPA)
    check_step_on_rank(parallel, mesh, build, (tokens, targets), rank, rel=1e-4)


@pytest.mark.slow
def test_cp_gloo_2x2():
    run_ranks(_cp_step, 4, timeout=900)


def _cp_adamw_steps(rank: int, world: int, ac: str | None) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message="DTensor random operators")
    from _parity import check_steps_on_rank, plan_and_apply
    from test_context_parallel import SDPA, LlamaLoss

    from autoparallel.capture.activation_checkpointing import apply_ac

    tokens = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(2))

    def build():
        model = LlamaLoss(128)
        if ac is not None:
            apply_ac(model.model, ac)
        return model

    parallel, plan, mesh = plan_and_apply(build, (tokens, targets), mesh_dim_names=("dp", "cp"), time_limit=300)
    assert all("S(2)" in n.output_placements for n in plan.nodes.values() if n.op == SDPA)
    errors = check_steps_on_rank(parallel, mesh, build, (tokens, targets), rank, steps=3, rel=1e-4)
    if rank == 0:
        print(f"largest relative gradient error over 3 steps (ac={ac}): {max(errors.values()):.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("ac", [None, "full", "selective"], ids=["plain", "full_ac", "selective_ac"])
def test_cp_gloo_2x2_adamw_steps(ac):
    run_ranks(_cp_adamw_steps, 4, ac, timeout=1200)
