"""Dual ascent on the local-polytope dual (solver.dual_bound): a lower bound
on every choice, never above the LP's optimum, exact on trees; its
rewriting of the costs is exact; pruning against a plan never drops a plan
no dearer; the resource filter drops only options no feasible choice takes."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from solver import Decision, Edge, Problem, ResourceConstraint
from solver.dual_bound import DualAscent, resource_filter
from solver.pricing_rounds import Pricer
from solver.pricing_quotient import build_quotient
from solver.tree_bound import choice_cost, eliminate

from test_tree_bound import brute_marginals, random_problem, tree_and_cyclic_problems

pytest.importorskip("highspy")


def full_lp(problem: Problem) -> float:
    """The LP relaxation (local polytope) over every option."""
    q = build_quotient(problem)
    full = Pricer(q)
    for i, c in enumerate(q.classes):
        full.add(i, np.flatnonzero(c.allowed))
    return full.solve_lp(None).objective


def test_bound_below_the_lp_and_the_optimum_exact_on_trees():
    exact = 0
    for seed, p, tree in tree_and_cyclic_problems(n=6, k=3, extra_edges=3):
        truth = brute_marginals(p)
        if not truth:
            continue
        opt = min(truth.values())
        q = build_quotient(p)
        d = DualAscent(q)
        bound = d.run(200)
        lp = full_lp(p)
        tol = 1e-7 * max(1.0, abs(opt))
        assert all(b <= a + 1e-12 * max(1.0, abs(a)) for b, a in zip(d.stats.bounds, d.stats.bounds[1:]))
        assert bound <= lp + tol <= opt + 2 * tol, (seed, bound, lp, opt)
        if tree:  # trees: the LP is exact and the ascent reaches it
            assert bound == pytest.approx(opt, rel=1e-6, abs=1e-9), seed
            assert choice_cost(q, d.decode()) == pytest.approx(opt, rel=1e-9)
            exact += 1
    assert exact >= 8


def test_rewritten_costs_are_exact_and_edges_never_negative():
    for seed in range(10):
        p = random_problem(seed, n=5, k=3, extra_edges=3)
        q = build_quotient(p)
        d = DualAscent(q)
        d.run(7)
        r = d.reparam()
        for e, a, b in zip(q.edges, r.alpha, r.beta):
            ok_p, ok_c = d.live[e.p], d.live[e.c]
            block = e.block(np.flatnonzero(ok_p), np.flatnonzero(ok_c))
            rewritten = block - a[ok_p][:, None] - b[ok_c][None, :]
            finite = np.isfinite(block)
            assert (rewritten[finite] >= -1e-9).all()
        for choice in itertools.product(*(np.flatnonzero(l).tolist() for l in d.live)):
            cost = choice_cost(q, list(choice))
            if not math.isfinite(cost):
                continue
            again = r.constant + sum(r.unary[i][o] for i, o in enumerate(choice))
            again += sum(
                float(e.block(np.array([choice[e.p]]), np.array([choice[e.c]]))[0, 0]) - a[choice[e.p]] - b[choice[e.c]]
                for e, a, b in zip(q.edges, r.alpha, r.beta)
            )
            assert again == pytest.approx(cost, rel=1e-9, abs=1e-9)
            assert cost >= d.bound() - 1e-9


def test_pruning_keeps_every_plan_no_dearer_and_forests_agree():
    checked = 0
    for seed in range(30):
        p = random_problem(seed, n=6, k=4, extra_edges=4)
        truth = brute_marginals(p)
        if not truth:
            continue
        opt = min(truth.values())
        names = [d.name for d in p.decisions]
        for slack in (0.0, 0.5):
            upper = opt + slack
            q = build_quotient(p)
            d = DualAscent(q)
            bound = d.run(100, upper=upper)
            assert min(upper, bound) <= opt + 1e-9
            el = eliminate(q, upper, trees=2, reparam=d.reparam())
            assert min(el.upper, el.bound) <= opt + 1e-9  # (el.upper: a forest's plan when cheaper)
            for i, name in enumerate(names):
                for o in range(q.classes[i].num_options):
                    best = truth.get((name, o), math.inf)  # the cheapest plan with it
                    if best <= upper - 1e-9:
                        assert d.live[i][o], (seed, name, o)
                        checked += 1
                    if best <= el.upper - 1e-9:
                        assert el.keep[i][o], (seed, name, o)
    assert checked > 100


def test_resource_filter_drops_only_infeasible_options():
    rng = np.random.default_rng(3)
    for seed in range(20):
        p = random_problem(seed, n=4, k=3, extra_edges=1)
        weights = {d.name: rng.integers(1, 6, 3).astype(float).tolist() for d in p.decisions}
        lightest = sum(min(w) for w in weights.values())
        high = lightest + float(rng.integers(0, 4))
        p = Problem(p.decisions, p.edges, resources=[ResourceConstraint("mem", weights, None, high)])
        q = build_quotient(p)
        allowed = [c.allowed.copy() for c in q.classes]
        resource_filter(q, allowed)
        usable = [set() for _ in q.classes]
        for choice in itertools.product(*(range(c.num_options) for c in q.classes)):
            if sum(weights[d.name][o] for d, o in zip(p.decisions, choice)) <= high:
                for i, o in enumerate(choice):
                    if q.classes[i].allowed[o]:
                        usable[i].add(o)
        for i, a in enumerate(allowed):
            assert set(np.flatnonzero(a).tolist()) == usable[i], seed  # one row: exact


def test_budget_at_the_lightest_total_pins_its_classes():
    """A memory budget only the lightest options meet (the parameters
    fully sharded): the filter leaves those alone, and the ascent's bound
    then counts what they cost."""
    d = [Decision("w", ["shard", "replicate"], [0.0, 0.0]), Decision("x", ["A", "B"], [1.0, 1.0])]
    e = [Edge("w", "x", 0, [[5.0, 0.0], [0.0, 5.0]])]
    p = Problem(d, e, resources=[ResourceConstraint("mem", {"w": [1.0, 8.0]}, None, 1.0)])
    q = build_quotient(p)
    bound = DualAscent(q).run(10)
    assert bound == pytest.approx(1.0)  # x at B, w at shard: 1 + 0
    assert DualAscent(build_quotient(Problem(d, e))).run(10) == pytest.approx(1.0)
    p2 = Problem(
        d,
        [Edge("w", "x", 0, [[5.0, 5.0], [0.0, 0.0]])],
        resources=[ResourceConstraint("mem", {"w": [1.0, 8.0]}, None, 1.0)],
    )
    assert DualAscent(build_quotient(p2)).run(10) == pytest.approx(6.0)  # without the filter: 1.0
