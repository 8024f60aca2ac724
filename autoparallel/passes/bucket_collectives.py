"""Bucket small parameter all-gathers of one layer into one all-gather.

FSDP-style plans gather every parameter shard on its own. For the small ones
(LLaMA's two RMSNorm weights per layer: 128 bytes per rank on a 16 x 8 mesh)
each collective costs its latency and moves almost nothing. Gathers on the
same process group, of the same dtype, whose parameters belong to the same
layer (the FQN up to its first numeric component, ``layers.3``) become one::

    ag(a, W, G) -> wait -> A        ag(b, W, G) -> wait -> B

    cat(a.view(-1), b.view(-1)) -> ag(., W, G) -> wait -> view(W, n_a + n_b)
        -> split_with_sizes([n_a, n_b], dim=1) -> clone -> view(A.shape)  (A)
                                                 -> clone -> view(B.shape)  (B)

Data layout: an all-gather concatenates the ranks' inputs along dim 0, so
row ``r`` of the ``(W, n_a + n_b)`` result is rank ``r``'s concatenated
flattened shards; its first ``n_a`` columns are rank ``r``'s ``a``, and
``A`` (rank 0's ``a``, then rank 1's, ...) is the contiguous copy of those
columns viewed as ``A``'s shape.

Only provably equivalent rewrites: every member has the same group name,
group size and dtype; its input is a contiguous tensor of at most
``PassOptions.bucket_bytes`` bytes per rank that depends on graph inputs
only (a parameter placeholder, or a short chain of casts and views of it),
so it can be computed before any other member's collective; its all-gather
has a single user, a ``wait_tensor``. The merged all-gather goes where the
bucket's first all-gather was (chain nodes of later members move up before
it), the wait and the copies out where its first wait was: before every
consumer of every member, so the graph stays topologically valid and no
consumer of one member can feed another member's input.

``bucket_bytes=0`` switches the pass off (or ``disable_passes=
("bucket_collectives",)``). Run before ``schedule_overlap``, which prefetches
a bucket's all-gather as one of its layer's parameter gathers.

>>> # stats = bucket_collectives(gm, ctx)   # doctest: +SKIP
>>> # BucketStats(buckets=32, collectives_merged=64, by_kind={"all_gather": 64})
"""

from __future__ import annotations

import contextlib
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from . import PassContext, register_pass

__all__ = ["BucketStats", "bucket_collectives"]

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
_AG = _c10d.all_gather_into_tensor.default
_WAIT = _c10d.wait_tensor.default
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


@dataclass
class _Member:
    ag: fx.Node
    wait: fx.Node
    x: fx.Node  # the gathered input
    chain: list[fx.Node]  # non-placeholder nodes x depends on (x included unless a placeholder)
    numel: int


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
    """(chain nodes, placeholder roots) when ``x`` is computed from graph
    inputs by cheap ops only; None otherwise."""
    chain: set[fx.Node] = set()
    roots: set[fx.Node] = set()
    stack = [x]
    while stack:
        n = stack.pop()
        if n.op == "placeholder":
            roots.add(n)
            continue
        if n in chain:
            continue
        t = n.target
        cheap = n.op == "call_function" and (t in _CHEAP or (isinstance(t, torch._ops.OpOverload) and t.is_view))
        if not cheap or len(chain) >= _MAX_CHAIN:
            return None
        chain.add(n)
        stack.extend(n.all_input_nodes)
    return list(chain), list(roots)


def _member(ag: fx.Node, limit: int) -> tuple[tuple, _Member, list[fx.Node]] | None:
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
    if not xv.is_contiguous() or xv.numel() * xv.element_size() > limit:
        return None
    if tuple(wv.shape) != (size * xv.shape[0], *xv.shape[1:]) or wv.dtype != xv.dtype:
        return None
    found = _input_chain(x)
    if found is None:
        return None
    chain, roots = found
    return (group, size, xv.dtype), _Member(ag, wait, x, chain, xv.numel()), roots


def _buckets(gm: fx.GraphModule, ctx: PassContext | None, limit: int, index: dict[fx.Node, float]) -> list[list[_Member]]:
    """Mergeable gathers grouped by (layer, group, size, dtype), in graph order."""
    layers = _param_layers(ctx)
    groups: dict[tuple, list[_Member]] = {}
    for ag in sorted(gm.graph.find_nodes(op="call_function", target=_AG), key=index.__getitem__):
        found = _member(ag, limit)
        if found is None:
            continue
        key, member, roots = found
        if layers is None:
            layer = None
        else:
            # a parameter's gather (not an input's or a tangent's), one layer
            keys = {layers[r.name] for r in roots if r.name in layers}
            if len(keys) != 1:
                continue
            (layer,) = keys
        groups.setdefault((layer, *key), []).append(member)
    return [members for members in groups.values() if len(members) > 1]


