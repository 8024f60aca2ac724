"""Problem generators and a brute-force reference solver for the ILP tests."""

from __future__ import annotations

import itertools
import random

from solver.problem import INF, Decision, Edge, Link, Pin, Problem, ResourceConstraint

MATRIX_KINDS = ("random", "zero", "separable", "constant", "comm", "inf", "blocks")


def random_matrix(rng: random.Random, rows: int, cols: int, kind: str) -> list[list[float]]:
    if kind == "zero":
        return [[0.0] * cols for _ in range(rows)]
    if kind == "constant":
        v = rng.uniform(0, 5)
        return [[v] * cols for _ in range(rows)]
    if kind == "separable":
        r = [rng.uniform(-2, 5) for _ in range(rows)]
        s = [rng.uniform(-2, 5) for _ in range(cols)]
        return [[ri + sj for sj in s] for ri in r]
    if kind == "comm":  # free when "the same" option, a price otherwise
        return [[0.0 if i == j else rng.choice([1.0, 2.0, 4.0]) for j in range(cols)] for i in range(rows)]
    if kind == "blocks":  # interchangeable options: repeated rows and columns
        block = [[0.0, rng.choice([1.0, 3.5, INF])], [rng.choice([2.0, 6.0]), 0.0]]
        rclass = ([0, 1] + [rng.randrange(2) for _ in range(rows)])[:rows]
        cclass = ([0, 1] + [rng.randrange(2) for _ in range(cols)])[:cols]
        rng.shuffle(rclass)
        rng.shuffle(cclass)
        return [[block[rclass[i]][cclass[j]] for j in range(cols)] for i in range(rows)]
    m = [[round(rng.uniform(0, 10), 3) for _ in range(cols)] for _ in range(rows)]
    if kind == "inf":
        for row in m:
            for j in range(cols):
                if rng.random() < 0.3:
                    row[j] = INF
    return m


def random_problem(seed: int, *, max_decisions: int = 6, max_options: int = 4) -> Problem:
    """A small random problem: chain, tree or DAG, with every kind of cost
    matrix and constraint, sometimes infeasible."""
    rng = random.Random(seed)
    n = rng.randint(2, max_decisions)
    names = [f"d{k}" for k in range(n)]
    decisions = []
    for name in names:
        k = rng.randint(1, max_options)
        costs = [round(rng.uniform(0, 10), 2) for _ in range(k)]
        for o in range(k):
            if rng.random() < 0.1:
                costs[o] = INF
        decisions.append(Decision(name, [f"o{o}" for o in range(k)], costs))
    nopt = {d.name: d.num_options for d in decisions}

    shape = rng.choice(["chain", "tree", "dag", "dag"])
    pairs: list[tuple[int, int]] = []
    for k in range(1, n):
        if shape == "chain":
            pairs.append((k - 1, k))
        else:
            pairs.append((rng.randrange(k), k))
    if shape == "dag":  # fan-in, fan-out, parallel edges, backward edges
        for _ in range(rng.randint(0, n)):
            a, b = rng.sample(range(n), 2)
            pairs.append((min(a, b), max(a, b)) if rng.random() < 0.7 else (b, a))
    edges = []
    for arg, (a, b) in enumerate(pairs):
        kind = rng.choice(MATRIX_KINDS)
        m = random_matrix(rng, nopt[names[a]], nopt[names[b]], kind)
        edges.append(Edge(names[a], names[b], arg % 3, m))

    pins = []
    for t in range(rng.randint(0, 2)):
        d = rng.choice(decisions)
        allowed = sorted(rng.sample(range(d.num_options), rng.randint(1, d.num_options)))
        # Sometimes two pins share a name: one group.
        pins.append(Pin(f"pin {t if rng.random() < 0.8 else 0}", d.name, allowed))

    links = []
    for t in range(rng.randint(0, 2)):
        a, b = rng.sample(decisions, 2)
        targets = list(range(b.num_options))
        rng.shuffle(targets)
        mapping: list[int | None] = []
        for i in range(a.num_options):
            if targets and rng.random() < 0.85:
                mapping.append(targets.pop())
            else:
                mapping.append(None)
        links.append(Link(f"link {t}", a.name, b.name, mapping))

    resources = []
    for t in range(rng.randint(0, 2)):
        chosen = rng.sample(decisions, rng.randint(1, n))
        terms = {d.name: [float(rng.randint(0, 8)) for _ in range(d.num_options)] for d in chosen}
        lo_sum = sum(min(w) for w in terms.values())
        hi_sum = sum(max(w) for w in terms.values())
        low = high = None
        r = rng.random()
        if r < 0.4:
            high = float(rng.randint(int(lo_sum), int(hi_sum)))
        elif r < 0.7:
            low = float(rng.randint(int(lo_sum), int(hi_sum)))
        else:
            low = float(rng.randint(int(lo_sum), int(hi_sum)))
            high = low + rng.randint(0, 6)
        resources.append(ResourceConstraint(f"resource {t}", terms, low, high))

    p = Problem(decisions, edges, pins, links, resources, name=f"random{seed}")
    p.validate()
    return p


