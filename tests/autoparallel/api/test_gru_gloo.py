"""A model nobody here wrote, planned by every rank on its own: a 2-layer
``nn.GRU`` (batch_first) with a Linear head on 4 real gloo ranks (2x2 mesh,
default cost model). Its problem (~1.7M option pairs) goes through option
pricing. Every rank must hold the same plan (optimize_placement checks it,
and the test compares the digests), the parallel step must equal the
single-device one (loss and every gradient), and a second launch must plan
the same again. Slow: 4 processes each trace and price the GRU (~2 min of
CPU each).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from _dist_utils import run_ranks

WORLD = 4
BATCH, SEQ, DIM, HIDDEN, OUT = 8, 12, 16, 32, 8

pytestmark = [pytest.mark.slow]


class GRUHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(DIM, HIDDEN, num_layers=2, batch_first=True)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).sum() / (BATCH * SEQ * OUT)


def _gru_rank(rank: int, world: int, digest_file: str) -> None:
    import warnings

    from autoparallel import AutoParallel
    from autoparallel.checks import agreement

    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = init_device_mesh("cpu", (2, 2))
    with torch.device("meta"):
        model = GRUHead()
    batch = (Shard(0), Replicate())
    with AutoParallel(model, mesh, torch.empty(BATCH, SEQ, DIM, device="meta")) as autop:
        autop.add_input_constraints([batch])
        autop.add_output_constraints([batch])
        plan = autop.optimize_placement()  # raises PlanDisagreement unless every rank holds this plan
        parallel = autop.apply_placement(plan)
    assert plan.solution.backend.startswith("pricing+"), plan.solution.backend
    assert plan.solution.stopped_by is None, plan.solution.stopped_by
    digest = agreement.plan_digest(plan)
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    assert len(set(digests)) == 1, digests
    if rank == 0:
        with open(digest_file, "w") as f:
            f.write(digest)

    torch.manual_seed(0)
    ref = GRUHead()
    parallel.to_empty(device="cpu")
    parallel.load_state_dict(ref.state_dict())
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1))
    ref_loss = _loss(ref(x))
    ref_loss.backward()
    per = BATCH // mesh.size(0)
    dp = mesh.get_coordinate()[0]
    loss = _loss(parallel(x[dp * per : (dp + 1) * per]))
    loss.backward()
    total = loss.detach().clone()
    if mesh.get_coordinate()[1] != 0:  # one local loss per dp slice
        total.zero_()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss.detach(), rtol=1e-5, atol=1e-7)
    for name, p in parallel.named_parameters():
        assert isinstance(p.grad, DTensor), name
        torch.testing.assert_close(p.grad.full_tensor(), ref.get_parameter(name).grad, rtol=1e-4, atol=1e-6, msg=name)


_digests: dict[int, str] = {}


@pytest.mark.parametrize("launch", [1, 2])
def test_gru_same_plan_on_every_rank_and_launch(launch, tmp_path):
    """Two launches (fresh processes, each rank planning under the others'
    load): the same plan on every rank, in both launches."""
    path = os.path.join(tmp_path, "digest")
    run_ranks(_gru_rank, WORLD, path, timeout=1500)
    with open(path) as f:
        _digests[launch] = f.read()
    assert len(set(_digests.values())) == 1, _digests
