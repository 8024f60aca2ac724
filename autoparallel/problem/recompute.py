"""Which forward ops the backward runs again under the model's activation
checkpointing, so that the problem prices them twice.

The min-cut partitioner honours the AC tags (``node.meta["recompute"]``):
a forward op tagged ``PREFER_RECOMPUTE`` or ``MUST_RECOMPUTE`` is not saved
but run again in backward, when the backward needs it, directly or through
other recomputed ops; a ``MUST_SAVE`` op's output is saved, and what only
feeds it is not rerun. Before the cut, the partitioner saves the boundary
between two checkpointed regions: a tagged op read by a tagged op of a later
region (a block's residual add read by the next block) is saved, so the
block's last ops (a MoE block's routed experts under that add) run once. Full AC tags every op of a block for recomputation
(the backward reruns the block's whole forward); selective AC saves the
matmuls and attention (every other matmul recomputed), so it reruns the
cheap element-wise work and half the matmuls. The compute term of the
objective is then the step's compute, recomputation included, as the
overlap scheduler's estimate counts it.

>>> # recomputed = recomputed_forward_nodes(traced.gm)   # doctest: +SKIP
>>> # len(recomputed)  -> the forward ops that run twice
"""

from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["recomputed_forward_nodes"]

_RECOMPUTED = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


def _is_backward(n: fx.Node) -> bool:
    return n.meta.get("partitioner_tag") == "is_backward"


def _later_region(n: fx.Node, user: fx.Node) -> bool:
    """Whether ``user`` lies in a later checkpointed region than ``n`` (the
    partitioner's ``cleanup_recompute_tags`` then saves ``n``)."""
    a, b = n.meta.get("ac_graph_id"), user.meta.get("ac_graph_id")
    return a is not None and b is not None and b > a


def recomputed_forward_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The forward ``call_function`` nodes tagged for recomputation whose
    value the backward reads, directly or through other such nodes."""
    tagged = {
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and not _is_backward(n) and n.meta.get("recompute") in _RECOMPUTED
    }
    tagged -= {n for n in tagged if any(_later_region(n, u) for u in n.users if u in tagged)}
    if not tagged:
        return set()
    out: set[fx.Node] = set()
    for n in reversed(list(gm.graph.nodes)):  # users before their inputs
        if n in tagged and any(_is_backward(u) or u in out for u in n.users):
            out.add(n)
    return out
