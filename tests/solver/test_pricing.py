"""solve_by_pricing (solver.pricing): exact optima over small option
subsets, proven with LP duals, on dense and lazy edge matrices."""

from __future__ import annotations

import math

import numpy as np
import pytest

from solver import Decision, Edge, InfeasibleError, Link, Pin, Problem, ResourceConstraint, solve
from solver import pricing_proof
from solver.pricing import PricingResult, solve_by_pricing
from solver.pricing_rounds import Pricer
from solver.pricing_quotient import build_quotient

from ilp_cases import random_problem

pytest.importorskip("highspy")


class CountingMatrix:
    """A lazy matrix over a numpy array that counts the entries asked for."""

    def __init__(self, array: np.ndarray, floor: float | None = None):
        self.array = np.asarray(array, dtype=float)
        self.shape = self.array.shape
        finite = self.array[np.isfinite(self.array)]
        self.floor = (float(finite.min()) if finite.size else 0.0) if floor is None else floor
        self.requested = 0

    def block(self, rows, cols):
        self.requested += len(rows) * len(cols)
        return self.array[np.ix_(rows, cols)]


def lazy_copy(problem: Problem) -> tuple[Problem, list[CountingMatrix]]:
    """``problem`` with every edge matrix lazy; edges sharing a list share
    one lazy object."""
    made: dict[int, CountingMatrix] = {}
    edges = []
    for e in problem.edges:
        m = made.get(id(e.costs))
        if m is None:
            m = made[id(e.costs)] = CountingMatrix(np.array(e.costs, dtype=float))
        edges.append(Edge(e.producer, e.consumer, e.arg_index, m))
    p = Problem(problem.decisions, edges, problem.pins, problem.links, problem.resources, problem.name)
    return p, list(made.values())


def reference(problem: Problem) -> float | None:
    try:
        return solve(problem).objective
    except InfeasibleError:
        return None


def check(problem: Problem, initial=None, dense: Problem | None = None, **kw) -> PricingResult | None:
    """solve_by_pricing agrees with solve() on ``dense`` (default: the
    problem itself) and its bound holds."""
    want = reference(dense or problem)
    if want is None:
        with pytest.raises(InfeasibleError):
            solve_by_pricing(problem, initial, **kw)
        return None
    res = solve_by_pricing(problem, initial, **kw)
    sol = res.solution
    tol = 1e-9 * max(1.0, abs(want))
    assert sol.status == "optimal", (problem.name, sol.objective, sol.bound, want)
    assert abs(sol.objective - want) <= tol, (problem.name, sol.objective, want)
    assert res.stats.lower_bound <= want + 1e-7 * max(1.0, abs(want))
    assert sol.bound <= want + tol
    for name, kept in res.kept.items():
        assert sol.choice[name] in kept
    return res


def one_option_each(problem: Problem) -> dict[str, list[int]]:
    return {d.name: [0] for d in problem.decisions}


def test_small_random_problems_dense_and_lazy():
    for seed in range(120):
        p = random_problem(seed, max_decisions=7, max_options=5)
        check(p)
        check(lazy_copy(p)[0], one_option_each(p), dense=p)


def layered_problem(
    seed: int, *, layers=3, ops=4, options=12, pins=True, resource=True, inf_rate=0.05, lazy=True
) -> Problem:
    """Repeated layers (identity links, shared matrix objects) of a small
    op graph with a residual edge (an undirected cycle), an input feeding
    every layer (parallel edges between classes), pins, inf entries and a
    binding memory row."""
    rng = np.random.default_rng(seed)
    decisions = [Decision("inp", [f"o{k}" for k in range(options)], rng.uniform(0, 2, options).round(3).tolist())]
    op_costs = [rng.uniform(0, 5, options).round(3).tolist() for _ in range(ops)]
    mats = []
    for _ in range(ops + 1):
        m = rng.uniform(0, 10, (options, options)).round(3)
        np.fill_diagonal(m, rng.uniform(0, 1, options).round(3))
        m[rng.random((options, options)) < inf_rate] = math.inf
        mats.append(CountingMatrix(m) if lazy else m.tolist())
    edges, links = [], []
    for layer in range(layers):
        names = [f"L{layer}.op{k}" for k in range(ops)]
        decisions += [Decision(n, [f"o{k}" for k in range(options)], op_costs[k]) for k, n in enumerate(names)]
        prev = f"L{layer - 1}.op{ops - 1}" if layer else "inp"
        edges.append(Edge(prev, names[0], 0, mats[0]))
        for k in range(1, ops):
            edges.append(Edge(names[k - 1], names[k], 0, mats[k]))
        edges.append(Edge(names[0], names[-1], 1, mats[ops]))  # residual
        edges.append(Edge("inp", names[1], 1, mats[1]))  # the input again, every layer
        if layer:
            links += [Link("layers", f"L0.op{k}", n, list(range(options))) for k, n in enumerate(names)]
    pin_list = [Pin("input layout", "inp", sorted(rng.choice(options, 4, replace=False).tolist()))] if pins else []
    resources = []
    if resource:
        w = rng.integers(1, 9, options).astype(float).tolist()
        terms = {f"L{layer}.op0": w for layer in range(layers)}
        best = min(range(options), key=lambda o: op_costs[0][o])
        w[best] = 9.0  # the cheapest option is the heaviest: the row binds
        resources.append(ResourceConstraint("memory", terms, high=layers * w[best] - 1))
    return Problem(decisions, edges, pin_list, links, resources, name=f"layered{seed}")


