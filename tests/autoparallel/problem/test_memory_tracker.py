"""The planner's memory figure holds: not below what the applied step
allocates, as torch's MemTracker counts it running rank 0's step (forward,
the example's fp32 cross-entropy, backward, AdamW) under FakeTensorMode,
and within 10% of it (benchmarks/memory_tracker.py measures the large
configurations)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.apply.local_graph import local_shape
from autoparallel.models import LLAMA3_CONFIGS, Transformer
from autoparallel.models.llama3 import apply_ac
from autoparallel.problem.memory import breakdown

ROOT = Path(__file__).resolve().parents[3]
MARGIN = 0.10  # the planner's figure at most 10% above the tracked peak


def _tracker():
    spec = importlib.util.spec_from_file_location("memory_tracker", ROOT / "benchmarks" / "memory_tracker.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)  # its dataclasses look their module up
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def test_the_planned_peak_bounds_the_tracked_step_on_the_debug_llama(fake_world):
    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    config = dataclasses.replace(LLAMA3_CONFIGS["debug"], max_seq_len=256)
    with torch.device("meta"):
        model = Transformer(config)
    apply_ac(model, mode="selective")
    x = torch.empty(8, 256, dtype=torch.long, device="meta")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    data = (Shard(0), Replicate())
    with AutoParallel(model, mesh, x, mp_policy=mp) as autop:
        autop.add_input_constraints([data])
        autop.add_output_constraints([data])
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan)
    shape = tuple(local_shape(parallel.parallel_state.inputs[0].spec))
    tracked = _tracker().tracked_step(parallel, shape, config.vocab_size)
    mem = breakdown(plan)
    # the figure the report shows is the planner's, which the budget bounds
    assert mem.total == mem.planned
    assert tracked.peak > 0 and tracked.by_category["Activation"] > 0
    assert mem.planned >= tracked.peak, (mem.planned, tracked)
    assert mem.planned <= (1 + MARGIN) * tracked.peak, (mem.planned, tracked)
