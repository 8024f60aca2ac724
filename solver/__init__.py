"""Torch-free placement solver: problem model, presolve, ILP, backends, JSON.

Nothing under ``solver/`` imports torch; it can be used and tested with
hand-made problems.
"""

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

__all__ = [
    "INF",
    "Decision",
    "Edge",
    "Link",
    "Pin",
    "PresolveStats",
    "Problem",
    "ProblemError",
    "ResourceConstraint",
    "Solution",
]