def dense_copy(problem: Problem) -> Problem:
    edges = [Edge(e.producer, e.consumer, e.arg_index, e.costs.array.tolist()) for e in problem.edges]
    return Problem(problem.decisions, edges, problem.pins, problem.links, problem.resources, problem.name)


def test_layered_lazy_problems_match_dense_solve():
    for seed in range(12):
        lazy = layered_problem(seed, inf_rate=0.05 if seed % 3 else 0.3)
        want = reference(dense_copy(lazy))
        if want is None:
            with pytest.raises(InfeasibleError):
                solve_by_pricing(lazy)
            continue
        for initial in (None, one_option_each(lazy)):
            res = solve_by_pricing(lazy, initial)
            assert res.solution.status == "optimal"
            assert abs(res.solution.objective - want) <= 1e-9 * max(1.0, want)
            assert res.solution.bound <= want + 1e-9 * max(1.0, want)
            # linked decisions take corresponding options; the memory row holds
            ch = res.solution.choice
            assert all(ch[f"L{layer}.op1"] == ch["L0.op1"] for layer in range(3))


def test_resource_binds_and_is_met():
    free = layered_problem(3, inf_rate=0.0, resource=False)
    unbound = solve_by_pricing(free)
    # the free optimum's op0 option is the heaviest: the row binds
    w = [float(1 + k % 8) for k in range(12)]
    w[unbound.solution.choice["L0.op0"]] = 9.0
    terms = {f"L{layer}.op0": w for layer in range(3)}
    row = ResourceConstraint("memory", terms, high=3 * 9.0 - 1)
    lazy = Problem(free.decisions, free.edges, free.pins, free.links, [row], "bound")
    bound = check(lazy, dense=dense_copy(lazy))
    assert bound.solution.objective > unbound.solution.objective + 1e-9
    assert sum(w[bound.solution.choice[n]] for n in terms) <= row.high


def test_one_option_seed_prices_options_in():
    # lazy matrices without min-plus reductions: no tree elimination, all rounds
    p = layered_problem(5, pins=False, resource=False, inf_rate=0.0)
    # seed with each decision's most expensive option: pricing must move away
    worst = {d.name: [int(np.argmax(d.costs))] for d in p.decisions}
    res = check(p, worst, dense=dense_copy(p))
    assert res.stats.rounds > 1 and sum(res.stats.priced_per_round) > 0
    # options entered relaxed, then exact when the LP leaned on them
    assert max(res.stats.relaxed_per_round) > 0 and sum(res.stats.promoted_per_round) > 0
    assert res.stats.converged
    assert any(res.solution.choice[n] not in worst[n] for n in worst)


