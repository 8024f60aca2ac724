"""Run the project on several torch releases and print a version x check table.

For each version it makes (or reuses) a virtual environment at
``<tempdir>/autoparallel-torch-matrix/torch-<version>``, installs that torch
release and the project's other dependencies there (only when an import
check finds something missing), puts this checkout first on ``PYTHONPATH``
(the project itself is not installed), and runs the checks:

* ``plan``: ``examples/example_llama3.py --no-apply`` (LLaMA-3 8B, 16 x 8 mesh)
* ``apply``: the same example without ``--no-apply`` (plan + apply; ``--apply-model debug``
  runs the small debug config instead of 8B)
* ``solver``: ``pytest tests/solver``
* ``smoke``: ``pytest -m smoke tests/autoparallel`` (the subset CI runs on a second torch)

and prints pass/fail and seconds per cell, the 8B plan's estimated step (the
solver's compute + communication from ``plan``, the overlap scheduler's step
from ``apply``), then the reason of each failure. Every check's output is kept
in ``<tempdir>/autoparallel-torch-matrix/logs/``. Exits 1 when a cell fails.

    python benchmarks/torch_matrix.py                                   # 5 versions x 4 checks
    python benchmarks/torch_matrix.py --versions 2.14.1 --checks smoke  # what .ci/run adds
    python benchmarks/torch_matrix.py --versions 2.13.0 2.15.0 --checks plan solver --markdown

Only 2.13.0 installs from a local CPU-only wheel here; the other releases pull
the CUDA packages from the registry (about 3 GB per environment), which is why
the environments live in the temp folder and are reused between runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VERSIONS = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")
CHECKS = ("plan", "apply", "solver", "smoke")
# Dependencies the checks need besides the project's own (pytest and the
# test extras' transformers); ruff is not needed to run anything.
EXTRA_SKIP = {"ruff"}


def matrix_root() -> Path:
    return Path(tempfile.gettempdir()) / "autoparallel-torch-matrix"


def venv_dir(version: str) -> Path:
    """Where the environment of ``version`` lives (shared by every run and by CI)."""
    return matrix_root() / f"torch-{version}"


def venv_python(version: str) -> Path:
    return venv_dir(version) / "bin" / "python"


def project_requirements() -> list[str]:
    """pyproject's dependencies and test extras, torch and ruff left out
    (torch is installed at the version under test)."""
    text = (ROOT / "pyproject.toml").read_text()
    if tomllib is not None:
        project = tomllib.loads(text)["project"]
        reqs = list(project["dependencies"]) + list(project.get("optional-dependencies", {}).get("test", []))
    else:  # the quoted strings of the two lists
        deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
        test = re.search(r"^test = \[(.*?)\]", text, re.M).group(1)
        reqs = re.findall(r'"([^"]+)"', deps) + re.findall(r'"([^"]+)"', test)
    return [r for r in reqs if _req_name(r) not in {"torch", *EXTRA_SKIP}]


def _req_name(req: str) -> str:
    return re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower()


# Prints what is missing or at the wrong version in the running environment:
# torch at argv[1], then the requirement strings (name and optional
# comparisons) given after it.
_MISSING_SCRIPT = r"""
import sys
from importlib import metadata
try:
    from packaging.requirements import Requirement
except ImportError:
    Requirement = None
want_torch, reqs = sys.argv[1], sys.argv[2:]
missing = []
try:
    if metadata.version("torch").split("+")[0] != want_torch:
        missing.append("torch==" + want_torch)
except metadata.PackageNotFoundError:
    missing.append("torch==" + want_torch)
for r in reqs:
    name = Requirement(r).name if Requirement else r.split("=")[0].split(">")[0].split("<")[0]
    try:
        v = metadata.version(name)
    except metadata.PackageNotFoundError:
        missing.append(r)
        continue
    if Requirement and not Requirement(r).specifier.contains(v, prereleases=True):
        missing.append(r)
