"""JSON dumps: lossless round-trips, precise errors, and the ``python -m solver`` CLI."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest

from solver.problem import (
    INF,
    Decision,
    Edge,
    Link,
    Pin,
    PresolveStats,
    Problem,
    ResourceConstraint,
    Solution,
)
from solver.serialize import (
    SCHEMA,
    Bundle,
    DumpError,
    dump,
    dumps,
    from_json,
    load,
    problem_from_json,
    problem_to_json,
    solution_from_json,
    solution_to_json,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sample_problem() -> Problem:
    return Problem(
        decisions=[
            Decision("embed", ["R", "S0", "S1"], [1.0, 0.5, INF]),
            Decision("layers.0.mlp", ["R", "S0"], [2, 0.25]),  # an int cost stays an int
            Decision("layers.1.mlp", ["R", "S0"], [2.0, 0.25]),
            Decision('odd name "x"', ["R"], [0.0]),
        ],
        edges=[
            Edge("embed", "layers.0.mlp", 0, [[0.0, 1e-9], [INF, 0.0], [3.5, INF]]),
            Edge("layers.0.mlp", "layers.1.mlp", 1, [[0.0, 0.1], [0.2, 0.0]]),
        ],
        pins=[Pin("user pin", "embed", [0, 1])],
        links=[
            Link("repeated layers", "layers.0.mlp", "layers.1.mlp", [0, 1]),
            Link("partial", "embed", "layers.0.mlp", [None, 1, 0]),
        ],
        resources=[
            ResourceConstraint("memory", {"embed": [4.0, 2.0, 2.0], "layers.0.mlp": [1.0, 0.5]}, low=None, high=5.5),
            ResourceConstraint("unbounded above", {'odd name "x"': [1.0]}, low=-INF, high=INF),
        ],
        name="sample",
        metadata={
            "model": "llama3-8b",
            "mesh": [8, 16],
            "budget": INF,
            "nested": {"neg": -INF, "flags": [True, None, 1.5]},
        },
    )


def sample_solution() -> Solution:
    return Solution(
        choice={"embed": 1, "layers.0.mlp": 1, "layers.1.mlp": 1, 'odd name "x"': 0},
        objective=3.75,
        unary_cost=1.25,
        edge_cost=2.5,
        status="feasible",
        optimal=False,
        gap=INF,
        backend="highs",
        timings={"presolve": 0.01, "build": 0.02, "solve": 0.5},
        num_variables=12,
        num_constraints=7,
        presolve=PresolveStats(
            decisions_before=4, decisions_after=2, merged_by_links=1, decisions_fixed=1, edges_folded=2
        ),
    )


# -------------------------------------------------------------- round trips


def test_problem_round_trip_is_lossless():
    p = sample_problem()
    d = problem_to_json(p)
    assert d["schema"] == SCHEMA and d["kind"] == "problem"
    text = json.dumps(d, allow_nan=False)  # strict JSON: no Infinity literal
    q = problem_from_json(json.loads(text))
    assert q == p
    assert type(q.decisions[1].costs[0]) is int
    assert q.links[1].mapping == [None, 1, 0]
    assert q.metadata["budget"] == INF and q.metadata["nested"]["neg"] == -INF
    assert q.resources[1].low == -INF and q.resources[1].high == INF


def test_inf_is_written_as_the_string_inf():
    d = problem_to_json(sample_problem())
    assert d["decisions"][0]["costs"] == [1.0, 0.5, "inf"]
    assert d["edges"][0]["costs"][1] == ["inf", 0.0]
    assert d["metadata"]["budget"] == {"$float": "inf"}


def test_solution_round_trip_is_lossless():
    s = sample_solution()
    t = solution_from_json(json.loads(json.dumps(solution_to_json(s), allow_nan=False)))
    assert t == s
    assert t.gap == INF
    s.presolve = None
    s.gap = None
    assert solution_from_json(solution_to_json(s)) == s


def test_dump_and_load_files(tmp_path):
    p, s = sample_problem(), sample_solution()
    dump(p, tmp_path / "p.json")
    dump(s, tmp_path / "s.json")
    dump((p, s), tmp_path / "b.json")
    assert load(tmp_path / "p.json") == p
    assert load(tmp_path / "s.json") == s
    b = load(tmp_path / "b.json")
    assert isinstance(b, Bundle) and b.problem == p and b.solution == s
    assert from_json(json.loads(dumps(Bundle(p, s)))) == Bundle(p, s)


def test_metadata_that_json_cannot_hold_is_refused():
    p = sample_problem()
    p.metadata = {"ok": 1, "bad": {"x": object()}}
    with pytest.raises(DumpError, match=r"\$\.metadata\.bad\.x: cannot write a value of type object to JSON"):
        problem_to_json(p)


# --------------------------------------------------------- malformed dumps


def mutated(edit) -> dict:
    d = copy.deepcopy(problem_to_json(sample_problem()))
    edit(d)
    return d


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d["decisions"][1]["costs"].__setitem__(1, "abc"),
            r'\$\.decisions\[1\]\.costs\[1\]: expected a number or "inf", got "abc"',
        ),
        (
            lambda d: d["decisions"][0]["costs"].__setitem__(0, "-inf"),
            r'\$\.decisions\[0\]\.costs\[0\]: expected a number or "inf", got "-inf"',
        ),
        (
            lambda d: d["edges"][0]["costs"][2].__setitem__(0, None),
            r'\$\.edges\[0\]\.costs\[2\]\[0\]: expected a number or "inf", got null',
        ),
        (
            lambda d: d["edges"][1].__setitem__("arg_index", 1.5),
            r"\$\.edges\[1\]\.arg_index: expected an integer, got 1\.5",
        ),
        (
            lambda d: d["edges"][1].__setitem__("costs", {"a": 1}),
            r"\$\.edges\[1\]\.costs: expected an array, got an object",
        ),
        (lambda d: d["decisions"][2].pop("options"), r"\$\.decisions\[2\]: missing key 'options'"),
        (lambda d: d["decisions"][2].__setitem__("colour", "red"), r"\$\.decisions\[2\]: unexpected key 'colour'"),
        (
            lambda d: d["links"][1]["mapping"].__setitem__(0, True),
            r"\$\.links\[1\]\.mapping\[0\]: expected an integer, got true",
        ),
        (lambda d: d["pins"][0].__setitem__("allowed", "0,1"), r'\$\.pins\[0\]\.allowed: expected an array, got "0,1"'),
        (
            lambda d: d["resources"][0]["terms"].__setitem__("layers.0.mlp", [1.0, "inf"]),
            r'\$\.resources\[0\]\.terms\["layers\.0\.mlp"\]\[1\]: expected a number, got "inf"',
        ),
        (
            lambda d: d["resources"][0].__setitem__("high", "lots"),
            r'\$\.resources\[0\]\.high: expected a number or "inf" or "-inf", got "lots"',
        ),
        (lambda d: d.__setitem__("decisions", None), r"\$\.decisions: expected an array, got null"),
        (
            lambda d: d.__setitem__("schema", "autoparallel.solver/0"),
            r'\$\.schema: unsupported schema "autoparallel\.solver/0", expected '
            r"'autoparallel\.solver/1'",
        ),
        (lambda d: d.pop("schema"), r"\$: missing key 'schema'"),
        (lambda d: d.__setitem__("kind", "plan"), r'\$\.kind: expected "problem", "solution" or "bundle", got "plan"'),
        # Well-formed JSON, but not a valid problem: Problem.validate() speaks.
        (
            lambda d: d["edges"][0].__setitem__("consumer", "nope"),
            r"\$: invalid problem: edge #0 .*unknown decision 'nope'",
        ),
        (lambda d: d["edges"][1]["costs"][0].pop(), r"\$: invalid problem: edge #1 .*row 0 has 1 entries"),
    ],
)
def test_malformed_problem_dumps_name_the_path(edit, message):
    with pytest.raises(DumpError, match=message):
        from_json(mutated(edit))


def test_malformed_solution_and_bundle():
    d = solution_to_json(sample_solution())
    d["choice"]["embed"] = "1"
    with pytest.raises(DumpError, match=r'\$\.choice\.embed: expected an integer, got "1"'):
        solution_from_json(d)
    d = solution_to_json(sample_solution())
    d["presolve"]["bogus"] = 1
    with pytest.raises(DumpError, match=r"\$\.presolve: unexpected key 'bogus'"):
        solution_from_json(d)
    d = json.loads(dumps((sample_problem(), sample_solution())))
    d["solution"]["choice"]["layers.1.mlp"] = 5
    with pytest.raises(DumpError, match=r'\$\.solution\.choice\["layers\.1\.mlp"\]: option 5 out of range'):
        from_json(d)
    d["solution"]["choice"].pop("layers.1.mlp")
    with pytest.raises(DumpError, match=r"\$\.solution\.choice: no option for decision\(s\) 'layers\.1\.mlp'"):
        from_json(d)
    d["problem"]["decisions"][0]["costs"][0] = []
    with pytest.raises(DumpError, match=r"\$\.problem\.decisions\[0\]\.costs\[0\]"):
        from_json(d)


def test_load_reports_bad_json_and_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"schema": "autoparallel.solver/1", "kind": ')
    with pytest.raises(DumpError, match=r"broken\.json: not valid JSON"):
        load(path)
    path.write_text(
        '{"schema": "autoparallel.solver/1", "kind": "problem", '
        '"decisions": [{"name": "a", "options": ["R"], "costs": [Infinity]}]}'
    )
    with pytest.raises(DumpError, match=r'broken\.json: .*Infinity.*"inf"'):
        load(path)
    path.write_text("[1, 2]")
    with pytest.raises(DumpError, match=r"broken\.json: \$: expected an object, got an array"):
        load(path)


# ----------------------------------------------------------------------- CLI


def cli_problem() -> Problem:
    p = sample_problem()
    p.pins = []
    return p


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "solver", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def test_cli_solves_a_problem_dump_and_prints_a_summary(tmp_path):
    path = tmp_path / "p.json"
    dump(cli_problem(), path)
    out_path = tmp_path / "solution.json"
    r = run_cli(str(path), "--backend", "cbc", "--output", str(out_path))
    assert r.returncode == 0, r.stderr
    for word in ("status", "optimal", "objective", "unary", "edge", "timings", "presolve", "variables", "constraints"):
        assert word in r.stdout
    bundle = load(out_path)
    assert isinstance(bundle, Bundle) and bundle.solution.optimal

    # A bundle: the new objective is compared with the dumped one.
    r = run_cli(str(out_path), "--no-presolve", "--time-limit", "30", "--gap", "0")
    assert r.returncode == 0, r.stderr
    assert "presolve   off" in r.stdout
    assert "new objective matches" in r.stdout


def test_cli_rejects_malformed_dumps(tmp_path):
    d = problem_to_json(cli_problem())
    d["decisions"][3]["costs"][0] = "abc"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    r = run_cli(str(path))
    assert r.returncode == 2
    assert '$.decisions[3].costs[0]: expected a number or "inf", got "abc"' in r.stderr
    r = run_cli(str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "cannot read" in r.stderr


def test_cli_reports_infeasible_problems(tmp_path):
    p = Problem(
        [Decision("a", ["R", "S0"], [0.0, 0.0])],
        pins=[Pin("want R", "a", [0]), Pin("want S0", "a", [1])],
    )
    path = tmp_path / "infeasible.json"
    dump(p, path)
    r = run_cli(str(path))
    assert r.returncode == 1
    assert "want R" in r.stderr and "want S0" in r.stderr