def test_duals_match_highs_reduced_costs_and_full_lp():
    """The x columns' reduced costs computed from the row duals equal HiGHS'
    own (its sign convention), and the converged restricted LP's bound equals
    the LP over all options."""
    for seed in range(6):
        p = layered_problem(seed, inf_rate=0.1)
        q = build_quotient(p)
        pr = Pricer(q)
        try:
            pr.seed(p, None)
        except InfeasibleError:
            continue
        for _ in range(50):
            lp = pr.solve_lp(None)
            assert lp is not None
            r = pr.reduced_costs(lp)
            for qi, rq in enumerate(r):
                assert np.allclose(rq[lp.options[qi]], lp.x_reduced[qi], atol=1e-7)
            picks = pr.select(r, 1e-9 / pr.scale)
            bound = lp.objective + sum(min(0.0, float(x.min())) for x in r)
            promote = pr.promotions(lp, lp.fake)
            if not picks and not promote:
                break
            for _, qi, o in picks:
                pr.relax(qi, o)
            for qi, opts in promote:
                pr.add(qi, opts)
        full = Pricer(q)
        for qi, c in enumerate(q.classes):
            full.add(qi, np.flatnonzero(c.allowed))
        full_lp = full.solve_lp(None)
        assert abs(bound - full_lp.objective) <= 1e-7 * max(1.0, abs(full_lp.objective))
        assert pr.num_kept() < full.num_kept()


def test_lazy_matrix_read_sparingly():
    """300 options per decision, most of them expensive: only a small
    fraction of each matrix is ever asked for."""
    rng = np.random.default_rng(7)
    n, k = 300, 12
    decisions, edges = [], []
    unary = rng.uniform(50, 100, n)
    unary[rng.choice(n, 10, replace=False)] = rng.uniform(0, 5, 10)  # a few cheap ones
    for d in range(k):
        decisions.append(Decision(f"d{d}", [f"o{o}" for o in range(n)], unary.round(3).tolist()))
    mats = [CountingMatrix(rng.uniform(0, 10, (n, n)).round(3), floor=0.0) for _ in range(3)]
    for d in range(1, k):
        edges.append(Edge(f"d{d - 1}", f"d{d}", 0, mats[d % 3]))
    edges.append(Edge("d0", f"d{k - 1}", 1, mats[0]))
    lazy = Problem(decisions, edges, name="sparse")
    res = solve_by_pricing(lazy)
    dense = Problem(decisions, [Edge(e.producer, e.consumer, 0, e.costs.array.tolist()) for e in edges])
    want = solve(dense).objective
    assert res.solution.status == "optimal"
    assert abs(res.solution.objective - want) <= 1e-9 * want
    asked = sum(m.requested for m in mats)
    assert asked < 0.2 * len(mats) * n * n, asked
    assert res.stats.entries_read == asked
    assert sum(map(len, res.kept.values())) < 0.1 * k * n


def frustrated_problem(seed: int, n: int = 20) -> Problem:
    """An odd cycle of 'take different options' edges over two cheap
    options (and n - 2 dearer ones): the local LP relaxation takes halves
    of both at no clash, so it sits below every choice."""
    rng = np.random.default_rng(seed)
    k = 5
    decisions = []
    for i in range(k):
        u = np.concatenate([rng.uniform(0, 0.01, 2), rng.uniform(0.05, 0.3, n - 2)]).round(4)
        decisions.append(Decision(f"d{i}", [f"o{o}" for o in range(n)], u.tolist()))
    edges = []
    for i in range(k):
        m = rng.uniform(0, 0.01, (n, n)).round(4)
        m[np.arange(n), np.arange(n)] += 1.0  # equal options clash
        edges.append(Edge(f"d{i}", f"d{(i + 1) % k}", 0, m.tolist()))
    return Problem(decisions, edges, name=f"frustrated{seed}")


def test_reduced_cost_fixing_and_the_max_options_cap(monkeypatch):
    # without the dual ascent, which proves these small problems before any LP round
    monkeypatch.setattr(pricing_proof, "ASCENT", False)
    capped = fixed = 0
    for seed in range(6):
        p = frustrated_problem(seed)
        want = solve(p).objective
        full = check(p)  # no cap: proven optimal, at once or by fixing
        assert full.stats.lower_bound < want - 1e-6  # the LP is loose
        fixed += full.stats.fixed_in > 0
        caps = [len(p.decisions) + 1]
        if full.stats.fixed_in:  # the fixing step just over the cap
            caps.append(full.stats.kept_per_round[-1] + full.stats.fixed_in - 1)
        for cap in caps:
            sol = solve_by_pricing(p, one_option_each(p), max_options=cap).solution
            assert sol.bound <= want + 1e-9 <= sol.objective + 2e-9
            if sol.status == "optimal":
                assert sol.objective == pytest.approx(want, rel=1e-9)
            else:
                capped += 1
                assert sol.gap > 0 and sol.bound < sol.objective
    assert fixed and capped