def feasible_choice(problem: Problem, choice: dict[str, int], groups: set[str] | None = None) -> bool:
    """Whether ``choice`` is feasible, counting only constraint groups in
    ``groups`` (all when ``None``)."""
    for d in problem.decisions:
        if d.costs[choice[d.name]] == INF:
            return False
    for e in problem.edges:
        if e.costs[choice[e.producer]][choice[e.consumer]] == INF:
            return False
    for pin in problem.pins:
        if (groups is None or pin.name in groups) and choice[pin.decision] not in pin.allowed:
            return False
    for link in problem.links:
        if (groups is None or link.name in groups) and link.mapping[choice[link.a]] != choice[link.b]:
            return False
    for r in problem.resources:
        if groups is not None and r.name not in groups:
            continue
        total = sum(w[choice[n]] for n, w in r.terms.items())
        if (r.low is not None and total < r.low - 1e-9) or (r.high is not None and total > r.high + 1e-9):
            return False
    return True


def brute_force(problem: Problem, groups: set[str] | None = None):
    """``(objective, choice)`` of an optimal choice, or ``None`` if infeasible."""
    names = [d.name for d in problem.decisions]
    best = None
    for combo in itertools.product(*(range(d.num_options) for d in problem.decisions)):
        choice = dict(zip(names, combo))
        if not feasible_choice(problem, choice, groups):
            continue
        obj = sum(d.costs[choice[d.name]] for d in problem.decisions) + sum(
            e.costs[choice[e.producer]][choice[e.consumer]] for e in problem.edges
        )
        if best is None or obj < best[0]:
            best = (obj, choice)
    return best


# ---------------------------------------------------------------------------
# Transformer-shaped problems (for scale): placements are tuples of per-mesh-
# dimension labels; redistribution costs add up per mesh dimension.

_LABELS = ("R", "S0", "S1", "P")
_COMM = {  # cost factor of turning label a into label b on one mesh dim
    ("R", "S0"): 0.0,
    ("R", "S1"): 0.0,
    ("S0", "R"): 1.0,
    ("S1", "R"): 1.0,
    ("S0", "S1"): 1.0,
    ("S1", "S0"): 1.0,
    ("P", "R"): 2.0,
    ("P", "S0"): 1.0,
    ("P", "S1"): 1.0,
    ("R", "P"): INF,
    ("S0", "P"): INF,
    ("S1", "P"): INF,
}


def _redistribute(a: tuple[str, ...], b: tuple[str, ...], size: float) -> float:
    total = 0.0
    for dim, (x, y) in enumerate(zip(a, b)):
        if x != y:
            total += _COMM[x, y] * size * (1.0 + 0.5 * dim)
    return total


