"""How one run of option pricing (:func:`solver.pricing.solve_by_pricing`)
went: the record every phase of it (rounds, proof, bisection) adds to."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class PricingStats:
    """How the pricing went; seconds per phase: setup (quotient), lp,
    pricing, ilp, evaluate."""

    classes: int = 0
    options_total: int = 0  # allowed options over all classes
    rounds: int = 0
    kept_per_round: list[int] = field(default_factory=list)  # exact options
    relaxed_per_round: list[int] = field(default_factory=list)
    promoted_per_round: list[int] = field(default_factory=list)
    priced_per_round: list[int] = field(default_factory=list)
    lp_objective_per_round: list[float] = field(default_factory=list)
    bound_per_round: list[float] = field(default_factory=list)
    lower_bound: float = -math.inf
    restricted_objectives: list[float] = field(default_factory=list)
    fixed_in: int = 0  # options added by reduced-cost fixing
    tree_bound: float = -math.inf  # best spanning-forest bound (solver.tree_bound)
    eliminated: int = 0  # options dropped by tree min-marginals before pricing
    ascent_bound: float = -math.inf  # the dual ascent's (solver.dual_bound)
    ascent_sweeps: int = 0
    entries_read: int = 0  # matrix entries materialised (pairs)
    converged: bool = False  # the LP reached the full LP's optimum
    seconds: dict[str, float] = field(default_factory=dict)
