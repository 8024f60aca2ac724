"""Context parallelism: attention with the sequence split over one mesh dim.

Attention is not local along the sequence: each query row reads every key
(every earlier key, under a causal mask). The sequence-sharded option
therefore does not run the same op on local shards. It declares, per
attention op, where its query, key and value sit (:class:`AttentionSignature`),
and :mod:`autoparallel.apply.context_parallel` runs the option as "gather K
and V over the cp dim, then attend the rank's queries to every key with the
causal mask offset by the rank's first query position" (or, for an op
given a mask, with the mask's rows of the rank's queries: the option splits
the mask's query dim like the queries); its backward attends the same way
and reduce-scatters dK and dV back to sequence shards.

The planner sees the option as a sequence split of every attention tensor
(q, k, v, output, logsumexp, their gradients: ``Shard(seq_dim)`` on the cp
dim), plus the in-op work :func:`in_op_work` prices: the gathers and
reduce-scatters as collectives, and the compute a rank does beyond its
local shapes' flop formula (its queries against the full keys: the
attention compute divided by the cp degree, not by its square).

A new attention kernel (the CUDA flash / efficient / cuDNN ops) joins by
adding its :class:`AttentionSignature` to :data:`SEQUENCE_SHARDED_ATTENTION`
and offering :func:`sequence_options` from its rule; the local computation
needs a kernel that takes an additive mask (``attn_mask`` / ``attn_bias``)
for the causal case.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.fx
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from ..placements import InOpWork, Option, is_evenly_sharded, tensor_meta_of

aten = torch.ops.aten


@dataclass(frozen=True)
class AttentionSignature:
    """Where an attention op keeps what the sequence split needs.

    Positions are indices into ``node.args`` (the op's positional schema
    arguments); ``grad_key_value``: for a backward op, the indices of dK and
    dV in its output tuple (None for a forward op); ``seq_dim``: the
    sequence dim of q, k, v, the output and its gradient (``[B, H, L, D]``)
    and of the logsumexp (``[B, H, L]``).
    """

    query: int
    key: int
    value: int
    dropout_p: int
    is_causal: int
    # the additive mask argument: a keyword (``attn_mask``) or a position
    # (the efficient kernel's ``attn_bias``)
    mask: str | int = "attn_mask"
    grad_key_value: tuple[int, int] | None = None
    seq_dim: int = 2
    # tensor inputs the op has without a mask (the option is offered then only)
    tensor_inputs: int = 3

    @property
    def backward(self) -> bool:
        return self.grad_key_value is not None


SEQUENCE_SHARDED_ATTENTION: dict[object, AttentionSignature] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: AttentionSignature(
        query=0, key=1, value=2, dropout_p=3, is_causal=4
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: AttentionSignature(
        query=1, key=2, value=3, dropout_p=6, is_causal=7, grad_key_value=(1, 2), tensor_inputs=6
    ),
}


def _arg(node, index: int, default):
    return node.args[index] if len(node.args) > index else default


def user_mask(node, sig: AttentionSignature):
    """The node's additive/boolean mask argument (an fx Node), or None."""
    mask = _arg(node, sig.mask, None) if isinstance(sig.mask, int) else node.kwargs.get(sig.mask)
    return mask if isinstance(mask, torch.fx.Node) else None


def sequence_shardable(node) -> bool:
    """Whether ``node`` (an op of :data:`SEQUENCE_SHARDED_ATTENTION`) may be
    sequence-sharded: no dropout (its random stream is per global
    position), and a user mask (Hugging Face models pass their causal mask
    as one) only if its query rows can follow the queries' split: its
    query dim (``-2``) is either the full query length (split like the
    queries, each rank keeping its rows against every key, as the keys are
    gathered) or broadcast (size 1, or a mask of fewer than two dims)."""
    sig = SEQUENCE_SHARDED_ATTENTION.get(node.target)
    if sig is None:
        return False
    mask = user_mask(node, sig)
    if mask is not None:
        if is_causal(node, sig):
            return False  # both masks at once: the lowering would replace the user's with the causal one
        m, q = mask.meta["val"], node.args[sig.query].meta["val"]
        if m.dim() > 4 or (m.dim() >= 2 and m.shape[-2] not in (1, q.shape[sig.seq_dim])):
            return False
    return float(_arg(node, sig.dropout_p, node.kwargs.get("dropout_p", 0.0))) == 0.0


