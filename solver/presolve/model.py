"""Presolve's data: the result type, the working records, tolerances
and small numpy helpers shared by the phases."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from ..problem import PresolveStats, Problem


# Relative tolerance (to the matrix's largest entry) of the separability test.
SEPARABLE_RTOL = 1e-12
# How many times the dominance tests (options, then pairs) may run on one
# decision. Re-running them whenever a neighbour shrinks reaches a fixpoint,
# but on a 32-layer transformer that doubles presolve time to shrink the ILP
# by another 5%; once is the better deal.
DOMINANCE_ROUNDS = 1
# Dominance of a decision with n options and W partner options over its
# edges: a dense [k, i, j] array (also giving the pair cuts) while n * n * W
# is at most this, else a bound first and exact gains only where it may be
# <= 0 (no pair cuts). On the 8B 4x4x8 problem, 4M instead of 1M cost 0.4 s
# more presolve for 0.4% fewer pairs; 0.3M left 15% more pairs.
DENSE_DOMINANCE_MAX = 1_000_000
# Margin (relative to the costs involved) of that bound's filter.
SPARSE_GAIN_RTOL = 1e-9
# Tolerance of conditional (pair) dominance, relative to the largest costs
# involved: a pair is only dropped when another option is better by more.
PAIR_RTOL = 1e-9
# Relative slack when a resource bound rules an option out: only options that
# miss the bound clearly are dropped, leaving borderline ones to the ILP.
RESOURCE_RTOL = 1e-9
# Name of the stand-in decision (one option) carrying the constant cost when
# presolve decides everything; not counted in PresolveStats.decisions_after.
CONSTANT_DECISION = "__presolve_constant__"

_chain = itertools.chain.from_iterable


class PresolveInfeasible(ValueError):
    """Presolve proved the problem infeasible (the message says where and why)."""


@dataclass
class Presolved:
    """A reduced problem and the way back to the original decisions.

    ``problem`` is the reduced problem, ``stats`` what shrank. ``timings``
    maps presolve phases (``merge``, ``reduce``, ``emit``) to seconds.
    """

    problem: Problem
    stats: PresolveStats
    timings: dict[str, float] = field(default_factory=dict)
    # How to expand (filled by presolve(); empty means "nothing was reduced").
    _groups: list[_Group] | None = field(default=None, repr=False)
    _final: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict, repr=False)
    _steps: list[tuple] = field(default_factory=list, repr=False)
    _names: list[str] = field(default_factory=list, repr=False)  # original order

    def expand(self, reduced_choice: dict[str, int]) -> dict[str, int]:
        """Choice for every original decision (original option ids).

        ``reduced_choice`` maps every decision of :attr:`problem` to an option
        id of the reduced problem.
        """
        if self._groups is None:
            return {d.name: int(reduced_choice[d.name]) for d in self.problem.decisions}
        root: dict[int, int] = {}  # group -> chosen option in its root's ids
        for name, (g, alive) in self._final.items():
            if name not in reduced_choice:
                raise KeyError(f"reduced choice has no option for {name!r}")
            t = reduced_choice[name]
            if not isinstance(t, (int, np.integer)) or not 0 <= t < len(alive):
                raise ValueError(f"reduced choice {t!r} for {name!r} out of range 0..{len(alive) - 1}")
            root[g] = int(alive[t])
        for step in reversed(self._steps):
            kind, g = step[0], step[1]
            if kind == "fix":
                root[g] = step[2]
            elif kind == "elim1":
                _, _, a, table = step
                root[g] = table[root[a]]
            else:  # "elim2"
                _, _, a, b, pos_a, pos_b, table = step
                root[g] = int(table[pos_a[root[a]], pos_b[root[b]]])
        out: dict[str, int] = {}
        for g, grp in enumerate(self._groups):
            r = root[g]
            for name, omap in zip(grp.members, grp.omaps):
                out[name] = r if omap is None else int(omap[r])
        return {name: out[name] for name in self._names}


@dataclass
class _Group:
    """Decisions merged by links. Option ids are those of ``root`` (members[0])."""

    members: list[str]
    # Per member: root option -> member option (-1: no counterpart); None when
    # the member is the root itself.
    omaps: list[np.ndarray | None]


class _Edge:
    __slots__ = ("u", "v", "M", "arg", "flip", "clean", "has_inf")

    def __init__(self, u: int, v: int, M: np.ndarray, arg: int, flip: bool):
        self.u, self.v, self.M = u, v, M  # M[i][j]: option i of u, j of v
        self.arg, self.flip = arg, flip  # emitted as v -> u when flip
        self.clean = False  # checked (arc consistency, separability) since last change
        self.has_inf: bool | None = None  # None: unknown


class _Resource:
    __slots__ = ("name", "terms", "low", "high", "orig", "fixed")

    def __init__(self, name, terms, low, high):
        self.name = name
        self.terms: dict[int, np.ndarray] = terms  # group -> weight per alive option
        self.low: float | None = low  # shifted by the weights of fixed decisions
        self.high: float | None = high
        self.orig = (low, high)
        self.fixed = 0.0  # sum of the weights of fixed decisions


def _matrix(rows: list[list[float]], n: int, m: int) -> np.ndarray:
    # fromiter over the flattened rows is ~3x faster than np.array(rows).
    return np.fromiter(_chain(rows), float, n * m).reshape(n, m)


def _and(a: np.ndarray | None, b: np.ndarray) -> np.ndarray:
    return b if a is None else a & b


def _separable(M: np.ndarray) -> bool:
    """``M[i][j] == a[i] + b[j]`` for all i, j (up to rounding)?"""
    n, m = M.shape
    if n == 1 or m == 1:
        return True
    # Quick rejection on one 2x2 minor (most matrices are not separable).
    c00, c0m, cn0, cnm = M[0, 0], M[0, -1], M[-1, 0], M[-1, -1]
    corner = max(abs(c00), abs(c0m), abs(cn0), abs(cnm))
    if abs(cnm - cn0 - c0m + c00) > SEPARABLE_RTOL * corner:
        return False
    tol = SEPARABLE_RTOL * float(np.abs(M).max())
    return float(np.abs(M - M[:, :1] - M[:1, :] + c00).max()) <= tol


def _slack(bound: float) -> float:
    return RESOURCE_RTOL * max(1.0, abs(bound)) if math.isfinite(bound) else 0.0
