"""Bucket a layer's collectives into one per (group, dtype), as FSDP2 does.

FSDP-style plans gather every parameter shard on its own and reduce every
gradient on its own; each collective costs a launch and a latency floor.
Collectives on the same process group, of the same dtype, whose parameters
belong to the same layer (the FQN up to its first numeric component,
``layers.3``) become one collective of one flat buffer, at most
``PassOptions.bucket_bytes`` input bytes per rank (default 64 MiB):

* parameter all-gathers (forward, and backward re-gathers)::

    ag(a, W, G) -> wait -> A        ag(b, W, G) -> wait -> B

    cat(a.view(-1), b.view(-1)) -> ag(., W, G) -> wait -> view(W, n_a + n_b)
        -> split_with_sizes([n_a, n_b], dim=1) -> clone -> view(A.shape)  (A)
                                                 -> clone -> view(B.shape)  (B)

  Row ``r`` of the ``(W, n_a + n_b)`` result is rank ``r``'s concatenated
  shards; ``A`` is the contiguous copy of its first ``n_a`` columns (one copy
  per parameter out of the buffer, like FSDP2's split-with-sizes copy: rank
  ``r``'s rows of ``A`` are not adjacent in the buffer, so no view can be
  ``A``). The merged gather goes where the first member's was (later members'
  input chains, casts and views of parameters, move up before it), the copies
  out where the first wait was. A gather whose input is a view of another
  gather's result (the second stage of a parameter sharded on two mesh
  dims) buckets with its layer's other second stages in a later round,
  once the first stages are bucketed.

  A second stage whose input is a part of a first stage's buffer (or a
  transpose of it) reads it as it is: ``_chunk_cat`` writes strided sources
  into the flat buffer, so the contiguous copy before it is not made.

* gradient reduce-scatters and all-reduces (backward; the layer is that of
  the graph output, a parameter's gradient, the result flows to)::

    _chunk_cat([ga, gb], 0, W).view(-1) -> rs(., W, G)
        -> wait -> split_with_sizes([n_a/W, n_b/W]) -> view (A') / view (B')

  Rank ``r`` receives row ``r`` of the ``(W, (n_a + n_b)/W)`` buffer: its
  shards back to back, so the results are views of the buffer (no copy
  out). ``_chunk_cat`` is the one copy in, and reads any strides: a
  gradient made contiguous only for its collective (``clone`` of a
  transposed weight gradient) is written into the buffer from where it
  was computed instead (``BucketStats.copies_removed``). The
  merged reduction goes where the last member's was, the wait before the
  first consumer of any result (data movement computed from a result alone,
  layout ops before the output or the split + cat that reorders a dim-1
  shard's chunks before a second stage, moves down after it); a member
  joins a bucket only if no result of the bucket is consumed before it.
  Rounds repeat so both stages of a two-stage reduce-scatter are bucketed.

Only provably equivalent rewrites: same group name, group size, dtype (and
reduce op); contiguous inputs; a single ``wait_tensor`` user per collective.
The estimated peak memory (:mod:`.overlap_model`) of the bucketed graph may
exceed the original's by at most ``PassOptions.bucket_peak_growth`` (5%):
beyond it the pass halves the byte limit and tries again (4 times), else
leaves the graph alone. Stats say how much collective time the buckets save
by the cost model (``comm_time_saved_s``): the planner's ILP costs every
collective with its own latency and does not see this (the scheduler's
estimate, made on the bucketed graph, does). Charging parameter gathers and
gradient reductions no latency in the ILP was tried and left out: on the
dim-256 LLaMA-3 2x2 plan it picked layouts whose reductions cannot bucket
(57 -> 131 collectives per step, estimated step +0.5%); on 8B at 16x8 it
changed nothing measurable.

``bucket_bytes=0`` switches the pass off (or ``disable_passes=
("bucket_collectives",)``). Run before ``schedule_overlap``, which prefetches
a bucket's all-gather as one of its layer's parameter gathers and spaces
bucketed reduce-scatters like any gradient reduction.

>>> # stats = bucket_collectives(gm, ctx)   # doctest: +SKIP
>>> # BucketStats(buckets=160, collectives_merged=640, by_kind={"all_gather": 288, "reduce_scatter": 352}, ...)
"""

