"""Re-gather parameters in backward instead of saving the gathered weights.

An FSDP-style plan gathers each sharded parameter before the compute that
uses it::

    primal (shard) -> [cast] -> all_gather -> wait -> [split/cat] -> t / view ...

The backward needs the gathered weight again (``grad_x = grad_y @ W``). Left
alone, the partitioner saves it (collectives are MUST_SAVE by default), so
every layer's full weight stays alive from forward to backward: the memory
FSDP exists to avoid. This pass tags the whole chain ``MUST_RECOMPUTE`` so
the backward gathers again from the shard (a primal, always available).

The chain is every node that is a function of one parameter alone
(plus the ``coords`` input) built from collectives, casts and layout ops, and
that is connected to an all-gather: the cast before it, the all-gather and
its wait, the slices/cat that place gathered chunks, and the single-input
chain of layout ops after it (``t``, ``permute``, ``view``, ``expand``...).
Tagging only the collective would let the partitioner save ``t(W)`` instead:
the same bytes under another name. Backward nodes belong to the chain too: a
backward op that reads the weight in another layout (the transposed weight
gathered over tp as well) has its own gather, a function of the parameter
alone, which the partitioner would otherwise run in the forward and save
(it saves every collective it is not told to recompute): on a LLaMA-3
70B plan on 16 x 8 that is 75 GB of gathered weights per rank.

``PassOptions.reshard_after_forward=False`` (ZeRO-2 style) does the opposite:
the chain's collectives are MUST_SAVE even inside a selective-AC region, so
the gathered weights are kept for backward and never re-gathered.

Context parallelism's sequence-sharded attention gathers K and V over the
cp dim and stacks blocks of its inputs (:mod:`autoparallel.apply.context_parallel`);
the backward does so again. The partitioner would merge the two and save
the gathered values or blocks of every layer; :func:`attention_input_chains`
finds those chains, tagged ``MUST_RECOMPUTE`` like a parameter's (not with
``reshard_after_forward=False``, which is about weights).

Tags (read by ``torch._functorch.partitioners``): ``meta["recompute"]`` and
``meta["ac_graph_id"]``. The id is a large constant: the partitioner turns a
recomputed node into MUST_SAVE when one of its recomputed users has a larger
``ac_graph_id`` (the boundary between two AC regions); chain nodes feed AC
regions with small ids, never the other way round, so they stay recomputed.

>>> # stats = recompute_all_gathers(local.gm, ctx)    # doctest: +SKIP
>>> # RecomputeAllGathersStats(chains=21, all_gathers=21, nodes_tagged=84, ...)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..capture.activation_checkpointing import forward_nodes
from ..graph_vocab import ALL_GATHER as _AG, ALL_TO_ALL, REDISTRIBUTE_KEY, SOURCE_KEY, WAIT
from ..options.rules.context_parallel import SEQUENCE_SHARDED_ATTENTION
from .base import PassContext, register_pass

__all__ = [
    "RecomputeAllGathersStats",
    "recompute_all_gathers",
    "saved_for_backward",
    "param_gather_chains",
    "attention_input_chains",
    "is_chain_op",
]

# Far above any AC region id (see the module docstring).
CHAIN_AC_GRAPH_ID = 1_000_000

_aten = torch.ops.aten
_COLLECTIVES = {_AG, WAIT, ALL_TO_ALL}
# Non-view ops that only move or cast a parameter's data.
_DATA_MOVES = {
    _aten.clone.default,
    _aten.cat.default,
    _aten._to_copy.default,
    _aten.index_select.default,  # this rank's chunk, by coords
    _aten.reshape.default,
    _aten._unsafe_view.default,  # a reshape's copy (the backward's re-layout of a weight ends in one)
    _aten.split.Tensor,
    _aten.split_with_sizes.default,
    _aten.chunk.default,
    _aten.unbind.int,
    torch.ops.prims.convert_element_type.default,
    operator.getitem,
}


def is_chain_op(node: fx.Node) -> bool:
    """Whether ``node`` may belong to a parameter's gather chain: a collective, a wait, a view or an op that only moves or casts data."""
    if node.op != "call_function":
        return False
    t = node.target
    if t in _COLLECTIVES or t in _DATA_MOVES:
        return True
    return isinstance(t, torch._ops.OpOverload) and t.is_view


