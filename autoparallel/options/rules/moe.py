"""Sharding rules for the routed-experts op of :mod:`autoparallel.ops.moe`.

``moe_experts(x, topk_idx, topk_w, w1, w3, w2, expert_ids, n_experts)``
computes, for every token, the routing-weighted sum of its top-k experts'
SwiGLU outputs, restricted to the experts listed in ``expert_ids``. That
restriction makes the op decompose four ways on each mesh dim, and any
combination across mesh dims is again exact:

* ``R``     everything replicated.
* ``T(d)``  token parallel (data/sequence): x, topk_idx, topk_w and the
            output ``Shard(d)`` on a token dim d; weights replicated (FSDP
            arrives here: the planner gathers sharded weights before use);
            the backward's weight gradients are ``Partial``.
* ``EP``    expert parallel: w1, w3, w2 **and expert_ids** ``Shard(0)``; each
            rank sees every routed (token, slot) of its group (x, topk_idx,
            topk_w replicated on that dim), computes only its experts and
            leaves zeros elsewhere, so the output is ``Partial``. With tokens
            arriving sharded on the same dim the redistribution is an
            all-gather before and a reduce-scatter after: an exact, static
            shape, dropless dispatch that moves ``ep`` times the bytes of an
            all-to-all under balanced routing (the cost model prices the
            collectives it actually runs).
* ``A(d)``  expert parallel with all-to-all dispatch: x, topk_idx, topk_w
            and the output stay ``Shard(d)`` (token dim d) and w1, w3, w2,
            expert_ids are ``Shard(0)`` on the same mesh dim. The apply stage
            lowers the op to ``autoparallel::moe_experts_a2a`` (and its
            backward) with that dim's process group
            (:mod:`autoparallel.apply.moe_dispatch`): per-expert counts are
            computed and exchanged at run time, token rows go to their
            experts' ranks by ``all_to_all_single`` with variable splits
            (dropless, unpadded) and come back weighted; the
            ``split_moe_a2a`` pass then splits it into phases whose
            all-to-alls the overlap scheduler can move. The option carries
            the in-op work (:class:`~autoparallel.options.strategies.InOpWork`):
            under balanced routing each rank sends its ``T_local * top_k``
            routed rows out and back, (ep-1)/ep of them to peers, ``dim``
            wide forward and ``2 dim`` backward, plus an ``n_experts``-int
            count exchange; and it computes ep times the rows its own tokens
            route to its experts. Offered only where no other mesh dim shards
            the expert dim (expert e lives on group rank ``e // (E / ep)``).
* ``TP``    hidden-dim tensor parallel: w1, w3 ``Shard(2)``, w2 ``Shard(1)``;
            inputs replicated, output ``Partial``.

The backward op mirrors each mode (grad_out arrives like the output would
leave, gradients of replicated inputs become ``Partial``).

What a user annotates: nothing, when the model's routed experts call
``autoparallel.ops.moe.moe_experts`` (as :class:`~autoparallel.models.moe.MoE`
does). Another MoE implementation plugs in by routing its expert compute
through that op (stacked ``w1/w3 [E, dim, hidden]``, ``w2 [E, hidden, dim]``
and an ``expert_ids = arange(E)`` buffer); a data-dependent dispatch traced
op by op (``nonzero``, ``.item()``) cannot be traced on fake tensors.
No region has to be declared: the planner chooses every placement around
the op, and this rule's modes for the op itself.

The FLOP formulas and the all-to-all bytes assume balanced routing: a rank
holding ``E_local`` of ``E`` experts does ``E_local / E`` of the routed work.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils.flop_counter import register_flop_formula

import autoparallel.ops.moe  # noqa: F401  (defines the ops)

from ..placements import all_placements
from ...cost_model.compute import local_shape as _local_shape
from ..strategies import InOpWork, Option, is_evenly_sharded, register_rule, tensor_inputs, tensor_meta_of

_ops = torch.ops.autoparallel
R, P = Replicate(), Partial()


# Per-mode placements: (x, topk_idx, topk_w, w1, w3, w2, expert_ids) -> out,
# and for the backward (grad_out, *those) -> (gx, gtw, gw1, gw3, gw2).
def _modes(token_dims: tuple[int, ...]):
    modes = {
        "R": ((R, R, R, R, R, R, R), R, (R, R, R, R, R)),
        "EP": ((R, R, R, Shard(0), Shard(0), Shard(0), Shard(0)), P, (P, P, Shard(0), Shard(0), Shard(0))),
        "TP": ((R, R, R, Shard(2), Shard(2), Shard(1), R), P, (P, P, Shard(2), Shard(2), Shard(1))),
    }
    for d in token_dims:
        s = Shard(d)
        modes[f"T{d}"] = ((s, s, s, R, R, R, R), s, (s, s, P, P, P))
    for d in token_dims:
        s, e = Shard(d), Shard(0)
        modes[f"A{d}"] = ((s, s, s, e, e, e, e), s, (s, s, e, e, e))
    return modes


def _expert_sharding_ok(names: tuple[str, ...]) -> bool:
    """An all-to-all mode maps expert e to group rank e // (E / ep): it needs
    the expert dim sharded on its mesh dim only."""
    n_a = sum(n.startswith("A") for n in names)
    return n_a == 0 or (n_a == 1 and "EP" not in names)


def local_shape(spec: DTensorSpec) -> tuple[int, ...]:
    return _local_shape(spec.tensor_meta.shape, spec.mesh.shape, spec.placements)


def _a2a_work(names, vals, in_specs, mesh, backward: bool) -> InOpWork | None:
    """The all-to-alls the ``A`` mode runs inside the op, balanced routing:
    each rank's routed (token, slot) rows go out and come back, (ep-1)/ep of
    them to peers (collective_time applies that fraction); the forward sends
    ``dim`` wide rows, the backward ``2 dim``; plus the ``n_experts`` counts.
    The flop formula sees 1/ep of the rows a rank computes (it assumes the
    rank's tokens only), so the rest is added here."""
    m = next((m for m, n in enumerate(names) if n.startswith("A")), None)
    if m is None:
        return None
    ep = mesh.size(m)
    off = 1 if backward else 0
    x, _idx, w1 = vals[off], vals[off + 1], vals[off + 3]
    x_spec, idx_spec, w1_spec = in_specs[off], in_specs[off + 1], in_specs[off + 3]
    dim, itemsize = x.shape[-1], x.element_size()
    rows = 1
    for s in local_shape(idx_spec):
        rows *= s  # this rank's routed (token, slot) pairs
    width = 2 * dim if backward else dim
    n_experts = w1.shape[0]
    counts = ("all_to_all", 8.0 * n_experts, m)
    rows_a2a = ("all_to_all", float(rows * width * itemsize), m)
    w_local = local_shape(w1_spec)
    base = _routed_flops(local_shape(x_spec), local_shape(idx_spec), w_local, n_experts)
    flops = (3 if backward else 1) * base * (ep - 1)
    return InOpWork(flops=float(flops), dtype=x.dtype, collectives=(counts, rows_a2a, rows_a2a))


def _options(node, mesh, backward: bool) -> list[Option]:
    ins = tensor_inputs(node)
    vals = [n.meta["val"] for n in ins]
    x = vals[1] if backward else vals[0]
    modes = _modes(tuple(range(x.ndim - 1)))
    out_val = node.meta["val"]
    options = []
    for names in itertools.product(modes, repeat=mesh.ndim):
        if not _expert_sharding_ok(names):
            continue
        combo = [modes[n] for n in names]
        in_pl = [tuple(m[0][k] for m in combo) for k in range(7)]
        if backward:
            # grad_out: the gradient of a Partial output is replicated (every
            # rank needs the full gradient of the rows its experts produced);
            # token-sharded outputs get token-sharded gradients.
            in_pl = [tuple(R if isinstance(m[1], Partial) else m[1] for m in combo)] + in_pl
            out_pl = [tuple(m[2][k] for m in combo) for k in range(5)]
            outs = list(out_val)
        else:
            out_pl = [tuple(m[1] for m in combo)]
            outs = [out_val]
        tensors = list(zip(vals, in_pl)) + list(zip(outs, out_pl))
        if not all(is_evenly_sharded(t.shape, pl, mesh) for t, pl in tensors):
            continue
        in_specs = tuple(DTensorSpec(mesh, pl, tensor_meta=tensor_meta_of(t)) for t, pl in zip(vals, in_pl))
        out_specs = tuple(DTensorSpec(mesh, pl, tensor_meta=tensor_meta_of(t)) for t, pl in zip(outs, out_pl))
        work = _a2a_work(names, vals, in_specs, mesh, backward)
        options.append(Option(out_specs if backward else out_specs[0], in_specs, in_op=work))
    return options


@register_rule(_ops.moe_experts.default)
def moe_experts_rule(node, input_candidates, mesh):
    return _options(node, mesh, backward=False)


@register_rule(_ops.moe_experts_backward.default)
def moe_experts_backward_rule(node, input_candidates, mesh):
    return _options(node, mesh, backward=True)


@register_rule(_ops.moe_grad_layout.default)
def moe_grad_layout_rule(node, input_candidates, mesh):
    """Any even layout, taken as it arrives (the edge into it reduces)."""
    val = node.meta["val"]
    meta = tensor_meta_of(val)
    return [
        Option(DTensorSpec(mesh, pl, tensor_meta=meta), (DTensorSpec(mesh, pl, tensor_meta=meta),))
        for pl in all_placements(val.shape, mesh)
    ]


def _routed_flops(x_shape, idx_shape, w1_shape, n_experts) -> int:
    tokens = 1
    for s in x_shape[:-1]:
        tokens *= s
    e_local, dim, hidden = w1_shape
    # three [dim x hidden] matmuls per routed (token, slot), balanced routing.
    return 2 * 3 * tokens * idx_shape[-1] * dim * hidden * e_local // n_experts


@register_flop_formula(_ops.moe_experts)
def _moe_experts_flop(x, idx, tw, w1, w3, w2, ids, n_experts, *args, out_shape=None, **kwargs) -> int:
    return _routed_flops(x, idx, w1, n_experts)


@register_flop_formula(_ops.moe_experts_backward)
def _moe_experts_backward_flop(g, x, idx, tw, w1, w3, w2, ids, n_experts, *args, out_shape=None, **kwargs) -> int:
    # recompute (3 matmuls) + weight grads (3) + input grads (2) + gh (1)
    return 3 * _routed_flops(x, idx, w1, n_experts)