from __future__ import annotations

import contextlib
import copy
import logging
import types
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..graph_vocab import ALL_GATHER as _AG, ALL_REDUCE as _AR, REDUCE_SCATTER as _RS, WAIT as _WAIT
from .base import PassContext, register_pass
from .bucket_buffers import CHUNK_CAT, buffer_source, copy_meta, erase_dead, renumber, bucket_values

__all__ = ["BucketStats", "bucket_collectives"]

logger = logging.getLogger(__name__)

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
# Ops that only cast or lay out a parameter before its gather: a member's
# input may be a short chain of these over graph inputs.
_CHEAP = {
    torch.ops.prims.convert_element_type.default,
    _aten._to_copy.default,
    _aten.clone.default,
    _aten.reshape.default,
    _aten.index_select.default,  # this rank's chunk, by coords
}
_MAX_CHAIN = 16  # nodes in a member's input chain


@dataclass
class BucketStats:
    buckets: int = 0  # merged collectives created
    collectives_merged: int = 0  # original collectives they replace
    by_kind: dict[str, int] = field(default_factory=dict)  # kind -> collectives merged
    # What the cost model does not see: the ILP and the plan's estimate cost
    # every collective with its own latency; bucketing saves the difference
    # (estimated time of the members minus that of the buckets, summed).
    comm_time_saved_s: float = 0.0
    peak_memory_before: int = 0  # estimated bytes per rank (overlap_model)
    peak_memory_after: int = 0
    bucket_bytes_used: int = 0  # the limit kept (lowered when the peak grew)
    # Copies: members' contiguous copies (``clone``) that writing the source
    # straight into the flat buffer made unnecessary, and the copies out of
    # gathered buffers (one per parameter; reductions' results are views).
    copies_removed: int = 0
    copies_out: int = 0


@dataclass
class _Member:
    ag: fx.Node  # the collective (all-gather, reduce-scatter or all-reduce)
    wait: fx.Node
    x: fx.Node  # its input
    chain: list[fx.Node]  # all-gathers: non-placeholder nodes x depends on
    numel: int
    nbytes: int = 0
    ready: float = -1.0  # all-gathers: position of the latest collective result its input needs


def _layer_of(fqn: str) -> str:
    m = re.match(r"^(.*?\.\d+)(\.|$)", fqn)
    return m.group(1) if m else fqn


def _param_layers(ctx: PassContext | None) -> dict[str, str] | None:
    """Placeholder name -> layer key of its parameter (None: no parameter
    names known, a bare graph whose gathers all count as one layer)."""
    local = getattr(ctx, "local", None)
    names = getattr(local, "primal_names", None)
    if local is None or names is None:
        return None
    fqns = list(local.param_fqns) + list(local.buffer_fqns)
    return {name: _layer_of(fqn) for name, fqn in zip(names(), fqns)}


def _input_chain(x: fx.Node) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """(chain nodes, roots) when ``x`` is computed by cheap ops only from
    graph inputs or from collective results (``wait_tensor``, e.g. the first
    stage of a two-stage gather); None otherwise."""
    chain: set[fx.Node] = set()
    roots: set[fx.Node] = set()
    stack = [x]
    while stack:
        n = stack.pop()
        if n.op == "placeholder" or n.target is _WAIT:
            roots.add(n)
            continue
        if n in chain:
            continue
        if not _is_move(n) or len(chain) >= _MAX_CHAIN:
            return None
        chain.add(n)
        stack.extend(n.all_input_nodes)
    return list(chain), list(roots)


def _root_layers(root: fx.Node, layers: dict[str, str]) -> set[str]:
    """Layer keys of the parameters a root stands for: its own for a
    placeholder, those gathered into it for a collective's result."""
    out: set[str] = set()
    seen: set[fx.Node] = set()
    stack = [root]
    while stack and len(seen) < 4 * _MAX_CHAIN:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n.name in layers:
                out.add(layers[n.name])
            continue
        if n.op == "call_function" and (_is_move(n) or n.target in (_WAIT, _AG)):
            stack.extend(n.all_input_nodes)
        else:
            return set()  # computed from something else: not a parameter's gather
    return out if not stack else set()


