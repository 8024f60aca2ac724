"""``python -m solver``: exit codes 0 solved, 1 infeasible / no solution, 2 bad input."""

import json
import subprocess
import sys

import pytest

from solver import solve
from solver.__main__ import EXIT_BAD_INPUT, EXIT_NO_SOLUTION, EXIT_OK, main
from solver.problem import Decision, Edge, Pin, Problem
from solver.serialize import dump


def _problem() -> Problem:
    return Problem(
        decisions=[Decision("a", ["R", "S0"], [1.0, 0.5]), Decision("b", ["R", "S0"], [1.0, 0.5])],
        edges=[Edge("a", "b", 0, [[0.0, 0.0], [2.0, 0.0]])],
        name="cli",
    )


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "problem.json"
    dump(_problem(), path)
    return path


def _run(argv, capsys):
    """main()'s exit code (argparse's SystemExit included) and its stderr."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_solves(good, capsys):
    code, err = _run([good, "--gap", "0.01", "--time-limit", "10"], capsys)
    assert code == EXIT_OK, err


def test_infeasible_is_1(tmp_path, capsys):
    p = _problem()
    p.pins = [Pin("r", "a", [0]), Pin("s", "a", [1])]
    path = tmp_path / "infeasible.json"
    dump(p, path)
    code, err = _run([path], capsys)
    assert code == EXIT_NO_SOLUTION
    assert "error:" in err


@pytest.mark.parametrize(
    "args, words",
    [
        (["--gap", "nan"], "--gap"),
        (["--gap", "-0.1"], "--gap"),
        (["--gap", "1.5"], "--gap"),
        (["--gap", "x"], "--gap"),
        (["--time-limit", "-1"], "--time-limit"),
        (["--time-limit", "0"], "--time-limit"),
        (["--time-limit", "nan"], "--time-limit"),
        (["--gap", "nan", "--time-limit", "-1"], "argument"),
    ],
)
def test_bad_limits_are_2(good, capsys, args, words):
    code, err = _run([good, *args], capsys)
    assert code == EXIT_BAD_INPUT
    assert words in err and "Traceback" not in err


def _write_bytes(tmp_path, data: bytes):
    path = tmp_path / "dump.json"
    path.write_bytes(data)
    return path


def _valid_dict():
    return {
        "schema": "autoparallel.solver/1",
        "kind": "problem",
        "name": "",
        "metadata": {},
        "decisions": [{"name": "a", "options": ["R", "S"], "costs": [1.0, 2.0]}],
        "edges": [],
        "pins": [],
        "links": [],
        "resources": [],
    }


def _huge_int(where: str) -> bytes:
    d = _valid_dict()
    d["decisions"].append({"name": "b", "options": ["R", "S"], "costs": [1.0, 2.0]})
    if where == "cost":
        d["decisions"][0]["costs"][0] = 10**400
    elif where == "edge":
        d["edges"] = [{"producer": "a", "consumer": "b", "arg_index": 0, "costs": [[10**400, 1], [1, 0]]}]
    else:
        d["resources"] = [{"name": "mem", "terms": {"a": [1, 2]}, "low": None, "high": -(10**400)}]
    return json.dumps(d).encode()


@pytest.mark.parametrize(
    "data, words",
    [
        (bytes(range(256)) * 4, "not a JSON text file"),
        (b"\xff\xfe{}", "not a JSON text file"),
        (b"", "not valid JSON"),
        (b"{" * 1 + b'"schema": ', "not valid JSON"),
        (b"[" * 200000, "nested too deeply"),
        (b'{"schema": NaN}', "non-standard JSON constant"),
        (_huge_int("cost"), "decision 'a' (#0), option 0: cost is an integer of 401 digits"),
        (_huge_int("edge"), "entry [0][0]: cost is an integer of 401 digits"),
        (_huge_int("bound"), "$.resources[0].high: number too large for a float"),
        (json.dumps(_valid_dict()).replace('"costs"', '"kosts"').encode(), "missing key 'costs'"),
    ],
    ids=[
        "binary",
        "bom-ish",
        "empty",
        "truncated",
        "deep",
        "nan",
        "huge-cost",
        "huge-edge-cost",
        "huge-bound",
        "missing-key",
    ],
)
def test_malformed_dump_is_2(tmp_path, capsys, data, words):
    code, err = _run([_write_bytes(tmp_path, data)], capsys)
    assert code == EXIT_BAD_INPUT, err
    assert err.startswith("error: malformed dump:") and words in err, err
    assert "Traceback" not in err


def test_missing_file_is_2(tmp_path, capsys):
    code, err = _run([tmp_path / "nope.json"], capsys)
    assert code == EXIT_BAD_INPUT and "cannot read" in err


def test_real_process_exit_codes(good, tmp_path):
    """The same codes from a real ``python -m solver`` (sys.exit wiring)."""
    binary = _write_bytes(tmp_path, bytes(range(256)))

    def rc(*args):
        return subprocess.run([sys.executable, "-m", "solver", *map(str, args)], capture_output=True, text=True)

    ok, bad_arg, bad_file = rc(good), rc(good, "--gap", "nan", "--time-limit", "-1"), rc(binary)
    assert ok.returncode == 0, ok.stderr
    assert bad_arg.returncode == 2 and "Traceback" not in bad_arg.stderr
    assert bad_file.returncode == 2 and "Traceback" not in bad_file.stderr


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"time_limit": float("nan")}, ValueError),
        ({"time_limit": -1}, ValueError),
        ({"time_limit": "10"}, TypeError),
        ({"rel_gap": float("nan")}, ValueError),
        ({"rel_gap": 1.0}, ValueError),
        ({"rel_gap": True}, TypeError),
    ],
)
def test_solve_rejects_bad_limits(kwargs, exc):
    name = next(iter(kwargs))
    with pytest.raises(exc, match=name):
        solve(_problem(), **kwargs)


def _ms_problem() -> Problem:
    """Costs of a few milliseconds (the planner's costs are seconds)."""
    return Problem(
        decisions=[Decision("a", ["R", "S0"], [0.004, 0.002]), Decision("b", ["R", "S0"], [0.004, 0.0015])],
        edges=[Edge("a", "b", 0, [[0.0, 0.0], [0.01, 0.0005]])],
        name="ms",
    )


def test_summary_prints_costs_with_their_unit(tmp_path, capsys):
    path = tmp_path / "problem.json"
    dump(_ms_problem(), path)
    code = main([str(path), "--output", str(tmp_path / "bundle.json")])
    out = capsys.readouterr().out
    assert code == EXIT_OK
    (objective,) = [line for line in out.splitlines() if line.startswith("objective")]
    # the optimum: a=S0, b=S0 (2 + 1.5 ms) with their edge (0.5 ms)
    assert objective == "objective  4.0 ms = unary 3.5 ms + edge 500.0 us (exactly 0.004 s)"
    (status,) = [line for line in out.splitlines() if line.startswith("status")]
    assert "gap 0%" in status
    (timings,) = [line for line in out.splitlines() if line.startswith("timings")]
    assert all(t.rsplit(" ", 1)[1] in ("s", "ms", "us") for t in timings[len("timings    ") :].split(", ")), timings

    # a bundle: the dumped objective and the difference in the same unit
    code = main([str(tmp_path / "bundle.json")])
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert "dumped     objective 4.0 ms (optimal, " in out and "new objective matches" in out


def test_compare_gives_the_difference_with_its_unit():
    from dataclasses import replace

    from solver.__main__ import compare

    new = solve(_ms_problem())
    worse = replace(new, objective=new.objective + 0.0012, choice={"a": 0, "b": 0})
    assert "new objective is better by 1.2 ms; 2 decisions chose differently" in compare(worse, new)
    assert "new objective is WORSE by 1.2 ms" in compare(new, worse)
