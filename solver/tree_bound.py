"""Exact option elimination by spanning-tree min-marginals.

Edge costs are redistribution times, never negative, so dropping edges
from a problem can only lower what a choice costs: the problem over a
spanning forest of its classes is a relaxation. On a forest the cheapest
choice *with a given option* (its min-marginal) is exact and cheap: one
min-sum pass up every tree and one down, each a min-plus product over an
edge's whole matrix (``QuotientEdge.min_plus``; lazy matrices reduce
their distinct placements, not their option pairs). An option whose
min-marginal exceeds the cost of a known plan is in no better plan, of the
relaxation or of the problem: it can be dropped before any pair of it is
read. Resource rows are left out (a relaxation too).

Which edges make the tree decides how much is seen: :func:`edge_weights`
ranks an edge by what its sampled rows cost (forbidden pairs, the
structural edges that keep a gradient on its parameter's layout, count
as the dearest), and :func:`eliminate` intersects what several trees keep
(each later tree prefers edges the earlier ones left out).

>>> from solver.problem import Decision, Edge, Problem
>>> from solver.pricing_quotient import build_quotient
>>> p = Problem(
...     decisions=[Decision("a", ["R", "S"], [1.0, 0.5]), Decision("b", ["R", "S"], [1.0, 0.5])],
...     edges=[Edge("a", "b", 0, [[0.0, 1.0], [9.0, 0.0]])],
... )
>>> t = tree_marginals(build_quotient(p))
>>> t.bound, [m.tolist() for m in t.marginals]
(1.0, [[2.0, 1.0], [2.0, 1.0]])
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import networkx as nx
import numpy as np

from .pricing_quotient import Quotient

logger = logging.getLogger(__name__)

# Row options per edge sampled to weigh it (the cheapest by unary cost).
SAMPLE_ROWS = 8
# Elimination passes (forests recomputed over the options left) and the
# share of options a pass must drop for another to run.
MAX_PASSES = 4
PASS_MIN_SHARE = 0.01
# Relative slack on the elimination test: marginals and plan costs are
# sums taken in different orders.
ELIMINATION_RTOL = 1e-7


@dataclass
class TreeMarginals:
    """``marginals[q][o]``: the least cost of the forest relaxation with
    class ``q`` at option ``o`` (inf: not allowed or no finite partner);
    ``bound``: the relaxation's optimum, a lower bound on the problem's."""

    bound: float
    marginals: list[np.ndarray]
    tree_edges: list[int]
    choice: list[int]  # per class, an optimal choice of the relaxation (-1: none finite)


@dataclass
class Reparam:
    """LP duals that rewrite the problem without changing any choice's cost
    by more than ``constant`` allows: unary costs become reduced costs
    ``unary[q]`` and edge ``k``'s entries ``C(i, j) - alpha[k][i] -
    beta[k][j]`` (never negative for dual-feasible duals), and every
    feasible choice costs at least ``constant`` plus its rewritten cost
    (:meth:`solver.pricing_rounds.Pricer.reduced_costs`). A forest over the
    rewritten costs bounds at least as high as the LP bound."""

    constant: float
    unary: list[np.ndarray]
    alpha: list[np.ndarray]
    beta: list[np.ndarray]


def edge_weights(quotient: Quotient, reparam: Reparam | None = None) -> list[float]:
    """Per quotient edge, the mean finite cost over a few sampled rows (the
    row class's cheapest options by unary cost) against every column, with
    forbidden entries counted at the dearest finite cost seen anywhere."""
    means, inf_share = [], []
    top = 0.0
    for k, e in enumerate(quotient.edges):
        cls = quotient.classes[e.p]
        opts = np.flatnonzero(cls.allowed)
        rows = opts[np.argsort(cls.unary[opts], kind="stable")[:SAMPLE_ROWS]]
        block = e.rows(rows)
        if reparam is not None:
            with np.errstate(invalid="ignore"):  # inf - inf: a forbidden pair, left out below
                block = block - reparam.alpha[k][rows][:, None] - reparam.beta[k][None, :]
        block = block[:, quotient.classes[e.c].allowed]
        finite = np.isfinite(block)
        means.append(float(block[finite].mean()) if finite.any() else 0.0)
        inf_share.append(1.0 - float(finite.mean()) if block.size else 0.0)
        if finite.any():
            top = max(top, float(block[finite].max()))
    return [m + s * top for m, s in zip(means, inf_share)]


def tree_marginals(
    quotient: Quotient,
    weights: list[float] | None = None,
    reparam: Reparam | None = None,
    allowed: list[np.ndarray] | None = None,
) -> TreeMarginals | None:
    """Min-marginals of every option over a maximum-weight spanning forest
    of the classes (of the costs rewritten by ``reparam``, plus its
    constant); None when some forest edge's matrix cannot reduce whole rows
    (no ``min_plus``). ``allowed``: per class, the options still in play
    (default: the classes' own)."""
    classes = quotient.classes
    allowed = [c.allowed for c in classes] if allowed is None else allowed
    weights = edge_weights(quotient, reparam) if weights is None else weights
    graph = nx.Graph()
    graph.add_nodes_from(range(len(classes)))
    for k, e in enumerate(quotient.edges):
        graph.add_edge(e.p, e.c, weight=weights[k], edge=k)
    forest = nx.maximum_spanning_tree(graph, weight="weight")
    unary = [c.unary for c in classes] if reparam is None else reparam.unary
    h = [np.where(ok, u, math.inf) for ok, u in zip(allowed, unary)]
    up: dict[tuple[int, int], np.ndarray] = {}  # (child, parent) -> message over the parent's options
    order: list[tuple[int, int | None, int | None]] = []  # (class, parent, edge), parents first
    roots = []
    for comp in nx.connected_components(forest):
        root = min(comp)
        roots.append(root)
        order.append((root, None, None))
        order += [
            (child, parent, forest.edges[parent, child]["edge"])
            for parent, child in nx.bfs_edges(forest, root, sort_neighbors=sorted)
        ]
    for child, parent, k in reversed(order):  # leaves first
        if parent is None:
            continue
        msg = _pass(quotient, k, child, h[child], reparam)
        if msg is None:
            return None
        up[child, parent] = msg
        h[parent] = h[parent] + msg
    belief = {root: h[root] for root in roots}
    for child, parent, k in order:  # roots first
        if parent is None:
            continue
        own = up[child, parent]
        rest = np.where(np.isfinite(own), belief[parent] - np.where(np.isfinite(own), own, 0.0), math.inf)
        down = _pass(quotient, k, parent, rest, reparam)
        belief[child] = h[child] + down
    per_root = {root: float(belief[root].min()) for root in roots}
    comp_of = {q: min(comp) for comp in nx.connected_components(forest) for q in comp}
    bound = math.fsum(per_root.values()) + (0.0 if reparam is None else reparam.constant)
    marginals = [belief[q] + (bound - per_root[comp_of[q]]) for q in range(len(classes))]
    # an optimal choice of the forest: roots at their best, each child at its
    # best given its parent's choice (ties: lowest id)
    choice = [-1] * len(classes)
    for child, parent, k in order:
        if parent is None:
            costs = h[child]
        elif choice[parent] < 0:
            continue
        else:
            e = quotient.edges[k]
            one = np.array([choice[parent]])
            with np.errstate(invalid="ignore"):  # inf - inf: a forbidden pair (not finite below)
                if e.p == parent:
                    pair = e.rows(one)[0]
                    if reparam is not None:
                        pair = pair - reparam.alpha[k][choice[parent]] - reparam.beta[k]
                else:
                    pair = e.cols(one)[:, 0]
                    if reparam is not None:
                        pair = pair - reparam.alpha[k] - reparam.beta[k][choice[parent]]
            costs = np.where(np.isfinite(pair), h[child] + np.where(np.isfinite(pair), pair, 0.0), math.inf)
        best = int(np.argmin(costs))
        choice[child] = best if math.isfinite(costs[best]) else -1
    return TreeMarginals(bound, marginals, sorted(d["edge"] for _, _, d in forest.edges(data=True)), choice)


def choice_cost(quotient: Quotient, choice: list[int]) -> float:
    """The problem's cost of a class choice (every edge, not only a
    forest's); inf when some class has none, some pair is forbidden or some
    resource row is violated."""
    if min(choice, default=0) < 0:
        return math.inf
    for r in quotient.resources:
        used = math.fsum(float(w[choice[q]]) for q, w in r.weights.items())
        slack = 1e-9 * max(1.0, abs(used))
        if (r.high is not None and used > r.high + slack) or (r.low is not None and used < r.low - slack):
            return math.inf
    total = [float(c.unary[o]) for c, o in zip(quotient.classes, choice)]
    total += [float(e.rows(np.array([choice[e.p]]))[0, choice[e.c]]) for e in quotient.edges]
    return math.fsum(total)


def _pass(quotient: Quotient, k: int, sender: int, costs: np.ndarray, reparam: Reparam | None) -> np.ndarray | None:
    """Per option of edge ``k``'s other end, ``min_o C + costs[o]`` over the
    sender's options (``inf`` costs left out), of the rewritten ``C`` with
    ``reparam``: ``min_o C(o, x) - (shift_o - costs[o])``, less the
    receiver's shift."""
    e = quotient.edges[k]
    from_rows = e.p == sender
    if reparam is None:
        values = np.where(np.isfinite(costs), -costs, -math.inf)
        return e.min_plus(values, along_rows=not from_rows)
    send, receive = (reparam.alpha[k], reparam.beta[k]) if from_rows else (reparam.beta[k], reparam.alpha[k])
    ok = np.isfinite(costs) & np.isfinite(send)
    values = np.where(ok, np.where(ok, send, 0.0) - np.where(ok, costs, 0.0), -math.inf)
    msg = e.min_plus(values, along_rows=not from_rows)
    if msg is None:
        return None
    ok = np.isfinite(receive) & np.isfinite(msg)
    return np.where(ok, np.where(ok, msg, 0.0) - np.where(ok, receive, 0.0), math.inf)


@dataclass
class Elimination:
    """What :func:`eliminate` found: per class the options that may be in a
    plan costing at most ``upper`` (the given plan's cost, or a forest
    plan's when cheaper: ``plan``), and the best forest bound. Forests of
    later passes see only the options left, so ``bound`` holds for plans
    costing at most ``upper``: the optimum is at least ``min(upper,
    bound)`` (callers clip the bound by the plan they return)."""

    keep: list[np.ndarray]
    bound: float
    upper: float
    plan: list[int] | None  # a forest's choice costing ``upper`` (None: the caller's plan is best)
    # the cheapest forest choice priced, whatever ``upper`` (cost, choice): a
    # plan when ``upper`` is a guess under the known plan's cost
    cheapest: tuple[float, list[int]] | None = None


def eliminate(
    quotient: Quotient,
    upper: float,
    trees: int = 2,
    reparam: Reparam | None = None,
    max_passes: int = MAX_PASSES,
    deadline: float | None = None,
    enough: Callable[[list[np.ndarray]], bool] | None = None,
    allowed: list[np.ndarray] | None = None,
) -> Elimination | None:
    """Per class, the options whose min-marginal on every one of ``trees``
    spanning forests is at most the best known plan's cost: every choice
    costing at most that uses only those. Each forest's own optimal choice
    is priced on the whole problem and becomes the known plan when cheaper
    than ``upper``. Dropped options no longer partner anyone, which raises
    the others' marginals: passes repeat while one drops more than
    ``PASS_MIN_SHARE`` of the options left (at most ``max_passes``). None
    when the matrices cannot reduce whole rows. Past ``deadline``
    (``time.perf_counter``) no further pass starts. ``enough(keep)``: stop
    after the first forest whose survivors it accepts (few enough for the
    caller's exhaustive ILP: more forests would only shrink a problem that
    is already cheap to solve whole; on LLaMA-3 70B 4x4x8x8 the last of
    nine forests after the dual ascent, ~1 s each, left 476 options where
    the second had left 694). ``allowed``: per class, the options still in
    play (default: the classes' own)."""
    weights = edge_weights(quotient, reparam)
    given = allowed or [None] * len(quotient.classes)
    keep = [c.allowed.copy() if a is None else c.allowed & a for c, a in zip(quotient.classes, given)]
    total = sum(int(c.allowed.sum()) for c in quotient.classes)
    best, plan, cheapest = -math.inf, None, None
    for n_pass in range(max_passes):
        if not all(k.any() for k in keep):
            break  # some class has no option left: no plan costs at most ``upper``
        before = sum(int(k.sum()) for k in keep)
        for t in range(trees):
            tm = tree_marginals(quotient, weights, reparam, allowed=keep)
            if tm is None:
                return None
            best = max(best, tm.bound)
            cost = choice_cost(quotient, tm.choice)
            if math.isfinite(cost) and (cheapest is None or cost < cheapest[0]):
                cheapest = (cost, tm.choice)
            if cost < upper:
                upper, plan = cost, tm.choice
            slack = ELIMINATION_RTOL * max(1.0, abs(upper))
            for q, m in enumerate(tm.marginals):
                keep[q] &= m <= upper + slack
            if plan is not None:
                for q, o in enumerate(plan):
                    keep[q][o] = True  # its own options, whatever the rounding
            # the next forest prefers edges this one left out
            for k in tm.tree_edges:
                weights[k] *= 0.25
            logger.info(
                "pass %d, tree %d: bound %.9g, its plan %.9g, best plan %.9g, %d options left of %d",
                n_pass + 1,
                t + 1,
                tm.bound,
                cost,
                upper,
                sum(int(k.sum()) for k in keep),
                total,
            )
            if not all(k.any() for k in keep):
                break
            if enough is not None and enough(keep):
                return Elimination(keep, best, upper, plan, cheapest)
        left = sum(int(k.sum()) for k in keep)
        if before - left <= PASS_MIN_SHARE * before or (deadline is not None and time.perf_counter() > deadline):
            break
    return Elimination(keep, best, upper, plan, cheapest)