def _member(ag: fx.Node) -> tuple[tuple, _Member, list[fx.Node]] | None:
    """(group key without the layer, member, roots) when ``ag`` may join a bucket."""
    if len(ag.args) != 3 or ag.kwargs:
        return None
    x, size, group = ag.args
    if not isinstance(x, fx.Node) or not isinstance(size, int) or not isinstance(group, str) or len(ag.users) != 1:
        return None
    (wait,) = ag.users
    if wait.target is not _WAIT or wait.args != (ag,) or wait.kwargs:
        return None
    xv, wv = x.meta.get("val"), wait.meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor) or xv.dim() == 0:
        return None
    if not xv.is_contiguous():
        return None
    if tuple(wv.shape) != (size * xv.shape[0], *xv.shape[1:]) or wv.dtype != xv.dtype:
        return None
    found = _input_chain(x)
    if found is None:
        return None
    chain, roots = found
    return (group, size, xv.dtype), _Member(ag, wait, x, chain, xv.numel(), xv.numel() * xv.element_size()), roots


def _split_by_bytes(members: list[_Member], limit: int, index: dict[fx.Node, float]) -> list[list[_Member]]:
    """Consecutive runs of ``members`` of at most ``limit`` input bytes each
    (a member over the limit stays alone, i.e. unbucketed). A member whose
    input comes from a collective that finishes after the run's first gather
    starts a new run: the merged gather goes where the first member's was."""
    out: list[list[_Member]] = []
    cur: list[_Member] = []
    used = 0
    for m in members:
        if cur and (used + m.nbytes > limit or m.ready > index[cur[0].ag]):
            out.append(cur)
            cur, used = [], 0
        cur.append(m)
        used += m.nbytes
    if cur:
        out.append(cur)
    return [b for b in out if len(b) > 1]


def _buckets(
    gm: fx.GraphModule, ctx: PassContext | None, limit: int, index: dict[fx.Node, float]
) -> list[list[_Member]]:
    """Mergeable gathers grouped by (layer, group, size, dtype), in graph
    order, cut into runs of at most ``limit`` bytes. Gathers of collective
    results (second stages) wait for a later round when a first stage is
    bucketed in this one: their input chains run through its result."""
    layers = _param_layers(ctx)
    groups: dict[tuple, list[_Member]] = {}
    for ag in sorted(gm.graph.find_nodes(op="call_function", target=_AG), key=index.__getitem__):
        found = _member(ag)
        if found is None:
            continue
        key, member, roots = found
        waits = [r for r in roots if r.op != "placeholder"]
        member.ready = max((index[w] for w in waits), default=-1.0)
        if layers is None:
            if waits:
                continue
            layer = None
        else:
            # a parameter's gather (not an input's or a tangent's), one layer
            # (other inputs, such as the mesh coordinates, name no layer)
            keys = {layers[r.name] for r in roots if r.op == "placeholder" and r.name in layers}
            from_waits = [_root_layers(w, layers) for w in waits]
            if not all(from_waits):
                continue
            keys = keys.union(*from_waits)
            if len(keys) != 1:
                continue
            (layer,) = keys
        groups.setdefault((layer, bool(waits), *key), []).append(member)
    first = {k: v for k, v in groups.items() if not k[1]}
    found = [b for members in first.values() for b in _split_by_bytes(members, limit, index)]
    if found:
        return found
    return [b for members in groups.values() for b in _split_by_bytes(members, limit, index)]


# ---------------------------------------------------------------------------
# reductions (reduce-scatters and all-reduces of gradients, in backward)


