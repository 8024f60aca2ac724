"""schedule_overlap on hand-built graphs: a valid topological order, parameter
all-gathers prefetched a bounded number of layers ahead, reduce-scatters
issued as soon as their gradient exists, at most ``max_consecutive_compute``
compute ops before each reduce-scatter, and estimates reported."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel.passes import PassContext, PassOptions
from autoparallel.passes.schedule_overlap import (
    PEAK_TOLERANCE,
    check_topological,
    longest_compute_run,
    schedule_overlap,
)

c10d = torch.ops._c10d_functional
AG, RS, WAIT = c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default, c10d.wait_tensor.default
LAYERS = 4


def _backward_like(*args):
    # gradients of LAYERS linear layers, all reduce-scattered at the end (as
    # the joint graph emits them), weights re-gathered right before use
    g, acts, shards = args[0], args[1 : 1 + LAYERS], args[1 + LAYERS :]
    grads = []
    for k in reversed(range(LAYERS)):
        w = c10d.wait_tensor(c10d.all_gather_into_tensor(shards[k], 4, "0"))
        grads.append(g.t() @ acts[k])
        g = g @ w
    outs = [c10d.wait_tensor(c10d.reduce_scatter_tensor(gw, "sum", 4, "0")) for gw in grads]
    return (g, *outs)


def _trace(tokens=16, fn=None):
    """``fn`` (default :func:`_backward_like`) traced on its input, one
    activation and one 8 x 32 weight shard per layer."""
    # tokens=16: comm-bound (collective latency >> matmul time);
    # tokens=1 << 20: each matmul takes longer than a gather
    with FakeTensorMode():
        args = (
            [torch.randn(tokens, 32)]
            + [torch.randn(tokens, 32) for _ in range(LAYERS)]
            + [torch.randn(8, 32) for _ in range(LAYERS)]
        )
        return make_fx(fn or _backward_like)(*args)


def _ctx(**kw):
    return PassContext(mesh=None, plan=None, options=PassOptions(**kw), graph_kind="backward")


def _positions(gm, target):
    return [i for i, n in enumerate(gm.graph.nodes) if n.target is target]


def test_reduce_scatters_move_up_and_cap_holds():
    gm = _trace()
    assert longest_compute_run(gm.graph.nodes) == 2 * LAYERS  # all matmuls before the first reduce-scatter
    stats = schedule_overlap(gm, _ctx(max_consecutive_compute=2))
    check_topological(gm)
    assert stats.longest_compute_run_before == 2 * LAYERS
    assert stats.longest_compute_run_after <= 2
    assert longest_compute_run(gm.graph.nodes) == stats.longest_compute_run_after
    assert stats.reduce_scatters == LAYERS and stats.nodes_moved > 0
    # prefetching is bounded by the unscheduled peak (+ slack)
    assert 0 < stats.peak_memory_after <= 1.1 * stats.peak_memory_before


def test_all_gathers_prefetched_bounded():
    gm = _trace(tokens=1 << 20)
    stats = schedule_overlap(gm, _ctx(prefetch_layers=1))
    assert stats.prefetched_all_gathers == LAYERS
    check_topological(gm)
    nodes = list(gm.graph.nodes)
    ags = _positions(gm, AG)
    mms = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    # compute-bound: every gather is issued before the matmul preceding its
    # use, but never more than one layer (2 matmuls) ahead of it
    for i in ags:
        wait = next(u for u in nodes[i].users if u.target is WAIT)
        use = min(nodes.index(u) for u in wait.users)
        between = [m for m in mms if i < m < use]
        assert 1 <= len(between) <= 4, (nodes[i].name, between)
    # waits right before their first use
    for i in _positions(gm, WAIT):
        w = nodes[i]
        if w.args[0].target is AG:
            first = min(nodes.index(u) for u in w.users)
            assert not any(nodes[j].target is torch.ops.aten.mm.default for j in range(i + 1, first))


def test_estimates_and_no_collectives():
    def f(x, w):
        return (x @ w).relu() @ w

    with FakeTensorMode():
        gm = make_fx(f)(torch.randn(8, 8), torch.randn(8, 8))
    stats = schedule_overlap(gm, _ctx())
    check_topological(gm)
    assert stats.nodes_moved == 0 and stats.all_gathers == 0
    assert stats.exposed_comm_before_s == stats.exposed_comm_after_s == 0.0
    assert stats.peak_memory_before == stats.peak_memory_after > 0


def test_overlap_reduces_exposed_comm():
    gm = _trace()
    stats = schedule_overlap(gm, _ctx())
    assert stats.exposed_comm_after_s < stats.exposed_comm_before_s


def test_comm_bound_reductions_not_queued_behind_prefetch():
    """Comm-bound: a gather of a later layer is prefetched only while its
    link is idle, so each reduce-scatter is issued before the next compute op
    after its gradient (after the gathers that step prefetches: those are
    needed first) and never sits behind gathers issued far ahead of need;
    memory does not grow."""
    gm = _trace()
    stats = schedule_overlap(gm, _ctx(prefetch_layers=LAYERS))
    check_topological(gm)
    nodes = list(gm.graph.nodes)
    for i in _positions(gm, RS):
        grad = nodes.index(nodes[i].args[0])
        assert not any(n.target is torch.ops.aten.mm.default for n in nodes[grad + 1 : i]), nodes[i].name
        assert sum(n.target is AG for n in nodes[grad + 1 : i]) <= 1, nodes[i].name
    assert stats.exposed_comm_after_s < stats.exposed_comm_before_s
    assert stats.peak_memory_after <= stats.peak_memory_before


def test_stall_filled_with_ready_compute():
    """A wait whose all-to-all is still in flight: an independent matmul from
    further on in the original order runs before it, and the estimated
    exposed communication drops."""

    def f(x, w, u, v):
        y = c10d.wait_tensor(c10d.all_to_all_single(x, [2048, 2048], [2048, 2048], "0")) @ w
        return y, u @ v

    with FakeTensorMode():
        # the peak is at the first matmul (its result is large), so running the
        # small independent one earlier stays within the memory limit
        gm = make_fx(f)(
            torch.randn(4096, 1024), torch.randn(1024, 2048), torch.randn(256, 1024), torch.randn(1024, 256)
        )
    stats = schedule_overlap(gm, _ctx())
    check_topological(gm)
    nodes = list(gm.graph.nodes)
    (wait,) = _positions(gm, WAIT)
    independent = next(
        i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default and nodes[i].args[0].op == "placeholder"
    )
    assert independent < wait and stats.nodes_filled >= 1
    assert stats.exposed_comm_after_s < stats.exposed_comm_before_s
    assert stats.peak_memory_after <= stats.peak_memory_before


# ---------------------------------------------------------------------------
# the multi-stream model (overlap_model): hand graphs on two links, "dp"
# across nodes (network) and "tp" within a node (NVLink)


def _two_link_costs():
    from autoparallel.passes.overlap_model import Costs

    costs = Costs(None)
    costs.group_dim = {"dp": (16, False, 1), "tp": (8, True, 8)}
    return costs


def _info(gm):
    from autoparallel.passes.overlap_model import Info

    nodes = list(gm.graph.nodes)
    return nodes, Info(nodes, _two_link_costs())


def _node(nodes, target, k=0):
    return [n for n in nodes if n.target is target][k]


def test_dp_gather_hides_under_compute_while_tp_gather_is_exposed():
    """A parameter gather over dp (network) issued ahead runs concurrently
    with an activation gather over tp (NVLink) whose consumer is the next op:
    only the tp gather is exposed, not queued behind the dp one."""

    def f(x, shard, w0):
        wg = c10d.all_gather_into_tensor(shard, 16, "dp")  # prefetch of the next layer's weight
        xa = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 8, "tp"))  # sequence-parallel gather
        h = xa @ w0
        return h @ c10d.wait_tensor(wg)

    with FakeTensorMode():
        gm = make_fx(f)(torch.randn(1 << 10, 4096), torch.randn(256, 4096), torch.randn(4096, 4096))
    nodes, info = _info(gm)
    ag_dp, ag_tp = _node(nodes, AG, 0), _node(nodes, AG, 1)
    assert info.stream[ag_dp] == "network" and info.stream[ag_tp] == "nvlink"
    mm0 = _node(nodes, torch.ops.aten.mm.default, 0)
    assert info.time[ag_dp] < info.time[mm0]  # the gather fits under the first matmul
    exposed, _ = info.estimate(nodes)
    assert exposed == pytest.approx(info.time[ag_tp])
    # one FIFO comm stream (both on one link) would have queued it behind the dp gather
    info.stream[ag_tp] = "network"
    queued, _ = info.estimate(nodes)
    assert queued == pytest.approx(info.time[ag_dp] + info.time[ag_tp])


def test_tp_gather_feeding_next_op_is_exposed_and_same_link_queues():
    def f(x, w):
        a = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 8, "tp"))
        b = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 8, "tp"))
        return (a @ w) + (b @ w)

    with FakeTensorMode():
        gm = make_fx(f)(torch.randn(64, 512), torch.randn(512, 512))
    nodes, info = _info(gm)
    a, b = _node(nodes, AG, 0), _node(nodes, AG, 1)
    exposed, _ = info.estimate(nodes)
    assert exposed == pytest.approx(info.time[a] + info.time[b])  # nothing to hide under


def test_wait_feeding_only_a_collective_does_not_stall_compute():
    """A parameter resharded by an all-to-all, cast, then gathered: the first
    wait chains the gather behind the all-to-all on the side stream; compute
    in between hides both."""
    A2A = c10d.all_to_all_single.default

    def f(p, x, w):
        r = c10d.wait_tensor(c10d.all_to_all_single(p, [128, 128], [128, 128], "dp"))
        g = c10d.all_gather_into_tensor(r.to(torch.bfloat16), 16, "dp")
        h = (x @ w) @ w
        return h, c10d.wait_tensor(g)

    with FakeTensorMode():
        gm = make_fx(f)(torch.randn(256, 1024), torch.randn(1 << 13, 4096), torch.randn(4096, 4096))
    nodes, info = _info(gm)
    a2a, ag = _node(nodes, A2A), _node(nodes, AG)
    wait_a2a = next(iter(a2a.users))
    assert wait_a2a in info.comm_side and info.after[ag] == [a2a]
    mms = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    assert info.time[a2a] + info.time[ag] < sum(info.time[m] for m in mms)
    exposed, _ = info.estimate(nodes)
    assert exposed == 0.0


def _bucketed_forward(*args):
    # every layer's weight gathered, waited and reshaped at the start (as
    # bucketing leaves it), then the layers
    x, shards = args[0], args[1:]
    ws = [c10d.wait_tensor(c10d.all_gather_into_tensor(s, 4, "0")).view(32, 32) for s in shards]
    for w in ws:
        x = (x @ w).relu()
    return x


def test_gather_chain_deferred_whole():
    """The reshape after a gather's wait does not pull the wait (and the
    gathered weight) to the start: each wait comes after the previous
    layer's matmul."""
    with FakeTensorMode():
        gm = make_fx(_bucketed_forward)(torch.randn(1 << 16, 32), *[torch.randn(256) for _ in range(LAYERS)])
    before = list(gm.graph.nodes)
    waits_before = [i for i, n in enumerate(before) if n.target is WAIT]
    assert waits_before[-1] < min(i for i, n in enumerate(before) if n.target is torch.ops.aten.mm.default)
    ctx = PassContext(mesh=None, plan=None, options=PassOptions(prefetch_layers=1), graph_kind="forward")
    stats = schedule_overlap(gm, ctx)
    check_topological(gm)
    nodes = list(gm.graph.nodes)
    mms = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    waits = [i for i, n in enumerate(nodes) if n.target is WAIT]
    for k in range(1, LAYERS):
        assert waits[k] > mms[k - 1], (k, waits, mms)
    assert stats.peak_memory_after <= stats.peak_memory_before


