"""Planning a DeepSeek-style MoE end to end.

Plans (and with ``--apply`` applies) one training step of the MoE model of
:mod:`autoparallel.models.moe` on a fake mesh, and prints plan/apply times,
peak RSS, what the plan chose for the routed experts (EP = ``Shard(0)`` of
the expert dim, FSDP, TP), collectives per kind with bytes per rank, and the
estimated step. Asserts nothing::

    python benchmarks/plan_moe.py                          # 16B on 8 x 8
    python benchmarks/plan_moe.py --model 671B --mesh 32 8 --layers 4 --seq 4096
    python benchmarks/plan_moe.py --layers 4 --apply

Measured on the shared 2-core machine (2026-11-23 09:07 UTC, load ~4): 16B,
27 layers, 8 x 8, seq 4096, batch 64, selective AC, --apply: plan 14.1 s wall
(10.0 s CPU), apply 25.0 s, peak RSS 748 MiB; the solver chose token parallel
on dp x hidden-split (TP) on ep for the routed experts (estimated step 1765 +
333 ms); ``--force-a2a-dim 1`` (all-to-all EP on ep) is priced 1838 + 260 ms,
within 0.02 % of it. 671B, 61 layers, 32 x 8 (256 ranks), batch 256, --apply:
plan 19.8 s, apply 46.9 s, peak RSS 1191 MiB; forward T x TP, backward
all-to-all EP on dp x T on ep (the all-to-all rows cost less than
reduce-scattering the full fp32 expert gradients over dp), 174 in-op
all-to-alls moving 203 GiB per rank per step.

``--chunk`` (with ``--force-a2a-dim 1 --batch 256``) applies the plan with
the all-to-all MoE ops fused (``split_moe_a2a`` off), split into phases,
and split and chunked, and prints estimated exposed communication per MoE
layer (all-to-all separately) and per step, peak memory, node counts and
apply time (2026-11-23 12:15 UTC, load ~3): exposed all-to-all per layer
11.93 ms fused, 2.90 ms as phases, 0.09 ms chunked; per step 340.8 /
106.0 / 32.4 ms; peak +0.0 %; apply 30.2 / 33.3 / 35.6 s (load ~6 at
13:12 UTC: the same estimates, apply 35.2 / 38.0 / 59.6 s).

Routing is assumed balanced by the cost model (each rank of an EP group does
``E_local / E`` of the routed work; an all-to-all rank sends (ep-1)/ep of its
routed rows). Target: 16B plans and applies in under
60 s and 2 GB.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.placement_types import Shard  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from autoparallel import AutoParallel  # noqa: E402
from autoparallel.models.moe import MOE_CONFIGS, MoETransformer  # noqa: E402
from autoparallel.models.llama3 import apply_ac  # noqa: E402
from _chunk_report import add_chunk_argument, chunk_compare, parse_chunk, pin_expert_parallel  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="16B", choices=sorted(MOE_CONFIGS))
    p.add_argument("--layers", type=int, default=None, help="default: the config's")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=None, help="default: one sequence per rank")
    p.add_argument("--mesh", type=int, nargs="+", default=[8, 8])
    p.add_argument("--ac", default="selective", choices=["none", "selective", "full"])
    p.add_argument(
        "--force-a2a-dim",
        type=int,
        default=None,
        help="offer the routed ops only the all-to-all mode on this mesh dim (to compare its estimated step)",
    )
    p.add_argument("--apply", action="store_true", help="also time apply_placement and count collectives")
    p.add_argument("--verbose", action="store_true")
    add_chunk_argument(p, {"layers.*.moe": "batch"})  # --chunk: chunk_regions without/with (_chunk_report.py)
    return p.parse_args(argv)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _expert_choice(plan) -> dict[str, int]:
    """Placements of the routed-expert weights (w1 of each MoE layer), counted."""
    seen: dict[str, int] = {}
    for n in plan.nodes.values():
        if n.is_parameter and (n.module_path or n.name).replace(".", "_").endswith("moe_w1"):
            seen[n.output_placements] = seen.get(n.output_placements, 0) + 1
    return seen


_PLACEMENT = re.compile(r"S\(\d+\)|R|P")


def _mode(x: str, w1: str) -> str:
    """The rule's mode on one mesh dim from the x and w1 placements there."""
    if w1 == "S(0)":
        return "A2A" if x.startswith("S") else "EP-gather"
    if w1 in ("S(1)", "S(2)"):
        return "TP"
    return "T" if x.startswith("S") else "R"


def _experts_op_choice(plan) -> dict[str, int]:
    seen: dict[str, int] = {}
    for n in plan.nodes.values():
        if "moe_experts" in n.op:
            off = 1 if n.phase == "backward" else 0
            xs, ws = (_PLACEMENT.findall(n.input_placements[off + k]) for k in (0, 3))
            modes = " x ".join(_mode(x, w) for x, w in zip(xs, ws))
            key = f"{n.phase} [{modes}] {', '.join(n.input_placements)} -> {n.output_placements}"
            seen[key] = seen.get(key, 0) + 1
    return seen


