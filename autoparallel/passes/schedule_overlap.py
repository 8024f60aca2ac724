"""Reorder a forward or backward graph so communication overlaps compute.

A list scheduler walks the graph in its original order and re-emits every
node after all of its inputs (so the result is always a valid topological
order), with four rules:

* **Prefetch parameter all-gathers, one at a time, bounded.** A parameter's
  gather chain (see :func:`.recompute_all_gathers.param_gather_chains`; also
  found in the backward graph, where the partitioner recomputes it) belongs
  to a *layer*: its parameter FQN up to the first numeric component
  (``layers.3``); other parameters are a layer each. Layers are numbered by
  when the graph first needs them. Gathers are issued in order of need, each
  only when (a) its layer is at most ``prefetch_layers`` past the layer
  running now, (b) the comm stream is idle in the two-stream clock the
  scheduler keeps (a queued gather would delay every reduce-scatter that
  becomes ready behind it on the single comm stream), and (c) the live bytes
  now, plus what the original order adds until the gather's use, plus the
  gathered bytes stay under the unscheduled graph's peak times
  ``1 + PREFETCH_MEMORY_SLACK``. A gather not prefetched is issued when its
  consumer needs it, as in the original order.
* **Issue other collectives as soon as their input exists** (gradient
  reduce-scatters, activation redistributions).
* **Wait late, free early.** A ``wait_tensor`` is emitted only when a
  consumer needs its result; a reduce-scatter's (or all-reduce's) wait,
  whose consumer is often the graph output, as soon as the clock says the
  collective is done (no stall) and at the latest after
  ``max_consecutive_compute`` compute ops: its unreduced input stays alive
  until the wait.
* **Cap compute between reduce-scatters.** Once ``max_consecutive_compute``
  compute ops (ops with a FLOP formula: matmuls, attention) have run since
  the last reduce-scatter, the scheduler prefers, among the nodes it may run
  next, the one closest to a pending reduce-scatter. Without it, backward
  computes all gradients before the first reduce-scatter (the joint graph
  reduces gradients at its very end) and every unreduced gradient is alive
  at once.

Estimates for the stats (before and after): exposed communication from a
two-stream simulation (compute ops take ``cost_model.node_compute_time``,
collectives ``cost_model.collective_time`` on the mesh dim's topology; a wait
stalls compute until its collective ends) and peak memory from a liveness
walk over the fake tensor sizes (views alias their base; a collective's input
lives until its wait).

>>> # stats = schedule_overlap(graphs.bw, ctx)   # doctest: +SKIP
>>> # stats.longest_compute_run_before, stats.longest_compute_run_after  -> 56, 4
"""

from __future__ import annotations

import bisect
import heapq
import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import cost_model
from ..cost_model.compute import _flop_formula
from . import PassContext, register_pass

__all__ = [
    "ScheduleStats",
    "schedule_overlap",
    "estimate",
    "longest_compute_run",
    "is_compute",
    "check_topological",
]

_c10d = torch.ops._c10d_functional
_AG = _c10d.all_gather_into_tensor.default
_RS = _c10d.reduce_scatter_tensor.default
_AR = _c10d.all_reduce.default
_A2A = _c10d.all_to_all_single.default
_WAIT = _c10d.wait_tensor.default
_STARTS = {_AG: "all_gather", _RS: "reduce_scatter", _AR: "all_reduce", _A2A: "all_to_all"}
_GRAD_REDUCTIONS = {_RS, _AR}
# Prefetched gathers may raise the estimated live bytes to at most this much
# above the unscheduled graph's peak.
PREFETCH_MEMORY_SLACK = 0.0