def _bucketed_backward(*args):
    # as _backward_like, but each layer's two gradients reduced as one
    # bucket: flattened, concatenated and cast to fp32 at the very end
    g, acts, shards = args[0], args[1 : 1 + LAYERS], args[1 + LAYERS :]
    grads = []
    for k in reversed(range(LAYERS)):
        w = c10d.wait_tensor(c10d.all_gather_into_tensor(shards[k], 4, "0"))
        grads.append((g.t() @ acts[k], (g.t() @ acts[k]).relu()))
        g = g @ w
    outs = []
    for a, b in grads:
        flat = torch.cat([a.reshape(-1), b.reshape(-1)]).to(torch.float64)
        outs.append(c10d.wait_tensor(c10d.reduce_scatter_tensor(flat, "sum", 4, "0")))
    return (g, *outs)


def test_bucketed_reduction_issued_with_its_preparation():
    """The flatten/concatenate/cast before a bucket's reduce-scatter (run at
    the end in the original order) moves up with it: each reduce-scatter is
    issued before the next layer's matmuls, not after all of them."""
    gm = _trace(1 << 16, _bucketed_backward)  # compute-bound: each reduction ends within a layer
    assert longest_compute_run(gm.graph.nodes) == 3 * LAYERS
    stats = schedule_overlap(gm, _ctx())
    check_topological(gm)
    assert stats.longest_compute_run_after <= 3, stats
    assert stats.exposed_comm_after_s < stats.exposed_comm_before_s
    assert stats.peak_memory_after <= (1 + PEAK_TOLERANCE) * stats.peak_memory_before


