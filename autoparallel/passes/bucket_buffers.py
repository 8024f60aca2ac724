"""Flat-buffer helpers of :mod:`.bucket_collectives`: what to write into a
bucket's buffer (skipping a contiguous copy made only for the collective),
the fake values of the buffer nodes (made once per distinct bucket shape),
and the small graph bookkeeping the merges share (dead copies, positions of
moved nodes, metadata of new nodes)."""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

_aten = torch.ops.aten

CHUNK_CAT = _aten._chunk_cat.default
_VIEWS = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}


def buffer_source(x: fx.Node, coll: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """What to write into the flat buffer for input ``x`` of ``coll``, and the
    copies that makes dead. ``x = clone(y)`` or ``view(clone(y))`` used only
    on the way to ``coll`` (a contiguous copy that exists for the collective:
    a transposed weight gradient, a part of a first-stage gather's buffer):
    ``y`` itself, since the buffer write (``_chunk_cat``) reads any strides
    and flattens row-major, as the contiguous copy would have."""
    chain, n = [], x
    if n.target in _VIEWS and len(n.users) == 1:
        chain.append(n)
        n = n.args[0]
    if not (isinstance(n, fx.Node) and n.target is _aten.clone.default and len(n.users) == 1):
        return x, []
    cv = n.meta.get("val")
    if not isinstance(cv, torch.Tensor) or not cv.is_contiguous():
        return x, []  # a strides-preserving copy: not the row-major order
    y = n.args[0]
    yv = y.meta.get("val") if isinstance(y, fx.Node) else None
    if not isinstance(yv, torch.Tensor) or yv.dim() == 0 or yv.dtype != cv.dtype:
        return x, []
    return y, [*chain, n]


def erase_dead(g: fx.Graph, nodes: list[fx.Node]) -> int:
    """Erase those of ``nodes`` (users first) that nothing reads any more; how many were copies (``clone``)."""
    n_copies = 0
    for n in nodes:  # users first
        if not n.users:
            n_copies += n.target is _aten.clone.default
            g.erase_node(n)
    return n_copies


def renumber(index: dict[fx.Node, float], a: fx.Node, b: fx.Node) -> None:
    """Spread positions between ``a`` and ``b`` (both indexed) over the nodes now between them."""
    between = []
    n = a.next
    while n is not b:
        between.append(n)
        n = n.next
    lo, hi = index[a], index[b]
    for k, n in enumerate(between):
        index[n] = lo + (hi - lo) * (k + 1) / (len(between) + 1)


def copy_meta(new: fx.Node, old: fx.Node, val, keep_custom: bool = False) -> None:
    """Give ``new`` the metadata of ``old`` (module path, AC tags, ...) with fake value ``val``; the ``custom`` tags only with ``keep_custom``."""
    skip = {"val", "tensor_meta"} if keep_custom else {"val", "tensor_meta", "custom"}
    new.meta.update({k: v for k, v in old.meta.items() if k not in skip})
    new.meta["val"] = val


def bucket_values(members: list, srcs: list[fx.Node], size: int, cache: dict) -> dict:
    """Fake values of a bucket's new nodes. Buckets of repeated layers have
    the same shapes: their values are made once (fake tensor ops are slow)
    and shared, like the values of copied layers."""
    xvals = [s.meta["val"] for s in srcs]
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
        buf2d = CHUNK_CAT(xvals, 0, 1)
        cat = buf2d.view(-1)
        flat = [x.view(k) if x.is_contiguous() else None for x, k in zip(xvals, sizes)]
        ag = cat.new_empty((size * total,))
        mat = ag.view(size, total)
        parts = list(torch.split(mat, sizes, 1))
        copy = [p.clone(memory_format=torch.contiguous_format) for p in parts]
        out = [c.view(o.shape) for c, o in zip(copy, outs)]
    cache[key] = vals = {
        "buf2d": buf2d,
        "flat": flat,
        "cat": cat,
        "ag": ag,
        "mat": mat,
        "parts": parts,
        "copy": copy,
        "out": out,
    }
    return vals
