"""The pass contract: :class:`PassOptions`, :class:`PassContext`,
:func:`register_pass`, the run order :data:`PASS_ORDER` and
:func:`run_stage` (see the package docstring). Pass modules import these
from here; :mod:`autoparallel.passes` re-exports them."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Mapping, Protocol

if TYPE_CHECKING:
    import torch.fx as fx
    from torch.distributed.device_mesh import DeviceMesh

    from ..apply.local_graph import LocalJoint
    from ..capture.tracing import TracedStep
    from ..options.strategies import NodeStrategy

# the package's logger: the passes' log lines read "autoparallel.passes"
logger = logging.getLogger(__package__)

Stage = Literal["plan", "joint", "graphs"]
# Which graph a "graphs"-stage pass is called on.
GraphKind = Literal["forward", "backward"]
# How fuse_all_gathers gathers chains whose first gather is on the first
# mesh dim (see PassOptions.column_major_all_gather).
ColumnMajorAllGather = Literal["group", "reorder"]
# Which dim chunk_regions splits a region's work along (user inputs are
# [batch, seq, ...]).
ChunkMode = Literal["batch", "seq"]
# chunk_regions' promise: "bitwise", every chunk computes what the region
# computes on contiguous halves of its inputs; "tolerance", chunks may also
# hold every rank's half of rows gathered over a mesh dim (equal to the
# unchunked step up to the order of floating-point sums over the split dim)
ChunkExactness = Literal["bitwise", "tolerance"]


@dataclass
class PassOptions:
    """Knobs of the passes (``apply_placement(..., pass_options=...)``)."""

    # FSDP-style: re-gather parameters in backward instead of saving the
    # gathered weights (False: ZeRO-2 style, keep them).
    reshard_after_forward: bool = True
    # Overlap scheduling: most compute ops between two reduce-scatters in
    # backward, and how many layers of parameter all-gathers to prefetch.
    max_consecutive_compute: int = 8
    prefetch_layers: int = 1
    # Bucketing (bucket_collectives): a layer's parameter all-gathers, and
    # its gradient reduce-scatters / all-reduces, on the same group and dtype
    # become one collective of at most this many input bytes per rank (0:
    # off). FSDP2 gathers a whole block per collective; 64 MiB holds a
    # LLaMA-3 8B block's bf16 shard down to 8-way sharding, and the pass
    # lowers the limit where the estimated peak memory would grow > 5%.
    bucket_bytes: int = 64 << 20
    # ... and by how much (a fraction) bucketing may raise the estimated peak.
    bucket_peak_growth: float = 0.05
    # fuse_all_gathers on chains that gather the first mesh dim first
    # (tp-outer parameters): "group" gathers on a column-major process
    # group; "reorder" on the row-major one, then reorders the chunks locally
    # (what LocalTensorMode can simulate: it only knows sorted groups).
    column_major_all_gather: ColumnMajorAllGather = "group"
    # chunk_regions (opt-in): module-path pattern ("layers.*.moe", "*" one
    # path component) -> "batch" or "seq": split those modules' work in two
    # chunks so one chunk's communication overlaps the other's compute.
    chunk_modules: dict[str, ChunkMode] | None = None
    # ... True: a chunked region's sums over the split dim (weight gradients)
    # are added at once, before their collectives (one reduce-scatter);
    # False: each chunk's goes through its own reduce-scatter, added after
    # (chunk A's overlaps chunk B's compute; twice the gradient bytes).
    chunk_early_grad_sum: bool = True
    # ... "tolerance" (default) or "bitwise": see ChunkExactness and
    # docs/chunking.md (the bound on the difference from the unchunked step).
    chunk_exactness: ChunkExactness = "tolerance"


class PlanNodeEntry(Protocol):
    """A plan's entry for one graph node as passes update it (an
    :class:`autoparallel.plan.NodePlan`)."""

    comm_cost: float
    # (producer name, producer placement, seconds) for non-free transitions
    incoming: list[tuple[str, str, float]]


class PlanLike(Protocol):
    """What passes read of an :class:`autoparallel.plan.Plan`: its per-node
    entries. A Protocol, since plan.py sits above passes (it stores their
    stats) and passes may not import it."""

    @property
    def nodes(self) -> Mapping[str, PlanNodeEntry]: ...


@dataclass
class PassContext:
    """What passes may read: the mesh, the plan and the apply state so far."""

    mesh: DeviceMesh
    plan: PlanLike
    options: PassOptions = field(default_factory=PassOptions)
    # Set by apply as it goes (None until that stage).
    traced: TracedStep | None = None
    strategies: dict[fx.Node, NodeStrategy] | None = None
    choice: dict[str, int] | None = None  # node name -> option index (mutable in "plan")
    local: LocalJoint | None = None  # the rank-local joint graph ("joint" and later)
    graph_kind: GraphKind | None = None  # during "graphs"
    # Layer folding (autoparallel.apply.fold): a "joint"-stage pass sees a
    # joint graph in which one representative stands for several identical
    # transformer layers; node name -> how many layers it stands for.
    # Stats count a node ``copies(node)`` times so they describe the model.
    folded_copies: dict[str, int] = field(default_factory=dict)

    def copies(self, node: fx.Node) -> int:
        """How many nodes of the unfolded graph ``node`` stands for (1 unless folded)."""
        return self.folded_copies.get(node.name, 1)


PassFn = Callable[..., Any]


@dataclass(frozen=True)
class PassSpec:
    name: str
    stage: Stage
    fn: PassFn  # plan: fn(ctx); joint: fn(gm, ctx); graphs: fn(gm, ctx)


# Run order of the passes within their stage (a pass must be listed here).
PASS_ORDER: tuple[str, ...] = (
    # "plan"
    "remove_alias_round_trips",
    # "joint": the MoE op split into phases first, so that chunk_regions can
    # chunk its all-to-alls; recompute tags last, on the final gather chains.
    "split_moe_a2a",
    "chunk_regions",
    "recompute_all_gathers",
    # "graphs": chains fused into one all-gather before bucketing merges
    # collectives; the overlap scheduler last, on the final collectives.
    "fuse_all_gathers",
    "bucket_collectives",
    "schedule_overlap",
)

# The registered passes, kept in PASS_ORDER.
PASSES: list[PassSpec] = []


def register_pass(name: str, stage: Stage) -> Callable[[PassFn], PassFn]:
    """Decorator adding a pass to :data:`PASSES` (names are unique and listed
    in :data:`PASS_ORDER`, which decides when it runs)."""

    def wrap(fn: PassFn) -> PassFn:
        if name not in PASS_ORDER:
            raise ValueError(f"pass {name!r} is not in PASS_ORDER {PASS_ORDER}: add it where it should run")
        if any(p.name == name for p in PASSES):
            raise ValueError(f"a pass named {name!r} is already registered")
        PASSES.append(PassSpec(name, stage, fn))
        PASSES.sort(key=lambda p: PASS_ORDER.index(p.name))
        return fn

    return wrap


def pass_names() -> list[str]:
    return [p.name for p in PASSES]


def check_disabled(disabled: Iterable[str]) -> frozenset[str]:
    disabled = frozenset(disabled)
    unknown = disabled - set(pass_names())
    if unknown:
        raise ValueError(f"unknown pass(es) {sorted(unknown)}; passes are {pass_names()}")
    return disabled


def run_stage(stage: Stage, ctx: PassContext, disabled: frozenset[str], *targets) -> dict[str, Any]:
    """Run the enabled passes of ``stage``; returns name -> stats (a dict of
    graph kind -> stats for the "graphs" stage)."""
    results: dict[str, Any] = {}
    for spec in PASSES:
        if spec.stage != stage or spec.name in disabled:
            continue
        t0 = time.perf_counter()
        if stage == "plan":
            stats = spec.fn(ctx)
        elif stage == "joint":
            stats = spec.fn(targets[0], ctx)
        else:
            stats = {}
            for kind, gm in zip(("forward", "backward"), targets):
                ctx.graph_kind = kind
                stats[kind] = spec.fn(gm, ctx)
            ctx.graph_kind = None
        logger.info("pass %s: %s (%.2fs)", spec.name, stats, time.perf_counter() - t0)
        if stats is not None:  # None: an opt-in pass that was not asked for
            results[spec.name] = stats
    return results


def stats_to_json(stats: Any) -> Any:
    """Plain data of a stats object (dataclasses, dicts of them)."""
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        # fields marked metadata={"json": False} are detail for callers, not the dump
        skip = {f.name for f in dataclasses.fields(stats) if f.metadata.get("json") is False}
        return {k: stats_to_json(v) for k, v in dataclasses.asdict(stats).items() if k not in skip}
    if isinstance(stats, dict):
        return {str(k): stats_to_json(v) for k, v in stats.items()}
    if isinstance(stats, (list, tuple)):
        return [stats_to_json(v) for v in stats]
    if isinstance(stats, (int, float, str, bool)) or stats is None:
        return stats
    return str(stats)
