"""Names shared by the modules that read and rewrite FX graphs.

``node.meta`` keys that autoparallel writes (and the one it reads from
tracing), the functional-collective ops the passes look for, and the kinds
a scheduler gives graph nodes. Modules import them from here; a new key or
alias belongs here too, so one file lists what the graphs may carry.
"""

from __future__ import annotations

from enum import IntEnum

import torch

__all__ = [
    "AC_MODE_KEY",
    "AC_POLICY_KEY",
    "AC_REGION_KEY",
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "C10D",
    "CHUNK_KEY",
    "COLLECTIVE_START",
    "COLLECTIVE_STARTS",
    "FOLD_KEY",
    "MODULE_PATH_KEY",
    "module_path",
    "NOT_A_CALL",
    "NodeKind",
    "OTHER_CALL",
    "REDISTRIBUTE_KEY",
    "REDUCE_SCATTER",
    "SOURCE_KEY",
    "WAIT",
    "WAIT_NODE",
]

# -- node.meta keys ------------------------------------------------------------
# On the traced joint graph:
MODULE_PATH_KEY = "module_path"  # FQN of the module a node was traced in
# Inside node.meta["custom"] (activation checkpointing annotations):
AC_REGION_KEY = "ac_region"  # which checkpointed region a node belongs to
AC_MODE_KEY = "ac_mode"  # "full" or "selective"
AC_POLICY_KEY = "ac_policy"  # selective only: SACPolicy.to_annotation()
# On the rank-local graphs apply builds:
SOURCE_KEY = "autoparallel_source"  # name of the joint-graph node a local node implements
REDISTRIBUTE_KEY = "autoparallel_redistribute"  # (producer, src placements, dst placements)
FOLD_KEY = "ap_fold"  # layer folding: (short layer, key within the layer), absent if global
CHUNK_KEY = "ap_chunk"  # chunk_regions: (region, chunk 0 or 1) on the nodes it duplicated

# -- functional collectives ----------------------------------------------------
C10D = torch.ops._c10d_functional
ALL_GATHER = C10D.all_gather_into_tensor.default
REDUCE_SCATTER = C10D.reduce_scatter_tensor.default
ALL_REDUCE = C10D.all_reduce.default
ALL_TO_ALL = C10D.all_to_all_single.default
WAIT = C10D.wait_tensor.default
# Ops that start an asynchronous collective completed by WAIT.
COLLECTIVE_STARTS = frozenset({ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL})


class NodeKind(IntEnum):
    """What a graph node is to a scheduler (see passes/overlap_model.py)."""

    NOT_A_CALL = 0  # placeholder, output, get_attr
    COLLECTIVE_START = 1  # one of COLLECTIVE_STARTS
    WAIT = 2  # wait_tensor: the collective's result is ready
    OTHER_CALL = 3  # compute, views, in-op communication


# The members as module constants, for hot loops: an attribute lookup on an
# Enum class costs about a microsecond, a module global tens of nanoseconds.
NOT_A_CALL, COLLECTIVE_START, WAIT_NODE, OTHER_CALL = NodeKind


def module_path(node: torch.fx.Node) -> str | None:
    """FQN of the innermost module whose forward produced ``node`` (or whose
    forward's backward did), as recorded while tracing."""
    custom = node.meta.get("custom")
    return custom.get(MODULE_PATH_KEY) if custom else None