def _grad_layers(gm: fx.GraphModule, ctx: PassContext | None) -> dict[fx.Node, str] | None:
    """Node -> layer key of the gradient it becomes: graph outputs of a
    backward graph are the parameters' gradients in ``param_fqns`` order
    (None where a parameter has none), and the layout ops before an output
    belong to it. None when no parameter names are known (a bare graph)."""
    local = getattr(ctx, "local", None)
    fqns = getattr(local, "param_fqns", None)
    if fqns is None:
        return None
    has_grad = getattr(local, "has_grad", None) or [True] * len(fqns)
    out_args = gm.graph.output_node().args[0]
    if not isinstance(out_args, (list, tuple)):
        return {}
    grads = [fqn for fqn, g in zip(fqns, has_grad) if g]
    if len(out_args) < len(fqns):
        return {}
    # outputs hold either one slot per parameter or one per parameter with a gradient
    slots = fqns if sum(a is not None for a in out_args[: len(fqns)]) <= len(grads) else grads
    layer_of: dict[fx.Node, str] = {}
    for fqn, a in zip(slots, out_args):
        stack = [a] if isinstance(a, fx.Node) else []
        while stack:  # walk back through the gradient's layout ops
            n = stack.pop()
            if n in layer_of:
                continue
            layer_of[n] = _layer_of(fqn)
            if n.op == "call_function" and (_is_layout(n) or n.target in _THROUGH):
                stack.extend(n.all_input_nodes)
    return layer_of


# Ops a gradient passes through on its way from the reduction to the output:
# waits, chained reductions (a two-stage reduce-scatter), buckets' buffers.
_THROUGH = {
    _WAIT,
    _RS,
    _AR,
    _aten.cat.default,
    _aten._chunk_cat.default,
    _aten.split_with_sizes.default,
    operator.getitem,
}
# Data movement on a collective's way in or out (a dim-1 shard's chunks
# reordered by split + cat, a bucket's outputs taken apart).
_MOVES = {
    _aten.cat.default,
    _aten._chunk_cat.default,
    _aten.split.Tensor,
    _aten.split_with_sizes.default,
    _aten.slice.Tensor,
    operator.getitem,
}


def _is_layout(n: fx.Node) -> bool:
    return n.op == "call_function" and (n.target in _CHEAP or getattr(n.target, "is_view", False))


def _is_move(n: fx.Node) -> bool:
    return _is_layout(n) or (n.op == "call_function" and n.target in _MOVES)


def _tail(wait: fx.Node) -> set[fx.Node]:
    """Data movement after ``wait`` computed from its result alone (every
    input in the tail or ``wait``): it may move down to just before its
    first other consumer, after a merged wait, so it does not pin where
    that wait goes (a local reorder of a reduce-scatter's chunks before the
    next stage, layout ops before the graph output)."""
    tail: set[fx.Node] = set()
    frontier = list(wait.users)
    while frontier and len(tail) < 4 * _MAX_CHAIN:
        n = frontier.pop(0)
        if n in tail or not _is_move(n):
            continue
        if all(a is wait or a in tail for a in n.all_input_nodes):
            tail.add(n)
            frontier.extend(n.users)
    return tail


def _first_use(m: _Member, index: dict[fx.Node, float]) -> float:
    """Position of the first consumer of ``m``'s result outside its tail."""
    tail = _tail(m.wait)
    uses = [u for n in (m.wait, *tail) for u in n.users if u not in tail]
    return min(index[u] for u in uses)


def _reduction(n: fx.Node) -> tuple[tuple, _Member] | None:
    """(group key without the layer, member) for a reduce-scatter or an
    all-reduce whose only user is its wait, on a contiguous input."""
    if n.kwargs or len(n.users) != 1:
        return None
    (wait,) = n.users
    if wait.target is not _WAIT or wait.args != (n,) or wait.kwargs:
        return None
    x = n.args[0]
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(xv, torch.Tensor) or xv.dim() == 0 or not xv.is_contiguous():
        return None
    if n.target is _RS:
        if len(n.args) != 4:
            return None
        _, op, size, group = n.args
        if not isinstance(size, int) or size <= 0 or xv.shape[0] % size:
            return None
        key = ("reduce_scatter", op, size, group, xv.dtype)
    else:
        if len(n.args) != 3:
            return None
        _, op, group = n.args
        key = ("all_reduce", op, group, xv.dtype)
    if not isinstance(group, str) or not isinstance(op, str):
        return None
    return key, _Member(n, wait, x, [], xv.numel(), xv.numel() * xv.element_size())


