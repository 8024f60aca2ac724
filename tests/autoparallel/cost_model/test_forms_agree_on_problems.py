"""The edge matrices' vectorised grids equal the scalar reference on every
pair real planning problems price.

The problem's redistribution edges are costed in whole class grids
(:func:`autoparallel.cost_model.class_costs.class_cost_grid`, numpy); the
reference is :func:`autoparallel.cost_model.edge_time` pair by pair (on
:func:`autoparallel.cost_model.redistribute_time`). Here the problems of
LLaMA-3 (built with ``examples/example_llama3.py``'s building blocks) and
of the MoE transformer are built on a fake world, every grid their edge
matrices compute is recorded, and each distinct (source spec, target spec,
device, overlap kind, keep-partial) entry is compared with the reference,
bit for bit, after the cost caches are cleared (the reference recomputes
every figure). The default suite builds the debug models; the 8B (16x8)
and MoE 16B (8x8) problems run with ``-m slow``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.placement_types import Shard

from autoparallel import AutoParallel, cost_model
from autoparallel.problem.edge_matrices import EdgeMatrices

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "example_llama3.py"


def _example_llama3():
    module = sys.modules.get("example_llama3")
    if module is None:
        spec = importlib.util.spec_from_file_location("example_llama3", EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return module


def _record_grids(monkeypatch) -> list[tuple]:
    """Every grid the edge matrices compute from now on, with what it was
    computed for: (device with the copies share, overlap policy, source
    specs, target specs, kind, keep_partial, grid)."""
    grids: list[tuple] = []
    compute = EdgeMatrices._class_matrix

    def record(self, src_specs, dst_specs, kind, keep_partial, copies=1.0):
        out = compute(self, src_specs, dst_specs, kind, keep_partial, copies)
        device = cost_model.copies_device(self.device, copies)
        grids.append((device, self.overlap, list(src_specs), list(dst_specs), kind, keep_partial, out.copy()))
        return out

    monkeypatch.setattr(EdgeMatrices, "_class_matrix", record)
    return grids


def _build_llama(fake_world, model: str, mesh_shape: list[int], extra: list[str]) -> None:
    """The problem ``examples/example_llama3.py --no-apply`` solves."""
    ex = _example_llama3()
    args = ex.parse_args(["--model", model, "--mesh", *map(str, mesh_shape), "--no-apply", *extra])
    fake_world(math.prod(args.mesh))
    mesh = init_device_mesh("cpu", tuple(args.mesh), mesh_dim_names=ex.mesh_names(args, len(args.mesh)))
    net, config = ex.build_model(args)

    def inputs():
        return torch.randint(0, config.vocab_size, (args.batch, args.seq), device="meta")

    data = ex.data_placements(mesh)
    with AutoParallel(
        net,
        mesh,
        inputs,
        device=args.device,
        mp_policy=ex.mp_policy(args),
        input_constraints=[data],
        grad_reduction="mean",
    ) as autop:
        autop.add_output_constraints([data])
        autop.build_problem()


def _build_moe(fake_world, model: str, mesh_shape: tuple[int, ...], seq: int, layers: int | None = None) -> None:
    """The MoE problem of ``examples/example_moe.py`` (one sequence per
    rank, batch and output sharded on every mesh dim), selective AC as
    ``benchmarks/estimate_agreement.py``'s MoE rows."""
    from autoparallel.models import MOE_CONFIGS, MoETransformer, apply_ac

    fake_world(math.prod(mesh_shape))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "ep"))
    base = MOE_CONFIGS[model]
    config = dataclasses.replace(base, n_layers=layers or base.n_layers, max_seq_len=max(seq, base.max_seq_len))
    with torch.device("meta"):
        net = MoETransformer(config)
    apply_ac(net, mode="selective")
    x = torch.empty(math.prod(mesh_shape), seq, dtype=torch.long, device="meta")
    data = (Shard(0),) * len(mesh_shape)
    with AutoParallel(net, mesh, x, input_constraints=[data]) as autop:
        autop.add_output_constraints([data])
        autop.build_problem()


def _check_against_reference(grids: list[tuple]) -> int:
    """Compare every distinct recorded entry with ``cost_model.edge_time``
    (caches cleared first); returns how many were compared."""
    assert grids, "the build computed no class grid"
    cost_model.clear_caches()
    seen: set = set()
    wrong = []
    for device, overlap, src_specs, dst_specs, kind, keep_partial, grid in grids:
        for i, s in enumerate(src_specs):
            for j, d in enumerate(dst_specs):
                key = (s, d, device, id(overlap), kind, keep_partial)
                if key in seen:
                    continue
                seen.add(key)
                ref = cost_model.edge_time(s, d, device, overlap, kind, keep_partial)
                if not grid[i, j] == ref:
                    wrong.append(f"{s} -> {d} ({kind}, keep_partial={keep_partial}): grid {grid[i, j]!r}, ref {ref!r}")
    assert not wrong, f"{len(wrong)} of {len(seen)} pairs differ, e.g.\n" + "\n".join(wrong[:10])
    return len(seen)


def test_debug_llama_and_moe_grids_equal_the_reference(fake_world, monkeypatch):
    grids = _record_grids(monkeypatch)
    _build_llama(fake_world, "debug", [2, 2], ["--layers", "1", "--seq", "64", "--batch", "4"])
    assert _check_against_reference(grids) > 5_000
    grids.clear()
    _build_moe(fake_world, "debug", (2, 2), seq=64, layers=1)
    assert _check_against_reference(grids) > 5_000


@pytest.mark.slow
def test_llama3_8b_grids_equal_the_reference(fake_world, monkeypatch):
    grids = _record_grids(monkeypatch)
    _build_llama(fake_world, "8B", [16, 8], [])
    assert _check_against_reference(grids) > 10_000


@pytest.mark.slow
def test_moe_16b_grids_equal_the_reference(fake_world, monkeypatch):
    grids = _record_grids(monkeypatch)
    _build_moe(fake_world, "16B", (8, 8), seq=4096)
    assert _check_against_reference(grids) > 10_000
