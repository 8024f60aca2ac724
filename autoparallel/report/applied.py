"""What the plan records of the applied step: its collectives' traffic, the
overlap scheduler's timeline and memory curve (the HTML report draws them),
and a warning where the step's estimated peak memory exceeds the budget or
the applied graphs' live bytes exceed the estimate."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from torch._subclasses.fake_tensor import unset_fake_temporarily

if TYPE_CHECKING:
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from ..cost_model import DeviceSpec

logger = logging.getLogger(__name__)

__all__ = ["record_applied"]


class AppliedPlan(Protocol):
    """What :func:`record_applied` sets on an :class:`autoparallel.plan.Plan`
    (it hands the whole plan to :func:`~autoparallel.problem.memory.breakdown`).
    A Protocol, since plan.py sits above report (its summaries are report
    code) and report may not import it."""

    collectives: list[dict]
    timeline: dict[str, Any]


def record_applied(plan: AppliedPlan, model: nn.Module, mesh: DeviceMesh, device: DeviceSpec) -> None:
    """Set ``plan.collectives`` and ``plan.timeline`` from the applied
    ``model``'s forward and backward graphs; log a warning when the step's
    peak memory (:func:`~autoparallel.problem.memory.breakdown`) exceeds the
    memory budget, or the applied graphs' live bytes exceed that estimate."""
    from ..apply.collectives import traffic_table
    from ..problem.memory import breakdown
    from .timeline import simulate

    graphs = {"forward": model.forward_graph, "backward": model.backward_graph}
    plan.collectives = traffic_table(graphs, mesh, device)
    # what the HTML report draws: the scheduler's timeline and memory curve
    with unset_fake_temporarily():
        plan.timeline = {phase: simulate(gm, mesh, device) for phase, gm in graphs.items()}
    mem = breakdown(plan)
    if mem.budget is not None and mem.total > mem.budget * (1 + 1e-9):
        logger.warning(
            "memory: the step's estimated peak, %.2f GB per rank, exceeds the memory budget of %.2f GB; lower "
            "add_memory_budget by the difference and plan again",
            mem.total / 1e9,
            mem.budget / 1e9,
        )
    applied = mem.applied
    if mem.planned_peak is not None and applied is not None and applied > mem.planned * (1 + 1e-9):
        # the scheduler's order of the applied graphs holds more than the
        # planner's estimate of the whole step: a term the model misses
        logger.warning(
            "memory: the applied graphs' live-bytes peak (overlap scheduler), %.2f GB per rank, exceeds the "
            "planner's estimate of the step, %.2f GB",
            applied / 1e9,
            mem.planned / 1e9,
        )