print("\n".join(missing))
"""


def ensure_venv(version: str, log=print) -> Path:
    """The Python of ``version``'s environment, made and filled when needed.

    Reuses an existing environment; runs pip only when torch is not that
    release or a dependency is missing or off its range. Raises
    ``RuntimeError`` naming the failed step (and the pip output's tail)."""
    python = venv_python(version)
    if not python.exists():
        log(f"torch {version}: creating {venv_dir(version)}")
        venv_dir(version).parent.mkdir(parents=True, exist_ok=True)
        _run_or_raise([sys.executable, "-m", "venv", str(venv_dir(version))], f"python -m venv for torch {version}")
    reqs = project_requirements()
    missing = subprocess.run(
        [str(python), "-c", _MISSING_SCRIPT, version, *reqs], capture_output=True, text=True, check=False
    )
    if missing.returncode != 0:
        raise RuntimeError(f"could not inspect {python}: {missing.stderr.strip()[-800:]}")
    todo = [line for line in missing.stdout.splitlines() if line.strip()]
    if todo:
        log(f"torch {version}: pip install {' '.join(todo)} (into {venv_dir(version)})")
        _run_or_raise(
            [str(python), "-m", "pip", "install", "-q", f"torch=={version}", *reqs],
            f"pip install torch=={version} into {venv_dir(version)}",
        )
    return python


def _run_or_raise(cmd: list[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        tail = "\n".join(line for line in (r.stdout + r.stderr).splitlines() if "is ignored" not in line)[-1500:]
        raise RuntimeError(f"{what} failed (exit {r.returncode}):\n{tail}")


@dataclasses.dataclass
class Cell:
    """One check on one torch version."""

    ok: bool
    seconds: float
    reason: str = ""  # why it failed, one line
    log: Path | None = None
    estimate_ms: float | None = None  # the 8B plan's estimated step, when the check prints one


def check_command(check: str, *, apply_model: str) -> list[str]:
    """The command line (after the environment's python) of ``check``."""
    example = ["examples/example_llama3.py"]
    pytest = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if check == "plan":
        return example + ["--no-apply"]
    if check == "apply":
        return example + ([] if apply_model == "8B" else ["--model", apply_model, "--mesh", "2", "4", "--seq", "64"])
    if check == "solver":
        return pytest + ["tests/solver"]
    if check == "smoke":
        return pytest + ["-m", "smoke", "tests/autoparallel"]
    raise ValueError(f"unknown check {check!r}; known: {', '.join(CHECKS)}")


def run_check(python: Path, version: str, check: str, *, apply_model: str = "8B", timeout: float = 3600) -> Cell:
    """Run ``check`` with the environment's ``python`` on this checkout."""
    cmd = [str(python), *check_command(check, apply_model=apply_model)]
    log_dir = matrix_root() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"torch-{version}-{check}.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        out, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        out, rc = out + f"\n(timed out after {timeout:.0f} s)", None
    seconds = time.perf_counter() - t0
    log.write_text(" ".join(cmd) + "\n\n" + out)
    cell = Cell(ok=rc == 0, seconds=seconds, log=log)
    if check in ("plan", "apply"):
        cell.estimate_ms = parse_estimate(out, applied=check == "apply")
    if rc is None:
        cell.reason = f"timed out after {timeout:.0f} s"
    elif check in ("solver", "smoke"):
        cell.ok, cell.reason = pytest_verdict(rc, out)
    elif rc != 0:
        cell.reason = failure_reason(out, rc)
    if check == "plan" and cell.ok and cell.estimate_ms is None:
        cell.ok, cell.reason = False, "exit 0 but no estimated step in the output"
    return cell


_STEP_APPLIED = re.compile(r"estimated step ([0-9.]+) ms =")
_STEP_PLANNED = re.compile(r"estimated step: compute ([0-9.]+) ms \+ communication ([0-9.]+) ms")


def parse_estimate(output: str, *, applied: bool) -> float | None:
    """Milliseconds of the example's estimated step: the overlap scheduler's
    figure after apply, the solver's compute + communication before."""
    if applied:
        m = _STEP_APPLIED.search(output)
        return float(m.group(1)) if m else None
    m = _STEP_PLANNED.search(output)
    return float(m.group(1)) + float(m.group(2)) if m else None


def pytest_verdict(rc: int, output: str) -> tuple[bool, str]:
    """Pass only on exit 0; exit 5 (nothing collected) fails."""
    summary = next((line for line in reversed(output.splitlines()) if re.search(r"\bin [0-9.]+s\b", line)), "")
    summary = summary.strip("= ")
    if rc == 0:
        return True, summary
    if rc == 5:
        return False, "no tests collected (pytest exit 5)"
    return False, summary or failure_reason(output, rc)


_ERROR_LINE = re.compile(r"^\s*(?:E\s+)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)$")


def failure_reason(output: str, rc: int) -> str:
    """The last exception line of ``output`` (else its last line), shortened."""
    # torch's distributed launcher prefixes a rank's traceback lines with "[rank0]: "
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", line) for line in output.splitlines()]
    hit = next((m.group(1) for line in reversed(lines) if (m := _ERROR_LINE.match(line))), None)
    text = hit or next((line for line in reversed(lines) if line.strip()), f"exit {rc}")
    return text.strip()[:200]


def torch_label(version: str) -> str:
    return f"{version} (CPU wheel)" if version == "2.13.0" else version


def format_table(
    results: dict[str, dict[str, Cell]], checks: list[str], *, markdown: bool, apply_model: str = "8B"
) -> list[str]:
    """version x check: ``ok 12 s`` / ``FAIL 3 s``, then the two estimates."""
    headers = ["torch", *checks]
    if "plan" in checks:
        headers.append("8B step est. (plan)")
    if "apply" in checks:
        headers.append(f"{apply_model} step est. (apply)")
    rows = []
    for version, cells in results.items():
        row = [torch_label(version)]
        for check in checks:
            c = cells.get(check)
            row.append("-" if c is None else f"{'ok' if c.ok else 'FAIL'} {c.seconds:.0f} s")
        for check in ("plan", "apply"):
            if check in checks:
                c = cells.get(check)
                row.append("-" if c is None or c.estimate_ms is None else f"{c.estimate_ms:.1f} ms")
        rows.append(row)
    if markdown:
        out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        return out + ["| " + " | ".join(r) + " |" for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    return ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in [headers, *rows]]


def failure_lines(results: dict[str, dict[str, Cell]]) -> list[str]:
    out = []
    for version, cells in results.items():
        for check, c in cells.items():
            if not c.ok:
                where = f" (log: {c.log})" if c.log else ""
                out.append(f"torch {version} {check}: {c.reason}{where}")
    return out


def run_matrix(
    versions, checks, *, apply_model: str = "8B", timeout: float = 3600, log=print
) -> dict[str, dict[str, Cell]]:
    """Every check on every version; an environment that cannot be made
    fails all its checks with the reason."""
    results: dict[str, dict[str, Cell]] = {}
    for version in versions:
        cells = results[version] = {}
        t0 = time.perf_counter()
        try:
            python = ensure_venv(version, log=log)
        except RuntimeError as e:
            reason = str(e).splitlines()[0] + " ..." if "\n" in str(e) else str(e)
            log(f"torch {version}: {e}")
            for check in checks:
                cells[check] = Cell(ok=False, seconds=time.perf_counter() - t0, reason=reason)
            continue
        for check in checks:
            log(f"torch {version}: {check} ...")
            cells[check] = c = run_check(python, version, check, apply_model=apply_model, timeout=timeout)
            est = f", est. step {c.estimate_ms:.1f} ms" if c.estimate_ms is not None else ""
            log(
                f"torch {version}: {check} {'ok' if c.ok else 'FAIL'} in {c.seconds:.0f} s{est}"
                + (f" ({c.reason})" if not c.ok else "")
            )
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", nargs="+", default=list(DEFAULT_VERSIONS), help="torch releases")
    ap.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS, help="which checks, in this order")
    ap.add_argument(
        "--apply-model",
        default="8B",
        help="model config of the apply check (8B: the example's default 16 x 8 run; "
        "debug: a 2 x 4 mesh, sequence 64, seconds)",
    )
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per check before it counts as failed")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = ap.parse_args(argv)

    results = run_matrix(args.versions, args.checks, apply_model=args.apply_model, timeout=args.timeout)
    print()
    for line in format_table(results, args.checks, markdown=args.markdown, apply_model=args.apply_model):
        print(line)
    failures = failure_lines(results)
    if failures:
        print("\nfailures:")
        for line in failures:
            print("  " + line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
