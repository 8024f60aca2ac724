"""Context parallelism: attention with the sequence split over one mesh dim.

Attention is not local along the sequence: each query row reads every key
(every earlier key, under a causal mask). The sequence-sharded option
therefore does not run the same op on local shards. It declares, per
attention op, where its query, key, value and the rest sit
(:class:`AttentionSignature`), and :mod:`autoparallel.apply.context_parallel`
runs the option: K and V gathered over the cp dim; a causal op as blocks
(the rank's diagonal block with the kernel's causal mask, the blocks
below the diagonal unmasked in one batched call, their outputs merged with
their logsumexps), any other op as one call of its queries against every
key (with an op's mask: the mask's rows of the rank's queries, as the
option splits the mask's query dim like the queries); the backward runs
the same blocks and reduce-scatters dK and dV back to sequence shards.

The planner sees the option as a sequence split of every attention tensor
(q, k, v, output, logsumexp, their gradients: ``Shard(seq_dim)`` on the cp
dim; the kernels' random-number state and empty debug outputs replicated),
plus the in-op work :func:`in_op_work` prices: the gathers and
reduce-scatters as collectives, and the compute a rank does beyond its
local shapes' flop formula.

A kernel joins by adding its :class:`AttentionSignature` to
:data:`SEQUENCE_SHARDED_ATTENTION` and offering :func:`sequence_options`
from its rule (the CPU kernel in :mod:`.attention`, the CUDA flash,
memory-efficient and cuDNN kernels in :mod:`.fused_attention`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.fx
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from ..placements import InOpWork, Option, is_evenly_sharded, tensor_meta_of

aten = torch.ops.aten

# attention tensors have batch, heads and at least one more dim; smaller
# tensors are the kernels' random-number state and empty debug masks
AUXILIARY_MAX_DIMS = 2


@dataclass(frozen=True)
class AttentionSignature:
    """Where an attention op keeps what the sequence split needs.

    Positions are indices into the op's positional schema arguments
    (``node.args``; an argument past the ones given is set by its schema
    name). Every kernel returns its output first and its logsumexp second;
    ``grad_key_value``: for a backward op, the indices of dK and dV in its
    output tuple (None for a forward op); ``seq_dim``: the sequence dim of
    q, k, v, the output and its gradient (``[B, H, L, D]``) and of the
    logsumexp (``[B, H, L]``, or ``[B, H, L, 1]`` for cuDNN).
    """

    query: int
    key: int
    value: int
    dropout_p: int
    is_causal: int
    # the additive mask argument: a keyword (``attn_mask``), a position (the
    # efficient and cuDNN kernels' ``attn_bias``) or None (flash takes none)
    mask: str | int | None = "attn_mask"
    grad_key_value: tuple[int, int] | None = None
    seq_dim: int = 2
    # tensor inputs the op has without a mask (the option is offered then only)
    tensor_inputs: int = 3
    # backward: the positions of the output's gradient, the forward's output and its logsumexp
    grad_out: int | None = None
    out: int | None = None
    logsumexp: int | None = None
    # backward: the positions of the SymInt max_q / max_k (the flash and cuDNN kernels)
    max_lengths: tuple[int, int] | None = None
    # forward: the position of ``compute_log_sumexp`` (the efficient and cuDNN kernels)
    compute_logsumexp: int | None = None
    # the kernel pads its logsumexp's sequence to a multiple of this (the efficient kernel: 32)
    logsumexp_multiple: int = 1

    @property
    def backward(self) -> bool:
        return self.grad_key_value is not None


def _backward(**positions) -> AttentionSignature:
    return AttentionSignature(query=1, key=2, value=3, grad_out=0, grad_key_value=(1, 2), **positions)


SEQUENCE_SHARDED_ATTENTION: dict[object, AttentionSignature] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: AttentionSignature(
        query=0, key=1, value=2, dropout_p=3, is_causal=4
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _backward(
        out=4, logsumexp=5, dropout_p=6, is_causal=7, tensor_inputs=6
    ),
    # (query, key, value, dropout_p, is_causal, return_debug_mask) -> (out, lse, cum_seq_q, cum_seq_k,
    # max_q, max_k, rng_state, unused, debug_attn_mask)
    aten._scaled_dot_product_flash_attention.default: AttentionSignature(
        query=0, key=1, value=2, dropout_p=3, is_causal=4, mask=None
    ),
    # (grad_out, query, key, value, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    # philox_seed, philox_offset)
    aten._scaled_dot_product_flash_attention_backward.default: _backward(
        out=4, logsumexp=5, max_lengths=(8, 9), dropout_p=10, is_causal=11, mask=None, tensor_inputs=8
    ),
    # (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal) -> (out, lse padded to a
    # multiple of 32, philox_seed, philox_offset)
    aten._scaled_dot_product_efficient_attention.default: AttentionSignature(
        query=0, key=1, value=2, mask=3, compute_logsumexp=4, dropout_p=5, is_causal=6, logsumexp_multiple=32
    ),
    # (grad_out, query, key, value, attn_bias, out, lse, philox_seed, philox_offset, dropout_p,
    # grad_input_mask, is_causal) -> (dq, dk, dv, d_bias)
    aten._scaled_dot_product_efficient_attention_backward.default: _backward(
        mask=4, out=5, logsumexp=6, dropout_p=9, is_causal=11, tensor_inputs=8, logsumexp_multiple=32
    ),
    # (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask) ->
    # (out, lse [B, H, L, 1], cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_attn_mask)
    aten._scaled_dot_product_cudnn_attention.default: AttentionSignature(
        query=0, key=1, value=2, mask=3, compute_logsumexp=4, dropout_p=5, is_causal=6
    ),
    # (grad_out, query, key, value, out, lse, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k,
    # max_q, max_k, dropout_p, is_causal)
    aten._scaled_dot_product_cudnn_attention_backward.default: _backward(
        out=4, logsumexp=5, mask=8, max_lengths=(11, 12), dropout_p=13, is_causal=14, tensor_inputs=8
    ),
}


def _arg(node, index: int, default):
    return node.args[index] if len(node.args) > index else default


def user_mask(node, sig: AttentionSignature):
    """The node's additive/boolean mask argument (an fx Node), or None."""
    if sig.mask is None:
        return None
    mask = _arg(node, sig.mask, None) if isinstance(sig.mask, int) else node.kwargs.get(sig.mask)
    return mask if isinstance(mask, torch.fx.Node) else None


