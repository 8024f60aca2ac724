"""The user-facing entry point: ``with AutoParallel(model, mesh, inputs) as autop``.

Entering the context traces one training step and enumerates placement
options; constraints are then added; :meth:`AutoParallel.optimize_placement`
builds the ILP, solves it and returns a :class:`~autoparallel.plan.Plan`.
Leaving the context releases everything tracing set up, also on error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor.placement_types import Placement, Shard

import solver

from . import cost_model, rules  # noqa: F401 - rules register on import
from .plan import NodePlan, Plan
from .problem_builder import DEFAULT_MAX_PROBLEM_BYTES, BuiltProblem, Constraints, build_problem
from .repeated_layers import RepeatedLayers, find_repeated_layers
from .strategies import NodeStrategy, StrategyEnumerator, format_specs
from .tracing import TracedStep, module_path, trace_training_step

logger = logging.getLogger(__name__)

DUMP_DIR_ENV = "AUTOPARALLEL_DUMP_DIR"


class ConstraintError(ValueError):
    """A user constraint is malformed (wrong count, length, dim, node name)."""


def _clear_sharding_caches() -> None:
    """Forget DTensor's sharding-propagation caches (Python and C++ fast path)."""
    from torch.distributed.tensor.debug import _clear_fast_path_sharding_prop_cache, _clear_python_sharding_prop_cache

    _clear_python_sharding_prop_cache()
    _clear_fast_path_sharding_prop_cache()