def transformer_problem(
    *,
    layers: int = 32,
    per_layer: int = 300,
    mesh_dims: int = 2,
    seed: int = 0,
    merged: bool = False,
    budget: float | None = None,
) -> Problem:
    """A stack of identical layers, each a chain of ops with residual
    skips and q/k/v-like fan-outs. Op options are placements on a
    ``mesh_dims``-D mesh (4 to 16 of them). Layers are linked to layer 0;
    with ``merged=True`` one layer stands for all of them (costs scaled by
    ``layers``), as presolve would leave it.
    """
    rng = random.Random(seed)
    all_places = list(itertools.product(_LABELS, repeat=mesh_dims))
    ops = []  # per op: placements, unary costs, inputs (producer index, size)
    for k in range(per_layer):
        n_opt = rng.choice([4, 6, 8, 9, 12, 16])
        # Replicated everywhere is always an option, so problems are feasible.
        replicated = ("R",) * mesh_dims
        others = [p for p in all_places if p != replicated]
        places = [replicated] + rng.sample(others, min(n_opt, len(all_places)) - 1)
        flops = rng.uniform(1, 10)
        unary = [flops / (1 + sum(lbl != "R" for lbl in pl)) + rng.uniform(0, 0.01) for pl in places]
        inputs = []
        if k > 0:
            inputs.append((k - 1, rng.uniform(0.5, 4)))
        if k > 3 and rng.random() < 0.3:
            inputs.append((rng.randrange(max(0, k - 12), k - 1), rng.uniform(0.5, 4)))
        ops.append((places, unary, inputs))

    def layer(prefix: str, scale: float, decisions, edges):
        for k, (places, unary, inputs) in enumerate(ops):
            decisions.append(Decision(f"{prefix}op{k}", ["".join(p) for p in places], [u * scale for u in unary]))
            for arg, (src, size) in enumerate(inputs):
                src_places = ops[src][0]
                m = [[_redistribute(a, b, size) * scale for b in places] for a in src_places]
                edges.append(Edge(f"{prefix}op{src}", f"{prefix}op{k}", arg, m))

    decisions: list[Decision] = []
    edges: list[Edge] = []
    links: list[Link] = []
    resources = []
    if merged:
        layer("L0.", float(layers), decisions, edges)
        if layers > 1:  # the residual stream between layers, merged
            m = [[_redistribute(a, b, layers - 1.0) for b in ops[0][0]] for a in ops[-1][0]]
            edges.append(Edge(f"L0.op{per_layer - 1}", "L0.op0", 0, m))
    else:
        for li in range(layers):
            layer(f"L{li}.", 1.0, decisions, edges)
            if li > 0:
                for k, (places, _, _) in enumerate(ops):
                    links.append(Link("repeated layers", f"L0.op{k}", f"L{li}.op{k}", list(range(len(places)))))
            if li > 0:  # the residual stream flows from one layer into the next
                last = ops[-1][0]
                first = ops[0][0]
                m = [[_redistribute(a, b, 1.0) for b in first] for a in last]
                edges.append(Edge(f"L{li - 1}.op{per_layer - 1}", f"L{li}.op0", 0, m))
    if budget is not None:
        # Parameter memory: every 10th op holds a weight, sharded by S labels.
        terms = {}
        for k in range(0, per_layer, 10):
            places = ops[k][0]
            w = [4.0 / (1 + sum(lbl.startswith("S") for lbl in p)) for p in places]
            scale = layers if merged else 1
            terms[f"L0.op{k}"] = [v * scale for v in w]
            if not merged:
                for li in range(1, layers):
                    terms[f"L{li}.op{k}"] = list(w)
        resources.append(ResourceConstraint("parameter memory budget", terms, high=budget))
    p = Problem(decisions, edges, [], links, resources, name=f"transformer{layers}x{per_layer}")
    p.validate()
    return p
