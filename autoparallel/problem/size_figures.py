"""What the problem-size guard (:mod:`.size`) counts and estimates: the
bytes per pair, line and option it charges, and :class:`ProblemSize`, which
:class:`~autoparallel.errors.ProblemTooLarge` carries."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_PROBLEM_BYTES = 4 * 2**30
# Peak bytes of the whole pipeline (cost matrices, presolve, ILP) per option
# pair, measured on LLaMA-3 8B with pruning (benchmarks/plan_mesh3d.py):
# ~200 B per pair of a distinct (shared) edge matrix, which presolve and the
# ILP materialise once per distinct block (4x4x8, 1 layer: 4.4M pairs, +860
# MiB), and ~1 B per pair of every edge, which shares rows (32 layers: 116M
# more pairs, +100 MiB); 2 B leaves a margin.
BYTES_PER_DISTINCT_PAIR = 200
BYTES_PER_PAIR = 2
# Lazy matrices and option pricing (autoparallel.problem.pricing) keep, per
# distinct edge matrix, whole rows and columns for the options in play
# (tens per decision) in the solver's and the matrices' caches: bytes per
# row or column of a distinct matrix, and per option (labels, unary costs).
BYTES_PER_LAZY_LINE = 1024
BYTES_PER_OPTION = 400
# per option of every decision: links' option mappings, the solver's
# per-decision index arrays (option lists themselves are shared)
BYTES_PER_DECISION_OPTION = 48


@dataclass
class ProblemSize:
    """How big the ILP input will be, counted before any matrix is built."""

    decisions: int
    options: int
    edges: int
    # option pairs over all edges, and over distinct (shared) edge matrices
    pairs: int
    distinct_pairs: int
    estimated_bytes: float
    # rows + columns over the distinct matrices: what lazy matrices grow with
    distinct_lines: int = 0
    # options over distinct option lists (repeated layers share theirs)
    distinct_options: int = 0
    # (pairs, producer, consumer) of the largest distinct edge matrices
    largest: list[tuple[int, str, str]] = field(default_factory=list)
    # (op, nodes, options, option pairs of the edges into its nodes) of the
    # op kinds holding the most pairs: where a mesh's options come from
    by_op: list[tuple[str, int, int, int]] = field(default_factory=list)

    @property
    def lazy_bytes(self) -> float:
        """Estimated peak bytes with lazy matrices and option pricing."""
        return float(
            BYTES_PER_LAZY_LINE * self.distinct_lines
            + BYTES_PER_OPTION * self.distinct_options
            + BYTES_PER_DECISION_OPTION * self.options
        )

    def describe(self) -> str:
        return (
            f"{self.decisions} decisions, {self.options} options, {self.edges} edges, "
            f"{self.pairs:,} option pairs ({self.distinct_pairs:,} in distinct matrices), "
            f"estimated {self.estimated_bytes / 1e9:.2f} GB"
        )
