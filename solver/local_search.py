"""Local search: improve a feasible choice one decision at a time.

:func:`improve` runs iterated conditional modes: each decision in turn moves
to its cheapest option given its neighbours' current options (unary cost
plus the costs of its incident edges), provided pins and resource
constraints still hold, until a whole sweep moves nothing. The objective
never increases, so the result is at least as good as the start; it is a
local optimum, not a proven one.

The backend uses it to polish the rounded LP relaxation into a MIP start
(:mod:`solver.backends`): the 1-layer debug LLaMA's rounded LP is 0.03%
above its optimum, and the ILP search may stop at its time limit before
improving on its start. Deterministic: fixed sweep order, strict
improvements only.

Example::

    >>> from solver.problem import Decision, Edge, Problem
    >>> p = Problem(
    ...     decisions=[Decision("a", ["R", "S0"], [1.0, 0.5]),
    ...                Decision("b", ["R", "S0"], [1.0, 0.5])],
    ...     edges=[Edge("a", "b", 0, [[0.0, 3.0], [3.0, 0.0]])],
    ... )
    >>> improve(p, {"a": 0, "b": 0})
    {'a': 0, 'b': 0}
    >>> improve(p, {"a": 1, "b": 0})
    {'a': 0, 'b': 0}
"""

from __future__ import annotations

import numpy as np

from .problem import Problem

# A move must lower the objective by more than this (relative to the
# decision's current local cost) to be taken: no cycling on float noise.
RTOL = 1e-12
# Resource rows are checked with this slack (relative to the bound).
RESOURCE_RTOL = 1e-9


def improve(problem: Problem, choice: dict[str, int], *, max_sweeps: int = 100) -> dict[str, int]:
    """A choice at most as costly as ``choice`` and as feasible (see module doc).

    Linked decisions must move together, which single moves cannot do:
    problems with links are returned unchanged.
    """
    if problem.links or not problem.decisions:
        return dict(choice)
    names = [d.name for d in problem.decisions]
    index = {n: i for i, n in enumerate(names)}
    cur = np.array([choice[n] for n in names], dtype=np.int64)
    unary = [np.asarray(d.costs, dtype=np.float64) for d in problem.decisions]
    for pin in problem.pins:
        i = index[pin.decision]
        mask = np.full(len(unary[i]), np.inf)
        mask[list(pin.allowed)] = 0.0
        unary[i] = unary[i] + mask
    # incident[i]: (matrix oriented with decision i's options as rows, neighbour index)
    incident: list[list[tuple[np.ndarray, int]]] = [[] for _ in names]
    for e in problem.edges:
        m = np.asarray(e.costs, dtype=np.float64)
        p, c = index[e.producer], index[e.consumer]
        incident[p].append((m, c))
        incident[c].append((m.T, p))
    rows = []  # (weights per decision or None, low, high, current sum)
    for r in problem.resources:
        w = [None] * len(names)
        for name, weights in r.terms.items():
            w[index[name]] = np.asarray(weights, dtype=np.float64)
        total = sum(float(w[i][cur[i]]) for i in range(len(names)) if w[i] is not None)
        rows.append([w, r.low, r.high, total])

    for _ in range(max_sweeps):
        moved = False
        for i in range(len(names)):
            local = unary[i].copy()
            for m, j in incident[i]:
                local += m[:, cur[j]]
            for w, low, high, total in rows:
                if w[i] is None:
                    continue
                after = total - w[i][cur[i]] + w[i]
                if high is not None:
                    local[after > high + RESOURCE_RTOL * max(abs(high), 1.0)] = np.inf
                if low is not None:
                    local[after < low - RESOURCE_RTOL * max(abs(low), 1.0)] = np.inf
            best = int(np.argmin(local))
            now = local[cur[i]]
            threshold = now - RTOL * abs(now) if np.isfinite(now) else np.inf
            if not (np.isfinite(local[best]) and local[best] < threshold):
                continue
            for row in rows:
                w = row[0][i]
                if w is not None:
                    row[3] += w[best] - w[cur[i]]
            cur[i] = best
            moved = True
        if not moved:
            break
    return {n: int(cur[k]) for k, n in enumerate(names)}
