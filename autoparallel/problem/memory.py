"""Per-rank memory of a training step, as a function of the chosen placements.

The persistent state of a parameter is linear in its local size: parameter
bytes + gradient bytes + optimizer state bytes, each ``numel / shard_factor``
elements, where ``shard_factor`` is the product of the mesh dims the chosen
placement shards it over. :func:`param_state_bytes` is that coefficient per
option, so an ILP can bound the sum the way the parameter-memory
constraint does; :func:`breakdown` reports a plan's memory per rank.

One figure, in GB (10^9 bytes): the peak per rank, the planner's estimate
(:class:`MemoryBreakdown`), which the memory budget
(:mod:`autoparallel.problem.memory_budget`) bounds and ``plan.summary()``
shows: parameters + gradients + optimizer state + the saved activations,
the step's outputs and their gradients, and the largest of the moments that
allocate more (the backward's transients, the caller's loss, the optimizer
step: :mod:`autoparallel.problem.memory_peaks`). Once applied, the overlap
scheduler's live-bytes peak of the forward and backward graphs is shown
beside it. Plans made without the step's memory model get parameters from
their placements and activations from the scheduler's peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .memory_budget import StepMemoryModel
from .param_memory import (  # noqa: F401 - re-exported: the memory vocabulary
    ADAMW,
    DTYPE_BYTES,
    GB,
    HBM_BYTES,
    UNIT_NOTE,
    OptimizerSpec,
    param_state_bytes,
    placement_tokens,
    shard_factor,
    size_text,
)


@dataclass
class MemoryBreakdown:
    """Bytes per rank.

    The one figure is :attr:`total`, the peak per rank. For a plan made with
    the step's memory model it is the planner's estimate (:attr:`planned`,
    what the memory budget bounds): parameters + gradients + optimizer state
    + the larger of (saved activations + the step's outputs and their
    incoming gradients + the larger of the backward's transients and the
    caller's loss's fp32 copies of the outputs) and the optimizer step's
    intermediates (:meth:`~autoparallel.problem.memory_budget.StepMemoryModel.peak`).
    Once applied, the overlap scheduler's live-bytes peak of the forward and
    backward graphs (:attr:`scheduler_activations`) is shown beside it: it
    covers the graphs only, not the loss or the optimizer step. Plans made
    without the model take their activations from the scheduler's peak."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float  # saved for backward (the planner's estimate), or the scheduler's peak for older plans
    hbm: float  # device memory, bytes
    optimizer_name: str = "AdamW"
    activations_source: str = ""
    notes: list[str] = field(default_factory=list)
    # the memory budget the plan was made under (None: none), how it was set
    budget: float | None = None
    budget_source: str = ""
    # activations and transients at the overlap scheduler's live-bytes
    # peak, once applied (outputs and their gradients included)
    scheduler_activations: float | None = None
    # the step's outputs and their incoming gradients (the planner's estimate)
    outputs: float = 0.0
    # the moments beyond (the planner's estimate): the backward's largest
    # live set of transients, the caller's loss's fp32 copies of the
    # outputs, the optimizer step's intermediates
    transients: float = 0.0
    loss: float = 0.0
    inputs: float = 0.0  # the batch and the buffers
    optimizer_step: float = 0.0
    loss_rule: str = ""
    # the planner's peak (None: a plan made without the step's memory model)
    planned_peak: float | None = None

    @property
    def state(self) -> float:
        """Parameters, gradients and optimizer state."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def planned(self) -> float:
        """The planner's estimate of the peak, which the memory budget bounds."""
        if self.planned_peak is not None:
            return self.planned_peak
        return self.state + self.activations + self.outputs

    @property
    def peak_activations(self) -> float:
        """Everything at the peak beyond the state."""
        if self.planned_peak is None and self.scheduler_activations is not None:
            return self.scheduler_activations
        return self.planned - self.state

    @property
    def total(self) -> float:
        """The peak per rank: the planner's estimate, or for plans made
        without the step's memory model the state + the scheduler's peak."""
        return self.state + self.peak_activations

    @property
    def applied(self) -> float | None:
        """State + the overlap scheduler's live-bytes peak of the applied
        graphs (None before apply)."""
        return None if self.scheduler_activations is None else self.state + self.scheduler_activations

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm and (self.budget is None or self.total <= self.budget * (1 + 1e-9))

    def lines(self) -> list[str]:
        modelled = self.planned_peak is not None
        out = [
            f"parameters   {size_text(self.parameters):>10s}",
            f"gradients    {size_text(self.gradients):>10s}",
            f"optimizer    {size_text(self.optimizer):>10s} ({self.optimizer_name})",
        ]
        if modelled:
            if self.inputs:
                out.append(f"inputs       {size_text(self.inputs):>10s} (the batch and the buffers)")
            out.append(
                f"activations  {size_text(self.activations):>10s}"
                + (f" ({self.activations_source})" if self.activations_source else "")
            )
            if self.outputs:
                out.append(
                    f"outputs      {size_text(self.outputs):>10s} (the step's outputs and their incoming gradients)"
                )
            moments = [
                ("transients", self.transients, "the backward's largest live set beyond the saved values"),
                ("loss", self.loss, f"the caller's loss: {self.loss_rule}" if self.loss_rule else "the caller's loss"),
                ("optim. step", self.optimizer_step, f"{self.optimizer_name}'s foreach intermediates"),
            ]
            for name, b, what in moments:
                if b:
                    out.append(f"{name:12s} {size_text(b):>10s} ({what})")
            if any(b for _, b, _ in moments):
                out.append(
                    "             these moments do not overlap: the peak counts the larger of the transients and "
                    "the loss with the saved activations and the outputs' gradients, or the optimizer step"
                )
        else:
            shown = self.scheduler_activations if self.scheduler_activations is not None else self.activations
            out.append(
                f"activations  {size_text(shown):>10s}"
                + (
                    " (activations and transients at the overlap scheduler's live-bytes peak)"
                    if self.scheduler_activations is not None
                    else ""
                )
            )
        out.append(
            f"peak         {size_text(self.total):>10s} per rank of {size_text(self.hbm)} HBM "
            f"({_percent(self.total / self.hbm)})" + ("; the planner's estimate" if modelled else "")
        )
        if modelled and self.applied is not None:
            out.append(
                f"applied      {size_text(self.applied):>10s} (state + the overlap scheduler's live-bytes peak of the "
                "applied forward and backward graphs: without the caller's loss and the optimizer step)"
            )
        if self.budget is not None:
            line = (
                f"budget       {size_text(self.budget):>10s} ({self.budget_source}): bounds the planner's estimate, "
                f"{size_text(self.planned)} ({_percent(self.planned / self.budget)})"
            )
            if self.total != self.planned:  # a plan made without the step's memory model, applied
                line += f"; the peak is {_percent(self.total / self.budget)} of it"
            out.append(line)
            worst = max(self.total, self.applied or 0.0)
            if worst > self.budget * (1 + 1e-9):
                out.append(
                    f"WARNING: {size_text(worst)} per rank exceeds the budget: lower the budget "
                    "(add_memory_budget) by the difference and plan again"
                )
        elif self.budget_source:
            out.append(f"budget       none ({self.budget_source})")
        if self.total > self.hbm:
            out.append(
                f"WARNING: does not fit: {size_text(self.total)} needed per rank, the device has "
                f"{size_text(self.hbm)} (shard more, recompute more, or use a smaller batch)"
            )
        return out + self.notes


