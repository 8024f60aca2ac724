"""Plan your own model for 8 GPUs on a laptop: python examples/own_model.py"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoparallel import AutoParallel


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


# A fake process group: plan for 8 ranks (2 x 4) in one CPU process.
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
with torch.device("meta"):
    model = nn.Sequential(*[Block(1024) for _ in range(4)])
x = torch.empty(16, 512, 1024, device="meta")  # global shape: batch, seq, dim

with AutoParallel(model, mesh, x) as autop:
    autop.add_input_constraints([(Shard(0), Replicate())])  # batch split over dp
    autop.add_output_constraints([(Shard(0), Replicate())])
    plan = autop.optimize_placement()
    parallel_model = autop.apply_placement(plan)

print(plan.summary())
w = parallel_model.get_submodule("0.up").weight  # a DTensor, laid out by the plan
print("0.up.weight:", w.placements, "local shard", tuple(w.to_local().shape))
dist.destroy_process_group()
