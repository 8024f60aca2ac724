"""Apply the sequence-sharded attention option (context parallelism).

A rank holding a slice of the sequence over the cp mesh dim cannot run the
attention op on its local q, k, v: its queries need every (earlier) key.
The option (:mod:`autoparallel.options.rules.context_parallel`) is run as:

causal (no mask)
    gather K and V over the cp dim; attend the rank's queries to its own
    keys with the kernel's causal mask (the diagonal block) and to the
    chunks of the gathered keys before them unmasked, all those blocks in
    one batched call of the same kernel; merge the results with their
    logsumexps (:mod:`.attention_blocks`). ``balanced``: rank ``r`` holds
    chunks ``r`` and ``2n-1-r`` of ``2n`` (the layout every rank does the
    same causal work in: ``2n-2`` blocks beyond the diagonal); else rank
    ``r`` holds chunk ``r`` of ``n`` and computes all ``n-1`` other blocks,
    those after its queries weighted 0 (a graph traced once for every rank
    has static shapes: it cannot skip them).
otherwise
    gather K and V and attend the local queries to every key in one call;
    with a user mask (its query rows local, its key dim whole, in natural
    order) the balanced layout's gathered keys are put in natural order.
backward
    gather K and V again, run the same blocks (each block's backward given
    the merged output and logsumexp of its queries), and reduce-scatter the
    full-length dK and dV (every rank's queries contributed to every key's
    gradient) back to sequence shards.

Every kernel of :data:`SEQUENCE_SHARDED_ATTENTION` runs so: the CPU kernel
and the CUDA flash, memory-efficient and cuDNN kernels (their logsumexp
layouts: ``[B, H, L]``, padded to a multiple of 32, ``[B, H, L, 1]``).

Everything is traced as ordinary nodes of the local graph, so the
collectives are visible to the passes (bucketing, overlap) and to the
communication report like any redistribution.

Use: ``fn, args, kwargs = lower_attention(op, option, mesh, coords, largs,
lkwargs, device, balanced=True)``, then ``fn(*args, **kwargs)`` in place of
``op(*largs, **lkwargs)``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ..cost_model.devices import H100, DeviceSpec
from ..errors import ApplyError
from ..options.rules.context_parallel import SEQUENCE_SHARDED_ATTENTION, AttentionSignature, cp_mesh_dim
from .attention_blocks import block_plan, blocks_backward, blocks_forward, natural_chunk_order, split_chunks
from .redistribute import redistribute

__all__ = ["lower_attention"]


def _with(spec: DTensorSpec, mesh_dim: int, placement) -> DTensorSpec:
    placements = list(spec.placements)
    placements[mesh_dim] = placement
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)


def _get(op, args: list, kwargs: dict, position: int, default=None):
    if position < len(args):
        return args[position]
    return kwargs.get(op._schema.arguments[position].name, default)


def _set(op, args: list, kwargs: dict, position: int, value) -> None:
    """Set schema argument ``position``: positionally where the call passes
    it so, else by its schema name."""
    if position < len(args):
        args[position] = value
    else:
        kwargs[op._schema.arguments[position].name] = value


def _plain_logsumexp(lse: torch.Tensor, q_len: int) -> torch.Tensor:
    """A kernel's logsumexp as ``[B, H, Lq]`` (cuDNN's ``[B, H, Lq, 1]``
    squeezed, the efficient kernel's padding cut)."""
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return lse[..., :q_len]


def _kernel_logsumexp(lse: torch.Tensor, template: torch.Tensor, multiple: int) -> torch.Tensor:
    """``[B, H, Lq]`` in the layout of the kernel's ``template`` logsumexp
    (trailing unit dim for cuDNN, padded to ``multiple`` for the efficient
    kernel)."""
    pad = -lse.shape[-1] % multiple
    if pad:
        lse = F.pad(lse, (0, pad))
    return lse.unsqueeze(-1) if template.dim() == 4 else lse


def _local_length(spec: DTensorSpec, dim: int) -> int:
    size = spec.tensor_meta.shape[dim]
    for m, p in enumerate(spec.placements):
        if isinstance(p, Shard) and p.dim == dim:
            size //= spec.mesh.size(m)
    return size


