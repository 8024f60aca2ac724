"""Reorder a forward or backward graph so communication overlaps compute.

A list scheduler walks the graph in its original order and re-emits every
node after all of its inputs (so the result is always a valid topological
order), with four rules:

* **Prefetch parameter all-gathers, bounded.** A parameter's gather chain
  (see :func:`.recompute_all_gathers.param_gather_chains`; also found in the
  backward graph, where the partitioner recomputes it) belongs to a *layer*:
  its parameter FQN up to the first numeric component (``layers.3``); other
  parameters are a layer each; a bucket gathering several parameters at once
  (:mod:`.bucket_collectives`) belongs to its first parameter's layer.
  Layers are ranked by when the graph first needs them; parameters outside
  the numbered blocks (embeddings, final norm, output projection) share the
  rank of the next block (or one after the last), as FSDP wraps them.
  The whole chain is deferred: its ops run when a consumer needs them (a
  bucket's split after the wait would otherwise pull the wait forward).
  Gathers are issued in order of need (each its own: a chain that gathers
  again for a copy saved for backward is not prefetched), each only when
  (a) its layer's rank is at most ``prefetch_layers`` past the running one,
  (b) for a later layer than the running one, its link is idle in the
  clock the scheduler keeps (a queued gather would delay the collectives
  that become ready behind it; the running layer's gathers are needed now
  and queue anyway), and (c) the live bytes now, plus what the original
  order adds until the gather's use (from the gather's own place on, the
  original order holds its bytes already), plus the gathered bytes stay
  under the unscheduled graph's peak times ``1 + PREFETCH_MEMORY_SLACK``.
  A gather not prefetched is issued when its consumer needs it, as in the
  original order. That prediction can miss (prefetched gathers then
  overlap): a schedule whose estimated peak exceeds the unscheduled one by
  more than ``PEAK_TOLERANCE`` plus one gathered buffer (the largest
  all-gather's: what prefetching one gather ahead holds, as FSDP does) is
  redone with a limit lowered by the overshoot, and the original order is
  kept when no attempt fits.
* **Later stages of a prefetched gather run ahead too.** A parameter
  redistributed in stages (a bucket gathered over the network, then each
  weight resharded and gathered within the node) has its next stage
  issued once the stage before is done in the clock, its link is idle,
  the compute before the next collective on that link that is not a
  parameter stage (an activation collective, which blocks compute) is
  longer than it, and what it allocates fits; otherwise it runs where its
  consumer needs it. A layer is needed where its compute starts: a
  gather's need follows layout ops and later stages to the first op that
  computes with the data.
* **Issue other collectives as soon as their input exists**: activation
  redistributions (except gathers whose result only leaves the graph, an
  activation saved for backward: those stay in place), and reductions
  (gradient reduce-scatters, all-reduces) together with the ops that only
  prepare their input (a bucket's flatten and fp32 cast, which the original
  order runs at the very end; a small collective among those ops, such as
  a norm weight's gradient gathered into the bucket's layout, is issued
  first and the reduction once the clock has it done). A ready reduction is issued by the main loop
  after that step's prefetches (FSDP2's order: the next layer's gathers
  before this layer's reduce-scatter, which would otherwise hold the link)
  and once the bytes its preparation allocates fit under the limit.
* **Wait late, free early.** A ``wait_tensor`` is emitted only when a
  consumer needs its result; a reduce-scatter's (or all-reduce's) wait,
  whose consumer is often the graph output, as soon as the clock says the
  collective is done (no stall: on a GPU the unreduced input is freed when
  the collective ends), and after ``max_consecutive_compute`` compute ops
  only when the live bytes come near the memory limit (a stall that buys
  memory).
* **Fill stalls.** When the next node would wait for a collective still in
  flight (in the streams' clock), ready nodes from the next
  ``FILL_WINDOW`` nodes of the original order (all inputs out, within the
  memory limit) run first, until the collective is done: the shared
  experts while the routed tokens are exchanged, the other chunk's compute
  while one chunk's all-to-all runs.
* **Cap compute between reduce-scatters.** Once ``max_consecutive_compute``
  compute ops (ops with a FLOP formula: matmuls, attention) have run since
  the last reduce-scatter, the scheduler prefers, among the nodes it may run
  next, the one closest to a pending reduce-scatter. Without it, backward
  computes all gradients before the first reduce-scatter (the joint graph
  reduces gradients at its very end) and every unreduced gradient is alive
  at once.

Estimates for the stats (before and after): exposed communication from the
multi-stream clock of :mod:`.overlap_model` (compute on one stream, each
link, NVLink or network, a FIFO stream of its own; a wait stalls compute
until its collective ends) and peak memory from a liveness walk over the
fake tensor sizes (views alias their base; a collective's input lives until
its wait), shared with the scheduler.

>>> # stats = schedule_overlap(graphs.bw, ctx)   # doctest: +SKIP
>>> # stats.longest_compute_run_before, stats.longest_compute_run_after  -> 56, 4
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections import deque
from dataclasses import dataclass

import torch.fx as fx

from .base import PassContext, register_pass
from .param_chains import deferred_chain_ops, first_use, gathers_by_layer, is_layout_op, layer_ranks
from .schedule_queries import RangeMax, check_order, closest_reduction, only_output_reads, preparation
from ..graph_vocab import COLLECTIVE_START, OTHER_CALL, WAIT_NODE
from .overlap_model import (
    AG,
    RS,
    Clock,
    Costs,
    Info,
    LiveBytes,
    check_topological,
    estimate,
    is_compute,
    live_curve,
    longest_compute_run,
    nbytes,
)

__all__ = [
    "ScheduleStats",
    "OverlapScheduler",
    "schedule_order",
    "schedule_overlap",
    "estimate",
    "longest_compute_run",
    "is_compute",
    "check_topological",
]

# Prefetched gathers may raise the estimated live bytes to at most this much
# above the unscheduled graph's peak.
PREFETCH_MEMORY_SLACK = 0.0
# How far ahead (nodes of the original order) a stall looks for ready work.
FILL_WINDOW = 160


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
    nodes_filled: int = 0  # run early while a wait's collective was in flight


# ---------------------------------------------------------------------------
# the scheduler


class OverlapScheduler:
    """One list-scheduling run over ``gm`` (see the module docstring).

    The constructor reads the graph once (gather chains and their layers,
    the eager collective starts and what prepares them, the original
    order's live bytes); :meth:`run` emits every node once and returns the
    new order. The state that changes as nodes are emitted lives in the
    fields below the "emission state" comment: the emitted nodes, the ready
    collective starts, the reductions whose wait is pending, the compute
    counters, the streams' clock and the live bytes."""

    def __init__(
        self,
        gm: fx.GraphModule,
        ctx: PassContext | None,
        stats: ScheduleStats,
        costs: Costs | None = None,
        memory_limit: int | None = None,
        info: Info | None = None,
    ):
        opts = ctx.options if ctx is not None else None
        self.stats = stats
        self.memory_limit = memory_limit
        self.prefetch = max(0, opts.prefetch_layers if opts else 1)
        self.cap = max(1, opts.max_consecutive_compute if opts else 8)
        costs = costs or Costs(ctx)
        nodes = self.nodes = list(gm.graph.nodes)
        if info is None or info.nodes != nodes:
            info = Info(nodes, costs)
        self.info = info
        self.index, self.ins, self.kind = info.index, info.ins, info.kind
        self.compute, self.reductions = info.compute, info.reductions
        self.output = nodes[-1]
        self._read_gather_chains(gm, ctx)
        self.dist_to_rs = self._distances_to_reductions()
        self._read_eager_starts()

        # emission state
        self.done: set[fx.Node] = set()
        self.order: list[fx.Node] = []
        self.eager: list[tuple[int, fx.Node]] = []  # ready collective starts
        self.held: list[tuple[int, fx.Node]] = []  # ready reductions, issued after the step's prefetches
        self.pending_rs: deque[tuple[fx.Node, int]] = deque()  # (wait node, compute count when issued)
        self.compute_count = 0
        self.since_rs = 0  # compute ops since the last reduction
        self.next_pf = 0  # index into pf_order
        self.staged: list[fx.Node] = []  # later stages of prefetched gathers, issued once their input is in
        self.stage_need: dict[fx.Node, int] = {}
        self._read_link_gaps()
        # the streams' clock of :func:`estimate`, and live bytes, as nodes are emitted
        self.clock = Clock(info)
        self.live = LiveBytes(info)

        # live bytes after each node of the original order
        self.orig_live = live_curve(info, nodes) if memory_limit is not None else []
        self.range_max = RangeMax(self.orig_live)
        self.orig_last: dict[fx.Node, int] = {}  # root -> its last keeper's place in the original order
        if memory_limit is not None:
            for p, n in enumerate(nodes):
                for r in info.kept_by[n]:
                    self.orig_last[r] = p
        # waits, and of parameter gather chains the ops up to each gather and
        # the views of its result: a bucket's split into parameters would
        # otherwise pull the wait forward to its place in the original order (a
        # copy out of the bucket stays there: deferred, it would hold the whole
        # bucket until the last parameter's use)
        self.deferred = {n for n in nodes if self.kind[n] == 2} | deferred_chain_ops(self.ag_layer, info)

    # -- reading the graph --------------------------------------------------

    def _read_gather_chains(self, gm: fx.GraphModule, ctx: PassContext | None) -> None:
        nodes, index, stats = self.nodes, self.index, self.stats
        self.ag_layer = ag_layer = gathers_by_layer(gm, ctx)
        stats.all_gathers = sum(1 for n in nodes if n.target is AG)
        stats.reduce_scatters = sum(1 for n in nodes if n.target is RS)
        # each gather's first need (the first consumer outside its chain of what
        # it feeds: a chain may gather twice, once for forward, once more for a
        # copy saved for backward), layers in order of first need
        self.need_of = need_of = {}
        first_need: dict[str, int] = {}
        chain_sets: dict[int, set[fx.Node]] = {}
        for ag, (layer, chain) in ag_layer.items():
            chain_set = chain_sets.get(id(chain))
            if chain_set is None:
                chain_set = chain_sets[id(chain)] = set(chain)
            need = first_use(ag, chain_set, index)
            need_of[ag] = need
            first_need[layer] = min(first_need.get(layer, need), need)
        layer_order = sorted(first_need, key=first_need.__getitem__)
        self.layer_rank = layer_ranks(layer_order)
        stats.layers = len(layer_order)
        # prefetch candidates: one gather at a time, in order of need
        # (not those the graph only returns, a gathered weight saved for
        # backward: prefetched, it would only hold memory; they run at the end)
        self.pf_order = sorted(
            (a for a in ag_layer if nodes[need_of[a]] is not self.output), key=lambda a: (need_of[a], index[a])
        )
        self.need_points = [first_need[name] for name in layer_order]

    def _read_link_gaps(self) -> None:
        # compute seconds before each place of the original order, and per
        # link the places of the collectives that are not parameter stages
        # (activation redistributions, reductions): a parameter's later stage
        # must not hold the link when one of them is issued
        info, kind = self.info, self.kind
        param_stages: set[fx.Node] = set()
        stack = list(self.ag_layer)
        while stack:
            for c in self.follow_ups(stack.pop()):
                if c not in param_stages:
                    param_stages.add(c)
                    stack.append(c)
        self.compute_before = cum = [0.0]
        self.link_starts: dict[str, list[int]] = {}
        for p, n in enumerate(self.nodes):
            cum.append(cum[-1] + (info.time.get(n, 0.0) if kind[n] == OTHER_CALL else 0.0))
            if kind[n] == COLLECTIVE_START and n not in self.ag_layer and n not in param_stages:
                self.link_starts.setdefault(info.stream[n], []).append(p)

    def link_gap(self, i: int, link: str) -> float:
        """Compute seconds, in the original order from place ``i``, before
        the next collective on ``link`` that is not a parameter stage."""
        starts = self.link_starts.get(link, ())
        k = bisect.bisect_left(starts, i)
        while k < len(starts) and self.nodes[starts[k]] in self.done:
            k += 1
        return float("inf") if k == len(starts) else self.compute_before[starts[k]] - self.compute_before[i]

    def _distances_to_reductions(self) -> dict[fx.Node, int]:
        # distance (in compute ops) from each node to the nearest gradient reduction
        dist_to_rs: dict[fx.Node, int] = {}
        for n in reversed(self.nodes):
            if n in self.reductions:
                dist_to_rs[n] = 0
                continue
            best = min((dist_to_rs[u] for u in n.users if u in dist_to_rs), default=None)
            if best is not None:
                dist_to_rs[n] = best + (1 if n in self.compute else 0)
        return dist_to_rs

    def _read_eager_starts(self) -> None:
        # collective starts (not param gathers) are issued once ready; a
        # reduction together with the ops that only prepare its input (a
        # bucket's flatten and cast of gradients), which the original order runs
        # at the end (reducing early frees the unreduced input; gathering early
        # would hold the larger output): count the missing inputs of start and
        # preparation
        # (a gather whose result only leaves the graph, an activation saved for
        # backward, stays where the original order has it: early, it would only
        # hold memory)
        nodes, kind, ins, info = self.nodes, self.kind, self.ins, self.info
        self.wait_of = wait_of = {}
        for n in nodes:
            if kind[n] == 2 and isinstance(n.args[0], fx.Node):
                wait_of[n.args[0]] = n
        eager_starts = [
            n
            for n in nodes
            if kind[n] == 1
            and n not in self.ag_layer
            and (n in self.reductions or not only_output_reads(wait_of.get(n), self.output))
        ]
        self.remaining_inputs: dict[fx.Node, int] = {}
        self.start_users: dict[fx.Node, list[fx.Node]] = {}
        self.prep_bytes: dict[fx.Node, int] = {}  # what a reduction's preparation allocates
        self.inner_starts: dict[fx.Node, list[fx.Node]] = {}  # collectives within a reduction's preparation
        for c in eager_starts:
            prep, inner = preparation(c, info) if c in self.reductions else (set(), [])
            if inner:
                self.inner_starts[c] = inner
            if prep:
                self.prep_bytes[c] = sum(info.size.get(m, 0) for m in prep)
            outside = {a for m in prep | {c} for a in ins[m] if a not in prep}
            self.remaining_inputs[c] = len(outside)
            for a in outside:
                self.start_users.setdefault(a, []).append(c)

    # -- emitting -----------------------------------------------------------

    def emit(self, n: fx.Node) -> None:
        self.order.append(n)
        self.done.add(n)
        self.live.emit(n)
        self.clock.run(n)
        if n in self.compute:
            self.compute_count += 1
            self.since_rs += 1
        if n in self.reductions:
            self.since_rs = 0
            w = self.wait_of.get(n)
            if w is not None:
                self.pending_rs.append((w, self.compute_count))
        for u in self.start_users.get(n, ()):
            left = self.remaining_inputs[u] - 1
            self.remaining_inputs[u] = left
            if left == 0:
                heapq.heappush(self.eager, (self.index[u], u))

    def ensure(self, n: fx.Node) -> None:
        """Emit ``n`` after its missing inputs, deepest first (iterative DFS)."""
        done, ins = self.done, self.ins
        if n in done:
            return
        for a in ins[n]:
            if a not in done:
                break
        else:  # the common case: every input is out already
            self.emit(n)
            self.flush()
            return
        stack = [(n, False)]
        while stack:
            m, expanded = stack.pop()
            if m in done:
                continue
            if expanded:
                self.emit(m)
                self.flush()
                continue
            stack.append((m, True))
            for a in reversed(ins[m]):
                if a not in done:
                    stack.append((a, False))

    def flush(self) -> None:
        """Collective starts that became ready (before any further prefetch,
        so reductions do not queue behind gathers); reduction waits once their
        collective is done (free the unreduced input at no stall) or past the cap."""
        eager, pending_rs, clock = self.eager, self.pending_rs, self.clock
        while eager:
            item = heapq.heappop(eager)
            if item[1] in self.done:
                continue
            if item[1] in self.reductions:
                # released by the main loop after its prefetches (a gather
                # queued behind a long reduction on the link is exposed), and
                # once its preparation (an fp32 copy of gradients) fits
                heapq.heappush(self.held, item)
                continue
            self.ensure(item[1])
        while pending_rs and (
            clock.done.get(pending_rs[0][0].args[0], 0.0) <= clock.now
            or (self.compute_count - pending_rs[0][1] >= self.cap and self.short_of_memory())
        ):
            w, _ = pending_rs.popleft()
            if w not in self.done:
                self.ensure(w)

    def short_of_memory(self) -> bool:
        # waiting for a reduction stalls compute; on a GPU its input is
        # freed when it ends anyway: force the wait only near the limit
        return self.memory_limit is None or self.live.live > self.memory_limit * (1 - PEAK_TOLERANCE)

    def fits(self, c: fx.Node) -> bool:
        return self.memory_limit is None or self.live.live + self.prep_bytes.get(c, 0) <= self.memory_limit

    def release_held(self) -> None:
        """Ready reductions, once the collectives within their preparation
        are done (issued here first) and their preparation fits."""
        held, done, clock = self.held, self.done, self.clock
        while held:
            c = held[0][1]
            if c not in done:
                inner = self.inner_starts.get(c, ())
                for s in inner:
                    self.ensure(s)
                if any(clock.done.get(s, 0.0) > clock.now for s in inner) or not self.fits(c):
                    return
            heapq.heappop(held)
            self.ensure(c)

    # -- the rules of the main loop -------------------------------------------

    def prefetch_step(self, i: int) -> None:
        """Issue the next parameter gathers (in order of need) while: their
        layer is at most ``prefetch`` layers past the current one, the comm
        stream is idle (a queued gather would delay the reductions that
        become ready meanwhile), and the gathered bytes fit under the limit."""
        current = max(self.current_rank(i), 0)
        upto = current + self.prefetch
        pf_order, memory_limit, range_max = self.pf_order, self.memory_limit, self.range_max
        while self.next_pf < len(pf_order):
            ag = pf_order[self.next_pf]
            if ag in self.done:
                self.next_pf += 1
                continue
            rank = self.layer_rank[self.ag_layer[ag][0]]
            if rank > upto or (rank > current and not self.clock.link_idle(self.info.stream[ag])):
                return
            if memory_limit is not None:
                # what the original order adds before the gather is used
                # (it stays alive until then) predicts the rise from here;
                # from the gather's own place on, the original order holds
                # the gathered bytes already, if it keeps them to the need
                need = self.need_of[ag]
                base, gathered, at = self.orig_live[i - 1 if i else 0], nbytes(ag.meta.get("val")), self.index[ag]
                if (
                    at < i or self.orig_last.get(ag, at) < need
                ):  # (or the original frees it before the need: a copy-out)
                    rise = max(range_max(i, need + 1) - base, 0) + gathered
                else:
                    rise = max(range_max(i, at) - base + gathered, range_max(at, need + 1) - base, gathered)
                if self.live.live + rise > memory_limit:
                    return
            before = self.compute_count
            self.ensure(ag)
            self.staged.extend(self.follow_ups(ag))
            self.next_pf += 1
            if before == self.compute_count:
                self.stats.prefetched_all_gathers += 1

    def follow_ups(self, start: fx.Node) -> list[fx.Node]:
        """The collectives that take ``start``'s result on through layout ops
        alone: a parameter's next stage (gathered over the network, then
        resharded and gathered within the node)."""
        w = self.wait_of.get(start)
        if w is None:
            return []
        kind, out, stack, seen = self.kind, [], [w], {w}
        while stack:
            for u in stack.pop().users:
                if u in seen:
                    continue
                seen.add(u)
                if kind[u] == COLLECTIVE_START:
                    if u not in self.reductions and u not in self.ag_layer:
                        out.append(u)
                elif kind[u] == OTHER_CALL and u not in self.compute and is_layout_op(u):
                    stack.append(u)
        return out

    def _missing_layout_ops(self, start: fx.Node) -> list[fx.Node] | None:
        """The ops ``start`` still needs, when all are layout ops (views,
        copies, casts) or waits of collectives the clock has finished; None
        otherwise (running them now would stall or compute early)."""
        done, kind, clock = self.done, self.kind, self.clock
        missing, stack, seen = [], [start], {start}
        while stack:
            for a in self.ins[stack.pop()]:
                if a in done or a in seen:
                    continue
                seen.add(a)
                k = kind[a]
                if k == WAIT_NODE:
                    if a.args[0] not in done or clock.done.get(a.args[0], 0.0) > clock.now:
                        return None
                elif k != OTHER_CALL or a in self.compute or not is_layout_op(a):
                    return None
                missing.append(a)
                stack.append(a)
        return missing

    def stage_step(self, i: int) -> None:
        """Issue the next stage of prefetched parameter gathers once the stage
        before is done (in the clock), while its link is idle and the bytes
        it and its layout ops allocate fit, so that it runs ahead of the
        layer too instead of queueing, at the layer's start, before the
        activation collectives that block compute (and only where it ends
        before the next of those is issued)."""
        if not self.staged:
            return
        keep: list[fx.Node] = []
        for c in self.staged:
            if c in self.done:
                continue
            missing, link = None, self.info.stream[c]
            if self.clock.link_idle(link) and self.info.time[c] <= self.link_gap(i, link):
                missing = self._missing_layout_ops(c)
            if missing is None or not self._stage_fits(i, c, missing):
                keep.append(c)
                continue
            self.ensure(c)
            keep.extend(self.follow_ups(c))
        self.staged = keep

    def _stage_fits(self, i: int, c: fx.Node, missing: list[fx.Node]) -> bool:
        if self.memory_limit is None:
            return True
        size = self.info.size
        added = size.get(c, 0) + sum(size.get(m, 0) for m in missing)
        need = self.stage_need.get(c)
        if need is None:
            need = self.stage_need[c] = first_use(c, set(), self.index)
        base = self.orig_live[i - 1 if i else 0]
        rise = max(self.range_max(i, need + 1) - base, 0) + added
        return self.live.live + rise <= self.memory_limit

    def current_rank(self, i: int) -> int:
        # need_points ascend: the last layer whose first need is at or before i
        return bisect.bisect_right(self.need_points, i) - 1

    def stall_until(self, n: fx.Node) -> float:
        """When the collectives behind ``n``'s pending waits end (0: no stall)."""
        end = 0.0
        for a in self.ins[n]:
            if self.kind[a] == 2 and a not in self.done and a not in self.info.comm_side:
                end = max(end, self.clock.done.get(a.args[0], 0.0))
        return end

    def fill(self, i: int, until: float) -> None:
        """Run ready work from a little further on while the collectives n
        waits for are in flight (the shared experts while the MoE tokens
        are exchanged, the other chunk's compute): in original order,
        only nodes whose inputs are all out, within the memory limit."""
        done, memory_limit = self.done, self.memory_limit
        for m in self.nodes[i + 1 : i + FILL_WINDOW]:
            if self.clock.now >= until:
                return
            if m in done or m is self.output or m in self.deferred or self.kind[m] != 3:
                continue
            if any(a not in done for a in self.ins[m]):
                continue
            if memory_limit is not None and self.live.live + self.info.size.get(m, 0) > memory_limit:
                continue
            self.ensure(m)
            self.stats.nodes_filled += 1

    def run(self) -> list[fx.Node]:
        """Emit every node once; the new order."""
        nodes, done, output, deferred = self.nodes, self.done, self.output, self.deferred
        # placeholders first, in their order
        for n in nodes:
            if n.op == "placeholder":
                self.emit(n)
        self.flush()
        i = 0
        while i < len(nodes):
            n = nodes[i]
            if n in done or n is output or n in deferred:
                i += 1
                continue
            self.prefetch_step(i)
            self.stage_step(i)
            self.release_held()
            until = self.stall_until(n)
            if until > self.clock.now:
                self.fill(i, until)
                if n in done:
                    i += 1
                    continue
            if self.since_rs >= self.cap and n in self.compute and n in self.dist_to_rs:
                # past the cap: run toward the nearest pending reduction first
                target = closest_reduction(n, nodes, i, done, self.dist_to_rs, self.info)
                if target is not None and target is not n:
                    self.ensure(target)
                    continue
            self.ensure(n)
            i += 1
        for n in nodes:
            if n not in done and n is not output:
                self.ensure(n)
        self.emit(output)
        return self.order


def schedule_order(
    gm: fx.GraphModule,
    ctx: PassContext | None,
    stats: ScheduleStats,
    costs: Costs | None = None,
    memory_limit: int | None = None,
    info: Info | None = None,
) -> list[fx.Node]:
    """The overlap schedule of ``gm``'s nodes (``gm`` itself is not changed);
    ``stats`` receives the counts. ``memory_limit`` (bytes): the live bytes
    that prefetching, filling and early reductions must stay under (None: no
    limit)."""
    return OverlapScheduler(gm, ctx, stats, costs, memory_limit, info).run()


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
        order = schedule_order(gm, ctx, attempt, costs, limit, info)
        peak = info.estimate(order)[1]
        if peak <= target:
            for f in dataclasses.fields(stats):
                setattr(stats, f.name, getattr(attempt, f.name))
            return order
        limit = int(limit * target / peak)
    stats.all_gathers = sum(1 for n in original if n.target is AG)
    stats.reduce_scatters = sum(1 for n in original if n.target is RS)
    return list(original)


@register_pass("schedule_overlap", "graphs")
def schedule_overlap(gm: fx.GraphModule, ctx: PassContext) -> ScheduleStats:
    """Reorder ``gm`` (a forward or backward graph, in place); see the module
    docstring."""
    stats = ScheduleStats(graph=getattr(ctx, "graph_kind", None) or "")
    costs = Costs(ctx)
    before = list(gm.graph.nodes)
    info = Info(before, costs)
    stats.longest_compute_run_before = info.longest_compute_run(before)
    stats.exposed_comm_before_s, stats.peak_memory_before = info.estimate(before)
    limit = int(stats.peak_memory_before * (1 + PREFETCH_MEMORY_SLACK))
    # one gather held ahead of its use: on a small model a single buffer is
    # more than the relative tolerance
    one_gather = max((info.size.get(n, 0) for n in before if n.target is AG), default=0)
    target = int(stats.peak_memory_before * (1 + PEAK_TOLERANCE)) + one_gather
    order = _schedule_within(gm, ctx, stats, costs, limit, target, info, before)
    if len(order) != len(before) or set(order) != set(before):
        raise RuntimeError("schedule_overlap lost or duplicated nodes")
    check_order(order, info)
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
