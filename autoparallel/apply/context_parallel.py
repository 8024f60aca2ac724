"""Apply the sequence-sharded attention option (context parallelism).

A rank holding a contiguous slice of the sequence over the cp mesh dim
(rows ``[r * L/n, (r + 1) * L/n)`` on coordinate ``r``) cannot run the
attention op on its local q, k, v: its queries need every key. The option
(:mod:`autoparallel.options.rules.context_parallel`) is run as:

forward
    gather K and V over the cp dim (functional all-gathers); attend the
    local queries to the full keys; a causal op gets an explicit additive
    mask whose rows are offset by the rank's first query position
    (``coords[cp] * L/n``), since ``is_causal`` on the local shapes would
    mask as if the rank's queries started at position 0. An op given a
    mask (``attn_mask``) receives its local rows (the option splits the
    mask's query dim like the queries and keeps its key dim whole) and
    runs with them unchanged.
backward
    gather K and V again, run the backward with the same mask, and
    reduce-scatter the full-length dK and dV (every rank's queries
    contributed to every key's gradient) back to sequence shards.

Everything is traced as ordinary nodes of the local graph, so the
collectives are visible to the passes (bucketing, overlap) and to the
communication report like any redistribution.

>>> # lowered = lower_attention(op, option, mesh, coords, args, kwargs, device)
>>> # fn, args, kwargs = lowered; out = fn(*args, **kwargs)   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Partial, Replicate

from ..cost_model.devices import H100, DeviceSpec
from ..options.rules.context_parallel import SEQUENCE_SHARDED_ATTENTION, AttentionSignature, cp_mesh_dim
from .redistribute import redistribute


def _with(spec: DTensorSpec, mesh_dim: int, placement) -> DTensorSpec:
    placements = list(spec.placements)
    placements[mesh_dim] = placement
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)


def causal_mask(lq: int, lk: int, first_row: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """The additive ``[lq, lk]`` mask of query rows ``first_row + i`` against
    keys ``0..lk-1`` (``-inf`` where the key comes after the query), as
    ``is_causal`` masks the global ``[L, L]`` product (top-left aligned).

    >>> causal_mask(2, 4, torch.tensor(2), torch.float32, "cpu")
    tensor([[0., 0., 0., -inf],
            [0., 0., 0., 0.]])
    """
    rows = torch.arange(lq, device=device) + first_row
    cols = torch.arange(lk, device=device)
    return torch.zeros((lq, lk), dtype=dtype, device=device).masked_fill(rows[:, None] < cols[None, :], float("-inf"))


def _query_positions(lq: int, coord: torch.Tensor, n: int, balanced: bool, device) -> torch.Tensor:
    """The global sequence positions of a rank's ``lq`` local query rows."""
    if not balanced:
        return torch.arange(lq, device=device) + coord * lq
    c = lq // 2
    head = torch.arange(c, device=device)
    return torch.cat([head + coord * c, head + (2 * n - 1 - coord) * c])


def _sequence_sharded(
    op, sig: AttentionSignature, option, cp_dim: int, coords: torch.Tensor, device: DeviceSpec, balanced: bool
):
    specs = option.input_specs
    gathered = {i: _with(specs[i], cp_dim, Replicate()) for i in (sig.key, sig.value)}
    layout = frozenset({cp_dim}) if balanced else frozenset()
    n = option.input_specs[sig.query].mesh.size(cp_dim)

    def run(*args, **kwargs):
        args = list(args)
        for i, full in gathered.items():
            args[i] = redistribute(args[i], specs[i], full, coords, device=device, src_balanced=layout)
        # is_causal as the node passes it: positional, by name, or left to its default (False)
        causal = args[sig.is_causal] if len(args) > sig.is_causal else kwargs.get("is_causal", False)
        if causal:
            q, k = args[sig.query], args[sig.key]
            lq, lk = q.shape[sig.seq_dim], k.shape[sig.seq_dim]
            rows = _query_positions(lq, coords[cp_dim], n, balanced, q.device)
            if len(args) > sig.is_causal:
                args[sig.is_causal] = False
            kwargs = {**kwargs, "is_causal": False} if "is_causal" in kwargs else dict(kwargs)
            cols = torch.arange(lk, device=q.device)
            mask = torch.zeros((lq, lk), dtype=q.dtype, device=q.device).masked_fill(
                rows[:, None] < cols[None, :], float("-inf")
            )
            if isinstance(sig.mask, int):
                args[sig.mask] = mask
            else:
                kwargs[sig.mask] = mask
        out = op(*args, **kwargs)
        if not sig.backward:
            return out
        out = list(out)
        for pos, i in zip(sig.grad_key_value, (sig.key, sig.value)):
            # every rank's queries contributed to every key's gradient
            out[pos] = redistribute(
                out[pos], _with(gathered[i], cp_dim, Partial()), specs[i], coords, device=device, dst_balanced=layout
            )
        return tuple(out)

    return run


def lower_attention(
    op,
    option,
    mesh: DeviceMesh,
    coords: torch.Tensor,
    largs,
    lkwargs,
    device: DeviceSpec = H100,
    *,
    balanced: bool = False,
) -> tuple[Callable, tuple, dict] | None:
    """``(fn, args, kwargs)`` that run ``op`` under a sequence-sharded
    ``option`` on the local shards ``largs``; None when ``op`` is not a
    sequence-shardable attention op or ``option`` does not split the
    sequence (it then runs as is)."""
    sig = SEQUENCE_SHARDED_ATTENTION.get(op)
    if sig is None:
        return None
    cp_dim = cp_mesh_dim(option, sig)
    if cp_dim is None:
        return None
    return _sequence_sharded(op, sig, option, cp_dim, coords, device, balanced), tuple(largs), dict(lkwargs)