def test_fixed_decisions_no_edges_and_infeasible_seed():
    d = [
        Decision("a", ["x", "y", "z"], [3.0, 1.0, 2.0]),
        Decision("b", ["x", "y", "z"], [0.0, 0.0, 0.0]),
        Decision("lonely", ["x", "y"], [2.0, 1.5]),
        Decision("fixed", ["x"], [0.25]),
    ]
    m = [[0.0, math.inf, math.inf], [math.inf, math.inf, 1.0], [math.inf, 0.0, math.inf]]
    p = Problem(
        d,
        [Edge("a", "b", 0, m), Edge("fixed", "b", 0, [[1.0, 0.0, 5.0]])],
        pins=[Pin("b not x", "b", [1, 2])],
        resources=[ResourceConstraint("mem", {"lonely": [0.0, 5.0]}, high=1.0)],
    )
    # seed {a: y, b: y}: the pair is forbidden (arc repair adds partners);
    # lonely's y breaks the memory row: the LP is infeasible until grown
    res = check(p, {"a": [1], "b": [1], "lonely": [1]})
    assert res.solution.choice == {"a": 2, "b": 1, "lonely": 0, "fixed": 0}


def test_infeasible_problem_raises():
    d = [Decision("a", ["x", "y"], [0.0, 0.0]), Decision("b", ["x", "y"], [0.0, 0.0])]
    p = Problem(
        d, [Edge("a", "b", 0, [[math.inf, 0.0], [0.0, math.inf]])], pins=[Pin("a x", "a", [0]), Pin("b x", "b", [0])]
    )
    with pytest.raises(InfeasibleError):
        solve_by_pricing(p)


def test_deterministic():
    p = layered_problem(2)
    a = solve_by_pricing(p)
    b = solve_by_pricing(layered_problem(2))
    assert a.solution.choice == b.solution.choice and a.kept == b.kept
    assert a.stats.kept_per_round == b.stats.kept_per_round


def test_time_limit_still_answers_with_a_valid_bound():
    p = layered_problem(4, inf_rate=0.0)
    want = solve(dense_copy(p)).objective
    sol = solve_by_pricing(p, one_option_each(p), time_limit=1e-3).solution
    assert sol.objective >= want - 1e-9
    assert sol.bound is None or sol.bound <= want + 1e-9
    if sol.status == "optimal":
        assert sol.objective == pytest.approx(want, rel=1e-9)


def test_no_edges_and_bad_initial():
    p = Problem(
        [Decision("a", ["x", "y"], [2.0, 1.0]), Decision("b", ["x"], [0.5])],
        resources=[ResourceConstraint("mem", {"a": [1.0, 3.0]}, high=2.0)],
    )
    res = check(p, {})
    assert res.solution.choice == {"a": 0, "b": 0}
    with pytest.raises(ValueError, match="0..1"):
        solve_by_pricing(p, {"a": [2]})
    with pytest.raises(KeyError, match="nope"):
        solve_by_pricing(p, {"nope": [0]})


class ReducingMatrix(CountingMatrix):
    """A lazy matrix that also reduces whole rows and columns (min-plus)."""

    def min_plus_rows(self, col_values):
        return (self.array - col_values[None, :]).min(axis=1)

    def min_plus_cols(self, row_values):
        return (self.array - row_values[:, None]).min(axis=0)


def reducing_copy(problem: Problem) -> Problem:
    made: dict[int, ReducingMatrix] = {}
    edges = []
    for e in problem.edges:
        costs = e.costs.array if isinstance(e.costs, CountingMatrix) else np.array(e.costs, dtype=float)
        m = made.setdefault(id(e.costs), ReducingMatrix(costs))
        edges.append(Edge(e.producer, e.consumer, e.arg_index, m))
    return Problem(problem.decisions, edges, problem.pins, problem.links, problem.resources, problem.name)


