"""The cost and memory model behind :mod:`.schedule_overlap`.

Per-node facts of a forward or backward graph (:class:`Info`: inputs, kind,
estimated time, storage roots and what keeps them alive), the multi-stream
clock (:class:`Clock`) behind the estimate of exposed communication and
peak memory (:func:`estimate`), and the live-bytes tracker
(:class:`LiveBytes`) the scheduler and the estimates share. Compute ops take
``cost_model.node_compute_time``, collectives ``cost_model.collective_time``
on their process group's topology.

Streams, as on GPUs: compute runs on one stream; every collective runs on
the stream of its *link* (:meth:`Costs.link`): the intra-node link (NVLink)
for groups within a node, the network for groups that span nodes. NCCL runs
each communicator on its own stream and FSDP2 issues parameter all-gathers
and gradient reduce-scatters from side streams, so collectives on different
links (a 16x8 mesh's dp gathers over the network, its tp activation gathers
over NVLink) proceed concurrently, while collectives sharing a link share
its bandwidth: each link is one FIFO queue (a collective starts when it is
issued and the link's previous collective is done). A ``wait_tensor``
stalls compute until its collective ends: a collective whose consumer runs
right after it is exposed, one issued a layer ahead (a prefetched gather) or
waited late (a reduce-scatter) hides behind the compute in between. Not
modelled: the SM and HBM share NCCL kernels take from concurrent compute.

Memory: views alias their base, a collective's input lives until its wait,
graph outputs live to the end.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import cost_model
from ..cost_model.compute import flop_formula
from ..apply.moe_a2a_phases import EXCHANGE as MOE_EXCHANGE
from ..apply.moe_dispatch import in_op_collectives
from ..graph_vocab import ALL_GATHER as AG, ALL_REDUCE as AR, ALL_TO_ALL as A2A, REDUCE_SCATTER as RS, WAIT
from ..graph_vocab import COLLECTIVE_START, NOT_A_CALL, OTHER_CALL, WAIT_NODE, NodeKind
from .base import PassContext

__all__ = ["Clock", "Info", "LiveBytes", "estimate", "is_compute", "longest_compute_run", "check_topological"]

# collective starts (a wait_tensor on the result completes them); the MoE
# row exchange is an all-to-all of data-dependent size, priced balanced
STARTS = {AG: "all_gather", RS: "reduce_scatter", AR: "all_reduce", A2A: "all_to_all", MOE_EXCHANGE: "all_to_all"}
GRAD_REDUCTIONS = {RS, AR}

# ops that communicate inside themselves (blocking): the fused MoE all-to-all
_IN_OP_TARGETS = frozenset(
    (torch.ops.autoparallel.moe_experts_a2a.default, torch.ops.autoparallel.moe_experts_a2a_backward.default)
)

# target -> has a FLOP formula (asked once per target: the lookup is not free)
_COMPUTE_TARGETS: dict = {}


def is_compute(node: fx.Node) -> bool:
    """A compute op for the cap: one with a FLOP formula (matmul, attention)."""
    if node.op != "call_function":
        return False
    target = node.target
    hit = _COMPUTE_TARGETS.get(target)
    if hit is None:
        hit = isinstance(target, torch._ops.OpOverload) and flop_formula(target) is not None
        _COMPUTE_TARGETS[target] = hit
    return hit


# ---------------------------------------------------------------------------
# measures


def longest_compute_run(nodes, reductions=GRAD_REDUCTIONS) -> int:
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


def nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(nbytes(v) for v in val)
    return 0


def _is_alias(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target is operator.getitem or n.target is WAIT:
        return True
    return isinstance(n.target, torch._ops.OpOverload) and n.target.is_view


def _group_size_and_name(n: fx.Node) -> tuple[int, str | None]:
    args = list(n.args) + list(n.kwargs.values())
    name = next((a for a in reversed(args) if isinstance(a, str)), None)
    if n.target is AG or n.target is RS:
        return int(n.args[-2] if n.target is AG else n.args[2]), name
    return 0, name


class Costs:
    def __init__(self, ctx: PassContext | None):
        self.device = getattr(ctx, "device", None) or cost_model.H100
        mesh = getattr(ctx, "mesh", None)
        self.group_dim: dict[str, tuple[int, bool, int]] = {}
        if mesh is not None:
            try:
                topo = cost_model.mesh_dim_topology(mesh, self.device.gpus_per_node)
                for d in range(mesh.ndim):
                    t = topo[d]
                    self.group_dim[mesh.get_group(d).group_name] = (mesh.size(d), t.intra_node, t.ranks_per_node)
            except Exception:  # a bare graph without a usable mesh: intra-node defaults
                self.group_dim = {}
        self._cache: dict[fx.Node, float] = {}
        self._free: dict = {}  # target -> launches no kernel
        self._by_shape: dict[tuple, float] = {}
        self._unresolved: set = set()  # group names not registered here

    def group(self, name: str | None, size: int) -> tuple[int, bool, int]:
        """(group size, intra-node, members per node) of the process group
        ``name``: a mesh dim's, else (a flattened or sub-mesh group) from
        its ranks with the device's GPUs per node, as :func:`cost_model.mesh_dim_topology`,
        else (a bare graph) intra-node."""
        hit = self.group_dim.get(name)
        if hit is None and name not in self._unresolved:
            hit = _group_topology(name, self.device.gpus_per_node)
            if hit is None:
                self._unresolved.add(name)
            else:
                self.group_dim[name] = hit
        return hit if hit is not None else (size, True, 1)

    def link(self, n: fx.Node) -> str:
        """The stream a collective start ``n`` runs on: the link its group
        uses, ``"nvlink"`` (within a node) or ``"network"`` (across nodes)."""
        size, name = _group_size_and_name(n)
        return "nvlink" if self.group(name, size)[1] else "network"

    def time(self, n: fx.Node) -> float:
        if n in self._cache:
            return self._cache[n]
        t = 0.0
        if n.op == "call_function" and n.target in STARTS:
            size, name = _group_size_and_name(n)
            size, intra, per_node = self.group(name, size)
            if n.target is A2A or n.target is MOE_EXCHANGE:
                size = size or (len(n.args[1]) if isinstance(n.args[1], (list, tuple)) else 2)
            if n.target is AR and not size:
                size = 2
            src = n.args[0]
            moved = nbytes(src.meta.get("val")) if isinstance(src, fx.Node) else 0
            t = cost_model.collective_time(STARTS[n.target], moved, size, intra, self.device, per_node)
        elif n.op == "call_function" and n.target is not WAIT:
            t = self._compute_time(n) + self.in_op_comm(n)
        self._cache[n] = t
        return t

    def in_op_comm(self, n: fx.Node) -> float:
        """Seconds of blocking communication inside op ``n`` (the fused MoE
        all-to-all op): part of its time, and all of it exposed."""
        t = 0.0
        for kind, moved, name in in_op_collectives(n):
            size, intra, per_node = self.group(name, 2)
            t += cost_model.collective_time(kind, moved, size, intra, self.device, per_node)
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


def _group_topology(name: str | None, gpus_per_node: int) -> tuple[int, bool, int] | None:
    """(size, intra-node, fewest members per node) from the ranks of the
    registered process group ``name``; None when there is none."""
    if name is None:
        return None
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group, get_process_group_ranks

        ranks = get_process_group_ranks(_resolve_process_group(name))
    except Exception:  # no such group here (a bare graph)
        return None
    nodes: dict[int, int] = {}
    for r in ranks:
        nodes[r // gpus_per_node] = nodes.get(r // gpus_per_node, 0) + 1
    return len(ranks), len(nodes) == 1, min(nodes.values())


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


class Info:
    """Per-node facts of one graph, computed once and shared by the
    estimates and the scheduler: inputs, kind, cost, compute flag, and the
    memory model of :func:`estimate` (views alias their base: storage roots;
    which roots each node keeps alive; root sizes). Built from ``nodes`` in
    the given order (roots follow the first input already seen, as in a
    walk over that order); any topological order gives the same facts."""

    def __init__(self, nodes: list[fx.Node], costs: Costs):
        self.nodes = nodes
        self.index = {n: i for i, n in enumerate(nodes)}
        ins: dict[fx.Node, list[fx.Node]] = {}
        kind: dict[fx.Node, NodeKind] = {}
        time: dict[fx.Node, float] = {}
        compute: set[fx.Node] = set()
        blocking: dict[fx.Node, float] = {}  # in-op communication (exposed)
        stream: dict[fx.Node, str] = {}  # collective start -> its link (Costs.link)
        root: dict[fx.Node, fx.Node] = {}
        for n in nodes:
            inputs = n.all_input_nodes
            ins[n] = inputs
            if _is_alias(n):
                root[n] = next((root[a] for a in inputs if a in root), n)
            else:
                root[n] = n
            if n.op != "call_function":
                kind[n] = NOT_A_CALL
                continue
            target = n.target
            if target in STARTS:
                kind[n] = COLLECTIVE_START
                time[n] = costs.time(n)
                stream[n] = costs.link(n)
            elif target is WAIT:
                kind[n] = WAIT_NODE
            else:
                kind[n] = OTHER_CALL
                time[n] = costs.time(n)
                if is_compute(n):
                    compute.add(n)
                if target in _IN_OP_TARGETS:
                    blocking[n] = costs.in_op_comm(n)
        kept_by: dict[fx.Node, set[fx.Node]] = {}
        keepers: dict[fx.Node, int] = {}
        for n in nodes:
            kept = {root.get(a, a) for a in ins[n]}
            if kind[n] == WAIT_NODE:  # the collective's input lives until its wait
                for a in ins[n]:
                    kept.update(root.get(b, b) for b in (ins[a] if a in ins else a.all_input_nodes))
            kept_by[n] = kept
            for r in kept:
                keepers[r] = keepers.get(r, 0) + 1
        self.ins, self.kind, self.time, self.compute, self.stream = ins, kind, time, compute, stream
        self.blocking = blocking
        self.root, self.kept_by, self.keepers = root, kept_by, keepers
        self.size = {n: nbytes(n.meta.get("val")) for n in nodes if root[n] is n and n.op != "output"}
        self.reductions = {n for n in nodes if kind[n] and n.target in GRAD_REDUCTIONS}
        self.comm_side, self.after = _comm_side_waits(nodes, kind, ins)

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
        clock = Clock(self)
        for n in order:
            clock.run(n)
        exposed = clock.exposed
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


def _comm_side_waits(nodes, kind, ins) -> tuple[set[fx.Node], dict[fx.Node, list[fx.Node]]]:
    """Waits whose result only feeds further collectives (through layout
    ops and casts: a parameter resharded by an all-to-all, then gathered),
    and for each collective start, the collectives such waits make it
    follow. A side stream (FSDP2's copy-in) chains these without stalling
    compute: the later collective starts when the earlier one ends. (The
    graph output may read them too: a copy saved for backward.)"""
    from .recompute_all_gathers import is_chain_op

    comm_side: set[fx.Node] = set()
    after: dict[fx.Node, list[fx.Node]] = {}
    for w in nodes:
        if kind.get(w) != WAIT_NODE or not isinstance(w.args[0], fx.Node) or kind.get(w.args[0]) != COLLECTIVE_START:
            continue
        starts, stack, seen, ok = [], [w], {w}, True
        while stack and ok:
            for u in stack.pop().users:
                if u in seen:
                    continue
                seen.add(u)
                if kind.get(u) == COLLECTIVE_START:
                    starts.append(u)
                elif u.op == "output":  # also saved for backward
                    continue
                elif kind.get(u) == OTHER_CALL and is_chain_op(u):
                    stack.append(u)
                else:
                    ok = False
                    break
        if ok and starts:
            comm_side.add(w)
            for c in starts:
                after.setdefault(c, []).append(w.args[0])
    return comm_side, after


class Clock:
    """The streams' clock as nodes run in some order (see the module
    docstring): ``now`` on the compute stream, ``free[link]`` when each
    link's last collective ends, ``done[start]`` when each collective ends,
    ``exposed``: compute-stream time spent waiting on collectives."""

    __slots__ = ("kind", "time", "stream", "blocking", "comm_side", "after", "now", "free", "done", "exposed")

    def __init__(self, info: "Info"):
        self.kind, self.time, self.stream = info.kind, info.time, info.stream
        self.blocking = info.blocking  # in-op communication: part of the op's time, all exposed
        self.comm_side, self.after = info.comm_side, info.after
        self.now = self.exposed = 0.0
        self.free: dict[str, float] = {}
        self.done: dict[fx.Node, float] = {}

    def run(self, n: fx.Node) -> tuple[float, float] | None:
        """Advance past ``n``; its interval: a compute op's run, a
        collective's run on its link, a wait's stall (None: no stall, or a
        node that takes no time)."""
        k = self.kind[n]
        if k == COLLECTIVE_START:
            link = self.stream[n]
            start = max(self.now, self.free.get(link, 0.0))
            for prev in self.after.get(n, ()):  # chained behind a collective on a side stream
                start = max(start, self.done.get(prev, 0.0))
            end = self.free[link] = self.done[n] = start + self.time[n]
            return start, end
        if k == WAIT_NODE:
            end = self.done.get(n.args[0], 0.0)
            if end > self.now and n not in self.comm_side:
                start, self.now = self.now, end
                self.exposed += end - start
                return start, end
            return None
        if k == OTHER_CALL:
            start = self.now
            self.now += self.time[n]
            self.exposed += self.blocking.get(n, 0.0)
            return start, self.now
        return None

    def link_idle(self, link: str) -> bool:
        """Whether ``link`` has finished its queue by ``now``."""
        return self.free.get(link, 0.0) <= self.now

    def end(self) -> float:
        """When the last stream is done."""
        return max([self.now, *self.free.values()])


def estimate(nodes: list[fx.Node], costs: Costs) -> tuple[float, int]:
    """(exposed communication seconds, peak live bytes) of running ``nodes``
    in this order."""
    return Info(list(nodes), costs).estimate(list(nodes))


class LiveBytes:
    """Live bytes as nodes run in some order, in :func:`estimate`'s memory
    model: a root's bytes count from its node until its last keeper ran (a
    root nobody reads is freed at once)."""

    def __init__(self, info: "Info"):
        self.kept_by, self.size = info.kept_by, info.size
        self.pending = dict(info.keepers)  # root -> keepers not run yet
        self.live = 0

    def emit(self, n: fx.Node) -> int:
        s = self.size.get(n, 0)
        if s and self.pending.get(n):
            self.live += s
        pending, size = self.pending, self.size
        for r in self.kept_by[n]:
            left = pending[r] - 1
            pending[r] = left
            if left == 0:
                self.live -= size.get(r, 0)
        return self.live


def live_curve(info: "Info", nodes: list[fx.Node]) -> list[int]:
    """Live bytes after each node of ``nodes``."""
    tracker = LiveBytes(info)
    return [tracker.emit(n) for n in nodes]
