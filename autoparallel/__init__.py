"""autoparallel: automatic parallelism planning for PyTorch training.

``with AutoParallel(model, mesh, inputs) as autop:`` traces one training
step, lists DTensor placement options for every node, and
``autop.optimize_placement()`` picks one per node with an integer linear
program (see README.md).
"""

from .agreement import PlanDisagreement
from .api import AutoParallel, ConstraintError
from .apply.compile import autoparallel_backend
from .cost_model import CommOverlapPolicy, DeviceSpec
from .plan import NodePlan, Plan, diff
from .provenance import PlanMismatch
from .problem.builder import ProblemTooLarge
from .options.strategies import register_rule
from .capture.tracing import DataDependentTraceError

__all__ = [
    "AutoParallel",
    "CommOverlapPolicy",
    "ConstraintError",
    "DataDependentTraceError",
    "DeviceSpec",
    "NodePlan",
    "autoparallel_backend",
    "Plan",
    "PlanDisagreement",
    "PlanMismatch",
    "ProblemTooLarge",
    "diff",
    "register_rule",
]
