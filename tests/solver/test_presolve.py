"""Presolve preserves the optimum: checked against brute force on random problems."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from solver.presolve import CONSTANT_DECISION, PresolveInfeasible, presolve
from solver.problem import (
    INF,
    Decision,
    Edge,
    Link,
    Pin,
    PresolveStats,
    Problem,
    ResourceConstraint,
)

TOL = 1e-6


# ------------------------------------------------------------------ brute force


def objective(p: Problem, choice: dict[str, int]) -> float:
    """Total cost of ``choice``; ``inf`` when it violates anything."""
    by = p.decision_index()
    total = 0.0
    for d in p.decisions:
        total += d.costs[choice[d.name]]
    for e in p.edges:
        total += e.costs[choice[e.producer]][choice[e.consumer]]
    for pin in p.pins:
        if choice[pin.decision] not in pin.allowed:
            return INF
    for link in p.links:
        if link.mapping[choice[link.a]] != choice[link.b]:
            return INF
    for r in p.resources:
        s = sum(w[choice[name]] for name, w in r.terms.items())
        if r.high is not None and s > r.high + 1e-7 * max(1, abs(r.high)):
            return INF
        if r.low is not None and s < r.low - 1e-7 * max(1, abs(r.low)):
            return INF
    assert set(choice) == set(by)
    return total


def brute_force(p: Problem) -> tuple[float, dict[str, int] | None]:
    names = [d.name for d in p.decisions]
    best, arg = INF, None
    for combo in itertools.product(*(range(d.num_options) for d in p.decisions)):
        choice = dict(zip(names, combo))
        v = objective(p, choice)
        if v < best - 1e-12:
            best, arg = v, choice
    return best, arg


def check_exact(p: Problem):
    """Presolve ``p``; assert the expanded reduced optimum is an optimum of ``p``."""
    p.validate()
    best, _ = brute_force(p)
    try:
        pre = presolve(p)
    except PresolveInfeasible:
        assert best == INF, "presolve called a feasible problem infeasible"
        return None
    q = pre.problem
    q.validate()
    assert not q.pins and not q.links
    rbest, rchoice = brute_force(q)
    if best == INF:
        assert rbest == INF, "reduced problem feasible, original not"
        return pre
    assert rbest < INF, "reduced problem infeasible, original feasible"
    assert math.isclose(rbest, best, rel_tol=TOL, abs_tol=TOL)
    full = pre.expand(rchoice)
    assert list(full) == [d.name for d in p.decisions]
    value = objective(p, full)
    assert math.isclose(value, best, rel_tol=TOL, abs_tol=TOL), (value, best)
    return pre


# ------------------------------------------------------------- random problems


def _cost(rng: random.Random, p_inf: float) -> float:
    return INF if rng.random() < p_inf else float(rng.randint(0, 6))


def random_problem(
    rng: random.Random,
    *,
    n: int | None = None,
    links: bool = True,
    pins: bool = True,
    resources: bool = True,
    p_inf: float = 0.08,
) -> Problem:
    n = n or rng.randint(1, 6)
    decisions = []
    for i in range(n):
        k = rng.randint(1, 4)
        decisions.append(Decision(f"d{i}", [f"o{j}" for j in range(k)], [_cost(rng, p_inf) for _ in range(k)]))
    edges = []
    for _ in range(rng.randint(0, 2 * n)):
        a, b = rng.sample(range(n), 2) if n > 1 else (0, 0)
        if a == b:
            continue
        na, nb = decisions[a].num_options, decisions[b].num_options
        kind = rng.random()
        if kind < 0.15:
            m = [[0.0] * nb for _ in range(na)]
        elif kind < 0.3:  # separable
            r = [float(rng.randint(0, 4)) for _ in range(na)]
            s = [float(rng.randint(0, 4)) for _ in range(nb)]
            m = [[r[i] + s[j] for j in range(nb)] for i in range(na)]
        elif kind < 0.5:  # "placements agree" diagonal
            m = [[0.0 if i == j else float(rng.randint(1, 5)) for j in range(nb)] for i in range(na)]
        else:
            m = [[_cost(rng, p_inf) for _ in range(nb)] for _ in range(na)]
        edges.append(Edge(f"d{a}", f"d{b}", rng.randint(0, 2), m))
    pin_list = []
    if pins and rng.random() < 0.4:
        for _ in range(rng.randint(1, 2)):
            i = rng.randrange(n)
            k = decisions[i].num_options
            allowed = sorted(rng.sample(range(k), rng.randint(1, k)))
            pin_list.append(Pin(f"pin{i}", f"d{i}", allowed))
    link_list = []
    if links and n > 1 and rng.random() < 0.7:
        for _ in range(rng.randint(1, n)):
            a, b = rng.sample(range(n), 2)
            na, nb = decisions[a].num_options, decisions[b].num_options
            targets = list(range(nb))
            rng.shuffle(targets)
            mapping: list[int | None] = []
            for i in range(na):
                if targets and rng.random() < 0.85:
                    mapping.append(targets.pop())
                else:
                    mapping.append(None)
            link_list.append(Link(f"link{a}{b}", f"d{a}", f"d{b}", mapping))
    res = []
    if resources and rng.random() < 0.4:
        members = rng.sample(range(n), rng.randint(1, n))
        terms = {f"d{i}": [float(rng.randint(0, 5)) for _ in range(decisions[i].num_options)] for i in members}
        lo_sum = sum(min(w) for w in terms.values())
        hi_sum = sum(max(w) for w in terms.values())
        mid = rng.uniform(lo_sum, hi_sum)
        kind = rng.random()
        low = None if kind < 0.5 else float(rng.randint(int(lo_sum), int(mid) + 1))
        high = None if 0.3 < kind < 0.7 else float(rng.randint(int(mid), int(hi_sum) + 1))
        res.append(ResourceConstraint("memory", terms, low, high))
    return Problem(decisions, edges, pin_list, link_list, res, name="random")


@pytest.mark.parametrize("seed", range(400))
def test_random_problems_keep_their_optimum(seed):
    check_exact(random_problem(random.Random(seed)))


@pytest.mark.parametrize("seed", range(100))
def test_random_unconstrained_problems(seed):
    rng = random.Random(10_000 + seed)
    check_exact(random_problem(rng, n=rng.randint(4, 7), links=False, pins=False, resources=False, p_inf=0.0))


@pytest.mark.parametrize("seed", range(60))
def test_random_link_cycles(seed):
    """Links around a cycle, with permutations that may or may not compose to identity."""
    rng = random.Random(20_000 + seed)
    n, k = rng.randint(3, 5), rng.randint(2, 4)
    p = random_problem(rng, n=n, links=False)
    p.decisions = [
        Decision(f"d{i}", [f"o{j}" for j in range(k)], [float(rng.randint(0, 6)) for _ in range(k)]) for i in range(n)
    ]
    p.edges = [
        Edge(f"d{i}", f"d{(i + 1) % n}", 0, [[float(rng.randint(0, 5)) for _ in range(k)] for _ in range(k)])
        for i in range(n)
    ]
    p.pins, p.resources = [], []
    for i in range(n):
        perm = list(range(k))
        if rng.random() < 0.3:
            rng.shuffle(perm)
        if rng.random() < 0.2:
            perm[rng.randrange(k)] = None
        p.links.append(Link(f"cycle{i}", f"d{i}", f"d{(i + 1) % n}", perm))
    check_exact(p)


# ----------------------------------------------------------- targeted behaviour


def layered(n_layers: int, k: int = 3) -> Problem:
    """A chain of layers of two decisions each, layers linked by identity."""
    decisions, edges, links = [Decision("emb", ["a", "b", "c"][:k], [0.0] * k)], [], []
    prev = "emb"
    diag = [[0.0 if i == j else 1.0 + i for j in range(k)] for i in range(k)]
    for layer in range(n_layers):
        for part, costs in (("attn", [3.0, 1.0, 2.0]), ("mlp", [1.0, 2.0, 0.5])):
            name = f"l{layer}.{part}"
            decisions.append(Decision(name, ["a", "b", "c"][:k], costs[:k]))
            edges.append(Edge(prev, name, 0, [row[:] for row in diag]))
            if layer:
                links.append(Link("layers", f"l0.{part}", name, list(range(k))))
            prev = name
    decisions.append(Decision("out", ["a", "b", "c"][:k], [0.0, 5.0, 5.0][:k]))
    edges.append(Edge(prev, "out", 0, [row[:] for row in diag]))
    return Problem(decisions, edges, links=links, name="layered")


def test_links_merge_repeated_layers_and_sum_their_edges():
    p = layered(3)
    pre = check_exact(p)
    s = pre.stats
    assert s.merged_by_links == 4  # 6 layer decisions -> 2 groups
    assert s.decisions_before == 8 and s.decisions_after <= 4
    assert s.edges_after < s.edges_before
    choice = pre.expand(brute_force(pre.problem)[1])
    for layer in range(1, 3):
        for part in ("attn", "mlp"):
            assert choice[f"l{layer}.{part}"] == choice[f"l0.{part}"]


def test_expand_respects_link_mappings():
    # b's option i corresponds to a's option 2 - i.
    p = Problem(
        [
            Decision("a", ["x", "y", "z"], [0.0, 1.0, 2.0]),
            Decision("b", ["z", "y", "x"], [5.0, 0.0, 0.0]),
            Decision("c", ["x", "y"], [0.0, 0.0]),
        ],
        [Edge("a", "c", 0, [[0.0, 9.0], [9.0, 0.0], [4.0, 4.0]])],
        links=[Link("rev", "a", "b", [2, 1, 0])],
    )
    pre = check_exact(p)
    choice = pre.expand(brute_force(pre.problem)[1])
    assert choice["b"] == [2, 1, 0][choice["a"]]


def test_partial_mapping_forbids_unmapped_options():
    p = Problem(
        [Decision("a", ["x", "y", "z"], [0.0, 5.0, 5.0]), Decision("b", ["x", "y"], [0.0, 0.0])],
        links=[Link("l", "a", "b", [None, 0, 1])],
    )
    pre = check_exact(p)
    choice = pre.expand(brute_force(pre.problem)[1])
    assert choice["a"] in (1, 2)
    assert pre.stats.options_removed_forbidden >= 1


def test_edge_inside_a_link_group_becomes_unary():
    # a -> b are linked, so only the diagonal of the edge can ever be paid.
    p = Problem(
        [Decision("a", ["x", "y"], [0.0, 0.0]), Decision("b", ["x", "y"], [0.0, 0.0])],
        [Edge("a", "b", 0, [[7.0, -100.0], [-100.0, 1.0]])],
        links=[Link("l", "a", "b", [0, 1])],
    )
    pre = check_exact(p)
    assert pre.stats.edges_after == 0
    assert pre.expand(brute_force(pre.problem)[1]) == {"a": 1, "b": 1}


def test_inconsistent_link_cycle_is_infeasible():
    p = Problem(
        [Decision(n, ["x", "y"], [0.0, 0.0]) for n in "abc"],
        links=[Link("ab", "a", "b", [0, 1]), Link("bc", "b", "c", [0, 1]), Link("ca", "c", "a", [1, 0])],
    )
    with pytest.raises(PresolveInfeasible, match=r"'a'.*links 'ab', 'ca'|'a'.*links"):
        presolve(p)


def test_contradictory_pins_are_infeasible():
    p = Problem(
        [Decision("a", ["x", "y"], [0.0, 0.0]), Decision("b", ["x", "y"], [0.0, 0.0])],
        pins=[Pin("pa", "a", [0]), Pin("pb", "b", [1])],
        links=[Link("same", "a", "b", [0, 1])],
    )
    with pytest.raises(PresolveInfeasible, match="'a'.*pin 'p[ab]'"):
        presolve(p)


def test_forbidden_pairs_propagate_to_infeasibility():
    p = Problem(
        [Decision("a", ["x", "y"], [0.0, INF]), Decision("b", ["x", "y"], [0.0, 0.0])],
        [Edge("a", "b", 0, [[INF, INF], [0.0, 0.0]])],
    )
    with pytest.raises(PresolveInfeasible, match="has no option left"):
        presolve(p)


def test_resource_bound_that_cannot_be_met_is_infeasible():
    p = Problem(
        [Decision("a", ["x", "y"], [0.0, 0.0]), Decision("b", ["x", "y"], [0.0, 0.0])],
        resources=[ResourceConstraint("mem", {"a": [3.0, 2.0], "b": [3.0, 2.5]}, high=4.0)],
    )
    with pytest.raises(PresolveInfeasible, match="'mem'"):
        presolve(p)


def test_dominance_drops_options_and_keeps_lowest_id_among_equals():
    p = Problem(
        [
            Decision("a", ["x", "y", "z", "w"], [1.0, 1.0, 3.0, 1.0]),
            Decision("b", ["x", "y"], [0.0, 0.0]),
            Decision("c", ["x", "y"], [0.0, 0.0]),
        ],
        [
            Edge("a", "b", 0, [[0.0, 2.0], [0.0, 2.0], [0.0, 2.0], [0.0, 1.0]]),
            Edge("a", "c", 0, [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 3.0]]),
            Edge("b", "c", 0, [[0.0, 5.0], [5.0, 0.0]]),
        ],
        # In a resource constraint (equal weights): not eliminated, only dominated.
        resources=[ResourceConstraint("mem", {"a": [1.0] * 4, "b": [1.0, 2.0], "c": [0.0, 0.0]}, high=10.0)],
    )
    pre = check_exact(p)
    # y equals x (higher id goes), z is worse than x; w is not comparable.
    assert pre.stats.options_removed_dominated >= 2
    assert [d.options for d in pre.problem.decisions if d.name == "a"] == [["x", "w"]]


def test_dominance_respects_resource_weights():
    # Option 0 is cheaper but heavier: it must survive as the only feasible one
    # would be option 1 under a tight budget, and the other way round.
    p = Problem(
        [Decision("a", ["x", "y"], [0.0, 1.0]), Decision("b", ["x", "y"], [0.0, 1.0])],
        resources=[ResourceConstraint("mem", {"a": [2.0, 1.0], "b": [2.0, 1.0]}, high=3.0)],
    )
    pre = check_exact(p)
    assert brute_force(p)[0] == 1.0
    assert pre.stats.options_removed_dominated == 0 or pre.problem.resources


def test_low_bound_resource():
    p = Problem(
        [Decision("a", ["x", "y"], [0.0, 1.0]), Decision("b", ["x", "y"], [0.0, 1.0])],
        resources=[ResourceConstraint("min", {"a": [0.0, 1.0], "b": [0.0, 1.0]}, low=1.0)],
    )
    check_exact(p)


def test_everything_decided_leaves_one_constant_decision():
    p = Problem(
        [Decision("a", ["x", "y"], [2.0, 1.0]), Decision("b", ["x"], [4.0])],
        [Edge("a", "b", 0, [[0.0], [0.5]])],
    )
    pre = check_exact(p)
    (d,) = pre.problem.decisions
    assert d.name == CONSTANT_DECISION and d.costs == [5.5]
    assert pre.stats.decisions_after == 0 and pre.stats.options_after == 0
    assert pre.expand({}) == {"a": 1, "b": 0}


@pytest.mark.parametrize("keep", [False, True])
def test_stats_are_consistent(keep):
    p = layered(4)
    if keep:  # unbounded resource terms keep decisions from being eliminated
        p.resources = [ResourceConstraint("tag", {d.name: [0.0] * d.num_options for d in p.decisions})]
    pre = presolve(p)
    s = pre.stats
    assert isinstance(s, PresolveStats)
    assert s.decisions_before == len(p.decisions)
    assert s.options_before == sum(d.num_options for d in p.decisions)
    assert s.edges_before == len(p.edges)
    assert s.pairs_before == sum(len(e.costs) * len(e.costs[0]) for e in p.edges)
    real = [d for d in pre.problem.decisions if d.name != CONSTANT_DECISION]
    assert s.decisions_after == len(real)
    assert (s.decisions_after > 0) == keep
    assert s.options_after == sum(d.num_options for d in real)
    assert s.edges_after == len(pre.problem.edges)
    assert s.pairs_after == sum(len(e.costs) * len(e.costs[0]) for e in pre.problem.edges)
    assert s.merged_by_links == 6  # 4 layers x 2 decisions -> 2 groups
    assert s.decisions_after + s.decisions_fixed + s.decisions_eliminated + s.merged_by_links == s.decisions_before
    assert s.pairs_after <= s.pairs_before
    assert set(pre.timings) == {"merge", "reduce", "emit"}


def test_presolve_does_not_mutate_its_input():
    rng = random.Random(7)
    for _ in range(30):
        p = random_problem(rng)
        snapshot = repr(p)
        try:
            presolve(p)
        except PresolveInfeasible:
            pass
        assert repr(p) == snapshot


def test_many_linked_layers_shrink_to_one_layer():
    p = layered(32)
    pre = presolve(p)
    assert pre.stats.decisions_after <= 4
    choice = pre.expand({d.name: 0 for d in pre.problem.decisions})
    assert len(choice) == len(p.decisions)
    assert len({choice[f"l{i}.attn"] for i in range(32)}) == 1


def test_conditional_dominance_forbids_pairs_no_optimum_uses():
    # Unbounded resource terms keep every decision (no elimination), so only
    # dominance can act. Given b = x, a prefers x; given b = y, a prefers y:
    # neither option of a dominates the other, but pairs (x, y), (y, x) go.
    free = ResourceConstraint("tag", {n: [0.0, 0.0] for n in "abc"})
    p = Problem(
        [
            Decision("a", ["x", "y"], [0.0, 0.0]),
            Decision("b", ["x", "y"], [0.0, 1.0]),
            Decision("c", ["x", "y"], [1.0, 0.0]),
        ],
        [
            Edge("a", "b", 0, [[0.0, 5.0], [5.0, 0.0]]),
            Edge("a", "c", 0, [[0.0, 1.0], [1.0, 0.0]]),
            Edge("b", "c", 0, [[0.0, 2.0], [2.0, 0.0]]),
        ],
        resources=[free],
    )
    pre = check_exact(p)
    assert pre.stats.pairs_removed_dominated >= 2
    assert pre.stats.options_removed_dominated == 0
    ab = next(e for e in pre.problem.edges if {e.producer, e.consumer} == {"a", "b"})
    assert ab.costs == [[0.0, INF], [INF, 0.0]]


@pytest.mark.parametrize("seed", range(150))
def test_random_problems_without_elimination(seed):
    """Every decision in an unbounded resource constraint: dominance does the work."""
    rng = random.Random(30_000 + seed)
    p = random_problem(
        rng, n=rng.randint(3, 6), links=rng.random() < 0.3, pins=False, resources=False, p_inf=rng.choice([0.0, 0.05])
    )
    p.resources = [ResourceConstraint("tag", {d.name: [0.0] * d.num_options for d in p.decisions})]
    check_exact(p)


def _without_pair_cuts(monkeypatch):
    from solver.presolve.reduce import ReducePhase

    monkeypatch.setattr(ReducePhase, "_pair_cuts", staticmethod(lambda u, C, D, *rest: [None] * D.shape[2]))


def _reduced(pre) -> tuple:
    q = pre.problem
    return (
        [(d.name, d.options, d.costs) for d in q.decisions],
        [(e.producer, e.consumer, e.costs) for e in q.edges],
        pre.stats,
    )


def test_sparse_dominance_drops_what_the_dense_test_drops(monkeypatch):
    """Big decisions bound the gain first and compute it exactly only where
    the bound allows dominance: the same options go as with the dense
    [k, i, j] test (pair cuts, dense only, switched off for the comparison)."""
    import solver.presolve.reduce as reduce_mod

    _without_pair_cuts(monkeypatch)
    removed = 0
    for seed in range(150):
        rng = random.Random(40_000 + seed)
        p = random_problem(
            rng,
            n=rng.randint(3, 6),
            links=rng.random() < 0.3,
            pins=False,
            resources=False,
            p_inf=rng.choice([0.0, 0.05, 0.2]),
        )
        p.resources = [ResourceConstraint("tag", {d.name: [0.0] * d.num_options for d in p.decisions})]
        try:
            dense = _reduced(presolve(p))
        except PresolveInfeasible:
            dense = None
        with monkeypatch.context() as m:
            m.setattr(reduce_mod, "DENSE_DOMINANCE_MAX", 0)
            try:
                sparse = _reduced(check_exact(p) or presolve(p))
            except PresolveInfeasible:
                sparse = None
        assert sparse == dense, seed
        removed += 0 if dense is None else dense[2].options_removed_dominated
    assert removed > 20  # the comparison saw dominance at work