class SequenceShardedAttention:
    """The callable that replaces one attention op under a sequence-sharded
    option (see the module docstring)."""

    def __init__(
        self,
        op,
        sig: AttentionSignature,
        option,
        cp_dim: int,
        coords: torch.Tensor,
        device: DeviceSpec,
        balanced: bool,
    ):
        self.op, self.sig, self.option, self.cp_dim = op, sig, option, cp_dim
        self.coords, self.device, self.balanced = coords, device, balanced
        specs = option.input_specs
        self.n = specs[sig.query].mesh.size(cp_dim)
        self.gathered = {i: _with(specs[i], cp_dim, Replicate()) for i in (sig.key, sig.value)}

    # -- collectives -----------------------------------------------------------
    def _gather(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return redistribute(x, self.option.input_specs[i], self.gathered[i], self.coords, device=self.device)

    def _reduce_scatter(self, x: torch.Tensor, i: int) -> torch.Tensor:
        partial = _with(self.gathered[i], self.cp_dim, Partial())
        return redistribute(x, partial, self.option.input_specs[i], self.coords, device=self.device)

    def _reorder(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``x``'s sequence chunks (``2n``) in the order ``index``."""
        dim = self.sig.seq_dim
        return split_chunks(x, 2 * self.n, dim).index_select(0, index).movedim(0, dim).flatten(dim, dim + 1)

    def _mask(self, args: list, kwargs: dict):
        mask = self.sig.mask
        if mask is None:
            return None
        return _get(self.op, args, kwargs, mask) if isinstance(mask, int) else kwargs.get(mask)

    # -- kernel calls ----------------------------------------------------------
    def _forward_call(self, args: list, kwargs: dict) -> Callable:
        op, sig = self.op, self.sig

        def call(q, k, v, causal):
            a, kw = list(args), dict(kwargs)
            for position, value in ((sig.query, q), (sig.key, k), (sig.value, v), (sig.is_causal, causal)):
                _set(op, a, kw, position, value)
            if sig.compute_logsumexp is not None:
                _set(op, a, kw, sig.compute_logsumexp, True)  # the merge needs it
            result = op(*a, **kw)
            return result, _plain_logsumexp(result[1], q.shape[sig.seq_dim])

        return call

    def _backward_call(self, args: list, kwargs: dict) -> Callable:
        op, sig = self.op, self.sig
        template = _get(op, args, kwargs, sig.logsumexp)

        def call(grad_out, q, k, v, out, lse, causal):
            a, kw = list(args), dict(kwargs)
            lse = _kernel_logsumexp(lse, template, sig.logsumexp_multiple)
            for position, value in (
                (sig.grad_out, grad_out),
                (sig.query, q),
                (sig.key, k),
                (sig.value, v),
                (sig.out, out),
                (sig.logsumexp, lse),
                (sig.is_causal, causal),
            ):
                _set(op, a, kw, position, value)
            if sig.max_lengths is not None:
                for position, t in zip(sig.max_lengths, (q, k)):
                    _set(op, a, kw, position, t.shape[sig.seq_dim])
            grads = op(*a, **kw)
            return grads[0], grads[sig.grad_key_value[0]], grads[sig.grad_key_value[1]]

        return call

    # -- the lowering ----------------------------------------------------------
    def __call__(self, *args, **kwargs):
        op, sig = self.op, self.sig
        args, kwargs = list(args), dict(kwargs)
        k, v = args[sig.key], args[sig.value]
        k_full, v_full = self._gather(k, sig.key), self._gather(v, sig.value)
        if bool(_get(op, args, kwargs, sig.is_causal, False)):
            # the rule offers no causal op with a mask (sequence_shardable)
            local_len = args[sig.query].shape[sig.seq_dim]
            if self.balanced and local_len % 2:
                raise ApplyError(
                    f"{op}: the balanced sequence layout holds two chunks per rank, but the local sequence has "
                    f"{local_len} rows (odd): lay this attention's sequence out contiguously (balanced=False)"
                )
            plan = block_plan(self.n, local_len, self.coords[self.cp_dim], self.balanced)
            if sig.backward:
                return self._blocks_backward(args, kwargs, k_full, v_full, plan)
            return self._blocks_forward(args, kwargs, k_full, v_full, plan)
        # a user mask's key dim is in natural order: so must the keys be
        reorder = self.balanced and isinstance(self._mask(args, kwargs), torch.Tensor)
        if reorder:
            natural = natural_chunk_order(self.n, k.device)
            k_full, v_full = self._reorder(k_full, natural), self._reorder(v_full, natural)
        args[sig.key], args[sig.value] = k_full, v_full
        if sig.backward:
            return self._gathered_backward(args, kwargs, reorder)
        return self._gathered_forward(args, kwargs)

    def _forward_result(self, result, out: torch.Tensor, lse: torch.Tensor) -> tuple:
        """The op's result tuple with the merged output and logsumexp, the
        logsumexp laid out as the option's local shard of it."""
        spec = self.option.output_specs[1]
        lse = lse[..., : _local_length(spec, self.sig.seq_dim)]
        if result[1].dim() == 4:
            lse = lse.unsqueeze(-1)
        return (out, lse, *result[2:])

    def _blocks_forward(self, args, kwargs, k_full, v_full, plan) -> tuple:
        sig = self.sig
        q, k, v = args[sig.query], args[sig.key], args[sig.value]
        call = self._forward_call(args, kwargs)
        diagonal, out, lse = blocks_forward(call, q, k, v, k_full, v_full, plan)
        return self._forward_result(diagonal, out, lse)

    def _gathered_forward(self, args, kwargs) -> tuple:
        result = self.op(*args, **kwargs)
        q_len = args[self.sig.query].shape[self.sig.seq_dim]
        return self._forward_result(result, result[0], _plain_logsumexp(result[1], q_len))

    def _blocks_backward(self, args, kwargs, k_full, v_full, plan) -> tuple:
        op, sig = self.op, self.sig
        grad_out, q, k, v, out = (args[i] for i in (sig.grad_out, sig.query, sig.key, sig.value, sig.out))
        lse = _plain_logsumexp(_get(op, args, kwargs, sig.logsumexp), q.shape[sig.seq_dim])
        call = self._backward_call(args, kwargs)
        dq, dk, dv, dk_full, dv_full = blocks_backward(call, grad_out, q, k, v, out, lse, k_full, v_full, plan)
        grads = [dq, None, None]
        for position, local, full, i in zip(sig.grad_key_value, (dk, dv), (dk_full, dv_full), (sig.key, sig.value)):
            grads[position] = local + self._reduce_scatter(full, i)
        return tuple(grads)

    def _gathered_backward(self, args, kwargs, reorder: bool) -> tuple:
        op, sig = self.op, self.sig
        q_len = args[sig.query].shape[sig.seq_dim]
        template = _get(op, args, kwargs, sig.logsumexp)
        lse = _kernel_logsumexp(_plain_logsumexp(template, q_len), template, sig.logsumexp_multiple)
        _set(op, args, kwargs, sig.logsumexp, lse)
        if sig.max_lengths is not None:
            for position, i in zip(sig.max_lengths, (sig.query, sig.key)):
                _set(op, args, kwargs, position, args[i].shape[sig.seq_dim])
        grads = list(op(*args, **kwargs))
        back = natural_chunk_order(self.n, args[sig.key].device).argsort() if reorder else None
        for position, i in zip(sig.grad_key_value, (sig.key, sig.value)):
            full = grads[position] if back is None else self._reorder(grads[position], back)
            # every rank's queries contributed to every key's gradient
            grads[position] = self._reduce_scatter(full, i)
        return tuple(grads)


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
    sequence (it then runs as is). ``coords``: this rank's coordinate on
    every mesh dim (a 1-d int64 tensor); ``balanced``: the attention
    tensors are in the balanced layout along the sequence (rank ``r``
    holding chunks ``r`` and ``2n-1-r`` of ``2n``), else contiguous."""
    sig = SEQUENCE_SHARDED_ATTENTION.get(op)
    if sig is None:
        return None
    cp_dim = cp_mesh_dim(option, sig)
    if cp_dim is None:
        return None
    lowering = SequenceShardedAttention(op, sig, option, cp_dim, coords, device, balanced)
    return lowering, tuple(largs), dict(lkwargs)