def _logsumexp_val(node, sig: AttentionSignature):
    if sig.backward:
        lse = _arg(node, sig.logsumexp, None)
        return lse.meta.get("val") if isinstance(lse, torch.fx.Node) else None
    val = node.meta["val"]
    return val[1] if isinstance(val, (tuple, list)) and len(val) > 1 else None


def sequence_shardable(node) -> bool:
    """Whether ``node`` (an op of :data:`SEQUENCE_SHARDED_ATTENTION`) may be
    sequence-sharded: no dropout (its random stream is per global
    position); causal only with as many keys as queries (self-attention:
    the blocks are square); a logsumexp whose sequence is the queries' (the
    efficient kernel pads it to a multiple of 32: the split needs a
    sequence that is one); and a user mask (Hugging Face models pass their
    causal mask as one) only if its query rows can follow the queries'
    split: its query dim (``-2``) is either the full query length (split
    like the queries, each rank keeping its rows against every key, as the
    keys are gathered) or broadcast (size 1, or a mask of fewer than two
    dims)."""
    sig = SEQUENCE_SHARDED_ATTENTION.get(node.target)
    if sig is None:
        return False
    q, k = (node.args[i].meta["val"] for i in (sig.query, sig.key))
    mask = user_mask(node, sig)
    if mask is not None:
        if is_causal(node, sig):
            return False  # both masks at once: the lowering would replace the user's with the causal one
        m = mask.meta["val"]
        if m.dim() > 4 or (m.dim() >= 2 and m.shape[-2] not in (1, q.shape[sig.seq_dim])):
            return False
    elif is_causal(node, sig) and q.shape[sig.seq_dim] != k.shape[sig.seq_dim]:
        return False
    lse = _logsumexp_val(node, sig)
    if (
        isinstance(lse, torch.Tensor)
        and lse.dim() > sig.seq_dim
        and lse.shape[sig.seq_dim] not in (0, q.shape[sig.seq_dim])
    ):
        return False
    return float(_arg(node, sig.dropout_p, node.kwargs.get("dropout_p", 0.0))) == 0.0


