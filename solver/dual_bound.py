"""Lower bounds by block-coordinate ascent on the local-polytope dual.

Why: the restricted LP of :mod:`solver.pricing` sees a few thousand of a
4-D mesh's ~143K options per layer, and a spanning forest
(:mod:`solver.tree_bound`) sees only a forest's edges; neither reaches the
optimum of the LP relaxation over every option (the local polytope), so
plans stopped at a gap. This ascent works on every option and every edge
at once, one whole-matrix min-plus reduction per edge end
(``QuotientEdge.min_plus``), like the forests.

The dual: per edge ``E = (p, c)`` and end ``i`` a vector ``lam[E, i]``
over ``i``'s options. Any choice ``x`` costs exactly ::

    sum_i B_i(x_i) + sum_E (C_E(x_p, x_c) - lam[E, p](x_p) - lam[E, c](x_c))

with beliefs ``B_i = c_i + sum_{E at i} lam[E, i]``, so ``D = sum_i min
B_i + sum_E m_E`` (``m_E`` a lower bound on the edge's rewritten entries)
bounds every choice from below. A *star update* at class ``i`` maximises
``D`` over the messages at ``i``'s end of its ``d`` edges, the rest fixed:
with ``g_E(x) = min_y C_E(x, y) - lam[E, j](y)`` (over the other end's
options) and ``b = c_i + sum_E g_E``, it sets ``lam[E, i] = g_E -
b / (d + 1)``, which leaves ``B_i = b / (d + 1)`` and every edge's
rewritten entries at least ``min b / (d + 1)``: the node and its edges
together hold ``min b``, the most they can (MPLP's star update, Sontag,
Globerson, Jaakkola 2011). Sweeps visit the classes in order and back.
``D`` never decreases; its fixed points are not always the LP's optimum
(block-coordinate ascent on a non-smooth dual), but it converges where the
LP's duals are unique, and is a valid bound in every sweep.

Options die (leave every later reduction) when no finite plan can use them
(some edge gives them no finite partner among the live options) and, given
the cost ``upper`` of a known plan, when ``B_i(o) - min B_i > upper - D``:
every choice with ``o`` costs more than ``upper``. ``D`` then bounds the
plans costing at most ``upper`` (the optimum is at least ``min(upper,
D)``), and the survivors hold every such plan. Resource rows are left out
(a relaxation).

Messages computed from a *lower bound* of ``g_E`` keep every rewritten edge
entry at least ``m_E`` too, so the first sweeps (LOWER_SWEEPS, while the
bound is far below the plan) reduce in float32 where the matrices offer it
(``min_plus_classes(..., lower=True)``), about twice as fast; the next
exact sweep's bound is what exact sweeps would have reached.

:meth:`DualAscent.reparam` hands the result to the forests
(:class:`solver.tree_bound.Reparam`): each ``m_E`` goes into the constant,
so rewritten edge entries are never negative.

>>> from solver.problem import Decision, Edge, Problem
>>> from solver.pricing_quotient import build_quotient
>>> p = Problem(
...     decisions=[Decision("a", ["R", "S"], [1.0, 0.5]), Decision("b", ["R", "S"], [1.0, 0.5]),
...                Decision("c", ["R", "S"], [0.0, 0.0])],
...     edges=[Edge("a", "b", 0, [[0.0, 1.0], [1.0, 0.0]]), Edge("b", "c", 1, [[0.0, 1.0], [1.0, 0.0]]),
...            Edge("a", "c", 2, [[1.0, 0.0], [0.0, 1.0]])],
... )
>>> d = DualAscent(build_quotient(p))
>>> round(d.run(sweeps=50), 6)  # the LP optimum (the integral optimum is 2.0)
1.5
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from .pricing_quotient import Quotient, Term
from .tree_bound import Reparam

logger = logging.getLogger(__name__)

# Relative slack on the elimination test (sums taken in different orders).
ELIMINATION_RTOL = 1e-7
# Sweeps (the first ones, while the bound is more than LOWER_GAP, relative,
# below the plan) whose star updates use lower bounds of the min-plus
# reductions where the matrices offer them (float32: about half the time):
# a message from a lower bound of ``g_E`` keeps every rewritten edge entry
# at least ``m_E`` (see update), so the bound stays valid, a little less
# tight; later sweeps are exact.
LOWER_SWEEPS = 30
LOWER_GAP = 1e-3
# A sweep that raises the bound by less than this share of the remaining
# gap (or of the bound, without a plan) counts as stalled.
STALL_RTOL = 1e-4


@dataclass
class AscentStats:
    sweeps: int = 0
    bounds: list[float] = field(default_factory=list)  # after each sweep
    live: list[int] = field(default_factory=list)  # options alive after each sweep
    seconds: float = 0.0


def resource_filter(quotient: Quotient, allowed: list[np.ndarray]) -> int:
    """Narrow ``allowed`` in place to the options some choice meeting every
    resource row can take: ``o`` of class ``i`` leaves when its weight plus
    the lightest of every other class in the row exceeds the row's upper
    bound (heaviest, below the lower bound). Repeats until nothing leaves;
    returns how many left. A budget at the lightest total (a memory budget
    that only the fully sharded parameters meet) pins its classes this way,
    where the ascent, which leaves resource rows out, would not see it."""
    dropped = 0
    changed = True
    while changed:
        changed = False
        for r in quotient.resources:
            for sign, bound in ((1.0, r.high), (-1.0, r.low)):
                if bound is None or not r.weights:
                    continue
                lightest = {
                    i: float((sign * w)[allowed[i]].min()) if allowed[i].any() else math.inf
                    for i, w in r.weights.items()
                }
                total = math.fsum(lightest.values())
                if not math.isfinite(total):
                    continue
                # the same slack as a choice's check (solver.tree_bound.choice_cost), doubled
                room = sign * bound - total + 2e-9 * max(1.0, abs(bound), abs(total))
                for i, w in r.weights.items():
                    over = allowed[i] & (sign * w - lightest[i] > room)
                    n = int(over.sum())
                    if n:
                        allowed[i] &= ~over
                        dropped += n
                        changed = True
    return dropped


@dataclass
class Factor:
    """One term of a quotient edge (one matrix object): the ascent keeps
    messages per term, so each reduction is exact (a quotient edge of
    several terms only bounds its min-plus from below, which would let a
    star update lower the bound)."""

    p: int
    c: int
    edge: int  # quotient edge index
    term: Term

    def min_plus(self, values: np.ndarray, along_rows: bool, lower: bool = False) -> np.ndarray | None:
        return self.term.min_plus(values, along_rows, lower)


class DualAscent:
    """The messages and beliefs of one quotient; see the module docstring.

    ``allowed``: per class, the options in play (default: the classes'
    own); options outside it never enter a reduction."""

    def __init__(self, quotient: Quotient, allowed: list[np.ndarray] | None = None):
        self.q = quotient
        classes = quotient.classes
        self.live = [
            (c.allowed if allowed is None else a & c.allowed).copy()
            for c, a in zip(classes, allowed or [None] * len(classes))
        ]
        resource_filter(quotient, self.live)
        self.factors = [Factor(e.p, e.c, k, t) for k, e in enumerate(quotient.edges) for t in e.terms]
        self.lam_p = [np.zeros(classes[f.p].num_options) for f in self.factors]
        self.lam_c = [np.zeros(classes[f.c].num_options) for f in self.factors]
        # m_F: a lower bound on the factor's rewritten entries (its floor while lam = 0)
        self.edge_min = np.array([t.count * t.cache.floor for t in (f.term for f in self.factors)])
        self.belief = [np.where(l, c.unary, math.inf) for c, l in zip(classes, self.live)]
        self.incident: list[list[int]] = [[] for _ in classes]
        for k, f in enumerate(self.factors):
            self.incident[f.p].append(k)
            self.incident[f.c].append(k)
        self.stats = AscentStats()
        self.stalled = False  # the last run stopped for want of progress
        self.lower = False  # star updates from lower bounds of the reductions (LOWER_SWEEPS)

    # -- the bound -----------------------------------------------------------
    def bound(self) -> float:
        """``D``: every choice over the live options costs at least this."""
        mins = [float(b.min()) if b.size else math.inf for b in self.belief]
        return math.fsum(mins) + math.fsum(self.edge_min.tolist())

    def num_live(self) -> int:
        return int(sum(int(l.sum()) for l in self.live))

    # -- one star update -----------------------------------------------------
    def update(self, i: int, later: np.ndarray | None = None) -> None:
        """Maximise the bound over the messages at class ``i``'s end of its
        edges. ``later``: per incident edge, whether its other end comes
        later in the sweep; the belief ``b`` is then shared out only to
        those edges, ``1 / max(#earlier, #later)`` each (SRMP's weights:
        the next classes pick it up), the class keeping the rest; without
        it, evenly over the class and all its edges."""
        edges = self.factors
        live = self.live[i]
        inc = self.incident[i]
        b = np.where(live, self.q.classes[i].unary, math.inf)
        gs = []
        for k in inc:
            e = edges[k]
            at_rows = e.p == i
            j, other = (e.c, self.lam_c[k]) if at_rows else (e.p, self.lam_p[k])
            values = np.where(self.live[j], other, -math.inf)
            g = e.min_plus(values, along_rows=at_rows, lower=self.lower)
            if g is None:
                names = self.q.edges[e.edge].names[:1]
                raise ValueError(f"edge {names} cannot reduce whole rows: no dual ascent")
            gs.append(g)
            b = b + g
        live &= np.isfinite(b)  # no finite partner on some edge: in no plan
        if later is None:
            weights = np.full(len(inc), 1.0 / (len(inc) + 1))
        else:
            n_later = int(later.sum())
            weights = np.where(later, 1.0 / max(n_later, len(inc) - n_later, 1), 0.0)
        b_live = np.where(live, b, 0.0)
        low = float(b[live].min()) if live.any() else math.inf
        for k, g, w in zip(inc, gs, weights.tolist()):
            lam = np.where(live, g - w * b_live, 0.0)
            if edges[k].p == i:
                self.lam_p[k] = lam
            else:
                self.lam_c[k] = lam
            self.edge_min[k] = w * low if w else 0.0  # min over x of w * b(x)
        self.belief[i] = np.where(live, (1.0 - float(weights.sum())) * b_live, math.inf)

    def prune(self, upper: float, keep: list[int] | None = None) -> int:
        """Kill options every choice with which costs more than ``upper``
        (``keep``: a plan whose options stay, whatever the rounding).
        Returns how many died."""
        d = self.bound()
        if not math.isfinite(d):
            return 0
        slack = upper - d + ELIMINATION_RTOL * max(1.0, abs(upper))
        died = 0
        for i, (b, live) in enumerate(zip(self.belief, self.live)):
            if not live.any():
                continue
            over = live & (b - b[live].min() > slack)
            if keep is not None:
                over[keep[i]] = False
            died += self._kill(i, over)
        return died

    def restrict(self, allowed: list[np.ndarray]) -> int:
        """Kill the options outside ``allowed`` (found in no plan of
        interest by other means: forests). Returns how many died."""
        return sum(self._kill(i, live & ~a) for i, (live, a) in enumerate(zip(self.live, allowed)))

    def _kill(self, i: int, over: np.ndarray) -> int:
        n = int(over.sum())
        if n:
            live = self.live[i]
            live &= ~over
            self.belief[i] = np.where(live, self.belief[i], math.inf)
            for k in self.incident[i]:
                if self.factors[k].p == i:
                    self.lam_p[k] = np.where(live, self.lam_p[k], 0.0)
                else:
                    self.lam_c[k] = np.where(live, self.lam_c[k], 0.0)
        return n

    def sweep(self, order: list[int], weighted: bool = True) -> None:
        rank = np.empty(len(order), dtype=np.int64)
        rank[np.asarray(order)] = np.arange(len(order))
        for i in order:
            if weighted:
                others = [self.factors[k].c if self.factors[k].p == i else self.factors[k].p for k in self.incident[i]]
                self.update(i, rank[np.asarray(others, dtype=np.int64)] > rank[i] if others else None)
            else:
                self.update(i)

    def run(
        self, sweeps: int, upper: float | None = None, keep: list[int] | None = None, deadline: float | None = None
    ) -> float:
        """Up to ``sweeps`` sweeps (forward, then backward, alternately),
        pruning against ``upper`` after each; stops early when the bound
        reaches ``upper``, stalls, or at ``deadline`` (perf_counter: no
        sweep starts past it).
        Returns the bound."""
        t0 = time.perf_counter()
        self.stalled = False
        n = len(self.q.classes)
        forward = list(range(n))
        last = self.bound()
        for s in range(sweeps):
            if deadline is not None and time.perf_counter() > deadline:
                logger.info("dual ascent: past its deadline after %d sweeps", self.stats.sweeps)
                break
            # lower bounds while the bound is far below the plan: a sweep
            # from them costs about half, and the next exact sweep's bound
            # is the same as after exact ones (LLaMA-3 70B 4x4x8x8: equal
            # to 8 digits after 30 of them); exact near the plan, where the
            # bound may meet it
            self.lower = self.stats.sweeps < LOWER_SWEEPS and (
                upper is None or upper - last > LOWER_GAP * max(1.0, abs(upper))
            )
            self.sweep(forward if self.stats.sweeps % 2 == 0 else forward[::-1])
            if upper is not None:
                self.prune(upper, keep)
            d = self.bound()
            self.stats.sweeps += 1
            self.stats.bounds.append(d)
            self.stats.live.append(self.num_live())
            logger.info(
                "dual ascent sweep %d: bound %.9g, %d options live, %.1fs",
                self.stats.sweeps,
                d,
                self.stats.live[-1],
                time.perf_counter() - t0,
            )
            if upper is not None and d >= upper - ELIMINATION_RTOL * max(1.0, abs(upper)):
                break
            scale = (upper - d) if upper is not None and math.isfinite(d) else abs(d)
            if s and not self.lower and d - last <= STALL_RTOL * max(scale, 1e-300):
                logger.info(
                    "dual ascent: stalled after %d sweeps (bound up %.3g, gap %.3g)", self.stats.sweeps, d - last, scale
                )
                self.stalled = True
                break
            last = d
        self.stats.seconds += time.perf_counter() - t0
        return self.bound()

    def decode(self) -> list[int]:
        """A choice from the messages (TRW-S's rounding): classes in the
        order opposite to the last sweep's, each taking its live option of
        least unary cost plus the exact pair costs to the classes already
        chosen plus the messages from those still to choose (which the last
        sweep left as their exact min-plus reductions). -1 where a class has
        no finite option left."""
        n = len(self.q.classes)
        order = list(range(n)) if self.stats.sweeps % 2 == 0 else list(range(n - 1, -1, -1))
        choice = [-1] * n
        for i in order:
            cost = np.where(self.live[i], self.q.classes[i].unary, math.inf)
            for k in self.incident[i]:
                f = self.factors[k]
                at_rows = f.p == i
                j = f.c if at_rows else f.p
                if choice[j] >= 0:
                    one = np.array([choice[j]])
                    t = f.term
                    pair = t.cols(one)[:, 0] if at_rows else t.rows(one)[0]
                    cost = cost + t.count * pair
                elif choice[j] == -1:
                    cost = cost + (self.lam_p[k] if at_rows else self.lam_c[k])
            if self.q.classes[i].num_options and np.isfinite(cost).any():
                choice[i] = int(np.argmin(cost))
            else:
                choice[i] = -2  # none finite: the classes after it take messages
        return [c if c >= 0 else -1 for c in choice]

    def reparam(self) -> Reparam:
        """The messages as a rewriting of the costs for the forests: unary
        costs the beliefs, edge ``E``'s entries ``C - alpha - beta`` with
        ``alpha = lam[E, p] + m_E`` (never negative), constant ``sum m_E``."""
        classes = self.q.classes
        alpha = [np.zeros(classes[e.p].num_options) for e in self.q.edges]
        beta = [np.zeros(classes[e.c].num_options) for e in self.q.edges]
        for f, lp, lc, m in zip(self.factors, self.lam_p, self.lam_c, self.edge_min.tolist()):
            alpha[f.edge] += lp + m
            beta[f.edge] += lc
        return Reparam(math.fsum(self.edge_min.tolist()), [b.copy() for b in self.belief], alpha, beta)
