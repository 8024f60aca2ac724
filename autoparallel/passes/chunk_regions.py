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
rows rank by rank, interleaved with the other chunk's: fine inside the
region (row-wise ops, sums), refused where it would leave it before being
scattered back (:func:`~.chunk_dims.merge_depth`).

Limits (refused, with the reason in the stats): a split dim that a reshape
merges with an outer dim (sequence chunking where batch and sequence are
flattened together with a batch > 1), one row per rank (nothing to split),
factories whose sizes do not follow a split value. When nothing was
chunked the pass says so in one warning line, with one line per refusal
reason (:meth:`ChunkRegionsStats.refusal_lines`).

Buffer mutations stay where they are: their new values are rebuilt from
both chunks (concatenated or summed) before the mutation output reads them.
The result is exactly eager module-level chunking (run the module on each
half, concatenate): the same ops on the same halves, gradients added once.

>>> # stats = chunk_regions(local.gm, ctx)   # doctest: +SKIP
>>> # ChunkRegionsStats(regions_chunked=2, refusals={reason: count}, nodes_added=310, ...)
"""

from __future__ import annotations

import fnmatch
import logging
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..capture.tracing import module_path
from . import PassContext, register_pass
from .chunk_dims import (
    PER_CHUNK,
    _ATTENTION_NAMES,
    _FILLS,
    _MESH_SIZES,
    REDUCED,
    ChunkRefused,
    _acts_along,
    _stamp,
    _fake_mode,
    _probe,
    _Unknown,
    _val,
    group_split,
    merge_depth,
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
# Which dim of a user input each mode splits (inputs are [batch, seq, ...]).
MODE_INPUT_DIM = {"batch": 0, "seq": 1}

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

# Ops whose result, where it lost the split dim, is a *sum* over it: the
# chunks' results add up to the whole (weight gradients are sums over tokens).
_SUM_REDUCTIONS = {
    _aten.mm.default,
    _aten.bmm.default,
    _aten.sum.dim_IntList,
    _aten.sum.default,
}


def _extra_sum_reductions() -> set:
    # custom ops that are sums over tokens in the outputs they reduce
    out = set()
    ops = getattr(torch.ops, "autoparallel", None)
    for name in ("moe_experts_backward", "moe_a2a_expert_rows_backward"):
        op = getattr(ops, name, None) if ops is not None else None
        if op is not None:
            out.add(op.default)
    return out


@dataclass
class RegionReport:
    region: str  # module path of the instance (layers.3.moe)
    mode: str  # "batch" | "seq"
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
# regions


def region_of(path: str | None, pattern: str) -> str | None:
    """The module instance of ``path`` that ``pattern`` names (``*`` matches
    one path component), or None. ``region_of("layers.3.moe.gate",
    "layers.*.moe") == "layers.3.moe"``."""
    if not path:
        return None
    comps, pcomps = path.split("."), pattern.split(".")
    if len(comps) < len(pcomps):
        return None
    if all(fnmatch.fnmatchcase(c, p) for c, p in zip(comps, pcomps)):
        return ".".join(comps[: len(pcomps)])
    return None


def _regions(gm: fx.GraphModule, modules: dict[str, str]) -> dict[str, tuple[str, list[fx.Node]]]:
    """region -> (mode, its call nodes in graph order); first pattern wins."""
    out: dict[str, tuple[str, list[fx.Node]]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        path = module_path(n)
        for pattern, mode in modules.items():
            r = region_of(path, pattern)
            if r is not None:
                out.setdefault(r, (mode, []))[1].append(n)
                break
    return out


# ---------------------------------------------------------------------------
# the rewrite


@dataclass
class _Plan:
    region: str
    mode: str
    nodes: list[fx.Node]  # region nodes that depend on split live-ins, graph order
    live_ins: dict[fx.Node, int]  # split ones -> dim
    shared: int
    state: dict[fx.Node, Any]  # node -> dim | REDUCED | tuple of them
    probe: dict[fx.Node, tuple]  # node -> (A value, (args, kwargs) with chunk sizes)
    joins: dict[fx.Node, fx.Node] = field(default_factory=dict)  # rebuilt value -> original node
    # values without the split dim that line up with it at full size (a mask
    # built outside the region with the literal batch, a constant fill):
    # value -> dim; each chunk reads its own half
    partners: dict[fx.Node, int] = field(default_factory=dict)


def _is_random(n: fx.Node) -> bool:
    t = n.target
    if not (isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags):
        return False
    # attention is tagged random for its dropout; without dropout it is not
    for k, a in enumerate(t._schema.arguments):
        if a.name == "dropout_p":
            p = n.args[k] if k < len(n.args) else n.kwargs.get("dropout_p", a.default_value)
            return bool(p)
    return True


def _late_sum_closure(n: fx.Node, members: set[fx.Node]) -> set[fx.Node] | None:
    """The region nodes after sum ``n`` when every one of them is linear in
    it (waits, sum reductions over ranks, layout copies), so each chunk's
    partial sum may go through them on its own and be added where it
    leaves the region; None when some use is not (sum it at once)."""
    closure: set[fx.Node] = set()
    inside = {n}
    changed = True
    while changed:  # to a fixpoint: a cat joins once all its pieces are in
        changed = False
        for x in list(inside):
            for u in x.users:
                if u in members and u not in inside and _is_linear(u) and all(a in inside for a in u.all_input_nodes):
                    inside.add(u)
                    closure.add(u)
                    changed = True
    for x in inside:
        if any(u in members and u not in inside for u in x.users):
            return None
    return closure


def _is_linear(n: fx.Node) -> bool:
    t = n.target
    if t in (
        _c10d.wait_tensor.default,
        _aten.clone.default,
        operator.getitem,
        _aten.cat.default,
        _aten.split.Tensor,
        _aten.split_with_sizes.default,
    ):
        return True
    if t in (_c10d.reduce_scatter_tensor.default, _c10d.all_reduce.default):
        return n.args[1] == "sum"
    if "grad_layout" in str(t):  # autoparallel.moe_grad_layout: a copy
        return True
    return isinstance(t, torch._ops.OpOverload) and t.is_view


def _plan_region(
    region: str, mode: str, members: list[fx.Node], global_dims: dict, early_sums: bool = True, why: dict | None = None
) -> _Plan:
    """Decide what to split, duplicate and rebuild; raise :class:`ChunkRefused`."""
    member_set = set(members)
    if mode == "seq":
        att = next((n for n in members if any(s in str(n.target) for s in _ATTENTION_NAMES)), None)
        if att is not None:
            raise ChunkRefused(f"{att.name} ({att.target}): attention under sequence chunking needs every key")
    sums = _SUM_REDUCTIONS | _extra_sum_reductions()
    state: dict[fx.Node, Any] = {}
    half: dict[fx.Node, Any] = {}
    probe: dict[fx.Node, tuple] = {}
    live_ins: dict[fx.Node, int] = {}
    shared: set[fx.Node] = set()
    dependent: list[fx.Node] = []
    summed: set[fx.Node] = set()  # sums over the split dim, added up at once
    partners: dict[fx.Node, int] = {}  # full-size inputs each chunk reads its part of
    late_reduced: dict[fx.Node, fx.Node] = {}  # linear ops on a partial sum, duplicated -> its producer
    depth: dict[fx.Node, int] = {}  # see merge_depth: 0 where a chunk's rows are a contiguous half
    mesh_sizes = _MESH_SIZES.get()
    for n in members:
        ins = n.all_input_nodes
        deps = []
        for a in ins:
            if a in member_set:
                if a in state and a not in summed:
                    deps.append(a)
                continue
            g = global_dims.get(a, "absent")
            if isinstance(g, int):
                if a not in live_ins:
                    v = _val(a)
                    if v.shape[g] % 2:
                        raise ChunkRefused(f"live-in {a.name} has odd size {v.shape[g]} on the split dim {g}")
                    live_ins[a] = g
                    half[a] = v.narrow(g, 0, v.shape[g] // 2)
                    state[a] = g
                deps.append(a)
            elif g is None:
                lost = (why or {}).get(a)
                raise ChunkRefused(
                    f"cannot tell the split dim of live-in {a.name} (feeding {n.name})" + (f": {lost}" if lost else "")
                )
            else:
                shared.add(a)
        if not deps or n.target in _FILLS:
            continue  # a fill reads its input for the dtype only: shared
        if n in late_reduced:
            # a linear op on one chunk's partial sum (its gradient collective)
            out, st, sized = _probe(n, state, half)
            state[n], half[n], probe[n] = REDUCED, out, (out, sized)
            dependent.append(n)
            continue
        if any(a in summed for a in ins):
            raise ChunkRefused(
                f"{n.name} ({n.target}) uses a sum over the split dim together with per-chunk values "
                "(a norm or statistic over the split dim)"
            )
        if _is_random(n):
            raise ChunkRefused(f"{n.name} ({n.target}) is random: the chunks would draw other numbers")
        if mode == "seq" and any(s in str(n.target) for s in _ATTENTION_NAMES):
            raise ChunkRefused(f"{n.name} ({n.target}): attention under sequence chunking needs every key")
        in_dims = [state[a] for a in deps if isinstance(state.get(a), int)]
        first = next((a for a in deps if isinstance(state.get(a), int)), None)
        regroup = first is not None and group_split(n, state[first], depth.get(first, 0), mesh_sizes)
        if (
            first is not None
            and not regroup
            and _acts_along(n, state[first], _val(first).dim() if isinstance(_val(first), torch.Tensor) else 0)
        ):
            if n.target not in sums:
                raise ChunkRefused(f"{n.name} ({n.target}) acts along the split dim")
        found: dict[fx.Node, int] = {}
        try:
            out, st, sized = _probe(n, state, half, partners=found)
        except _Unknown as e:
            raise ChunkRefused(str(e)) from None
        sts = st if isinstance(st, list) else [st]
        if REDUCED in sts and n.target not in sums and n.target is not operator.getitem:
            raise ChunkRefused(f"{n.name} ({n.target}) reduces across the split dim (only sums can be rebuilt)")
        if not in_dims and n.target is not operator.getitem and not any(state.get(a) == PER_CHUNK for a in deps):
            raise ChunkRefused(f"{n.name} ({n.target}) depends on the split only through multi-output values")
        for f, i in found.items():
            if partners.setdefault(f, i) != i:
                raise ChunkRefused(f"{f.name} lines up with the split dim along two different dims")
        depths = {depth.get(a, 0) for a in deps}
        if len(depths) > 1 or (found and depths != {0}):
            raise ChunkRefused(
                f"{n.name} ({n.target}) combines rows in different orders (one gathered over a mesh dim "
                "along the split dim inside the region)"
            )
        base = depths.pop() if depths else 0
        if regroup:
            depth[n] = base - 1  # each part: one rank's rows again
        else:
            depth[n] = base + (merge_depth(n, state[first], st, mesh_sizes) if first is not None else 0)
        state[n] = tuple(st) if isinstance(st, list) else st
        half[n] = out
        probe[n] = (out, sized)
        dependent.append(n)
        if st == REDUCED:
            late = _late_sum_closure(n, member_set) if not early_sums else None
            if late is None:
                summed.add(n)
            else:
                # each chunk's sum runs through its own collectives; added at the end
                for m in late:
                    late_reduced[m] = n
    if not dependent:
        raise ChunkRefused("no node of the region depends on a value carrying the split dim")
    for n in dependent:
        u = next((u for u in n.users if u not in member_set), None)
        if u is not None and depth.get(n, 0) and isinstance(state[n], int):
            raise ChunkRefused(
                f"{n.name} ({n.target}) was gathered or scattered over a mesh dim along the split dim and "
                f"{u.name} outside the region reads it: the chunks' rows interleave rank by rank"
            )
        if state[n] == PER_CHUNK:
            u = next((u for u in n.users if u not in member_set), None)
            if u is not None:
                raise ChunkRefused(
                    f"{n.name} ({n.target}) is per-chunk (MoE routing or exchanged rows) and {u.name} "
                    "outside the region reads it: it cannot be rebuilt from the chunks"
                )
    return _Plan(region, mode, dependent, live_ins, len(shared), state, probe, partners=partners)


def _apply(gm: fx.GraphModule, plan: _Plan) -> int:
    """Rewrite ``gm`` per ``plan``; returns how many nodes were added."""

    g = gm.graph
    dep = set(plan.nodes)
    a_of: dict[fx.Node, fx.Node] = {}
    b_of: dict[fx.Node, fx.Node] = {}
    added = 0
    first_use = {}
    for n in plan.nodes:
        for a in n.all_input_nodes:
            if a in plan.live_ins and a not in first_use:
                first_use[a] = n
    for x, d in plan.live_ins.items():
        a_of[x], b_of[x] = _split_before(g, x, d, first_use[x], "chunk_split")
        added += 3
    for f, d in plan.partners.items():
        n0 = next(u for u in plan.nodes if f in u.all_input_nodes)
        a_of[f], b_of[f] = _split_before(g, f, d, n0, "chunk_partner")
        added += 3
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
        _stamp(b, n, "chunk1")
        n.args = fx.node.map_arg(args, to_a)
        n.kwargs = fx.node.map_arg(kwargs, to_a)
        n.meta["val"] = out
        b.meta["val"] = _rerun(b, out)
        n.meta[CHUNK_KEY] = (plan.region, 0)
        b.meta[CHUNK_KEY] = (plan.region, 1)
        a_of[n], b_of[n] = n, b
        added += 1
    # rebuild the values that leave the chunked part
    for n in plan.nodes:
        st = plan.state[n]
        if isinstance(st, tuple) or st == PER_CHUNK:
            continue  # multi-output op: its getitems are rebuilt; per-chunk values stay inside
        outside = [u for u in n.users if u not in dep and u is not b_of[n]]
        if not outside:
            continue
        b = b_of[n]
        with g.inserting_after(b):
            if st == REDUCED:
                j = g.call_function(_aten.add.Tensor, (n, b))
            else:
                j = g.call_function(_aten.cat.default, ([n, b], st))
        j.meta = {k: v for k, v in n.meta.items() if k not in (CHUNK_KEY,)}
        j.meta["val"] = _rerun(j, None)
        _stamp(j, n, "chunk_join")
        for u in outside:
            u.replace_input_with(n, j)
        plan.joins[j] = n
        added += 1
    return added


def _split_before(g: fx.Graph, x: fx.Node, d: int, n0: fx.Node, tag: str) -> tuple[fx.Node, fx.Node]:
    """Split ``x`` in two halves along ``d`` right before its first chunked
    consumer ``n0``; the halves (chunk A's, chunk B's)."""
    from ..apply.unfold import FOLD_KEY

    size = _val(x).shape[d] // 2
    with g.inserting_before(n0):
        sp = g.call_function(_aten.split.Tensor, (x, size, d))
        ha = g.call_function(operator.getitem, (sp, 0))
        hb = g.call_function(operator.getitem, (sp, 1))
    v = _val(x)
    with _fake_mode([v]) or _null():
        sp.meta["val"] = v.split(size, d)
    ha.meta["val"], hb.meta["val"] = sp.meta["val"][0], sp.meta["val"][1]
    for k, m in enumerate((sp, ha, hb)):
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
    vals = [_val(a) for a in n.all_input_nodes]
    mode = _fake_mode(vals if not isinstance(vals[0], (tuple, list)) else list(vals[0]) + vals[1:])
    args = fx.node.map_arg(n.args, _val)
    kwargs = fx.node.map_arg(n.kwargs, _val)
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


def _scheduled_exposure(gm: fx.GraphModule, ctx, modules: dict[str, str]) -> dict[str, float]:
    """:func:`exposed_comm_by_region` of ``gm`` in ``schedule_overlap``'s order."""
    from .overlap_model import Costs
    from .schedule_overlap import ScheduleStats, _schedule

    try:
        costs = Costs(ctx)
        order = _schedule(gm, ctx, ScheduleStats(), costs)
        return exposed_comm_by_region(order, costs, modules)
    except Exception as e:  # an estimate only: never fail the pass on it
        logger.warning("chunk_regions: no exposure estimate: %s", e)
        return {}


