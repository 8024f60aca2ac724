"""What the user asked of a problem (pins, parameter memory bounds, reduce
dtype, size guard, pricing), in node terms: what :mod:`.builder` and
:mod:`.param_budget` read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .option_rules import OptionRule
from .size_figures import DEFAULT_MAX_PROBLEM_BYTES


@dataclass
class Constraints:
    """What the user asked for, in node terms (validated by the API)."""

    # decision name -> (constraint name, allowed placements)
    pins: dict[str, tuple[str, tuple]] = field(default_factory=dict)
    # Parameter memory budget as fractions of replicated parameter bytes;
    # None high = fully sharded (smallest achievable per parameter). The API
    # passes high=1.0 when the user set no bound and a step memory budget
    # holds (the budget's row bounds parameters with the rest of the step).
    memory_low: float | None = None
    memory_high: float | None = None
    # Mixed precision: dtype parameter gradients are reduced in (None: no
    # constraint). Partial gradients of another dtype may not be reduced.
    reduce_dtype: torch.dtype | None = None
    # Refuse to build a problem whose estimated memory (see
    # :func:`estimate_problem_size`) exceeds this many bytes; None: no limit.
    max_problem_bytes: float | None = DEFAULT_MAX_PROBLEM_BYTES
    # Drop Partial options no computation can make useful, before building
    # pair matrices (exact: see autoparallel.options.pruning); off only to
    # compare against.
    prune_options: bool = True
    # Lazy edge matrices and option pricing (solver.pricing) instead of
    # dense matrices: True, False, or None = when the dense problem's
    # estimate exceeds max_problem_bytes (then max_problem_bytes bounds the
    # lazy estimate instead).
    option_pricing: bool | None = None
    # decision name -> rules allowing a set of its options by placement on
    # one mesh dim (autoparallel.problem.option_rules; mesh-dim roles)
    option_rules: dict[str, list[OptionRule]] = field(default_factory=dict)
