"""Run a function on N real gloo processes (CPU), failing fast and clearly.

``run_ranks(fn, world_size, *args, timeout=...)`` spawns ``world_size``
processes, each joining one gloo process group (FileStore under a fresh
temporary directory) and calling ``fn(rank, world_size, *args)``. An
exception in any rank fails the caller with that rank's traceback (the other
ranks are terminated, so none waits forever in a collective); a run past
``timeout`` seconds kills every rank and fails with a TimeoutError.
``fn`` must be importable by the children (a module-level function).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, world_size: int, init_method: str, collective_timeout: float, args) -> None:
    # 2 cores shared by all ranks: one intra-op thread each
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=collective_timeout),
    )
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0) -> float:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns
    the wall seconds taken."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autoparallel_gloo_") as tmp:
        init_method = "file://" + os.path.join(tmp, "store")
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, init_method, timeout, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            while True:
                left = timeout - (time.monotonic() - start)
                if left <= 0:
                    raise TimeoutError(
                        f"{fn.__name__} on {world_size} gloo ranks did not finish in {timeout:.0f} s "
                        f"(alive ranks: {[i for i, p in enumerate(ctx.processes) if p.is_alive()]})"
                    )
                # raises ProcessRaisedException (with the rank's traceback)
                # or ProcessExitedException, after terminating the others
                if ctx.join(timeout=min(left, 1.0)):
                    break
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(timeout=10)
    return time.monotonic() - start