class AutoParallel:
    """Plan the placement of every tensor of one training step over ``mesh``.

    Args:
        model: the module to parallelise, usually built on the meta device.
        mesh: the DeviceMesh to plan for (its process group must exist; use
            the "fake" backend to plan for a cluster on a laptop).
        inputs: global-shaped example inputs: a tensor, a tuple of positional
            args, a dict of keyword args, or a callable returning one of
            these. DTensor leaves fix their input's placements.
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy``; parameters
            are cast to ``param_dtype`` inside the traced step and gradients
            are reduced in ``reduce_dtype``.
        device: a :class:`~autoparallel.cost_model.DeviceSpec` or a preset
            name ("H100", "A100", "H200", "B200").
        gpus_per_node: decides which mesh dims communicate inside a node.
        overlap: how much of FSDP-style collectives the cost model counts.
        link_repeated_layers: let identical layers share one decision each.
        backend, time_limit, rel_gap: passed to the solver.
        max_problem_bytes: refuse (``ProblemTooLarge``, before building any
            cost matrix) a problem estimated to need more memory; None: no limit.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        inputs: Any,
        *,
        mp_policy: Any = None,
        device: cost_model.DeviceSpec | str = "H100",
        gpus_per_node: int | None = None,
        overlap: cost_model.CommOverlapPolicy | None = None,
        link_repeated_layers: bool = True,
        backend: str | None = None,
        time_limit: float | None = None,
        rel_gap: float | None = None,
        max_problem_bytes: float | None = DEFAULT_MAX_PROBLEM_BYTES,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
        self.model = model
        self.mesh = mesh
        self.inputs = inputs
        self.mp_policy = mp_policy
        spec = cost_model.DeviceSpec.get(device) if isinstance(device, str) else device
        if gpus_per_node is not None:
            spec = dataclasses.replace(spec, gpus_per_node=gpus_per_node)
        self.device = spec
        self.overlap = overlap or cost_model.CommOverlapPolicy()
        self.link_repeated_layers = link_repeated_layers
        self.backend = backend
        self.time_limit = time_limit
        self.rel_gap = rel_gap
        self._constraints = Constraints(max_problem_bytes=max_problem_bytes)
        if mp_policy is not None:
            # FSDP semantics: gradients are reduced in reduce_dtype, which
            # defaults to param_dtype.
            self._constraints.reduce_dtype = getattr(mp_policy, "reduce_dtype", None) or getattr(
                mp_policy, "param_dtype", None
            )
        self._constraint_log: dict[str, Any] = {}
        self._stack: contextlib.ExitStack | None = None
        self.traced: TracedStep | None = None
        self.strategies: dict[torch.fx.Node, NodeStrategy] | None = None
        self.repeats: RepeatedLayers | None = None
        self.built: BuiltProblem | None = None
        self.timings: dict[str, float] = {}

    # -- context ---------------------------------------------------------------
    def __enter__(self) -> "AutoParallel":
        if not dist.is_initialized():
            raise RuntimeError(
                "the mesh's process group is not initialised: call "
                "torch.distributed.init_process_group first (backend 'fake' with "
                "torch.testing._internal.distributed.fake_pg.FakeStore plans for any "
                "world size without devices)"
            )
        # a mesh may cover part of the world, but its ranks must exist
        highest = int(self.mesh.mesh.max())
        if highest >= dist.get_world_size():
            raise RuntimeError(
                f"mesh has {self.mesh.size()} ranks (up to rank {highest}) but the process group has "
                f"{dist.get_world_size()}"
            )
        # DTensor caches sharding propagation by op schema, and specs on an
        # equal mesh of an earlier process group hit that cache: the new
        # parameters (``nn.Parameter(dtensor)`` runs ``detach``) would then
        # live on the old mesh object, whose groups may be gone.
        _clear_sharding_caches()
        self._stack = contextlib.ExitStack()
        self._stack.__enter__()
        try:
            self._trace()
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self._close()
        return False

    def _close(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(None, None, None)

    def _require_open(self) -> None:
        if self._stack is None or self.traced is None:
            raise RuntimeError("use AutoParallel as a context manager: `with AutoParallel(...) as autop:`")

    def _trace(self) -> None:
        t0 = time.perf_counter()
        self.traced = trace_training_step(
            self.model,
            self.inputs,
            self.mesh.device_type,
            param_dtype=getattr(self.mp_policy, "param_dtype", None),
            reduce_dtype=getattr(self.mp_policy, "reduce_dtype", None),
            cast_inputs=getattr(self.mp_policy, "cast_forward_inputs", True),
            stack=self._stack,
        )
        t1 = time.perf_counter()
        self.timings["tracing"] = t1 - t0
        enumerator = StrategyEnumerator(self.mesh)
        # AOT export leaves its fake mode entered on the stack; planning
        # works on real metadata, outside it.
        with unset_fake_temporarily():
            self.strategies = enumerator.enumerate(self.traced.gm, set(self.traced.param_nodes.values()))
        self.strategy_stats = enumerator.stats
        t2 = time.perf_counter()
        self.timings["options"] = t2 - t1
        self.repeats = find_repeated_layers(self.traced) if self.link_repeated_layers else None
        self.timings["repeated_layers"] = time.perf_counter() - t2
        for i, placements in enumerate(self.traced.input_placements):
            if placements is not None:
                self._pin_input(i, placements, "DTensor input")

    # -- constraints -------------------------------------------------------------
    def _check_placements(self, placements: Sequence, node: torch.fx.Node, what: str) -> tuple:
        if not isinstance(placements, (tuple, list)):
            raise ConstraintError(f"{what}: placements must be a tuple, got {placements!r}")
        if len(placements) != self.mesh.ndim:
            raise ConstraintError(
                f"{what}: {len(placements)} placements given for a {self.mesh.ndim}-D mesh "
                f"{tuple(self.mesh.shape)}"
            )
        ndim = node.meta["val"].ndim
        for p in placements:
            if not isinstance(p, Placement):
                raise ConstraintError(f"{what}: {p!r} is not a Placement")
            if isinstance(p, Shard) and not -ndim <= p.dim < max(ndim, 1):
                raise ConstraintError(
                    f"{what}: {p} is out of range for a {ndim}-D tensor (node {node.name})"
                )
        return tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements)

    def _pin(self, node: torch.fx.Node, placements: tuple, cname: str) -> None:
        self._constraints.pins[node.name] = (cname, placements)
        self._constraint_log[cname] = {"node": node.name, "placements": [str(p) for p in placements]}

    def _pin_input(self, i: int, placements, cname_prefix: str) -> None:
        node = self.traced.input_nodes[i]
        if node is None:
            return
        what = f"{cname_prefix} {i}"
        self._pin(node, self._check_placements(placements, node, what), f"input constraint {i}")

    def add_input_constraints(self, constraints: Sequence[Sequence[Placement] | None]) -> None:
        """One placement tuple (or None) per tensor input, in flattened order."""
        self._require_open()
        n = len(self.traced.input_nodes)
        if len(constraints) != n:
            raise ConstraintError(f"{len(constraints)} input constraints given for {n} inputs")
        for i, placements in enumerate(constraints):
            if placements is not None:
                self._pin_input(i, placements, "input constraint")

    def add_output_constraints(self, constraints: Sequence[Sequence[Placement] | None]) -> None:
        """One placement tuple (or None) per output of the forward, flattened."""
        self._require_open()
        outs = self.traced.output_nodes
        if len(constraints) != len(outs):
            raise ConstraintError(f"{len(constraints)} output constraints given for {len(outs)} outputs")
        for i, placements in enumerate(constraints):
            if placements is None:
                continue
            node = outs[i]
            checked = self._check_placements(placements, node, f"output constraint {i}")
            self._pin(node, checked, f"output constraint {i}")

    def add_node_constraint(self, node: torch.fx.Node | str, placements: Sequence[Placement]) -> None:
        """Pin the output placement of one graph node (an FX node or its name)."""
        self._require_open()
        name = getattr(node, "name", node)
        target = next((n for n in self.strategies if n.name == name), None)
        if target is None:
            raise ConstraintError(f"no graph node named {name!r} (see plan JSON for node names)")
        checked = self._check_placements(placements, target, f"node constraint on {name}")
        self._pin(target, checked, f"node constraint {name}")

    def add_parameter_memory_constraint(self, low: float | None = None, high: float | None = None) -> None:
        """Bound per-rank parameter memory as a fraction of the replicated size.

        ``high=None`` means fully sharded (each parameter as sharded as the
        mesh allows, which makes FSDP emerge); ``high=1.0`` allows full
        replication (DDP).
        """
        for name, v in (("low", low), ("high", high)):
            if v is not None and not (0.0 <= v):
                raise ConstraintError(f"parameter memory constraint: {name}={v} must be >= 0")
        if low is not None and high is not None and low > high:
            raise ConstraintError(f"parameter memory constraint: low={low} > high={high}")
        self._constraints.memory_low = low
        self._constraints.memory_high = high
        self._constraint_log["parameter memory budget"] = {"low": low, "high": high}

    # -- solving -------------------------------------------------------------------
    def build_problem(self) -> BuiltProblem:
        self._require_open()
        t0 = time.perf_counter()
        with unset_fake_temporarily():
            self.built = build_problem(
                self.traced,
                self.strategies,
                self.mesh,
                self._constraints,
                device=self.device,
                overlap=self.overlap,
                repeats=self.repeats,
            )
        self.timings["problem_build"] = time.perf_counter() - t0
        return self.built

    def optimize_placement(self) -> Plan:
        built = self.build_problem()
        dump_dir = os.environ.get(DUMP_DIR_ENV)
        t0 = time.perf_counter()
        solution = solver.solve(
            built.problem, backend=self.backend, time_limit=self.time_limit, rel_gap=self.rel_gap
        )
        self.timings["solve"] = time.perf_counter() - t0
        for phase, seconds in solution.timings.items():
            self.timings[f"solver.{phase}"] = seconds
        plan = self._make_plan(built, solution)
        if dump_dir:
            self._dump(dump_dir, built, solution, plan)
        logger.info("%s", plan.summary())
        return plan

    def _dump(self, directory: str, built: BuiltProblem, solution: solver.Solution, plan: Plan) -> None:
        from solver import serialize

        os.makedirs(directory, exist_ok=True)
        serialize.dump(built.problem, os.path.join(directory, "problem.json"))
        serialize.dump(solution, os.path.join(directory, "solution.json"))
        plan.dump_json(os.path.join(directory, "plan.json"))
        logger.info("wrote solver dumps to %s", directory)

    def _make_plan(self, built: BuiltProblem, solution: solver.Solution) -> Plan:
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
        param_fqn = {n: fqn for fqn, n in self.traced.param_nodes.items()}
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
        per_rank = total = 0.0
        for term_name, weights in built.problem.resources[0].terms.items():
            per_rank += weights[choice[term_name]]
            val = by_name[term_name].meta["val"]
            total += val.numel() * val.element_size()
        return Plan(
            mesh_shape=list(self.mesh.shape),
            mesh_dim_names=list(self.mesh.mesh_dim_names) if self.mesh.mesh_dim_names else None,
            nodes=nodes,
            solution=solution,
            constraints=dict(self._constraint_log),
            timings=dict(self.timings),
            parameter_bytes_per_rank=per_rank,
            parameter_bytes_total=total,
        )

    def apply_placement(
        self,
        plan: Plan,
        *,
        partitioner: str = "min_cut",
        disable_passes: Sequence[str] = (),
        pass_options: Any = None,
        fold_layers: bool = True,
    ) -> nn.Module:
        """A copy of the model whose parameters are DTensors laid out as ``plan``
        says and whose forward runs the plan on per-rank local inputs (see
        :mod:`autoparallel.apply`). The rewrite passes of
        :mod:`autoparallel.passes` run on the way; ``disable_passes`` names
        those to skip, ``pass_options`` is a
        :class:`~autoparallel.passes.PassOptions`; ``fold_layers=False`` builds
        the full graphs instead of copying a middle layer's (slower, same
        result; see :mod:`autoparallel.apply.fold`)."""
        self._require_open()
        from .apply import apply_placement

        return apply_placement(
            self,
            plan,
            partitioner=partitioner,
            disable_passes=disable_passes,
            pass_options=pass_options,
            fold_layers=fold_layers,
        )