@dataclass
class RecomputeAllGathersStats:
    mode: str = "recompute"  # "recompute" or "save" (reshard_after_forward=False)
    chains: int = 0  # parameters with a gather chain in the forward
    all_gathers: int = 0
    nodes_tagged: int = 0
    # per rank: bytes of the gathered weights (all-gather outputs) in the chains
    gathered_bytes: int = 0
    # sequence-sharded attention: inputs gathered over cp or stacked as blocks
    attention_chains: int = 0
    attention_nodes_tagged: int = 0


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _param_and_free_inputs(gm: fx.GraphModule, ctx: PassContext | None) -> tuple[list[fx.Node], set[fx.Node]]:
    """Parameter (and buffer) placeholders, and inputs a chain may read
    besides its parameter (the ``coords`` input)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    local = getattr(ctx, "local", None)
    if local is None:  # a bare graph: every primal may be a parameter
        return [p for p in placeholders if "tangents" not in str(p.target)], set()
    params = placeholders[: len(local.param_fqns) + len(local.buffer_fqns)]
    free = {placeholders[local.num_primals - 1]} if local.num_primals <= len(placeholders) else set()
    return params, free


def param_gather_chains(
    gm: fx.GraphModule,
    ctx: PassContext | None = None,
    *,
    params: list[fx.Node] | None = None,
    forward_only: bool = True,
) -> dict[fx.Node, list[fx.Node]]:
    """Parameter placeholder -> its gather chain (graph order); only gathered
    parameters appear. ``params`` overrides which placeholders are parameters;
    ``forward_only`` (for joint graphs) ignores backward nodes."""
    found, free = _param_and_free_inputs(gm, ctx)
    if params is None:
        params = found
    fwd = forward_nodes(gm) if forward_only else set(gm.graph.nodes)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    chains: dict[fx.Node, list[fx.Node]] = {}
    for p in params:
        # forward closure: chain ops whose inputs are all p, free, or closure
        closure: set[fx.Node] = set()
        frontier = [p]
        while frontier:
            n = frontier.pop()
            for u in n.users:
                if u in closure or u not in fwd or not is_chain_op(u):
                    continue
                if all(a is p or a in free or a in closure for a in u.all_input_nodes):
                    closure.add(u)
                    frontier.append(u)
        gathers = [n for n in closure if n.target is _AG]
        if not gathers:
            continue
        # keep what is connected to a gather: its ancestors and descendants
        keep: set[fx.Node] = set(gathers)
        stack = list(gathers)
        while stack:  # ancestors inside the closure (casts before the gather)
            for a in stack.pop().all_input_nodes:
                if a in closure and a not in keep:
                    keep.add(a)
                    stack.append(a)
        stack = list(gathers)
        while stack:  # descendants inside the closure (wait, layout chain)
            for u in stack.pop().users:
                if u in closure and u not in keep:
                    keep.add(u)
                    stack.append(u)
        chains[p] = sorted(keep, key=order.__getitem__)
    return chains


def attention_input_chains(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The chains of collectives and data moves that make a sequence-sharded
    attention kernel's q, k, v, output and logsumexp inputs
    (:mod:`autoparallel.apply.context_parallel`), where they gather (K and
    V over the cp dim) or pick (``index_select``: the stacked blocks, a
    rank's shard), up to the ops that computed the values. Chains that read
    a tangent (the output gradient's blocks) are left out, and so is a
    mask (its local rows would be recomputed from the replicated mask).
    Untagged, the partitioner merges the backward's chains with the
    forward's (CSE), runs them in the forward and saves their results:
    several times a layer's K and V; tagged, the backward gathers and
    stacks again from what computed them."""
    tangent_dependent: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if (n.op == "placeholder" and "tangents" in str(n.target)) or any(
            a in tangent_dependent for a in n.all_input_nodes
        ):
            tangent_dependent.add(n)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    picks = {_aten.index_select.default, _AG}
    chains: list[list[fx.Node]] = []
    claimed: set[fx.Node] = set()
    for kernel in gm.graph.nodes:
        if kernel.op != "call_function" or kernel.target not in SEQUENCE_SHARDED_ATTENTION:
            continue
        sig = SEQUENCE_SHARDED_ATTENTION[kernel.target]
        found = []
        for position in (sig.query, sig.key, sig.value, sig.out, sig.logsumexp):
            start = kernel.args[position] if position is not None and position < len(kernel.args) else None
            chain: set[fx.Node] = set()
            stack = [start] if isinstance(start, fx.Node) else []
            while stack:
                n = stack.pop()
                if n in chain or n in tangent_dependent or not is_chain_op(n):
                    continue
                chain.add(n)
                stack.extend(n.all_input_nodes)
            if any(n.target in picks for n in chain):
                found.append(chain)
        # only the sequence-sharded lowering's kernels: an all-gather of the
        # op itself (not a layout change of its inputs) feeds them
        source = kernel.meta.get(SOURCE_KEY)
        if not any(
            n.target is _AG and REDISTRIBUTE_KEY not in n.meta and n.meta.get(SOURCE_KEY) == source
            for chain in found
            for n in chain
        ):
            continue
        for chain in found:
            if chain - claimed:
                claimed |= chain
                chains.append(sorted(chain, key=order.__getitem__))
    return chains


