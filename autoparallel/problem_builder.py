"""Stage 3: turn node options + the cost model + user constraints into a
torch-free :class:`solver.Problem`.

* one decision per node (named after the FX node), one option per
  :class:`~autoparallel.strategies.Option`, unary cost = compute time;
* one edge per (producer, consumer, argument): redistribution time from the
  producer's output spec to the consumer's required input spec, plus a tiny
  tie-break for any non-identical transition;
* parameter all-gathers in forward and gradient reductions in backward get
  the overlap discount of :class:`~autoparallel.cost_model.CommOverlapPolicy`;
* structural constraints as infinite-cost pairs: a gradient is laid out like
  its parameter, a tangent like its output; except that a parameter laid out
  tp-outer (which no op produces) takes its gradient from any layout through
  a redistribution, costed on the parameter -> gradient edge;
* user constraints as named pins, the parameter-memory budget as a named
  resource constraint, and repeated layers as links.

Edge costs come per distinct (source, target) placements from
:mod:`autoparallel.edge_costs` (equal to ``redistribute_time``, fast on 3-D
and 4-D meshes). Before any pair matrix exists, Partial options that cannot help are dropped
(:mod:`autoparallel.option_pruning`, exact) and the problem's size is
estimated (:func:`estimate_problem_size`); over ``max_problem_bytes`` the
build stops with :class:`ProblemTooLarge` instead of exhausting memory.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Shard, _StridedShard

import solver

from . import cost_model
from .edge_costs import clear_caches as clear_edge_cost_caches
from .edge_costs import redistribution_matrix
from .option_pruning import PruneStats, prune_partials
from .problem_size import (  # noqa: F401  (the size guard, re-exported)
    DEFAULT_MAX_PROBLEM_BYTES,
    ProblemSize,
    ProblemTooLarge,
    check_problem_size,
    estimate_problem_size,
)
from .option_pruning import copy_cheaper_than_collectives as cost_model_allows_pruning
from .repeated_layers import RepeatedLayers
from .strategies import NodeStrategy, Option, placements_of
from .tracing import TracedStep

logger = logging.getLogger(__name__)

# Nodes that only reinterpret or convert a tensor: a parameter's all-gather
# may happen before or after them and is still "the parameter's all-gather".
_PASS_THROUGH_OPS = {
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
    torch.ops.aten._to_copy.default,
    torch.ops.prims.convert_element_type.default,
}


# Well under a 24 GB workstation, far above any 2-D plan of LLaMA-3 (<1 GB).
@dataclass
class Constraints:
    """What the user asked for, in node terms (validated by the API)."""

    # decision name -> (constraint name, allowed placements)
    pins: dict[str, tuple[str, tuple]] = field(default_factory=dict)
    # Parameter memory budget as fractions of replicated parameter bytes;
    # None high = fully sharded (smallest achievable per parameter). The
    # budget always applies: by default it is what makes FSDP emerge.
    memory_low: float | None = None
    memory_high: float | None = None
    # Mixed precision: dtype parameter gradients are reduced in (None: no
    # constraint). Partial gradients of another dtype may not be reduced.
    reduce_dtype: torch.dtype | None = None
    # Refuse to build a problem whose estimated memory (see
    # :func:`estimate_problem_size`) exceeds this many bytes; None: no limit.
    max_problem_bytes: float | None = DEFAULT_MAX_PROBLEM_BYTES
    # Drop Partial options no computation can make useful, before building
    # pair matrices (exact: see autoparallel.option_pruning); off only to
    # compare against.
    prune_options: bool = True


@dataclass
class BuiltProblem:
    problem: solver.Problem
    nodes: list[torch.fx.Node]
    strategies: dict[torch.fx.Node, NodeStrategy]
    # decision name -> per-option compute seconds
    compute: dict[str, list[float]]
    seconds: float = 0.0
    size: ProblemSize | None = None  # as built (after pruning)
    pruning: PruneStats | None = None
    size_unpruned: ProblemSize | None = None


def local_numel(shape, placements, mesh: DeviceMesh) -> int:
    sizes = list(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            sizes[p.dim] //= mesh.size(mesh_dim)
    return math.prod(sizes)


def _forward_param_chain(traced: TracedStep) -> set[torch.fx.Node]:
    """Parameters and the layout/cast ops applied to them in forward."""
    chain: set[torch.fx.Node] = set(traced.param_nodes.values())
    for node in traced.gm.graph.nodes:
        if (
            node.op == "call_function"
            and node.target in _PASS_THROUGH_OPS
            and node.meta.get("partitioner_tag") != "is_backward"
            and node.args
            and node.args[0] in chain
        ):
            chain.add(node)
    return chain


def _grad_tail(traced: TracedStep) -> set[torch.fx.Node]:
    """Gradient outputs, the layout/cast ops leading to them, and the op
    computing the gradient: where gradient reductions happen."""
    tail: set[torch.fx.Node] = set()
    for grad in traced.grad_nodes.values():
        node = grad
        while node is not None and node.op == "call_function":
            tail.add(node)
            if node.target not in _PASS_THROUGH_OPS:
                break
            node = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    return tail


def _unreducible_grad_nodes(traced: TracedStep, reduce_dtype: torch.dtype | None) -> set[torch.fx.Node]:
    """Nodes whose partial outputs must not be reduced: on a parameter
    gradient's own path (every use leads only to parameter gradients) and of
    a dtype other than ``reduce_dtype``. Tracing puts a cast to
    ``reduce_dtype`` on each gradient's path, so the reduction is left to
    happen at or after it, in ``reduce_dtype``."""
    if reduce_dtype is None:
        return set()
    grads = {g for g in traced.grad_nodes.values() if g is not None}
    grad_only: set[torch.fx.Node] = set()
    for node in reversed(traced.gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node in grads or (node.users and all(u in grad_only for u in node.users)):
            grad_only.add(node)
    return {
        n
        for n in grad_only
        if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype != reduce_dtype
    }


def _partial_mask(spec) -> int:
    return sum(1 << i for i, p in enumerate(spec.placements) if p.is_partial())


@dataclass(frozen=True)
class RedistEdge:
    """An edge costed by redistribution."""

    producer: torch.fx.Node
    consumer: torch.fx.Node
    arg: int
    kind: str | cost_model.HiddenComm | None
    keep_partial: bool


class _EdgeMatrices:
    """Edge cost matrices, each computed once per distinct block.

    * Per (producer option list, consumer option list, argument, overlap
      kind), by identity: repeated layers share option lists, so every
      repeat of an edge gets the same matrix object, which the solver then
      reads once (it memoises matrices by id in validation and presolve).
    * Per (distinct source placements, distinct target placements, tensor
      shape and dtype, overlap kind), by value: the option grid repeats
      placements (options differ in their other inputs), and many edges of
      a layer carry tensors of one shape (q/k/v, gate/up, residuals).
    """

    def __init__(self, device, overlap):
        self.device = device
        self.overlap = overlap
        self._matrices: dict = {}
        self._classes: dict = {}
        self._pair_cache: dict = {}  # for edge_costs.redistribution_matrix

    def _pair(self, src, dst, kind) -> float:
        t = cost_model.redistribute_time(src, dst, self.device)
        if t != 0.0 and math.isfinite(t):
            if kind is not None:
                t = cost_model.apply_discount(t, kind, self.overlap)
            t += cost_model.TRANSITION_TIEBREAK
        elif t == 0.0 and src.placements != dst.placements:
            t = cost_model.TRANSITION_TIEBREAK
        return t

    def classes(self, prod: list[Option], cons: list[Option], arg: int, kind: str | None, keep_partial: bool = False):
        """The redistribution costs between distinct placements: a matrix
        over (distinct producer outputs) x (distinct consumer inputs ``arg``),
        and each producer / consumer option's row / column index in it."""
        src_specs, row_class = _spec_classes([po.output_spec for po in prod])
        dst_specs, col_class = _spec_classes([co.input_specs[arg] for co in cons])
        src_meta, dst_meta = src_specs[0].tensor_meta, dst_specs[0].tensor_meta
        class_key = (
            tuple((s.placements, s.shard_order) for s in src_specs),
            tuple((d.placements, d.shard_order) for d in dst_specs),
            tuple(src_meta.shape),
            src_meta.dtype,
            tuple(dst_meta.shape),
            kind,
            keep_partial,
        )
        class_rows = self._classes.get(class_key)
        if class_rows is None:
            class_rows = self._classes[class_key] = self._class_matrix(src_specs, dst_specs, kind, keep_partial)
        return class_rows, row_class, col_class

    def drop_pair_cache(self) -> None:
        self._pair_cache = {}

    def _class_matrix(self, src_specs, dst_specs, kind, keep_partial) -> list[list[float]]:
        """:meth:`_pair` for every (source, target) spec, with the raw times
        from :func:`edge_costs.redistribution_matrix` (equal to
        ``redistribute_time``, ~10x faster on 3-D meshes)."""
        raw = redistribution_matrix(src_specs, dst_specs, self.device, self._pair_cache)
        tiebreak = cost_model.TRANSITION_TIEBREAK
        discount = (lambda t: cost_model.apply_discount(t, kind, self.overlap)) if kind is not None else None
        # Partial mesh dims of each source / non-partial ones of each target:
        # a pair reduces a Partial where they meet.
        src_partial = [_partial_mask(s) for s in src_specs]
        dst_whole = [~_partial_mask(d) for d in dst_specs]
        rows = []
        for s, sp, raw_row in zip(src_specs, src_partial, raw):
            row = []
            for d, dw, t in zip(dst_specs, dst_whole, raw_row):
                if keep_partial and sp & dw:
                    row.append(math.inf)
                    continue
                # as _pair
                if t != 0.0 and math.isfinite(t):
                    if discount is not None:
                        t = discount(t)
                    t += tiebreak
                elif t == 0.0 and s.placements != d.placements:
                    t = tiebreak
                row.append(t)
            rows.append(row)
        return rows

    def redistribution(
        self, prod: list[Option], cons: list[Option], arg: int, kind: str | None, keep_partial: bool = False
    ):
        """Producer option x consumer option: time to bring the producer's
        output to what the consumer's option needs for argument ``arg``
        (``keep_partial``: reducing a Partial mesh dim is forbidden)."""
        key = (id(prod), id(cons), arg, kind, keep_partial)
        hit = self._matrices.get(key)
        if hit is not None:
            return hit[0]
        class_rows, row_class, col_class = self.classes(prod, cons, arg, kind, keep_partial)
        # Options with the same output placements get the same row object.
        rows_by_class: dict[int, list[float]] = {}
        rows = []
        for r in row_class:
            row = rows_by_class.get(r)
            if row is None:
                costs = class_rows[r]
                row = rows_by_class[r] = [costs[c] for c in col_class]
            rows.append(row)
        # keep prod/cons alive so their ids stay unique while cached
        self._matrices[key] = (rows, prod, cons)
        return rows

    def gradient(self, param: list[Option], grad: list[Option], kind: str):
        """Parameter option x gradient option: 0 where the gradient already
        has the parameter's placements; for a tp-outer parameter, the time
        to bring the gradient to it (a reduce-scatter of kind ``kind``);
        inf otherwise."""
        key = ("gradient", id(param), id(grad), kind)
        hit = self._matrices.get(key)
        if hit is None:
            # costs depend on the gradient's output placements only: priced
            # per distinct placements (a gradient op has many options per
            # output layout, and a tp-outer pair goes through DTensor's
            # planner, ~100 us)
            grad_specs, grad_class = _spec_classes([go.output_spec for go in grad])
            mesh_shape = None
            rows = []
            for po in param:
                ps = po.output_spec
                mesh_shape = mesh_shape or tuple(ps.mesh.shape)
                strided = cost_model.is_tp_outer(ps.placements, mesh_shape)
                by_class = [
                    0.0 if gs.placements == ps.placements else self._pair(gs, ps, kind) if strided else math.inf
                    for gs in grad_specs
                ]
                rows.append([by_class[c] for c in grad_class])
            hit = self._matrices[key] = (rows, param, grad)
        return hit[0]

    def getitem(self, parent: list[Option], item: list[Option], idx: int):
        """0 where the parent option's ``idx``-th output is the item's option, else inf."""
        key = ("getitem", id(parent), id(item), idx)
        hit = self._matrices.get(key)
        if hit is None:
            rows = [[0.0 if po.output_specs[idx] == co.output_specs else math.inf for co in item] for po in parent]
            hit = self._matrices[key] = (rows, parent, item)
        return hit[0]

    def equal_placements(self, a: list[Option], b: list[Option]):
        """0 where both options' outputs have the same placements, else inf."""
        key = ("equal", id(a), id(b))
        hit = self._matrices.get(key)
        if hit is None:
            rows = [
                [0.0 if placements_of(x.output_specs) == placements_of(y.output_specs) else math.inf for y in b]
                for x in a
            ]
            hit = self._matrices[key] = (rows, a, b)
        return hit[0]


