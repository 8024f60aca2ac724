"""Where a solve stops: counted work, never the clock.

Every rank of a job plans on its own, so the same problem must give the same
plan whatever the machine's load. The solver's normal stopping points are
therefore counts: LP pricing rounds, dual-ascent sweeps, restricted ILPs of
the target bisection, decision branch-and-bound nodes
(:data:`solver.highs_bb.NODE_BUDGET`) and HiGHS MIP nodes (``node_limit``).
HiGHS itself is deterministic for a given model and options (fixed random
seed; its parallel MIP tasks are deterministic), and ties between equally
good choices are broken by the model's fixed column order.

A ``time_limit`` stays, as a safety cap: when the wall clock reaches it the
solve stops at the next check and its solution says so
(``Solution.stopped_by == "time limit"``); such a plan may depend on the
machine's load, which the ranks' agreement check
(:mod:`autoparallel.checks.agreement`) then catches. A plan stopped by a count says
``"work limit"``: it is the same on every run.

Example::

    >>> stopped_by(optimal=False, elapsed=3.0, time_limit=10.0)
    'work limit'
    >>> stopped_by(optimal=False, elapsed=10.2, time_limit=10.0)
    'time limit'
    >>> stopped_by(optimal=True, elapsed=99.0, time_limit=10.0) is None
    True
"""

from __future__ import annotations

import time

# LP rounds of option pricing (solver.pricing) before it goes on with the
# plan and bound it has: rounds add options until no left-out option is
# cheaper, which on the zoo takes a few to a few dozen rounds.
MAX_PRICING_ROUNDS = 100
# Dual-ascent sweeps (solver.dual_bound) over one pricing solve, counting
# both runs (before the LP rounds and against the restricted ILP's plan):
# LLaMA-3 70B on 4x4x8x8 meets its optimum in 43; an ascent that stalls
# stops earlier by itself.
MAX_ASCENT_SWEEPS = 200
# HiGHS MIP nodes after the decision branch and bound gave up (the ILP's
# ``node_limit`` when the caller sets none: AutoParallel does): the MIP
# then reports its incumbent and proven gap, status "feasible".
DEFAULT_NODE_LIMIT = 2000

# Infeasibility diagnosis (solver.diagnose): MIP nodes of one feasibility
# check after presolve and the LP relaxation (most checks end there), and
# checks in all (its deletion filter needs about k log n for k conflicting
# groups among n, plus n when every group is needed). A check out of nodes
# counts as "unknown": the group it tested stays in the conflict, unproven.
DIAGNOSIS_NODE_LIMIT = 500
DIAGNOSIS_MAX_CHECKS = 200
# Columns of one check's model (after presolve) beyond which it is not
# solved (unknown): its LP relaxation, which no node limit bounds, took 28 s
# at 30k columns on LLaMA-3 8B without presolve, and minutes at 425k.
DIAGNOSIS_MAX_COLUMNS = 100_000

STOPPED_BY_TIME = "time limit"
STOPPED_BY_WORK = "work limit"


def stopped_by(*, optimal: bool, elapsed: float, time_limit: float | None) -> str | None:
    """Why a solve stopped short of a proof: ``None`` when proven optimal;
    ``"time limit"`` when the safety cap was reached (every wall-clock check
    is against it, so a solve that stopped before it stopped on a count);
    else ``"work limit"`` (or a ``rel_gap`` the caller allowed)."""
    if optimal:
        return None
    if time_limit is not None and elapsed >= time_limit:
        return STOPPED_BY_TIME
    return STOPPED_BY_WORK


class SafetyCap:
    """The wall-clock cap of one solve: seconds left (``None``: no cap)
    and whether it was reached. Counted limits make the normal stops;
    this only ends a solve that would otherwise run on."""

    def __init__(self, time_limit: float | None, start: float | None = None):
        self.start = time.perf_counter() if start is None else start
        self.deadline = None if time_limit is None else self.start + time_limit

    def left(self, at_least: float = 1e-3) -> float | None:
        """Seconds to the cap (at least ``at_least``: a last solve's
        answer beats none), ``None`` without a cap."""
        return None if self.deadline is None else max(self.deadline - time.perf_counter(), at_least)

    def reached(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline
