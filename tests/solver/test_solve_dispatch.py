"""solve()'s route through option pricing (solver.api.PRICING_MIN_PAIRS):
the same optimum as the ILP, proven, on random problems with links, pins,
forbidden pairs and resource rows; the ILP where pricing cannot prove its
plan; never pricing inside pricing."""

from __future__ import annotations

import time

import pytest

import solver
import solver.api as solver_api
from solver import InfeasibleError, evaluate, solve, violations
from solver.problem import Decision, Edge, Problem, Solution

from ilp_cases import brute_force, random_problem, transformer_problem


@pytest.mark.parametrize("chunk", range(2))
def test_priced_solves_match_brute_force_and_the_ilp(chunk):
    priced_seen = 0
    for seed in range(chunk * 1000, chunk * 1000 + 60):
        p = random_problem(seed)
        expected = brute_force(p)
        if expected is None:
            with pytest.raises(InfeasibleError):
                solve(p, pricing=True)
            continue
        s = solve(p, pricing=True)
        ilp = solve(p, pricing=False)
        assert s.status == "optimal" and s.optimal and s.gap == 0.0 and s.bound == s.objective
        assert violations(p, s.choice) == []
        unary, edge = evaluate(p, s.choice)
        assert (s.unary_cost, s.edge_cost) == (unary, edge)
        assert s.objective == pytest.approx(expected[0], rel=1e-9, abs=1e-15), (seed, s.choice, expected)
        assert s.objective == pytest.approx(ilp.objective, rel=1e-9, abs=1e-15), seed
        priced_seen += s.backend.startswith("pricing+")
    # most presolved problems keep a decision, and those go through pricing
    assert priced_seen >= 20


@pytest.mark.parametrize("budget", [None, 50.0])
def test_transformer_problem_priced_equals_ilp(budget):
    p = transformer_problem(layers=4, per_layer=30, seed=3, budget=budget)
    priced = solve(p, pricing=True)
    ilp = solve(p, pricing=False)
    assert priced.backend.startswith("pricing+") and not ilp.backend.startswith("pricing")
    assert priced.status == ilp.status == "optimal"
    assert priced.objective == pytest.approx(ilp.objective, rel=1e-9)
    assert violations(p, priced.choice) == []


def test_size_threshold_picks_the_route(monkeypatch):
    p = transformer_problem(layers=2, per_layer=20, seed=1)
    assert not solve(p).backend.startswith("pricing")  # a small problem: the ILP
    monkeypatch.setattr(solver_api, "PRICING_MIN_PAIRS", 0)
    assert solve(p).backend.startswith("pricing+")
    with solver.ilp_only():  # pricing's own restricted solves
        assert not solve(p).backend.startswith("pricing")
    assert not solve(p, pricing=False).backend.startswith("pricing")


def _fake_pricing(monkeypatch, status, objective_shift, bound_shift):
    """solve_by_pricing answering with the ILP's own optimum of the problem
    it is given, shifted (a worse plan) and with a made-up bound."""
    import solver.pricing as pricing_mod

    calls = []

    def fake(problem, initial=None, *, backend=None, time_limit=None, max_options=None):
        calls.append(problem.name)
        with solver.ilp_only():
            exact = solve(problem, presolve=False)
        # the worst choice of the first decision: a worse (or equal) plan
        d = problem.decisions[0]
        choice = dict(exact.choice)
        if objective_shift:
            choice[d.name] = max(range(len(d.options)), key=lambda o: d.costs[o])
        unary, edge = evaluate(problem, choice)
        sol = Solution(
            choice,
            unary + edge,
            unary,
            edge,
            status,
            status == "optimal",
            None,
            "pricing+fake",
            exact.objective - bound_shift,
        )
        return pricing_mod.PricingResult(
            sol, {d.name: list(range(len(d.options))) for d in problem.decisions}, pricing_mod.PricingStats()
        )

    monkeypatch.setattr(pricing_mod, "solve_by_pricing", fake)
    return calls


def test_unproven_pricing_falls_back_to_the_ilp(monkeypatch):
    p = Problem(
        [Decision("a", ["R", "S", "X"], [1.0, 0.5, 9.0]), Decision("b", ["R", "S", "X"], [1.0, 0.5, 9.0])],
        [Edge("a", "b", 0, [[0.0, 1.0, 1.0], [2.0, 0.0, 1.0], [1.0, 1.0, 0.0]])],
    )
    calls = _fake_pricing(monkeypatch, "feasible", True, 0.5)
    s = solve(p, pricing=True, presolve=False)
    assert calls and s.status == "optimal" and s.objective == pytest.approx(1.0)
    assert not s.backend.startswith("pricing")  # the ILP's proven plan


def test_unproven_pricing_out_of_time_returns_its_plan(monkeypatch):
    p = Problem(
        [Decision("a", ["R", "S", "X"], [1.0, 0.5, 9.0]), Decision("b", ["R", "S", "X"], [1.0, 0.5, 9.0])],
        [Edge("a", "b", 0, [[0.0, 1.0, 1.0], [2.0, 0.0, 1.0], [1.0, 1.0, 0.0]])],
    )
    _fake_pricing(monkeypatch, "feasible", False, 0.25)
    times = iter([0.0] + [100.0] * 50)  # every clock read after the start: past the limit
    monkeypatch.setattr(time, "perf_counter", lambda: next(times))
    s = solve(p, pricing=True, presolve=False, time_limit=10.0)
    assert s.backend == "pricing+fake" and s.status == "feasible" and s.objective == pytest.approx(1.0)
    assert s.bound == pytest.approx(0.75) and s.gap == pytest.approx(0.25)