# ---------------------------------------------------------------------------
# parameters redistributed in stages (a bucket gathered over one mesh dim,
# then each weight over another) and named by layer


class _Local:
    """The part of a LocalJoint that names parameters: the placeholders
    after the first (the activations) are the parameters ``fqns``."""

    def __init__(self, gm, fqns):
        self.param_fqns, self.buffer_fqns = list(fqns), []
        self._names = [p.name for p in gm.graph.find_nodes(op="placeholder")][1 : 1 + len(fqns)]

    def primal_names(self):
        return self._names


def _layer_ctx(gm, fqns, kind="forward", **kw):
    ctx = PassContext(mesh=None, plan=None, options=PassOptions(**kw), graph_kind=kind)
    ctx.local = _Local(gm, fqns)
    return ctx


def _gather_bucket(a, b, size, group):
    # two parameters gathered as one flat bucket, then copied out of it
    flat = torch.cat([a.reshape(-1), b.reshape(-1)])
    g = c10d.wait_tensor(c10d.all_gather_into_tensor(flat, size, group)).view(size, -1)
    ga, gb = g.split([a.numel(), b.numel()], dim=1)
    return ga.clone().view(-1, *a.shape[1:]), gb.clone().view(-1, *b.shape[1:])


def _preamble_forward(x, *params):
    # every layer's two norm weights gathered in a preamble (a bucket over
    # "0", then over "1"), as a plan that casts all parameters first leaves
    # them; each layer's weight gathered at the layer; every layer's output
    # saved for backward (the peak is at the end)
    norms, shards = params[: 2 * LAYERS], params[2 * LAYERS :]
    scales = []
    for k in range(LAYERS):
        na, nb = _gather_bucket(norms[2 * k], norms[2 * k + 1], 2, "0")
        scales.append((c10d.wait_tensor(c10d.all_gather_into_tensor(na.clone(), 2, "1")).view(-1), nb))
    saved = []
    for k in range(LAYERS):
        w = c10d.wait_tensor(c10d.all_gather_into_tensor(shards[k], 4, "0")).view(256, 256)
        sa, nb = scales[k]
        x = ((x * sa + nb.sum()) @ w).relu()
        saved.append(x)
    return tuple(saved)


