import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

# Tests mirror the package layout (one folder per stage); the shared
# helpers (_parity, _dist_utils, ...) live here and some tests reuse
# another folder's helpers (test_apply's step comparison): put this folder
# and each stage folder on sys.path so `from _parity import ...` and
# `from test_apply import ...` resolve from anywhere, as before.
_HERE = Path(__file__).resolve().parent
for _p in [_HERE, *sorted(d for d in _HERE.iterdir() if d.is_dir() and not d.name.startswith(("_", ".")))]:
    if str(_p) not in sys.path:
        sys.path.append(str(_p))


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


def pytest_collection_modifyitems(config, items):
    # `-m smoke` replaces the default `-m 'not slow'`: a smoke test that is
    # also slow would silently make the smoke run long.
    both = [item.nodeid for item in items if item.get_closest_marker("smoke") and item.get_closest_marker("slow")]
    if both:
        raise pytest.UsageError(f"tests marked both smoke and slow (smoke must stay fast): {', '.join(both)}")
