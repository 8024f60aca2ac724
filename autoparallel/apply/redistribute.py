"""Rank-generic redistribution of local shards between two DTensorSpecs.

PyTorch's ``redistribute_local_tensor`` bakes this rank's mesh coordinate
into the traced graph wherever a replicated tensor is split (Replicate ->
Shard). Here the coordinate comes from a tensor, ``coords`` (this rank's
coordinate on every mesh dim, a graph input), so one traced graph serves every
rank: under ``LocalTensorMode`` it runs all simulated ranks at once, and the
graph is the same on every rank of a real job except for process-group names.

Collectives are PyTorch's functional collectives (all-gather, reduce-scatter,
all-reduce, all-to-all, each followed by its wait) on the mesh dim's group,
emitted by the placements' own methods. The steps are exactly the plan the
cost model priced (:func:`autoparallel.cost_model.comm.min_cost_plan`): the
min-cost plan where it applies and is cheaper, its intermediate layouts in
non-default shard orders included (each step acts on its mesh dim's
innermost chunk, which the plan guarantees), else DTensor's own transform
plan (``_gen_transform_infos``), which the cost model reimplements.

>>> # x: local shard of a [8, 4] tensor laid out S(0) on a 1-D mesh of 2
>>> # y = redistribute(x, spec_s0, spec_replicate, coords)   # all-gather
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _MaskPartial

from ..cost_model.comm import min_cost_plan
from ..cost_model.devices import H100, DeviceSpec
from ..errors import ApplyError, UnsupportedRedistribution  # noqa: F401 - ApplyError re-exported
from .balanced_layout import balanced_shard_of_replicated, from_balanced, to_balanced
from ..graph_vocab import REDISTRIBUTE_KEY, SOURCE_KEY  # noqa: F401 - node.meta keys apply writes, re-exported

__all__ = ["mask_indices", "redistribute", "same_placements", "shard_of_replicated", "UnsupportedRedistribution"]


def shard_of_replicated(x: torch.Tensor, dim: int, num_chunks: int, coord: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim``; ``coord`` is a 1-element int64 tensor.

    >>> shard_of_replicated(torch.arange(6), 0, 3, torch.tensor([1]))
    tensor([2, 3])
    """
    size = x.shape[dim]
    if size % num_chunks:
        raise UnsupportedRedistribution(f"dim {dim} of size {size} does not split evenly in {num_chunks}")
    chunk = size // num_chunks
    split = x.unflatten(dim, (num_chunks, chunk))
    return split.index_select(dim, coord).squeeze(dim)


