"""How one edge's cost matrix becomes rows of the ILP (:mod:`solver.ilp`):
a separable matrix folds into the two ends' unary costs
(:func:`separable`), an edge with forbidden pairs requires each option's
allowed partners (:func:`add_support_rows`), and any other matrix gets one
pair column per finite entry with its marginals, built per class of equal
rows and columns (:func:`add_pairwise`).
"""

from __future__ import annotations

import numpy as np

from .ilp_assembler import Assembler

SEPARABLE_RTOL = 1e-12


def separable(m: np.ndarray) -> tuple[list[float], list[float]] | None:
    """``(r, s)`` with ``m[i][j] == r[i] + s[j]`` if the (finite) matrix is
    separable."""
    r = m[:, 0]
    s = m[0, :] - m[0, 0]
    tol = SEPARABLE_RTOL * float(np.abs(m).max())
    if float(np.abs(m - r[:, None] - s[None, :]).max()) > tol:
        return None
    return r.tolist(), s.tolist()


def option_classes(vectors) -> list[list[int]]:
    """Indices grouped by equal vector, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for t, vec in enumerate(vectors):
        groups.setdefault(tuple(vec), []).append(t)
    return list(groups.values())


def add_support_rows(asm: Assembler, pkey, ckey, finite: np.ndarray) -> int:
    """Feasibility only: choosing an option of one end requires choosing one
    of its finite partners at the other, ``sum x[class] <= sum x[partners]``
    per class of options with the same partners (exact for binary x).
    Returns the number of rows added."""
    added = 0
    for mine, theirs, fin in ((pkey, ckey, finite), (ckey, pkey, finite.T)):
        listed = fin.tolist()
        for members in option_classes(listed):
            support = listed[members[0]]
            if all(support):
                continue
            cols = [mine[i] for i in members] + [theirs[j] for j, ok in enumerate(support) if ok]
            vals = [1.0] * len(members) + [-1.0] * (len(cols) - len(members))
            asm.row(cols, vals, None, 0.0)
            added += 1
    return added


SIGNS = np.array([1.0, -1.0, 1.0, -1.0])


def add_pairwise(asm: Assembler, pkey, ckey, m: np.ndarray) -> int:
    """Pair columns for finite entries, tied to both sides' one-hots.

    Options with equal rows (columns) of ``m`` are interchangeable for this
    edge: ``m`` is constant on each block (row class x column class), so one
    pair variable per finite block, with marginals over the classes' summed
    one-hots, is exact and has the same LP relaxation (the local polytope
    projected onto block sums). Rows: one marginal per producer class, one
    per consumer class but the last (implied by the others plus both
    one-hots). Returns the number of pair columns added.
    """
    listed = m.tolist()
    rows = option_classes(listed)
    cols = option_classes(zip(*listed))
    s, t = len(rows), len(cols)
    block = m[[g[0] for g in rows]][:, [g[0] for g in cols]] if s * t < m.size else m
    kk, ll = np.nonzero(np.isfinite(block))
    n = len(kk)
    y = np.arange(n, dtype=np.int64) + asm.new_pairs(block[kk, ll])
    rclass = np.empty(len(pkey), dtype=np.int64)
    for k, g in enumerate(rows):
        rclass[g] = k
    cclass = np.empty(len(ckey), dtype=np.int64)
    for k, g in enumerate(cols):
        cclass[g] = k
    prow = asm.new_rows(s + t - 1, 0.0, 0.0)
    crow = prow + s
    last_y = ll < t - 1
    last_x = cclass < t - 1
    asm.add(
        np.concatenate([prow + kk, prow + rclass, crow + ll[last_y], crow + cclass[last_x]]),
        np.concatenate([y, np.asarray(pkey, dtype=np.int64), y[last_y], np.asarray(ckey, dtype=np.int64)[last_x]]),
        np.repeat(SIGNS, [n, len(pkey), int(np.count_nonzero(last_y)), int(np.count_nonzero(last_x))]),
    )
    return n
