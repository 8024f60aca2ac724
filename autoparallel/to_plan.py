"""From a solved problem to the :class:`~autoparallel.plan.Plan`, and the
solver dumps.

* :func:`make_plan`: per node, the chosen option's placements, its
  compute and the communication on its incoming edges, the runner-up
  options (:func:`runner_ups`), the parameter bytes per rank;
* :func:`write_dumps`: problem.json, solution.json and plan.json for
  ``python -m solver`` and for debugging a plan (``AUTOPARALLEL_DUMP_DIR``).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

import solver

from . import cost_model
from .capture.tracing import TracedStep, module_path
from .options.strategies import format_specs
from .plan import NodePlan, Plan
from .problem.builder import BuiltProblem
from .torch_compat import current_ranks

__all__ = ["make_plan", "runner_ups", "write_dumps"]


# set to 1 to gzip the dumps (problem.json.gz, ...)
DUMP_GZIP_ENV = "AUTOPARALLEL_DUMP_GZIP"


def write_dumps(
    directory: str,
    mesh: DeviceMesh,
    built: BuiltProblem,
    solution: solver.Solution | None,
    plan: Plan | None,
    status: str | None = None,
    *,
    gzip: bool | None = None,
) -> float | None:
    """Write problem.json (each distinct cost table once: repeated layers
    cost one layer), solution.json and plan.json to ``directory``, from
    rank 0 of the mesh only, each replaced atomically; ``gzip``: as .json.gz
    (None: when the environment sets ``AUTOPARALLEL_DUMP_GZIP`` to other than 0).
    A failed solve writes the problem with ``status`` saying why and removes
    the previous run's solution and plan, which would no longer match.
    Returns the seconds it took (None on the other ranks, which write nothing)."""
    if gzip is None:
        gzip = os.environ.get(DUMP_GZIP_ENV, "") not in ("", "0")
    from solver import serialize

    with unset_fake_temporarily():  # the mesh tensor, outside tracing's fake mode
        first = int(mesh.mesh.flatten()[0])
    if first not in current_ranks():
        return None  # one writer: rank 0 of the mesh
    t0 = time.perf_counter()
    os.makedirs(directory, exist_ok=True)
    gz = ".gz" if gzip else ""
    extra = {"status": status or (solution.status if solution is not None else "not solved")}
    serialize.dump(built.problem, os.path.join(directory, "problem.json" + gz), shared=True, extra=extra)
    for name, obj in (("solution.json", solution), ("plan.json", plan)):
        path = os.path.join(directory, name + gz)
        if obj is None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        elif name == "solution.json":
            serialize.dump(obj, path)
        else:
            obj.dump_json(path, indent=None)
    return time.perf_counter() - t0


def runner_ups(built: BuiltProblem, choice: dict[str, int], nodes: dict[str, NodePlan], k: int = 3) -> None:
    """Per node, the ``k`` cheapest other options and how much more the
    step would cost with each, the rest of the plan held fixed (its
    compute plus the redistributions on its edges; for ``plan.explain``)."""
    edges_of: dict[str, list] = {}
    for e in built.problem.edges:
        edges_of.setdefault(e.consumer, []).append(e)
        edges_of.setdefault(e.producer, []).append(e)
    for node in built.nodes:
        name = node.name
        compute = built.compute[name]
        total = list(compute)
        for e in edges_of.get(name, ()):
            if e.consumer == name:
                row = e.costs[choice[e.producer]]
                total = [t + row[o] for o, t in enumerate(total)]
            else:
                total = [t + e.costs[o][choice[e.consumer]] for o, t in enumerate(total)]
        mine = total[choice[name]]
        others = sorted((t - mine, o) for o, t in enumerate(total) if o != choice[name] and t != float("inf"))[:k]
        opts = built.strategies[node].options
        nodes[name].runner_ups = [
            (
                f"{','.join(format_specs(s) for s in opts[o].input_specs)} -> {format_specs(opts[o].output_specs)}",
                delta,
            )
            for delta, o in others
        ]


def make_plan(
    built: BuiltProblem,
    solution: solver.Solution,
    traced: TracedStep,
    mesh: DeviceMesh,
    *,
    constraints: dict[str, Any],
    timings: dict[str, float],
    provenance: dict[str, Any],
) -> Plan:
    """The plan of ``solution`` to ``built`` (``constraints``: the
    constraint log; ``provenance``: what the plan was made for)."""
    choice = solution.choice
    incoming: dict[str, list] = {}
    comm: dict[str, float] = {}
    tiebreak: dict[str, float] = {}
    for e in built.problem.edges:
        # (arg_index < 0: structural pairs; they cost 0 except a tp-outer
        # parameter's gradient redistribution, counted on the gradient)
        c = e.costs[choice[e.producer]][choice[e.consumer]]
        if c > 0:
            comm[e.consumer] = comm.get(e.consumer, 0.0) + c
            if c <= cost_model.TRANSITION_TIEBREAK:
                tiebreak[e.consumer] = tiebreak.get(e.consumer, 0.0) + c
            incoming.setdefault(e.consumer, []).append((e.producer, c))
    nodes: dict[str, NodePlan] = {}
    by_name = {n.name: n for n in built.nodes}
    param_fqn = {n: fqn for fqn, n in traced.param_nodes.items()}
    for node in built.nodes:
        strat = built.strategies[node]
        opt = strat.options[choice[node.name]]
        val = node.meta.get("val")
        nodes[node.name] = NodePlan(
            name=node.name,
            op=str(node.target),
            module_path=module_path(node) or param_fqn.get(node),
            phase="backward" if node.meta.get("partitioner_tag") == "is_backward" else "forward",
            shape=list(val.shape) if isinstance(val, torch.Tensor) else None,
            dtype=str(val.dtype).replace("torch.", "") if isinstance(val, torch.Tensor) else None,
            input_placements=[format_specs(s) for s in opt.input_specs],
            output_placements=format_specs(opt.output_specs),
            num_options=len(strat.options),
            compute_cost=built.compute[node.name][choice[node.name]],
            comm_cost=comm.get(node.name, 0.0),
            transition_cost=tiebreak.get(node.name, 0.0),
            option=choice[node.name],
            is_parameter=node in param_fqn,
            recompute=getattr(node.meta.get("recompute"), "name", None),
        )
    for consumer, items in incoming.items():
        nodes[consumer].incoming = [(p, nodes[p].output_placements, c) for p, c in items]
    runner_ups(built, choice, nodes)
    per_rank = total = 0.0
    for term_name, weights in built.problem.resources[0].terms.items():
        per_rank += weights[choice[term_name]]
        val = by_name[term_name].meta["val"]
        total += val.numel() * val.element_size()
    return Plan(
        mesh_shape=list(mesh.shape),
        mesh_dim_names=list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        nodes=nodes,
        solution=solution,
        constraints=constraints,
        timings=timings,
        parameter_bytes_per_rank=per_rank,
        parameter_bytes_total=total,
        provenance=provenance,
    )
