"""Deterministic solves (solver.work): where a solve stops is counted work,
never the clock, so the same problem gives the same plan whatever the load;
a solve stopped short says by what (``stopped_by``)."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from solver import Decision, Edge, Problem, solve

pytest.importorskip("highspy")


def tied_grid(n: int, k: int, seed: int) -> Problem:
    """An n x n grid of k-option decisions whose costs take few values:
    cycles make the LP fractional, and many plans cost the same."""
    rng = np.random.default_rng(seed)
    ds = [
        Decision(f"v{i}_{j}", [f"o{o}" for o in range(k)], rng.integers(0, 3, k).astype(float).tolist())
        for i in range(n)
        for j in range(n)
    ]
    es = [
        Edge(f"v{i}_{j}", f"v{i + di}_{j + dj}", 0, rng.integers(0, 4, (k, k)).astype(float).tolist())
        for i in range(n)
        for j in range(n)
        for di, dj in ((0, 1), (1, 0))
        if i + di < n and j + dj < n
    ]
    return Problem(ds, es, name=f"tied{n}")


def _key(s):
    return s.choice, s.objective, s.status, s.bound, s.stopped_by


def _burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1])
def test_same_plan_under_load(seed):
    """Option pricing (LP rounds, dual ascent, restricted ILPs) and the ILP,
    once on a quiet process and once beside CPU-burning processes: the same
    choice among the many equal-cost optima, the same bound and status."""
    p = tied_grid(4, 6, seed)
    quiet = [solve(p, pricing=True, time_limit=600), solve(p, pricing=False, time_limit=600, node_limit=50)]
    burners = _burners(2)
    try:
        loaded = [solve(p, pricing=True, time_limit=600), solve(p, pricing=False, time_limit=600, node_limit=50)]
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert quiet[0].backend.startswith("pricing+") and not quiet[1].backend.startswith("pricing")
    for a, b in zip(quiet, loaded):
        assert _key(a) == _key(b)


def test_a_slow_clock_does_not_change_the_plan(monkeypatch):
    """Every clock reading 2 s after the last (a machine ~1000x slower),
    under a cap it never reaches (~300 readings): the same plan as with the
    real clock."""
    p = tied_grid(4, 6, 0)
    real = solve(p, pricing=True, time_limit=1e4)
    now = [time.perf_counter()]

    def slow() -> float:
        now[0] += 2.0
        return now[0]

    monkeypatch.setattr(time, "perf_counter", slow)
    assert _key(solve(p, pricing=True, time_limit=1e4)) == _key(real)


def test_stopped_by_says_which_limit():
    """A solve stopped by the gap it was allowed (a count-free but
    clock-free stop) says "work limit" and repeats exactly; one stopped by
    its time limit says so."""
    from test_time_limit import grid

    p = grid(8, 4, 1)
    short = [solve(p, rel_gap=0.5), solve(p, rel_gap=0.5)]
    assert short[0].status == "feasible" and short[0].stopped_by == "work limit"
    assert _key(short[0]) == _key(short[1])
    full = solve(p, node_limit=1000)
    assert full.optimal and full.stopped_by is None
    capped = solve(grid(14, 4, 1), time_limit=0.5)
    assert capped.stopped_by == ("time limit" if not capped.optimal else None)
