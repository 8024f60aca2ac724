"""The ILP against brute force on small random problems, plus the encoding
shortcuts, backends and the solve() contract."""

from __future__ import annotations

import importlib.util
import random

import pytest

import solver
from solver import InfeasibleError, evaluate, solve, violations
from solver.backends import get_backend
from solver.ilp import build
from solver.problem import INF, Decision, Edge, Link, Pin, Problem, ResourceConstraint

from ilp_cases import brute_force, random_problem, transformer_problem

BACKENDS = solver.available_backends()
HAS_PRESOLVE = importlib.util.find_spec("solver.presolve") is not None
PRESOLVE = [False, pytest.param(True, marks=pytest.mark.skipif(not HAS_PRESOLVE, reason="no solver.presolve yet"))]


def check_against_brute_force(problem: Problem, backend: str, presolve: bool) -> None:
    expected = brute_force(problem)
    if expected is None:
        with pytest.raises(InfeasibleError):
            solve(problem, backend=backend, presolve=presolve)
        return
    s = solve(problem, backend=backend, presolve=presolve)
    assert s.status == "optimal" and s.optimal and s.gap == 0.0
    assert violations(problem, s.choice) == []
    unary, edge = evaluate(problem, s.choice)
    assert s.objective == pytest.approx(unary + edge, rel=1e-12, abs=1e-12)
    assert (s.unary_cost, s.edge_cost) == (unary, edge)
    assert s.objective == pytest.approx(expected[0], rel=1e-6, abs=1e-15), f"brute force {expected}, got {s.choice}"


@pytest.mark.parametrize("presolve", PRESOLVE)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", range(4))
def test_random_problems_match_brute_force(backend, presolve, chunk):
    # CBC runs as a subprocess: give it fewer problems.
    per_chunk = 60 if backend == "highs" else 15
    for seed in range(chunk * 1000, chunk * 1000 + per_chunk):
        check_against_brute_force(random_problem(seed), backend, presolve)


def test_random_problems_cover_every_case():
    """The random suite really exercises what it claims to."""
    seen = {
        "infeasible": 0,
        "separable": 0,
        "pairwise": 0,
        "fixed": 0,
        "links": 0,
        "resources": 0,
        "pins": 0,
        "inf pairs": 0,
        "diagonal": 0,
        "blocks": 0,
    }
    for seed in range(240):
        p = random_problem(seed)
        m = build(p)
        if m.infeasible is not None or brute_force(p) is None:
            seen["infeasible"] += 1
            continue
        seen["separable"] += m.stats["edges_separable"] > 0
        seen["pairwise"] += m.stats["edges_pairwise"] > 0
        seen["diagonal"] += m.stats["edges_diagonal"] > 0
        seen["blocks"] += m.stats["pair_blocks"] < m.stats["finite_pairs"]
        seen["fixed"] += m.stats["fixed_decisions"] > 0
        seen["links"] += bool(p.links)
        seen["resources"] += bool(p.resources)
        seen["pins"] += bool(p.pins)
        seen["inf pairs"] += any(INF in row for e in p.edges for row in e.costs)
    assert all(v >= 5 for v in seen.values()), seen


def two(name, costs):
    return Decision(name, [f"o{i}" for i in range(len(costs))], list(costs))


def test_separable_and_zero_matrices_need_no_pair_variables():
    rng = random.Random(0)
    r, s = [rng.uniform(0, 3) for _ in range(3)], [rng.uniform(0, 3) for _ in range(4)]
    p = Problem(
        [two("a", [1, 2, 3]), two("b", [4, 1, 2, 9]), two("c", [0, 0, 1, 1])],
        [
            Edge("a", "b", 0, [[ri + sj for sj in s] for ri in r]),  # separable
            Edge("b", "c", 0, [[0.0] * 4 for _ in range(4)]),  # zero
            Edge("a", "c", 1, [[5.0] * 4 for _ in range(3)]),  # constant
        ],
    )
    m = build(p)
    assert m.num_cols == m.num_x == 11
    assert m.stats["edges_separable"] == 3 and m.stats["edges_pairwise"] == 0
    check_against_brute_force(p, "highs", False)


def test_pairwise_variables_skip_forbidden_pairs():
    p = Problem(
        [two("a", [1, 2, 3]), two("b", [3, 1, 2])],
        [Edge("a", "b", 0, [[0, INF, 1], [2, 0, INF], [INF, 1, 0]])],
    )
    m = build(p)
    assert m.num_cols - m.num_x == 6
    # 3 producer marginals + 2 consumer marginals (one is implied) + 2 one-hots
    assert m.num_rows == 7
    for b in BACKENDS:
        check_against_brute_force(p, b, False)


