"""Stage 3: turn node options + the cost model + user constraints into a
torch-free :class:`solver.Problem`.

* one decision per node (named after the FX node), one option per
  :class:`~autoparallel.options.strategies.Option`, unary cost = compute time
  (twice for a forward op the backward recomputes under activation
  checkpointing, :mod:`.recompute`);
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
:mod:`autoparallel.cost_model.class_costs` (equal to ``redistribute_time``, fast on 3-D
and 4-D meshes). Before any pair matrix exists, Partial options that cannot help are dropped
(:mod:`autoparallel.options.pruning`, exact) and the problem's size is
estimated (:func:`estimate_problem_size`); over ``max_problem_bytes`` the
build stops with :class:`ProblemTooLarge` instead of exhausting memory.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec

import solver

from .. import cost_model
from ..cost_model.compute import spec_sig  # the cost model's view of a spec, for deduplicating
from .edge_matrices import EdgeMatrices
from .recompute import recomputed_forward_nodes
from ..options.pruning import PruneStats, prune_partials
from .constraints import Constraints
from .param_budget import option_mapping, parameter_memory_row
from .size import (  # noqa: F401  (the size guard, re-exported)
    DEFAULT_MAX_PROBLEM_BYTES,
    ProblemSize,
    ProblemTooLarge,
    check_lazy_size,
    check_problem_size,
    estimate_problem_size,
)
from ..options.pruning import copy_cheaper_than_collectives as cost_model_allows_pruning
from ..options.placements import SpecLabels
from ..capture.repeated_layers import RepeatedLayers
from ..options.strategies import NodeStrategy, Option, placements_of
from ..capture.tracing import TracedStep

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
    # edges hold lazy matrices (autoparallel.problem.edge_matrices): solve with
    # autoparallel.problem.pricing, not solver.solve
    lazy: bool = False
    # a dense rebuild over the options pricing kept: the lazy problem's size
    # (``size_unpruned`` and ``pruning`` are the lazy problem's too)
    priced_size: ProblemSize | None = None


# tests patch the class under its old name
_EdgeMatrices = EdgeMatrices


def forward_param_chain(traced: TracedStep) -> set[torch.fx.Node]:
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
    return {n for n in grad_only if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype != reduce_dtype}


@dataclass(frozen=True)
class RedistEdge:
    """An edge costed by redistribution."""

    producer: torch.fx.Node
    consumer: torch.fx.Node
    arg: int
    kind: str | cost_model.HiddenComm | None
    keep_partial: bool
    copies: float = 1.0  # the share of its local copies counted (shared by the producer's readers)


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


def _frozen_nodes(traced, strategies, constraints: Constraints, repeats) -> set[torch.fx.Node]:
    """Nodes whose Partial options pruning must keep: pinned to a set of
    placements that allows a Partial (a pin that allows none makes those
    options infeasible anyway)."""
    frozen: set[torch.fx.Node] = set()
    for node in strategies:
        pin = constraints.pins.get(node.name)
        if pin is not None and any(p.is_partial() for p in _flat_placements(pin[1])):
            frozen.add(node)
        if any(r.output == "P" for r in constraints.option_rules.get(node.name, ())):
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
    from ..capture.tracing import module_path

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
        while (
            node not in fqn_of and node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node)
        ):
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
            block,
            windows.forward[block] * 1e3,
            windows.backward.get(block, 0.0) * 1e3,
            windows.param_bytes.get(block, 0) / 1e6,
        )
    fqns = {e: param_fqn(e) for e in redist_edges if e.kind is not None}
    edges_per: dict = {}
    for e, fqn in fqns.items():
        edges_per[(fqn, e.kind)] = edges_per.get((fqn, e.kind), 0) + 1
    return [
        replace(e, kind=windows.kind(e.kind, fqns[e], edges_per[(fqns[e], e.kind)])) if fqns.get(e) is not None else e
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
    redist_edges = _redistribution_edges(traced, strategies, constraints, overlap)
    unary = _unary_costs(strategies, mesh, device)
    if overlap.enabled and overlap.compute_windows:
        redist_edges = _with_compute_windows(traced, strategies, unary, redist_edges)

    strategies, size, size_unpruned, pruning = _pruned(traced, strategies, unary, mesh, constraints, device, repeats)
    lazy = _use_lazy_matrices(size, mesh, constraints)
    matrices = EdgeMatrices(device, overlap, lazy=lazy)
    nodes = list(strategies)
    decisions, compute = _decisions(nodes, strategies, unary, recomputed_forward_nodes(traced.gm))
    edges = _edges(nodes, strategies, redist_edges, matrices, size)
    edges += _structural_edges(traced, strategies, matrices)
    if not lazy:
        # the step plans per placement pair are only needed while costing
        # (millions of entries on a 4-D mesh); lazy matrices cost while the
        # solver prices (autoparallel.problem.pricing clears them after)
        cost_model.clear_caches()
        matrices.drop_pair_cache()

    pins = _pins(nodes, strategies, constraints)
    resources = [parameter_memory_row(traced, strategies, mesh, constraints, repeats)]
    links = _links(strategies, repeats)
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
    return BuiltProblem(problem, nodes, strategies, compute, seconds, size, pruning, size_unpruned, lazy)


def _redistribution_edges(
    traced: TracedStep, strategies, constraints: Constraints, overlap: cost_model.CommOverlapPolicy
) -> list[RedistEdge]:
    """One edge per (producer, consumer, argument), tagged with the overlap
    kind of communication it may hide (a parameter's all-gather in forward, a
    gradient's reduction in backward; under the per-link policy also a
    backward op's gather of a parameter and its read of an activation)."""
    by_phase = cost_model.per_link(overlap)
    param_chain = forward_param_chain(traced)
    grad_tail = _grad_tail(traced)
    unreducible = _unreducible_grad_nodes(traced, constraints.reduce_dtype)
    redist_edges = []
    for node, strat in strategies.items():
        if strat.getitem_index is not None:
            continue
        for k, producer in enumerate(strat.inputs):
            kind = None
            backward = node.meta.get("partitioner_tag") == "is_backward"
            if producer in param_chain:
                # a backward op reading a parameter (a matmul's input
                # gradient reads the weight; a custom op's backward takes
                # the weights) gathers it from the shard: prefetched under
                # the backward's compute
                kind = cost_model.PARAM_BACKWARD_GATHER if backward and by_phase else cost_model.PARAM_ALL_GATHER
            elif node in grad_tail:
                kind = cost_model.GRAD_REDUCE_SCATTER
            elif backward and by_phase:
                kind = cost_model.BACKWARD_ACTIVATION
            redist_edges.append(RedistEdge(producer, node, k, kind, producer in unreducible))
    return _with_copy_shares(redist_edges)


def _with_copy_shares(redist_edges: list[RedistEdge]) -> list[RedistEdge]:
    """Each edge counts ``1/k`` of its local copies, ``k`` the number of
    edges out of its producer: apply makes a value's redistribution to one
    layout once for all its readers (:func:`cost_model.copies_device`)."""
    readers: dict[torch.fx.Node, int] = {}
    for e in redist_edges:
        readers[e.producer] = readers.get(e.producer, 0) + 1
    return [e if readers[e.producer] == 1 else replace(e, copies=1.0 / readers[e.producer]) for e in redist_edges]


def _unary_costs(strategies, mesh: DeviceMesh, device) -> dict[int, list[float]]:
    """id(option list) -> compute costs. Structurally identical nodes
    (repeated layers, forward and backward) share one option list object
    (same op, arguments, shapes and input candidates), so their costs are
    computed once and their decisions share the lists."""
    unary: dict[int, list[float]] = {}
    shapes = _LocalShapeCodes()
    for node, strat in strategies.items():
        if id(strat.options) not in unary:
            if node.op == "call_function" and strat.getitem_index is None:
                unary[id(strat.options)] = _compute_costs(node, strat.options, shapes, mesh, device)
            else:
                unary[id(strat.options)] = [0.0] * len(strat.options)
    return unary


def _pruned(traced, strategies, unary, mesh: DeviceMesh, constraints: Constraints, device, repeats):
    """``(strategies, size, size_unpruned, pruning)``: the strategies without
    the Partial options that cannot help (when the constraints and the cost
    model allow pruning), and the problem's estimated size before and after."""
    size = size_unpruned = estimate_problem_size(traced, strategies)
    logger.info("problem size before pruning: %s", size.describe())
    pruning = None
    if constraints.prune_options and cost_model_allows_pruning(device):
        frozen = _frozen_nodes(traced, strategies, constraints, repeats)
        linked = list(repeats.reference.items()) if repeats is not None else []
        strategies, pruning = prune_partials(strategies, unary, frozen, mesh.ndim, linked)
        size = estimate_problem_size(traced, strategies)
        logger.info("problem size after pruning: %s", size.describe())
    return strategies, size, size_unpruned, pruning


def _use_lazy_matrices(size: ProblemSize, mesh: DeviceMesh, constraints: Constraints) -> bool:
    """Whether to build lazy edge matrices (solved by option pricing): as the
    constraints say, or when the dense problem would exceed
    ``max_problem_bytes``. Raises :class:`ProblemTooLarge` when even the
    chosen form is over the limit."""
    lazy = constraints.option_pricing
    if lazy is None:
        lazy = constraints.max_problem_bytes is not None and size.estimated_bytes > constraints.max_problem_bytes
        if lazy:
            logger.info(
                "dense problem estimated at %.2f GB, over max_problem_bytes (%.2f GB): lazy edge matrices and option pricing",
                size.estimated_bytes / 1e9,
                constraints.max_problem_bytes / 1e9,
            )
    if lazy:
        check_lazy_size(size, mesh, constraints.max_problem_bytes)
    else:
        check_problem_size(size, mesh, constraints.max_problem_bytes)
    return lazy


def _decisions(nodes, strategies, unary, recomputed) -> tuple[list[solver.Decision], dict[str, list[float]]]:
    """One decision per node, its options labelled by placement, and each
    node's per-option compute seconds: twice for the forward ops in
    ``recomputed``, which the backward runs again (activation checkpointing)."""
    decisions: list[solver.Decision] = []
    compute: dict[str, list[float]] = {}
    labels_cache: dict[int, list[str]] = {}
    twice: dict[int, list[float]] = {}
    label = SpecLabels().option
    for node in nodes:
        strat = strategies[node]
        key = id(strat.options)
        labels = labels_cache.get(key)
        if labels is None:
            labels = labels_cache[key] = [label(o) for o in strat.options]
        costs = unary[key]
        if node in recomputed and any(costs):  # free ops keep the shared list
            costs = twice.get(key)
            if costs is None:
                costs = twice[key] = [2 * c for c in unary[key]]
        compute[node.name] = costs
        decisions.append(solver.Decision(node.name, labels, costs))
    return decisions, compute


def _edges(nodes, strategies, redist_edges: list[RedistEdge], matrices: EdgeMatrices, size) -> list[solver.Edge]:
    """The data-flow edges, consumer by consumer: a getitem's choice of its
    parent's output, and each redistribution's cost matrix."""
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
                strategies[e.producer].options,
                strat.options,
                e.arg,
                e.kind,
                keep_partial=e.keep_partial,
                copies=e.copies,
            )
            edges.append(solver.Edge(e.producer.name, node.name, e.arg, matrix))
    return edges


