"""Stage 4: the solver's answer as a placement plan users can read and diff.

A :class:`Plan` holds, per graph node, the chosen input and output
placements and what they cost; :meth:`Plan.explain` tells why a node looks
the way it does, :func:`diff` compares two plans, and :meth:`Plan.to_json`
is the solver debug dump (per node: name, op, module path, phase, shape,
dtype, placements, number of options, costs).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import solver

from .passes import stats_to_json
from .report import units
from .report.files import file_mode, write_atomic  # noqa: F401 - file_mode re-exported


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
    # the cheapest other options: ("inputs -> output", seconds more per step
    # with the rest of the plan fixed)
    runner_ups: list[tuple[str, float]] = field(default_factory=list)


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
    # What the plan was made for (see autoparallel.checks.provenance): graph
    # fingerprint, input shapes, device spec, mixed precision.
    provenance: dict[str, Any] = field(default_factory=dict)
    # Collectives of the applied graphs per (phase, kind, group): count,
    # traffic bytes per rank, estimated seconds (apply.collectives.traffic_table).
    collectives: list[dict] = field(default_factory=list)
    # phase -> the scheduler's intervals and memory curve (report.timeline.simulate)
    timeline: dict[str, Any] = field(default_factory=dict)
    # hand layouts estimated like the plan (autoparallel.baselines.compare)
    baselines: list[dict] = field(default_factory=list)

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
        gap = "" if s.gap is None else f", gap {units.percent(s.gap)}"
        if s.stopped_by == "time limit":  # the wall-clock safety cap: may depend on load
            why = "stopped at its time limit: the plan may differ between runs"
        elif s.backend.startswith("pricing"):
            why = "option pricing stopped at its work or option limit"
        else:
            why = "solver stopped at its work limit or gap"
        return f"NOT proven optimal ({why}): objective {_us(s.objective)}, {bound}{gap}"

    def placements(self, name: str) -> str:
        return self.nodes[name].output_placements

    def explain(self, node: Any) -> str:
        """Why a node is placed the way it is. ``node``: an FX node, a node
        name, or a module path (``layers.3.attention.wq``: all its nodes,
        forward and backward), with the runner-up options and what each
        would add to the step. Each entry leads with the module and the op;
        the graph node's name comes last, in brackets."""
        name = getattr(node, "name", node)
        if name in self.nodes:
            return self._explain_node(self.nodes[name])
        members = [n for n in self.nodes.values() if n.module_path == name and n.shape is not None]
        members += [
            n for n in self.nodes.values() if n.is_parameter and n.module_path and n.module_path.startswith(name + ".")
        ]
        if not members:
            paths = sorted({n.module_path for n in self.nodes.values() if n.module_path and not n.is_parameter})
            near = [p for p in paths if p.endswith(name.rsplit(".", 1)[-1])][:5]
            raise KeyError(
                f"no node or module named {name!r} in the plan"
                + (f"; modules with that name: {', '.join(near)}" if near else "")
            )
        order = {True: 0, False: 1}
        members.sort(key=lambda n: (order[n.is_parameter], n.phase != "forward"))
        params = sum(n.is_parameter for n in members)
        fwd = sum(not n.is_parameter and n.phase == "forward" for n in members)
        header = (
            f"module {name}: {_plural(params, 'parameter')}, {_plural(fwd, 'forward op')}, "
            f"{_plural(len(members) - params - fwd, 'backward op')}; "
            f"compute {_us(sum(n.compute_cost for n in members))}, "
            f"incoming communication {_us(sum(n.comm_cost for n in members))} per step"
        )
        return "\n".join([header] + [self._explain_node(n) for n in members])

    def _describe_node(self, name: str) -> str:
        """``layers.0.attention.wq mm`` for a node name (the name itself when unknown)."""
        n = self.nodes.get(name)
        if n is None:
            return name
        what = "parameter" if n.is_parameter else _short_op(n.op)
        return f"{n.module_path or '(no module)'} {what}" if not n.is_parameter else f"{n.module_path} (parameter)"

    def _explain_node(self, n: NodePlan) -> str:
        what = "parameter" if n.is_parameter else f"{_short_op(n.op)} ({n.phase})"
        shape = "x".join(str(d) for d in n.shape) if n.shape else "-"
        inputs = ", ".join(n.input_placements)
        layout = n.output_placements if n.is_parameter or not inputs else f"{inputs} -> {n.output_placements}"
        lines = [
            f"{n.module_path or '(no module)'} {what} [{shape}] {n.dtype or ''}: {layout}   [node {n.name}]",
            f"  compute {_us(n.compute_cost)}, incoming communication {_us(n.comm_cost)}; "
            f"{n.num_options} options considered",
        ]
        for producer, placement, seconds in n.incoming:
            lines.append(f"    from {self._describe_node(producer)} as {placement}: {_us(seconds)}   [node {producer}]")
        for sig, delta in n.runner_ups:
            sig = sig.removeprefix(" -> ")  # a parameter: no inputs
            lines.append(f"  runner-up {sig}: +{_us(delta)} per step (rest of the plan fixed)")
        return "\n".join(lines)

    def summary(self, *, legend: bool = True) -> str:
        """What the plan is in words, the notation, then the numbers:
        estimated step time, per-rank memory against HBM, collectives,
        placements per kind (forward/backward labelled) and pass stats."""
        from .problem import memory
        from .report import baseline_table, numbers, words

        s = self.solution
        mesh = " x ".join(
            f"{n} {d}"
            for n, d in zip(self.mesh_dim_names or [f"dim{i}" for i in range(len(self.mesh_shape))], self.mesh_shape)
        )
        lines = [
            f"plan for mesh {mesh}: {len(self.nodes)} nodes, solver {s.status}"
            f" ({s.backend}, gap {units.percent(s.gap)})",
            f"  {self.optimality()}",
        ]
        lines += ["  " + line for line in words.describe(self)]
        if legend:
            lines += ["  " + line for line in words.LEGEND]
        lines += ["  " + line for line in numbers.step_lines(self)]
        lines += ["  " + line for line in baseline_table.table_lines(self)]
        lines.append(f"  memory per rank ({memory.UNIT_NOTE}):")
        lines += ["    " + line for line in memory.breakdown(self).lines()]
        lines.append("  collectives per step and rank:")
        lines += ["  " + line for line in numbers.collective_lines(self)]
        if self.timings:
            lines.append("  timings: " + ", ".join(f"{k} {units.seconds(v)}" for k, v in self.timings.items()))
        if self.pass_stats:
            lines.append("  passes:")
            lines += ["  " + line for line in numbers.pass_stat_lines(self)]
        return "\n".join(lines)

    def to_html(self, path: str, *, model: str | None = None) -> None:
        """One self-contained HTML file (no network): a title naming the
        model (``model``, default the recorded class name), its parameter
        count, mesh, device, inputs and dtypes; summary, placements per
        layer, timeline, memory curve, collectives, pass stats."""
        from .report.html import write_html

        write_html(self, path, model)

    def placements_by_kind(self) -> list[PlacementKind]:
        """Chosen placements grouped by what a node is, for a readable overview.

        A kind is (phase, module path with layer indices folded to ``*``, op):
        ``layers.*.attention.wq`` covers that projection in every layer.
        Parameters are the graph inputs with a module path (their FQN).
        Sorted by phase, then the first node of each kind in graph order.
        """
        kinds: dict[tuple, PlacementKind] = {}
        param_shapes = {n.module_path: n.shape for n in self.nodes.values() if n.is_parameter}
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
            signature = n.output_placements if is_param else f"{','.join(n.input_placements)} -> {n.output_placements}"
            if n.phase == "backward" and n.op in ("aten.mm.default", "aten.addmm.default"):
                # the two matmuls of a linear layer's backward: which is which
                w = param_shapes.get(n.module_path + ".weight")
                is_dw = w is not None and n.shape is not None and sorted(n.shape) == sorted(w) and len(n.shape) == 2
                signature = ("weight grad " if is_dw else "input grad ") + signature
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
                "stopped_by": s.stopped_by,
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
            "provenance": self.provenance,
            "constraints": self.constraints,
            "timings": self.timings,
            "passes": stats_to_json(self.pass_stats),
            "collectives": self.collectives,
            "timeline": self.timeline,
            "baselines": self.baselines,
            "nodes": [asdict(n) for n in self.nodes.values()],
        }

    def dump_json(self, path: str, *, indent: int | None = 1) -> None:
        """Write the plan (gzip when ``path`` ends in ``.gz``), replacing any
        old file atomically."""
        text = json.dumps(self.to_json(), indent=indent, sort_keys=False, default=_json_default) + "\n"
        write_atomic(path, text)

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        if not isinstance(d, dict) or d.get("schema") != PLAN_SCHEMA:
            got = d.get("schema") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"not a plan: schema {got!r}, expected {PLAN_SCHEMA!r}")
        nodes = {}
        for nd in d["nodes"]:
            nd = dict(nd)
            nd["incoming"] = [tuple(t) for t in nd.get("incoming", [])]
            nd["runner_ups"] = [tuple(t) for t in nd.get("runner_ups", [])]
            nodes[nd["name"]] = NodePlan(**nd)
        sv = d.get("solver", {})
        solution = solver.Solution(
            choice={name: n.option for name, n in nodes.items()},
            objective=sv.get("objective", 0.0),
            unary_cost=sv.get("unary_cost", 0.0),
            edge_cost=sv.get("edge_cost", 0.0),
            status=sv.get("status", "loaded"),
            optimal=bool(sv.get("optimal", False)),
            stopped_by=sv.get("stopped_by"),
            gap=sv.get("gap"),
            backend=sv.get("backend", ""),
            num_variables=sv.get("num_variables", 0),
            num_constraints=sv.get("num_constraints", 0),
        )
        totals = d.get("totals", {})
        return cls(
            mesh_shape=list(d["mesh_shape"]),
            mesh_dim_names=d.get("mesh_dim_names"),
            nodes=nodes,
            solution=solution,
            constraints=d.get("constraints", {}),
            timings=d.get("timings", {}),
            parameter_bytes_per_rank=totals.get("parameter_bytes_per_rank", 0.0),
            parameter_bytes_total=totals.get("parameter_bytes_total", 0.0),
            pass_stats=d.get("passes", {}),
            provenance=d.get("provenance", {}),
            collectives=d.get("collectives", []),
            timeline=d.get("timeline", {}),
            baselines=d.get("baselines", []),
        )

    @classmethod
    def load_json(cls, path: str) -> "Plan":
        """A plan written by :meth:`dump_json` (``.gz`` read as gzip); apply
        it with ``autop.apply_placement(plan)``, which checks it was made for
        the same model, mesh and input shapes."""
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt") as f:
            return cls.from_json(json.load(f))


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
    return units.seconds(seconds)


def _plural(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


def _short_op(op: str) -> str:
    """``aten.mm.default`` -> ``mm``; ``aten.add.Tensor`` -> ``add.Tensor``."""
    return op.removeprefix("aten.").removesuffix(".default")


def _json_default(o):
    # Placements, dtypes and the like: their readable form.
    return str(o)
