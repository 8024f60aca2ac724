"""One benchmark row in a child process under a memory cap.

The big rows (8B, 70B, MoE 16B) each plan in a fresh process, so one row's
memory neither adds to the next nor can run the machine out of memory: the
child's address space is capped at ``max_gb`` and it prints its record as
the last JSON line of its stdout."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])


def run_row_child(script: str, row: str, extra_args: list[str], max_gb: float) -> dict:
    """``python script --child row *extra_args`` capped at ``max_gb``: the
    record it printed, or ``{"row", "error"}`` with its exit code and last
    line of stderr."""
    cmd = [sys.executable, os.path.abspath(script), "--child", row, *extra_args]

    def limit():
        b = int(max_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (b, b))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit, env=env)
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
    return {"row": row, "error": f"exit {r.returncode}: {tail}"}
