"""What apply needs from planning: :class:`ApplyState`.

``AutoParallel.apply_placement`` builds one from its traced step and hands
it to :func:`autoparallel.apply_plan.apply_placement`; apply reads nothing else
of the facade, so a plan can be applied from any source of these fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch.fx as fx
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from ..capture.repeated_layers import RepeatedLayers
    from ..capture.tracing import TracedStep
    from ..cost_model import DeviceSpec
    from ..options.strategies import NodeStrategy

__all__ = ["ApplyState", "GradReduction"]

# How parameter gradients combine the ranks' losses (AutoParallel's
# ``grad_reduction``): of their sum, or of their mean over the output's shards.
GradReduction = Literal["sum", "mean"]


@dataclass(frozen=True)
class ApplyState:
    """The planning results and settings a plan is applied with."""

    model: nn.Module  # the user's module (usually on the meta device)
    inputs: Any  # the example inputs, as given to AutoParallel (or a callable making them)
    mesh: DeviceMesh
    device: DeviceSpec  # the cost model's device (the local graph's costs)
    traced: TracedStep  # the joint graph and its parameter / input nodes
    # the placement options per node that the plan's choice indexes (the
    # built problem's, pruned, when there is one; else the traced ones)
    strategies: dict[fx.Node, NodeStrategy]
    repeats: RepeatedLayers | None  # repeated layers (None: found again when folding)
    grad_reduction: GradReduction = "sum"
