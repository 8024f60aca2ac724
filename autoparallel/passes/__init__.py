"""Rewrite passes that ``apply_placement`` runs on the plan and its graphs.

Each pass is one module of this package holding one function that takes
what it rewrites plus a :class:`PassContext` and returns a small stats
dataclass. Passes run at one of three points of the apply pipeline:

* ``"plan"``: on the traced joint graph and the plan's choice, before the
  rank-local graph is built (e.g. removing alias round-trips);
* ``"joint"``: on the rank-local joint graph, before the forward/backward
  split (e.g. tagging all-gather chains for recomputation);
* ``"graphs"``: on the forward and on the backward graph after the split
  (e.g. fusing chained all-gathers, overlap scheduling); such a pass is
  called once per graph, with ``ctx.graph_kind`` set to "forward" or
  "backward", and returns stats for that graph.

All registered passes run by default, in :data:`PASS_ORDER` within a
stage; ``apply_placement(plan, disable_passes=("name", ...))`` switches some
off. Stats are logged, stored on the plan (``plan.pass_stats``, shown in
``plan.summary()`` and the JSON dump).
"""

from .base import (
    ChunkMode,
    ColumnMajorAllGather,
    GraphKind,
    PASS_ORDER,
    PASSES,
    PassContext,
    PassFn,
    PassOptions,
    PassSpec,
    Stage,
    check_disabled,
    pass_names,
    register_pass,
    run_stage,
    stats_to_json,
)

__all__ = [
    "ChunkMode",
    "ColumnMajorAllGather",
    "GraphKind",
    "PASS_ORDER",
    "PASSES",
    "PassContext",
    "PassFn",
    "PassOptions",
    "PassSpec",
    "Stage",
    "check_disabled",
    "pass_names",
    "register_pass",
    "run_stage",
    "stats_to_json",
]

# Importing the pass modules registers them; PASS_ORDER decides the run order.
from . import fuse_all_gathers  # noqa: F401
from . import alias_round_trips  # noqa: F401
from . import split_moe_a2a  # noqa: F401
from . import chunk_regions  # noqa: F401
from . import recompute_all_gathers  # noqa: F401
from . import bucket_collectives  # noqa: F401
from . import schedule_overlap  # noqa: F401
