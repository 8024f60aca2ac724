"""Reorder a forward or backward graph so communication overlaps compute.

A list scheduler walks the graph in its original order and re-emits every
node after all of its inputs (so the result is always a valid topological
order), with four rules:

* **Prefetch parameter all-gathers, one at a time, bounded.** A parameter's
  gather chain (see :func:`.recompute_all_gathers.param_gather_chains`; also
  found in the backward graph, where the partitioner recomputes it) belongs
  to a *layer*: its parameter FQN up to the first numeric component
  (``layers.3``); other parameters are a layer each; a bucket gathering
  several parameters at once (:mod:`.bucket_collectives`) belongs to its
  first parameter's layer. Layers are numbered by
  when the graph first needs them. Gathers are issued in order of need, each
  only when (a) its layer is at most ``prefetch_layers`` past the layer
  running now, (b) the comm stream is idle in the two-stream clock the
  scheduler keeps (a queued gather would delay every reduce-scatter that
  becomes ready behind it on the single comm stream), and (c) the live bytes
  now, plus what the original order adds until the gather's use, plus the
  gathered bytes stay under the unscheduled graph's peak times
  ``1 + PREFETCH_MEMORY_SLACK``. A gather not prefetched is issued when its
  consumer needs it, as in the original order. That prediction can miss
  (prefetched gathers then overlap): a schedule whose estimated peak
  exceeds the unscheduled one by more than ``PEAK_TOLERANCE`` is redone
  with a limit lowered by the overshoot, and the original order is kept
  when no attempt fits.
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
import dataclasses
import heapq
import operator
import re
from collections import deque
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


# target -> has a FLOP formula (asked once per target: the lookup is not free)
_COMPUTE_TARGETS: dict = {}


def is_compute(node: fx.Node) -> bool:
    """A compute op for the cap: one with a FLOP formula (matmul, attention)."""
    if node.op != "call_function":
        return False
    target = node.target
    hit = _COMPUTE_TARGETS.get(target)
    if hit is None:
        hit = isinstance(target, torch._ops.OpOverload) and _flop_formula(target) is not None
        _COMPUTE_TARGETS[target] = hit
    return hit


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
        self._free: dict = {}  # target -> launches no kernel
        self._by_shape: dict[tuple, float] = {}

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
            t = self._compute_time(n)
        self._cache[n] = t
        return t

    def _compute_time(self, n: fx.Node) -> float:
        # Repeated layers repeat the same op on the same shapes: cost each
        # (op, argument shapes and values) once. The key holds what the
        # roofline model reads (shapes, dtypes, plain values).
        target = n.target
        free = self._free.get(target)
        if free is None:
            free = self._free[target] = cost_model.is_free_op(target)
        if free:
            return 0.0
        try:
            key = (target, _shape_key(n.args), _shape_key(n.kwargs), _shape_key(n.meta.get("val")))
            hit = self._by_shape.get(key)
        except (_NoKey, TypeError):  # symbolic or unusual arguments: no caching
            key = hit = None
        if hit is None:
            try:
                hit = cost_model.node_compute_time(n, None, None, self.device)
            except Exception:  # ops the roofline model cannot cost
                hit = 0.0
            if key is not None:
                self._by_shape[key] = hit
        return hit


class _NoKey(Exception):
    pass


_TENSOR = object()  # marks a tensor in a shape key (no literal argument is it)
_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout})


def _shape_key(x):
    t = type(x)
    if t is fx.Node:
        v = x.meta.get("val")
        return (_TENSOR, v.shape, v.dtype) if isinstance(v, torch.Tensor) else None
    if t in _PLAIN:
        return x
    if isinstance(x, torch.Tensor):
        return (_TENSOR, x.shape, x.dtype)
    if isinstance(x, (tuple, list)):  # fx args hold immutable lists
        return tuple([_shape_key(v) for v in x])
    if isinstance(x, dict):
        return tuple([(k, _shape_key(v)) for k, v in x.items()])
    raise _NoKey


class _Info:
    """Per-node facts of one graph, computed once and shared by the
    estimates and the scheduler: inputs, kind, cost, compute flag, and the
    memory model of :func:`estimate` (views alias their base: storage roots;
    which roots each node keeps alive; root sizes). Built from ``nodes`` in
    the given order (roots follow the first input already seen, as in a
    walk over that order); any topological order gives the same facts."""

    def __init__(self, nodes: list[fx.Node], costs: _Costs):
        self.nodes = nodes
        self.index = {n: i for i, n in enumerate(nodes)}
        ins: dict[fx.Node, list[fx.Node]] = {}
        kind: dict[fx.Node, int] = {}  # 0 not a call, 1 collective start, 2 wait, 3 other call
        time: dict[fx.Node, float] = {}
        compute: set[fx.Node] = set()
        root: dict[fx.Node, fx.Node] = {}
        for n in nodes:
            inputs = n.all_input_nodes
            ins[n] = inputs
            if _is_alias(n):
                root[n] = next((root[a] for a in inputs if a in root), n)
            else:
                root[n] = n
            if n.op != "call_function":
                kind[n] = 0
                continue
            target = n.target
            if target in _STARTS:
                kind[n] = 1
                time[n] = costs.time(n)
            elif target is _WAIT:
                kind[n] = 2
            else:
                kind[n] = 3
                time[n] = costs.time(n)
                if is_compute(n):
                    compute.add(n)
        kept_by: dict[fx.Node, set[fx.Node]] = {}
        keepers: dict[fx.Node, int] = {}
        for n in nodes:
            kept = {root.get(a, a) for a in ins[n]}
            if kind[n] == 2:  # the collective's input lives until its wait
                for a in ins[n]:
                    kept.update(root.get(b, b) for b in (ins[a] if a in ins else a.all_input_nodes))
            kept_by[n] = kept
            for r in kept:
                keepers[r] = keepers.get(r, 0) + 1
        self.ins, self.kind, self.time, self.compute = ins, kind, time, compute
        self.root, self.kept_by, self.keepers = root, kept_by, keepers
        self.size = {n: _nbytes(n.meta.get("val")) for n in nodes if root[n] is n and n.op != "output"}
        self.reductions = {n for n in nodes if kind[n] and n.target in _GRAD_REDUCTIONS}

    def longest_compute_run(self, order: list[fx.Node]) -> int:
        run = best = 0
        seen = False
        compute, reductions = self.compute, self.reductions
        for n in order:
            if n in reductions:
                best, run, seen = max(best, run), 0, True
            elif n in compute:
                run += 1
        return best if seen else 0

    def estimate(self, order: list[fx.Node]) -> tuple[float, int]:
        """:func:`estimate` of ``order`` (a topological order of the nodes)."""
        kind, time = self.kind, self.time
        now = comm_free = exposed = 0.0
        done: dict[fx.Node, float] = {}
        for n in order:
            k = kind[n]
            if k == 0:
                continue
            if k == 1:
                start = max(now, comm_free)
                comm_free = done[n] = start + time[n]
            elif k == 2:
                end = done.get(n.args[0], 0.0)
                if end > now:
                    exposed += end - now
                    now = end
            else:
                now += time[n]
        # memory: storage roots, freed after the last use of any alias
        kept_by = self.kept_by
        last: dict[fx.Node, int] = {}
        for p, n in enumerate(order):
            for r in kept_by[n]:
                last[r] = p  # positions ascend: the latest keeper wins
        end = len(order)
        out = [n for n in order if n.op == "output"]
        if out:
            (out,) = out
            root = self.root
            for a in self.ins[out]:
                last[root.get(a, a)] = end
        size = self.size
        frees: dict[int, int] = {}
        live = peak = 0
        for p, n in enumerate(order):
            s = size.get(n)
            if s is not None:
                live += s
                i = last.get(n, p)
                frees[i] = frees.get(i, 0) + s
            if live > peak:
                peak = live
            live -= frees.pop(p, 0)
        return exposed, peak


def estimate(nodes: list[fx.Node], costs: _Costs) -> tuple[float, int]:
    """(exposed communication seconds, peak live bytes) of running ``nodes``
    in this order."""
    return _Info(list(nodes), costs).estimate(list(nodes))


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
    # gathers of several parameters at once (:mod:`.bucket_collectives`)
    rank = {p: k for k, p in enumerate(params)}
    for ag in gm.graph.find_nodes(op="call_function", target=_AG):
        if ag not in out:
            found = _bucket_chain(ag, rank)
            if found is not None:
                p, chain = found
                out[ag] = (_layer_of(fqn_of.get(p.name, p.name)), chain)
    return out


def _bucket_chain(ag: fx.Node, rank: dict[fx.Node, int]) -> tuple[fx.Node, list[fx.Node]] | None:
    """(first parameter, chain) when ``ag`` gathers data of parameters only
    (its input made from parameter placeholders by casts and layout ops);
    the chain is those ops, ``ag`` and the layout ops after its wait."""
    from .recompute_all_gathers import _is_chain_op

    chain: set[fx.Node] = set()
    roots: set[fx.Node] = set()
    stack = list(ag.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in chain or n in roots:
            continue
        if n.op == "placeholder":
            if n not in rank:
                return None
            roots.add(n)
            continue
        if not _is_chain_op(n) or n.target in _STARTS or n.target is _WAIT:
            return None
        chain.add(n)
        stack.extend(n.all_input_nodes)
    if not roots:
        return None
    chain.add(ag)
    stack = [ag]
    while stack:  # the wait and the layout ops after it
        for u in stack.pop().users:
            if u not in chain and _is_chain_op(u) and u.target not in _STARTS and all(a in chain for a in u.all_input_nodes):
                chain.add(u)
                stack.append(u)
    return min(roots, key=rank.__getitem__), list(chain)


def _live_curve(info: _Info, nodes: list[fx.Node]) -> list[int]:
    """Live bytes after each node of ``nodes`` in :func:`estimate`'s model
    (views alias their base; a collective's input lives until its wait; the
    graph outputs live to the end): what the scheduler's ``emit`` tracks."""
    kept_by, size = info.kept_by, info.size
    pending = dict(info.keepers)  # root -> keepers not emitted yet
    live = 0
    curve = []
    for n in nodes:
        s = size.get(n, 0)
        if s and pending.get(n):  # a root nobody reads is freed at once
            live += s
        for r in kept_by[n]:
            left = pending[r] - 1
            pending[r] = left
            if left == 0:
                live -= size.get(r, 0)
        curve.append(live)
    return curve


