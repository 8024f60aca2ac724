"""Flatten and unflatten views whose shards stay contiguous blocks.

A linear layer on ``[B, L, D]`` is traced as a ``view`` to ``[B*L, D]``, an
``mm`` and an ``_unsafe_view`` back to ``[B, L, N]``. With the batch split
over dp and the sequence over cp (``S(0)`` over dp, ``S(1)`` over cp, dp
before cp in the mesh) and a local batch of 1, a rank's rows of
``[B*L, D]`` are one contiguous block: the flattened tensor is ``Shard(0)``
over dp and cp, and the linear runs on the rank's tokens with its weight
gathered, instead of the sequence being gathered.

DTensor's view rule reaches the flattened layout as
``_StridedShard(0, split_factor=1)`` over cp, which the options read as
``Shard(0)`` (:func:`~autoparallel.options.placements.plain_shards`), but
offers no way back: ``Shard(0)`` over two mesh dims of ``[B*L, N]`` does
not unflatten to ``[B, L, N]`` in its strict rule (it raises; the
non-strict one demotes the second mesh dim to ``Replicate``). This rule
adds that option, and its flatten counterpart, to DTensor's:

- unflatten of one dim into ``(g0, g1, ...)``: ``Shard(flat)`` over mesh
  dims in mesh order is ``Shard`` of the split dims, the leading mesh dims
  on ``g0`` until their sizes' product is ``g0``, the next on ``g1``, and so
  on; the last dim they reach only needs to divide (``S(0)S(0)`` on
  ``[B*L, N]`` is ``S(0)S(1)`` on ``[B, L, N]`` when ``B`` is the dp degree);
- flatten of ``(g0, g1, ...)`` into one dim: the reverse, where the mesh
  dims sharding the merged dims shard them in order (an earlier dim on an
  earlier mesh dim) and split every dim but the last they reach down to
  size 1.

A split that leaves a local batch above 1 is a true strided layout
(``_StridedShard`` with a split factor above 1), which plans do not use.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ..conversion import SpecPool
from ..placements import Option, tensor_meta_of
from ..rule_registry import register_extra_rule

aten = torch.ops.aten

VIEW_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


@dataclass(frozen=True)
class MergedDims:
    """A view that merges the dims ``start .. start + len(sizes) - 1`` of
    its wide side (row-major) into dim ``start`` of its narrow side."""

    start: int
    sizes: tuple[int, ...]


def merged_dims(wide: tuple[int, ...], narrow: tuple[int, ...]) -> MergedDims | None:
    """Where ``narrow`` is ``wide`` with one run of two or more consecutive
    dims merged into one, that run; None otherwise.

    >>> merged_dims((4, 4096, 64), (16384, 64))
    MergedDims(start=0, sizes=(4, 4096))
    """
    if len(wide) <= len(narrow) or not narrow:
        return None
    start = 0
    while start < len(narrow) - 1 and wide[start] == narrow[start]:
        start += 1
    tail = 0
    while tail < len(narrow) - 1 - start and wide[-1 - tail] == narrow[-1 - tail]:
        tail += 1
    sizes = tuple(wide[start : len(wide) - tail])
    if len(narrow) - tail - start != 1 or len(sizes) < 2 or math.prod(sizes) != narrow[start]:
        return None
    return MergedDims(start, sizes)


def _plain(placements: tuple) -> bool:
    return all(type(p) in (Shard, Replicate, Partial) for p in placements)


@functools.lru_cache(maxsize=65536)
def unflattened(placements: tuple, mesh_shape: tuple[int, ...], merge: MergedDims) -> tuple | None:
    """The wide side's placements of the narrow side's ``placements`` when
    the merged dim's shards are contiguous blocks of the split dims (see the
    module docstring); None where they are not, or where fewer than two mesh
    dims shard the merged dim (DTensor's rule covers those).

    >>> unflattened((Shard(0), Shard(0)), (2, 4), MergedDims(0, (2, 64)))
    (Shard(dim=0), Shard(dim=1))
    """
    if not _plain(placements):
        return None
    start, sizes = merge.start, merge.sizes
    on_merged = [m for m, p in enumerate(placements) if type(p) is Shard and p.dim == start]
    if len(on_merged) < 2:
        return None
    out = [Shard(p.dim + len(sizes) - 1) if type(p) is Shard and p.dim > start else p for p in placements]
    dim, held = 0, 1
    for m in on_merged:
        while dim < len(sizes) and held == sizes[dim]:
            dim, held = dim + 1, 1
        if dim == len(sizes) or sizes[dim] % (held * mesh_shape[m]):
            return None
        held *= mesh_shape[m]
        out[m] = Shard(start + dim)
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def flattened(placements: tuple, mesh_shape: tuple[int, ...], merge: MergedDims) -> tuple | None:
    """The narrow side's placements of the wide side's ``placements`` when
    the shards of the merged dims flatten to contiguous blocks (see the
    module docstring); None where they do not, or where no mesh dim shards
    the merged dims.

    >>> flattened((Shard(0), Shard(1)), (2, 4), MergedDims(0, (2, 64)))
    (Shard(dim=0), Shard(dim=0))
    """
    if not _plain(placements):
        return None
    start, sizes = merge.start, merge.sizes
    end = start + len(sizes)
    on_merged = [(m, p.dim - start) for m, p in enumerate(placements) if type(p) is Shard and start <= p.dim < end]
    if not on_merged:
        return None
    held = [1] * len(sizes)
    last = 0
    for m, dim in on_merged:
        if dim < last:
            return None  # a later dim split on an earlier mesh dim: the blocks are out of order
        last = dim
        held[dim] *= mesh_shape[m]
    if any(held[d] != sizes[d] for d in range(last)) or sizes[last] % held[last]:
        return None
    return tuple(
        Shard(start)
        if type(p) is Shard and start <= p.dim < end
        else Shard(p.dim - len(sizes) + 1)
        if type(p) is Shard and p.dim >= end
        else p
        for p in placements
    )


@register_extra_rule(*VIEW_OPS)
def flat_view_options(node: torch.fx.Node, input_candidates: list, pool: SpecPool) -> list[Option]:
    """Per input candidate, the contiguous flatten or unflatten layout of a
    view that merges or splits one run of dims (none for other views)."""
    source = node.args[0]
    if not isinstance(source, torch.fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
        return []
    in_val, out_val = source.meta["val"], node.meta["val"]
    in_shape, out_shape = tuple(in_val.shape), tuple(out_val.shape)
    merge = merged_dims(in_shape, out_shape)
    follow = flattened
    if merge is None:
        merge, follow = merged_dims(out_shape, in_shape), unflattened
    if merge is None:
        return []
    mesh_shape = tuple(pool.mesh.shape)
    in_meta, out_meta = tensor_meta_of(in_val), tensor_meta_of(out_val)
    options: list[Option] = []
    seen: set = set()
    for candidate in input_candidates[0]:
        placements = tuple(candidate.placements)
        out = follow(placements, mesh_shape, merge)
        if out is None or not pool.evenly_sharded(out_shape, out) or not pool.evenly_sharded(in_shape, placements):
            continue
        in_spec, out_spec = pool.get(placements, in_meta), pool.get(out, out_meta)
        if (id(out_spec), id(in_spec)) in seen:
            continue
        seen.add((id(out_spec), id(in_spec)))
        options.append(Option(out_spec, (in_spec,)))
    return options