class _Progress:
    """INFO log of a long loop's progress, at most every ``every`` seconds."""

    def __init__(self, what: str, total: int, every: float = 5.0):
        self.what, self.total, self.every = what, total, every
        self.t0 = self.last = time.perf_counter()

    def tick(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            logger.info("%s: %d/%d after %.0fs", self.what, done, self.total, now - self.t0)


def _spec_classes(specs: list) -> tuple[list, list[int]]:
    """Distinct specs (by placements) and, per input spec, its class index."""
    index: dict = {}
    distinct: list = []
    classes: list[int] = []
    for spec in specs:
        cls = index.setdefault(spec.placements, len(index))
        if cls == len(distinct):
            distinct.append(spec)
        classes.append(cls)
    return distinct, classes



def _frozen_nodes(traced, strategies, constraints: Constraints, repeats) -> set[torch.fx.Node]:
    """Nodes whose Partial options pruning must keep: pinned to a set of
    placements that allows a Partial (a pin that allows none makes those
    options infeasible anyway)."""
    frozen: set[torch.fx.Node] = set()
    for node in strategies:
        pin = constraints.pins.get(node.name)
        if pin is not None and any(p.is_partial() for p in _flat_placements(pin[1])):
            frozen.add(node)
    return frozen


def _flat_placements(placements):
    for p in placements:
        if isinstance(p, (tuple, list)):
            yield from _flat_placements(p)
        else:
            yield p


def _with_compute_windows(traced, strategies, unary, redist_edges: list[RedistEdge]) -> list[RedistEdge]:
    """The overlap edges with the compute window of their parameter's
    block (:class:`cost_model.ComputeWindows`)."""
    from .tracing import module_path

    fqn_of = {p: fqn for fqn, p in traced.param_nodes.items()}
    for fqn, grad in traced.grad_nodes.items():  # gradient tails, as _grad_tail walks them
        node = grad
        while node is not None and node.op == "call_function":
            fqn_of.setdefault(node, fqn)
            if node.target not in _PASS_THROUGH_OPS:
                break
            node = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None

    def param_fqn(e: RedistEdge) -> str | None:
        node = e.producer if e.kind == cost_model.PARAM_ALL_GATHER else e.consumer
        while node not in fqn_of and node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
            node = node.args[0]  # the forward chain of layout/cast ops back to the parameter
        return fqn_of.get(node)

    windows = cost_model.ComputeWindows.of(
        strategies,
        traced.param_nodes,
        lambda n: min(unary[id(strategies[n].options)], default=0.0) if strategies[n].getitem_index is None else 0.0,
        module_path,
        lambda n: n.meta.get("partitioner_tag") == "is_backward",
    )
    if windows.forward:
        block = next(iter(windows.forward))
        logger.info(
            "overlap windows of %s: forward %.2f ms, backward %.2f ms, %.1f MB of parameters",
            block, windows.forward[block] * 1e3, windows.backward.get(block, 0.0) * 1e3, windows.param_bytes.get(block, 0) / 1e6,
        )
    fqns = {e: param_fqn(e) for e in redist_edges if e.kind is not None}
    edges_per: dict = {}
    for e, fqn in fqns.items():
        edges_per[(fqn, e.kind)] = edges_per.get((fqn, e.kind), 0) + 1
    return [
        replace(e, kind=windows.kind(e.kind, fqns[e], edges_per[(fqns[e], e.kind)]))
        if fqns.get(e) is not None
        else e
        for e in redist_edges
    ]


def build_problem(
    traced: TracedStep,
    strategies: dict[torch.fx.Node, NodeStrategy],
    mesh: DeviceMesh,
    constraints: Constraints,
    *,
    device: cost_model.DeviceSpec,
    overlap: cost_model.CommOverlapPolicy,
    repeats: RepeatedLayers | None = None,
) -> BuiltProblem:
    t0 = time.perf_counter()
    param_chain = _forward_param_chain(traced)
    grad_tail = _grad_tail(traced)
    unreducible = _unreducible_grad_nodes(traced, constraints.reduce_dtype)
    matrices = _EdgeMatrices(device, overlap)
    redist_edges = []
    for node, strat in strategies.items():
        if strat.getitem_index is not None:
            continue
        for k, producer in enumerate(strat.inputs):
            kind = None
            if producer in param_chain and node.meta.get("partitioner_tag") != "is_backward":
                kind = cost_model.PARAM_ALL_GATHER
            elif node in grad_tail:
                kind = cost_model.GRAD_REDUCE_SCATTER
            redist_edges.append(RedistEdge(producer, node, k, kind, producer in unreducible))

    # id(option list) -> compute costs. Structurally identical nodes
    # (repeated layers, forward and backward) share one option list object
    # (same op, arguments, shapes and input candidates), so their costs are
    # computed once and their decisions share the lists.
    unary: dict[int, list[float]] = {}
    for node, strat in strategies.items():
        if id(strat.options) not in unary:
            unary[id(strat.options)] = [
                cost_model.node_compute_time(node, o.input_specs, o.output_specs, device)
                + _in_op_time(o.in_op, mesh, device)
                if node.op == "call_function" and strat.getitem_index is None
                else 0.0
                for o in strat.options
            ]

    if overlap.enabled and overlap.compute_windows:
        redist_edges = _with_compute_windows(traced, strategies, unary, redist_edges)

    size = size_unpruned = estimate_problem_size(traced, strategies)
    logger.info("problem size before pruning: %s", size.describe())
    pruning = None
    if constraints.prune_options and cost_model_allows_pruning(device):
        frozen = _frozen_nodes(traced, strategies, constraints, repeats)
        linked = list(repeats.reference.items()) if repeats is not None else []
        strategies, pruning = prune_partials(strategies, unary, frozen, mesh.ndim, linked)
        size = estimate_problem_size(traced, strategies)
        logger.info("problem size after pruning: %s", size.describe())
    check_problem_size(size, mesh, constraints.max_problem_bytes)
    nodes = list(strategies)
    decisions: list[solver.Decision] = []
    compute: dict[str, list[float]] = {}
    labels_cache: dict[int, list[str]] = {}
    for node in nodes:
        strat = strategies[node]
        key = id(strat.options)
        labels = labels_cache.get(key)
        if labels is None:
            labels = labels_cache[key] = [o.label for o in strat.options]
        compute[node.name] = unary[key]
        decisions.append(solver.Decision(node.name, labels, unary[key]))

    edges: list[solver.Edge] = []
    progress = _Progress("costing edges", size.edges)
    by_consumer: dict[torch.fx.Node, list] = {}
    for e in redist_edges:
        by_consumer.setdefault(e.consumer, []).append(e)
    for node in nodes:
        strat = strategies[node]
        progress.tick(len(edges))
        if strat.getitem_index is not None:
            parent = strat.inputs[0]
            matrix = matrices.getitem(strategies[parent].options, strat.options, strat.getitem_index)
            edges.append(solver.Edge(parent.name, node.name, 0, matrix))
            continue
        for e in by_consumer.get(node, ()):
            matrix = matrices.redistribution(
                strategies[e.producer].options, strat.options, e.arg, e.kind, keep_partial=e.keep_partial
            )
            edges.append(solver.Edge(e.producer.name, node.name, e.arg, matrix))

    # A gradient is laid out like its parameter (or redistributed to a
    # tp-outer one); a tangent like its output.
    for fqn, grad in traced.grad_nodes.items():
        param = traced.param_nodes.get(fqn)
        if grad is None or param is None or grad not in strategies:
            continue
        matrix = matrices.gradient(strategies[param].options, strategies[grad].options, cost_model.GRAD_REDUCE_SCATTER)
        edges.append(solver.Edge(param.name, grad.name, -1, matrix))
    for out_idx, tangent in traced.tangent_nodes.items():
        out = traced.output_nodes[out_idx]
        if out in strategies and tangent in strategies:
            matrix = matrices.equal_placements(strategies[out].options, strategies[tangent].options)
            edges.append(solver.Edge(out.name, tangent.name, -1, matrix))

    # the step plans per placement pair are only needed while costing
    # (millions of entries on a 4-D mesh)
    clear_edge_cost_caches()
    matrices.drop_pair_cache()

    pins = []
    for name, (cname, placements) in constraints.pins.items():
        node = next(n for n in nodes if n.name == name)
        allowed = [
            i
            for i, o in enumerate(strategies[node].options)
            if placements_of(o.output_specs) == tuple(placements)
        ]
        pins.append(solver.Pin(cname, name, allowed))

    resources = [_memory_constraint(traced, strategies, mesh, constraints)]

    links = []
    if repeats is not None:
        for node, ref in repeats.reference.items():
            if node in strategies and ref in strategies:
                mapping = _option_mapping(strategies[ref].options, strategies[node].options)
                name = _layer_name(node) or repeats.layer_name(node)
                links.append(solver.Link(f"repeated layer {name}", ref.name, node.name, mapping))

    problem = solver.Problem(
        decisions=decisions,
        edges=edges,
        pins=pins,
        links=links,
        resources=resources,
        name="autoparallel",
        metadata={"mesh_shape": list(mesh.shape), "device": device.name},
    )
    seconds = time.perf_counter() - t0
    logger.info(
        "built problem: %d decisions, %d edges, %d links in %.2fs",
        len(decisions),
        len(edges),
        len(links),
        seconds,
    )
    return BuiltProblem(problem, nodes, strategies, compute, seconds, size, pruning, size_unpruned)


def _layer_name(node: torch.fx.Node) -> str | None:
    from .tracing import module_path

    return module_path(node)


def _option_mapping(ref: list[Option], other: list[Option]) -> list[int | None]:
    if ref is other:
        return list(range(len(ref)))
    index = {(placements_of(o.output_specs), placements_of(o.input_specs)): j for j, o in enumerate(other)}
    return [index.get((placements_of(o.output_specs), placements_of(o.input_specs))) for o in ref]


def _memory_constraint(traced, strategies, mesh, constraints: Constraints) -> solver.ResourceConstraint:
    terms: dict[str, list[float]] = {}
    total = 0.0
    smallest = 0.0
    for fqn, node in traced.param_nodes.items():
        val = node.meta["val"]
        itemsize = val.element_size()
        weights = [
            float(local_numel(val.shape, o.output_spec.placements, mesh) * itemsize)
            for o in strategies[node].options
        ]
        terms[node.name] = weights
        total += float(val.numel() * itemsize)
        smallest += min(weights)
    high = smallest if constraints.memory_high is None else constraints.memory_high * total
    low = None if constraints.memory_low is None else constraints.memory_low * total
    # Bytes are exact integers; a relative slack keeps float round-off from
    # turning "exactly fully sharded" into infeasible.
    return solver.ResourceConstraint(
        "parameter memory budget",
        terms,
        low=None if low is None else low * (1 - 1e-9),
        high=high * (1 + 1e-9),
    )


def _in_op_time(work, mesh, device) -> float:
    """Seconds of an option's in-op work (:class:`strategies.InOpWork`)."""
    if work is None:
        return 0.0
    t = cost_model.compute_time(work.flops, 0.0, work.dtype, device) if work.flops else 0.0
    topo = cost_model.mesh_dim_topology(mesh)
    for kind, nbytes, m in work.collectives:
        tp = topo[m]
        t += cost_model.collective_time(kind, nbytes, tp.group_size, tp.intra_node, device, tp.ranks_per_node)
    return t