def _schedule(
    gm: fx.GraphModule,
    ctx: PassContext | None,
    stats: ScheduleStats,
    costs: "_Costs | None" = None,
    memory_limit: int | None = None,
    info: _Info | None = None,
) -> list[fx.Node]:
    opts = ctx.options if ctx is not None else None
    prefetch = max(0, opts.prefetch_layers if opts else 1)
    cap = max(1, opts.max_consecutive_compute if opts else 8)
    costs = costs or _Costs(ctx)
    nodes = list(gm.graph.nodes)
    if info is None or info.nodes != nodes:
        info = _Info(nodes, costs)
    index = info.index
    ins, kind, times, compute, reductions = info.ins, info.kind, info.time, info.compute, info.reductions
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
        if n in reductions:
            dist_to_rs[n] = 0
            continue
        best = min((dist_to_rs[u] for u in n.users if u in dist_to_rs), default=None)
        if best is not None:
            dist_to_rs[n] = best + (1 if n in compute else 0)

    done: set[fx.Node] = set()
    order: list[fx.Node] = []
    # collective starts (not param gathers) are issued once ready: count their missing inputs
    eager_starts = [n for n in nodes if kind[n] == 1 and n not in ag_layer]
    remaining_inputs = {n: len(ins[n]) for n in eager_starts}
    start_users: dict[fx.Node, list[fx.Node]] = {}
    for c in eager_starts:
        for a in ins[c]:
            start_users.setdefault(a, []).append(c)
    eager: list[tuple[int, fx.Node]] = []  # ready ones
    pending_rs: deque[tuple[fx.Node, int]] = deque()  # (wait node, compute count when issued)
    compute_count = 0
    since_rs = 0
    next_pf = 0
    wait_of: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if kind[n] == 2 and isinstance(n.args[0], fx.Node):
            wait_of[n.args[0]] = n
    # the two-stream clock of :func:`estimate`, and live bytes, as nodes are emitted
    kept_by, size = info.kept_by, info.size
    pending = dict(info.keepers)  # root -> keepers not emitted yet
    live = 0
    # live bytes after each node of the original order
    orig_live = _live_curve(info, nodes) if memory_limit is not None else []
    range_max = _RangeMax(orig_live)
    now = comm_free = 0.0
    comm_done: dict[fx.Node, float] = {}

    def emit(n: fx.Node) -> None:
        nonlocal compute_count, since_rs, now, comm_free, live
        order.append(n)
        done.add(n)
        # live bytes, as in _live_curve
        s = size.get(n, 0)
        if s and pending.get(n):
            live += s
        for r in kept_by[n]:
            left = pending[r] - 1
            pending[r] = left
            if left == 0:
                live -= size.get(r, 0)
        k = kind[n]
        if k == 1:
            comm_free = comm_done[n] = max(now, comm_free) + times[n]
        elif k == 2:
            now = max(now, comm_done.get(n.args[0], 0.0))
        elif k == 3:
            now += times[n]
        if n in compute:
            compute_count += 1
            since_rs += 1
        if n in reductions:
            since_rs = 0
            w = wait_of.get(n)
            if w is not None:
                pending_rs.append((w, compute_count))
        for u in start_users.get(n, ()):
            left = remaining_inputs[u] - 1
            remaining_inputs[u] = left
            if left == 0:
                heapq.heappush(eager, (index[u], u))

    def ensure(n: fx.Node) -> None:
        # emit n after its missing inputs, deepest first (iterative DFS)
        if n in done:
            return
        for a in ins[n]:
            if a not in done:
                break
        else:  # the common case: every input is out already
            emit(n)
            flush()
            return
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
            for a in reversed(ins[m]):
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
            compute_count - pending_rs[0][1] >= cap or comm_done.get(pending_rs[0][0].args[0], 0.0) <= now
        ):
            w, _ = pending_rs.popleft()
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
            if layer_rank[ag_layer[ag][0]] > upto or comm_free > now:
                return
            if memory_limit is not None:
                # what the original order adds before the gather is used
                # (it stays alive until then) predicts the rise from here
                growth = range_max(i, need_of[ag] + 1) - orig_live[i - 1 if i else 0]
                if live + max(growth, 0) + _nbytes(ag.meta.get("val")) > memory_limit:
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
    deferred = {n for n in nodes if kind[n] == 2} | set(ag_layer)
    while i < len(nodes):
        n = nodes[i]
        if n in done or n is output or n in deferred:
            i += 1
            continue
        prefetch_step(i)
        if since_rs >= cap and n in compute and n in dist_to_rs:
            # past the cap: run toward the nearest pending reduction first
            target = _closest_reduction(n, nodes, i, done, dist_to_rs, info)
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
                table.append(list(map(max, prev, prev[step:])))
                step *= 2
            self.table = table
        k = (hi - lo).bit_length() - 1
        row = self.table[k]
        return max(row[lo], row[hi - (1 << k)])