def mask_placement(p, mask: torch.Tensor, q_shape, gradient: bool = False) -> object:
    """A mask's (or its gradient's) placement on a mesh dim where q, k, v
    have ``p``: the mask's dim that broadcasts against the sharded
    ``[B, H, L, D]`` dim (the batch, the heads, or the query rows for the
    sequence split) is sharded where the mask holds it in full; where it
    broadcasts, the mask is replicated and its gradient a partial sum. The
    key dim is never split: the keys are gathered."""
    if not isinstance(p, Shard):
        return p
    dim = p.dim - (4 - mask.dim())
    if dim >= 0 and mask.shape[dim] == q_shape[p.dim] and q_shape[p.dim] > 1:
        return Shard(dim)
    return Partial() if gradient else Replicate()


def is_causal(node, sig: AttentionSignature) -> bool:
    """Whether the attention node masks causally (positional, by name, or
    the default False)."""
    return bool(_arg(node, sig.is_causal, node.kwargs.get("is_causal", False)))


def cp_mesh_dim(option: Option, sig: AttentionSignature) -> int | None:
    """The mesh dim an option splits the sequence over (the query's
    ``Shard(seq_dim)``), or None for a batch/heads option."""
    spec = option.input_specs[sig.query]
    for m, p in enumerate(spec.placements):
        if isinstance(p, Shard) and p.dim == sig.seq_dim:
            return m
    return None


def _local_shape(shape, placements, mesh) -> list[int]:
    out = list(shape)
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            out[p.dim] //= mesh.size(m)
    return out


def _with_length(shape, dim: int, length: int) -> list[int]:
    out = list(shape)
    out[dim] = length
    return out


def in_op_work(node, sig: AttentionSignature, placements: tuple, mesh, cp_dim: int) -> InOpWork:
    """The work the sequence-sharded option does beyond its local shapes:
    K and V gathered over ``cp_dim`` (forward and backward: the backward
    gathers them again rather than keep the gathered copies alive between
    the passes), dK and dV reduce-scattered (backward), and the flops
    beyond the op's own price (its local shapes' flops, halved when
    causal: a causal kernel skips the masked half).

    Causal, with the local sequence ``l = L/n`` even (the balanced layout,
    rank ``r`` holding chunks ``r`` and ``2n-1-r`` of ``c = l/2`` rows):
    the rank's causal diagonal block is the op's own price; the beyond is
    ``2n-2`` full ``c x c`` blocks, so each rank does half the unmasked
    attention divided by ``n``. With ``l`` odd the layout cannot be
    balanced and the contiguous lowering runs: ``n-1`` full ``l x l``
    blocks beyond the diagonal. Not causal: the local queries against the
    keys of the other ranks."""
    q, k, v = (node.args[i].meta["val"] for i in (sig.query, sig.key, sig.value))
    n = mesh.size(cp_dim)
    s = sig.seq_dim
    ql, kl, vl = (_local_shape(t.shape, placements, mesh) for t in (q, k, v))

    def flops(q_len: int, k_len: int) -> float:
        qs, ks, vs = _with_length(ql, s, q_len), _with_length(kl, s, k_len), _with_length(vl, s, k_len)
        if sig.backward:
            return sdpa_backward_flop_count(qs, qs, ks, vs)
        return sdpa_flop_count(qs, ks, vs)

    local = ql[s]
    if is_causal(node, sig):
        extra = (2 * n - 2) * flops(local // 2, local // 2) if local % 2 == 0 else (n - 1) * flops(local, local)
    else:
        extra = flops(local, kl[s] * n) - flops(local, kl[s])
    shard_bytes = [_numel(s) * t.element_size() for s, t in ((kl, k), (vl, v))]
    collectives = [("all_gather", b, cp_dim) for b in shard_bytes]
    if sig.backward:
        # the full-length gradients, reduced and split back to sequence shards
        collectives += [("reduce_scatter", b * n, cp_dim) for b in shard_bytes]
    return InOpWork(flops=float(extra), dtype=q.dtype, collectives=tuple(collectives))


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _mask_tensor_index(node, sig: AttentionSignature, mask) -> int | None:
    """The mask's index among the node's tensor inputs (positional masks sit
    among the other inputs, a keyword mask comes last)."""
    if mask is None:
        return None
    if isinstance(sig.mask, str):
        return sig.tensor_inputs
    return sum(
        isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) for a in node.args[: sig.mask]
    )


