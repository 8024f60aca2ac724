"""Where the plan's sequence shards take the balanced layout.

A causal attention op split along the sequence over a mesh dim (context
parallelism) does equal work on every rank only if each rank holds two
chunks from opposite ends of the sequence (:mod:`.balanced_layout`). The
plan says ``Shard(d)`` for those tensors; which *rows* a shard holds is a
convention apply may choose, as long as every op that shares the shard sees
the same one. This module chooses it.

Sharing is read off the plan: on one mesh dim, the ``Shard`` placements an
op's option puts on its inputs and outputs describe one split of one
iteration space (the sequence, for the ops around attention), so they must
agree; and an edge whose producer and consumer hold the same ``Shard(d)``
there passes the shard on untouched. The ops joined this way form groups
(union-find); a group that contains a causal, mask-free attention op split
over that mesh dim takes the balanced layout, every other group DTensor's
contiguous one. The step's inputs, parameters, buffers and outputs stay
contiguous (what the caller passes and receives, what checkpoints hold):
an edge from or to them whose layouts differ is converted by the
redistribution (gather, then split the other way; for token ids and labels
that is a few kilobytes per step).

The layout is that of the mesh dim's own shard: where later mesh dims
split the same tensor dim further (the linear layers' flattened token rows
split over dp, cp and tp), they split the balanced shard contiguously, as
DTensor nests shards in mesh order; a redistribution step on the mesh dim
acts when its shard is the innermost one, as every step does.

A group is left contiguous when the balanced layout would not be well
defined for one of its shards: a strided shard, or an odd local size along
the dim (no two equal chunks). Its attention ops then run the contiguous
lowering, which computes every block (logged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch.fx
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from ..options.rules.context_parallel import SEQUENCE_SHARDED_ATTENTION, cp_mesh_dim, is_causal, user_mask

logger = logging.getLogger(__name__)


@dataclass
class SequenceLayout:
    """The mesh dims on which each op node's shards are balanced; nodes not
    listed (placeholders among them) are contiguous everywhere."""

    balanced: dict[torch.fx.Node, frozenset[int]] = field(default_factory=dict)
    # per balanced mesh dim: the attention ops that made it so
    attention: dict[int, list[str]] = field(default_factory=dict)

    def dims_of(self, node: torch.fx.Node | None) -> frozenset[int]:
        return self.balanced.get(node, frozenset()) if node is not None else frozenset()


def _specs(specs) -> list[DTensorSpec]:
    if isinstance(specs, DTensorSpec):
        return [specs]
    if isinstance(specs, (tuple, list)):
        return [s for s in specs if isinstance(s, DTensorSpec)]
    return []


def _shard_dim(spec: DTensorSpec, mesh_dim: int) -> int | None:
    p = spec.placements[mesh_dim]
    return p.dim if isinstance(p, Shard) and not isinstance(p, _StridedShard) else None


def _why_not_balanced(spec: DTensorSpec, mesh_dim: int) -> str | None:
    """Why ``spec``'s shard on ``mesh_dim`` cannot take the balanced layout
    (None: it can, or it is not a shard there)."""
    p = spec.placements[mesh_dim]
    if isinstance(p, _StridedShard):
        return f"a strided shard {p}"
    if not isinstance(p, Shard):
        return None
    size = spec.tensor_meta.shape[p.dim] if spec.tensor_meta is not None else None
    if size is None:
        return "no shape"
    for m, q in enumerate(spec.placements[: mesh_dim + 1]):
        if isinstance(q, (Shard, _StridedShard)) and q.dim == p.dim:
            size //= spec.mesh.size(m)
    if size % 2:
        return f"local size {size} along tensor dim {p.dim} is odd"
    return None


class _Groups:
    def __init__(self):
        self.parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def find(self, x):
        self.parent.setdefault(x, x)
        while self.parent[x] is not x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[ra] = rb


def _seed_mesh_dim(node: torch.fx.Node, option) -> int | None:
    """The mesh dim a causal, mask-free attention op splits the sequence
    over (the ops the balanced layout is for), else None."""
    sig = SEQUENCE_SHARDED_ATTENTION.get(node.target)
    if sig is None or not is_causal(node, sig) or user_mask(node, sig) is not None:
        return None
    return cp_mesh_dim(option, sig)


def plan_sequence_layout(graph: torch.fx.Graph, strategies: dict, choice: dict[str, int], mesh) -> SequenceLayout:
    """The balanced shards of the plan ``choice`` over ``graph``'s nodes."""
    chosen = {}
    seeds: dict[int, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        strat = strategies.get(node)
        if node.op != "call_function" or strat is None or node.name not in choice:
            continue
        opt = strat.options[choice[node.name]]
        chosen[node] = (strat, opt)
        m = _seed_mesh_dim(node, opt)
        if m is not None and mesh.size(m) > 1:
            seeds.setdefault(m, []).append(node)
    layout = SequenceLayout()
    for m, attention in seeds.items():
        groups = _Groups()
        members: dict[torch.fx.Node, list[DTensorSpec]] = {}
        for node, (strat, opt) in chosen.items():
            out_specs = _specs(opt.output_specs)
            specs = out_specs + ([] if strat.getitem_index is not None else _specs(opt.input_specs))
            sharded = [s for s in specs if isinstance(s.placements[m], (Shard, _StridedShard))]
            if sharded:
                members[node] = sharded
                groups.find(node)
            if strat.getitem_index is not None:
                parent = strat.inputs[0]
                if parent in chosen and sharded:
                    groups.union(node, parent)
                continue
            for producer, want in zip(strat.inputs, opt.input_specs):
                if producer not in chosen:
                    continue  # a placeholder: contiguous
                have = chosen[producer][1].output_specs
                if not isinstance(have, DTensorSpec) or not isinstance(want, DTensorSpec):
                    continue
                d = _shard_dim(want, m)
                if d is not None and _shard_dim(have, m) == d:
                    groups.union(producer, node)
        by_group: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for node in members:
            by_group.setdefault(groups.find(node), []).append(node)
        done = set()
        for seed in attention:
            root = groups.find(seed)
            if root in done:
                continue
            done.add(root)
            group = by_group.get(root, [seed])
            blocker = next(
                ((n, why) for n in group for s in members.get(n, []) if (why := _why_not_balanced(s, m))), None
            )
            names = [a.name for a in attention if groups.find(a) is root]
            if blocker is not None:
                logger.warning(
                    "attention %s keeps the contiguous sequence layout on mesh dim %d (its causal blocks are all "
                    "computed): node %s shares its shards and %s",
                    ", ".join(names[:3]) + (" ..." if len(names) > 3 else ""),
                    m,
                    blocker[0].name,
                    blocker[1],
                )
                continue
            for n in group:
                layout.balanced[n] = layout.balanced.get(n, frozenset()) | {m}
            layout.attention.setdefault(m, []).extend(names)
        if layout.attention.get(m):
            logger.info(
                "balanced sequence layout on mesh dim %d: %d attention ops, %d ops share their shards",
                m,
                len(layout.attention[m]),
                sum(1 for v in layout.balanced.values() if m in v),
            )
    return layout