def _percent(fraction: float) -> str:
    from solver import units

    return units.percent(fraction)


def breakdown(plan, *, optimizer: OptimizerSpec | None = None, hbm_bytes: float | None = None) -> MemoryBreakdown:
    """Per-rank memory of ``plan`` (an :class:`~autoparallel.plan.Plan`): the
    memory budget's estimate at its chosen placements (the number the ILP
    bounded) when the plan has the step's memory model, else its parameters'
    placements and, once applied, the scheduler's live-bytes peak of the
    forward and backward graphs. ``optimizer`` (default: the plan's, AdamW)
    restates the optimizer state for another optimizer."""
    prov = plan.provenance or {}
    hbm_notes: list[str] = []
    if hbm_bytes is None:
        device = prov.get("device") or {}
        name = device.get("name", "H100")
        hbm_bytes = device.get("hbm_bytes") or HBM_BYTES.get(name)
        if hbm_bytes is None:
            hbm_bytes = HBM_BYTES["H100"]
            hbm_notes.append(f"device {name!r} has no known HBM size: {size_text(hbm_bytes)} assumed (pass hbm_bytes=)")
    entry = (plan.constraints or {}).get("memory budget")
    if isinstance(entry, dict) and "model" in entry:
        return _budget_breakdown(plan, entry, optimizer, hbm_bytes, hbm_notes)
    optimizer = optimizer or ADAMW
    mesh = plan.mesh_shape
    reduce_dtype = (prov.get("mp_policy") or {}).get("reduce_dtype")
    params = grads = opt = 0.0
    for n in plan.nodes.values():
        if not n.is_parameter or n.shape is None:
            continue
        pbytes = DTYPE_BYTES.get(n.dtype or "float32", 4)
        gbytes = DTYPE_BYTES.get(reduce_dtype, pbytes) if reduce_dtype not in (None, "None") else pbytes
        p, g, o = param_state_bytes(
            math.prod(n.shape), shard_factor(n.output_placements, mesh), pbytes, gbytes, optimizer
        )
        params, grads, opt = params + p, grads + g, opt + o
    notes = hbm_notes
    peak = _scheduler_activations(plan, params, grads)
    if peak is None:
        notes.append("activations not estimated: apply the plan (the overlap scheduler measures them)")
    return MemoryBreakdown(params, grads, opt, 0.0, hbm_bytes, optimizer.name, "", notes, scheduler_activations=peak)


