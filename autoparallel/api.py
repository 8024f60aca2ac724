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
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist
import torch.fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor.placement_types import Placement

import solver

from . import cost_model
from . import validation
from .checks import agreement, preflight
from .problem import mesh_roles as mesh_roles_mod
from .options import rules  # noqa: F401 - rules register on import
from .problem import coarse_seed, infeasibility
from .problem import local_map as local_map_mod
from .problem import memory_budget as memory_budget_mod
from .problem import pricing as option_pricing
from .problem.memory import ADAMW, OptimizerSpec
from .plan import Plan
from . import to_plan, torch_compat
from .checks.provenance import PlanMismatch, PlanTarget, check_applicable, provenance  # noqa: F401 - PlanMismatch re-exported
from .progress import Stages, gc_paused
from .problem.param_budget import PARAM_BUDGET, default_bound_entry, with_default_bound
from .problem.builder import DEFAULT_MAX_PROBLEM_BYTES, BuiltProblem, Constraints, build_problem
from .capture.repeated_layers import RepeatedLayers, find_repeated_layers
from .options.strategies import NodeStrategy, StrategyEnumerator
from .capture.attention_kernels import traced_attention_kernel
from .capture.tracing import TracedStep, module_path, trace_training_step

if TYPE_CHECKING:
    from .apply import GradReduction, Partitioner
    from .passes import PassOptions

logger = logging.getLogger(__name__)

DUMP_DIR_ENV = "AUTOPARALLEL_DUMP_DIR"
# The solve stops on counted work (solver.work: MIP nodes, pricing rounds,
# ascent sweeps), so every rank gets the same plan whatever its load; this
# wall-clock cap (seconds) only ends a solve that would run on, and a plan
# stopped by it says so (plan.solution.stopped_by == "time limit").
# Problems whose LP relaxation is integral (LLaMA-3 8B on 16x8: 0.1 s) are
# unaffected, and the solver's branching proves the fractional 1-layer debug
# LLaMA on 4x2 in 2-4 s.
DEFAULT_TIME_LIMIT = 300.0


