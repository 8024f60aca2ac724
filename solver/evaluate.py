"""Cost and feasibility of a full assignment, straight from the problem model.

This is the authoritative objective: the ILP's own objective value is only
used to steer the search, and :func:`solver.solve` re-evaluates the choice it
returns with :func:`evaluate`.

Example::

    >>> from solver.problem import Decision, Edge, Problem
    >>> p = Problem(
    ...     decisions=[Decision("a", ["R", "S0"], [1.0, 0.5]),
    ...                Decision("b", ["R", "S0"], [1.0, 0.5])],
    ...     edges=[Edge("a", "b", 0, [[0.0, 0.0], [2.0, 0.0]])],
    ... )
    >>> evaluate(p, {"a": 1, "b": 0})
    (1.5, 2.0)
    >>> violations(p, {"a": 1, "b": 0})
    []
"""

from __future__ import annotations

import math

from .problem import Problem

# Slack allowed on resource bounds: weights are floats summed in any order.
RESOURCE_TOL = 1e-9


def evaluate(problem: Problem, choice: dict[str, int]) -> tuple[float, float]:
    """Return ``(unary_cost, edge_cost)`` of a full assignment.

    A forbidden option or option pair makes the corresponding sum ``inf``.
    Constraints (pins, links, resources) are not checked here; see
    :func:`violations`.
    """
    unary = 0.0
    for d in problem.decisions:
        unary += d.costs[choice[d.name]]
    edge = 0.0
    for e in problem.edges:
        edge += e.costs[choice[e.producer]][choice[e.consumer]]
    return unary, edge


def violations(problem: Problem, choice: dict[str, int], *, costs_finite: bool = False) -> list[str]:
    """Describe everything ``choice`` violates; empty when it is feasible.

    Constraint violations are reported by the constraint's user-facing name
    (once per group), forbidden options and pairs by decision/edge.
    ``costs_finite=True`` (the caller found the total cost of ``choice``
    finite) skips looking for forbidden pairs, which cannot exist then.
    """
    out: list[str] = []
    index = problem.decision_index()
    for d in problem.decisions:
        if d.name not in choice:
            out.append(f"decision {d.name!r}: no option chosen")
            continue
        o = choice[d.name]
        if not isinstance(o, int) or not 0 <= o < d.num_options:
            out.append(f"decision {d.name!r}: option {o!r} out of range")
        elif math.isinf(d.costs[o]):
            out.append(f"decision {d.name!r}: option {o} is forbidden (inf cost)")
    unknown = sorted(set(choice) - set(index))
    out.extend(f"unknown decision {n!r} in choice" for n in unknown)
    if out:
        return out

    for e in () if costs_finite else problem.edges:
        i, j = choice[e.producer], choice[e.consumer]
        if math.isinf(e.costs[i][j]):
            out.append(f"edge {e.producer!r} -> {e.consumer!r}: pair ({i}, {j}) is forbidden")

    seen: set[str] = set()

    def report(name: str) -> None:
        if name not in seen:
            seen.add(name)
            out.append(name)

    for pin in problem.pins:
        if choice[pin.decision] not in pin.allowed:
            report(pin.name)
    for link in problem.links:
        if link.mapping[choice[link.a]] != choice[link.b]:
            report(link.name)
    for r in problem.resources:
        total = sum(w[choice[n]] for n, w in r.terms.items())
        tol = RESOURCE_TOL * max(1.0, abs(total))
        if (r.low is not None and total < r.low - tol) or (r.high is not None and total > r.high + tol):
            report(r.name)
    return out
