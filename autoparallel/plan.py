"""Stage 4: the solver's answer as a placement plan users can read and diff.

A :class:`Plan` holds, per graph node, the chosen input and output
placements and what they cost; :meth:`Plan.explain` tells why a node looks
the way it does, :func:`diff` compares two plans, and :meth:`Plan.to_json`
is the solver debug dump (per node: name, op, module path, phase, shape,
dtype, placements, number of options, costs).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import solver

from .passes import stats_to_json


PLAN_SCHEMA = "autoparallel.plan/1"


@dataclass
class NodePlan:
    name: str
    op: str
    module_path: str | None
    phase: str  # "forward" | "backward"
    shape: list[int] | None
    dtype: str | None
    input_placements: list[str]
    output_placements: str
    num_options: int
    compute_cost: float
    comm_cost: float  # incoming redistributions, seconds
    transition_cost: float  # tie-break part of comm_cost
    option: int = 0
    is_parameter: bool = False
    # Activation checkpointing tag ("MUST_SAVE" / "PREFER_RECOMPUTE"), if any.
    recompute: str | None = None
    # (producer name, producer placement, seconds) for non-free transitions
    incoming: list[tuple[str, str, float]] = field(default_factory=list)


@dataclass
class PlacementKind:
    """Nodes of one kind (see :meth:`Plan.placements_by_kind`) and how many
    of them took each placement (``inputs -> output`` for ops)."""

    role: str  # "parameter" | "forward" | "backward"
    module_path: str  # layer indices folded to "*"
    op: str  # "" for parameters
    placements: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        what = self.module_path + (f" {self.op.removeprefix('aten.').removesuffix('.default')}" if self.op else "")
        chosen = "; ".join(f"{p}" + (f" (x{c})" if c > 1 else "") for p, c in self.placements.items())
        return f"{self.role:9s} {what}: {chosen}"


@dataclass
class Plan:
    mesh_shape: list[int]
    mesh_dim_names: list[str] | None
    nodes: dict[str, NodePlan]
    solution: solver.Solution
    # name -> what the user asked for, for the dump
    constraints: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    parameter_bytes_per_rank: float = 0.0
    parameter_bytes_total: float = 0.0
    # Rewrite passes run by apply_placement: name -> stats (see autoparallel.passes).
    pass_stats: dict[str, Any] = field(default_factory=dict)

    # -- summaries --------------------------------------------------------
    @property
    def compute_cost(self) -> float:
        return sum(n.compute_cost for n in self.nodes.values())

    @property
    def comm_cost(self) -> float:
        return sum(n.comm_cost for n in self.nodes.values())

    # -- how good the solver's answer is ---------------------------------------
    @property
    def status(self) -> str:
        """``"optimal"`` (proven) or ``"feasible"`` (stopped by the time limit or gap)."""
        return self.solution.status

    @property
    def objective(self) -> float:
        """Estimated seconds per step of this plan (the ILP objective)."""
        return self.solution.objective

    @property
    def bound(self) -> float | None:
        """Proven lower bound on any plan's objective (``objective`` when optimal)."""
        return self.solution.bound

    @property
    def gap(self) -> float | None:
        """Proven relative gap ``(objective - bound) / objective``; 0 when optimal."""
        return self.solution.gap

    def optimality(self) -> str:
        """One line: proven optimal, or how far from optimal it may be."""
        s = self.solution
        if s.status == "optimal":
            return f"proven optimal: objective {_us(s.objective)}"
        bound = "no bound" if s.bound is None else f"bound {_us(s.bound)}"
        gap = "" if s.gap is None else f", gap {100 * s.gap:.3g}%"
        return (
            f"NOT proven optimal (solver stopped at its time limit or gap): "
            f"objective {_us(s.objective)}, {bound}{gap}"
        )

    def placements(self, name: str) -> str:
        return self.nodes[name].output_placements

    def explain(self, node: Any) -> str:
        """Why ``node`` (an FX node or its name) is placed the way it is."""
        name = getattr(node, "name", node)
        if name not in self.nodes:
            raise KeyError(f"no node named {name!r} in the plan")
        n = self.nodes[name]
        lines = [
            f"{n.name} = {n.op}  [{n.phase}, module {n.module_path or '-'}]",
            f"  shape {n.shape} {n.dtype}; {n.num_options} options considered",
            f"  chosen: inputs {', '.join(n.input_placements) or '-'} -> output {n.output_placements}",
            f"  compute {_us(n.compute_cost)}, incoming communication {_us(n.comm_cost)}",
        ]
        for producer, placement, seconds in n.incoming:
            lines.append(f"    from {producer} ({placement}): {_us(seconds)}")
        return "\n".join(lines)

    def summary(self) -> str:
        s = self.solution
        lines = [
            f"plan for mesh {self.mesh_shape}: {len(self.nodes)} nodes, solver {s.status}"
            f" ({s.backend}, gap {s.gap if s.gap is not None else 'n/a'})",
            f"  {self.optimality()}",
            f"  estimated compute {_ms(self.compute_cost)}, communication {_ms(self.comm_cost)} per step",
            f"  parameters per rank {self.parameter_bytes_per_rank / 2**30:.3f} GiB"
            f" of {self.parameter_bytes_total / 2**30:.3f} GiB",
        ]
        if self.timings:
            lines.append(
                "  timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items())
            )
        for name, stats in self.pass_stats.items():
            lines.append(f"  pass {name}: {stats}")
        return "\n".join(lines)

    def placements_by_kind(self) -> list[PlacementKind]:
        """Chosen placements grouped by what a node is, for a readable overview.

        A kind is (phase, module path with layer indices folded to ``*``, op):
        ``layers.*.attention.wq`` covers that projection in every layer.
        Parameters are the graph inputs with a module path (their FQN).
        Sorted by phase, then the first node of each kind in graph order.
        """
        kinds: dict[tuple, PlacementKind] = {}
        for n in self.nodes.values():
            if n.module_path is None or n.shape is None:
                continue
            is_param = n.is_parameter
            if not (is_param or n.op.startswith("aten.")):
                continue  # getitem, user inputs, tangents
            key = ("parameter" if is_param else n.phase, _fold_layers(n.module_path), "" if is_param else n.op)
            kind = kinds.get(key)
            if kind is None:
                kind = kinds[key] = PlacementKind(*key)
            signature = (
                n.output_placements if is_param else f"{','.join(n.input_placements)} -> {n.output_placements}"
            )
            kind.placements[signature] = kind.placements.get(signature, 0) + 1
        order = {"parameter": 0, "forward": 1, "backward": 2}
        return sorted(kinds.values(), key=lambda k: order[k.role])

    # -- JSON -----------------------------------------------------------------
    def to_json(self) -> dict:
        s = self.solution
        return {
            "schema": PLAN_SCHEMA,
            "mesh_shape": self.mesh_shape,
            "mesh_dim_names": self.mesh_dim_names,
            "solver": {
                "status": s.status,
                "optimal": s.optimal,
                "gap": s.gap,
                "bound": s.bound,
                "backend": s.backend,
                "objective": s.objective,
                "unary_cost": s.unary_cost,
                "edge_cost": s.edge_cost,
                "num_variables": s.num_variables,
                "num_constraints": s.num_constraints,
                "presolve": asdict(s.presolve) if s.presolve else None,
            },
            "totals": {
                "compute_cost": self.compute_cost,
                "comm_cost": self.comm_cost,
                "parameter_bytes_per_rank": self.parameter_bytes_per_rank,
                "parameter_bytes_total": self.parameter_bytes_total,
            },
            "constraints": self.constraints,
            "passes": stats_to_json(self.pass_stats),
            "nodes": [asdict(n) for n in self.nodes.values()],
        }

    def dump_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1, sort_keys=False, default=_json_default)
            f.write("\n")


def diff(a: Plan, b: Plan) -> list[str]:
    """Human-readable differences between two plans, node by node."""
    out = []
    for name in a.nodes.keys() | b.nodes.keys():
        na, nb = a.nodes.get(name), b.nodes.get(name)
        if na is None or nb is None:
            out.append(f"{name}: only in {'first' if nb is None else 'second'} plan")
        elif (na.output_placements, na.input_placements) != (nb.output_placements, nb.input_placements):
            out.append(
                f"{name}: {','.join(na.input_placements)}->{na.output_placements}"
                f"  vs  {','.join(nb.input_placements)}->{nb.output_placements}"
            )
    return sorted(out)


def _fold_layers(path: str) -> str:
    """``layers.3.attention.wq`` -> ``layers.*.attention.wq``."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def _us(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds * 1e6:.1f}us"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}ms"


def _json_default(o):
    # Placements, dtypes and the like: their readable form.
    return str(o)
