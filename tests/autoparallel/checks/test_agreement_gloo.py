"""Ranks agree on the plan (autoparallel.checks.agreement), on 4 real gloo processes.

Simulated ranks share one plan, so only real processes can disagree. Each
rank plans a bias FFN on a 2x2 mesh through option pricing (the threshold
lowered so this small problem takes that route), and:

* every rank holds the same plan (the check passes, the digests agree),
  and a plan file loaded on every rank holds it too;
* one rank given other constraints: every rank raises the named error
  (the ranks, the constraint that differs), none hangs;
* one rank whose constraints make planning fail: the others fail at once,
  naming it and its error;
* one rank that never plans: the others name it after the timeout.

One process launch and one trace per rank for all four.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from _dist_utils import run_ranks

WORLD = 4


def _scenarios(rank: int, world: int, plan_path: str) -> None:
    import warnings

    import solver.api
    from autoparallel import AutoParallel, Plan
    from autoparallel.checks import agreement
    from autoparallel.checks.agreement import PlanDisagreement
    from autoparallel.models import FFN

    warnings.filterwarnings("ignore", category=FutureWarning)
    solver.api.PRICING_MIN_PAIRS = 0  # this small problem goes through option pricing
    mesh = init_device_mesh("cpu", (2, 2))
    with torch.device("meta"):
        model = FFN(16, 64, bias=True)
    # one context (one trace) per rank; the scenarios add constraints to it
    with AutoParallel(model, mesh, torch.empty(8, 16, 16, device="meta")) as autop:
        # 1. every rank plans on its own: the same plan, checked
        plan = autop.optimize_placement()
        assert plan.solution.backend.startswith("pricing+"), plan.solution.backend
        assert plan.solution.optimal and plan.solution.stopped_by is None
        digests = [None] * world
        dist.all_gather_object(digests, agreement.plan_digest(plan))
        assert len(set(digests)) == 1

        # a plan file: written once, loaded on every rank, the same plan,
        # its proof recorded; the check apply_placement runs passes
        if rank == 0:
            plan.dump_json(plan_path)
        dist.barrier()
        loaded = Plan.load_json(plan_path)
        assert agreement.plan_digest(loaded) == digests[0]
        assert loaded.solution.optimal and loaded.solution.stopped_by is None
        agreement.agree(loaded, [0, 1, 2, 3], what="applied plan")

        # 2. rank 2 pins its input to a layout its plan did not choose: the
        # named error on every rank
        if rank == 2:
            chosen = plan.nodes[autop.traced.input_nodes[0].name].output_placements
            layouts = {"S(0)S(0)": (Shard(0), Shard(0)), "S(0)R": (Shard(0), Replicate()), "RR": (Replicate(),) * 2}
            autop.add_input_constraints([next(v for k, v in layouts.items() if k != chosen)])
        with pytest.raises(PlanDisagreement) as err:
            autop.optimize_placement()
        msg = str(err.value)
        assert "ranks [0, 1, 3]" in msg and "ranks [2]" in msg, msg
        assert "constraint 'input constraint 0': rank 0 None, rank 2" in msg, msg

        # 3. rank 2's memory budget leaves no plan: it raises its own error, the others name it
        if rank == 2:
            autop.add_memory_budget(bytes=1)
            with pytest.raises(Exception, match="memory budget") as own:
                autop.optimize_placement()
            assert not isinstance(own.value, PlanDisagreement)
        else:
            with pytest.raises(PlanDisagreement, match=r"rank 2 failed to plan \(Infeasible"):
                autop.optimize_placement()

    # 4. rank 3 never posts its plan: the others name it after the timeout, no hang
    dist.barrier()
    if rank != 3:
        with pytest.raises(PlanDisagreement, match=r"ranks \[3\] did not report their plan within 3 s"):
            agreement.agree(plan, [0, 1, 2, 3], timeout=3)


def test_ranks_agree_or_fail_naming_the_ranks(tmp_path):
    run_ranks(_scenarios, WORLD, str(tmp_path / "plan.json"), timeout=600)
