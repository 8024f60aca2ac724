"""Stopping early: a solution stopped by a gap or time limit says so and gives
its proven bound; the MIP start (rounded LP + local search) keeps it good."""

import random

import pytest

from solver import solve
from solver.evaluate import evaluate
from solver.local_search import improve
from solver.problem import Decision, Edge, Pin, Problem, ResourceConstraint

from ilp_cases import brute_force, feasible_choice, random_problem


def grid(n: int, k: int, seed: int) -> Problem:
    """An n x n grid of k-option decisions with random pair costs: cycles
    everywhere, so the LP relaxation is fractional and the MIP needs search."""
    rng = random.Random(seed)
    ds = [
        Decision(f"v{i}_{j}", [f"o{o}" for o in range(k)], [round(rng.uniform(0, 1), 3) for _ in range(k)])
        for i in range(n)
        for j in range(n)
    ]
    es = [
        Edge(f"v{i}_{j}", f"v{i + di}_{j + dj}", 0, [[round(rng.uniform(0, 2), 3) for _ in range(k)] for _ in range(k)])
        for i in range(n)
        for j in range(n)
        for di, dj in ((0, 1), (1, 0))
        if i + di < n and j + dj < n
    ]
    return Problem(ds, es, name=f"grid{n}")


def test_stopped_by_gap_reports_bound_and_gap():
    p = grid(8, 4, 1)
    s = solve(p, rel_gap=0.5)
    # The rounded, polished LP optimum is within 50% at the root: HiGHS stops
    # there, not proven optimal (the relaxation of this grid is fractional).
    assert s.status == "feasible" and not s.optimal
    assert s.bound is not None and s.bound < s.objective
    assert 0 < s.gap <= 0.5
    assert s.gap == pytest.approx((s.objective - s.bound) / s.objective, rel=1e-3)
    exact = solve(p)
    assert exact.status == "optimal" and exact.gap == 0.0 and exact.bound == exact.objective
    assert s.bound <= exact.objective + 1e-9 <= s.objective + 1e-9
    # The start alone is already close: far closer than the 50% allowed.
    assert s.objective <= exact.objective * 1.05


def test_time_limit_gives_a_bounded_solution():
    p = grid(14, 4, 1)
    s = solve(p, time_limit=0.5)
    assert s.status in ("optimal", "feasible")
    assert s.bound is not None and s.bound <= s.objective + 1e-9
    if s.status == "feasible":
        assert s.gap == pytest.approx((s.objective - s.bound) / s.objective, rel=1e-3)
    else:
        assert s.gap == 0.0 and s.bound == s.objective


def _local_optimum(p: Problem, choice: dict) -> bool:
    """No single decision can move to a cheaper feasible option."""
    base = sum(evaluate(p, choice))
    for d in p.decisions:
        for o in range(d.num_options):
            c = dict(choice, **{d.name: o})
            if o != choice[d.name] and feasible_choice(p, c) and sum(evaluate(p, c)) < base - 1e-9:
                return False
    return True


@pytest.mark.parametrize("seed", range(40))
def test_local_search_never_worse_and_stays_feasible(seed):
    p = random_problem(seed)
    if p.links:
        return  # improve() leaves linked problems alone (checked below)
    ref = brute_force(p)
    if ref is None:
        return
    rng = random.Random(seed)
    for _ in range(5):
        start = {d.name: rng.randrange(d.num_options) for d in p.decisions}
        if not feasible_choice(p, start):
            continue
        out = improve(p, start)
        assert feasible_choice(p, out)
        assert sum(evaluate(p, out)) <= sum(evaluate(p, start)) + 1e-12
        assert _local_optimum(p, out)


def test_local_search_respects_pins_resources_and_links():
    a = Decision("a", ["R", "S"], [5.0, 1.0])
    b = Decision("b", ["R", "S"], [5.0, 1.0])
    pinned = Problem([a, b], pins=[Pin("keep a", "a", [0])])
    assert improve(pinned, {"a": 0, "b": 0}) == {"a": 0, "b": 1}
    budget = Problem([a, b], resources=[ResourceConstraint("mem", {"a": [1.0, 3.0], "b": [1.0, 3.0]}, high=4.0)])
    out = improve(budget, {"a": 0, "b": 0})
    assert sorted(out.values()) == [0, 1]  # only one of them fits the budget sharded
    from solver.problem import Link

    linked = Problem([a, b], links=[Link("l", "a", "b", [0, 1])])
    assert improve(linked, {"a": 0, "b": 0}) == {"a": 0, "b": 0}


@pytest.mark.parametrize("n, seed", [(6, 0), (8, 1), (10, 1)])
def test_branching_on_decisions_matches_the_mip(monkeypatch, n, seed, caplog):
    """The decision branch and bound (solver.highs_bb) proves these grids
    itself; with no node budget HiGHS' MIP solves them: same optimum."""
    import logging

    from solver import highs_bb

    p = grid(n, 3, seed)
    with caplog.at_level(logging.DEBUG, logger="solver"):
        ours = solve(p)
    assert ours.status == "optimal" and ours.gap == 0.0
    fractional = any("LP relaxation is fractional" in r.getMessage() for r in caplog.records)
    if fractional:  # else the LP alone proved it, and there was nothing to branch on
        assert not any("did not finish" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(highs_bb.branch_and_bound, "__defaults__", (None, 0))
    mip = solve(p)
    assert mip.status == "optimal"
    assert ours.objective == pytest.approx(mip.objective, rel=1e-9, abs=1e-12)


def test_branching_on_decisions_with_brute_force(caplog):
    """Small random problems (pins, resources, inf pairs) and small grids
    (fractional relaxations, so the branching runs): the brute-force optimum."""
    import logging

    problems = [random_problem(seed) for seed in range(60)] + [grid(3, 2, seed) for seed in range(40)]
    checked = 0
    with caplog.at_level(logging.DEBUG, logger="solver"):
        for p in problems:
            ref = brute_force(p)
            if ref is None:
                continue
            s = solve(p, presolve=False)
            assert s.status == "optimal"
            assert s.objective == pytest.approx(ref[0], rel=1e-9, abs=1e-9), p.name
            checked += 1
    branched = sum("LP relaxation is fractional" in r.getMessage() for r in caplog.records)
    assert checked > 50 and branched >= 3, (checked, branched)
