import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


@pytest.fixture
def fake_world():
    """A fake process group of the requested size (plans for any mesh on CPU)."""

    def init(world_size: int):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()