def _grad_mask_output(sig: AttentionSignature, outs) -> int | None:
    """The efficient backward's fourth output: the mask's gradient."""
    if sig.backward and len(outs) > 3 and isinstance(outs[3], torch.Tensor):
        return 3
    return None


def sequence_options(node, tensors: list[torch.Tensor], out_val, mesh, per_dim_choices) -> list[Option]:
    """The options that split the sequence over exactly one mesh dim (every
    attention tensor ``Shard(seq_dim)`` there, tensors of at most
    :data:`AUXILIARY_MAX_DIMS` dims replicated) and take ``per_dim_choices``
    (uniform batch / heads / replicate placements) on the others."""
    sig = SEQUENCE_SHARDED_ATTENTION.get(node.target)
    if sig is None or not sequence_shardable(node):
        return []
    mask = user_mask(node, sig)
    if len(tensors) != sig.tensor_inputs + (mask is not None):
        return []  # packed sequences (cum_seq_q/k given) or an input this signature does not know
    mask_index = _mask_tensor_index(node, sig, mask)
    q_shape = tensors[sig.query].shape
    outs = out_val if isinstance(out_val, (tuple, list)) else (out_val,)
    grad_mask = _grad_mask_output(sig, outs)
    seq = Shard(sig.seq_dim)
    options = []
    for cp_dim in range(mesh.ndim):
        if mesh.size(cp_dim) == 1:
            continue
        for rest in itertools.product(per_dim_choices, repeat=mesh.ndim - 1):
            combo = (*rest[:cp_dim], seq, *rest[cp_dim:])
            replicated = (Replicate(),) * mesh.ndim

            def placements(t, combo=combo, replicated=replicated):
                return replicated if t.dim() <= AUXILIARY_MAX_DIMS else combo

            in_placements = [placements(t) for t in tensors]
            if mask_index is not None:
                in_placements[mask_index] = tuple(mask_placement(p, tensors[mask_index], q_shape) for p in combo)
            out_placements = [placements(o) if isinstance(o, torch.Tensor) else None for o in outs]
            if grad_mask is not None:
                out_placements[grad_mask] = tuple(
                    mask_placement(p, outs[grad_mask], q_shape, gradient=True) for p in combo
                )
            placed = [*zip(tensors, in_placements), *((o, p) for o, p in zip(outs, out_placements) if p is not None)]
            if not all(is_evenly_sharded(t.shape, p, mesh) for t, p in placed):
                continue
            out_specs = tuple(
                DTensorSpec(mesh, p, tensor_meta=tensor_meta_of(o)) if p is not None else None
                for o, p in zip(outs, out_placements)
            )
            if not isinstance(out_val, (tuple, list)):
                out_specs = out_specs[0]
            work = in_op_work(node, sig, combo, mesh, cp_dim)
            in_specs = tuple(
                DTensorSpec(mesh, p, tensor_meta=tensor_meta_of(t)) for t, p in zip(tensors, in_placements)
            )
            options.append(Option(out_specs, in_specs, in_op=work))
    return options