def is_compute(node: fx.Node) -> bool:
    """A compute op for the cap: one with a FLOP formula (matmul, attention)."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and _flop_formula(node.target) is not None
    )


@dataclass
class ScheduleStats:
    graph: str = ""
    nodes_moved: int = 0
    all_gathers: int = 0
    prefetched_all_gathers: int = 0  # issued before the previous compute op
    reduce_scatters: int = 0
    layers: int = 0
    longest_compute_run_before: int = 0
    longest_compute_run_after: int = 0
    exposed_comm_before_s: float = 0.0
    exposed_comm_after_s: float = 0.0
    peak_memory_before: int = 0  # bytes per rank
    peak_memory_after: int = 0


# ---------------------------------------------------------------------------
# measures


def longest_compute_run(nodes, reductions=_GRAD_REDUCTIONS) -> int:
    """Most compute ops run before a gradient reduction (since the previous
    one or the start); 0 when the graph has none."""
    run = best = 0
    seen = False
    for n in nodes:
        if n.op != "call_function":
            continue
        if n.target in reductions:
            best, run, seen = max(best, run), 0, True
        elif is_compute(n):
            run += 1
    return best if seen else 0


def check_topological(gm: fx.GraphModule) -> None:
    """Raise if some node comes before one of its inputs."""
    seen: set[fx.Node] = set()
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            if a not in seen:
                raise AssertionError(f"{n.name} runs before its input {a.name}")
        seen.add(n)


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_nbytes(v) for v in val)
    return 0


def _is_alias(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target is operator.getitem or n.target is _WAIT:
        return True
    return isinstance(n.target, torch._ops.OpOverload) and n.target.is_view


def _group_size_and_name(n: fx.Node) -> tuple[int, str | None]:
    args = list(n.args) + list(n.kwargs.values())
    name = next((a for a in reversed(args) if isinstance(a, str)), None)
    if n.target is _AG or n.target is _RS:
        return int(n.args[-2] if n.target is _AG else n.args[2]), name
    return 0, name


class _Costs:
    def __init__(self, ctx: PassContext | None):
        self.device = getattr(ctx, "device", None) or cost_model.H100
        mesh = getattr(ctx, "mesh", None)
        self.group_dim: dict[str, tuple[int, bool, int]] = {}
        if mesh is not None:
            try:
                topo = cost_model.mesh_dim_topology(mesh)
                for d in range(mesh.ndim):
                    t = topo[d]
                    self.group_dim[mesh.get_group(d).group_name] = (mesh.size(d), t.intra_node, t.ranks_per_node)
            except Exception:  # a bare graph without a usable mesh: intra-node defaults
                self.group_dim = {}
        self._cache: dict[fx.Node, float] = {}

    def time(self, n: fx.Node) -> float:
        if n in self._cache:
            return self._cache[n]
        t = 0.0
        if n.op == "call_function" and n.target in _STARTS:
            size, name = _group_size_and_name(n)
            info = self.group_dim.get(name)
            if info is not None:
                size, intra, per_node = info
            else:
                intra, per_node = True, 1
            if n.target is _A2A:
                size = size or (len(n.args[1]) if isinstance(n.args[1], (list, tuple)) else 2)
            if n.target is _AR and not size:
                size = 2
            src = n.args[0]
            nbytes = _nbytes(src.meta.get("val")) if isinstance(src, fx.Node) else 0
            t = cost_model.collective_time(_STARTS[n.target], nbytes, size, intra, self.device, per_node)
        elif n.op == "call_function" and n.target is not _WAIT:
            try:
                t = cost_model.node_compute_time(n, None, None, self.device)
            except Exception:  # ops the roofline model cannot cost
                t = 0.0
        self._cache[n] = t
        return t


def estimate(nodes: list[fx.Node], costs: _Costs) -> tuple[float, int]:
    """(exposed communication seconds, peak live bytes) of running ``nodes``
    in this order."""
    # exposed comm: one compute stream, one comm stream
    now = comm_free = exposed = 0.0
    done: dict[fx.Node, float] = {}
    for n in nodes:
        if n.op != "call_function":
            continue
        if n.target in _STARTS:
            start = max(now, comm_free)
            comm_free = done[n] = start + costs.time(n)
        elif n.target is _WAIT:
            src = n.args[0]
            end = done.get(src, 0.0)
            if end > now:
                exposed += end - now
                now = end
        else:
            now += costs.time(n)
    # memory: storage roots, freed after the last use of any alias
    pos = {n: i for i, n in enumerate(nodes)}
    root: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        ins = [a for a in n.all_input_nodes if a in root]
        root[n] = root[ins[0]] if _is_alias(n) and ins else n
    last: dict[fx.Node, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            r = root.get(a, a)
            last[r] = max(last.get(r, -1), pos[n])
            if n.target is _WAIT:  # the collective's input lives until its wait
                for b in a.all_input_nodes:
                    rb = root.get(b, b)
                    last[rb] = max(last.get(rb, -1), pos[n])
    end = len(nodes)
    (out,) = [n for n in nodes if n.op == "output"] or [None]
    if out is not None:
        for a in out.all_input_nodes:
            last[root.get(a, a)] = end
    frees: dict[int, int] = {}
    live = peak = 0
    for n in nodes:
        if root.get(n) is n and n.op != "output":
            size = _nbytes(n.meta.get("val"))
            live += size
            i = last.get(n, pos[n])
            frees[i] = frees.get(i, 0) + size
        peak = max(peak, live)
        live -= frees.pop(pos[n], 0)
    return exposed, peak


# ---------------------------------------------------------------------------
# the scheduler


def _layer_of(fqn: str) -> str:
    m = re.match(r"^(.*?\.\d+)(\.|$)", fqn)
    return m.group(1) if m else fqn


def _param_chains(gm: fx.GraphModule, ctx: PassContext | None) -> dict[fx.Node, tuple[str, list[fx.Node]]]:
    """all-gather node -> (layer key, ...) for parameter gathers of ``gm``."""
    from .recompute_all_gathers import param_gather_chains

    local = getattr(ctx, "local", None)
    fqn_of: dict[str, str] = {}
    if local is not None:
        fqns = list(local.param_fqns) + list(local.buffer_fqns)
        fqn_of = dict(zip(local.primal_names(), fqns))
    placeholders = [p for p in gm.graph.find_nodes(op="placeholder")]
    # in a forward/backward graph the parameter shards keep their joint names
    params = [p for p in placeholders if p.name in fqn_of] if fqn_of else [
        p for p in placeholders if "tangents" not in p.name
    ]
    out: dict[fx.Node, tuple[str, list[fx.Node]]] = {}
    for p, chain in param_gather_chains(gm, None, params=params, forward_only=False).items():
        layer = _layer_of(fqn_of.get(p.name, p.name))
        for n in chain:
            if n.target is _AG:
                out[n] = (layer, chain)
    return out


class _Liveness:
    """Live bytes of the nodes emitted so far, in :func:`estimate`'s model
    (views alias their base; a collective's input lives until its wait; the
    graph outputs live to the end)."""

    def __init__(self, nodes: list[fx.Node]):
        root: dict[fx.Node, fx.Node] = {}
        for n in nodes:
            ins = [a for a in n.all_input_nodes if a in root]
            root[n] = root[ins[0]] if _is_alias(n) and ins else n
        self.root = root
        self.kept_by: dict[fx.Node, set[fx.Node]] = {n: set() for n in nodes}  # node -> roots it keeps alive
        keepers: dict[fx.Node, set[fx.Node]] = {}
        for n in nodes:
            for a in n.all_input_nodes:
                self.kept_by[n].add(root.get(a, a))
                if n.target is _WAIT:
                    for b in a.all_input_nodes:
                        self.kept_by[n].add(root.get(b, b))
            for r in self.kept_by[n]:
                keepers.setdefault(r, set()).add(n)
        self.pending = {r: len(k) for r, k in keepers.items()}
        self.size = {n: _nbytes(n.meta.get("val")) for n in nodes if root[n] is n and n.op != "output"}
        self.live = 0

    def emit(self, n: fx.Node) -> None:
        size = self.size.get(n, 0)
        self.live += size
        if size and not self.pending.get(n):
            self.live -= size
        for r in self.kept_by.get(n, ()):
            self.pending[r] -= 1
            if self.pending[r] == 0:
                self.live -= self.size.get(r, 0)


def _schedule(
    gm: fx.GraphModule, ctx: PassContext | None, stats: ScheduleStats, costs: "_Costs | None" = None, memory_limit: int | None = None
) -> list[fx.Node]:
    opts = ctx.options if ctx is not None else None
    prefetch = max(0, opts.prefetch_layers if opts else 1)
    cap = max(1, opts.max_consecutive_compute if opts else 8)
    costs = costs or _Costs(ctx)
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    output = nodes[-1]

    ag_layer = _param_chains(gm, ctx)
    stats.all_gathers = sum(1 for n in nodes if n.target is _AG)
    stats.reduce_scatters = sum(1 for n in nodes if n.target is _RS)
    # each gather's first need (its chain's first consumer), layers in order of first need
    need_of: dict[fx.Node, int] = {}
    first_need: dict[str, int] = {}
    for ag, (layer, chain) in ag_layer.items():
        chain_set = set(chain)
        need = min(
            (index[u] for c in chain for u in c.users if u not in chain_set),
            default=index[ag],
        )
        need_of[ag] = need
        first_need[layer] = min(first_need.get(layer, need), need)
    layer_order = sorted(first_need, key=first_need.__getitem__)
    layer_rank = {name: k for k, name in enumerate(layer_order)}
    stats.layers = len(layer_order)
    # prefetch candidates: one gather at a time, in order of need
    pf_order = sorted(ag_layer, key=lambda a: (need_of[a], index[a]))
    need_points = [first_need[name] for name in layer_order]

    # distance (in compute ops) from each node to the nearest gradient reduction
    dist_to_rs: dict[fx.Node, int] = {}
    for n in reversed(nodes):
        if n.target in _GRAD_REDUCTIONS:
            dist_to_rs[n] = 0
            continue
        best = min((dist_to_rs[u] for u in n.users if u in dist_to_rs), default=None)
        if best is not None:
            dist_to_rs[n] = best + (1 if is_compute(n) else 0)

    done: set[fx.Node] = set()
    order: list[fx.Node] = []
    remaining_inputs = {n: len(set(n.all_input_nodes)) for n in nodes}
    eager: list[tuple[int, fx.Node]] = []  # ready collective starts (not param gathers)
    pending_rs: list[tuple[fx.Node, int]] = []  # (wait node, compute count when issued)
    compute_count = 0
    since_rs = 0
    next_pf = 0
    wait_of: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.target is _WAIT and isinstance(n.args[0], fx.Node):
            wait_of[n.args[0]] = n
    # the two-stream clock of :func:`estimate`, and live bytes, as nodes are emitted
    live = _Liveness(nodes)
    orig_live: list[int] = []  # live bytes after each node of the original order
    if memory_limit is not None:
        probe = _Liveness(nodes)
        for n in nodes:
            probe.emit(n)
            orig_live.append(probe.live)
    range_max = _RangeMax(orig_live)
    clock = {"now": 0.0, "comm_free": 0.0}
    comm_done: dict[fx.Node, float] = {}

    def emit(n: fx.Node) -> None:
        nonlocal compute_count, since_rs
        order.append(n)
        done.add(n)
        live.emit(n)
        if n.op == "call_function":
            if n.target in _STARTS:
                clock["comm_free"] = comm_done[n] = max(clock["now"], clock["comm_free"]) + costs.time(n)
            elif n.target is _WAIT:
                clock["now"] = max(clock["now"], comm_done.get(n.args[0], 0.0))
            else:
                clock["now"] += costs.time(n)
        if is_compute(n):
            compute_count += 1
            since_rs += 1
        if n.target in _GRAD_REDUCTIONS:
            since_rs = 0
            w = wait_of.get(n)
            if w is not None:
                pending_rs.append((w, compute_count))
        for u in n.users:
            remaining_inputs[u] -= 1
            if remaining_inputs[u] == 0 and u.target in _STARTS and u not in ag_layer:
                heapq.heappush(eager, (index[u], u))

    def ensure(n: fx.Node) -> None:
        # emit n after its missing inputs, deepest first (iterative DFS)
        stack = [(n, False)]
        while stack:
            m, expanded = stack.pop()
            if m in done:
                continue
            if expanded:
                emit(m)
                flush()
                continue
            stack.append((m, True))
            for a in reversed(m.all_input_nodes):
                if a not in done:
                    stack.append((a, False))

    def flush() -> None:
        # collective starts that became ready (before any further prefetch, so
        # reductions do not queue behind gathers); reduction waits once their
        # collective is done (free the unreduced input at no stall) or past the cap
        while eager:
            _, c = heapq.heappop(eager)
            if c not in done:
                ensure(c)
        while pending_rs and (
            compute_count - pending_rs[0][1] >= cap or comm_done.get(pending_rs[0][0].args[0], 0.0) <= clock["now"]
        ):
            w, _ = pending_rs.pop(0)
            if w not in done:
                ensure(w)

    def prefetch_step(i: int) -> None:
        # Issue the next parameter gathers (in order of need) while: their
        # layer is at most `prefetch` layers past the current one, the comm
        # stream is idle (a queued gather would delay the reductions that
        # become ready meanwhile), and the gathered bytes fit under the limit.
        nonlocal next_pf
        upto = max(current_rank(i), 0) + prefetch
        while next_pf < len(pf_order):
            ag = pf_order[next_pf]
            if ag in done:
                next_pf += 1
                continue
            if layer_rank[ag_layer[ag][0]] > upto or clock["comm_free"] > clock["now"]:
                return
            if memory_limit is not None:
                # what the original order adds before the gather is used
                # (it stays alive until then) predicts the rise from here
                growth = range_max(i, need_of[ag] + 1) - orig_live[i - 1 if i else 0]
                if live.live + max(growth, 0) + _nbytes(ag.meta.get("val")) > memory_limit:
                    return
            before = compute_count
            ensure(ag)
            next_pf += 1
            if before == compute_count:
                stats.prefetched_all_gathers += 1

    def current_rank(i: int) -> int:
        # need_points ascend: the last layer whose first need is at or before i
        return bisect.bisect_right(need_points, i) - 1

    # placeholders first, in their order
    for n in nodes:
        if n.op == "placeholder":
            emit(n)
    flush()
    i = 0
    deferred = {n for n in nodes if n.target is _WAIT} | set(ag_layer)
    while i < len(nodes):
        n = nodes[i]
        if n in done or n is output or n in deferred:
            i += 1
            continue
        prefetch_step(i)
        if since_rs >= cap and is_compute(n) and n in dist_to_rs:
            # past the cap: run toward the nearest pending reduction first
            target = _closest_reduction(n, nodes, i, done, dist_to_rs)
            if target is not None and target is not n:
                ensure(target)
                continue
        ensure(n)
        i += 1
    for n in nodes:
        if n not in done and n is not output:
            ensure(n)
    emit(output)
    return order


class _RangeMax:
    """``max(values[lo:hi], default=0)`` in O(1) after an O(n log n) table
    (built on first use)."""

    def __init__(self, values: list[int]):
        self.values = values
        self.table: list[list[int]] | None = None

    def __call__(self, lo: int, hi: int) -> int:
        hi = min(hi, len(self.values))
        if hi <= lo:
            return 0
        if self.table is None:
            table = [self.values]
            step = 1
            while 2 * step <= len(self.values):
                prev = table[-1]
                table.append([max(a, b) for a, b in zip(prev, prev[step:])])
                step *= 2
            self.table = table
        k = (hi - lo).bit_length() - 1
        row = self.table[k]
        return max(row[lo], row[hi - (1 << k)])


def _closest_reduction(n, nodes, i, done, dist_to_rs):
    """A not-yet-run reduction reachable soonest from the nodes about to run
    (looking a short way ahead in the original order)."""
    best, best_d = None, dist_to_rs.get(n, 1 << 30)
    for m in nodes[i : i + 64]:
        if m in done or m.target not in _GRAD_REDUCTIONS:
            continue
        # cost to reach m: compute ops among its missing ancestors
        missing, stack, seen = 0, [m], {m}
        while stack:
            x = stack.pop()
            for a in x.all_input_nodes:
                if a not in done and a not in seen:
                    seen.add(a)
                    missing += 1 if is_compute(a) else 0
                    stack.append(a)
        if missing < best_d:
            best, best_d = m, missing
    return best


@register_pass("schedule_overlap", "graphs")
def schedule_overlap(gm: fx.GraphModule, ctx: PassContext) -> ScheduleStats:
    """Reorder ``gm`` (a forward or backward graph, in place); see the module
    docstring."""
    stats = ScheduleStats(graph=getattr(ctx, "graph_kind", None) or "")
    costs = _Costs(ctx)
    before = list(gm.graph.nodes)
    stats.longest_compute_run_before = longest_compute_run(before)
    stats.exposed_comm_before_s, stats.peak_memory_before = estimate(before, costs)
    limit = int(stats.peak_memory_before * (1 + PREFETCH_MEMORY_SLACK))
    order = _schedule(gm, ctx, stats, costs, limit)
    if len(order) != len(before) or set(order) != set(before):
        raise RuntimeError("schedule_overlap lost or duplicated nodes")
    # move nodes into the new order
    cursor = order[0]
    for n in order[1:]:
        if cursor.next is not n:
            cursor.append(n)
        cursor = n
    gm.graph.lint()
    gm.recompile()
    after = list(gm.graph.nodes)
    stats.nodes_moved = sum(1 for a, b in zip(before, after) if a is not b)
    stats.longest_compute_run_after = longest_compute_run(after)
    stats.exposed_comm_after_s, stats.peak_memory_after = estimate(after, costs)
    return stats
