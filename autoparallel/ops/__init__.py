"""Custom ops of the planner, registered as ``torch.ops.autoparallel.*`` on import.

:mod:`autoparallel.ops.moe`: the routed-experts op ``moe_experts`` with its
backward and gradient-layout ops.
"""

from . import moe  # noqa: F401  (registers the ops)