# ---------------------------------------------------------------------------
# entry points


def chunk_graph(
    gm: fx.GraphModule,
    modules: dict[str, str],
    seeds: dict[str, dict[fx.Node, int]],
    ctx: PassContext | None = None,
    *,
    copies=lambda node: 1,
    early_sums: bool = True,
) -> ChunkRegionsStats:
    """Chunk the regions of ``gm`` that ``modules`` (pattern -> "batch" or
    "seq") names, in place. ``seeds``: mode -> {placeholder: dim} where the
    split dim starts (user inputs, tangents)."""
    for pattern, mode in modules.items():
        if mode not in MODE_INPUT_DIM:
            raise ValueError(f"chunk_modules[{pattern!r}] = {mode!r}: the mode must be one of {sorted(MODE_INPUT_DIM)}")
    stats = ChunkRegionsStats()
    mesh = getattr(ctx, "mesh", None)
    token = _MESH_SIZES.set(frozenset(mesh.shape) if mesh is not None else frozenset())
    try:
        return _chunk_graph(gm, modules, seeds, ctx, copies, stats, early_sums)
    finally:
        _MESH_SIZES.reset(token)


def _chunk_graph(gm, modules, seeds, ctx, copies, stats, early_sums) -> ChunkRegionsStats:
    regions = _regions(gm, modules)
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
            plan = _plan_region(region, mode, members, dims_by_mode[mode], early_sums, whys[mode])
        except ChunkRefused as e:
            rep.reason = str(e)
            stats.regions_refused += n_copies
            stats.refused[region] = rep.reason
            key = stats.reason_keys[region] = _reason_key(rep.reason, names)
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
    from ..report.units import seconds  # here: the report package imports the passes' stats

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


