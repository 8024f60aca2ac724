"""Figures of :func:`solver.solve_by_pricing` on a random problem with lazy
edge matrices: rounds, kept options, entries read and seconds per phase.
Asserts nothing (``--check`` compares with :func:`solver.solve` on the dense
problem, which needs every matrix materialised: small sizes only).

The problem imitates placement: an option is a placement per mesh dim (one
of ``--placements``), so ``placements ** dims`` options; changing dim ``k``'s
placement between producer and consumer costs that dim's price (times a
per-edge tensor size), equal placements are free. Unary costs: compute time
the work divided by the product of the sharded mesh dims' sizes (4, 4,
8, 8, ...), times 1 + ``--noise`` x uniform. Decisions form a chain
with a skip edge every 4 (undirected cycles); edges of the same kind share
one lazy matrix object.

    PYTHONPATH=. python benchmarks/pricing_random.py --decisions 200 --dims 5 --placements 3

Figures (2026-11-23, shared 2-core machine, load ~1-3, 5 GiB ulimit):

* 200 x 243 options (48,600; 14.6M pairs): optimal 966.386996 (dense
  solve agrees), 54 rounds, 4,569 options exact (9.4%), 93K entries read,
  16 s (LP 13.8 s); the dense solve, which needs every matrix, 5 s.
* 60 x 243: optimal, 1,260 exact (8.6%), 4.7 s; dense 2.6 s.
* 200 x 1024 (204,800 options; 260M pairs): not proven. The LP climbs slowly
  (its compute costs tie within 10% noise over 243 fully sharded options,
  and with only ``floor`` known for unread pairs every near-tie must become
  exact); at 129 rounds / 390 s HiGHS hit the memory limit with 20,811
  exact + 6,489 relaxed options: "feasible" 1000.18, bound 930.41.

With whole-row reductions (default; ``--no-min-plus`` reads blocks only),
2026-11-23, load ~4: spanning-forest elimination (solver.tree_bound) drops
options before any LP round. 200 x 1024 (``--dims 5 --placements 4``):
197,235 of 204,800 options dropped, the ILP over the 7,565 left is the
proof: optimal 938.682949 in 78 s. 60 x 243 (``--dims 5 --placements 3``):
14,520 of 14,580 dropped (a forest's own plan is optimal), 5.4 s.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import time

import numpy as np

from solver import Decision, Edge, Problem, solve, solve_by_pricing


class PlacementMatrix:
    """Lazy matrix: ``size * sum_k price[k] * (code_i[k] != code_j[k])``."""

    def __init__(self, codes: np.ndarray, price: np.ndarray, size: float):
        self.codes, self.price, self.size = codes, price, size
        self.shape = (len(codes), len(codes))
        self.floor = 0.0
        self.entries = 0

    def block(self, rows, cols):
        self.entries += len(rows) * len(cols)
        diff = self.codes[rows][:, None, :] != self.codes[cols][None, :, :]
        return self.size * (diff * self.price).sum(axis=2)


class ReducingPlacementMatrix(PlacementMatrix):
    """With whole-row min-plus reductions (solver.pricing prices left-out
    options against every partner), computed block by block."""

    def min_plus_rows(self, col_values):
        out = np.empty(self.shape[0])
        allc = np.arange(self.shape[1])
        for s in range(0, self.shape[0], 128):
            rows = np.arange(s, min(s + 128, self.shape[0]))
            out[rows] = (self.block(rows, allc) - col_values[None, :]).min(axis=1)
        return out

    def min_plus_cols(self, row_values):  # symmetric costs
        return self.min_plus_rows(row_values)


def build(
    n_dec: int, dims: int, placements: int, kinds: int, seed: int, noise: float = 0.1, min_plus: bool = True
) -> tuple[Problem, list]:
    rng = np.random.default_rng(seed)
    codes = np.array(list(itertools.product(range(placements), repeat=dims)), dtype=np.int8)
    n = len(codes)
    price = rng.uniform(0.5, 2.0, dims)
    kind = ReducingPlacementMatrix if min_plus else PlacementMatrix
    mats = [kind(codes, price, float(rng.uniform(0.5, 3.0))) for _ in range(kinds)]
    mesh = np.array([4, 4, 8, 8, 2, 2][:dims] + [2] * max(0, dims - 6))
    # compute time: the work divided by the devices sharing it
    split = np.prod(np.where(codes > 0, mesh, 1), axis=1)
    decisions = []
    for d in range(n_dec):
        work = rng.uniform(1.0, 8.0) * float(mesh.prod())
        unary = work / split * (1 + noise * rng.random(n))
        decisions.append(Decision(f"n{d}", [str(c.tolist()) for c in codes], unary.round(6).tolist()))
    edges = []
    for d in range(1, n_dec):
        edges.append(Edge(f"n{d - 1}", f"n{d}", 0, mats[d % kinds]))
        if d >= 4 and d % 4 == 0:
            edges.append(Edge(f"n{d - 4}", f"n{d}", 1, mats[(d // 4) % kinds]))
    return Problem(decisions, edges, name=f"pricing_random{seed}"), mats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decisions", type=int, default=200)
    ap.add_argument("--dims", type=int, default=4)
    ap.add_argument("--placements", type=int, default=6, help="options = placements ** dims")
    ap.add_argument("--kinds", type=int, default=6, help="distinct lazy matrix objects")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.1, help="relative noise on compute costs")
    ap.add_argument("--max-options", type=int, default=None)
    ap.add_argument("--check", action="store_true", help="also solve the dense problem (small sizes)")
    ap.add_argument(
        "--no-min-plus", action="store_true", help="matrices read by blocks only (left-out pairs priced at the floor)"
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(name)s %(message)s")
    t0 = time.perf_counter()
    problem, mats = build(a.decisions, a.dims, a.placements, a.kinds, a.seed, a.noise, min_plus=not a.no_min_plus)
    n = len(problem.decisions[0].options)
    print(
        f"problem: {a.decisions} decisions x {n} options, {len(problem.edges)} edges, "
        f"{len(mats)} lazy objects, {len(problem.edges) * n * n / 1e6:.1f}M pairs "
        f"(built in {time.perf_counter() - t0:.2f}s)"
    )
    res = solve_by_pricing(problem, max_options=a.max_options)
    s, st = res.solution, res.stats
    print(f"status {s.status}, objective {s.objective:.9g}, bound {s.bound:.9g}")
    print(f"rounds {st.rounds}; kept per round {st.kept_per_round}; priced in {st.priced_per_round}")
    print(
        f"kept {sum(len(v) for v in res.kept.values())} decisions x options of {st.options_total} "
        f"({st.eliminated} dropped by tree elimination) "
        f"({st.fixed_in} by reduced-cost fixing); restricted ILP objectives {st.restricted_objectives}"
    )
    print(f"entries read {st.entries_read} ({st.entries_read / (len(mats) * n * n):.2%} of the distinct matrices)")
    print("seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in st.seconds.items()))
    if a.check:
        dense = Problem(
            problem.decisions,
            [
                Edge(e.producer, e.consumer, e.arg_index, e.costs.block(np.arange(n), np.arange(n)).tolist())
                for e in problem.edges
            ],
        )
        t = time.perf_counter()
        ref = solve(dense)
        print(
            f"dense solve: objective {ref.objective:.9g} ({time.perf_counter() - t:.2f}s); "
            f"match {math.isclose(ref.objective, s.objective, rel_tol=1e-9)}"
        )


if __name__ == "__main__":
    main()
