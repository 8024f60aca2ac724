"""Long context at scale: LLaMA-3 8B, 131072 tokens per sequence, 128 ranks.

Plans one training step (batch 4 x seq 131072, bf16 compute, selective
activation checkpointing as ``examples/example_llama3.py`` sets it) on a
fake dp 4 x cp 8 x tp 4 mesh twice and prints the two side by side:

- ``sequence split``: the middle dim named ``cp``: the tokens are laid out
  ``(Shard(0), Shard(1), Replicate())`` and the ``cp`` role makes every
  attention op take the sequence-sharded option (K and V gathered over cp);
- ``no sequence split``: the same mesh with the middle dim named ``mid``
  (no role, tokens replicated over it) and the sequence-sharded attention
  options taken out of the attention rule: the planner is free to use the
  dim for anything else (heads, tensor parallel), attention cannot split
  the sequence.

For each: planning time, the solver's step estimate, the planner's peak
memory per rank against the budget (HBM less 10%), and the attention ops'
placements. A variant that cannot fit the budget prints the smallest
estimate the planner can reach (``InfeasibleConstraintError``). Plans only
by default; ``--track`` also applies each plan and runs rank 0's step
under ``FakeTensorMode`` with ``MemTracker`` (``benchmarks/memory_tracker.py``)
under an address-space limit. Asserts nothing::

    python benchmarks/long_context.py
    python benchmarks/long_context.py --layers 2 --seq 16384   # a quick look
    python benchmarks/long_context.py --only split
    python benchmarks/long_context.py --only split --track --max-gb 10
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import example_llama3 as ex  # noqa: E402
from autoparallel import AutoParallel  # noqa: E402
from autoparallel.options.rules import attention as attention_rule  # noqa: E402
from autoparallel.problem import memory  # noqa: E402
from autoparallel.problem.infeasibility import InfeasibleConstraintError  # noqa: E402
from autoparallel.report import numbers  # noqa: E402

VARIANTS = {
    # name: (mesh dim names, sequence-sharded attention offered)
    "split": (("dp", "cp", "tp"), True),
    "no-split": (("dp", "mid", "tp"), False),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", type=int, nargs=3, default=[4, 8, 4], help="dp cp tp sizes")
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--model", default="8B")
    p.add_argument("--device", default="H100", help="cost-model preset (its HBM sets the budget)")
    p.add_argument("--only", choices=sorted(VARIANTS), default=None, help="plan one variant only")
    p.add_argument(
        "--track",
        action="store_true",
        help="also apply each plan and run rank 0's step under FakeTensorMode with MemTracker "
        "(benchmarks/memory_tracker.py; heavy at 8B x 131072)",
    )
    p.add_argument("--max-gb", type=float, default=10.0, help="address-space limit of the process with --track")
    return p.parse_args(argv)


@contextlib.contextmanager
def sequence_split_attention(offered: bool):
    """The attention rule with or without its sequence-sharded options."""
    if offered:
        yield
        return
    with mock.patch.object(attention_rule, "sequence_options", lambda *a, **k: []):
        yield


def plan_variant(args: argparse.Namespace, name: str) -> list[str]:
    names, offered = VARIANTS[name]
    ex_args = ex.parse_args(
        ["--model", args.model, "--seq", str(args.seq), "--batch", str(args.batch), "--device", args.device]
        + ["--mesh", *map(str, args.mesh), "--mesh-names", *names, "--no-apply"]
        + (["--layers", str(args.layers)] if args.layers else [])
    )
    world = args.mesh[0] * args.mesh[1] * args.mesh[2]
    mesh_desc = " x ".join(f"{n} {s}" for n, s in zip(names, args.mesh))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", tuple(args.mesh), mesh_dim_names=names)
        tokens = "".join(str(p) for p in ex.data_placements(mesh))
        lines = [f"== {name}: mesh {mesh_desc}, tokens {tokens}, sequence-sharded attention offered: {offered} =="]
        model, config = ex.build_model(ex_args)
        t0 = time.perf_counter()
        try:
            with sequence_split_attention(offered):
                plan, wall, tracked = plan_step(ex_args, mesh, model, config, track=args.track)
        except InfeasibleConstraintError as e:
            lines.append(f"  planning time {time.perf_counter() - t0:.1f} s: no plan fits")
            lines += ["  " + line for line in str(e).splitlines()]
            return lines
    finally:
        dist.destroy_process_group()
    b = memory.breakdown(plan)
    lines.append(f"  planning time {wall:.1f} s (tracing to plan), peak RSS {rss_gb():.1f} GB")
    lines += ["  " + line for line in numbers.step_lines(plan)]
    lines.append(f"  memory per rank (planner's peak, {memory.UNIT_NOTE}):")
    lines += ["    " + line for line in b.lines()]
    if tracked is not None:
        diff = (b.total - tracked.peak) / tracked.peak
        lines.append(
            f"  MemTracker's peak of the applied step (rank 0): {tracked.peak / 1e9:.2f} GB, planner {diff:+.1%}"
        )
    lines.append(f"  attention placements (mesh dims {tuple(plan.mesh_dim_names)}):")
    for (phase, op, signature), count in attention_placements(plan).items():
        lines.append(f"    {phase:9s} {op}: {signature} (x{count})")
    lines.append("  linear layers:")
    for kind in plan.placements_by_kind():
        if kind.op == "aten.mm.default" and kind.role == "forward" and kind.module_path.endswith("attention.wq"):
            lines.append("    " + str(kind))
    return lines


def plan_step(ex_args: argparse.Namespace, mesh, model, config, track: bool = False):
    """The step planned as the example plans it (bf16 compute, mean
    gradient reduction, the tokens laid out by the mesh dims' names), the
    logits' layout left to the planner in both variants. With ``track``:
    the plan applied and rank 0's step measured by MemTracker (else None).
    Returns (plan, planning seconds: tracing to plan, the tracked step)."""
    t0 = time.perf_counter()

    def inputs():
        return torch.randint(0, config.vocab_size, (ex_args.batch, ex_args.seq), device="meta")

    with AutoParallel(
        model,
        mesh,
        inputs,
        device=ex_args.device,
        mp_policy=ex.mp_policy(ex_args),
        input_constraints=[ex.data_placements(mesh)],
        grad_reduction="mean",
    ) as autop:
        plan = autop.optimize_placement()
        wall = time.perf_counter() - t0
        if not track:
            return plan, wall, None
        from memory_tracker import tracked_step

        from autoparallel.apply import local_shape

        parallel = autop.apply_placement(plan)
        spec = parallel.parallel_state.inputs[0].spec
        return plan, wall, tracked_step(parallel, tuple(local_shape(spec)), config.vocab_size, labels_like_logits=True)


def attention_placements(plan) -> dict[tuple[str, str, str], int]:
    """(phase, op, ``inputs -> outputs``) -> how many attention nodes took it."""
    out: dict[tuple[str, str, str], int] = {}
    for n in plan.nodes.values():
        if "scaled_dot_product" not in n.op:
            continue
        op = n.op.removeprefix("aten.").removesuffix(".default")
        key = (n.phase, op, f"{','.join(n.input_placements)} -> {n.output_placements}")
        out[key] = out.get(key, 0) + 1
    return out


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.track:
        limit = int(args.max_gb * 1e9)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    print(
        f"LLaMA-3 {args.model}{f' ({args.layers} layers)' if args.layers else ''}: batch {args.batch} x seq "
        f"{args.seq} on a fake {' x '.join(map(str, args.mesh))} mesh, device model {args.device}"
    )
    for name in [args.only] if args.only else list(VARIANTS):
        for line in plan_variant(args, name):
            print(line, flush=True)
        print()


if __name__ == "__main__":
    main()