_WORD = re.compile(r"(?<![\w.])([A-Za-z_]\w*)(?: \(([^()]*)\))?(?![\w.])")


def _reason_key(reason: str, names: set[str]) -> str:
    """``reason`` without its graph node names (``mul_7 (aten.mul.Tensor)``
    -> ``aten.mul.Tensor``, other names -> ``<node>``), so that the same
    refusal in every layer counts as one."""

    def sub(m):
        name, target = m.group(1), m.group(2)
        if name not in names:
            return m.group(0)
        if target:
            return target
        # a bare word that is also a node name ("split") stays
        return "<node>" if "_" in name.strip("_") else m.group(0)

    return _WORD.sub(sub, reason)


def _seeds(gm: fx.GraphModule, ctx: PassContext) -> dict[str, dict[fx.Node, int]]:
    """User inputs split at the mode's dim; tangents like their outputs."""
    local = ctx.local
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    n_params = len(local.param_fqns) + len(local.buffer_fqns)
    inputs = placeholders[n_params : n_params + len(local.input_specs)]
    tangents = placeholders[n_params + len(local.input_specs) + 1 :]
    out: dict[str, dict[fx.Node, int]] = {}
    for mode, d in MODE_INPUT_DIM.items():
        seeds = {}
        for p in inputs:
            v = _val(p)
            if isinstance(v, torch.Tensor) and v.dim() > d and v.shape[d] % 2 == 0:
                seeds[p] = d
        # tangents: like the forward outputs they are the gradients of
        (output,) = gm.graph.find_nodes(op="output")
        outs = list(output.args[0])
        dims = propagate_split_dims(gm, seeds)
        for k, t in enumerate(tangents):
            if k < len(local.differentiable_outputs):
                o = outs[local.differentiable_outputs[k]]
                od = dims.get(o) if isinstance(o, fx.Node) else None
                if isinstance(od, int):
                    seeds[t] = od
        out[mode] = seeds
    return out


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
    return chunk_graph(gm, dict(modules), _seeds(gm, ctx), ctx, copies=ctx.copies, early_sums=early)