ConstraintError = validation.ConstraintError


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
        backend, time_limit, rel_gap: passed to the solver. The solve
            stops on counted work (``solver.work``: the same plan on every
            rank and run); a plan stopped there has ``plan.status ==
            "feasible"`` and reports ``plan.bound`` and ``plan.gap``.
            ``time_limit`` (seconds, default :data:`DEFAULT_TIME_LIMIT`;
            ``None``: no cap) is a wall-clock safety cap: a plan that
            reached it says so (``plan.solution.stopped_by``) and may depend
            on the machine's load. Plans proven optimal are unaffected.
            With several processes, the ranks of the mesh then check they
            hold the same plan (:mod:`autoparallel.checks.agreement`).
        max_problem_bytes: a problem whose dense edge matrices are estimated
            to need more memory is solved by option pricing with lazy
            matrices instead (:mod:`autoparallel.problem.pricing`); one too
            big even for that is refused (``ProblemTooLarge``, before any
            cost matrix is built); None: no limit.
        option_pricing: True / False forces / forbids option pricing;
            None (default) uses it when the dense problem exceeds
            ``max_problem_bytes``.
        memory_budget: bound the per-rank memory of the whole step
            (parameters, gradients, optimizer state, saved activations; see
            :mod:`autoparallel.problem.memory_budget`) by the device's HBM less 10%;
            :meth:`add_memory_budget` sets another; False plans without it.
        input_constraints: as :meth:`add_input_constraints` takes them, but
            checked against the example inputs' shapes and the mesh before
            tracing (a batch that does not split over the data-parallel
            ranks fails in the first second, not after the trace).
        mesh_roles: what each mesh dim is for (:mod:`autoparallel.problem.mesh_roles`):
            a dict of dim name -> ``"replicate"`` (HSDP / DDP: parameters
            replicated, gradients all-reduced), ``"shard"`` (FSDP),
            ``"tp"``, ``"cp"`` or ``"ep"`` (routed experts with all-to-all
            dispatch). ``None`` (default): from torchtitan's dim names
            (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``ep``); ``{}``:
            no roles, the planner is free on every dim.
        grad_reduction: ``"sum"`` (default): parameter gradients are those
            of the sum of the ranks' losses, each shard of an output counted
            once; ``"mean"``: of their mean over the output's shards, as DDP
            and FSDP average: with each rank's loss the mean over its local
            batch, gradients equal a single device's for the global batch
            and a mean loss.
        attention_kernel: trace attention as this fused CUDA kernel
            (``"cudnn"``, ``"flash"``, ``"efficient"``) on any mesh: a plan
            made on a CPU machine for the GPU's kernel
            (:func:`~.capture.attention_kernels.traced_attention_kernel`);
            None (default): the kernel torch picks for the mesh's device.
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
        time_limit: float | None = DEFAULT_TIME_LIMIT,
        rel_gap: float | None = None,
        max_problem_bytes: float | None = DEFAULT_MAX_PROBLEM_BYTES,
        memory_budget: bool = True,
        option_pricing: bool | None = None,
        input_constraints: Sequence[Sequence[Placement] | None] | None = None,
        mesh_roles: dict[str | int, str] | None = None,
        grad_reduction: GradReduction = "sum",
        attention_kernel: str | None = None,
    ):
        validation.check_arguments(
            model=model,
            mesh=mesh,
            mp_policy=mp_policy,
            device=device,
            gpus_per_node=gpus_per_node,
            overlap=overlap,
            link_repeated_layers=link_repeated_layers,
            backend=backend,
            time_limit=time_limit,
            rel_gap=rel_gap,
            attention_kernel=attention_kernel,
        )
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
        if option_pricing is not None and not isinstance(option_pricing, bool):
            raise TypeError(
                f"option_pricing must be True, False or None (when the dense problem is too big), got {option_pricing!r}"
            )
        self._constraints = Constraints(max_problem_bytes=max_problem_bytes, option_pricing=option_pricing)
        if mp_policy is not None:
            # FSDP semantics: gradients are reduced in reduce_dtype, which
            # defaults to param_dtype.
            self._constraints.reduce_dtype = getattr(mp_policy, "reduce_dtype", None) or getattr(
                mp_policy, "param_dtype", None
            )
        self._constraint_log: dict[str, Any] = {PARAM_BUDGET: default_bound_entry()}
        if not isinstance(memory_budget, bool):
            raise TypeError(
                f"memory_budget must be True (HBM less a margin) or False (none), got {memory_budget!r}; "
                "set a size with autop.add_memory_budget(bytes=... or fraction=...)"
            )
        self._memory_budget = memory_budget_mod.MemoryBudget(enabled=memory_budget)
        self._input_constraints = input_constraints
        self.mesh_roles = mesh_roles_mod.resolve(mesh, mesh_roles)
        if self.mesh_roles:
            self._constraint_log[mesh_roles_mod.LOG_KEY] = mesh_roles_mod.describe(mesh, self.mesh_roles)
        if grad_reduction not in ("sum", "mean"):
            raise ValueError(
                f"grad_reduction must be 'sum' (gradients of the sum of the ranks' losses) or 'mean' (of their "
                f"mean over the data-parallel shards, as DDP and FSDP), got {grad_reduction!r}"
            )
        self.grad_reduction = grad_reduction
        self.attention_kernel = attention_kernel
        self._stack: contextlib.ExitStack | None = None
        self._closed = False
        self.traced: TracedStep | None = None
        self.strategies: dict[torch.fx.Node, NodeStrategy] | None = None
        self.repeats: RepeatedLayers | None = None
        self.built: BuiltProblem | None = None
        self._role_rules_off = False  # inside scoped_constraints(without_role_rules=True)
        self.timings: dict[str, float] = {}

    # -- context ---------------------------------------------------------------
    def __enter__(self) -> "AutoParallel":
        if self._stack is not None:
            raise RuntimeError(
                "this AutoParallel context is already entered: one `with AutoParallel(...) as autop:` block per "
                "object (make a second AutoParallel for a second plan)"
            )
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
        validation.check_dtensor_inputs(self.inputs, self.mesh)
        if self._input_constraints is not None:
            preflight.check_input_constraints(self.inputs, self._input_constraints, self.mesh)
        # DTensor caches sharding propagation by op schema, and specs on an
        # equal mesh of an earlier process group hit that cache: the new
        # parameters (``nn.Parameter(dtensor)`` runs ``detach``) would then
        # live on the old mesh object, whose groups may be gone.
        torch_compat.clear_sharding_caches()
        self._closed = False
        self._stack = contextlib.ExitStack()
        self._stack.__enter__()
        try:
            self._trace()
            validation.check_outputs(self.traced.output_nodes)
            if self._input_constraints is not None:
                self.add_input_constraints(self._input_constraints)
            # AOT export leaves its fake mode entered on the stack; the
            # user's `with` body runs outside it (real tensors, runnable
            # parallel modules), and so does planning (real metadata).
            self._stack.enter_context(validation.outside_tracing())
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
            self._closed = True
            stack.__exit__(None, None, None)

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "this AutoParallel context has closed: add constraints, optimize_placement and "
                "apply_placement inside `with AutoParallel(...) as autop:`; run the parallel module "
                "after the block"
            )
        if self._stack is None or self.traced is None:
            raise RuntimeError("use AutoParallel as a context manager: `with AutoParallel(...) as autop:`")

    def _trace(self) -> None:
        self._stages = Stages(self.timings)
        self._stack.callback(self._stages.close)
        with self._stages.stage("tracing", "tracing"), traced_attention_kernel(self.attention_kernel):
            self.traced = trace_training_step(
                self.model,
                self.inputs,
                self.mesh.device_type,
                param_dtype=getattr(self.mp_policy, "param_dtype", None),
                reduce_dtype=getattr(self.mp_policy, "reduce_dtype", None),
                cast_inputs=getattr(self.mp_policy, "cast_forward_inputs", True),
                stack=self._stack,
                mesh_shape=tuple(self.mesh.shape),
            )
        enumerator = StrategyEnumerator(self.mesh)
        # AOT export leaves its fake mode entered on the stack; planning
        # works on real metadata, outside it.
        with self._stages.stage("options", "options"), unset_fake_temporarily(), gc_paused():
            self.strategies = enumerator.enumerate(self.traced.gm, set(self.traced.param_nodes.values()))
        self.strategy_stats = enumerator.stats
        with self._stages.stage("repeated layers", "repeated_layers"):
            self.repeats = find_repeated_layers(self.traced) if self.link_repeated_layers else None
        for i, placements in enumerate(self.traced.input_placements):
            if placements is not None:
                self._pin_input(i, placements, "DTensor input")
        for node, placements, cname, subject in local_map_mod.no_redistribution_pins(self.traced.gm):
            self._pin(node, placements, cname, subject)

    # -- constraints -------------------------------------------------------------
    def _check_placements(self, placements: Sequence, node: Any, what: str) -> tuple:
        return validation.check_placements(placements, node, self.mesh, what)

    def _pin(self, node: torch.fx.Node, placements: tuple, cname: str, subject: str | None = None) -> None:
        # a pinned layout no option offers is infeasible whatever else holds:
        # say why now, in the user's terms, not after an ILP
        infeasibility.check_pin(
            cname, subject or f"node {node.name}", node, placements, self.strategies[node].options, self.mesh
        )
        validation.conflicting_pin(self._constraints.pins.get(node.name), cname, placements, node.name)
        # the same layout twice: the first constraint's name stays the pin's
        self._constraints.pins.setdefault(node.name, (cname, placements))
        self._constraint_log[cname] = {"node": node.name, "placements": [str(p) for p in placements]}

    def _pin_input(self, i: int, placements, cname_prefix: str) -> None:
        node = self.traced.input_nodes[i]
        if node is None:
            return
        what = f"{cname_prefix} {i}"  # "input constraint 0" or "DTensor input 0"
        self._pin(node, self._check_placements(placements, node, what), what, f"input {i}")

    def add_input_constraints(self, constraints: Sequence[Sequence[Placement] | None]) -> None:
        """One placement tuple (or None) per TENSOR input, in the flattened
        ``(args, kwargs)`` order (``torch.utils._pytree.tree_flatten``;
        keyword inputs in the order given). Non-tensor arguments (floats,
        ints, bools, strings, None) are constants of the traced step: they
        take no placement and are not counted."""
        self._require_open()
        n = len(self.traced.input_nodes)
        for i, placements in enumerate(validation.check_constraint_list(constraints, n, "input constraint")):
            if placements is not None:
                self._pin_input(i, placements, "input constraint")

    def add_output_constraints(self, constraints: Sequence[Sequence[Placement] | None]) -> None:
        """One placement tuple (or None) per output of the forward, flattened."""
        self._require_open()
        outs = self.traced.output_nodes
        for i, placements in enumerate(validation.check_constraint_list(constraints, len(outs), "output constraint")):
            if placements is None:
                continue
            node = outs[i]
            cname = f"output constraint {i}"
            checked = self._check_placements(placements, node, cname)
            infeasibility.check_pin(cname, f"output {i}", node, checked, self.strategies[node].options, self.mesh)
            # the output's incoming gradient is laid out like the output
            tangent = self.traced.tangent_nodes.get(i)
            if tangent is not None and tangent in self.strategies:
                subject = f"output {i} (its incoming gradient, {tangent.name}, takes the same layout)"
                infeasibility.check_pin(cname, subject, tangent, checked, self.strategies[tangent].options, self.mesh)
            self._pin(node, checked, cname, f"output {i}")

    def add_node_constraint(self, node: torch.fx.Node | str, placements: Sequence[Placement]) -> None:
        """Pin the output placement of one graph node (an FX node or its name)."""
        self._require_open()
        name = getattr(node, "name", node)
        if not isinstance(name, str):
            raise TypeError(f"node must be an FX node or a node name (str), got {type(node).__name__} {node!r}")
        target = next((n for n in self.strategies if n.name == name), None)
        if target is None:
            raise ConstraintError(f"no graph node named {name!r} (see plan JSON for node names)")
        checked = self._check_placements(placements, target, f"node constraint on {name}")
        path = module_path(target) or next((f for f, n in self.traced.param_nodes.items() if n is target), None)
        self._pin(target, checked, f"node constraint {name}", f"node {name}" + (f" ({path})" if path else ""))

    def add_parameter_memory_constraint(self, low: float | None = None, high: float | None = None) -> None:
        """Bound per-rank parameter memory as a fraction of the replicated size.

        ``high=None`` means fully sharded (each parameter as sharded as the
        mesh allows, which makes FSDP emerge); ``high=1.0`` allows full
        replication (DDP). Without this call the step's memory budget
        (:meth:`add_memory_budget`) bounds parameters together with their
        gradients, optimizer state and activations: the planner replicates
        where that is cheaper and fits, and shards what it must; with the
        budget off, the bound is fully sharded.
        """
        validation.check_memory_bounds(low, high)
        self._constraints.memory_low = low
        self._constraints.memory_high = high
        self._constraint_log[PARAM_BUDGET] = {"low": low, "high": high}

    def add_memory_budget(
        self, bytes: float | None = None, *, fraction: float | None = None, optimizer: OptimizerSpec = ADAMW
    ) -> None:
        """Bound the per-rank memory of the whole step: parameters, their
        gradients and ``optimizer`` state (AdamW: two fp32 moments per
        element), and the activations saved for backward under the model's
        activation checkpointing, each shrinking with its tensor's sharding.

        ``bytes`` per rank, or ``fraction`` of the device's HBM; neither: the
        default, HBM less 10% (on unless ``AutoParallel(...,
        memory_budget=False)``; this call switches it on again). The plan is
        the cheapest that fits; when none can, planning raises
        :class:`~autoparallel.problem.infeasibility.InfeasibleConstraintError` naming
        ``'memory budget'`` with the smallest reachable estimate.
        ``plan.summary()`` reports the estimate against the budget.
        """
        self._memory_budget = memory_budget_mod.MemoryBudget(bytes, fraction, optimizer)

    @contextlib.contextmanager
    def scoped_constraints(self, *, without_role_rules: bool = False):
        """Constraints added inside the block are dropped at its end (a
        baseline's pins, :mod:`autoparallel.baselines`); the plan, strategies
        and trace are kept. ``without_role_rules``: inside the block the mesh
        roles' option rules do not hold (a hand layout says itself what each
        dim does)."""
        self._require_open()
        saved = (dataclasses.replace(self._constraints, pins=dict(self._constraints.pins)), dict(self._constraint_log))
        built = self.built
        suspended = self._role_rules_off
        self._role_rules_off = suspended or without_role_rules
        try:
            yield self
        finally:
            self._constraints, self._constraint_log = saved
            self.built = built
            self._role_rules_off = suspended

    def _node_roles(self) -> dict[str, str]:
        """What parameter and gradient nodes are, for messages."""
        roles = {n.name: f"parameter {fqn}" for fqn, n in self.traced.param_nodes.items()}
        roles.update({n.name: f"the gradient of {fqn}" for fqn, n in self.traced.grad_nodes.items() if n is not None})
        return roles

    # -- solving -------------------------------------------------------------------
    def build_problem(self, strategies: dict[torch.fx.Node, NodeStrategy] | None = None) -> BuiltProblem:
        """The planning problem over ``strategies`` (default: every node's
        options; option pricing passes the options it kept, with pruning
        and pricing off for that dense rebuild)."""
        self._require_open()
        narrowed = strategies is not None
        strategies = self.strategies if strategies is None else strategies
        if not narrowed:
            self._apply_mesh_roles()
        c = self._with_default_param_bound(self._constraints)
        infeasibility.check_memory_budget(
            self.traced, self.strategies, self.mesh, c.pins, c.memory_low, c.memory_high, self.repeats, c.option_rules
        )
        step_memory = self._check_step_memory()
        constraints = dataclasses.replace(c, prune_options=False, option_pricing=False) if narrowed else c
        stage = "problem rebuild (kept options)" if narrowed else "problem build"
        with (
            self._stages.stage(stage, "problem_rebuild" if narrowed else "problem_build"),
            unset_fake_temporarily(),
            gc_paused(),
        ):
            self.built = build_problem(
                self.traced,
                strategies,
                self.mesh,
                constraints,
                device=self.device,
                overlap=self.overlap,
                repeats=self.repeats,
            )
            budget = self._constraint_log[memory_budget_mod.BUDGET_NAME]["budget_bytes"]
            if budget is not None:  # the whole step's memory: one more resource row
                self.built.problem.resources.append(
                    memory_budget_mod.budget_constraint(
                        step_memory, self.built.strategies, list(self.mesh.shape), budget
                    )
                )
        return self.built

    def _with_default_param_bound(self, c: Constraints) -> Constraints:
        budget, _ = self._memory_budget.resolve(self.device)
        return with_default_bound(c, self._constraint_log[PARAM_BUDGET], budget)

    def _apply_mesh_roles(self) -> None:
        """The roles' option rules, and (every dim with a role) their layout
        of the tensor inputs and outputs no constraint pinned."""
        if not self.mesh_roles:
            return
        c = self._constraints
        if self._role_rules_off:  # a hand layout's scope (scoped_constraints)
            c.option_rules = {}
            return
        c.option_rules = mesh_roles_mod.option_rules(self.traced, self.strategies, self.mesh, self.mesh_roles)
        for node, placements, cname, subject in mesh_roles_mod.io_pins(
            self.traced, self.strategies, self.mesh, self.mesh_roles, c.pins
        ):
            self._pin(node, placements, cname, subject)

    def _check_step_memory(self) -> memory_budget_mod.StepMemoryModel:
        """The step's memory terms; the budget's entry in the constraint
        log; an error naming the budget when no plan can fit it."""
        b = self._memory_budget
        model = memory_budget_mod.step_memory_model(self.traced, self.strategies, b.optimizer, device=self.device)
        budget, source = b.resolve(self.device)
        entry = {"budget_bytes": budget, "source": source, "model": model.to_json()}
        self._constraint_log[memory_budget_mod.BUDGET_NAME] = entry
        if budget is not None:
            low = memory_budget_mod.check_budget(
                model, self.strategies, list(self.mesh.shape), self._constraints.pins, budget, source
            )
            entry["smallest_bytes"] = sum(low.values())
        return model

    def optimize_placement(self) -> Plan:
        """Solve for the plan; with several processes, check every rank of
        the mesh holds the same one (:mod:`autoparallel.checks.agreement`), or
        raise naming the ranks and what differs."""
        try:
            plan = self._optimize_placement()
        except Exception as exc:  # the other ranks fail at once, naming this one
            agreement.agree(None, agreement.mesh_ranks(self.mesh), error=exc)
            raise
        agreement.agree(plan, agreement.mesh_ranks(self.mesh), solver_options=self._solver_options())
        return plan

    def _solver_options(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "time_limit": self.time_limit,
            "rel_gap": self.rel_gap,
            "node_limit": solver.DEFAULT_NODE_LIMIT,
            "option_pricing": self._constraints.option_pricing,
            "max_problem_bytes": self._constraints.max_problem_bytes,
        }

    def _optimize_placement(self) -> Plan:
        built = self.build_problem()
        dump_dir = os.environ.get(DUMP_DIR_ENV)
        try:
            if built.lazy:
                built, solution = self._solve_by_pricing(built)
            else:
                with self._stages.stage(f"solve ({len(built.problem.decisions)} decisions)", "solve"):
                    solution, _ = memory_budget_mod.solve_within_budget(
                        built.problem,
                        lambda p: solver.solve(
                            p,
                            backend=self.backend,
                            time_limit=self.time_limit,
                            rel_gap=self.rel_gap,
                            node_limit=solver.DEFAULT_NODE_LIMIT,
                        ),
                    )
        except Exception as exc:
            # the problem is what one needs to debug a failed solve
            if dump_dir:
                self._dump(dump_dir, built, None, None, status=f"{type(exc).__name__}: {exc}")
            if isinstance(exc, solver.InfeasibleError):
                raise infeasibility.describe_conflict(exc, self._constraint_log, self._node_roles()) from exc
            raise
        for phase, seconds in solution.timings.items():
            self.timings[f"solver.{phase}"] = seconds
        with self._stages.stage("plan report", "plan_report"):
            plan = self._make_plan(built, solution)
        plan.timings["plan_report"] = self.timings["plan_report"]
        if dump_dir:
            self._dump(dump_dir, built, solution, plan)
        logger.info("%s", plan.summary(legend=False))
        return plan

    def _solve_by_pricing(self, built: BuiltProblem) -> tuple[BuiltProblem, solver.Solution]:
        """Option pricing (:func:`~.problem.pricing.solve_and_narrow`), seeded by coarse-mesh plans."""
        lifted = []
        if option_pricing.COARSE_SEEDS:
            with self._stages.stage("coarse mesh plans (pricing seeds)", "coarse_seed"), unset_fake_temporarily():
                lifted = coarse_seed.lifted_plans(
                    self.traced,
                    built.strategies,
                    self.mesh,
                    self._with_default_param_bound(self._constraints),
                    device=self.device,
                    overlap=self.overlap,
                    repeats=self.repeats,
                    backend=self.backend,
                    time_limit=self.time_limit,
                )
        return option_pricing.solve_and_narrow(
            built,
            lifted,
            backend=self.backend,
            time_limit=self.time_limit,
            stage=self._stages.stage(f"option pricing ({len(built.problem.decisions)} decisions)", "solve"),
            rebuild=self.build_problem,
        )

    def _dump(
        self,
        directory: str,
        built: BuiltProblem,
        solution: solver.Solution | None,
        plan: Plan | None,
        status: str | None = None,
    ) -> None:
        """The solver dumps (see :func:`~.to_plan.write_dumps`)."""
        seconds = to_plan.write_dumps(directory, self.mesh, built, solution, plan, status)
        if seconds is not None:
            self.timings["dump"] = seconds
            logger.info("wrote solver dumps to %s in %.2fs", directory, seconds)

    def _plan_target(self) -> PlanTarget:
        """What a plan made or applied here is for (the provenance record's source)."""
        return PlanTarget(
            model=self.model,
            traced=self.traced,
            mesh=self.mesh,
            device=self.device,
            mp_policy=self.mp_policy,
            pins=self._constraints.pins,
        )

    def _make_plan(self, built: BuiltProblem, solution: solver.Solution) -> Plan:
        return to_plan.make_plan(
            built,
            solution,
            self.traced,
            self.mesh,
            constraints=dict(self._constraint_log),
            timings=dict(self.timings),
            provenance=provenance(self._plan_target()),
        )

    def apply_placement(
        self,
        plan: Plan,
        *,
        partitioner: Partitioner = "min_cut",
        disable_passes: Sequence[str] = (),
        pass_options: PassOptions | None = None,
        fold_layers: bool = True,
        cudagraphs: bool = False,
        compile: bool = False,
    ) -> nn.Module:
        """A copy of the model whose parameters are DTensors laid out as ``plan``
        says and whose forward runs the plan on per-rank local inputs (see
        :mod:`autoparallel.apply`). The rewrite passes of
        :mod:`autoparallel.passes` run on the way; ``disable_passes`` names
        those to skip, ``pass_options`` is a
        :class:`~autoparallel.passes.PassOptions`; ``fold_layers=False`` builds
        the full graphs instead of copying a middle layer's (slower, same
        result; see :mod:`autoparallel.apply.fold`). ``cudagraphs=True`` runs
        the forward and backward graphs as captured CUDA graphs after one
        warm-up step (:mod:`autoparallel.apply.cudagraphs`). ``compile=True``
        compiles the forward and backward graphs with Inductor, keeping the
        plan's decisions (:mod:`autoparallel.apply.inductor`)."""
        self._require_open()
        from .apply.state import ApplyState
        from .apply_plan import apply_placement
        from .report.applied import record_applied
        from .passes import chunk_options

        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be an autoparallel Plan (or Plan.load_json(path)), got {type(plan).__name__}")
        chunk_options.check_chunk_modules(
            getattr(pass_options, "chunk_modules", None), (name for name, _ in self.model.named_modules())
        )
        # A plan from elsewhere (a file, another context): refuse it when it
        # was made for another model, mesh or input shape, naming which.
        ranks = agreement.mesh_ranks(self.mesh)
        try:
            check_applicable(plan, self._plan_target())
        except PlanMismatch as exc:  # the other ranks fail at once, naming this one
            agreement.agree(None, ranks, what="applied plan", error=exc)
            raise
        # before the first collective: every rank applies the same plan (a
        # plan file loaded on each rank is checked here)
        agreement.agree(plan, ranks, what="applied plan")
        state = ApplyState(
            model=self.model,
            inputs=self.inputs,
            mesh=self.mesh,
            device=self.device,
            traced=self.traced,
            # a loaded plan (Plan.load_json) needs no problem: the traced options suffice
            strategies=self.built.strategies if self.built is not None else self.strategies,
            repeats=self.repeats,
            grad_reduction=self.grad_reduction,
        )
        with self._stages.stage("apply", "apply"):
            model = apply_placement(
                state,
                plan,
                partitioner=partitioner,
                disable_passes=disable_passes,
                pass_options=pass_options,
                fold_layers=fold_layers,
                cudagraphs=cudagraphs,
                compile=compile,
            )
        # what the plan's report shows of the applied step; warns past the memory budget
        record_applied(plan, model, self.mesh, self.device)
        return model