def _reduction_buckets(
    gm: fx.GraphModule, ctx: PassContext | None, limit: int, index: dict[fx.Node, float]
) -> list[list[_Member]]:
    """Gradient reductions of one layer on the same group, op and dtype, in
    graph order. A member joins the current bucket only when no consumer of
    the bucket's results runs before it (the merged collective goes where
    its last member was, so every result must be needed after that)."""
    layers = _grad_layers(gm, ctx)
    groups: dict[tuple, list[_Member]] = {}
    starts = [n for t in (_RS, _AR) for n in gm.graph.find_nodes(op="call_function", target=t)]
    for n in sorted(starts, key=index.__getitem__):
        found = _reduction(n)
        if found is None:
            continue
        key, member = found
        if layers is None:
            layer = None
        else:
            layer = layers.get(member.wait)
            if layer is None:
                continue
        groups.setdefault((layer, *key), []).append(member)
    out: list[list[_Member]] = []
    for members in groups.values():
        cur: list[_Member] = []
        used, first_use = 0, float("inf")
        for m in members:
            if cur and (used + m.nbytes > limit or first_use < index[m.ag]):
                out.append(cur)
                cur, used, first_use = [], 0, float("inf")
            cur.append(m)
            used += m.nbytes
            first_use = min(first_use, _first_use(m, index))
        out.append(cur)
    return [b for b in out if len(b) > 1]


