"""All-to-all token dispatch for the routed experts (the ``A`` mode of
:mod:`autoparallel.options.rules.moe`), as rank-local custom ops.

When the plan keeps tokens sharded on a mesh dim that also shards the expert
weights on dim 0, the apply stage replaces ``autoparallel::moe_experts`` (and
its backward) by the ops here, with the process group of that mesh dim:

1. every (token, slot) pair is sorted by its expert; per-expert counts are
   computed at run time and exchanged (a fixed-size all-to-all of
   ``n_experts`` ints), so each rank knows how many rows it receives from each
   peer for each of its local experts;
2. the token rows are sent with ``all_to_all_single`` and variable split
   sizes (dropless, nothing padded);
3. the owner runs its local experts on the rows it received and sends the
   un-weighted outputs back (the same splits, reversed);
4. the sender combines them with its routing weights.

The backward sends ``[x, topk_w * grad]`` rows (one all-to-all), the owner
computes its expert weight gradients and returns ``[grad_x, y]`` rows, and the
sender sums ``grad_x`` per token and forms ``grad_topk_w = <y, grad>``.

Expert ``e`` lives on group rank ``e // (n_experts / ep)``: the rule offers
this mode only where no other mesh dim shards the expert dim.

Data-dependent sizes stay inside the ops: their outputs have the shapes of
their inputs, so the graph around them is static. Their all-to-alls block
inside them; the ``split_moe_a2a`` pass (run by default) rewrites them into
graph-visible phases with asynchronous all-to-alls
(:mod:`.moe_a2a_phases`), built from the per-rank steps below. Under
``LocalTensorMode`` (many ranks in one process) a ``torch_dispatch`` rule runs
the same algorithm over all members of each group at once, exchanging in
memory.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

from autoparallel.ops.moe import swiglu_backward  # also registers the ops being lowered
from autoparallel.torch_compat import groups_of

_ops = torch.ops.autoparallel

# op -> function(option, mesh, largs, lkwargs) -> (op, largs, lkwargs) or None:
# how the apply stage replaces a rank-local call for a chosen option.
LOCAL_LOWERINGS: dict[object, Callable] = {}


# --------------------------------------------------------------------------
# The algorithm, over a list of group members (1 under real process groups)
# --------------------------------------------------------------------------


class _DistExchange:
    """This rank only; exchanges with ``all_to_all_single`` on ``group``."""

    def __init__(self, group_name: str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        self.group = _resolve_process_group(group_name)
        self.size = dist.get_world_size(self.group)

    def counts(self, send: list[torch.Tensor]) -> list[torch.Tensor]:
        out = torch.empty_like(send[0])
        dist.all_to_all_single(out, send[0].contiguous(), group=self.group)
        return [out]

    def rows(self, send: list[torch.Tensor], send_splits: list[list[int]], recv_splits: list[list[int]]):
        t = send[0].contiguous()
        out = t.new_empty((sum(recv_splits[0]),) + tuple(t.shape[1:]))
        dist.all_to_all_single(out, t, recv_splits[0], send_splits[0], group=self.group)
        return [out]


class _MemoryExchange:
    """All members of one group in this process (LocalTensorMode)."""

    def __init__(self, size: int):
        self.size = size

    def counts(self, send: list[torch.Tensor]) -> list[torch.Tensor]:
        # send[i] is [n_experts] in peer-major order: block j goes to member j
        blocks = [s.view(self.size, -1) for s in send]
        return [torch.cat([blocks[j][i] for j in range(self.size)]) for i in range(self.size)]

    def rows(self, send, send_splits, recv_splits):
        parts = [list(torch.split(send[j], send_splits[j])) for j in range(self.size)]
        return [torch.cat([parts[j][i] for j in range(self.size)]) for i in range(self.size)]


# Per-rank steps of the dispatch, shared by the fused ops below and the
# phase ops of :mod:`.moe_a2a_phases`. ``counts`` are per expert
# ([n_experts], expert e on group rank e // E_local: peer-major); rows sent
# are sorted by expert, rows received are peer-major, expert-minor.


def route(idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots sorted by expert [tokens * k], slots per expert [n_experts])."""
    flat = idx.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=n_experts)


def splits(counts: torch.Tensor, ep: int) -> list[int]:
    """Rows per peer from per-expert counts."""
    return counts.view(ep, -1).sum(-1).tolist()


def _recv_expert(recv_counts: torch.Tensor, e_local: int) -> torch.Tensor:
    """Local expert index of each received row (peer-major, expert-minor)."""
    ep = recv_counts.numel() // e_local
    return torch.arange(e_local).repeat(ep).repeat_interleave(recv_counts.reshape(-1))