def test_quotient_edge_min_plus_is_exact_or_a_lower_bound():
    """One term (a matrix object shared by linked edges, counted): the
    reduction equals brute force over the summed matrix; several terms:
    a lower bound on it, with -inf values leaving options out."""
    rng = np.random.default_rng(3)
    for seed in range(12):
        p = reducing_copy(layered_problem(seed, inf_rate=0.2))
        q = build_quotient(p)
        for e in q.edges:
            n_p, n_c = q.classes[e.p].num_options, q.classes[e.c].num_options
            full = e.block(np.arange(n_p), np.arange(n_c))
            b = rng.uniform(-5, 5, n_c)
            b[rng.random(n_c) < 0.2] = -math.inf
            a = rng.uniform(-5, 5, n_p)
            want_rows = (full - b[None, :]).min(axis=1)
            want_cols = (full - a[:, None]).min(axis=0)
            got_rows, got_cols = e.min_plus(b, along_rows=True), e.min_plus(a, along_rows=False)
            if len(e.terms) == 1:
                assert np.allclose(got_rows, want_rows, rtol=1e-12, atol=1e-12, equal_nan=False)
                assert np.allclose(got_cols, want_cols, rtol=1e-12, atol=1e-12)
            else:
                assert (got_rows <= want_rows + 1e-9).all() and (got_cols <= want_cols + 1e-9).all()


def first_round_bound(problem: Problem) -> float | None:
    """The bound of the first restricted LP over the seed (None: infeasible)."""
    q = build_quotient(problem)
    pr = Pricer(q)
    pr.seed(problem, None)
    lp = pr.solve_lp(None)
    if lp is None:
        return None
    return lp.objective + sum(min(0.0, float(r.min())) for r in pr.reduced_costs(lp))


def test_whole_row_pricing_tightens_the_bound_and_stays_exact():
    """With min-plus reductions the same restricted LP gives a bound at
    least the one priced at the edge floor, tree elimination drops options
    before pricing, and the optimum is still the dense one."""
    tighter = eliminated = direct = 0
    for seed in range(10):
        base = layered_problem(seed, inf_rate=0.1, pins=False)
        dense = Problem(
            base.decisions,
            [Edge(e.producer, e.consumer, e.arg_index, e.costs.array.tolist()) for e in base.edges],
            base.pins,
            base.links,
            base.resources,
            base.name,
        )
        reducing = reducing_copy(base)
        floor_res = check(base, one_option_each(base), dense=dense)
        exact_res = check(reducing, one_option_each(base), dense=dense)
        if floor_res is None:
            continue
        assert floor_res.stats.eliminated == 0  # no min-plus: no tree elimination
        eliminated += exact_res.stats.eliminated
        direct += exact_res.stats.rounds == 0  # few options left: one ILP over all of them (check(): optimal)
        first_floor, first_exact = first_round_bound(base), first_round_bound(reducing)
        if first_floor is None:
            continue
        assert first_exact >= first_floor - 1e-9 * max(1.0, abs(first_floor))
        tighter += first_exact > first_floor + 1e-9
    assert tighter  # the floor is not always the cheapest partner
    assert eliminated  # tree min-marginals dropped options before pricing
    assert direct


def test_ilp_near_the_ascent_duals_is_no_dearer_than_a_decoded_plan():
    """The restricted ILP after an ascent holds the known plan, a decoded
    one included (whose options the subsets need not hold yet): its plan
    costs at most the known one and is a valid choice."""
    from solver.dual_bound import DualAscent
    from solver.tree_bound import choice_cost

    checked = 0
    for seed in range(12):
        p = reducing_copy(layered_problem(seed, inf_rate=0.1, resource=False))
        q = build_quotient(p)
        pr = Pricer(q)
        pr.seed(p, one_option_each(p))
        ascent = DualAscent(q)
        ascent.run(3)
        plan = ascent.decode()
        cost = choice_cost(q, plan)
        if not math.isfinite(cost) or all(pr.kept[i][o] for i, o in enumerate(plan)):
            continue  # no finite decoded plan outside the seed
        checked += 1
        upper, best = pricing_proof._ilp_near_duals(pr, ascent, cost, plan, None, None)
        assert upper <= cost
        assert choice_cost(q, best) == pytest.approx(upper, rel=1e-9)
        assert all(pr.kept[i][o] for i, o in enumerate(plan))
    assert checked


def test_ascent_meeting_its_plan_proves_without_rounds():
    """Where the dual ascent's bound meets its plan, no LP round runs and
    the plan is the dense optimum (check())."""
    closed = 0
    for seed in range(10):
        base = layered_problem(seed, inf_rate=0.1, pins=False, resource=False)
        two_each = {d.name: [0, 1] for d in base.decisions}
        res = check(reducing_copy(base), two_each, dense=dense_copy(base))
        if res is None or res.stats.rounds or res.stats.ascent_bound < res.solution.objective - 1e-9:
            continue
        closed += 1
        assert res.stats.ascent_sweeps > 0
    assert closed
