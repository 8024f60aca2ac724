"""The all-to-all expert dispatch as graph-visible phases.

``autoparallel::moe_experts_a2a`` (:mod:`.moe_dispatch`) runs count
exchange, token all-to-all, local experts, all-to-all back and combine
inside one op, so its all-to-alls block and nothing can run beside them.
The ``split_moe_a2a`` pass (:mod:`autoparallel.passes.split_moe_a2a`)
rewrites each such op (and its backward) into the ops below, so that the
two row all-to-alls are asynchronous collectives the overlap scheduler can
move, like the functional collectives::

    order, counts = moe_a2a_route(topk_idx, n_experts)
    recv_counts   = wait_tensor(all_to_all_single(counts, [E_local] * ep, ...))   # fixed size
    rows          = moe_a2a_gather_rows(x, order, k)                               # [T*k, dim]
    recv          = wait_tensor(moe_a2a_exchange(rows, counts, recv_counts, group))
    y             = moe_a2a_expert_rows(recv, recv_counts, w1, w3, w2)
    back          = wait_tensor(moe_a2a_exchange(y, recv_counts, counts, group))
    out           = moe_a2a_combine(back, order, topk_w)

and the backward likewise (``moe_a2a_gather_grad_rows`` sends ``[x,
topk_w * grad]`` rows, ``moe_a2a_expert_rows_backward`` returns ``[grad_x,
y]`` rows and the local experts' weight gradients, ``moe_a2a_combine_backward``
forms grad x and grad topk_w).

``moe_a2a_exchange`` issues ``all_to_all_single`` with ``async_op=True`` and
registers the work on its result, so ``_c10d_functional.wait_tensor`` on
that result completes it, exactly as for a functional collective; before
the wait the result must not be read (the graph never does).

**Data-dependent sizes.** How many rows a rank receives depends on the
routing. Only two values have such a size: a dispatch exchange's result
(``recv``) and the experts' output on it (``y``; backward: the ``[grad_x,
y]`` rows). Their fake values (``meta["val"]``, what tracing, the
partitioner, the cost model and the chunking pass see) have the *balanced*
shape ``[T*k, width]`` (a rank receives as many rows as it sends), and the
real tensors of the real size flow between these custom ops and
``wait_tensor`` only: every other value in the graph keeps its static
shape. Nothing reads their sizes: the ops take them from the exchanged
counts. The forward and backward graphs never save them (the backward
routes again from ``topk_idx``). A compiler that checks the shapes of
custom-op results against their fake values (Inductor's size asserts)
would reject these two; the plain FX runtime does not check.

Under ``LocalTensorMode`` the local ops run per rank (their per-rank
tensors may differ in size) and ``moe_a2a_exchange`` has a dispatch rule
that exchanges all members of each group in memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.utils.flop_counter import register_flop_formula

from . import moe_dispatch as md

__all__ = ["PHASE_OPS", "EXCHANGE"]


@torch.library.custom_op("autoparallel::moe_a2a_route", mutates_args=())
def moe_a2a_route(topk_idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(routed slots sorted by expert [T*k], slots per expert [n_experts])."""
    return md.route(topk_idx, n_experts)


@moe_a2a_route.register_fake
def _(topk_idx, n_experts):
    return topk_idx.new_empty((topk_idx.numel(),)), topk_idx.new_empty((n_experts,))