def _copy_meta(new: fx.Node, old: fx.Node, val, keep_custom: bool = False) -> None:
    skip = {"val", "tensor_meta"} if keep_custom else {"val", "tensor_meta", "custom"}
    new.meta.update({k: v for k, v in old.meta.items() if k not in skip})
    new.meta["val"] = val


def _values(members: list[_Member], size: int, cache: dict) -> dict:
    """Fake values of a bucket's new nodes. Buckets of repeated layers have
    the same shapes: their values are made once (fake tensor ops are slow)
    and shared, like the values of copied layers."""
    xvals = [m.x.meta["val"] for m in members]
    outs = [m.wait.meta["val"] for m in members]
    fake = getattr(xvals[0], "fake_mode", None)
    key = (
        id(fake),
        size,
        tuple((tuple(v.shape), tuple(v.stride()), v.dtype, v.device) for v in xvals),
        tuple(tuple(v.shape) for v in outs),
    )
    hit = cache.get(key)
    if hit is not None:
        return hit
    sizes = [m.numel for m in members]
    total = sum(sizes)
    with fake if fake is not None else contextlib.nullcontext():
        flat = [x.view(k) for x, k in zip(xvals, sizes)]
        cat = torch.cat(flat)
        ag = cat.new_empty((size * total,))
        mat = ag.view(size, total)
        parts = list(torch.split(mat, sizes, 1))
        copy = [p.clone(memory_format=torch.contiguous_format) for p in parts]
        out = [c.view(o.shape) for c, o in zip(copy, outs)]
    cache[key] = vals = {"flat": flat, "cat": cat, "ag": ag, "mat": mat, "parts": parts, "copy": copy, "out": out}
    return vals


def _merge(gm: fx.GraphModule, members: list[_Member], index: dict[fx.Node, float], vals_cache: dict) -> None:
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
    vals = _values(members, size, vals_cache)
    with g.inserting_before(first_ag):
        flats = []
        for i, m in enumerate(members):
            f = g.call_function(_aten.view.default, (m.x, [m.numel]))
            _copy_meta(f, m.ag, vals["flat"][i])
            flats.append(f)
        cat = g.call_function(_aten.cat.default, (flats,))
        _copy_meta(cat, first_ag, vals["cat"])
        ag = g.call_function(_AG, (cat, size, group))
        _copy_meta(ag, first_ag, vals["ag"])
    with g.inserting_before(first_wait):
        wait = g.call_function(_WAIT, (ag,))
        _copy_meta(wait, first_wait, vals["ag"])
        mat = g.call_function(_aten.view.default, (wait, [size, total]))
        _copy_meta(mat, first_wait, vals["mat"])
        parts = g.call_function(_aten.split_with_sizes.default, (mat, sizes, 1))
        _copy_meta(parts, first_wait, vals["parts"])
        outs = []
        for i, m in enumerate(members):
            item = g.call_function(operator.getitem, (parts, i))
            _copy_meta(item, m.wait, vals["parts"][i])
            copy = g.call_function(_aten.clone.default, (item,), {"memory_format": torch.contiguous_format})
            _copy_meta(copy, m.wait, vals["copy"][i])
            out = g.call_function(_aten.view.default, (copy, list(m.wait.meta["val"].shape)))
            _copy_meta(out, m.wait, vals["out"][i], keep_custom=True)
            outs.append(out)
    for m, out in zip(members, outs):
        m.wait.replace_all_uses_with(out)
        g.erase_node(m.wait)
        g.erase_node(m.ag)


@register_pass("bucket_collectives", "graphs")
def bucket_collectives(gm: fx.GraphModule, ctx: PassContext) -> BucketStats:
    """Merge small same-group parameter all-gathers of one layer in ``gm`` (a
    forward or backward graph, in place); see the module docstring."""
    stats = BucketStats()
    opts = getattr(ctx, "options", None)
    limit = opts.bucket_bytes if opts is not None else 0
    if limit <= 0:
        return stats
    index: dict[fx.Node, float] = {n: i for i, n in enumerate(gm.graph.nodes)}
    buckets = _buckets(gm, ctx, limit, index)
    vals_cache: dict = {}
    for members in buckets:
        _merge(gm, members, index, vals_cache)
        stats.buckets += 1
        stats.collectives_merged += len(members)
        stats.by_kind["all_gather"] = stats.by_kind.get("all_gather", 0) + len(members)
    if stats.buckets:
        gm.recompile()
    return stats
