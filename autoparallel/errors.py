"""The errors autoparallel raises for a user to act on, under one base class.

``except AutoParallelError`` catches every one of them. Each kind also keeps
the built-in base callers already catch (``ValueError``, ``RuntimeError``,
``NotImplementedError``), and :class:`InfeasibleConstraintError` is also the
solver's :class:`solver.InfeasibleError`::

    AutoParallelError
    ├── ConstraintError (ValueError)            a malformed constraint
    │   └── InfeasibleConstraintError           one no plan can satisfy
    ├── DataDependentTraceError (RuntimeError)  the step branches on tensor values
    ├── ProblemTooLarge (RuntimeError)          too big to solve, and why
    ├── PlanMismatch (ValueError)               a plan for another model / mesh / input
    ├── ApplyError (RuntimeError)               the plan cannot be applied or run here
    └── UnsupportedRedistribution (NotImplementedError)

Every message names the argument, node, module path, input or constraint
concerned and says what would be valid.
"""

from __future__ import annotations

from typing import Any

import solver

__all__ = [
    "AutoParallelError",
    "ApplyError",
    "ConstraintError",
    "DataDependentTraceError",
    "InfeasibleConstraintError",
    "PlanMismatch",
    "ProblemTooLarge",
    "UnsupportedRedistribution",
]


class AutoParallelError(Exception):
    """Base class of the errors autoparallel raises for the user."""


class ConstraintError(AutoParallelError, ValueError):
    """A user constraint is malformed (wrong count, length, dim, node name)."""


class InfeasibleConstraintError(solver.InfeasibleError, ConstraintError):
    """A constraint no plan can satisfy, with the reason in user terms.

    Both a :class:`solver.InfeasibleError` (what solving raises for
    conflicting constraints) and a :class:`ConstraintError`.
    """


class DataDependentTraceError(AutoParallelError, RuntimeError):
    """The traced step branches on (or reads) the value of a tensor."""


class ProblemTooLarge(AutoParallelError, RuntimeError):
    """The estimated problem exceeds ``Constraints.max_problem_bytes``."""

    def __init__(self, message: str, size: Any):
        super().__init__(message)
        # an autoparallel.problem.size_figures.ProblemSize: errors sits below
        # every pipeline stage, so it names the type without importing it
        self.size = size


class PlanMismatch(AutoParallelError, ValueError):
    """A plan is applied to something other than what it was made for."""


class ApplyError(AutoParallelError, RuntimeError):
    """The plan cannot be applied to the graph, or the parallel module cannot
    run in this process (names the node, parameter, buffer or rank)."""


class UnsupportedRedistribution(AutoParallelError, NotImplementedError):
    """A transition apply cannot run (e.g. one that needs uneven shards)."""