@torch.library.custom_op("autoparallel::moe_a2a_gather_rows", mutates_args=())
def moe_a2a_gather_rows(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """One row of ``x`` per routed slot, sorted by expert: [T*k, dim]."""
    return md.gather_rows(x, order, top_k)


@moe_a2a_gather_rows.register_fake
def _(x, order, top_k):
    return x.new_empty((order.shape[0], x.shape[-1]))


@torch.library.custom_op("autoparallel::moe_a2a_gather_grad_rows", mutates_args=())
def moe_a2a_gather_grad_rows(
    x: torch.Tensor, grad_out: torch.Tensor, topk_w: torch.Tensor, order: torch.Tensor
) -> torch.Tensor:
    """``[x, topk_w * grad_out]`` per routed slot, sorted by expert: [T*k, 2 dim]."""
    return md.gather_grad_rows(x, grad_out, topk_w, order, topk_w.shape[-1])


@moe_a2a_gather_grad_rows.register_fake
def _(x, grad_out, topk_w, order):
    return x.new_empty((order.shape[0], 2 * x.shape[-1]))


@torch.library.custom_op("autoparallel::moe_a2a_exchange", mutates_args=())
def moe_a2a_exchange(
    rows: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor, group_name: str
) -> torch.Tensor:
    """Start the all-to-all of ``rows`` (sent per peer as ``send_counts``
    says, received as ``recv_counts`` says); complete it with
    ``_c10d_functional.wait_tensor`` on the result."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    ep = dist.get_world_size(group)
    send, recv = md.splits(send_counts, ep), md.splits(recv_counts, ep)
    out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
    work = dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group, async_op=True)
    torch._C._distributed_c10d._register_work(out, work)
    return out


@moe_a2a_exchange.register_fake
def _(rows, send_counts, recv_counts, group_name):
    # balanced routing: a rank receives as many rows as it sends
    return torch.empty_like(rows)


@moe_a2a_exchange.register_torch_dispatch(LocalTensorMode)
def _(mode, func, types, args, kwargs):
    rows, send_counts, recv_counts, group_name = args
    out: dict[int, torch.Tensor] = {}
    with mode.disable():
        for members in md._groups(group_name):
            ep = len(members)

            def per(t):
                return [t._local_tensors[r] if isinstance(t, LocalTensor) else t for r in members]

            got = md._MemoryExchange(ep).rows(
                per(rows), [md.splits(c, ep) for c in per(send_counts)], [md.splits(c, ep) for c in per(recv_counts)]
            )
            out.update(zip(members, got))
    return LocalTensor(out)


@torch.library.custom_op("autoparallel::moe_a2a_expert_rows", mutates_args=())
def moe_a2a_expert_rows(
    rows: torch.Tensor, recv_counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The local experts' (un-weighted) outputs on the received rows."""
    return md.expert_rows(rows, recv_counts, w1, w3, w2)


@moe_a2a_expert_rows.register_fake
def _(rows, recv_counts, w1, w3, w2):
    return torch.empty_like(rows)


@torch.library.custom_op("autoparallel::moe_a2a_expert_rows_backward", mutates_args=())
def moe_a2a_expert_rows_backward(
    rows: torch.Tensor, recv_counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """On received ``[x, topk_w * grad]`` rows: ``[grad_x, y]`` rows to send
    back and the local experts' weight gradients (sums over the rows)."""
    return md.expert_rows_backward(rows, recv_counts, w1, w3, w2)


@moe_a2a_expert_rows_backward.register_fake
def _(rows, recv_counts, w1, w3, w2):
    return torch.empty_like(rows), torch.empty_like(w1), torch.empty_like(w3), torch.empty_like(w2)


@torch.library.custom_op("autoparallel::moe_a2a_combine", mutates_args=())
def moe_a2a_combine(back: torch.Tensor, order: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
    """Per token, the routing-weighted sum of its returned rows."""
    return md.combine(back, order, topk_w)


@moe_a2a_combine.register_fake
def _(back, order, topk_w):
    return back.new_empty(tuple(topk_w.shape[:-1]) + (back.shape[-1],))


@torch.library.custom_op("autoparallel::moe_a2a_combine_backward", mutates_args=())
def moe_a2a_combine_backward(
    back: torch.Tensor, grad_out: torch.Tensor, order: torch.Tensor, topk_w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad x, grad topk_w) from the returned ``[grad_x, y]`` rows."""
    return md.combine_backward(back, grad_out, order, topk_w)


@moe_a2a_combine_backward.register_fake
def _(back, grad_out, order, topk_w):
    return torch.empty_like(grad_out), torch.empty_like(topk_w)


_ops = torch.ops.autoparallel
EXCHANGE = _ops.moe_a2a_exchange.default
PHASE_OPS = frozenset(
    getattr(_ops, name).default
    for name in (
        "moe_a2a_route",
        "moe_a2a_gather_rows",
        "moe_a2a_gather_grad_rows",
        "moe_a2a_exchange",
        "moe_a2a_expert_rows",
        "moe_a2a_expert_rows_backward",
        "moe_a2a_combine",
        "moe_a2a_combine_backward",
    )
)


def _rows_flops(rows_shape, w1_shape) -> int:
    # three [dim x hidden] matmuls per row; every row goes to one local expert
    _, dim, hidden = w1_shape
    return 2 * 3 * rows_shape[0] * dim * hidden


@register_flop_formula(_ops.moe_a2a_expert_rows)
def _expert_rows_flop(rows, recv_counts, w1, w3, w2, *args, out_shape=None, **kwargs) -> int:
    return _rows_flops(rows, w1)


@register_flop_formula(_ops.moe_a2a_expert_rows_backward)
def _expert_rows_backward_flop(rows, recv_counts, w1, w3, w2, *args, out_shape=None, **kwargs) -> int:
    # as moe_experts_backward: recompute, weight and input gradients
    return 3 * _rows_flops(rows, w1)