def _structural_edges(traced: TracedStep, strategies, matrices: EdgeMatrices) -> list[solver.Edge]:
    """A gradient is laid out like its parameter (or redistributed to a
    tp-outer one); a tangent like its output."""
    edges: list[solver.Edge] = []
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
    return edges


def _pins(nodes, strategies, constraints: Constraints) -> list[solver.Pin]:
    """The user's placement constraints and the mesh-dim option rules, as
    named pins to the options they allow."""
    pins = []
    for name, (cname, placements) in constraints.pins.items():
        node = next(n for n in nodes if n.name == name)
        allowed = [
            i for i, o in enumerate(strategies[node].options) if placements_of(o.output_specs) == tuple(placements)
        ]
        pins.append(solver.Pin(cname, name, allowed))
    by_name = {n.name: n for n in nodes}
    for name, rules in constraints.option_rules.items():
        node = by_name.get(name)
        if node is None:
            continue
        for rule in rules:
            allowed = [i for i, o in enumerate(strategies[node].options) if rule.allows(o)]
            pins.append(solver.Pin(rule.name, name, allowed))
    return pins


def _links(strategies, repeats: RepeatedLayers | None) -> list[solver.Link]:
    """Each node of a repeated layer linked to its node in the reference
    layer, option to option."""
    links = []
    if repeats is None:
        return links
    # per (reference list, repeat list), by identity: layers 2..N share
    # their lists, so each distinct pair is mapped once, not per layer
    # (the solver only reads the mappings)
    mappings: dict[tuple[int, int], list[int | None]] = {}
    for node, ref in repeats.reference.items():
        if node in strategies and ref in strategies:
            ref_options, options = strategies[ref].options, strategies[node].options
            mapping = mappings.get((id(ref_options), id(options)))
            if mapping is None:
                mapping = mappings[(id(ref_options), id(options))] = option_mapping(ref_options, options)
            name = _layer_name(node) or repeats.layer_name(node)
            links.append(solver.Link(f"repeated layer {name}", ref.name, node.name, mapping))
    return links


