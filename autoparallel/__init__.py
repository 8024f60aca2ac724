"""autoparallel: automatic parallelism planning for PyTorch training.

``with AutoParallel(model, mesh, inputs) as autop:`` traces one training
step, lists DTensor placement options for every node, and
``autop.optimize_placement()`` picks one per node with an integer linear
program (see README.md).
"""

from .checks.agreement import PlanDisagreement
from .api import AutoParallel, ConstraintError
from .apply.compile import autoparallel_backend
from .apply.cudagraphs import CudaGraphError, release_cuda_graphs
from .cost_model import CommOverlapPolicy, DeviceSpec
from .errors import (
    ApplyError,
    AutoParallelError,
    DataDependentTraceError,
    InfeasibleConstraintError,
    PlanMismatch,
    ProblemTooLarge,
)
from .plan import NodePlan, Plan, diff
from .options.strategies import register_rule

__all__ = [
    "ApplyError",
    "AutoParallel",
    "AutoParallelError",
    "CommOverlapPolicy",
    "ConstraintError",
    "CudaGraphError",
    "DataDependentTraceError",
    "DeviceSpec",
    "InfeasibleConstraintError",
    "NodePlan",
    "autoparallel_backend",
    "Plan",
    "PlanDisagreement",
    "PlanMismatch",
    "ProblemTooLarge",
    "diff",
    "register_rule",
    "release_cuda_graphs",
]
