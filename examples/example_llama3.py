"""Plan and apply LLaMA-3 training for a GPU cluster, on any machine.

By default this plans LLaMA-3 8B (32 layers, sequence 8192, global batch 32)
with selective activation checkpointing for 128 GPUs arranged as a 16 x 8
(dp x tp) mesh, then applies the plan. No GPU is needed: the process group is
a fake one and the model lives on the meta device, so only shapes flow
through the planner and the rank-local graphs.

It plans bf16 compute with fp32 gradient reduction (``--mp fp32``: none)
and prints the time of each planning stage, the plan in words (FSDP, TP,
sequence parallel... per mesh dim and kind of weight and matmul) with a
legend of the notation, the estimated step time and per-rank memory against
HBM, the placement chosen for each kind of weight and activation; then the
apply time per stage, the rewrite passes' stats and the collectives of the
parallel forward and backward graphs (traffic per rank, estimated time).
``--report plan.html`` writes the HTML report, ``--save-plan`` /
``--plan-file`` save a plan and apply a saved one (no solve), ``--dump-dir``
writes the solver's debug dumps.

    python examples/example_llama3.py
    python examples/example_llama3.py --mesh 8 8 --layers 4 --seq 2048 --batch 16
    python examples/example_llama3.py --model 70B --mesh 32 8 --no-apply
    python examples/example_llama3.py --model debug --mesh 2 4 --seq 64 --batch 8

With ``--real`` under torchrun it trains a small config for real (gloo on
CPU, NCCL on GPU): every rank plans for the actual world size (the --mesh
shape if it multiplies to it, else 1-D), applies, initialises the weights
under a fixed seed and runs a few AdamW steps on random tokens, each rank
feeding its local shard of the batch; rank 0 prints the global loss
(reduced over dp). The default --real config (width 256, seq 256) is big
enough that the plan shards the matmuls.

    torchrun --nproc-per-node 4 examples/example_llama3.py --real --mesh 2 2

Every rank plans the same plan (planning stops on counted work, never the
clock) and the ranks check they agree before the first collective. To skip
planning on the cluster, plan once (``--save-plan plan.json``, on a laptop
with the fake process group or on one rank) and give every rank
``--plan-file plan.json`` (see docs/determinism.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import resource
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoparallel import AutoParallel
from autoparallel.checks import preflight
from autoparallel.apply import collectives
from autoparallel.cli import HelpFormatter, setup_logging, user_errors
from autoparallel.cost_model import DeviceSpec
from autoparallel.passes.chunk_options import check_chunk_modules, parse_chunk_args
from autoparallel.models.llama3 import LLAMA3_CONFIGS, Transformer, apply_ac, count_params
from autoparallel.report import numbers, units
from autoparallel.report.units import count as count_text

logger = logging.getLogger("example_llama3")
PROG = "example_llama3.py"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument(
        "--model", default=None, choices=sorted(LLAMA3_CONFIGS), help="model config (default: 8B; debug with --real)"
    )
    ap.add_argument(
        "--mesh",
        type=int,
        nargs="+",
        default=[16, 8],
        help="mesh shape: dp [tp [cp [ep]]], or any number of dims named with --mesh-names (e.g. 2 8 8 with dp_replicate dp_shard tp)",
    )
    ap.add_argument(
        "--mesh-names",
        nargs="+",
        default=None,
        help="mesh dim names (default: dp tp cp ep); the batch is sharded over every "
        "dim whose name starts with 'dp', 'data' or 'batch', e.g. dp_replicate dp_shard tp for HSDP",
    )
    ap.add_argument("--layers", type=int, default=None, help="override the config's layer count")
    ap.add_argument(
        "--dim",
        type=int,
        default=None,
        help="override the config's model width (default with --real: 256, so that the plan shards the matmuls)",
    )
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: 8192; 256 with --real)")
    ap.add_argument("--batch", type=int, default=None, help="global batch size (default: 32; 8 with --real)")
    ap.add_argument(
        "--ac",
        default="selective",
        choices=["selective", "full", "none"],
        help="activation checkpointing of each transformer block",
    )
    ap.add_argument("--device", default="H100", help="cost-model preset (H100, A100, H200, B200)")
    ap.add_argument(
        "--memory-high",
        type=float,
        default=None,
        help="parameter memory bound as a fraction of the replicated size (default: none; the step memory budget bounds parameters with the rest)",
    )
    ap.add_argument(
        "--dump-dir",
        default=None,
        help="write the solver dumps (problem/solution/plan.json) here; off by default "
        "(any run: set AUTOPARALLEL_DUMP_DIR)",
    )
    ap.add_argument(
        "--plan-file",
        default=None,
        help="apply this plan (Plan.dump_json / --save-plan) instead of solving; it must "
        "have been made for the same model, mesh and input shape",
    )
    ap.add_argument("--save-plan", default=None, help="write the plan here (JSON; .gz compresses)")
    ap.add_argument("--report", default=None, help="write the HTML report of the plan here")
    ap.add_argument(
        "--mp",
        choices=["bf16", "fp32"],
        default=None,
        help="bf16: bf16 compute with fp32 gradient reduction (MixedPrecisionPolicy), as "
        "torchtitan trains LLaMA-3; fp32: no mixed precision (default: bf16, "
        "fp32 with --real on CPU)",
    )
    ap.add_argument(
        "--all-kinds", action="store_true", help="list the placements of every kind of op, not just weights and matmuls"
    )
    ap.add_argument("--no-apply", action="store_true", help="plan only")
    ap.add_argument(
        "--cudagraphs",
        action="store_true",
        help="run the applied step as captured CUDA graphs (a CUDA device only; see docs/cudagraphs.md)",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="compile the applied step's forward and backward graphs with Inductor, keeping the plan's "
        "saves, recomputes, buckets and collective order (see docs/compile.md)",
    )
    ap.add_argument(
        "--baselines",
        action="store_true",
        help="also plan, apply and estimate the hand layouts (DDP, FSDP, FSDP x TP + SP, HSDP) and print "
        "the plan's margin over each (each costs a solve and an apply)",
    )
    ap.add_argument("--real", action="store_true", help="train for real under torchrun (gloo on CPU, NCCL on GPU)")
    ap.add_argument("--steps", type=int, default=3, help="AdamW steps with --real")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate with --real")
    ap.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log the planner's detail (problem sizes, pruning, passes) and show tracebacks of errors",
    )
    ap.add_argument(
        "--chunk",
        nargs="*",
        default=None,
        metavar="PATTERN=MODE",
        help="chunk_regions: split these modules' work in two chunks so one chunk's communication "
        "overlaps the other's compute (no value: layers.*.attention=batch layers.*.feed_forward=batch)",
    )
    ap.add_argument(
        "--attention-kernel",
        choices=["cudnn", "flash", "efficient"],
        default=None,
        help="trace attention as this fused CUDA kernel (what a GPU runs; cuDNN on H100/H200), to plan on a CPU "
        "machine for GPUs (default: the kernel torch picks for the mesh's device)",
    )
    args = ap.parse_args(argv)
    if args.attention_kernel and args.real and not torch.cuda.is_available():
        ap.error("--attention-kernel traces a CUDA kernel: --real on a machine without a GPU cannot run it")
    if args.chunk is not None and args.no_apply:
        ap.error("--chunk chunks the applied graphs: it does nothing with --no-apply (drop one of them)")
    if args.compile and args.no_apply:
        ap.error("--compile compiles the applied step: it does nothing with --no-apply (drop one of them)")
    if args.cudagraphs and (args.no_apply or not torch.cuda.is_available()):
        ap.error("--cudagraphs runs the applied step on a CUDA device: it needs one, and no --no-apply")
    for flag in ("layers", "dim", "seq", "batch", "steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            ap.error(f"--{flag} must be positive, got {value}")
    try:
        DeviceSpec.get(args.device)
    except ValueError as exc:
        ap.error(f"--device: {exc}")
    if any(n < 1 for n in args.mesh):
        ap.error(f"--mesh sizes must be positive, got {args.mesh}")
    if args.mesh_names is None and len(args.mesh) > 4:
        ap.error(
            f"--mesh {args.mesh} has {len(args.mesh)} dims: name them with --mesh-names "
            "(the default names dp tp cp ep cover 4)"
        )
    if args.mesh_names is not None and len(set(args.mesh_names)) != len(args.mesh_names):
        ap.error(f"--mesh-names must be distinct, got {args.mesh_names}")
    if args.model is None:
        args.model = "debug" if args.real else "8B"
    if args.seq is None:
        args.seq = 256 if args.real else 8192
    if args.batch is None:
        args.batch = 8 if args.real else 32
    if args.dim is None and args.real and args.model == "debug":
        args.dim = 256
    if args.mp is None:
        args.mp = "fp32" if args.real and not torch.cuda.is_available() else "bf16"
    return args


def mp_policy(args: argparse.Namespace):
    if args.mp == "fp32":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def build_model(args: argparse.Namespace) -> tuple[Transformer, object]:
    config = LLAMA3_CONFIGS[args.model]
    config = dataclasses.replace(
        config,
        n_layers=args.layers or config.n_layers,
        dim=args.dim or config.dim,
        max_seq_len=max(args.seq, config.max_seq_len),
    )
    with torch.device("meta"):
        model = Transformer(config)
    if args.ac != "none":
        apply_ac(model, mode=args.ac)
    return model, config


def plan_model(args: argparse.Namespace, mesh, model, config):
    """Plan with tokens and logits split over dp (replicated over the other
    mesh dims); apply unless --no-apply. Returns (plan, parallel module or
    None, apply report or None, this run's stage times).

    Mistakes the arguments already show are caught before the trace: the
    batch against the dp ranks (``input_constraints``), the plan file (there,
    readable, made for this mesh and input shape), the --chunk patterns
    against the model's modules."""

    def inputs():
        return torch.randint(0, config.vocab_size, (args.batch, args.seq), device="meta")

    chunking = chunk_options(args.chunk)
    if chunking is not None:
        check_chunk_modules(chunking.chunk_modules, (name for name, _ in model.named_modules()))
    plan = preflight.load_plan_for(args.plan_file, mesh, inputs) if args.plan_file else None
    if args.dump_dir:
        os.makedirs(args.dump_dir, exist_ok=True)
        os.environ["AUTOPARALLEL_DUMP_DIR"] = args.dump_dir
    parallel = report = None
    # grad_reduction="mean": each rank's loss is the mean over its own tokens
    # and gradients are those of the global batch's mean loss, as DDP / FSDP
    with AutoParallel(
        model,
        mesh,
        inputs,
        device=args.device,
        mp_policy=mp_policy(args),
        input_constraints=[data_placements(mesh)],
        grad_reduction="mean",
        attention_kernel=args.attention_kernel,
    ) as autop:
        if Shard(1) not in data_placements(mesh):
            autop.add_output_constraints([data_placements(mesh)])
        # else: the sequence is split over a cp dim; the logits' layout is left to the planner and the cp role
        if args.memory_high is not None:
            autop.add_parameter_memory_constraint(high=args.memory_high)
        if plan is not None:
            if args.memory_high is not None:
                # the budget shaped the saved plan's solve; a loaded plan is applied as it is
                logger.warning(
                    "--memory-high %s is not used with --plan-file (the plan is not solved again)", args.memory_high
                )
        else:
            plan = autop.optimize_placement()
        if not args.no_apply:
            wall, cpu = time.perf_counter(), time.process_time()
            parallel = autop.apply_placement(
                plan, pass_options=chunking, cudagraphs=args.cudagraphs, compile=args.compile
            )
            report = ApplyReport.of(parallel, mesh, time.perf_counter() - wall, time.process_time() - cpu)
        if args.baselines:
            from autoparallel import baselines

            baselines.compare(autop, plan, apply=not args.no_apply, pass_options=chunking)
        timings = dict(autop.timings)
    return plan, parallel, report, timings


def chunk_options(values, default=("layers.*.attention=batch", "layers.*.feed_forward=batch")):
    """PassOptions for ``--chunk`` (None: no chunking; ``--chunk`` alone: the defaults)."""
    if values is None:
        return None
    from autoparallel.passes import PassOptions

    return PassOptions(chunk_modules=parse_chunk_args(values or default))


def chunking_failed(plan, values) -> str | None:
    """With ``--chunk``: print what chunk_regions did, one line per refusal
    reason; the error line when it changed nothing (else None)."""
    if values is None:
        return None
    stats = (plan.pass_stats or {}).get("chunk_regions")
    if stats is None:
        return "--chunk: chunk_regions did not run (the plan was not applied)"
    print("\n" + stats.summary())
    for line in stats.refusal_lines():
        print(line)
    return None if stats.regions_chunked else f"--chunk changed nothing: {stats.summary()}"


def mesh_names(args: argparse.Namespace, ndim: int) -> tuple[str, ...]:
    if args.mesh_names is None:
        return ("dp", "tp", "cp", "ep")[:ndim]
    if len(args.mesh_names) != ndim:
        raise SystemExit(f"--mesh-names needs {ndim} names for --mesh {args.mesh}, got {args.mesh_names}")
    return tuple(args.mesh_names)


# mesh dim names that carry the batch ("dp_shard", "data", "batch_replicate", ...)
DATA_PARALLEL_NAMES = ("dp", "data", "batch")


# mesh dim names that carry the sequence (context parallelism)
CONTEXT_PARALLEL_NAMES = ("cp", "context")


def data_placements(mesh) -> tuple:
    """The batch sharded over the data-parallel dims (names starting with
    :data:`DATA_PARALLEL_NAMES`; the first dim when none does), the sequence
    over the context-parallel dims (:data:`CONTEXT_PARALLEL_NAMES`),
    replicated over the others."""
    names = [n.lower() for n in (mesh.mesh_dim_names or ())]
    dp = [i for i, n in enumerate(names) if n.startswith(DATA_PARALLEL_NAMES)] or [0]
    cp = [i for i, n in enumerate(names) if n.startswith(CONTEXT_PARALLEL_NAMES) and i not in dp]
    return tuple(Shard(0) if i in dp else Shard(1) if i in cp else Replicate() for i in range(mesh.ndim))


def batch_replicas(mesh) -> int:
    """How many ranks hold each shard of the batch: the mesh size over the
    data-parallel dims' (2 on a 2x2x2 HSDP mesh, where the batch splits over
    dp_replicate and dp_shard; not mesh.size() // mesh.size(0))."""
    split = math.prod(mesh.size(i) for i, p in enumerate(data_placements(mesh)) if p == Shard(0))
    return mesh.size() // split


def main(argv=None) -> None:
    args = parse_args(argv)
    setup_logging(verbose=args.verbose, also=[logger.name])
    with user_errors(PROG, verbose=args.verbose):
        if args.real:
            return run_real(args)
        plan_fake(args)


def plan_fake(args: argparse.Namespace) -> None:
    """Plan (and apply) for the --mesh cluster on a fake process group."""
    world = math.prod(args.mesh)
    names = mesh_names(args, len(args.mesh))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", tuple(args.mesh), mesh_dim_names=names)
        t0 = time.perf_counter()
        model, config = build_model(args)
        print(
            f"LLaMA-3 {args.model}: {config.n_layers} layers, dim {config.dim}, "
            f"{count_text(count_params(model))} parameters, AC {args.ac}"
        )
        print(
            f"planning for {world} ranks, mesh {mesh_text(names, args.mesh)}, "
            f"batch {args.batch} x seq {args.seq}, device model {args.device}, "
            f"{'bf16 compute, fp32 gradient reduction' if args.mp == 'bf16' else 'fp32'}"
            + (f", plan from {args.plan_file}" if args.plan_file else "")
        )
        plan, _, report, timings = plan_model(args, mesh, model, config)
        total = time.perf_counter() - t0 - (report.wall if report else 0.0)
    finally:
        dist.destroy_process_group()
    print_report(plan, total, args.dump_dir, args.all_kinds, args.plan_file, timings)
    if report is not None:
        print_apply_report(plan, report)
    unchunked = chunking_failed(plan, args.chunk)
    if args.save_plan:
        plan.dump_json(args.save_plan)
        print(f"\nplan written to {args.save_plan} (apply it elsewhere: --plan-file {args.save_plan})")
    if args.report:
        plan.to_html(args.report, model=model_title(args, config))
        print(f"HTML report: {os.path.abspath(args.report)}")
    if unchunked:
        raise SystemExit(unchunked)


def mesh_text(names, shape) -> str:
    """``dp 16 x tp 8``."""
    return " x ".join(f"{n} {s}" for n, s in zip(names, shape))


def model_title(args: argparse.Namespace, config) -> str:
    """What the report's title calls the model: ``LLaMA-3 8B (32 layers, dim 4096)``."""
    return f"LLaMA-3 {args.model} ({config.n_layers} layers, dim {config.dim})"


# The ops whose placements tell the parallelism story (what runs sharded
# how); --all-kinds lists the element-wise and layout ops too.
STORY_OPS = (
    "aten.mm.default",
    "aten.bmm.default",
    "aten.addmm.default",
    "aten.embedding.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
)


def print_report(
    plan,
    total: float,
    dump_dir: str | None,
    all_kinds: bool = False,
    plan_file: str | None = None,
    timings: dict[str, float] | None = None,
) -> None:
    from autoparallel.problem import memory
    from autoparallel.report import LEGEND, describe

    print("\n== planning time ==")
    if plan_file:
        # this run traced and checked; the solve happened when the file was made
        t = timings or {}
        for stage in ("tracing", "options", "repeated_layers"):
            print(f"  {stage:16s} {t.get(stage, 0.0):7.2f} s")
        print(f"  {'solve':16s} {'-':>7s}   (plan from {plan_file})")
    else:
        t = plan.timings
        for stage in ("tracing", "options", "repeated_layers", "problem_build"):
            print(f"  {stage:16s} {t.get(stage, 0.0):7.2f} s")
        if "coarse_seed" in t:  # a problem too big for dense matrices: option pricing
            print(f"  {'coarse_seed':16s} {t['coarse_seed']:7.2f} s")
            print(f"  {'option pricing':16s} {t.get('solve', 0.0):7.2f} s")
            print(f"  {'problem_rebuild':16s} {t.get('problem_rebuild', 0.0):7.2f} s")
        else:
            for phase in ("presolve", "build", "solve"):
                print(f"  solver.{phase:9s} {t.get('solver.' + phase, 0.0):7.2f} s")
        print(f"  {'plan_report':16s} {t.get('plan_report', 0.0):7.2f} s")
    print(
        # ru_maxrss: KiB on Linux
        f"  {'total':16s} {total:7.2f} s   (peak RSS {units.size(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)})"
    )

    s = plan.solution
    pre = s.presolve
    print("\n== solver ==")
    gap = units.percent(s.gap)
    print(f"  {s.status} ({s.backend}, gap {gap}), {s.num_variables} variables, {s.num_constraints} constraints")
    if pre is not None:
        print(
            f"  presolve: {pre.decisions_before} -> {pre.decisions_after} decisions, "
            f"{pre.options_before} -> {pre.options_after} options"
        )

    print("\n== the plan ==")
    for line in describe(plan):
        print("  " + line)
    print()
    for line in LEGEND:
        print("  " + line)

    print("\n== estimated per step and rank ==")
    for line in numbers.step_lines(plan):
        print("  " + line)
    print(f"  memory per rank ({memory.UNIT_NOTE}):")
    for line in memory.breakdown(plan).lines():
        print("    " + line)
    if plan.baselines:
        from autoparallel import baselines

        print("\n== the plan against hand layouts ==")
        for line in baselines.table_lines(plan):
            print("  " + line)

    print("\n== placements by kind (mesh dims in order " + str(plan.mesh_dim_names) + ") ==")
    for kind in plan.placements_by_kind():
        if all_kinds or kind.role == "parameter" or kind.op in STORY_OPS:
            print("  " + str(kind))
    if dump_dir:
        print(
            f"\nsolver debug dumps: {os.path.abspath(dump_dir)}/"
            "{problem,solution,plan}.json  (re-solve: python -m solver "
            f"{os.path.join(dump_dir, 'problem.json')})"
        )


@dataclass
class ApplyReport:
    """What apply made, read while the mesh's process group is alive."""

    wall: float
    cpu: float
    stages: dict[str, float]  # local joint graph, partition (seconds)
    nodes: dict[str, int]  # joint / forward / backward graph sizes
    # (phase, kind, group: mesh dim name or whole mesh) -> (count, bytes per rank)
    collectives: dict[tuple[str, str, str], tuple[int, int]]

    @staticmethod
    def of(parallel, mesh, wall: float, cpu: float) -> "ApplyReport":
        st = parallel.parallel_state
        table: dict[tuple[str, str, str], tuple[int, int]] = {}
        for phase, gm in (("forward", parallel.forward_graph), ("backward", parallel.backward_graph)):
            # by graph, not by node tag: the backward graph also runs recomputed forward ops
            for c in collectives(gm, mesh):
                key = (phase, c.kind, c.group)
                count, size = table.get(key, (0, 0))
                table[key] = (count + 1, size + c.out_bytes)
        return ApplyReport(
            wall=wall,
            cpu=cpu,
            stages={"local joint graph": st.local.seconds, "partition": st.step.graphs.seconds},
            nodes={
                "joint": len(parallel.parallel_graph.graph.nodes),
                "forward": len(parallel.forward_graph.graph.nodes),
                "backward": len(parallel.backward_graph.graph.nodes),
            },
            collectives=table,
        )


def print_apply_report(plan, report: ApplyReport) -> None:
    print("\n== apply ==")
    for stage, seconds in report.stages.items():
        print(f"  {stage:18s} {seconds:7.2f} s")
    other = report.wall - sum(report.stages.values())
    print(f"  {'passes + module':18s} {other:7.2f} s")
    print(
        f"  {'total':18s} {report.wall:7.2f} s wall, {report.cpu:.2f} s CPU   "
        f"(graphs: joint {report.nodes['joint']}, forward {report.nodes['forward']}, "
        f"backward {report.nodes['backward']} nodes)"
    )
    print("\n== rewrite passes ==")
    if not plan.pass_stats:
        print("  (none ran)")
    for line in numbers.pass_stat_lines(plan):
        print(line)
    print("\n== collectives: traffic per rank and estimated time ==")
    for line in numbers.collective_lines(plan):
        print(line)
    print("\n== parallel graph collectives (per step, output bytes per rank; GB = 10^9 bytes) ==")
    if not report.collectives:
        print("  (none)")
        return
    rows = sorted(report.collectives.items(), key=lambda kv: (kv[0][0] != "forward", kv[0][1], kv[0][2]))
    table = [(phase, kind, group, f"x{count}", units.size(size)) for (phase, kind, group), (count, size) in rows]
    for phase in ("forward", "backward"):
        size = sum(v[1] for k, v in report.collectives.items() if k[0] == phase)
        table.append((phase, "total", "", "", units.size(size)))
    for line in numbers.format_table(("phase", "kind", "group", "count", "output/rank"), table, right=(4,)):
        print("  " + line)


@dataclass
class StepMeter:
    """Per-step figures as torchtitan logs them: loss, throughput, peak
    memory and model FLOPs utilisation. FLOPs per token: 6 x the
    non-embedding parameters (forward and backward matmuls) plus the
    attention scores, 12 x layers x dim x seq (torchtitan's estimate)."""

    flops_per_token: float
    tokens_per_step: int
    peak_flops: float | None  # FLOP/s of all ranks together; None on CPU
    device: torch.device
    device_name: str

    def __init__(self, model, config, args, world: int, device: torch.device):
        embedding = config.vocab_size * config.dim
        self.flops_per_token = 6 * (count_params(model) - embedding) + 12 * config.n_layers * config.dim * args.seq
        self.tokens_per_step = args.batch * args.seq
        self.device = device
        spec = DeviceSpec.get(args.device)
        peak = spec.peak_bf16 if args.mp == "bf16" else spec.peak_tf32
        # MFU against the --device preset's datasheet peak, on a GPU only
        self.peak_flops = peak * world if device.type == "cuda" else None
        self.device_name = args.device

    def describe(self) -> str:
        mfu = f"MFU against {self.device_name} peak" if self.peak_flops else "no MFU on CPU"
        return f"{self.tokens_per_step} tokens per step, {count_text(self.flops_per_token)} FLOP per token, {mfu}"

    def peak_memory(self) -> str:
        if self.device.type == "cuda":
            return f"peak memory {units.size(torch.cuda.max_memory_allocated(self.device))}"
        # ru_maxrss: KiB on Linux
        return f"peak RSS {units.size(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}"

    def line(self, step: int, loss: float, seconds: float) -> str:
        tps = self.tokens_per_step / seconds
        mfu = f"  mfu {100 * self.flops_per_token * tps / self.peak_flops:.2f}%" if self.peak_flops else ""
        return (
            f"step {step}: loss {loss:.4f}  tokens/s {tps:,.0f}  {self.peak_memory()}{mfu}  ({units.seconds(seconds)})"
        )


def run_real(args: argparse.Namespace) -> None:
    """Plan, apply and train a few steps on the torchrun process group."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        shape = tuple(args.mesh) if math.prod(args.mesh) == world else (world,)
        names = mesh_names(args, len(shape)) if len(shape) == len(args.mesh) else ("dp",)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        model, config = build_model(args)
        if rank == 0:
            print(
                f"LLaMA-3 {args.model}: {config.n_layers} layers, dim {config.dim}, "
                f"{count_text(count_params(model))} parameters, AC {args.ac}; "
                f"{world} ranks ({dist.get_backend()}), mesh {mesh_text(names, shape)}, "
                f"batch {args.batch} x seq {args.seq}"
            )
        args.no_apply = False
        t0 = time.perf_counter()
        plan, parallel, report, _ = plan_model(args, mesh, model, config)
        if rank == 0:
            print(f"planned in {time.perf_counter() - t0 - report.wall:.2f} s, applied in {report.wall:.2f} s")
            from autoparallel.report import describe

            print("\n== the plan ==")
            for line in describe(plan):
                print("  " + line)
            print_apply_report(plan, report)

        parallel.to_empty(device=device)
        torch.manual_seed(0)
        with torch.no_grad():
            parallel.init_weights()
        opt = torch.optim.AdamW(parallel.parameters(), lr=args.lr)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)
        labels = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)
        # This rank's shard of the batch, as the input placement says (no communication).
        placements = data_placements(mesh)
        local_tokens = distribute_tensor(tokens, mesh, placements, src_data_rank=None).to_local().to(device)
        local_labels = distribute_tensor(labels, mesh, placements, src_data_rank=None).to_local().to(device)
        meter = StepMeter(model, config, args, world, device)
        if rank == 0:
            print(f"\n== training ({meter.describe()}) ==")
        for step in range(args.steps):
            t = time.perf_counter()
            logits = parallel(local_tokens)
            # the mean over this rank's tokens; grad_reduction="mean" averages
            # over the data-parallel shards, so the gradients are the global mean's
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), local_labels.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            # the global loss: the mean of the ranks' (equal-sized) shard means; .item() waits for the step
            global_loss = total.item() / world
            logger.info("%s", meter.line(step, global_loss, time.perf_counter() - t))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