def gather_rows(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """The token rows to send, one per routed slot, sorted by expert."""
    return x.reshape(-1, x.shape[-1]).index_select(0, order // k)


def gather_grad_rows(x, grad, tw, order, k: int) -> torch.Tensor:
    """Backward rows to send: ``[x, topk_w * grad]`` per routed slot."""
    d = x.shape[-1]
    t = order // k
    return torch.cat([x.reshape(-1, d)[t], grad.reshape(-1, d)[t] * tw.reshape(-1)[order, None]], -1)


def expert_rows(rows, recv_counts, w1, w3, w2) -> torch.Tensor:
    """Un-weighted SwiGLU outputs of the local experts on received rows."""
    e_of = _recv_expert(recv_counts, w1.shape[0])
    y = torch.zeros_like(rows)
    for j in range(w1.shape[0]):
        sel = (e_of == j).nonzero(as_tuple=True)[0]
        if sel.numel():
            xs = rows[sel]
            y[sel] = (F.silu(xs @ w1[j]) * (xs @ w3[j])) @ w2[j]
    return y


def expert_rows_backward(rows, recv_counts, w1, w3, w2):
    """On received ``[x, topk_w * grad]`` rows: (``[grad_x, y]`` rows to
    send back, grad w1, grad w3, grad w2 of the local experts)."""
    d = rows.shape[-1] // 2
    xr, gyr = rows[:, :d], rows[:, d:]
    e_of = _recv_expert(recv_counts, w1.shape[0])
    ret = torch.zeros_like(rows)
    gw1, gw3, gw2 = torch.zeros_like(w1), torch.zeros_like(w3), torch.zeros_like(w2)
    for j in range(w1.shape[0]):
        sel = (e_of == j).nonzero(as_tuple=True)[0]
        if sel.numel() == 0:
            continue
        ret[sel, :d], ret[sel, d:], gw1[j], gw3[j], gw2[j] = swiglu_backward(xr[sel], gyr[sel], w1[j], w3[j], w2[j])
    return ret, gw1, gw3, gw2


def combine(back, order, tw) -> torch.Tensor:
    """Routing-weighted sum per token of the returned rows: ``[*tw[:-1], dim]``."""
    k = tw.shape[-1]
    out = back.new_zeros((tw.numel() // k, back.shape[-1]))
    out.index_add_(0, order // k, back * tw.reshape(-1)[order, None])
    return out.view(tuple(tw.shape[:-1]) + (back.shape[-1],))


def combine_backward(back, grad, order, tw):
    """(grad x, grad topk_w) from the returned ``[grad_x, y]`` rows."""
    d = grad.shape[-1]
    k = tw.shape[-1]
    t = order // k
    gx = torch.zeros_like(grad).view(-1, d)
    gx.index_add_(0, t, back[:, :d])
    gtw = torch.zeros_like(tw).reshape(-1)
    gtw[order] = (back[:, d:] * grad.reshape(-1, d)[t]).sum(-1)
    return gx.view(grad.shape), gtw.view(tw.shape)


def _dispatch(idxs, n_experts, ex):
    routes = [route(i, n_experts) for i in idxs]
    recv_counts = ex.counts([c for _, c in routes])
    send_splits = [splits(c, ex.size) for _, c in routes]
    recv_splits = [splits(c, ex.size) for c in recv_counts]
    return routes, recv_counts, send_splits, recv_splits


def _forward_group(xs, idxs, tws, w1s, w3s, w2s, n_experts, ex):
    k = idxs[0].shape[-1]
    routes, recv_counts, send_splits, recv_splits = _dispatch(idxs, n_experts, ex)
    recv = ex.rows([gather_rows(x, order, k) for x, (order, _) in zip(xs, routes)], send_splits, recv_splits)
    ys = [expert_rows(*a) for a in zip(recv, recv_counts, w1s, w3s, w2s)]
    back = ex.rows(ys, recv_splits, send_splits)
    return [combine(b, order, tw) for b, (order, _), tw in zip(back, routes, tws)]


def _backward_group(gs, xs, idxs, tws, w1s, w3s, w2s, n_experts, ex):
    k = idxs[0].shape[-1]
    routes, recv_counts, send_splits, recv_splits = _dispatch(idxs, n_experts, ex)
    send = [gather_grad_rows(x, g, tw, order, k) for x, g, tw, (order, _) in zip(xs, gs, tws, routes)]
    recv = ex.rows(send, send_splits, recv_splits)
    done = [expert_rows_backward(*a) for a in zip(recv, recv_counts, w1s, w3s, w2s)]
    back = ex.rows([d[0] for d in done], recv_splits, send_splits)
    return [combine_backward(b, g, order, tw) + d[1:] for b, g, (order, _), tw, d in zip(back, gs, routes, tws, done)]


# --------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------


@torch.library.custom_op("autoparallel::moe_experts_a2a", mutates_args=())
def moe_experts_a2a(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    n_experts: int,
    group_name: str,
) -> torch.Tensor:
    """``moe_experts`` for this rank's tokens, the experts living on the
    members of ``group_name`` (this rank holds ``w*``, experts ``expert_ids``)."""
    return _forward_group([x], [topk_idx], [topk_w], [w1], [w3], [w2], n_experts, _DistExchange(group_name))[0]


@moe_experts_a2a.register_fake
def _(x, topk_idx, topk_w, w1, w3, w2, expert_ids, n_experts, group_name):
    return torch.empty_like(x)


@torch.library.custom_op("autoparallel::moe_experts_a2a_backward", mutates_args=())
def moe_experts_a2a_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    n_experts: int,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (x, topk_w, w1, w3, w2) of :func:`moe_experts_a2a`."""
    ex = _DistExchange(group_name)
    return _backward_group([grad_out], [x], [topk_idx], [topk_w], [w1], [w3], [w2], n_experts, ex)[0]


@moe_experts_a2a_backward.register_fake
def _(grad_out, x, topk_idx, topk_w, w1, w3, w2, expert_ids, n_experts, group_name):
    return (
        torch.empty_like(x),
        torch.empty_like(topk_w),
        torch.empty_like(w1),
        torch.empty_like(w3),
        torch.empty_like(w2),
    )


# --------------------------------------------------------------------------
# LocalTensorMode: all ranks of each group at once
# --------------------------------------------------------------------------


def _groups(group_name: str) -> list[list[int]]:
    return groups_of(group_name)


def _local_run(tensors, n_experts, group_name, fn):
    out: dict[int, object] = {}
    for members in _groups(group_name):
        per = [[t._local_tensors[r] if isinstance(t, LocalTensor) else t for r in members] for t in tensors]
        for r, res in zip(members, fn(*per, n_experts, _MemoryExchange(len(members)))):
            out[r] = res
    return out


@moe_experts_a2a.register_torch_dispatch(LocalTensorMode)
def _(mode, func, types, args, kwargs):
    x, idx, tw, w1, w3, w2, _ids, n_experts, group_name = args
    with mode.disable():
        res = _local_run((x, idx, tw, w1, w3, w2), n_experts, group_name, _forward_group)
    return LocalTensor(res)


@moe_experts_a2a_backward.register_torch_dispatch(LocalTensorMode)
def _(mode, func, types, args, kwargs):
    g, x, idx, tw, w1, w3, w2, _ids, n_experts, group_name = args
    with mode.disable():
        res = _local_run((g, x, idx, tw, w1, w3, w2), n_experts, group_name, _backward_group)
    return tuple(LocalTensor({r: v[k] for r, v in res.items()}) for k in range(5))


# --------------------------------------------------------------------------
# Apply-time lowering
# --------------------------------------------------------------------------


def a2a_mesh_dim(x_spec, w1_spec) -> int | None:
    """The mesh dim on which tokens and experts are both sharded (the ``A``
    mode), or None."""
    for m, (px, pw) in enumerate(zip(x_spec.placements, w1_spec.placements)):
        if px.is_shard() and pw.is_shard(0):
            return m
    return None


def _lower(new_op, x_pos):
    def lower(option, mesh, largs, lkwargs):
        specs = option.input_specs
        m = a2a_mesh_dim(specs[x_pos], specs[x_pos + 3])
        if m is None:
            return None
        return new_op, tuple(largs) + (mesh.get_group(m).group_name,), lkwargs

    return lower


LOCAL_LOWERINGS[_ops.moe_experts.default] = _lower(_ops.moe_experts_a2a.default, 0)
LOCAL_LOWERINGS[_ops.moe_experts_backward.default] = _lower(_ops.moe_experts_a2a_backward.default, 1)


# --------------------------------------------------------------------------
# Costs of the lowered ops (overlap scheduling, estimates)
# --------------------------------------------------------------------------


def _rows_flops(x_shape, idx_shape, w1_shape) -> int:
    tokens = 1
    for s in x_shape[:-1]:
        tokens *= s
    _, dim, hidden = w1_shape
    # balanced routing: a rank runs as many (token, slot) rows as it routes
    return 2 * 3 * tokens * idx_shape[-1] * dim * hidden


@register_flop_formula(_ops.moe_experts_a2a)
def _a2a_flop(x, idx, tw, w1, w3, w2, ids, n_experts, group_name, *args, out_shape=None, **kwargs) -> int:
    return _rows_flops(x, idx, w1)


@register_flop_formula(_ops.moe_experts_a2a_backward)
def _a2a_backward_flop(g, x, idx, tw, w1, w3, w2, ids, n_experts, group_name, *a, out_shape=None, **kw) -> int:
    return 3 * _rows_flops(x, idx, w1)


def in_op_collectives(node) -> list[tuple[str, int, str]]:
    """(kind, bytes per rank, group name) of the all-to-alls a lowered op runs
    (blocking, inside the op: they cannot overlap with its compute)."""
    backward = node.target is _ops.moe_experts_a2a_backward.default
    if not backward and node.target is not _ops.moe_experts_a2a.default:
        return []
    off = 1 if backward else 0
    x, idx = node.args[off].meta["val"], node.args[off + 1].meta["val"]
    n_experts, group = node.args[-2], node.args[-1]
    rows = idx.numel() * x.shape[-1] * x.element_size() * (2 if backward else 1)
    return [("all_to_all", 8 * n_experts, group), ("all_to_all", rows, group), ("all_to_all", rows, group)]