def shard_to_shard(x: torch.Tensor, src_dim: int, dst_dim: int, mesh, mesh_dim: int) -> torch.Tensor:
    """S(src_dim) -> S(dst_dim) on one mesh dim with one all-to-all.

    (DTensor's own version all-gathers and picks this rank's chunk on CPU,
    which bakes the rank into the graph.)
    """
    n = mesh.size(mesh_dim)
    if x.shape[dst_dim] % n:
        raise UnsupportedRedistribution(f"dim {dst_dim} of size {x.shape[dst_dim]} does not split evenly in {n}")
    # chunk k of dst_dim goes to rank k: put chunks on a leading dim
    # (all_to_all_single splits dim 0 evenly: no flattening, so every dim
    # keeps its meaning through the exchange, as chunk_regions needs)
    send = x.unflatten(dst_dim, (n, x.shape[dst_dim] // n)).movedim(dst_dim, 0).contiguous()
    recv = _wait(funcol.all_to_all_single(send, None, None, group=(mesh, mesh_dim)))
    # recv[k] is rank k's src_dim shard of my dst_dim chunk: concatenate in order
    return recv.movedim(0, src_dim).flatten(src_dim, src_dim + 1)


def _wait(x: torch.Tensor) -> torch.Tensor:
    return x.wait() if isinstance(x, AsyncCollectiveTensor) else x


def same_placement(a: Placement, b: Placement) -> bool:
    """``a == b``, except that two ``_MaskPartial`` of the same embedding
    layout are the same (DTensor also compares their mask buffers' identity)."""
    if isinstance(a, _MaskPartial) and isinstance(b, _MaskPartial):
        return (a.reduce_op, a.offset_shape, a.offset_dim) == (b.reduce_op, b.offset_shape, b.offset_dim)
    return a == b


def same_placements(a, b) -> bool:
    return len(a) == len(b) and all(same_placement(p, q) for p, q in zip(a, b))


def mask_indices(x: torch.Tensor, p: _MaskPartial, n: int, coord: torch.Tensor):
    """Row-sharded embedding input: indices local to this rank's rows (0 where
    another rank holds the row) and the mask of those positions.

    >>> p = _MaskPartial(offset_shape=torch.Size([8, 2]), offset_dim=0)
    >>> mask_indices(torch.tensor([1, 5, 6]), p, 2, torch.tensor([1]))
    (tensor([0, 1, 2]), tensor([ True, False, False]))
    """
    rows = p.offset_shape[p.offset_dim]
    if rows % n:
        raise UnsupportedRedistribution(f"embedding rows {rows} do not split evenly in {n}")
    size = rows // n
    lo = coord * size
    mask = (x < lo) | (x >= lo + size)
    return torch.where(mask, torch.zeros_like(x), x - lo), mask


def _apply_mask(x: torch.Tensor, mask: torch.Tensor | None, what: str) -> torch.Tensor:
    if mask is None:
        raise UnsupportedRedistribution(f"no index mask for the row-sharded embedding output ({what})")
    if mask.dim() < x.dim():
        mask = mask.reshape(mask.shape + (1,) * (x.dim() - mask.dim()))
    return x.masked_fill(mask, 0)


def _step(
    x: torch.Tensor,
    cur: Placement,
    dst: Placement,
    spec: DTensorSpec,
    mesh_dim: int,
    logical_shape,
    coords: torch.Tensor,
    src_masks: dict | None = None,
    dst_masks: dict | None = None,
    src_balanced: bool = False,
    dst_balanced: bool = False,
) -> torch.Tensor:
    """One step on ``mesh_dim``; ``src_balanced`` / ``dst_balanced``: the
    shard before / after the step is in the balanced layout
    (:mod:`.balanced_layout`) rather than DTensor's contiguous one."""
    mesh = spec.mesh
    n = mesh.size(mesh_dim)
    coord = coords[mesh_dim : mesh_dim + 1]
    if isinstance(cur, _MaskPartial):
        # the embedding's output: zero the rows looked up elsewhere, then reduce
        x = _apply_mask(x, (src_masks or {}).get(mesh_dim), f"{cur} -> {dst}")
        cur = Partial(cur.reduce_op)
    if isinstance(dst, _MaskPartial):
        if not cur.is_replicate():
            raise UnsupportedRedistribution(f"redistribution {cur} -> {dst} on mesh dim {mesh_dim}")
        x, mask = mask_indices(x, dst, n, coord)
        if dst_masks is not None:
            dst_masks[mesh_dim] = mask
        return x
    if dst.is_replicate():
        if cur.is_partial():
            return cast(Partial, cur)._reduce_value(x, mesh, mesh_dim)
        if cur.is_shard():
            full = cast(Shard, cur)._to_replicate_tensor(x, mesh, mesh_dim, logical_shape)
            return from_balanced(_wait(full), cast(Shard, cur).dim, n) if src_balanced else full
    elif dst.is_shard():
        shard = cast(Shard, dst)
        if cur.is_partial():
            if dst_balanced:
                x = to_balanced(x, shard.dim, n)
            return cast(Partial, cur)._reduce_shard_value(x, mesh, mesh_dim, shard)
        if cur.is_replicate():
            if dst_balanced:
                return balanced_shard_of_replicated(x, shard.dim, n, coord)
            return shard_of_replicated(x, shard.dim, n, coord)
        if cur.is_shard():
            src_dim = cast(Shard, cur).dim
            if src_dim == shard.dim:
                # the same dim in the other layout: through the whole dim
                full = _step(x, cur, Replicate(), spec, mesh_dim, logical_shape, coords, src_balanced=src_balanced)
                return _step(
                    _wait(full), Replicate(), dst, spec, mesh_dim, logical_shape, coords, dst_balanced=dst_balanced
                )
            # one all-to-all, the balanced chunks put in place locally: the
            # whole destination dim ordered so that its contiguous pieces are
            # the ranks' balanced shards, the source dim's received pieces
            # (rank-major) put back in order
            if dst_balanced:
                x = to_balanced(x, shard.dim, n)
            y = shard_to_shard(x, src_dim, shard.dim, mesh, mesh_dim)
            return from_balanced(y, src_dim, n) if src_balanced else y
    elif dst.is_partial():
        if cur.is_replicate():
            return cast(Partial, dst)._partition_value(x, mesh, mesh_dim)
    raise UnsupportedRedistribution(f"redistribution {cur} -> {dst} on mesh dim {mesh_dim}")


def redistribute(
    x: torch.Tensor,
    src: DTensorSpec,
    dst: DTensorSpec,
    coords: torch.Tensor,
    *,
    src_masks: dict | None = None,
    dst_masks: dict | None = None,
    device: DeviceSpec = H100,
    src_balanced: frozenset[int] = frozenset(),
    dst_balanced: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """The local shard of ``x`` (laid out as ``src``) laid out as ``dst``.

    Row-sharded embeddings (``_MaskPartial``): partitioning the indices writes
    the mask per mesh dim into ``dst_masks``; reducing the embedding's output
    reads it from ``src_masks``. ``device``: the one the plan was costed for
    (the min-cost plan depends on it). ``src_balanced`` / ``dst_balanced``:
    the mesh dims whose shard is in the balanced layout
    (:mod:`.balanced_layout`) in ``src`` / ``dst``; a shard that keeps its
    placement but changes layout is gathered and split again.
    """
    reorder = {
        m
        for m in src_balanced ^ dst_balanced
        if src.placements[m].is_shard() and same_placement(src.placements[m], dst.placements[m])
    }
    if same_placements(src.placements, dst.placements) and not reorder:
        return x
    if src.tensor_meta is None:
        src = DTensorSpec(src.mesh, src.placements, tensor_meta=dst.tensor_meta)
    balanced = {m: m in src_balanced for m in range(src.mesh.ndim)}

    def run(x, mesh_dim, cur, target, logical):
        if src.mesh.size(mesh_dim) == 1:
            return x
        if cur.is_shard() and target.is_shard() and same_placement(cur, target):
            if balanced[mesh_dim] == (mesh_dim in dst_balanced):
                return x
        from_b = balanced[mesh_dim] and cur.is_shard()
        to_b = mesh_dim in dst_balanced and target.is_shard()
        balanced[mesh_dim] = to_b
        return _wait(_step(x, cur, target, src, mesh_dim, logical, coords, src_masks, dst_masks, from_b, to_b))

    def logical_shape(x, mesh_dim, cur):
        # even shards only (the plan's states are), so the gathered shape is
        # the logical one: no padding
        logical = list(x.shape)
        if cur.is_shard():
            logical[cast(Shard, cur).dim] *= src.mesh.size(mesh_dim)
        return logical

    def convert_layouts(x):
        # shards that keep their placement but change layout (no step of the
        # plan touches their mesh dim): gathered and split again over that
        # mesh dim alone, where its shard is the innermost one of its tensor
        # dim; later mesh dims splitting the same dim are gathered first
        for m in sorted(reorder):
            if balanced[m] == (m in dst_balanced):
                continue
            p = cast(Shard, src.placements[m])
            later = [k for k in range(m + 1, src.mesh.ndim) if _splits(src.placements[k], p.dim)]
            if later:
                whole = DTensorSpec(
                    src.mesh,
                    tuple(Replicate() if k in later else q for k, q in enumerate(src.placements)),
                    tensor_meta=src.tensor_meta,
                )
                keep = frozenset(d for d, b in balanced.items() if b)
                x = redistribute(x, src, whole, coords, device=device, src_balanced=keep, dst_balanced=keep)
                x = run(x, m, p, p, logical_shape(x, m, p))
                after = frozenset(d for d, b in balanced.items() if b)
                x = redistribute(x, whole, src, coords, device=device, src_balanced=after, dst_balanced=after)
                continue
            x = run(x, m, p, p, logical_shape(x, m, p))
        return x

    steps = min_cost_plan(src, dst, device)
    if steps is not None:
        reorder -= {mesh_dim for mesh_dim, *_ in steps}
        x = convert_layouts(x)
        for mesh_dim, cur, target, *_ in steps:
            x = run(x, mesh_dim, cur, target, logical_shape(x, mesh_dim, cur))
        return x
    infos = [] if same_placements(src.placements, dst.placements) else _gen_transform_infos_non_cached(src, dst)
    reorder -= {info.mesh_dim for info in infos}
    x = convert_layouts(x)
    for info in infos:
        cur, target = info.src_dst_placements
        if same_placement(cur, target) and balanced[info.mesh_dim] == (info.mesh_dim in dst_balanced):
            continue
        x = run(x, info.mesh_dim, cur, target, info.logical_shape)
    return x


def _splits(p: Placement, dim: int) -> bool:
    return p.is_shard() and cast(Shard, p).dim == dim


def replicate_spec(spec: DTensorSpec) -> DTensorSpec:
    return DTensorSpec(spec.mesh, tuple(Replicate() for _ in spec.placements), tensor_meta=spec.tensor_meta)


def user_spec(spec: DTensorSpec) -> DTensorSpec:
    """``spec`` with Partial mesh dims replaced by Replicate: how outputs are
    handed to the user (and their gradients taken back)."""
    placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)