def _merge_reduction(
    gm: fx.GraphModule, members: list[_Member], index: dict[fx.Node, float], stats: BucketStats
) -> fx.Node:
    """One reduce-scatter (all-reduce) of a flat buffer for ``members``.

    Reduce-scatter: rank ``r`` receives row ``r`` of the ``(W, total / W)``
    buffer whose columns are the members' inputs viewed ``(W, n_i / W)``, so
    its result is the members' shards back to back: each is a contiguous
    slice viewed in its shape (no copy out). All-reduce: the buffer is the
    flattened inputs back to back, and so is its result."""
    g = gm.graph
    members = sorted(members, key=lambda m: index[m.ag])
    last = members[-1].ag
    rs = last.target is _RS
    size = last.args[2] if rs else 1
    outs_v = [m.wait.meta["val"] for m in members]
    xvals = [m.x.meta["val"] for m in members]
    fake = getattr(xvals[0], "fake_mode", None)
    cols = [m.numel // size for m in members]
    srcs, dead = zip(*[buffer_source(m.x, m.ag) for m in members])
    with fake if fake is not None else contextlib.nullcontext():
        cat_v = CHUNK_CAT([s.meta["val"] for s in srcs], 0, size)
        buf_v = cat_v.view(-1)
        res_v = buf_v.new_empty((sum(cols),))
        parts_v = list(torch.split(res_v, cols))
        view_v = [p.view(o.shape) for p, o in zip(parts_v, outs_v)]
    before_last = last.prev
    with g.inserting_before(last):
        # (size, total / size): row r is rank r's shards back to back, each
        # gradient written straight from where it was computed
        cat = g.call_function(CHUNK_CAT, (list(srcs), 0, size))
        copy_meta(cat, last, cat_v)
        buf = g.call_function(_aten.view.default, (cat, [-1]))
        copy_meta(buf, last, buf_v)
        if rs:
            coll = g.call_function(_RS, (buf, last.args[1], size, last.args[3]))
        else:
            coll = g.call_function(_AR, (buf, last.args[1], last.args[2]))
        copy_meta(coll, last, res_v)
    tails = [_tail(m.wait) for m in members]
    users = [u for m, t in zip(members, tails) for n in (m.wait, *t) for u in n.users if u not in t]
    first_use = min(users, key=index.__getitem__)
    # every result is needed after the last member (see _reduction_buckets)
    before_use = first_use.prev
    with g.inserting_before(first_use):
        wait = g.call_function(_WAIT, (coll,))
        copy_meta(wait, members[0].wait, res_v)
        parts = g.call_function(_aten.split_with_sizes.default, (wait, cols))
        copy_meta(parts, members[0].wait, parts_v)
        outs = []
        for i, m in enumerate(members):
            item = g.call_function(operator.getitem, (parts, i))
            copy_meta(item, m.wait, parts_v[i])
            out = g.call_function(_aten.view.default, (item, list(outs_v[i].shape)))
            copy_meta(out, m.wait, view_v[i], keep_custom=True)
            outs.append(out)
    # the tails (layout ops to the output) move after the new results
    for n in sorted({n for t in tails for n in t}, key=index.__getitem__):
        first_use.prepend(n)
    # positions of the new and moved nodes, for the buckets still to merge
    renumber(index, before_last, last)
    renumber(index, before_use, first_use)
    for m, out in zip(members, outs):
        m.wait.replace_all_uses_with(out)
        g.erase_node(m.wait)
        g.erase_node(m.ag)
    stats.copies_removed += sum(erase_dead(g, d) for d in dead)
    return coll


def _merge(
    gm: fx.GraphModule, members: list[_Member], index: dict[fx.Node, float], vals_cache: dict, stats: BucketStats
) -> fx.Node:
    """Rewrite one bucket; ``index`` (graph positions of the old nodes) is
    kept up to date for the nodes moved."""
    g = gm.graph
    members = sorted(members, key=lambda m: index[m.ag])
    first_ag = members[0].ag
    first_wait = min((m.wait for m in members), key=index.__getitem__)
    # inputs first: chain nodes after the first all-gather move up before it
    at = index[first_ag]
    late = sorted({n for m in members for n in m.chain if index[n] > at}, key=index.__getitem__)
    for k, n in enumerate(late):
        first_ag.prepend(n)
        index[n] = at - 1 + (k + 1) / (len(late) + 1)  # between first_ag's predecessor and it
    size, group = first_ag.args[1], first_ag.args[2]
    sizes = [m.numel for m in members]
    total = sum(sizes)
    srcs, dead = zip(*[buffer_source(m.x, m.ag) for m in members])
    vals = bucket_values(members, list(srcs), size, vals_cache)
    with g.inserting_before(first_ag):
        if any(v is None for v in vals["flat"]):
            # strided sources (parts of a first stage's buffer): written
            # straight into one flat buffer, no contiguous copy first
            buf2d = g.call_function(CHUNK_CAT, (list(srcs), 0, 1))
            copy_meta(buf2d, first_ag, vals["buf2d"])
            cat = g.call_function(_aten.view.default, (buf2d, [-1]))
        else:
            # parameters (or casts of them): cat of flat views, the chain
            # schedule_overlap recognises as a bucket of parameters
            flats = []
            for m, src in zip(members, srcs):
                f = g.call_function(_aten.view.default, (src, [m.numel]))
                copy_meta(f, m.ag, vals["flat"][len(flats)])
                flats.append(f)
            cat = g.call_function(_aten.cat.default, (flats,))
        copy_meta(cat, first_ag, vals["cat"])
        ag = g.call_function(_AG, (cat, size, group))
        copy_meta(ag, first_ag, vals["ag"])
    with g.inserting_before(first_wait):
        wait = g.call_function(_WAIT, (ag,))
        copy_meta(wait, first_wait, vals["ag"])
        mat = g.call_function(_aten.view.default, (wait, [size, total]))
        copy_meta(mat, first_wait, vals["mat"])
        parts = g.call_function(_aten.split_with_sizes.default, (mat, sizes, 1))
        copy_meta(parts, first_wait, vals["parts"])
        outs = []
        for i, m in enumerate(members):
            item = g.call_function(operator.getitem, (parts, i))
            copy_meta(item, m.wait, vals["parts"][i])
            cp = g.call_function(_aten.clone.default, (item,), {"memory_format": torch.contiguous_format})
            copy_meta(cp, m.wait, vals["copy"][i])
            out = g.call_function(_aten.view.default, (cp, list(m.wait.meta["val"].shape)))
            copy_meta(out, m.wait, vals["out"][i], keep_custom=True)
            outs.append(out)
    for m, out in zip(members, outs):
        m.wait.replace_all_uses_with(out)
        g.erase_node(m.wait)
        g.erase_node(m.ag)
    stats.copies_removed += sum(erase_dead(g, d) for d in dead)
    stats.copies_out += len(members)
    return ag


# Tries with the byte limit halved each time the estimated peak of the
# bucketed graph exceeds the original's by more than
# PassOptions.bucket_peak_growth.
_ATTEMPTS = 4
# first stages, then each later stage of a gather over up to 4 mesh dims
_ROUNDS = 4


def _copy_graph(g: fx.Graph) -> fx.Graph:
    new = fx.Graph(owning_module=g.owning_module, tracer_cls=g._tracer_cls)
    new._codegen = copy.deepcopy(g._codegen)
    rv = new.graph_copy(g, {})
    new.output(rv)
    return new


def _bucket_graph(g: fx.Graph, ctx: PassContext | None, limit: int, costs) -> BucketStats:
    """Bucket ``g`` in place with byte limit ``limit``."""
    stats = BucketStats(bucket_bytes_used=limit)
    holder = types.SimpleNamespace(graph=g)
    vals_cache: dict = {}
    kinds = {_AG: "all_gather", _RS: "reduce_scatter", _AR: "all_reduce"}
    # Gathers, in rounds: the second stages of two-stage gathers bucket
    # once their first stages have been.
    for _ in range(_ROUNDS):
        index = {n: i for i, n in enumerate(g.nodes)}
        found = _buckets(holder, ctx, limit, index)
        for members in found:
            if _stale(members):
                continue  # found again next round, from the rewritten graph
            saved = sum(costs.time(m.ag) for m in members)
            new = _merge(holder, members, index, vals_cache, stats)
            stats.comm_time_saved_s += saved - costs.time(new)
            _count(stats, "all_gather", len(members))
        if not found:
            break
    # Reductions, in rounds: a two-stage reduce-scatter's first stages can
    # share a bucket once its second stages do (they then all feed one
    # merged collective placed after every first stage).
    for _ in range(_ROUNDS):
        index = {n: i for i, n in enumerate(g.nodes)}
        found = _reduction_buckets(holder, ctx, limit, index)
        for members in found:
            if _stale(members):
                continue  # found again next round, from the rewritten graph
            kind = kinds[members[0].ag.target]
            saved = sum(costs.time(m.ag) for m in members)
            new = _merge_reduction(holder, members, index, stats)
            stats.comm_time_saved_s += saved - costs.time(new)
            _count(stats, kind, len(members))
        if not found:
            break
    return stats


def _stale(members: list[_Member]) -> bool:
    """A member reads a node an earlier merge of the same round erased: on
    3-D and 4-D meshes a collective's input can be the result of another
    stage merged just before (a third-stage gather of a second stage's
    result, a reduce-scatter of a reduce-scatter's), which the members,
    found before any merge, still name."""
    return any(getattr(n, "_erased", False) for m in members for n in (m.ag, m.wait, m.x, *m.chain))


def _count(stats: BucketStats, kind: str, n: int) -> None:
    stats.buckets += 1
    stats.collectives_merged += n
    stats.by_kind[kind] = stats.by_kind.get(kind, 0) + n


@register_pass("bucket_collectives", "graphs")
def bucket_collectives(gm: fx.GraphModule, ctx: PassContext) -> BucketStats:
    """Bucket a layer's parameter all-gathers, gradient reduce-scatters and
    all-reduces in ``gm`` (a forward or backward graph, in place); see the
    module docstring. Keeps the estimated peak memory within
    ``PassOptions.bucket_peak_growth`` of the original graph's, halving the byte limit
    until it does (or leaving the graph alone)."""
    from .overlap_model import Costs, Info

    opts = getattr(ctx, "options", None)
    limit = opts.bucket_bytes if opts is not None else 0
    growth = opts.bucket_peak_growth if opts is not None else 0.05
    if limit <= 0:
        return BucketStats()
    costs = Costs(ctx)
    nodes = list(gm.graph.nodes)
    before = Info(nodes, costs).estimate(nodes)[1]
    stats = BucketStats(peak_memory_before=before, peak_memory_after=before)
    for _ in range(_ATTEMPTS):
        g = _copy_graph(gm.graph)
        trial = _bucket_graph(g, ctx, limit, costs)
        if not trial.buckets:
            return stats
        order = list(g.nodes)
        trial.peak_memory_before = before
        trial.peak_memory_after = Info(order, costs).estimate(order)[1]
        if trial.peak_memory_after <= before * (1 + growth):
            gm.graph = g
            gm.recompile()
            return trial
        logger.info(
            "bucket_collectives: %s graph with bucket_bytes=%d raises the estimated peak %d -> %d bytes; halving",
            getattr(ctx, "graph_kind", None),
            limit,
            before,
            trial.peak_memory_after,
        )
        limit //= 2
    return stats