def test_interchangeable_options_share_pair_variables():
    # Consumer options 0/2 and 1/3 read the same input placement; producer
    # options 0 and 1 look the same to this edge.
    m = [[0, 4, 0, 4], [0, 4, 0, 4], [2, INF, 2, INF]]
    p = Problem(
        [two("a", [1, 2, 3]), two("b", [3, 1, 2, 0]), two("c", [1, 2])],
        [Edge("a", "b", 0, m), Edge("b", "c", 0, [[0, 1], [1, 0], [2, 0], [0, 3]])],
    )
    model = build(p)
    assert model.stats["finite_pairs"] == 10 + 8
    assert model.stats["pair_blocks"] == 3 + 8
    for b in BACKENDS:
        check_against_brute_force(p, b, False)


def test_parallel_and_linked_edges_are_summed():
    """Edges over the same columns (parallel ones, repeated linked layers)
    share one set of pair variables."""
    comm = [[0.0, 1.0, 2.0], [1.0, 0.0, 1.0], [3.0, 1.0, 0.0]]
    decisions, edges, links = [], [], []
    for layer in range(4):
        decisions += [two(f"u{layer}", [1, 2, 3]), two(f"v{layer}", [2, 1, 1])]
        edges += [Edge(f"u{layer}", f"v{layer}", 0, comm), Edge(f"u{layer}", f"v{layer}", 1, comm)]
        if layer:
            links += [Link("layers", "u0", f"u{layer}", [0, 1, 2]), Link("layers", "v0", f"v{layer}", [0, 1, 2])]
    p = Problem(decisions, edges, links=links)
    m = build(p)
    assert m.num_x == 6 and m.num_cols - m.num_x == 9
    assert m.stats["edge_groups"] == 1
    check_against_brute_force(p, "highs", False)


def test_linked_decisions_with_an_edge_pay_the_diagonal():
    p = Problem(
        [two("fwd", [1, 1, 1]), two("bwd", [1, 1, 1])],
        [Edge("fwd", "bwd", 0, [[5, 0, 0], [3, 1, 0], [0, 0, INF]])],
        links=[Link("fwd/bwd", "fwd", "bwd", [1, 0, 2])],
    )
    m = build(p)
    assert m.stats["edges_diagonal"] == 1 and m.num_cols == m.num_x == 3
    s = solve(p, presolve=False)
    assert s.choice == {"fwd": 0, "bwd": 1} and s.objective == 2.0


def test_links_with_cycles_of_mappings():
    """Links that map a decision onto itself through a cycle force some
    options off; the substitution must stay exact."""
    p = Problem(
        [two("a", [1, 2, 5]), two("b", [1, 1, 1])],
        [Edge("a", "b", 0, [[0, 1, 1], [1, 0, 1], [1, 1, 0]])],
        links=[Link("same", "a", "b", [0, 1, 2]), Link("swap", "b", "a", [1, 0, 2])],
    )
    for b in BACKENDS:
        check_against_brute_force(p, b, False)
    assert solve(p, presolve=False).choice == {"a": 2, "b": 2}


def test_resource_constraint_low_and_high():
    rng = random.Random(7)
    decisions = [two(f"d{k}", [rng.uniform(0, 5) for _ in range(3)]) for k in range(5)]
    edges = [Edge(f"d{k}", f"d{k + 1}", 0, [[rng.uniform(0, 2) for _ in range(3)] for _ in range(3)]) for k in range(4)]
    terms = {d.name: [3.0, 1.0, 2.0] for d in decisions}
    for low, high in [(None, 7.0), (12.0, None), (9.0, 9.0), (8.0, 11.0)]:
        p = Problem(decisions, edges, resources=[ResourceConstraint("mem", terms, low, high)])
        for b in BACKENDS:
            check_against_brute_force(p, b, False)


def test_fixed_decisions_have_no_variables():
    p = Problem(
        [two("in", [0, 1]), two("a", [1, 2, 3]), two("b", [INF, 1, INF])],
        [Edge("in", "a", 0, [[0, 1, 2], [1, 0, 1]]), Edge("a", "b", 0, [[1, 2, 3]] * 3)],
        pins=[Pin("input", "in", [1])],
        resources=[ResourceConstraint("mem", {"in": [1, 2], "b": [0, 5, 0]}, high=7)],
    )
    m = build(p)
    assert m.fixed == {"in": 1, "b": 1} and m.num_x == 3
    check_against_brute_force(p, "highs", False)


def test_everything_fixed():
    p = Problem([two("a", [1, INF]), two("b", [2])], [Edge("a", "b", 0, [[3], [4]])])
    for b in BACKENDS:
        s = solve(p, backend=b, presolve=False)
        assert s.choice == {"a": 0, "b": 0} and s.objective == 6.0 and s.num_variables == 0


def test_tiny_costs_are_not_lost_to_solver_tolerances():
    p = Problem(
        [two("a", [3e-9, 1e-9]), two("b", [1e-9, 2e-9])],
        [Edge("a", "b", 0, [[0.0, 5e-9], [4e-9, 0.0]])],
    )
    for b in BACKENDS:
        check_against_brute_force(p, b, False)


def test_backend_selection():
    assert BACKENDS[0] == "highs" and "cbc" in BACKENDS
    assert get_backend().name == "highs"
    with pytest.raises(ValueError, match="unknown solver backend 'gurobi'.*highs"):
        solve(random_problem(1), backend="gurobi")


