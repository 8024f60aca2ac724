"""Time to compute every class grid of a lazy problem.

Builds LLaMA-3 70B on 4x4x8x8 (``--layers`` blocks, lazy edge matrices),
captures the problem's :class:`autoparallel.problem.edge_matrices.EdgeMatrices`, then
computes each distinct class grid whole (what the option-pricing solver
needs to price an option against every partner) and prints the time, the
number of grids and entries, and the peak RSS. Asserts nothing::

    PYTHONPATH=. python benchmarks/class_grids.py --layers 2
    PYTHONPATH=. python benchmarks/class_grids.py --layers 2 --max-grids 20

Current figures, with the date and commit they were measured at, are in
docs/benchmarks.md; earlier ones are in git history.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-gib", type=float, default=5.0, help="address-space limit")
    p.add_argument("--max-grids", type=int, default=None, help="compute only the largest N grids")
    a = p.parse_args(argv)
    resource.setrlimit(resource.RLIMIT_AS, (int(a.max_gib * 2**30),) * 2)

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.placement_types import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autoparallel import AutoParallel
    from autoparallel.problem import edge_matrices
    from autoparallel.models.llama3 import LLAMA3_CONFIGS, Transformer, apply_ac

    captured = []
    init = edge_matrices.EdgeMatrices.__init__

    def capture(self, *args, **kwargs):
        init(self, *args, **kwargs)
        captured.append(self)

    edge_matrices.EdgeMatrices.__init__ = capture

    shape, names = (4, 4, 8, 8), ("dp_replicate", "dp_shard", "cp", "tp")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1024)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    config = dataclasses.replace(LLAMA3_CONFIGS["70B"], n_layers=a.layers, max_seq_len=a.seq)
    with torch.device("meta"):
        model = Transformer(config)
    apply_ac(model, mode="selective")
    data = (Shard(0), Shard(0), Replicate(), Replicate())
    t0 = time.perf_counter()
    with AutoParallel(
        model,
        mesh,
        lambda: torch.randint(0, config.vocab_size, (a.batch, a.seq), device="meta"),
        max_problem_bytes=a.max_gib * 2**30 / 2,
    ) as autop:
        autop.add_input_constraints([data])
        autop.add_output_constraints([data])
        built = autop.build_problem()
    print(f"problem built in {time.perf_counter() - t0:.1f} s (lazy={built.lazy}), peak RSS {_rss_mib():.0f} MiB")
    matrices = [m for m in captured if m.lazy][-1]
    grids = list(matrices._grids.values())
    grids.sort(key=lambda g: -g.shape[0] * g.shape[1])
    if a.max_grids is not None:
        grids = grids[: a.max_grids]
    entries = sum(g.shape[0] * g.shape[1] for g in grids)
    print(f"{len(grids)} class grids, {entries / 1e6:.1f}M entries, largest {grids[0].shape[0]}x{grids[0].shape[1]}")
    rss0 = _current_rss_mib()
    t0 = time.perf_counter()
    total = 0.0
    for g in grids:
        block = g.block(np.arange(g.shape[0]), np.arange(g.shape[1]))
        total += float(np.nansum(np.where(np.isfinite(block), block, 0.0)))
    dt = time.perf_counter() - t0
    print(f"all grids: {dt:.2f} s ({dt / entries * 1e9:.0f} ns/entry), checksum {total:.9e}")
    print(f"RSS {_current_rss_mib():.0f} MiB after the grids, {rss0:.0f} MiB before; peak {_rss_mib():.0f} MiB")
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
