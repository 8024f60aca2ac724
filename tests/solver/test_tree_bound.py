"""Spanning-tree min-marginals (solver.tree_bound): lower bounds on the
cheapest plan holding each option, exact on tree-shaped problems, and an
elimination that never drops an optimal plan's options."""

from __future__ import annotations

import itertools
import math

import numpy as np

from solver import Decision, Edge, Link, Problem
from solver.pricing_quotient import build_quotient
from solver.tree_bound import choice_cost, eliminate, tree_marginals


def random_problem(seed: int, n: int, k: int, extra_edges: int, link: bool = False) -> Problem:
    rng = np.random.default_rng(seed)
    decisions = [
        Decision(f"d{i}", [f"o{j}" for j in range(k)], rng.uniform(0, 3, k).round(3).tolist()) for i in range(n)
    ]
    pairs = [(i - 1 - int(rng.integers(0, i)) if i > 1 else 0, i) for i in range(1, n)]  # a tree
    for _ in range(extra_edges):
        a, b = sorted(rng.choice(n, 2, replace=False).tolist())
        pairs.append((a, b))
    edges = []
    for a, b in pairs:
        m = rng.uniform(0, 4, (k, k)).round(3)
        m[rng.random((k, k)) < 0.15] = math.inf
        edges.append(Edge(f"d{a}", f"d{b}", len(edges), m.tolist()))
    links = [Link("rep", "d0", f"d{n - 1}", list(range(k)))] if link else []
    if link:
        decisions[-1] = Decision(f"d{n - 1}", decisions[-1].options, decisions[0].costs)
    return Problem(decisions, edges, links=links, name=f"tree{seed}")


def brute_marginals(problem: Problem) -> dict[tuple[str, int], float]:
    names = [d.name for d in problem.decisions]
    best: dict[tuple[str, int], float] = {}
    links = [(l.a, l.b, l.mapping) for l in problem.links]
    for choice in itertools.product(*(range(d.num_options) for d in problem.decisions)):
        c = dict(zip(names, choice))
        if any(m[c[a]] != c[b] for a, b, m in links):
            continue
        cost = sum(d.costs[c[d.name]] for d in problem.decisions)
        cost += sum(e.costs[c[e.producer]][c[e.consumer]] for e in problem.edges)
        for name in names:
            key = (name, c[name])
            best[key] = min(best.get(key, math.inf), cost)
    return best


def tree_and_cyclic_problems(n: int, k: int, extra_edges: int):
    """(seed, problem, whether a tree) for 30 seeds: every third a tree,
    every fourth with a link."""
    for seed in range(30):
        extra = 0 if seed % 3 == 0 else extra_edges
        yield seed, random_problem(seed, n=n, k=k, extra_edges=extra, link=seed % 4 == 1), extra == 0


def test_marginals_bound_every_option_and_are_exact_on_trees():
    exact_checked = 0
    for seed, p, tree in tree_and_cyclic_problems(n=5, k=3, extra_edges=2):
        q = build_quotient(p)
        tm = tree_marginals(q)
        truth = brute_marginals(p)
        opt = min(truth.values(), default=math.inf)
        assert tm.bound <= opt + 1e-9
        for qi, cls in enumerate(q.classes):
            for name, omap in cls.members:
                for o in range(cls.num_options):
                    want = truth.get((name, int(o if omap is None else omap[o])), math.inf)
                    got = tm.marginals[qi][o]
                    assert got <= want + 1e-9, (seed, name, o, got, want)
                    if tree and not p.links:
                        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12) or got == want == math.inf
                        exact_checked += 1
    assert exact_checked


def test_elimination_keeps_every_optimal_choice_and_drops_options():
    dropped = 0
    for seed in range(30):
        p = random_problem(seed, n=5, k=4, extra_edges=2)
        truth = brute_marginals(p)
        opt = min(truth.values(), default=math.inf)
        if not math.isfinite(opt):
            continue
        q = build_quotient(p)
        el = eliminate(q, opt + 1.0, trees=3)  # a plan costing more than the optimum
        keep, bound = el.keep, el.bound
        assert bound <= opt + 1e-9
        if el.plan is not None:  # a forest's plan, priced on the whole problem
            assert el.upper >= opt - 1e-9
            assert math.isclose(el.upper, choice_cost(q, el.plan), rel_tol=1e-12)
        for qi, cls in enumerate(q.classes):
            for o in range(cls.num_options):
                if truth.get((cls.name, o), math.inf) <= opt + 1e-12:  # in some optimal plan
                    assert keep[qi][o], (seed, cls.name, o)
        dropped += sum(int((~k & c.allowed).sum()) for k, c in zip(keep, q.classes))
    assert dropped


def test_forest_plan_cost_matches_brute_force():
    for seed in range(10):
        p = random_problem(seed, n=4, k=3, extra_edges=2)
        q = build_quotient(p)
        tm = tree_marginals(q)
        if min(tm.choice) < 0:
            continue
        c = {q.classes[i].name: o for i, o in enumerate(tm.choice)}
        want = sum(d.costs[c[d.name]] for d in p.decisions)
        want += sum(e.costs[c[e.producer]][c[e.consumer]] for e in p.edges)
        assert math.isclose(choice_cost(q, tm.choice), want, rel_tol=1e-12)
        # the forest's optimum is its bound: its edges at the choice sum to it
        assert tm.bound <= want + 1e-9


def test_forest_over_dual_rewritten_costs_bounds_between_lp_bound_and_optimum():
    """Rewritten by a restricted LP's extended duals, a forest bounds at
    least as high as the LP bound (lp + sum of negative reduced costs) and
    never above the optimum; options of optimal plans survive elimination."""
    import sys
    import os

    sys.path.insert(0, os.path.dirname(__file__))
    from test_pricing import layered_problem, reducing_copy
    from solver import solve
    from solver.pricing_rounds import Pricer

    higher = 0
    for seed in range(8):
        p = reducing_copy(layered_problem(seed, inf_rate=0.1, pins=False))
        q = build_quotient(p)
        pr = Pricer(q)
        pr.seed(p, None)
        lp = pr.solve_lp(None)
        if lp is None:
            continue
        r = pr.reduced_costs(lp)
        lp_bound = lp.objective + sum(min(0.0, float(x.min())) for x in r)
        dense = Problem(
            p.decisions,
            [Edge(e.producer, e.consumer, e.arg_index, e.costs.array.tolist()) for e in p.edges],
            p.pins,
            p.links,
            p.resources,
            p.name,
        )
        ref = solve(dense)
        tm = tree_marginals(q, reparam=pr.reparam)
        tol = 1e-7 * max(1.0, abs(ref.objective))
        assert lp_bound - tol <= tm.bound <= ref.objective + tol
        higher += tm.bound > lp_bound + tol
        el = eliminate(q, ref.objective, trees=2, reparam=pr.reparam)
        for name, o in ref.choice.items():
            qi = next(i for i, c in enumerate(q.classes) if any(m == name for m, _ in c.members))
            cls = q.classes[qi]
            omap = dict(cls.members)[name]
            root = o if omap is None else int(np.flatnonzero(omap == o)[0])
            assert el.keep[qi][root], (seed, name)
    assert higher
