"""Which all-gathers of a forward/backward graph gather parameters, for
:mod:`.schedule_overlap`: each parameter gather (single or bucketed) with
its layer key and chain (casts and layout ops before it, the wait and the
views after it), layers ranked for the prefetch distance, and the chain
ops the scheduler defers to a gather's first use."""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from .base import PassContext
from .overlap_model import AG, STARTS, WAIT, Info


def _layer_of(fqn: str) -> str:
    m = re.match(r"^(.*?\.\d+)(\.|$)", fqn)
    return m.group(1) if m else fqn


def layer_ranks(layer_order: list[str]) -> dict[str, int]:
    """Layer -> its rank for the prefetch distance, layers in order of need.
    Repeated blocks (``layers.3``) count one each; the parameters between
    them (embeddings before the first, the final norm and output projection
    after the last) join the next block, or form one more after the last,
    as FSDP wraps them: a tiny norm must not use up the prefetch distance
    and leave the output projection's gather exposed. Without numbered
    blocks, every layer counts."""
    numbered = [re.search(r"\.\d+$", name) is not None for name in layer_order]
    if not any(numbered):
        return {name: k for k, name in enumerate(layer_order)}
    ranks: dict[str, int] = {}
    seen = 0  # numbered layers before this one
    for name, is_block in zip(layer_order, numbered):
        ranks[name] = seen
        seen += is_block
    return ranks


def gathers_by_layer(gm: fx.GraphModule, ctx: PassContext | None) -> dict[fx.Node, tuple[str, list[fx.Node]]]:
    """all-gather node -> (layer key, ...) for parameter gathers of ``gm``."""
    from .recompute_all_gathers import param_gather_chains

    local = getattr(ctx, "local", None)
    fqn_of: dict[str, str] = {}
    if local is not None:
        fqns = list(local.param_fqns) + list(local.buffer_fqns)
        fqn_of = dict(zip(local.primal_names(), fqns))
    placeholders = [p for p in gm.graph.find_nodes(op="placeholder")]
    # in a forward/backward graph the parameter shards keep their joint names
    params = (
        [p for p in placeholders if p.name in fqn_of]
        if fqn_of
        else [p for p in placeholders if "tangents" not in p.name]
    )
    out: dict[fx.Node, tuple[str, list[fx.Node]]] = {}
    for p, chain in param_gather_chains(gm, None, params=params, forward_only=False).items():
        layer = _layer_of(fqn_of.get(p.name, p.name))
        for n in chain:
            if n.target is AG:
                out[n] = (layer, chain)
    # gathers of several parameters at once (:mod:`.bucket_collectives`)
    rank = {p: k for k, p in enumerate(params)}
    for ag in gm.graph.find_nodes(op="call_function", target=AG):
        if ag not in out:
            found = _bucket_chain(ag, rank)
            if found is not None:
                p, chain = found
                out[ag] = (_layer_of(fqn_of.get(p.name, p.name)), chain)
    return out


def _bucket_chain(ag: fx.Node, rank: dict[fx.Node, int]) -> tuple[fx.Node, list[fx.Node]] | None:
    """(first parameter, chain) when ``ag`` gathers data of parameters only
    (its input made from parameter placeholders by casts and layout ops);
    the chain is those ops, ``ag`` and the layout ops after its wait."""
    from .recompute_all_gathers import is_chain_op

    chain: set[fx.Node] = set()
    roots: set[fx.Node] = set()
    stack = list(ag.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in chain or n in roots:
            continue
        if n.op == "placeholder":
            if n not in rank:
                return None
            roots.add(n)
            continue
        if not is_chain_op(n) or n.target in STARTS or n.target is WAIT:
            return None
        chain.add(n)
        stack.extend(n.all_input_nodes)
    if not roots:
        return None
    chain.add(ag)
    stack = [ag]
    while stack:  # the wait and the layout ops after it
        for u in stack.pop().users:
            if (
                u not in chain
                and is_chain_op(u)
                and u.target not in STARTS
                and all(a in chain for a in u.all_input_nodes)
            ):
                chain.add(u)
                stack.append(u)
    return min(roots, key=rank.__getitem__), list(chain)


def deferred_chain_ops(ag_layer: dict, info: Info) -> set[fx.Node]:
    """Each gather, its ancestors in its chain, and the chain ops that view
    its result."""
    out: set[fx.Node] = set()
    root, ins = info.root, info.ins
    for ag, (_, chain) in ag_layer.items():
        members = set(chain)
        stack = [ag]
        while stack:
            n = stack.pop()
            if n in out:
                continue
            out.add(n)
            stack.extend(a for a in ins[n] if a in members)
        out.update(c for c in chain if root.get(c) is ag)
    return out


# ops that only lay data out for a collective besides the chain ops of
# :func:`.recompute_all_gathers.is_chain_op`: a bucket's flattening
_LAYOUT_TARGETS = frozenset((torch.ops.aten._unsafe_view.default, torch.ops.aten._chunk_cat.default))


def is_layout_op(node: fx.Node) -> bool:
    """A collective, wait, view, copy or cast: an op that moves data
    without computing with it (what lies between two stages of a
    parameter's redistribution)."""
    from .recompute_all_gathers import is_chain_op

    return node.op == "call_function" and (node.target in _LAYOUT_TARGETS or is_chain_op(node))


def first_use(ag: fx.Node, chain: set[fx.Node], index: dict[fx.Node, int]) -> int:
    """Where the graph first computes with what ``ag`` gathers: the earliest
    consumer, following the chain and then the ops that only move, view or
    redistribute the data (a second gather over another mesh dim, an
    all-to-all, a bucket's copy-out), that does neither; ``ag``'s own place
    when nothing does. A layer's norm weights gathered in a preamble that
    casts every parameter are first used in the layer, not the preamble."""
    best, stack, seen = None, [ag], {ag}
    while stack:
        for u in stack.pop().users:
            if u in seen:
                continue
            seen.add(u)
            if u in chain or is_layout_op(u):
                stack.append(u)
            elif best is None or index[u] < best:
                best = index[u]
    return index[ag] if best is None else best


def chain_users(ag: fx.Node, chain: set[fx.Node]) -> list[fx.Node]:
    """Consumers outside ``chain`` of ``ag`` and the chain ops after it."""
    out, stack, seen = [], [ag], {ag}
    while stack:
        for u in stack.pop().users:
            if u in seen:
                continue
            seen.add(u)
            if u in chain:
                stack.append(u)
            else:
                out.append(u)
    return out