def _closest_reduction(n, nodes, i, done, dist_to_rs, info: _Info):
    """A not-yet-run reduction reachable soonest from the nodes about to run
    (looking a short way ahead in the original order)."""
    ins, compute, reductions = info.ins, info.compute, info.reductions
    best, best_d = None, dist_to_rs.get(n, 1 << 30)
    for m in nodes[i : i + 64]:
        if m in done or m not in reductions:
            continue
        # cost to reach m: compute ops among its missing ancestors
        missing, stack, seen = 0, [m], {m}
        while stack:
            x = stack.pop()
            for a in ins[x]:
                if a not in done and a not in seen:
                    seen.add(a)
                    missing += 1 if a in compute else 0
                    stack.append(a)
        if missing < best_d:
            best, best_d = m, missing
    return best


def _check_order(order: list[fx.Node], info: _Info) -> None:
    """Every node after its inputs (what ``graph.lint`` would catch of a reorder)."""
    pos = {n: p for p, n in enumerate(order)}
    ins = info.ins
    for p, n in enumerate(order):
        for a in ins[n]:
            if pos[a] >= p:
                raise RuntimeError(f"schedule_overlap put {n.name} before its input {a.name}")


# The schedule's estimated peak may exceed the unscheduled one by this much;
# beyond it the graph is scheduled again with a tighter prefetch limit (at
# most MAX_RESCHEDULES times).
PEAK_TOLERANCE = 0.02
MAX_RESCHEDULES = 3


