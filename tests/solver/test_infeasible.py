"""Infeasibility: the error names an irreducible set of conflicting groups."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import solver
import solver.diagnose as diagnose_mod
from solver import InfeasibleError, solve
from solver.diagnose import Verdict, _deletion_filter, diagnose
from solver.problem import INF, Decision, Edge, Link, Pin, Problem, ResourceConstraint

from ilp_cases import brute_force, random_problem

BACKENDS = solver.available_backends()
HAS_PRESOLVE = importlib.util.find_spec("solver.presolve") is not None
PRESOLVE = [False, pytest.param(True, marks=pytest.mark.skipif(not HAS_PRESOLVE, reason="no solver.presolve yet"))]


def dec(name, n, costs=None):
    return Decision(name, [f"o{i}" for i in range(n)], list(costs or [1.0] * n))


def model_problem(extra_pins=(), extra_resources=()):
    """input -> w1 -> w2 -> out; options 0 = replicate, 1/2 = shard.

    Feasible: the budget affords one replicated weight, but w1 and w2 are
    linked, so both get sharded.
    """
    decisions = [dec("input", 3), dec("w1", 3, [1, 3, 2]), dec("w2", 3, [1, 3, 2]), dec("out", 3)]
    comm = [[0, 1, 1], [1, 0, 2], [1, 2, 0]]
    edges = [Edge("input", "w1", 0, comm), Edge("w1", "w2", 0, comm), Edge("w2", "out", 0, comm)]
    pins = [
        Pin("input constraint 0", "input", [0]),
        Pin("output constraint 0", "out", [0, 1, 2]),
        *extra_pins,
    ]
    links = [Link("w1/w2 alike", "w1", "w2", [0, 1, 2])]
    resources = [
        ResourceConstraint("parameter memory budget", {"w1": [4, 1, 1], "w2": [4, 1, 1]}, high=6),
        ResourceConstraint("activation memory", {"input": [2, 1, 1], "out": [2, 1, 1]}, high=10),
        *extra_resources,
    ]
    return Problem(decisions, edges, pins, links, resources, name="toy")


@pytest.mark.parametrize("presolve", PRESOLVE)
@pytest.mark.parametrize("backend", BACKENDS)
def test_feasible_problem_does_not_raise(backend, presolve):
    s = solve(model_problem(), backend=backend, presolve=presolve)
    assert s.status == "optimal"
    assert s.choice["w1"] != 0 and s.choice["w2"] != 0
    assert diagnose(model_problem()) is None


@pytest.mark.parametrize("presolve", PRESOLVE)
@pytest.mark.parametrize("backend", BACKENDS)
def test_known_conflicting_pair_is_named_exactly(backend, presolve):
    p = model_problem(extra_resources=[ResourceConstraint("replicated input too big", {"input": [9, 0, 0]}, high=5)])
    with pytest.raises(InfeasibleError) as info:
        solve(p, backend=backend, presolve=presolve)
    assert info.value.conflict == ["input constraint 0", "replicated input too big"]


@pytest.mark.parametrize("presolve", PRESOLVE)
@pytest.mark.parametrize("backend", BACKENDS)
def test_known_conflicting_triple_is_named_exactly(backend, presolve):
    # A replicated w1 fits the budget, but the link replicates w2 as well.
    p = model_problem(extra_pins=[Pin("w1 replicated", "w1", [0])])
    with pytest.raises(InfeasibleError) as info:
        solve(p, backend=backend, presolve=presolve)
    err = info.value
    assert err.conflict == ["w1 replicated", "w1/w2 alike", "parameter memory budget"]
    assert str(err) == (
        "Infeasible: constraints conflict: 'w1 replicated', 'w1/w2 alike', "
        "'parameter memory budget' (removing any one of them makes the problem feasible); "
        "'parameter memory budget': no choice under the others gets its sum below 8 (high 6)"
    )
    assert err.reachable == {"parameter memory budget": (8.0, 8.0)} and err.unproven == []


def test_conflicting_pair_message():
    p = model_problem(extra_resources=[ResourceConstraint("replicated input too big", {"input": [9, 0, 0]}, high=5)])
    err = diagnose(p)
    assert err.conflict == ["input constraint 0", "replicated input too big"]
    assert str(err) == (
        "Infeasible: constraints conflict: 'input constraint 0', 'replicated input too big' "
        "(removing any one of them makes the problem feasible); "
        "'replicated input too big': no choice under the others gets its sum below 9 (high 5)"
    )
    assert isinstance(err, ValueError) and not isinstance(err, solver.ProblemError)


def test_low_bound_conflict():
    p = model_problem(
        extra_resources=[ResourceConstraint("at least 7 params", {"w1": [4, 1, 1], "w2": [4, 1, 1]}, low=7)]
    )
    err = diagnose(p)
    assert err.conflict == ["parameter memory budget", "at least 7 params"]


def test_single_unsatisfiable_constraint():
    p = Problem([dec("a", 2, [1, INF]), dec("b", 2)], pins=[Pin("want shard", "a", [1]), Pin("ok", "b", [0])])
    with pytest.raises(InfeasibleError) as info:
        solve(p, presolve=False)
    assert info.value.conflict == ["want shard"]
    assert str(info.value) == (
        "Infeasible: constraint 'want shard' cannot be satisfied (removing it makes the problem feasible)"
    )


def test_decision_with_all_options_forbidden_is_named():
    p = Problem(
        [dec("a", 2), dec("dead", 3, [INF, INF, INF])],
        [Edge("a", "dead", 0, [[0, 1, 2], [1, 0, 2]])],
        pins=[Pin("p", "a", [0])],
    )
    for presolve in [False] + [True] * HAS_PRESOLVE:
        with pytest.raises(InfeasibleError) as info:
            solve(p, presolve=presolve)
        assert info.value.decisions == ["dead"] and info.value.conflict == []
        assert "'dead'" in str(info.value)


def test_edge_forbidding_every_pair_is_named():
    p = Problem(
        [dec("a", 2, [1, INF]), dec("b", 2), dec("c", 2)],
        [
            Edge("a", "b", 0, [[INF, 0], [0, 0]]),
            Edge("b", "c", 0, [[0, INF], [INF, 0]]),
            Edge("a", "c", 0, [[0, INF], [0, 0]]),
        ],
    )
    err = diagnose(p)
    # a=0 forces c=0, c=0 forces b=0, but a=0 forbids b=0.
    assert err.edges == ["'a' -> 'b'", "'b' -> 'c'", "'a' -> 'c'"]
    assert err.conflict == []
    q = Problem([dec("a", 2, [1, INF]), dec("b", 2)], [Edge("a", "b", 0, [[INF, INF], [0, 0]])])
    err = diagnose(q)
    assert err.edges == ["'a' -> 'b'"]
    assert "forbids every pair" in str(err)


def test_link_conflict():
    p = Problem(
        [dec("l0", 3), dec("l1", 3, [1, 1, INF]), dec("l2", 3)],
        [Edge("l0", "l1", 0, [[0, 1, 1]] * 3), Edge("l1", "l2", 0, [[0, 1, 1]] * 3)],
        pins=[Pin("last layer sharded", "l2", [2])],
        links=[Link("layers", "l0", "l1", [0, 1, 2]), Link("layers", "l0", "l2", [0, 1, 2])],
    )
    err = diagnose(p)
    assert err.conflict == ["last layer sharded", "layers"]


def test_random_infeasible_problems_get_irreducible_conflicts():
    """Against brute force: the named groups conflict on their own, and
    dropping any one of them makes the problem feasible."""
    checked = 0
    for seed in range(400):
        p = random_problem(seed)
        if brute_force(p) is not None:
            continue
        err = diagnose(p)
        assert err is not None
        if err.decisions or err.edges:
            assert brute_force(p, groups=set()) is None
            continue
        checked += 1
        assert err.conflict
        assert brute_force(p, groups=set(err.conflict)) is None
        for g in err.conflict:
            assert brute_force(p, groups=set(err.conflict) - {g}) is not None, (seed, g)
    assert checked >= 10


@pytest.mark.parametrize(
    "conflicts",
    [[{5, 40}], [{63}], [{0}], [{1, 2}, {3}], [{10, 20, 30}, {20, 50}], [set(range(64))]],
)
def test_deletion_filter_is_irreducible_with_few_checks(conflicts):
    calls = []

    def feasible(kept):
        return not any(c <= set(kept) for c in conflicts)

    def check(kept):
        calls.append(tuple(kept))
        return Verdict.FEASIBLE if feasible(kept) else Verdict.INFEASIBLE

    result, unproven = _deletion_filter(list(range(64)), check)
    assert len(set(calls)) == len(calls)  # no check repeated
    if len(conflicts[0]) <= 2:
        assert len(calls) <= 30  # versus 64 for one-by-one deletion
    assert not feasible(result) and unproven == []
    for g in result:
        assert feasible([k for k in result if k != g])


def test_deletion_filter_keeps_what_it_could_not_check():
    """A check that runs out of work keeps the group it tested: the result
    still conflicts (only proven-infeasible sets are moved to), and a group
    whose own removal was never decided comes back as unproven."""
    conflict = {5, 40}

    def check(kept):
        if not conflict <= set(kept):
            return Verdict.FEASIBLE
        # without group 7 the checker cannot prove anything infeasible
        return Verdict.INFEASIBLE if 7 in kept else Verdict.UNKNOWN

    result, unproven = _deletion_filter(list(range(64)), check)
    assert result == [5, 7, 40] and unproven == [7]


def market_split(m: int, n: int, seed: int) -> Problem:
    """Cornuéjols-Dawande market split: m equality rows over n on/off
    decisions, each row's sum held at half its total. Such rows are
    (almost always) infeasible, and proving it takes branch and bound
    thousands of nodes: the LP relaxation and propagation prove nothing.
    One pin per decision (allowing both options) gives the deletion filter
    groups to test."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 100, (m, n))
    return Problem(
        [Decision(f"d{j}", ["off", "on"], [0.0, 0.0]) for j in range(n)],
        pins=[Pin(f"pin {j}", f"d{j}", [0, 1]) for j in range(n)],
        resources=[
            ResourceConstraint(
                f"split {i}",
                {f"d{j}": [0.0, float(a[i, j])] for j in range(n)},
                low=float(a[i].sum() // 2),
                high=float(a[i].sum() // 2),
            )
            for i in range(m)
        ],
        name="market split",
    )


@pytest.mark.skipif("highs" not in BACKENDS, reason="the node limit is HiGHS'")
def test_diagnosis_of_a_hard_problem_ends_on_counted_work(monkeypatch):
    """Each feasibility check stops at the node limit (``unknown``), and the
    checks in all at ``max_checks``: the diagnosis ends, naming a set that
    conflicts (nothing was dropped without proof) and saying it is partial."""
    p = market_split(3, 20, 0)
    monkeypatch.setattr(diagnose_mod, "DIAGNOSIS_NODE_LIMIT", 20)
    checks = []
    real = diagnose_mod.FeasibilityChecker._check
    monkeypatch.setattr(diagnose_mod.FeasibilityChecker, "_check", lambda self, q: checks.append(q) or real(self, q))
    with pytest.raises(solver.SolverError, match="not decided within 20 MIP nodes"):
        diagnose(p)  # not known infeasible: no answer is honest
    assert len(checks) == 1
    checks.clear()
    err = diagnose(p, known_infeasible=True, max_checks=8)
    assert 0 < len(checks) <= 8
    assert err.conflict == p.constraint_names()  # no check proved a smaller set infeasible
    assert {f"pin {j}" for j in range(20)} <= set(err.unproven) <= set(err.conflict)
    assert "partial diagnosis" in str(err) and "limit of 8 checks" in str(err)


def test_diagnosis_stops_at_the_safety_cap(monkeypatch):
    """Past the caller's wall-clock cap no check runs: the conflict is every
    group, all unproven, and the message says why."""
    from solver.work import SafetyCap

    p = model_problem(extra_pins=[Pin("w1 replicated", "w1", [0])])
    checks = []
    real = diagnose_mod.FeasibilityChecker._check
    monkeypatch.setattr(diagnose_mod.FeasibilityChecker, "_check", lambda self, q: checks.append(q) or real(self, q))
    err = diagnose(p, cap=SafetyCap(1e-9, start=0.0), known_infeasible=True)
    assert checks == []
    assert err.conflict == p.constraint_names() and err.unproven == err.conflict
    assert "partial diagnosis" in str(err) and "the time limit was reached" in str(err)
