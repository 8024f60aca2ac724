"""Torch-free placement solver: problem model, presolve, ILP, backends, JSON.

Nothing under ``solver/`` imports torch; it can be used and tested with
hand-made problems.
"""

from .api import ilp_only, solve
from .backends import SolverError, available_backends
from .diagnose import InfeasibleError
from .evaluate import evaluate, violations
from .pricing import PricingResult, PricingStats, solve_by_pricing
from .problem import (
    INF,
    Decision,
    Edge,
    Link,
    Pin,
    PresolveStats,
    Problem,
    ProblemError,
    ResourceConstraint,
    Solution,
)
from .work import DEFAULT_NODE_LIMIT

__all__ = [
    "DEFAULT_NODE_LIMIT",
    "INF",
    "Decision",
    "Edge",
    "Link",
    "Pin",
    "PresolveStats",
    "Problem",
    "PricingResult",
    "PricingStats",
    "ProblemError",
    "ResourceConstraint",
    "Solution",
    "InfeasibleError",
    "SolverError",
    "available_backends",
    "ilp_only",
    "evaluate",
    "solve",
    "solve_by_pricing",
    "violations",
]