def _in_op_all_to_alls(pm, mesh) -> dict:
    """The all-to-alls the lowered MoE dispatch ops run inside themselves."""
    from autoparallel.apply.moe_dispatch import in_op_collectives

    names = {mesh.get_group(d).group_name: mesh.mesh_dim_names[d] for d in range(mesh.ndim)}
    found: dict = {}
    for phase, gm in (("forward", pm.forward_graph), ("backward", pm.backward_graph)):
        for n in gm.graph.nodes:
            for kind, b, group in in_op_collectives(n):
                k = (phase, f"{kind} (in MoE op)", names.get(group, group))
                cnt, tot = found.get(k, (0, 0))
                found[k] = (cnt + 1, tot + b)
    return found


def main(argv=None) -> None:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(name)s: %(message)s")
    world = 1
    for n in a.mesh:
        world *= n
    names = ("dp", "ep") if len(a.mesh) == 2 else tuple(f"d{i}" for i in range(len(a.mesh)))
    # the role 'ep' asks for all-to-all expert dispatch on that dim; no
    # roles otherwise (the mesh's "ep" name would give one)
    roles = {a.force_a2a_dim: "ep"} if a.force_a2a_dim is not None else {}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh("cpu", tuple(a.mesh), mesh_dim_names=names)
    base = MOE_CONFIGS[a.model]
    config = dataclasses.replace(base, n_layers=a.layers or base.n_layers, max_seq_len=a.seq)
    batch = a.batch or world
    with torch.device("meta"):
        model = MoETransformer(config)
    if a.ac != "none":
        apply_ac(model, mode=a.ac)
    x = torch.empty(batch, a.seq, dtype=torch.long, device="meta")
    constraint = [(Shard(0),) * len(a.mesh)]
    t0, c0 = time.perf_counter(), time.process_time()
    with AutoParallel(model, mesh, x, mesh_roles=roles) as autop:
        autop.add_input_constraints(constraint)
        autop.add_output_constraints(constraint)
        if a.pin_ep:
            pin_expert_parallel(autop, mesh)
        plan = autop.optimize_placement()
        plan_wall, plan_cpu = time.perf_counter() - t0, time.process_time() - c0
        applied = None
        if a.apply:
            from autoparallel.apply import collectives

            t1 = time.perf_counter()
            pm = autop.apply_placement(plan)
            apply_wall = time.perf_counter() - t1
            applied = {}
            for c in collectives(pm.forward_graph, mesh) + collectives(pm.backward_graph, mesh):
                k = (c.phase, c.kind, c.group)
                cnt, b = applied.get(k, (0, 0))
                applied[k] = (cnt + 1, b + c.in_bytes)
            applied.update(_in_op_all_to_alls(pm, mesh))

        if a.chunk is not None:
            chunk_compare(
                autop, plan, mesh, parse_chunk(a.chunk, a._chunk_default), fused_baseline=a.force_a2a_dim is not None
            )

    s = plan.solution
    print(
        f"MoE {a.model}: {config.n_layers} layers ({config.n_dense_layers} dense), {config.n_experts} experts "
        f"top-{config.top_k}, {config.n_shared_experts} shared; seq {a.seq}, batch {batch}, "
        f"mesh {tuple(a.mesh)} {names}, AC {a.ac}"
    )
    print(f"plan: {plan_wall:.1f} s wall, {plan_cpu:.1f} s CPU; status {s.status}")
    for k, v in sorted(autop.timings.items()):
        print(f"  {k:24s} {v:8.2f} s")
    problem = autop.built.problem
    print(f"problem: {len(problem.decisions)} decisions, {len(problem.links)} repeated-layer links")
    print("routed-expert weights (w1 per MoE layer):", _expert_choice(plan))
    print("routed-experts ops:")
    for k, v in _experts_op_choice(plan).items():
        print(f"  {v} x {k}")
    print(
        f"parameters per rank {plan.parameter_bytes_per_rank / 1e9:.3f} GB of {plan.parameter_bytes_total / 1e9:.3f} GB"
    )
    # the MoE all-to-all mode's in-op exchanges count as its compute (they block it)
    print(f"estimated step: compute {plan.compute_cost * 1e3:.1f} ms, communication {plan.comm_cost * 1e3:.1f} ms")
    if applied is not None:
        print(f"apply: {apply_wall:.1f} s wall")
        for (phase, kind, group), (cnt, b) in sorted(applied.items()):
            print(f"  {phase:8s} {kind:24s} on {group or '?':10s} x{cnt:4d}  {b / 2**20:10.1f} MiB per rank")
    print(f"peak RSS {_peak_rss_mib():.0f} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
