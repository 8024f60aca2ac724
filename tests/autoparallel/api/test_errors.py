"""One error hierarchy: every kind is an AutoParallelError and keeps the
built-in base callers catch."""

import pytest

import solver
import autoparallel
from autoparallel import (
    ApplyError,
    AutoParallelError,
    ConstraintError,
    DataDependentTraceError,
    InfeasibleConstraintError,
    PlanMismatch,
    ProblemTooLarge,
)
from autoparallel.errors import UnsupportedRedistribution


@pytest.mark.parametrize(
    "kind, builtin",
    [
        (ApplyError, RuntimeError),
        (ConstraintError, ValueError),
        (InfeasibleConstraintError, ValueError),
        (DataDependentTraceError, RuntimeError),
        (PlanMismatch, ValueError),
        (ProblemTooLarge, RuntimeError),
        (UnsupportedRedistribution, NotImplementedError),
    ],
)
def test_every_kind_is_an_autoparallel_error(kind, builtin):
    assert issubclass(kind, AutoParallelError)
    assert issubclass(kind, builtin)


def test_infeasible_constraint_is_also_the_solvers_error():
    err = InfeasibleConstraintError("input constraint 0: no layout", conflict=["input constraint 0"])
    assert isinstance(err, solver.InfeasibleError) and isinstance(err, ConstraintError)
    assert err.conflict == ["input constraint 0"]


def test_old_import_paths_name_the_same_classes():
    from autoparallel.apply.redistribute import ApplyError as apply_error
    from autoparallel.capture.tracing import DataDependentTraceError as trace_error
    from autoparallel.problem.builder import ProblemTooLarge as too_large
    from autoparallel.checks.provenance import PlanMismatch as mismatch
    from autoparallel.validation import ConstraintError as constraint_error

    assert (apply_error, trace_error, too_large, mismatch, constraint_error) == (
        ApplyError,
        DataDependentTraceError,
        ProblemTooLarge,
        PlanMismatch,
        ConstraintError,
    )
    assert set(autoparallel.__all__) >= {"AutoParallelError", "ApplyError", "InfeasibleConstraintError"}
