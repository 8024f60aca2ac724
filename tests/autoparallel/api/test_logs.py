"""Logs like a training tool's: timestamped stage lines on rank 0 whether
or not stderr is a terminal, nothing from other ranks below warnings, no
solver banner on stdout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

STAGES = """
from autoparallel.cli import setup_logging
from autoparallel.progress import Stages
setup_logging()
timings = {}
stages = Stages(timings)
with stages.stage("tracing", "tracing"):
    pass
stages.close()
print("timed", sorted(timings))
"""


def _run(code: str, **extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_stage_lines_without_a_tty():
    proc = _run(STAGES)  # stderr is a pipe, not a terminal
    assert proc.returncode == 0, proc.stderr
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    assert re.search(rf"^{stamp} INFO autoparallel.stages: tracing: start$", proc.stderr, re.M), proc.stderr
    assert re.search(rf"^{stamp} INFO autoparallel.stages: tracing: done in \d+\.\d\ds$", proc.stderr, re.M)
    assert "timed ['tracing']" in proc.stdout


def test_other_ranks_log_no_stage_lines():
    proc = _run(STAGES, RANK="1")
    assert proc.returncode == 0, proc.stderr
    assert "tracing" not in proc.stderr


def test_highs_prints_no_banner():
    code = "from solver.highs_quiet import new_highs\nnew_highs(); new_highs()\nimport highspy; highspy.Highs()\n"
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