def _schedule_within(gm, ctx, stats: ScheduleStats, costs, limit: int, target: int, info, original: list) -> list:
    """A schedule whose estimated peak stays within ``target`` bytes. The
    prefetch rule (``limit``) predicts memory from the original order, which
    can miss (prefetched gathers then overlap); on an overshoot the limit is
    lowered by the overshoot and the graph scheduled again; if no attempt
    fits, the original order stays (no reordering rather than a spike)."""
    for _ in range(1 + MAX_RESCHEDULES):
        attempt = dataclasses.replace(stats)
        order = _schedule(gm, ctx, attempt, costs, limit, info)
        peak = info.estimate(order)[1]
        if peak <= target:
            for f in dataclasses.fields(stats):
                setattr(stats, f.name, getattr(attempt, f.name))
            return order
        limit = int(limit * target / peak)
    stats.all_gathers = sum(1 for n in original if n.target is _AG)
    stats.reduce_scatters = sum(1 for n in original if n.target is _RS)
    return list(original)


@register_pass("schedule_overlap", "graphs")
def schedule_overlap(gm: fx.GraphModule, ctx: PassContext) -> ScheduleStats:
    """Reorder ``gm`` (a forward or backward graph, in place); see the module
    docstring."""
    stats = ScheduleStats(graph=getattr(ctx, "graph_kind", None) or "")
    costs = _Costs(ctx)
    before = list(gm.graph.nodes)
    info = _Info(before, costs)
    stats.longest_compute_run_before = info.longest_compute_run(before)
    stats.exposed_comm_before_s, stats.peak_memory_before = info.estimate(before)
    limit = int(stats.peak_memory_before * (1 + PREFETCH_MEMORY_SLACK))
    target = int(stats.peak_memory_before * (1 + PEAK_TOLERANCE))
    order = _schedule_within(gm, ctx, stats, costs, limit, target, info, before)
    if len(order) != len(before) or set(order) != set(before):
        raise RuntimeError("schedule_overlap lost or duplicated nodes")
    _check_order(order, info)
    # move nodes into the new order
    cursor = order[0]
    for n in order[1:]:
        if cursor.next is not n:
            cursor.append(n)
        cursor = n
    gm.recompile()
    after = list(gm.graph.nodes)
    stats.nodes_moved = sum(1 for a, b in zip(before, after) if a is not b)
    stats.longest_compute_run_after = info.longest_compute_run(after)
    stats.exposed_comm_after_s, stats.peak_memory_after = info.estimate(after)
    return stats