def test_solution_report_fields():
    p = transformer_problem(layers=2, per_layer=10, seed=0, merged=True)
    for b in BACKENDS:
        s = solve(p, backend=b, presolve=False)
        assert s.backend == b
        assert {"build", "solve", "extract", "total"} <= set(s.timings)
        assert s.num_variables > 0 and s.num_constraints > 0
        assert all(v >= 0 for v in s.timings.values())


def test_deterministic():
    p = transformer_problem(layers=4, per_layer=40, seed=3, merged=True)
    for b in BACKENDS:
        first = solve(p, backend=b, presolve=False)
        again = solve(p, backend=b, presolve=False)
        assert first.choice == again.choice


def test_gap_option():
    p = transformer_problem(layers=8, per_layer=60, seed=1, merged=True, budget=72.0)
    exact = solve(p, presolve=False)
    for b in BACKENDS:
        s = solve(p, backend=b, rel_gap=0.05, presolve=False)
        assert s.status in ("optimal", "feasible")
        assert s.objective <= exact.objective * 1.05 + 1e-9
        if s.status == "feasible":
            assert s.gap is None or 0 <= s.gap <= 0.05 + 1e-9


@pytest.mark.parametrize("budget", [None, 50.0])
def test_transformer_backends_agree(budget):
    """A mid-sized transformer-shaped problem: both backends, linked layers
    unmerged and merged by hand, all find the same optimum."""
    merged = transformer_problem(layers=6, per_layer=40, seed=5, merged=True, budget=budget)
    full = transformer_problem(layers=6, per_layer=40, seed=5, merged=False, budget=budget)
    objectives = [solve(merged, backend=b, presolve=False).objective for b in BACKENDS]
    s = solve(full, presolve=False)
    assert violations(full, s.choice) == []
    # The merged problem lacks nothing but the link structure, and the
    # residual edge between layers is paid once per layer boundary.
    assert objectives == pytest.approx([objectives[0]] * len(objectives), rel=1e-9)
    assert s.objective == pytest.approx(objectives[0], rel=1e-9)


def _binding_budget(seed: int) -> Problem | None:
    """A random problem (no links or pins) with one memory row that its
    unconstrained optimum breaks: half-way between the lightest choice and
    that optimum's weight."""
    rng = random.Random(seed)
    p = random_problem(50_000 + seed, max_decisions=6, max_options=4)
    p.links, p.pins, p.resources = [], [], []
    free = brute_force(p)
    if free is None:
        return None
    terms = {d.name: [float(rng.randint(1, 9)) for _ in d.options] for d in p.decisions}
    lightest = sum(min(w) for w in terms.values())
    used = sum(terms[n][o] for n, o in free[1].items())
    if used <= lightest:
        return None
    p.resources = [ResourceConstraint("memory budget", terms, high=(lightest + used) / 2)]
    return p


def _coupled_budget(seed: int) -> Problem:
    """A chain of decisions that like to agree (as linked layers do): heavy
    options cheap, light ones dear, and a budget that needs several light
    ones, more than one local move can bring."""
    rng = random.Random(seed)
    n = rng.randint(4, 6)
    names = [f"d{i}" for i in range(n)]
    decisions = [
        Decision(name, ["heavy", "light", "mid"], [0.0, 1.0 + rng.random(), 0.5 + rng.random()]) for name in names
    ]
    agree = [[0.0 if i == j else 3.0 + rng.random() for j in range(3)] for i in range(3)]
    edges = [Edge(a, b, 0, agree) for a, b in zip(names, names[1:])]
    weights = {name: [10.0, 1.0, 6.0] for name in names}
    need = rng.randint(2, n - 1)  # this many light decisions, at least
    budget = 10.0 * n - 9.0 * need
    return Problem(decisions, edges, resources=[ResourceConstraint("memory budget", weights, high=budget)])


def test_binding_budget_start_fits_and_solves_exactly():
    """With a binding row the LP mixes a plan that fits with one that does
    not; rounding each decision to its largest LP value may break the row,
    and the start is then each decision's lightest option among those the
    LP uses, which fits (a single row). Solves still match brute force."""
    import highspy
    import numpy as np

    from solver.backends import HighsBackend, _fits, _polished, _round, _rounded

    if "highs" not in BACKENDS:
        pytest.skip("needs highspy")
    repaired = 0
    for seed in range(150):
        p = _binding_budget(seed) if seed % 2 else _coupled_budget(seed)
        if p is None:
            continue
        model = build(p)
        if model.infeasible is not None or model.num_cols == 0:
            continue
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.passModel(HighsBackend._lp(model))
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            continue
        values = np.asarray(h.getSolution().col_value)
        # largest LP value per decision, after local search (which keeps or
        # sometimes restores the row)
        largest = _polished(model, _round(model, lambda c: -values[c]))
        start = _rounded(model, values)
        assert _fits(model, start), seed
        repaired += not _fits(model, largest)
        check_against_brute_force(p, "highs", presolve=False)
    assert repaired >= 3  # the repair was needed and worked