def _layer_name(node: torch.fx.Node) -> str | None:
    from ..capture.tracing import module_path

    return module_path(node)


class _LocalShapeCodes:
    """A small int per distinct local shape and dtype of a spec (what the
    cost model's compute time reads of it), memoised per spec object (specs
    are pooled: a few thousand serve all options, and stay alive while the
    option lists do)."""

    def __init__(self):
        self._codes: dict = {}  # local shape signature -> int
        self._by_spec: dict[int, int] = {}  # id(spec) -> int
        self.known = self._by_spec.get  # id(spec) -> its code, or None before of(spec)

    def of(self, spec) -> int | tuple | None:
        if isinstance(spec, DTensorSpec):
            code = self._by_spec.get(id(spec))
            if code is None:
                # the cost model reads a spec through its local shape and
                # dtype (spec_sig), or without a tensor meta its placements
                # (the shape then comes from the node, the same per list)
                sig = spec_sig(spec) if spec.tensor_meta is not None else ("placements", spec.placements)
                code = self._by_spec[id(spec)] = self._codes.setdefault(sig, len(self._codes))
            return code
        if isinstance(spec, (tuple, list)):
            return tuple(self.of(s) for s in spec)
        return None


def _compute_costs(node: torch.fx.Node, options: list[Option], shapes: _LocalShapeCodes, mesh, device) -> list[float]:
    """Per option, the node's compute seconds plus its in-op work. Options
    whose specs have the same local shapes cost the same: the cost model is
    asked once per distinct local shapes (a 4-D mesh's ~2K options of a
    pointwise op have a few dozen)."""
    by_shapes: dict = {}
    of, known = shapes.of, shapes.known
    costs = []
    for o in options:
        # memo hits inlined: a call per spec of 332K options costs seconds
        out = known(id(o.output_specs))
        ins = tuple([known(id(s)) for s in o.input_specs])
        if out is None or None in ins:
            out, ins = of(o.output_specs), tuple([of(s) for s in o.input_specs])
        key = (out, ins)
        t = by_shapes.get(key)
        if t is None:
            t = by_shapes[key] = cost_model.node_compute_time(node, o.input_specs, o.output_specs, device)
        costs.append(t + _in_op_time(o.in_op, mesh, device) if o.in_op is not None else t)
    return costs


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