def _scheduler_activations(plan, params: float, grads: float) -> float | None:
    peaks = _scheduler_peaks(plan.pass_stats)
    if not peaks:
        return None
    fw, bw = peaks.get("forward", 0), peaks.get("backward", 0)
    # the scheduler's live bytes count the parameter shards (inputs of
    # both graphs) and, in the backward, the gradients it produces
    return max(fw - params, bw - params - grads, 0.0)


def _budget_breakdown(plan, entry: dict, optimizer: OptimizerSpec | None, hbm: float, notes: list[str]):
    model = StepMemoryModel.from_json(entry["model"])
    est = model.estimate(plan.nodes, plan.mesh_shape)
    if any(b < 0 for term in model.terms.values() for b in term.values()):
        notes = notes + [
            "estimated by a memory model that charged values recomputed for the backward below zero "
            "(plans made before that was fixed): plan again for a corrected estimate"
        ]
    slack = model.row_bytes(model.estimate(plan.nodes, plan.mesh_shape, row=True)) - model.row_bytes(est)
    if slack > 1e-9 * sum(est.values()):
        notes = notes + [
            f"the budget's ILP row counts {size_text(slack)} more: a value recomputed for the backward but read "
            "in another layout, or saved reduce-scattered, weighed one option at a time, is bounded from above"
        ]
    name = model.optimizer
    if optimizer is not None and model.optimizer_bytes_per_element:
        per_elem = optimizer.state_bytes_per_element + optimizer.master_bytes_per_element
        est["optimizer"] *= per_elem / model.optimizer_bytes_per_element
        name = optimizer.name
    return MemoryBreakdown(
        est["parameters"],
        est["gradients"],
        est["optimizer"],
        est["activations"],
        hbm,
        name,
        "saved for backward, estimated: " + model.activations_rule,
        notes,
        budget=entry.get("budget_bytes"),
        budget_source=entry.get("source", ""),
        scheduler_activations=_scheduler_activations(plan, est["parameters"], est["gradients"]),
        outputs=est.get("outputs", 0.0) + est.get("output_grads", 0.0),
        transients=est.get("transients", 0.0),
        loss=est.get("loss", 0.0),
        inputs=est.get("inputs", 0.0),
        optimizer_step=est.get("optimizer_step", 0.0),
        loss_rule=model.loss_rule,
        planned_peak=model.peak(est),
    )


def _scheduler_peaks(pass_stats: dict) -> dict[str, float]:
    stats = (pass_stats or {}).get("schedule_overlap") or {}
    out = {}
    for graph, s in stats.items():
        v = s.get("peak_memory_after") if isinstance(s, dict) else getattr(s, "peak_memory_after", None)
        if v:
            out[graph] = float(v)
    return out
