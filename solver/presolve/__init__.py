"""Presolve: shrink a :class:`~solver.problem.Problem` without changing its optimum.

:func:`presolve` returns a :class:`Presolved`: a smaller problem whose optimal
choice, passed through :meth:`Presolved.expand`, is an optimal choice of the
original problem with the same objective (up to float rounding). Every step
is exact:

1. **Links merge decisions.** Decisions connected by links become one
   decision whose options are the tuples of corresponding options that are
   consistent around every link (options without a counterpart are dropped).
   Unary costs, resource weights and pins of the members are combined; edges
   between two merged groups are re-indexed and summed into one edge, so 32
   linked transformer layers cost one layer's worth of variables; an edge
   inside one group only ever pays its diagonal and becomes a unary cost.
2. **Forbidden options are dropped**: infinite unary cost, pinned out, no
   finite pair left on some edge (arc consistency), or unable to meet a
   resource bound whatever the others choose; to a fixpoint.
3. **Dominated options and pairs are dropped.** Switching a decision from
   option ``i`` to ``k`` changes the cost by at most
   ``u[k] - u[i] + sum over its edges of max_j (M[k][j] - M[i][j])``. When
   that bound is ``<= 0`` and the switch cannot break a resource bound,
   ``i`` goes (among equivalent options the lowest id stays). When the bound
   with one edge's ``max_j`` replaced by the entry of the neighbour's option
   ``j`` is ``< 0``, no optimum pairs ``i`` with ``j``: that pair becomes
   ``inf`` (the ILP creates no variable for it).
4. **Small pieces are folded away**: separable edge matrices
   (``c[i][j] == r[i] + s[j]``, zero matrices included) become unary costs;
   a decision with one option left is fixed and its edges folded into its
   neighbours' unary costs (its resource weights into the bounds); a decision
   outside resource constraints with at most two neighbours is eliminated
   (``min`` over its options folded into a neighbour's unary costs or into an
   edge between its two neighbours, when that does not grow the number of
   option pairs), its best option per neighbour choice recorded for
   :meth:`Presolved.expand`.

Constant costs (fixed decisions) are added to the unary costs of the first
remaining decision, so the reduced objective equals the original objective.
The reduced problem has no pins and no links.

Example::

    >>> from solver.problem import Decision, Edge, Link, Problem
    >>> p = Problem(
    ...     decisions=[Decision("l0", ["R", "S0"], [1.0, 0.5]),
    ...                Decision("l1", ["R", "S0"], [1.0, 0.5]),
    ...                Decision("x", ["R", "S0"], [0.0, 0.0])],
    ...     edges=[Edge("l0", "x", 0, [[0.0, 3.0], [3.0, 0.0]]),
    ...            Edge("l1", "x", 1, [[0.0, 3.0], [3.0, 0.0]])],
    ...     links=[Link("layers", "l0", "l1", [0, 1])],
    ... )
    >>> pre = presolve(p)
    >>> pre.stats.merged_by_links, pre.stats.decisions_after  # all decided
    (1, 0)
    >>> pre.expand({d.name: 0 for d in pre.problem.decisions})
    {'l0': 1, 'l1': 1, 'x': 1}
    >>> pre.problem.decisions[0].costs  # a stand-in carrying the constant optimum
    [1.0]
"""

from __future__ import annotations

import gc
import logging
import time

from ..problem import Problem, ProblemError
from .model import CONSTANT_DECISION, PresolveInfeasible, Presolved
from .reducer import Reducer

logger = logging.getLogger(__name__)

__all__ = ["CONSTANT_DECISION", "PresolveInfeasible", "Presolved", "presolve"]


def presolve(problem: Problem, *, check_costs: bool = False) -> Presolved:
    """Shrink ``problem`` exactly; see the module docstring for the steps.

    ``problem`` must be valid (:meth:`~solver.problem.Problem.validate`), but
    with ``check_costs=True`` its edge cost matrices need not have been
    checked yet: merging checks them, reading each once where ``validate``
    would read them all first. A matrix equal (``==``) to one already checked,
    e.g. a repeated layer's copy, is not checked again: its entries compare
    equal to valid costs, though their types are not checked (a numpy integer
    equal to a float cost passes, where ``validate`` rejects it). A malformed
    one raises ``validate``'s :class:`~solver.problem.ProblemError`.

    Raises :class:`PresolveInfeasible` when presolve proves that no choice
    satisfies the constraints (a decision loses all its options, or a
    resource bound cannot be met).
    """
    t0 = time.perf_counter()
    # Presolve creates no reference cycles; a full collection over a big
    # problem's millions of cost rows would cost more than presolve itself.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    r = None
    try:
        r = Reducer(problem, check_costs)
        r.merge()  # checks every edge matrix first when check_costs
        t1 = time.perf_counter()
        r.reduce()
        t2 = time.perf_counter()
        out = r.emit()
        t3 = time.perf_counter()
    except ProblemError:
        raise
    except Exception:
        # Raised before every matrix was checked (e.g. PresolveInfeasible, or
        # a malformed matrix tripping numpy): a malformed problem says so.
        if check_costs and (r is None or r.check_costs):
            problem.validate()
        raise
    finally:
        if gc_was_enabled:
            gc.enable()
    out.timings = {"merge": t1 - t0, "reduce": t2 - t1, "emit": t3 - t2}
    s = out.stats
    logger.info(
        "presolve %r: decisions %d -> %d, options %d -> %d, edges %d -> %d, "
        "pairs %d -> %d (%d merged by links, %d fixed, %d eliminated, "
        "%d options forbidden, %d dominated) in %.3fs",
        problem.name,
        s.decisions_before,
        s.decisions_after,
        s.options_before,
        s.options_after,
        s.edges_before,
        s.edges_after,
        s.pairs_before,
        s.pairs_after,
        s.merged_by_links,
        s.decisions_fixed,
        s.decisions_eliminated,
        s.options_removed_forbidden,
        s.options_removed_dominated,
        t3 - t0,
    )
    logger.debug("presolve timings: %s", out.timings)
    return out