def test_layer_need_is_its_compute_not_a_preamble():
    """A layer is needed where its compute starts, not where a preamble
    redistributes its norm weights: each layer's weight gather is prefetched
    at most one layer ahead, not all at the start."""
    fqns = [f"layers.{k}.norm_{s}" for k in range(LAYERS) for s in "ab"] + [f"layers.{k}.w" for k in range(LAYERS)]
    with FakeTensorMode():
        args = [torch.randn(1 << 12, 256)] + [torch.randn(1, 64) for _ in range(2 * LAYERS)]
        gm = make_fx(_preamble_forward)(*args, *[torch.randn(64, 256) for _ in range(LAYERS)])
    schedule_overlap(gm, _layer_ctx(gm, fqns, prefetch_layers=1))
    check_topological(gm)
    nodes = list(gm.graph.nodes)
    mms = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    weight_gathers = [i for i, n in enumerate(nodes) if n.target is AG and n.args[0].op == "placeholder"]
    assert len(weight_gathers) == LAYERS
    for k in range(2, LAYERS):
        assert weight_gathers[k] > mms[k - 2], (k, weight_gathers, mms)


def _norm_grad_backward(*args):
    # as _bucketed_backward, but each layer's bucket also holds a norm
    # weight's gradient that is first gathered over another dim (its own
    # collective and wait inside the bucket's preparation, at the very end)
    g, acts, shards = args[0], args[1 : 1 + LAYERS], args[1 + LAYERS :]
    grads = []
    for k in reversed(range(LAYERS)):
        w = c10d.wait_tensor(c10d.all_gather_into_tensor(shards[k], 4, "0"))
        grads.append((g.t() @ acts[k], (g * acts[k]).sum(0)))
        g = g @ w
    outs = []
    for gw, gn in grads:
        gn_full = c10d.wait_tensor(c10d.all_gather_into_tensor(gn.to(torch.float64), 2, "1"))
        flat = torch.cat([gw.reshape(-1).to(torch.float64), gn_full])
        outs.append(c10d.wait_tensor(c10d.reduce_scatter_tensor(flat, "sum", 4, "0")))
    return (g, *outs)


def test_reduction_waits_for_a_gather_within_its_preparation():
    """A bucket's reduce-scatter whose preparation gathers one gradient
    first: the gather is issued once the gradient exists and the
    reduce-scatter once the gather is done, within the layer, not after all
    layers' compute."""
    gm = _trace(1 << 16, _norm_grad_backward)
    assert longest_compute_run(gm.graph.nodes) == 2 * LAYERS
    stats = schedule_overlap(gm, _ctx())
    check_topological(gm)
    assert stats.longest_compute_run_after <= 2, stats
    assert stats.exposed_comm_after_s < stats.exposed_comm_before_s
    assert stats.peak_memory_after <= (1 + PEAK_TOLERANCE) * stats.peak_memory_before
