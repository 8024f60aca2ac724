"""The per-rank memory of the whole training step as one ILP constraint.

What a rank holds at the end of the forward, when the step's memory peaks
(before the transient buffers of the backward), is a sum of tensors each of
which shards with one decision of the ILP:

* per parameter (the parameter's decision): its bytes, its gradient's bytes
  (the traced gradient's dtype: ``reduce_dtype`` under mixed precision) and
  the optimizer's state (:class:`~autoparallel.problem.memory.OptimizerSpec`; AdamW:
  two fp32 moments);
* per activation saved for backward: its bytes, sharded as its producer
  lays it out or, when the backward reads it through a redistribution
  (gathered over tp for a column-parallel matmul), as the reader needs it.
  Which forward values are saved is the partitioner's choice, made later on
  the parallel graph; :func:`saved_activation_nodes` estimates it from the
  joint graph, the min-cut partitioner's rules and the recompute tags of
  activation checkpointing; :func:`~autoparallel.capture.saved_activations.redistributed_inputs` the layouts.

Each term is ``bytes / shard_factor(option)``: linear in the one-hot option
variables, so ``sum over terms <= budget`` is one resource row of the ILP
(:func:`budget_constraint`). Repeated layers linked to one decision keep one
term per layer: presolve sums the weights of linked decisions. One kind of
term depends on two decisions: a value the backward recomputes but reads
through a collective (its redistributed copy is kept, beyond what
recomputing it would keep, and never less than nothing); the row, one
weight per option, bounds it from above (:func:`~autoparallel.capture.saved_activations.redistributed_inputs`).

Checked against runs (tests/autoparallel/problem/test_memory_budget.py,
benchmarks/memory_budget.py): tiny LLaMA-3 on 2 x 2 LocalTensorMode ranks,
without and with selective AC, replicated or data-parallel activations:
parameters, gradients and AdamW state exact, saved activations within 6%;
LLaMA-3 8B on 16 x 8 (selective AC): 3.78 GB estimated, 4.20 GB saved by
the partitioned forward (-10%; before the AC region's recomputed
collectives were told apart, :func:`~autoparallel.capture.saved_activations._regathers`, the estimate was 7.54 GB:
it kept each layer's tp-gathered feed-forward input; the reduce-scattered
feed-forward outputs the policy keeps, :func:`~.memory_peaks.reduced_inputs`,
0.54 GB).

Beyond what the step holds throughout, the model counts the moments that
allocate more (:mod:`.memory_peaks`): the backward's largest live set of
transients, the caller's loss's fp32 copies of the outputs, the optimizer
step's intermediates; the peak (:meth:`StepMemoryModel.peak`) takes the
largest. The linear row sums the state, the saved activations, the outputs
and the one moment largest at the most sharded layouts
(:attr:`StepMemoryModel.row_categories`).

:class:`StepMemoryModel` is the one place the estimate is computed: the ILP's
weights (:meth:`StepMemoryModel.weights`) and the plan's report
(:meth:`StepMemoryModel.estimate`, used by :func:`autoparallel.problem.memory.breakdown`)
both call its per-term methods; the report is the row's value at the plan,
less the row's slack on those two-decision terms.

:func:`solve_within_budget` solves without the budget first: a plan whose
estimate already fits is the optimum of the budgeted problem too (its
relaxation), so the default budget changes neither plans that fit nor their
planning time; only a plan that does not fit is solved again with the row.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx

import solver

from .param_memory import ADAMW, HBM_BYTES, OptimizerSpec, shard_factor, size_text
from .step_memory import CATEGORIES, DURING_BACKWARD, STATE, StepMemoryModel  # noqa: F401  (public here too)
from .memory_peaks import (
    CROSS_ENTROPY,
    LossSpec,
    backward_transients,
    optimizer_step_bytes,
    reduce_scattered_saves,
    reduced_inputs,
)
from ..capture.activation_checkpointing import forward_nodes
from ..options.placements import SpecLabels
from ..capture.saved_activations import (  # noqa: F401  (saved_activation_nodes: public here too)
    nbytes,
    redistributed_inputs,
    saved_activation_nodes,
    saved_and_needed,
    single_output,
)

logger = logging.getLogger(__name__)

# The resource constraint's (and the constraint log's) name.
BUDGET_NAME = "memory budget"
# Default budget: the device's HBM less this fraction, for what the estimate
# leaves out: the CUDA context, NCCL's buffers, allocator fragmentation and
# rounding, and the applied graphs' collective buffers (gathered weights
# read at their gathered size, bucket buffers).
DEFAULT_HBM_MARGIN = 0.10

# -- the budget the user asked for -------------------------------------------------


@dataclass(frozen=True)
class MemoryBudget:
    """Per-rank bytes the whole step may use.

    ``bytes`` is absolute; ``fraction`` is of the device's HBM; neither is
    the default, HBM less :data:`DEFAULT_HBM_MARGIN`. ``enabled=False``
    plans without the constraint (the report still gives the estimate).
    """

    bytes: float | None = None
    fraction: float | None = None
    optimizer: OptimizerSpec = ADAMW
    enabled: bool = True

    def __post_init__(self):
        if self.bytes is not None and self.fraction is not None:
            raise ValueError("memory budget: give bytes or fraction (of the device's HBM), not both")
        if self.bytes is not None and not (isinstance(self.bytes, (int, float)) and self.bytes > 0):
            raise ValueError(f"memory budget: bytes must be a positive number, got {self.bytes!r}")
        if self.fraction is not None and not (isinstance(self.fraction, (int, float)) and 0 < self.fraction <= 1):
            raise ValueError(f"memory budget: fraction (of HBM) must be in (0, 1], got {self.fraction!r}")
        if not isinstance(self.optimizer, OptimizerSpec):
            raise TypeError(f"memory budget: optimizer must be an OptimizerSpec, got {self.optimizer!r}")

    def resolve(self, device: Any) -> tuple[float | None, str]:
        """(bytes, how they were chosen); None bytes: no budget."""
        if not self.enabled:
            return None, "off"
        if self.bytes is not None:
            return float(self.bytes), "given"
        hbm = hbm_bytes(device)
        if hbm is None:
            name = getattr(device, "name", device)
            logger.warning(
                "memory budget: device %r has no known HBM size (autoparallel.problem.memory.HBM_BYTES): "
                "planning without a memory budget; pass add_memory_budget(bytes=...)",
                name,
            )
            return None, f"off: device {name!r} has no known HBM size"
        from .param_memory import size_text

        if self.fraction is not None:
            return self.fraction * hbm, f"{self.fraction:g} of {size_text(hbm)} HBM"
        return (1 - DEFAULT_HBM_MARGIN) * hbm, f"{size_text(hbm)} HBM less {DEFAULT_HBM_MARGIN:.0%}"


def hbm_bytes(device: Any) -> float | None:
    """Device memory of a DeviceSpec (or its dict form): its ``hbm_bytes``
    when it has one, else by preset name."""
    get = device.get if isinstance(device, dict) else lambda k, d=None: getattr(device, k, d)
    return get("hbm_bytes") or HBM_BYTES.get(get("name", ""))


def step_memory_model(
    traced,
    strategies: dict[torch.fx.Node, Any],
    optimizer: OptimizerSpec = ADAMW,
    loss: LossSpec = CROSS_ENTROPY,
    device: Any = None,
) -> StepMemoryModel:
    """The terms of the step's memory: parameters (with their gradients,
    optimizer state and the optimizer step's intermediates), saved
    activations, the outputs and their gradients, the caller's loss's fp32
    copies of the outputs (``loss``) and the backward's largest live set of
    transients, per decision of ``strategies``. ``device``: the one the
    plan is costed for, whose redistributions apply runs (which tells a
    reduce-scatter from an all-reduce, :func:`~.memory_peaks.reduce_scattered_saves`)."""
    terms: dict[str, dict[str, float]] = {}
    per_elem_opt = optimizer.state_bytes_per_element + optimizer.master_bytes_per_element
    for fqn, node in traced.param_nodes.items():
        val = node.meta.get("val")
        if node not in strategies or not isinstance(val, torch.Tensor):
            continue
        grad = traced.grad_nodes.get(fqn)
        gval = grad.meta.get("val") if grad is not None else None
        numel = val.numel()
        terms[node.name] = {
            "parameters": float(numel * val.element_size()),
            "gradients": float(numel * gval.element_size()) if isinstance(gval, torch.Tensor) else 0.0,
            "optimizer": float(numel * per_elem_opt) if grad is not None else 0.0,
            "optimizer_step": optimizer_step_bytes(numel) if grad is not None and per_elem_opt else 0.0,
        }
    skipped = 0
    from .builder import forward_param_chain

    chain = forward_param_chain(traced)
    saved, remade = saved_and_needed(traced.gm, chain)
    counted = set()
    for node in saved:
        strat = strategies.get(node)
        if strat is None or strat.getitem_index is None and not single_output(strat):
            skipped += 1
            continue
        terms.setdefault(node.name, {})["activations"] = float(nbytes(node))
        counted.add(node)
    recomputed_inputs = redistributed_inputs(traced.gm, strategies, chain, remade, counted, terms)
    reduced = reduced_inputs(traced.gm, strategies, counted, set(remade), terms)
    reduce_scattered, rs_tables = reduce_scattered_saves(traced.gm, strategies, counted, set(remade), terms, device)
    # the outputs live from the forward's end through the caller's loss and
    # backward, their gradients from the backward's start: the largest
    # buffers beyond the saved activations (LLaMA's logits)
    ends = list(traced.output_nodes) + list(traced.tangent_nodes.values())
    for node in ends:
        strat = strategies.get(node)
        if node in counted or strat is None or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if strat.getitem_index is None and not single_output(strat):
            continue
        category = "output_grads" if node.op == "placeholder" else "outputs"  # tangents are graph inputs
        terms.setdefault(node.name, {})[category] = float(nbytes(node))
        counted.add(node)
    # the caller's loss: its fp32 copies of each floating output, beyond the
    # output's incoming gradient (made after them, counted in "output_grads")
    for i, node in enumerate(traced.output_nodes):
        strat, val = strategies.get(node), node.meta.get("val")
        if strat is None or not isinstance(val, torch.Tensor) or not val.is_floating_point() or not loss.fp32_copies:
            continue
        if strat.getitem_index is None and not single_output(strat):
            continue
        tangent = traced.tangent_nodes.get(i)
        extra = loss.fp32_copies * val.numel() * 4 - (nbytes(tangent) if tangent is not None else 0)
        if extra > 0:
            terms.setdefault(node.name, {})["loss"] = float(extra)
        # its targets, held by the caller through the step: one per row
        if loss.target_bytes and val.dim() > 1:
            terms.setdefault(node.name, {})["inputs"] = float(loss.target_bytes * val.numel() // val.shape[-1])
    # the batch and the buffers, held throughout
    for node in [*traced.input_nodes, *traced.buffer_nodes.values()]:
        strat = strategies.get(node) if node is not None else None
        if strat is None or node in counted or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if strat.getitem_index is None and not single_output(strat):
            continue
        terms.setdefault(node.name, {})["inputs"] = float(nbytes(node))
    # the backward's largest live set beyond what is counted; the forward
    # casts of parameters the backward reads are gathered again there
    grads = {g for g in traced.grad_nodes.values() if g is not None}
    fwd = forward_nodes(traced.gm)
    regathered = {n for n in chain if n.op == "call_function" and any(u not in fwd for u in n.users)}
    for node in backward_transients(traced.gm, counted | set(saved), set(remade) | regathered, grads):
        strat = strategies.get(node)
        if strat is None or strat.getitem_index is None and not single_output(strat):
            continue
        terms.setdefault(node.name, {})["transients"] = float(nbytes(node))
    if skipped:
        logger.warning("memory model: %d saved values without a single-output decision not counted", skipped)
    model = StepMemoryModel(
        terms,
        optimizer.name,
        per_elem_opt,
        "forward values the backward reads, less AC-recomputed ones",
        recomputed_inputs,
        loss_rule=loss.name,
        reduced_inputs=reduced,
        reduce_scattered=reduce_scattered,
        reduce_scatter_tables=rs_tables,
    )
    with_grads = sum(1 for fqn, node in traced.param_nodes.items() if traced.grad_nodes.get(fqn) is not None)
    if optimizer.bytes_per_tensor and with_grads:
        model.fixed["optimizer"] = float(optimizer.bytes_per_tensor * with_grads)
    if any("loss" in t for t in terms.values()):
        model.fixed["inputs"] = float(loss.value_bytes)  # the loss itself, held to the step's end
    model.row_categories = _row_categories(model, strategies)
    return model


def _row_categories(model: StepMemoryModel, strategies: dict[torch.fx.Node, Any]) -> list[str]:
    """The state, and of the moments that do not overlap (:meth:`StepMemoryModel.peak`)
    the largest with every term at its most sharded layout: a linear row
    bounds one of them, and the report checks the plan against all."""
    by_name = {n.name: n for n in strategies}
    cache: dict[tuple, int] = {}
    smallest = dict.fromkeys(CATEGORIES, 0.0)
    for key, cats in model.terms.items():
        name, k = model.site(key)
        factor = _most_sharded_factor(strategies[by_name[name]], k, cache)
        for cat, b in cats.items():
            smallest[cat] += b / factor
    during = max(DURING_BACKWARD, key=lambda c: smallest[c])
    if smallest["optimizer_step"] > smallest["activations"] + smallest["output_grads"] + smallest[during]:
        return [*STATE, "outputs", "optimizer_step"]
    return [*STATE, "activations", "outputs", "output_grads", during]


def _most_sharded_factor(strat, k: int | None, cache: dict) -> int:
    hit = cache.get((id(strat.options), k))
    if hit is None:
        best = 1
        for o in strat.options:
            spec = o.output_specs if k is None else o.input_specs[k]
            if isinstance(spec, (tuple, list)) or spec is None:
                continue
            best = max(best, math.prod(spec.mesh.size(d) for d, pl in enumerate(spec.placements) if pl.is_shard()))
        hit = cache[(id(strat.options), k)] = best
    return hit


# -- the constraint ---------------------------------------------------------------------


def _labels(strategies, node, cache: dict, k: int | None = None) -> list[str]:
    """Each option's output placements (``k``: its ``k``-th input's)."""
    # option lists are shared by structurally equal nodes: format each once
    opts = strategies[node].options
    labels = cache.get((id(opts), k))
    if labels is None:
        fmt = cache.setdefault("formatter", SpecLabels())
        labels = cache[(id(opts), k)] = [fmt(o.output_specs if k is None else o.input_specs[k]) for o in opts]
    return labels


@dataclass(eq=False)
class BudgetRow(solver.ResourceConstraint):
    """The budget's resource row, and ``exact``: the plan's estimate at a
    solution's choice (decision name -> option index), the step's peak
    (:meth:`StepMemoryModel.peak`); :func:`solve_within_budget` checks an
    unbudgeted plan with it. The row is linear: it sums the state, saved
    activations and outputs and, of the moments that do not overlap, the
    one that is largest at the most sharded layouts
    (:attr:`StepMemoryModel.row_categories`), so it bounds the estimate
    where that moment stays the largest; a binding plan is checked again
    with ``exact``."""

    exact: Callable[[dict[str, int]], float] | None = field(default=None, repr=False)

    def __eq__(self, other):
        # the constraint is its name, weights and bounds; ``exact`` derives
        # from them (a problem dump decodes to a plain ResourceConstraint)
        if not isinstance(other, solver.ResourceConstraint):
            return NotImplemented
        fields = ("name", "terms", "low", "high")
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    __hash__ = None


def budget_constraint(
    model: StepMemoryModel, strategies: dict[torch.fx.Node, Any], mesh_shape: list[int], budget: float
) -> BudgetRow:
    """``sum over decisions of weights[chosen option] <= budget``."""
    by_name = {n.name: n for n in strategies}
    labels: dict[tuple, list[str]] = {}
    cache: dict[tuple, dict[str, list[float]]] = {}
    terms: dict[str, list[float]] = {}
    # per decision and category, the bytes per option: the peak at a choice
    by_category: dict[str, dict[str, list[float]]] = {}
    for key, cats in model.terms.items():
        name, k = model.site(key)
        node = by_name[name]
        most = model.recomputed_inputs[key][1] if key in model.recomputed_inputs else None
        ckey = (id(strategies[node].options), k, tuple(sorted(cats.items())), most)
        cw = cache.get(ckey)
        if cw is None:
            cw = cache[ckey] = model.category_weights(key, _labels(strategies, node, labels, k), mesh_shape)
        mine = by_category.setdefault(name, {})
        for cat, w in cw.items():  # several terms on one decision: one weight per option
            mine[cat] = [a + b for a, b in zip(mine[cat], w)] if cat in mine else list(w)
    for name, cats in by_category.items():
        row = [cats[c] for c in model.row_categories if c in cats]
        if row:
            terms[name] = [sum(ws) for ws in zip(*row)]

    def exact(choice: dict[str, int]) -> float:
        parts = dict.fromkeys(CATEGORIES, 0.0)
        parts.update({c: b for c, b in model.fixed.items()})
        for name, cats in by_category.items():
            for cat, w in cats.items():
                parts[cat] += w[choice[name]]
        for key, producer in model.two_decision().items():
            if producer not in choice:  # not a decision of this problem: the bound stands
                continue
            reader, k = model.site(key)
            i = _labels(strategies, by_name[reader], labels, k)[choice[reader]]
            o = _labels(strategies, by_name[producer], labels)[choice[producer]]
            held, bound = model.held(key, i, o, mesh_shape), model.per_rank(key, i, mesh_shape)
            parts["activations"] += held["activations"] - bound["activations"]
        for key, readers in model.reduce_scattered.items():
            sites = [[(src, *model.site(site)) for src, site, _ in edges] for edges in readers]
            names = {key} | {n for edges in sites for src, r, _ in edges for n in (src, r)}
            if any(n not in choice for n in names):
                continue  # not decisions of this problem: the bound stands
            o = _labels(strategies, by_name[key], labels)[choice[key]]
            read = [
                [
                    (
                        _labels(strategies, by_name[src], labels)[choice[src]],
                        _labels(strategies, by_name[r], labels, j)[choice[r]],
                    )
                    for src, r, j in edges
                ]
                for edges in sites
            ]
            kept = model.kept_reduce_scattered(key, o, read, mesh_shape)["activations"]
            parts["activations"] += kept - model.per_rank(key, o, mesh_shape)["activations"]
        return model.peak(parts)

    # bytes are exact in float up to 2**53; the slack absorbs summation order
    fixed = model.row_bytes(model.fixed)
    return BudgetRow(BUDGET_NAME, terms, high=(budget - fixed) * (1 + 1e-9), exact=lambda c: exact(c) - fixed)


def smallest(
    model: StepMemoryModel, strategies: dict[torch.fx.Node, Any], mesh_shape: list[int], pins: dict
) -> dict[str, float]:
    """Per category, the per-rank bytes with every term at its smallest
    option allowed by the pins: a lower bound on any plan's estimate (equal
    to the smallest reachable when no edge rules the combination out)."""
    by_name = {n.name: n for n in strategies}
    labels: dict[tuple, list[str]] = {}
    best: dict[tuple, str] = {}
    out = dict.fromkeys(CATEGORIES, 0.0)
    out.update({c: b for c, b in model.fixed.items()})
    for key, cats in model.terms.items():
        name, k = model.site(key)
        node = by_name[name]
        pin = pins.get(name)
        allowed = None if pin is None else "".join(_fmt(p) for p in pin[1])
        # every term is non-negative and shrinks as its layout shards more
        ckey = (id(strategies[node].options), k, allowed)
        lab = best.get(ckey)
        if lab is None:
            mine = _labels(strategies, node, labels, k)
            outs = _labels(strategies, node, labels)
            cands = {m for m, o in zip(mine, outs) if allowed is None or o == allowed} or set(mine)
            lab = best[ckey] = max(cands, key=lambda x: shard_factor(x, mesh_shape))
        for cat, b in model.per_rank(key, lab, mesh_shape).items():
            out[cat] += b
    return out


def _fmt(p) -> str:
    from ..options.placements import format_placement

    return format_placement(p)


def describe(parts: dict[str, float]) -> str:
    return ", ".join(f"{cat} {size_text(parts[cat])}" for cat in CATEGORIES if parts.get(cat))


def describe_entry(entry: dict, reachable: tuple[float, float | None] | None = None) -> str:
    """A constraint-log entry of the budget in words, for conflict messages;
    ``reachable``: the solver diagnosis' ``(bound, reached)`` of the
    budget row under the other constraints of the conflict."""
    text = f"{size_text(entry['budget_bytes'])} per rank, {entry.get('source', '')}"
    if entry.get("smallest_bytes") is not None:
        text += f"; every term at its smallest layout: {size_text(entry['smallest_bytes'])}"
    if reachable is not None:
        text += f"; no plan under the other constraints needs less than {size_text(reachable[0])}"
    return text


def check_budget(
    model: StepMemoryModel,
    strategies: dict[torch.fx.Node, Any],
    mesh_shape: list[int],
    pins: dict,
    budget: float,
    source: str,
) -> dict[str, float]:
    """Raise :class:`~autoparallel.problem.infeasibility.InfeasibleConstraintError`
    (before any ILP) when even the smallest layout of every term exceeds the
    budget; returns that lower bound by category. (A budget above it may
    still be infeasible through the graph's edges: the solver then names
    the budget.)"""
    from ..errors import InfeasibleConstraintError

    low = smallest(model, strategies, mesh_shape, pins)
    total = sum(low.values())
    if total > budget * (1 + 1e-9):
        pinned = [c for name, (c, _) in pins.items() if name in model.terms]
        raise InfeasibleConstraintError(
            f"{BUDGET_NAME}: the smallest per-rank memory any plan can reach is at least {size_text(total)} "
            f"({describe(low)}; every tensor as sharded as its options"
            + (" and the pins " + ", ".join(repr(c) for c in pinned) if pinned else "")
            + f" allow), above the budget of {size_text(budget)} ({source}). To fit: use more ranks or a "
            "smaller batch, activation checkpointing (autoparallel.capture.activation_checkpointing.apply_ac), "
            "an optimizer with less state (add_memory_budget(optimizer=...)), raise the budget "
            "(add_memory_budget(bytes=...)), or plan without it (AutoParallel(..., memory_budget=False))",
            conflict=[BUDGET_NAME, *pinned],
        )
    return low


# -- solving --------------------------------------------------------------------------------


def solve_within_budget(problem: solver.Problem, solve: Callable[[solver.Problem], solver.Solution]):
    """Solve ``problem`` with its memory budget row only when it binds.

    Without the row the problem is a relaxation: when its optimum fits the
    budget, that optimum is optimal with the row too (and a time-limited
    solve's bound is a bound of both). It fits when the model's estimate
    (:attr:`BudgetRow.exact`) does, which the row bounds from above.
    Returns ``(solution, binding)``.
    """
    budget = next((r for r in problem.resources if r.name == BUDGET_NAME), None)
    if budget is None:
        return solve(problem), False
    relaxed = dataclasses.replace(problem, resources=[r for r in problem.resources if r is not budget])
    sol = solve(relaxed)
    used = sum(w[sol.choice[name]] for name, w in budget.terms.items())
    # the row bounds the estimate from above: a plan whose estimate fits is
    # the optimum of the problem under the estimate too
    exact = budget.exact(sol.choice) if isinstance(budget, BudgetRow) and budget.exact else used
    if exact <= budget.high:
        logger.info(
            "memory budget: not binding (%.4g of %.4g bytes per rank; the row's bound %.4g)", exact, budget.high, used
        )
        return sol, False
    logger.info(
        "memory budget: the unconstrained plan needs %.4g bytes per rank, over %.4g: solving with the budget",
        used,
        budget.high,
    )
    t = sol.timings
    full = solve(problem)
    # planning time includes the first solve
    for k, v in t.items():
        full.timings[f"unbudgeted {k}"] = v
    if isinstance(budget, BudgetRow) and budget.exact and full.choice:
        peak = budget.exact(full.choice)
        if peak > budget.high:
            logger.warning(
                "memory budget: the plan's estimated peak, %.4g bytes per rank, exceeds the budget of %.4g: "
                "a moment the budget's row does not sum (the caller's loss, the backward's transients or the "
                "optimizer step) is the largest at this plan; lower the budget by the difference",
                peak,
                budget.high,
            )
    return full, True


def used_bytes(problem: solver.Problem, choice: dict[str, int]) -> float | None:
    budget = next((r for r in problem.resources if r.name == BUDGET_NAME), None)
    if budget is None:
        return None
    return sum(w[choice[name]] for name, w in budget.terms.items())
