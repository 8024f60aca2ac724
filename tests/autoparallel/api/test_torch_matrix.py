"""benchmarks/torch_matrix.py's pure parts: where environments live, what
each check runs, how outputs become pass/fail cells and the table."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tm():
    spec = importlib.util.spec_from_file_location("torch_matrix", ROOT / "benchmarks" / "torch_matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_venv_location_and_requirements(tm):
    assert tm.venv_dir("2.14.1") == Path(tempfile.gettempdir()) / "autoparallel-torch-matrix" / "torch-2.14.1"
    reqs = tm.project_requirements()
    names = {tm._req_name(r) for r in reqs}
    assert "torch" not in names and "ruff" not in names  # torch at the version under test
    assert {"pulp", "highspy", "networkx", "pytest", "transformers"} <= names


def test_checks_run_the_example_and_the_smoke_marker(tm):
    assert tm.check_command("plan", apply_model="8B") == ["examples/example_llama3.py", "--no-apply"]
    assert tm.check_command("apply", apply_model="8B") == ["examples/example_llama3.py"]
    assert "--model" in tm.check_command("apply", apply_model="debug")
    smoke = tm.check_command("smoke", apply_model="8B")
    assert smoke[smoke.index("-m", 2) + 1] == "smoke" and smoke[-1] == "tests/autoparallel"
    with pytest.raises(ValueError, match="unknown check"):
        tm.check_command("lint", apply_model="8B")


def test_estimates_are_parsed_from_the_example_output(tm):
    planned = "  estimated step: compute 320.5 ms + communication 180.0 ms (solver's estimate, before the passes; ...)"
    applied = "  estimated step 514.5 ms = compute 348.1 ms + exposed communication 166.4 ms (overlap scheduler, ...)"
    assert tm.parse_estimate(planned, applied=False) == pytest.approx(500.5)
    assert tm.parse_estimate(applied, applied=True) == pytest.approx(514.5)
    assert tm.parse_estimate("no estimate here", applied=True) is None


def test_pytest_verdicts(tm):
    assert tm.pytest_verdict(0, "....\n12 passed, 3 deselected in 40.2s\n") == (
        True,
        "12 passed, 3 deselected in 40.2s",
    )
    ok, reason = tm.pytest_verdict(5, "\n3 deselected in 1.0s\n")
    assert not ok and "no tests collected" in reason  # nothing collected fails
    ok, reason = tm.pytest_verdict(1, "F.\n==== 1 failed, 1 passed in 3.0s ====\n")
    assert not ok and reason == "1 failed, 1 passed in 3.0s"


def test_failure_reason_is_the_last_exception(tm):
    out = "Traceback (most recent call last):\n  File 'x'\nImportError: cannot import name '_is_shard_like'\n"
    assert tm.failure_reason(out, 1) == "ImportError: cannot import name '_is_shard_like'"
    assert tm.failure_reason("", 3) == "exit 3"
    ranked = "[rank0]: Traceback ...\n[rank0]: autoparallel.problem.infeasibility.InfeasibleConstraintError: output 0\n"
    assert tm.failure_reason(ranked, 1) == "autoparallel.problem.infeasibility.InfeasibleConstraintError: output 0"


def test_table(tm):
    results = {
        "2.13.0": {
            "plan": tm.Cell(ok=True, seconds=400.2, estimate_ms=500.5),
            "smoke": tm.Cell(ok=True, seconds=180),
        },
        "2.15.0": {
            "plan": tm.Cell(ok=False, seconds=90, reason="InfeasibleConstraintError: ..."),
            "smoke": tm.Cell(ok=False, seconds=60, reason="5 failed"),
        },
    }
    lines = tm.format_table(results, ["plan", "smoke"], markdown=True)
    assert lines[0] == "| torch | plan | smoke | 8B step est. (plan) |"
    assert lines[2] == "| 2.13.0 (CPU wheel) | ok 400 s | ok 180 s | 500.5 ms |"
    assert lines[3] == "| 2.15.0 | FAIL 90 s | FAIL 60 s | - |"
    assert tm.failure_lines(results)[0].startswith("torch 2.15.0 plan: InfeasibleConstraintError")
