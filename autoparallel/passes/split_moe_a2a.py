"""Split the all-to-all MoE ops into phases whose all-to-alls can overlap.

The apply stage lowers the routed-experts op in its all-to-all mode to
``autoparallel::moe_experts_a2a`` (and ``..._backward``), which runs its
exchanges inside, blocking. This pass (stage ``"joint"``, before
``chunk_regions``) rewrites every such op of the rank-local joint graph
into the phase ops of :mod:`autoparallel.apply.moe_a2a_phases`: route,
a fixed-size count all-to-all (a functional collective), gather rows, an
asynchronous row all-to-all (``moe_a2a_exchange`` + ``wait_tensor``), the
local experts, the all-to-all back, combine. The same arithmetic in the
same order: results are bitwise those of the fused op. Then
``schedule_overlap`` issues the all-to-alls early and waits late (the
shared experts and other independent work run meanwhile), and
``chunk_regions`` can split a MoE region in two so one chunk's
all-to-all runs under the other's experts.

``disable_passes=("split_moe_a2a",)`` keeps the fused ops.

>>> # stats = split_moe_a2a(local.gm, ctx)   # doctest: +SKIP
>>> # SplitMoEStats(forward=3, backward=3, nodes_added=60)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..apply import moe_a2a_phases  # noqa: F401 - registers the phase ops (and moe_experts_a2a, through moe_dispatch)
from ..graph_vocab import C10D as _c10d, SOURCE_KEY
from .base import PassContext, register_pass
from .chunk_dims import fake_mode_of, stamp_like, fake_val

__all__ = ["SplitMoEStats", "split_moe_a2a"]

_ops = torch.ops.autoparallel

# node.meta keys copied from the fused op to its phases (module path, AC
# and partitioner tags, where it came from). The partitioner tag keeps the
# backward's routing (which reads forward values only) in the backward.
_KEEP_META = ("nn_module_stack", "stack_trace", "custom", "recompute", "ac_graph_id", "partitioner_tag", SOURCE_KEY)


@dataclass
class SplitMoEStats:
    forward: int = 0  # fused forward ops split
    backward: int = 0
    nodes_added: int = 0


class _Emitter:
    """Create nodes before ``anchor`` with fake values and the anchor's meta."""

    def __init__(self, gm: fx.GraphModule, anchor: fx.Node):
        self.g, self.anchor = gm.graph, anchor
        self.mode = fake_mode_of([fake_val(a) for a in anchor.all_input_nodes])
        self.added = 0

    def __call__(self, target, *args) -> fx.Node:
        with self.g.inserting_before(self.anchor):
            n = self.g.call_function(target, args)
        for k in _KEEP_META:
            if k in self.anchor.meta:
                n.meta[k] = self.anchor.meta[k]
        vals = fx.node.map_arg(args, fake_val)
        if target is operator.getitem:
            n.meta["val"] = vals[0][vals[1]]
        else:
            with self.mode:
                n.meta["val"] = target(*vals)
        stamp_like(n, self.anchor, ("split_moe_a2a", self.added))
        self.added += 1
        return n

    def pair(self, target, *args) -> tuple[fx.Node, fx.Node]:
        t = self(target, *args)
        return self(operator.getitem, t, 0), self(operator.getitem, t, 1)

    def exchange(self, rows, send_counts, recv_counts, group) -> fx.Node:
        return self(
            _c10d.wait_tensor.default, self(_ops.moe_a2a_exchange.default, rows, send_counts, recv_counts, group)
        )

    def route(self, idx, n_experts, e_local, group) -> tuple[fx.Node, fx.Node, fx.Node]:
        order, counts = self.pair(_ops.moe_a2a_route.default, idx, n_experts)
        ep = n_experts // e_local
        sizes = [e_local] * ep
        recv = self(_c10d.wait_tensor.default, self(_c10d.all_to_all_single.default, counts, sizes, sizes, group))
        return order, counts, recv


def _split_forward(gm: fx.GraphModule, n: fx.Node) -> int:
    x, idx, tw, w1, w3, w2, _ids, n_experts, group = n.args
    emit = _Emitter(gm, n)
    k = fake_val(idx).shape[-1]
    order, counts, recv_counts = emit.route(idx, n_experts, fake_val(w1).shape[0], group)
    rows = emit(_ops.moe_a2a_gather_rows.default, x, order, k)
    recv = emit.exchange(rows, counts, recv_counts, group)
    y = emit(_ops.moe_a2a_expert_rows.default, recv, recv_counts, w1, w3, w2)
    back = emit.exchange(y, recv_counts, counts, group)
    out = emit(_ops.moe_a2a_combine.default, back, order, tw)
    n.replace_all_uses_with(out)
    gm.graph.erase_node(n)
    return emit.added


def _split_backward(gm: fx.GraphModule, n: fx.Node) -> int:
    g, x, idx, tw, w1, w3, w2, _ids, n_experts, group = n.args
    emit = _Emitter(gm, n)
    order, counts, recv_counts = emit.route(idx, n_experts, fake_val(w1).shape[0], group)
    rows = emit(_ops.moe_a2a_gather_grad_rows.default, x, g, tw, order)
    recv = emit.exchange(rows, counts, recv_counts, group)
    done = emit(_ops.moe_a2a_expert_rows_backward.default, recv, recv_counts, w1, w3, w2)
    ret = emit(operator.getitem, done, 0)
    back = emit.exchange(ret, recv_counts, counts, group)
    gx, gtw = emit.pair(_ops.moe_a2a_combine_backward.default, back, g, order, tw)
    # the fused op's outputs (gx, gtw, gw1, gw3, gw2), read through getitems
    outs = {0: gx, 1: gtw}
    for u in list(n.users):
        if u.target is not operator.getitem:
            raise RuntimeError(f"split_moe_a2a: {u.name} reads {n.name}'s result tuple whole ({u.target})")
        i = u.args[1]
        if i not in outs:
            outs[i] = emit(operator.getitem, done, i - 1)
        u.replace_all_uses_with(outs[i])
        gm.graph.erase_node(u)
    gm.graph.erase_node(n)
    return emit.added


@register_pass("split_moe_a2a", "joint")
def split_moe_a2a(gm: fx.GraphModule, ctx: PassContext) -> SplitMoEStats | None:
    """Rewrite the fused all-to-all MoE ops of ``gm`` into phases (see the
    module docstring); None when the graph has none."""
    fwd = list(gm.graph.find_nodes(op="call_function", target=_ops.moe_experts_a2a.default))
    bwd = list(gm.graph.find_nodes(op="call_function", target=_ops.moe_experts_a2a_backward.default))
    if not fwd and not bwd:
        return None
    stats = SplitMoEStats()
    for n in fwd:
        stats.nodes_added += ctx.copies(n) * _split_forward(gm, n)
        stats.forward += ctx.copies(n)
    for n in bwd:
        stats.nodes_added += ctx.copies(n) * _split_backward(gm, n)
        stats.backward += ctx.copies(n)
    gm.graph.lint()
    gm.recompile()
    return stats
