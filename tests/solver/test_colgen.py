"""The LP relaxation by column generation (solver.colgen) gives the full
LP's optimum, and solve() stays exact through it and through its fallback."""

from __future__ import annotations

import numpy as np
import pytest

from solver import colgen, solve
from solver.backends import HighsBackend
from solver.ilp import build

from ilp_cases import brute_force, random_problem, transformer_problem
from test_ilp import check_against_brute_force

pytest.importorskip("highspy")


def _full_lp(model) -> float:
    h = HighsBackend._highs({"presolve": "off"}, None)
    h.passModel(HighsBackend._lp(model))
    h.run()
    assert h.modelStatusToString(h.getModelStatus()) == "Optimal"
    return h.getInfo().objective_function_value


@pytest.fixture
def every_model(monkeypatch):
    """Column generation on every model, from one pair per row (the
    smallest start: pricing and the infeasible-start fallback both run)."""
    monkeypatch.setattr(colgen, "MIN_PAIR_COLUMNS", 0)
    monkeypatch.setattr(colgen, "INITIAL_PER_ROW", 1)
    outcomes = {"integral": 0, "fallback": 0, "rounds>1": 0}
    solve_lp = colgen.solve_lp

    def counted(model, deadline=None):
        lp = solve_lp(model, deadline)
        if lp is None:
            outcomes["fallback"] += 1
        else:
            x = np.asarray(lp.values[: model.num_x])
            outcomes["integral"] += bool(np.all(np.minimum(x, 1 - x) <= 1e-9))
            outcomes["rounds>1"] += lp.rounds > 1
        return lp

    monkeypatch.setattr(colgen, "solve_lp", counted)
    return outcomes


def test_random_problems_match_brute_force_through_column_generation(every_model):
    for seed in range(150):
        check_against_brute_force(random_problem(seed), "highs", False)
    # both ways out of column generation, and real pricing rounds, were taken
    assert every_model["integral"] > 20 and every_model["fallback"] > 0 and every_model["rounds>1"] > 0


def test_random_problems_with_presolve_match_brute_force_through_column_generation(every_model):
    for seed in range(1000, 1080):
        check_against_brute_force(random_problem(seed), "highs", True)
    assert every_model["integral"] > 0


@pytest.mark.parametrize("mesh_dims", [2, 3])
def test_column_generation_lp_equals_full_lp(monkeypatch, mesh_dims):
    monkeypatch.setattr(colgen, "INITIAL_PER_ROW", 1)
    p = transformer_problem(layers=1, per_layer=60, mesh_dims=mesh_dims, seed=3)
    model = build(p)
    assert model.num_cols - model.num_x > 1000
    lp = colgen.solve_lp(model)
    assert lp is not None, "the restricted LP of a transformer chain should be feasible"
    assert lp.objective == pytest.approx(_full_lp(model), rel=1e-9, abs=1e-12)
    assert lp.columns < model.num_cols - model.num_x  # it left columns out
    assert len(lp.values) == model.num_cols
    # the values are a feasible point of the full model
    v = np.asarray(lp.values)
    rows = np.repeat(np.arange(model.num_rows), np.diff(model.row_start))
    activity = np.bincount(rows, weights=model.row_value * v[model.row_index], minlength=model.num_rows)
    assert np.all(activity >= model.row_lower - 1e-7) and np.all(activity <= model.row_upper + 1e-7)
    assert float(model.col_cost @ v) == pytest.approx(lp.objective, rel=1e-9, abs=1e-12)


def test_solve_through_column_generation_equals_solve_without(monkeypatch):
    p = transformer_problem(layers=4, per_layer=40, mesh_dims=3, seed=5)
    monkeypatch.setattr(colgen, "MIN_PAIR_COLUMNS", 10**12)
    without = solve(p)
    monkeypatch.setattr(colgen, "MIN_PAIR_COLUMNS", 0)
    with_cg = solve(p)
    assert with_cg.status == without.status == "optimal"
    assert with_cg.objective == pytest.approx(without.objective, rel=1e-9)


def test_brute_force_helper_sees_the_small_cases():
    # the random suite above includes infeasible problems (the fallback's
    # InfeasibleError path) as well as feasible ones
    results = [brute_force(random_problem(seed)) for seed in range(150)]
    assert any(r is None for r in results) and any(r is not None for r in results)


def test_linked_layers_through_column_generation_equal_the_merged_problem(monkeypatch):
    """Linked layers share one set of columns after presolve; through column
    generation the optimum equals that of the same layers merged by hand,
    solved on the full LP."""
    full = transformer_problem(layers=6, per_layer=40, mesh_dims=3, seed=5)
    merged = transformer_problem(layers=6, per_layer=40, mesh_dims=3, seed=5, merged=True)
    monkeypatch.setattr(colgen, "MIN_PAIR_COLUMNS", 10**12)
    expected = solve(merged, presolve=False).objective
    monkeypatch.setattr(colgen, "MIN_PAIR_COLUMNS", 0)
    s = solve(full)
    assert s.status == "optimal" and s.presolve.merged_by_links > 0
    assert s.objective == pytest.approx(expected, rel=1e-9)
