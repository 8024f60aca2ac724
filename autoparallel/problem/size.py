"""The problem-size guard: count decisions, options and option pairs of the
ILP :func:`~autoparallel.problem.builder.build_problem` would build, before
any cost matrix exists, estimate the pipeline's peak memory from them, and
stop with :class:`ProblemTooLarge` (naming the biggest matrices, the op kinds
holding the pairs and what to change) instead of exhausting memory."""

from __future__ import annotations

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh

from ..errors import ProblemTooLarge
from ..options.strategies import NodeStrategy
from ..capture.tracing import TracedStep
from .size_figures import (  # noqa: F401 - re-exported: the size guard's figures
    BYTES_PER_DECISION_OPTION,
    BYTES_PER_DISTINCT_PAIR,
    BYTES_PER_LAZY_LINE,
    BYTES_PER_OPTION,
    BYTES_PER_PAIR,
    DEFAULT_MAX_PROBLEM_BYTES,
    ProblemSize,
)


def _edge_endpoints(traced: TracedStep, strategies: dict[torch.fx.Node, NodeStrategy]):
    """(producer, consumer, key of its shared matrix) of every edge
    :func:`build_problem` will create, in its order."""
    for node, strat in strategies.items():
        if strat.getitem_index is not None:
            parent = strat.inputs[0]
            yield parent, node, ("getitem", id(strategies[parent].options), id(strat.options))
            continue
        for k, producer in enumerate(strat.inputs):
            yield producer, node, (id(strategies[producer].options), id(strat.options), k)
    for fqn, grad in traced.grad_nodes.items():
        param = traced.param_nodes.get(fqn)
        if grad is not None and param is not None and grad in strategies:
            yield param, grad, ("gradient", id(strategies[param].options), id(strategies[grad].options))
    for out_idx, tangent in traced.tangent_nodes.items():
        out = traced.output_nodes[out_idx]
        if out in strategies and tangent in strategies:
            yield out, tangent, ("equal", id(strategies[out].options), id(strategies[tangent].options))


def estimate_problem_size(traced: TracedStep, strategies: dict[torch.fx.Node, NodeStrategy]) -> ProblemSize:
    """Count decisions, options and option pairs without building a matrix,
    and estimate the pipeline's peak memory from them (cheap: one pass over
    the edges, no cost evaluated)."""
    pairs = 0
    edges = 0
    lines = 0
    distinct: dict[tuple, tuple[int, str, str]] = {}
    # op -> [nodes, options, pairs into its nodes]
    per_op: dict[str, list[int]] = {}
    for node, strat in strategies.items():
        counts = per_op.setdefault(_op_kind(node), [0, 0, 0])
        counts[0] += 1
        counts[1] += len(strat.options)
    for producer, consumer, key in _edge_endpoints(traced, strategies):
        n = len(strategies[producer].options) * len(strategies[consumer].options)
        pairs += n
        edges += 1
        if key not in distinct:
            distinct[key] = (n, producer.name, consumer.name)
            lines += len(strategies[producer].options) + len(strategies[consumer].options)
        per_op[_op_kind(consumer)][2] += n
    distinct_pairs = sum(v[0] for v in distinct.values())
    largest = sorted(distinct.values(), reverse=True)[:3]
    by_op = sorted(((op, *c) for op, c in per_op.items()), key=lambda t: (-t[3], -t[2], t[0]))[:5]
    return ProblemSize(
        decisions=len(strategies),
        options=sum(len(s.options) for s in strategies.values()),
        edges=edges,
        pairs=pairs,
        distinct_pairs=distinct_pairs,
        estimated_bytes=float(BYTES_PER_DISTINCT_PAIR * distinct_pairs + BYTES_PER_PAIR * pairs),
        distinct_lines=lines,
        distinct_options=sum({id(s.options): len(s.options) for s in strategies.values()}.values()),
        largest=largest,
        by_op=by_op,
    )


def _op_kind(node: torch.fx.Node) -> str:
    """``aten.mul.Tensor``, ``getitem``, ``placeholder``: what a node's
    options come from."""
    if node.op != "call_function":
        return node.op
    if isinstance(node.target, torch._ops.OpOverload):
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def check_problem_size(size: ProblemSize, mesh: DeviceMesh, limit: float | None) -> None:
    """Raise :class:`ProblemTooLarge` when ``size`` exceeds ``limit`` bytes."""
    if limit is None or size.estimated_bytes <= limit:
        return
    biggest = "; ".join(f"{p} x {c}: {n:,} pairs" for n, p, c in size.largest)
    ops = "; ".join(
        f"{op}: {nodes} nodes, {options:,} options, {pairs:,} pairs into them"
        for op, nodes, options, pairs in size.by_op
    )
    raise ProblemTooLarge(
        f"planning problem too large to build: {size.describe()}, over the limit of "
        f"{limit / 1e9:.2f} GB (max_problem_bytes). Why: on a {mesh.ndim}-D mesh "
        f"{tuple(mesh.shape)} each node's options are the product of its per-mesh-dim "
        f"placements and every edge holds options x options costs; largest edge matrices: "
        f"{biggest}; op kinds with the most pairs: {ops}. To change: plan on fewer mesh dims (flatten data-parallel dims into one, "
        f"e.g. mesh._flatten, and plan 2-D), pin layouts (add_input_constraints, "
        f"add_node_constraint, add_parameter_memory_constraint), use a coarser option set "
        f"(fewer layers: repeated layers share matrices), or raise max_problem_bytes "
        f"(AutoParallel(..., max_problem_bytes=...)) if this machine has the memory.",
        size,
    )


def check_lazy_size(size: ProblemSize, mesh: DeviceMesh, limit: float | None) -> None:
    """Raise :class:`ProblemTooLarge` when even lazy matrices and option
    pricing (whose memory grows with options, not option pairs) would
    exceed ``limit`` bytes."""
    if limit is None or size.lazy_bytes <= limit:
        return
    raise ProblemTooLarge(
        f"planning problem too large even with lazy edge matrices: {size.decisions} decisions, "
        f"{size.options:,} options ({size.distinct_options:,} in distinct option lists), "
        f"{size.distinct_lines:,} rows and columns of distinct edge "
        f"matrices, estimated {size.lazy_bytes / 1e9:.2f} GB, over the limit of "
        f"{limit / 1e9:.2f} GB (max_problem_bytes). Why: on a {mesh.ndim}-D mesh "
        f"{tuple(mesh.shape)} each node's options are the product of its per-mesh-dim placements. "
        f"To change: plan on fewer mesh dims (flatten data-parallel dims into one), pin layouts "
        f"(add_input_constraints, add_node_constraint), or raise max_problem_bytes.",
        size,
    )