def mask_placement(p, mask: torch.Tensor, q_shape) -> object:
    """A mask's placement on a mesh dim where q, k, v have ``p``: the
    mask's dim that broadcasts against the sharded ``[B, H, L, D]`` dim
    (the batch, the heads, or the query rows for the sequence split) is
    sharded where the mask holds it in full, replicated where it
    broadcasts. The key dim is never split: the keys are gathered."""
    if not isinstance(p, Shard):
        return p
    dim = p.dim - (4 - mask.dim())
    if dim >= 0 and mask.shape[dim] == q_shape[p.dim] and q_shape[p.dim] > 1:
        return Shard(dim)
    return Replicate()


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


def in_op_work(node, sig: AttentionSignature, placements: tuple, mesh, cp_dim: int) -> InOpWork:
    """The work the sequence-sharded option does beyond its local shapes:
    K and V gathered over ``cp_dim`` (forward and backward: the backward
    gathers them again rather than keep the gathered copies alive between
    the passes), dK and dV reduce-scattered (backward), and the flops of
    the local queries against the keys of the other ranks."""
    q, k, v = (node.args[i].meta["val"] for i in (sig.query, sig.key, sig.value))
    n = mesh.size(cp_dim)
    ql, kl, vl = (_local_shape(t.shape, placements, mesh) for t in (q, k, v))
    kf, vf = list(kl), list(vl)
    kf[sig.seq_dim] *= n
    vf[sig.seq_dim] *= n
    if sig.backward:
        full, local = sdpa_backward_flop_count(ql, ql, kf, vf), sdpa_backward_flop_count(ql, ql, kl, vl)
    else:
        full, local = sdpa_flop_count(ql, kf, vf), sdpa_flop_count(ql, kl, vl)
    # The op's own price is its local shapes' flops, halved when causal (a
    # causal kernel skips the masked half); the lowered kernel takes an
    # explicit mask and computes every block of the local queries against
    # all keys: the difference is in-op work.
    flops = full - (0.5 if is_causal(node, sig) else 1.0) * local
    shard_bytes = [_numel(s) * t.element_size() for s, t in ((kl, k), (vl, v))]
    collectives = [("all_gather", b, cp_dim) for b in shard_bytes]
    if sig.backward:
        # the full-length gradients, reduced and split back to sequence shards
        collectives += [("reduce_scatter", b * n, cp_dim) for b in shard_bytes]
    return InOpWork(flops=float(flops), dtype=q.dtype, collectives=tuple(collectives))


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def sequence_options(node, tensors: list[torch.Tensor], out_val, mesh, per_dim_choices) -> list[Option]:
    """The options that split the sequence over exactly one mesh dim (every
    tensor ``Shard(seq_dim)`` there) and take ``per_dim_choices`` (uniform
    batch / heads / replicate placements) on the others."""
    sig = SEQUENCE_SHARDED_ATTENTION.get(node.target)
    if sig is None or not sequence_shardable(node):
        return []
    mask = user_mask(node, sig)
    # the mask comes after q, k, v (and the backward's other tensors) in
    # the node's tensor inputs: keyword ``attn_mask`` last
    if len(tensors) != sig.tensor_inputs + (mask is not None):
        return []
    mask_index = sig.tensor_inputs if mask is not None and isinstance(sig.mask, str) else None
    if mask is not None and mask_index is None:
        return []  # a positional mask (attn_bias) sits among the inputs: no such kernel is registered yet
    q_shape = tensors[sig.query].shape
    outs = out_val if isinstance(out_val, (tuple, list)) else (out_val,)
    out_tensors = [o for o in outs if isinstance(o, torch.Tensor)]
    seq = Shard(sig.seq_dim)
    options = []
    for cp_dim in range(mesh.ndim):
        if mesh.size(cp_dim) == 1:
            continue
        for rest in itertools.product(per_dim_choices, repeat=mesh.ndim - 1):
            combo = (*rest[:cp_dim], seq, *rest[cp_dim:])
            in_placements = [combo] * len(tensors)
            if mask_index is not None:
                in_placements[mask_index] = tuple(mask_placement(p, tensors[mask_index], q_shape) for p in combo)
            placed = [*zip(tensors, in_placements), *((o, combo) for o in out_tensors)]
            if not all(is_evenly_sharded(t.shape, p, mesh) for t, p in placed):
                continue

            def spec(t, placements=combo):
                return DTensorSpec(mesh, placements, tensor_meta=tensor_meta_of(t))

            out_specs = tuple(spec(o) if isinstance(o, torch.Tensor) else None for o in outs)
            if not isinstance(out_val, (tuple, list)):
                out_specs = out_specs[0]
            work = in_op_work(node, sig, combo, mesh, cp_dim)
            in_specs = tuple(spec(t, p) for t, p in zip(tensors, in_placements))
            options.append(Option(out_specs, in_specs, in_op=work))
    return options