@register_pass("recompute_all_gathers", "joint")
def recompute_all_gathers(gm: fx.GraphModule, ctx: PassContext) -> RecomputeAllGathersStats:
    """Tag parameter all-gather chains of the joint graph ``gm`` (in place)."""
    recompute = ctx.options.reshard_after_forward
    stats = RecomputeAllGathersStats(mode="recompute" if recompute else "save")
    # backward nodes too: a backward op that reads a parameter in another
    # layout than the forward's (a transposed weight gathered over tp) gets
    # its own gather chain in the backward, a function of the parameter alone;
    # left untagged, the partitioner saves every collective
    # (``force_save_collectives``), so that chain would run in the forward
    # and keep each layer's gathered weight until the backward
    for param, chain in param_gather_chains(gm, ctx, forward_only=False).items():
        # a folded graph's layer-1 parameter stands for several layers'
        copies = ctx.copies(param)
        stats.chains += copies
        for n in chain:
            if n.target is _AG:
                stats.all_gathers += copies
                stats.gathered_bytes += copies * _nbytes(n)
            if recompute:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                n.meta["ac_graph_id"] = CHAIN_AC_GRAPH_ID
                stats.nodes_tagged += copies
            elif n.target in _COLLECTIVES:
                # keep the gathered weight even where selective AC said recompute
                n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                n.meta.pop("ac_graph_id", None)
                stats.nodes_tagged += copies
    if recompute:
        tagged: set[fx.Node] = set()
        for chain in attention_input_chains(gm):
            stats.attention_chains += 1
            for n in chain:
                if n not in tagged:
                    tagged.add(n)
                    n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                    n.meta["ac_graph_id"] = CHAIN_AC_GRAPH_ID
        stats.attention_nodes_tagged = len(tagged)
    return stats


def saved_for_backward(fw: fx.GraphModule, num_fwd_outputs: int) -> list[tuple[str, int]]:
    """(name, bytes per rank) of each tensor a forward graph saves for backward."""
    (out,) = fw.graph.find_nodes(op="output")
    return [(n.name, _nbytes(n)) for n in out.args[0][num_fwd_outputs:] if isinstance(n, fx.Node)]
