"""Causal attention over a sequence split, as blocks merged by their logsumexps.

The rank's queries are one or two chunks of ``c`` rows of the sequence;
its gathered keys (all-gathered over the cp dim, rank-major) are ``n * m``
chunks of ``c`` rows (``m`` chunks per rank). Causal attention of the
rank's queries is then

- the diagonal block: the rank's queries against its own keys with the
  kernel's causal mask (top-left aligned on the local ``m c x m c`` block,
  exact when the rank's chunks are in increasing global order);
- off-diagonal ``c x c`` blocks of one query chunk against one gathered key
  chunk, unmasked, all in ONE call of the same kernel (the blocks stacked
  on the batch dim);

merged as online softmax merges partial results: with per-row logsumexps
``l_i`` and outputs ``o_i``, ``l = logsumexp_i l_i`` and
``o = sum_i exp(l_i - l) o_i``. The backward runs the same blocks, each
given the MERGED output and logsumexp of its query chunk (the kernel's
backward then computes the exact share of the block in dQ, dK and dV, as
flash attention's does per tile).

Which blocks a rank computes depends on its coordinate, which is a tensor
(one graph serves every rank): :class:`BlockPlan` holds index tensors of
static shape whose values depend on the coordinate, never Python branches.

- balanced (rank ``r`` holds chunks ``r`` and ``2n-1-r`` of ``2n``): the
  first chunk reads chunks ``0..r-1``, the second chunks ``0..2n-2-r``
  except ``r`` (its own ``r`` and ``2n-1-r`` are on the diagonal): ``2n-2``
  blocks on every rank, the same work everywhere;
- contiguous (rank ``r`` holds chunk ``r`` of ``n``): the ``n-1`` chunks
  other than ``r``, those after ``r`` computed but weighted 0 (logsumexp
  ``-inf``): a static shape cannot skip them.

>>> # rank 1 of 4: chunks 1 and 6 of 8; chunk 1 reads chunk 0, chunk 6 reads 0, 2, 3, 4, 5,
>>> # which a rank-major all-gather of the balanced shards holds at 0, 0, 4, 6, 7, 5
>>> plan = block_plan(4, 8, torch.tensor(1), balanced=True)
>>> plan.query_chunk.tolist(), plan.key_chunk.tolist()
([0, 1, 1, 1, 1, 1], [0, 0, 4, 6, 7, 5])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["BlockPlan", "block_plan", "blocks_backward", "blocks_forward", "natural_chunk_order", "split_chunks"]

# (q, k, v, causal) -> (the kernel's result tuple, logsumexp [B, H, Lq] in float32)
ForwardCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[tuple, torch.Tensor]]
# (grad_out, q, k, v, out, logsumexp [B, H, Lq], causal) -> (dq, dk, dv)
BackwardCall = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class BlockPlan:
    """The off-diagonal blocks one rank computes (every shape static, the
    values of the index tensors computed from the rank's coordinate).

    ``chunks``: the rank's query chunks (2 balanced, 1 contiguous);
    ``chunk_len``: their rows ``c``; ``key_chunks``: chunks of the gathered
    keys (``chunks * n``); ``query_chunk[b]`` / ``key_chunk[b]``: block
    ``b``'s local query chunk and gathered key chunk (rank-major order);
    ``valid[b]``: False for a block that weighs 0 (None: all count).
    """

    chunks: int
    chunk_len: int
    key_chunks: int
    query_chunk: torch.Tensor
    key_chunk: torch.Tensor
    valid: torch.Tensor | None

    @property
    def blocks(self) -> int:
        return self.query_chunk.shape[0]


def _gathered_position(chunk: torch.Tensor, n: int) -> torch.Tensor:
    """Where global chunk ``g`` of ``2n`` sits in a rank-major all-gather of
    balanced shards: ``2g`` for the first halves, ``2(2n-1-g)+1`` after."""
    return torch.where(chunk < n, 2 * chunk, 2 * (2 * n - 1 - chunk) + 1)


def natural_chunk_order(n: int, device=None) -> torch.Tensor:
    """Index of the gathered (rank-major, balanced) chunks in natural order:
    ``gathered.index_select(dim, natural_chunk_order(n))`` is chunks
    ``0..2n-1``.

    >>> natural_chunk_order(2).tolist()
    [0, 2, 3, 1]
    """
    return _gathered_position(torch.arange(2 * n, device=device), n)


def block_plan(n: int, local_len: int, rank: torch.Tensor, balanced: bool) -> BlockPlan:
    """The blocks of the rank at cp coordinate ``rank`` (a 0-d int64
    tensor) holding ``local_len`` rows of a sequence split over ``n``."""
    device = rank.device
    if balanced:
        if local_len % 2:
            raise ValueError(f"the balanced layout needs an even local sequence (two chunks), got {local_len}")
        i = torch.arange(2 * n - 2, device=device)
        first = i < rank  # the first chunk (global r) reads chunks 0..r-1
        j = i - rank  # the second (global 2n-1-r): chunks 0..2n-2-r, skipping r
        key = torch.where(first, i, j + (j >= rank).long())
        return BlockPlan(2, local_len // 2, 2 * n, (~first).long(), _gathered_position(key, n), None)
    i = torch.arange(n - 1, device=device)
    key = i + (i >= rank).long()
    return BlockPlan(1, local_len, n, torch.zeros_like(i), key, key < rank)


def split_chunks(x: torch.Tensor, chunks: int, dim: int = 2) -> torch.Tensor:
    """``x`` with its dim ``dim`` cut into ``chunks``, the chunk index first:
    ``[chunks, *x.shape with dim // chunks]``."""
    return x.unflatten(dim, (chunks, x.shape[dim] // chunks)).movedim(dim, 0)


def _join_chunks(x: torch.Tensor, dim: int = 2) -> torch.Tensor:
    return x.movedim(0, dim).flatten(dim, dim + 1)


def _blocks(x: torch.Tensor, chunks: int, index: torch.Tensor) -> torch.Tensor:
    """The chunks ``index`` of ``x`` (dim 2 cut into ``chunks``) stacked on
    the batch dim: ``[len(index) * B, H, c, ...]`` (block-major)."""
    picked = split_chunks(x, chunks).index_select(0, index)
    return picked.flatten(0, 1)


def _per_block(x: torch.Tensor, blocks: int) -> torch.Tensor:
    return x.unflatten(0, (blocks, x.shape[0] // blocks))


def _sum_per_chunk(x: torch.Tensor, index: torch.Tensor, chunks: int) -> torch.Tensor:
    """``x`` ``[blocks, ...]`` summed into ``[chunks, ...]`` by ``index``."""
    return torch.zeros((chunks, *x.shape[1:]), dtype=x.dtype, device=x.device).index_add(0, index, x)


def blocks_forward(
    call: ForwardCall,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    plan: BlockPlan,
) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """Causal attention of the rank's queries ``q`` (its local keys ``k``,
    ``v``; the gathered ``k_full``, ``v_full``): (the diagonal call's result
    tuple, the merged output in q's dtype, the merged logsumexp ``[B, H, Lq]``
    in float32)."""
    diagonal, lse_d = call(q, k, v, True)
    out_d = diagonal[0]
    m, nb = plan.chunks, plan.blocks
    result_o, lse_o = call(
        _blocks(q, m, plan.query_chunk),
        _blocks(k_full, plan.key_chunks, plan.key_chunk),
        _blocks(v_full, plan.key_chunks, plan.key_chunk),
        False,
    )
    out_o = _per_block(result_o[0], nb)  # [nb, B, H, c, D]
    lse_o = _per_block(lse_o, nb)  # [nb, B, H, c]
    if plan.valid is not None:
        lse_o = torch.where(plan.valid.view(nb, 1, 1, 1), lse_o, float("-inf"))
    lse_chunks = split_chunks(lse_d, m)  # [m, B, H, c]
    # every block's logsumexp under its query chunk, -inf under the others
    mine = plan.query_chunk.view(nb, 1) == torch.arange(m, device=plan.query_chunk.device).view(1, m)
    candidates = torch.where(mine.view(nb, m, 1, 1, 1), lse_o.unsqueeze(1), float("-inf"))
    lse = torch.cat([lse_chunks.unsqueeze(0), candidates]).logsumexp(0)  # [m, B, H, c]
    # the diagonal is finite on every row (a query sees itself): lse is too
    weight_d = (lse_chunks - lse).exp().unsqueeze(-1)
    weight_o = (lse_o - lse.index_select(0, plan.query_chunk)).exp().unsqueeze(-1)
    # float32 weights times the kernel's outputs: the products and their sums in float32
    out = weight_d * split_chunks(out_d, m) + _sum_per_chunk(weight_o * out_o, plan.query_chunk, m)
    return diagonal, _join_chunks(out).to(out_d.dtype), _join_chunks(lse)


def blocks_backward(
    call: BackwardCall,
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    plan: BlockPlan,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`blocks_forward` given the merged ``out`` and
    ``lse`` (``[B, H, Lq]``): (dq, the diagonal's dk and dv for the local
    keys, the off-diagonal blocks' dk and dv as full-length ``[B, H, L, D]``
    buffers in the gathered keys' order, partial sums to reduce-scatter)."""
    dq_d, dk_d, dv_d = call(grad_out, q, k, v, out, lse, True)
    m, nb = plan.chunks, plan.blocks
    dq_o, dk_o, dv_o = call(
        _blocks(grad_out, m, plan.query_chunk),
        _blocks(q, m, plan.query_chunk),
        _blocks(k_full, plan.key_chunks, plan.key_chunk),
        _blocks(v_full, plan.key_chunks, plan.key_chunk),
        _blocks(out, m, plan.query_chunk),
        _blocks(lse, m, plan.query_chunk),
        False,
    )
    dq_o, dk_o, dv_o = (_per_block(g, nb) for g in (dq_o, dk_o, dv_o))
    query_chunk, key_chunk, spare = plan.query_chunk, plan.key_chunk, 0
    if plan.valid is not None:
        spare = 1
        # a block weighted 0 contributes nothing: its gradients are summed
        # into one chunk past the end, dropped (no masked copy of them; its
        # recomputed probabilities may overflow against the merged logsumexp)
        query_chunk = torch.where(plan.valid, query_chunk, m)
        key_chunk = torch.where(plan.valid, key_chunk, plan.key_chunks)
    dq_o = _sum_per_chunk(dq_o, query_chunk, m + spare)[:m]
    dq = dq_d + _join_chunks(dq_o).to(dq_d.dtype)
    dk_full, dv_full = (
        _join_chunks(_sum_per_chunk(g, key_chunk, plan.key_chunks + spare)[: plan.key_chunks]) for g in (dk_o, dv_o)
    )
    return dq, dk_d, dv_d, dk_full, dv_full
