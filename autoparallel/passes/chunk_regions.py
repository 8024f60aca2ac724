"""Split selected module regions into two chunks so one chunk's communication
overlaps the other's compute.

Opt-in: ``PassOptions(chunk_modules={"layers.*.moe": "batch",
"layers.*.attention": "seq"})`` (module-path patterns, ``*`` one path
component; the dim to split). The pass runs on the rank-local joint graph,
before the forward/backward split, so the partitioner and the recompute tags
see the chunked graph.

For each module instance a pattern matches (``layers.3.moe``) the region is
every joint node whose module path is in it, forward and backward. Then:

* **Which values carry the split dim.** The step's user inputs carry it at a
  known dim (batch: 0, seq: 1) and tangents like their forward outputs; it
  is propagated through the whole graph by *probing*: each op is run on fake
  inputs whose split dim is halved, and the output dim whose size halved is
  the output's split dim (none halved: the op reduced it away; several, or
  not by half: ambiguous). Ops with size arguments (``view``, ``expand``,
  ``slice_backward``...) get their sizes rewritten by shape factorisation.
  No value is matched by its size alone, so a batch equal to the sequence
  length (or the hidden size) cannot be mistaken for it. (:mod:`.chunk_dims`)
* **Live-ins** that carry it (activations, incoming gradients) are split in
  two (``split`` views); the others (parameters, their all-gather/cast
  chains, reduced values) are shared and never duplicated. A value without
  the split dim that a chunked op broadcasts against it at full size (an
  attention mask or bias built outside the region with the literal batch,
  a position table under sequence chunking, a constant fill) is split too,
  where it is read: each chunk reads its own half.
* **Duplication**: only the region nodes that depend on a split live-in;
  the original node becomes chunk A (on the halves), a copy right after it
  chunk B. The node-by-node interleave is what ``schedule_overlap`` needs:
  it issues chunk A's collective as soon as its input exists and waits as
  late as possible, so chunk B's compute runs while A's collective is in
  flight, under its usual compute cap and memory limit.
* **Escaping values**: split-dim values used outside the region are
  concatenated; sums over the split dim (weight gradients: ``mm`` over the
  tokens, ``sum``) are added at once, before any gradient collective, so
  gradient communication is not doubled (``chunk_early_grad_sum=False``:
  each chunk's sum goes through its own collectives where they are linear,
  added where it leaves the region).
* **Refusals** (a stats entry with the reason, the region left as is): a
  reduction across the split dim other than a sum (a norm or mean over the
  batch), a sum used together with per-chunk values, ops acting along the
  split dim (softmax, cat, slicing), attention under sequence chunking, an
  odd or ambiguous split size, random ops, live-ins whose split dim cannot
  be told.

Redistributions (apply's layout changes, tagged ``REDISTRIBUTE_KEY``) keep
their dims' meaning outside regions; inside a region they run per chunk, as
redistributing each eager chunk would (a ``[group, per-rank]`` reshape keeps
the mesh group factor and halves the per-rank one; its inverse merges them
back). A value gathered over a mesh dim along the split dim holds a chunk's
rows rank by rank, interleaved with the other chunk's (its *grouping*,
:func:`~.chunk_dims.merge_factor`, :func:`~.chunk_dims.rows_of_chunk`); a
scatter divides the grouping again. Values an op combines must share their
grouping (row ``i`` of each is the same token). Where they do not (the
region gathers the gradient's rows and pairs them with rows gathered before
it, as a sequence-parallel layer does), ``chunk_exactness="tolerance"`` (the
default) splits the live-ins they come from rank by rank instead of in
contiguous halves, and a value leaving the region with rows grouped rank by
rank is rebuilt rank by rank; ``"bitwise"`` refuses such regions.

Limits (refused, with the reason in the stats): a split dim that a reshape
merges with an outer dim (sequence chunking where batch and sequence are
flattened together with a batch > 1), one row per rank (nothing to split),
factories whose sizes do not follow a split value. When nothing was
chunked the pass says so in one warning line, with one line per refusal
reason (:meth:`ChunkRegionsStats.refusal_lines`).

Buffer mutations stay where they are: their new values are rebuilt from
both chunks (concatenated or summed) before the mutation output reads them.
With ``chunk_exactness="bitwise"`` the result is exactly eager module-level
chunking (run the module on each contiguous half, concatenate): the same
ops on the same halves, gradients added once. With ``"tolerance"`` the
halves may be every rank's half instead; either way the step equals the
unchunked one up to the order in which each sum over the split dim adds
its terms (two partial sums added once): within ``2 * n * eps`` of the
terms' magnitude for a sum of ``n`` terms (docs/chunking.md).

The analysis (which regions can be chunked, what to split and duplicate,
the refusal reasons) is :mod:`.chunk_analysis`; this module rewrites the
graph per its :class:`~.chunk_analysis.RegionPlan` and reports.

>>> # stats = chunk_regions(local.gm, ctx)   # doctest: +SKIP
>>> # ChunkRegionsStats(regions_chunked=2, refusals={reason: count}, nodes_added=310, ...)
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..capture.tracing import module_path
from .base import ChunkExactness, ChunkMode, PassContext, register_pass
from .chunk_analysis import (
    MODE_INPUT_DIM,
    RegionPlan,
    find_regions,
    plan_region,
    reason_key,
    region_of,
    split_seeds,
)
from .chunk_dims import (
    PER_CHUNK,
    MESH_SIZES,
    REDUCED,
    ChunkRefused,
    stamp_like,
    fake_mode_of,
    fake_val,
    propagate_split_dims,
)

__all__ = [
    "CHUNK_KEY",
    "ChunkRefused",
    "ChunkRegionsStats",
    "RegionReport",
    "chunk_graph",
    "chunk_regions",
    "exposed_comm_by_region",
    "region_of",
]

logger = logging.getLogger(__name__)

# node.meta key: (region, chunk 0 or 1) on the nodes this pass duplicated
CHUNK_KEY = "ap_chunk"
_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional


@dataclass
class RegionReport:
    region: str  # module path of the instance (layers.3.moe)
    mode: ChunkMode
    chunked: bool
    reason: str = ""  # why refused
    nodes_added: int = 0
    live_ins_split: int = 0
    live_ins_shared: int = 0
    exposed_comm_before_s: float = 0.0  # estimated, this region's collectives
    exposed_comm_after_s: float = 0.0


@dataclass
class ChunkRegionsStats:
    regions_chunked: int = 0
    regions_refused: int = 0
    # refusal reason -> how many regions (of the unfolded model) it refused
    refusals: dict[str, int] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict, metadata={"json": False})  # region -> reason
    # region -> its key in ``refusals`` (the reason without graph node names)
    reason_keys: dict[str, str] = field(default_factory=dict, repr=False, metadata={"json": False})
    nodes_added: int = 0
    live_ins_split: int = 0
    live_ins_shared: int = 0
    # estimated exposed communication of the chunked regions' collectives
    # (joint graph in the overlap scheduler's order), summed over regions
    exposed_comm_before_s: float = 0.0
    exposed_comm_after_s: float = 0.0
    # per chunked region instance: "+N nodes, exposed X -> Y us" (refused
    # ones are in ``refused``); the detail is in ``reports``
    chunked: dict[str, str] = field(default_factory=dict)
    reports: list[RegionReport] = field(default_factory=list, repr=False, metadata={"json": False})

    def summary(self) -> str:
        """One line: what was chunked, or that nothing was and why."""
        if self.regions_chunked:
            head = f"chunk_regions: {self.regions_chunked} region(s) chunked, +{self.nodes_added} nodes"
            return head + (f", {self.regions_refused} refused" if self.regions_refused else "")
        if not self.regions_refused:
            return "chunk_regions: nothing chunked: no node belongs to a module matching the patterns"
        return f"chunk_regions: nothing chunked: all {self.regions_refused} matching region(s) refused"

    def refusal_lines(self, limit: int = 5) -> list[str]:
        """One line per distinct refusal reason, most frequent first, with
        the regions it refused (first and last named)."""
        by_key: dict[str, list[str]] = {}
        for region, why in self.refused.items():
            by_key.setdefault(self.reason_keys.get(region, why), []).append(region)
        lines = []
        for key, regions in sorted(by_key.items(), key=lambda kv: -self.refusals.get(kv[0], len(kv[1]))):
            n = self.refusals.get(key, len(regions))
            where = regions[0] if len(regions) == 1 else f"{regions[0]} ... {regions[-1]}"
            lines.append(f"  refused {n} ({where}): {self.refused[regions[0]]}")
        if len(lines) > limit:
            lines = lines[:limit] + [f"  ... and {len(lines) - limit} other reason(s)"]
        return lines


# ---------------------------------------------------------------------------
# the rewrite


def _apply(gm: fx.GraphModule, plan: RegionPlan) -> int:
    """Rewrite ``gm`` per ``plan``; returns how many nodes were added."""

    g = gm.graph
    before = len(g.nodes)
    dep = set(plan.nodes)
    a_of: dict[fx.Node, fx.Node] = {}
    b_of: dict[fx.Node, fx.Node] = {}
    first_use = {}
    for n in plan.nodes:
        for a in n.all_input_nodes:
            if a in plan.live_ins and a not in first_use:
                first_use[a] = n
    for x, d in plan.live_ins.items():
        a_of[x], b_of[x] = _split_before(g, x, d, first_use[x], "chunk_split", plan.groups.get(x, 1))
    for f, d in plan.partners.items():
        n0 = next(u for u in plan.nodes if f in u.all_input_nodes)
        a_of[f], b_of[f] = _split_before(g, f, d, n0, "chunk_partner", plan.groups.get(f, 1))
    for n in plan.nodes:
        out, (args, kwargs) = plan.probe[n]

        def to_b(a):
            return b_of.get(a, a)

        def to_a(a):
            return a_of.get(a, a)

        b_args = fx.node.map_arg(args, to_b)
        b_kwargs = fx.node.map_arg(kwargs, to_b)
        with g.inserting_after(n):
            b = g.create_node("call_function", n.target, b_args, b_kwargs, name=f"{n.name}_chunk1")
        b.meta = dict(n.meta)
        stamp_like(b, n, "chunk1")
        n.args = fx.node.map_arg(args, to_a)
        n.kwargs = fx.node.map_arg(kwargs, to_a)
        n.meta["val"] = out
        b.meta["val"] = _rerun(b, out)
        n.meta[CHUNK_KEY] = (plan.region, 0)
        b.meta[CHUNK_KEY] = (plan.region, 1)
        a_of[n], b_of[n] = n, b
    # rebuild the values that leave the chunked part
    for n in plan.nodes:
        st = plan.state[n]
        if isinstance(st, tuple) or st == PER_CHUNK:
            continue  # multi-output op: its getitems are rebuilt; per-chunk values stay inside
        outside = [u for u in n.users if u not in dep and u is not b_of[n]]
        if not outside:
            continue
        b = b_of[n]
        groups = plan.groups.get(n, 1)
        with g.inserting_before(b.next):
            if st == REDUCED:
                j = g.call_function(_aten.add.Tensor, (n, b))
            elif groups == 1:
                j = g.call_function(_aten.cat.default, ([n, b], st))
            else:
                j = _join_by_rank(g, n, b, st, groups)
        j.meta = {k: v for k, v in n.meta.items() if k not in (CHUNK_KEY,)}
        j.meta["val"] = _rerun(j, None)
        stamp_like(j, n, "chunk_join")
        for u in outside:
            u.replace_input_with(n, j)
        plan.joins[j] = n
    return len(g.nodes) - before


def _with_meta(new: fx.Node, like: fx.Node, tag) -> fx.Node:
    """``new`` gets ``like``'s module path and AC tags, its fake value from
    its inputs and a fold stamp of its own."""
    for key in ("custom", "recompute", "ac_graph_id", "partitioner_tag", "stack_trace", "nn_module_stack"):
        if key in like.meta:
            new.meta[key] = like.meta[key]
    new.meta["val"] = _rerun(new, None)
    stamp_like(new, like, tag)
    return new


def _contiguous_view(g: fx.Graph, x: fx.Node, shape: list[int], like: fx.Node, tag) -> fx.Node:
    """``x`` viewed as ``shape``, copied first where its layout cannot be
    viewed so (a chunk's rows of every group are strided)."""
    if not fake_val(x).is_contiguous():
        x = _with_meta(
            g.call_function(_aten.clone.default, (x,), {"memory_format": torch.contiguous_format}), like, (tag, "copy")
        )
    return _with_meta(g.call_function(_aten.view.default, (x, shape)), like, (tag, "view"))


def _join_by_rank(g: fx.Graph, a: fx.Node, b: fx.Node, d: int, groups: int) -> fx.Node:
    """The whole value from chunk A's and B's rows along ``d``, each the
    first or second half of every one of ``groups`` groups
    (:func:`~.chunk_dims.rows_of_chunk`): both viewed ``[groups, half]``,
    concatenated along the halves, merged back (inserted at the graph's
    insert point). The returned node's meta is the caller's to set."""
    shape = list(fake_val(a).shape)
    grouped = shape[:d] + [groups, shape[d] // groups] + shape[d + 1 :]
    whole = shape[:d] + [2 * shape[d]] + shape[d + 1 :]
    va = _contiguous_view(g, a, grouped, a, ("chunk_join_rows", 0))
    vb = _contiguous_view(g, b, grouped, a, ("chunk_join_rows", 1))
    cat = _with_meta(g.call_function(_aten.cat.default, ([va, vb], d + 1)), a, "chunk_join_cat")
    return g.call_function(_aten.view.default, (cat, whole))


def _split_before(g: fx.Graph, x: fx.Node, d: int, n0: fx.Node, tag: str, groups: int = 1) -> tuple[fx.Node, fx.Node]:
    """Split ``x`` in two halves along ``d`` right before its first chunked
    consumer ``n0``; the halves (chunk A's, chunk B's). ``groups > 1``: each half is the first or second half of
    every one of ``groups`` groups of rows (:func:`~.chunk_dims.rows_of_chunk`)."""
    from ..apply.unfold import FOLD_KEY

    v = fake_val(x)
    shape = list(v.shape)
    made: list[fx.Node] = []
    src, at = x, d
    with g.inserting_before(n0):
        if groups > 1:
            if not v.is_contiguous():
                src = g.call_function(_aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
                made.append(src)
            src = g.call_function(_aten.view.default, (src, shape[:d] + [groups, shape[d] // groups] + shape[d + 1 :]))
            made.append(src)
            at = d + 1
        size = fake_val(x).shape[d] // (2 * groups)
        sp = g.call_function(_aten.split.Tensor, (src, size, at))
        ha = g.call_function(operator.getitem, (sp, 0))
        hb = g.call_function(operator.getitem, (sp, 1))
        made += [sp, ha, hb]
        if groups > 1:
            half = shape[:d] + [shape[d] // 2] + shape[d + 1 :]
            halves = []
            for h in (ha, hb):
                c = g.call_function(_aten.clone.default, (h,), {"memory_format": torch.contiguous_format})
                halves.append(g.call_function(_aten.view.default, (c, half)))
                made += [c, halves[-1]]
            ha, hb = halves
    with fake_mode_of([v]) or _null():
        for m in made:
            m.meta["val"] = _rerun(m, None)
    for k, m in enumerate(made):
        # the consumer's module path and AC tags; folded like the split value
        for key in ("custom", "recompute", "ac_graph_id", "partitioner_tag", "stack_trace", "nn_module_stack"):
            if key in n0.meta:
                m.meta[key] = n0.meta[key]
        if FOLD_KEY in n0.meta:
            key = x.meta.get(FOLD_KEY, (None, x.name))[1]
            m.meta[FOLD_KEY] = (n0.meta[FOLD_KEY][0], (tag, key, k))
    return ha, hb


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _rerun(n: fx.Node, fallback):
    """Fake value of ``n`` from its inputs' values."""
    vals = [fake_val(a) for a in n.all_input_nodes]
    mode = fake_mode_of(vals if not isinstance(vals[0], (tuple, list)) else list(vals[0]) + vals[1:])
    args = fx.node.map_arg(n.args, fake_val)
    kwargs = fx.node.map_arg(n.kwargs, fake_val)
    if n.target is operator.getitem:
        return args[0][args[1]]
    if mode is None:
        return fallback
    with mode:
        return n.target(*args, **kwargs)


# ---------------------------------------------------------------------------
# estimates


def exposed_comm_by_region(nodes: list[fx.Node], costs, regions: dict[str, str], only=None) -> dict[str, float]:
    """Estimated exposed communication (seconds) per region, for ``nodes``
    run in this order: the streams' clock of
    :mod:`.overlap_model` (its Clock), each wait's stall charged to the region of its
    collective (``regions``: pattern -> mode, as ``chunk_modules``);
    ``only``: charge these collectives only (others still take time)."""
    from .overlap_model import Clock, Info

    info = Info(list(nodes), costs)
    clock = Clock(info)
    out: dict[str, float] = {}
    for n in nodes:
        span = clock.run(n)
        k = info.kind[n]
        if k == 2 and span is not None:  # a stall: charged to its collective's region
            charged, seconds = n.args[0], span[1] - span[0]
        elif k == 3 and info.blocking.get(n):  # communication inside the op
            charged, seconds = n, info.blocking[n]
        else:
            continue
        if only is not None and charged not in only:
            continue
        path = module_path(charged)
        r = next((region_of(path, p) for p in regions if region_of(path, p)), None)
        if r is not None:
            out[r] = out.get(r, 0.0) + seconds
    return out


def _scheduled_exposure(gm: fx.GraphModule, ctx, modules: dict[str, ChunkMode]) -> dict[str, float]:
    """:func:`exposed_comm_by_region` of ``gm`` in ``schedule_overlap``'s order."""
    from .overlap_model import Costs
    from .schedule_overlap import ScheduleStats, schedule_order

    try:
        costs = Costs(ctx)
        order = schedule_order(gm, ctx, ScheduleStats(), costs)
        return exposed_comm_by_region(order, costs, modules)
    except Exception as e:  # an estimate only: never fail the pass on it
        logger.warning("chunk_regions: no exposure estimate: %s", e)
        return {}


# ---------------------------------------------------------------------------
# entry points


def chunk_graph(
    gm: fx.GraphModule,
    modules: dict[str, ChunkMode],
    seeds: dict[str, dict[fx.Node, int]],
    ctx: PassContext | None = None,
    *,
    copies=lambda node: 1,
    early_sums: bool = True,
    exactness: ChunkExactness = "tolerance",
) -> ChunkRegionsStats:
    """Chunk the regions of ``gm`` that ``modules`` (pattern -> "batch" or
    "seq") names, in place. ``seeds``: mode -> {placeholder: dim} where the
    split dim starts (user inputs, tangents). ``exactness``: see
    :func:`~.chunk_analysis.plan_region`."""
    for pattern, mode in modules.items():
        if mode not in MODE_INPUT_DIM:
            raise ValueError(f"chunk_modules[{pattern!r}] = {mode!r}: the mode must be one of {sorted(MODE_INPUT_DIM)}")
    stats = ChunkRegionsStats()
    mesh = getattr(ctx, "mesh", None)
    token = MESH_SIZES.set(frozenset(mesh.shape) if mesh is not None else frozenset())
    try:
        return _chunk_graph(gm, modules, seeds, ctx, copies, stats, early_sums, exactness)
    finally:
        MESH_SIZES.reset(token)


def _chunk_graph(gm, modules, seeds, ctx, copies, stats, early_sums, exactness) -> ChunkRegionsStats:
    regions = find_regions(gm, modules)
    if not regions:
        logger.warning("chunk_regions: nothing chunked: no node belongs to a module matching %s", sorted(modules))
        return stats
    before = _scheduled_exposure(gm, ctx, modules)
    names = {n.name for n in gm.graph.nodes}
    whys: dict[str, dict[fx.Node, str]] = {m: {} for m, _ in regions.values()}
    dims_by_mode = {mode: propagate_split_dims(gm, seeds.get(mode, {}), whys[mode]) for mode in whys}
    for region, (mode, members) in regions.items():
        rep = RegionReport(region, mode, chunked=False)
        n_copies = copies(members[0])
        try:
            plan = plan_region(region, mode, members, dims_by_mode[mode], early_sums, whys[mode], exactness)
        except ChunkRefused as e:
            rep.reason = str(e)
            stats.regions_refused += n_copies
            stats.refused[region] = rep.reason
            key = stats.reason_keys[region] = reason_key(rep.reason, names)
            stats.refusals[key] = stats.refusals.get(key, 0) + n_copies
            logger.debug("chunk_regions: %s (%s) refused: %s", region, mode, rep.reason)
            stats.reports.append(rep)
            continue
        rep.nodes_added = _apply(gm, plan)
        rep.chunked = True
        rep.live_ins_split, rep.live_ins_shared = len(plan.live_ins), plan.shared
        stats.regions_chunked += n_copies
        stats.nodes_added += n_copies * rep.nodes_added
        stats.live_ins_split += n_copies * rep.live_ins_split
        stats.live_ins_shared += n_copies * rep.live_ins_shared
        stats.reports.append(rep)
        # later regions read rebuilt values: same split dim as the originals
        for dims in dims_by_mode.values():
            for j, n in plan.joins.items():
                dims[j] = dims.get(n, REDUCED)
    gm.graph.lint()
    gm.recompile()
    if stats.regions_chunked:
        after = _scheduled_exposure(gm, ctx, modules)
        for rep in stats.reports:
            rep.exposed_comm_before_s = before.get(rep.region, 0.0)
            rep.exposed_comm_after_s = after.get(rep.region, 0.0)
            if rep.chunked:
                n_copies = copies(next(n for n in gm.graph.nodes if n.meta.get(CHUNK_KEY, (None,))[0] == rep.region))
                stats.exposed_comm_before_s += rep.exposed_comm_before_s * n_copies
                stats.exposed_comm_after_s += rep.exposed_comm_after_s * n_copies
    from solver.units import seconds

    for rep in stats.reports:
        if rep.chunked:
            stats.chunked[rep.region] = (
                f"+{rep.nodes_added} nodes, exposed communication {seconds(rep.exposed_comm_before_s)} -> "
                f"{seconds(rep.exposed_comm_after_s)}"
            )
    if stats.refused:
        # the user asked for chunking: say plainly when it changed nothing
        log = logger.warning if not stats.regions_chunked else logger.info
        log("%s\n%s", stats.summary(), "\n".join(stats.refusal_lines()))
    return stats


@register_pass("chunk_regions", "joint")
def chunk_regions(gm: fx.GraphModule, ctx: PassContext) -> ChunkRegionsStats | None:
    """Chunk ``PassOptions.chunk_modules``'s regions of the joint graph (see
    the module docstring); a no-op (None) when no module is named."""
    modules = getattr(ctx.options, "chunk_modules", None)
    if not modules:
        return None
    if ctx.local is None:
        raise ValueError("chunk_regions runs on a rank-local joint graph (ctx.local is not set)")
    early = getattr(ctx.options, "chunk_early_grad_sum", True)
    exactness = getattr(ctx.options, "chunk_exactness", "tolerance")
    return chunk_graph(
        gm, dict(modules), split_seeds(gm, ctx), ctx, copies=ctx.copies, early_sums=early, exactness=exactness
    )
