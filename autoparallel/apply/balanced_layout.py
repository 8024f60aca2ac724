"""The balanced (head-tail) layout of a sequence dim split over a cp mesh dim.

DTensor's ``Shard(d)`` over a mesh dim of ``n`` ranks gives coordinate ``r``
the contiguous rows ``[r L/n, (r+1) L/n)``. Under a causal mask the rank
holding the last rows then attends to every key while the first attends to
almost none. The balanced layout cuts the dim into ``2n`` chunks of
``c = L / 2n`` rows and gives coordinate ``r`` chunk ``r`` followed by chunk
``2n-1-r`` (torchtitan's head-tail load balancing): every rank then has the
same causal work. An all-gather over the mesh dim (rank-major
concatenation) yields the chunks in the order ``0, 2n-1, 1, 2n-2, ...,
n-1, n``.

These functions change between the two layouts on local tensors. Every
rank-dependent choice is an index tensor built from ``coord`` (a
1-element int64 tensor), so one traced graph serves every rank.

>>> balanced_chunk_order(2)
[0, 3, 1, 2]
>>> x = torch.arange(8)
>>> to_balanced(x, 0, 2)
tensor([0, 1, 6, 7, 2, 3, 4, 5])
>>> from_balanced(to_balanced(x, 0, 2), 0, 2)
tensor([0, 1, 2, 3, 4, 5, 6, 7])
>>> balanced_shard_of_replicated(x, 0, 2, torch.tensor([1]))
tensor([2, 3, 4, 5])
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedRedistribution


def balanced_chunk_order(n: int) -> list[int]:
    """The global chunk held at each position of the rank-major
    concatenation of ``n`` balanced shards (``2n`` chunks)."""
    order = []
    for r in range(n):
        order += [r, 2 * n - 1 - r]
    return order


def _chunks(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    size = x.shape[dim]
    if size % (2 * n):
        raise UnsupportedRedistribution(
            f"the balanced layout cuts dim {dim} of size {size} into {2 * n} equal chunks: it does not divide"
        )
    return x.unflatten(dim, (2 * n, size // (2 * n)))


def _reorder(x: torch.Tensor, dim: int, n: int, index: torch.Tensor) -> torch.Tensor:
    return _chunks(x, dim, n).index_select(dim, index).flatten(dim, dim + 1)


# The permutations are computed from ``arange`` rather than written as
# constants: a constant is a new graph input per call, and the repeated
# layers of a plan must trace to identical nodes to be folded.


def to_balanced(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """A whole dim in natural order -> the rank-major concatenation of the
    ``n`` balanced shards (what a reduce-scatter then splits evenly)."""
    p = torch.arange(2 * n, device=x.device)
    return _reorder(x, dim, n, torch.where(p % 2 == 0, p // 2, 2 * n - 1 - p // 2))


def from_balanced(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """The rank-major concatenation of ``n`` balanced shards (what an
    all-gather returns) -> the dim in natural order."""
    k = torch.arange(2 * n, device=x.device)
    return _reorder(x, dim, n, torch.where(k < n, 2 * k, 4 * n - 1 - 2 * k))


def balanced_shard_of_replicated(x: torch.Tensor, dim: int, n: int, coord: torch.Tensor) -> torch.Tensor:
    """Coordinate ``coord``'s balanced shard of the whole dim ``dim``:
    chunks ``coord`` and ``2n-1-coord`` of ``2n``."""
    index = torch.cat([coord, 2 * n - 1 - coord]).to(torch.int64)
    return _chunks(x, dim, n).index_select(dim, index).flatten(dim, dim + 1)
