"""Which forward values the backward keeps, and in which layout: the
activation terms of the step's memory (:mod:`autoparallel.problem.memory_budget`).

:func:`saved_activation_nodes` estimates the min-cut partitioner's saved
set from the joint graph and the AC tags; :func:`redistributed_inputs`
moves a saved value to the layout its backward reader gets it in when the
collective between them is kept.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from .activation_checkpointing import forward_nodes, recomputes_op

__all__ = ["VIEW_OPS", "saved_activation_nodes", "saved_and_needed", "redistributed_inputs", "single_output", "nbytes"]

_RECOMPUTED = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)

VIEW_OPS = {
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.squeeze.dims,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.select.int,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.view_as_real.default,
    torch.ops.aten.view_as_complex.default,
}


def saved_activation_nodes(
    gm: torch.fx.GraphModule, param_chain: set[torch.fx.Node] = frozenset()
) -> list[torch.fx.Node]:
    """The saved forward values (see :func:`saved_and_needed`)."""
    return saved_and_needed(gm, param_chain)[0]


def saved_and_needed(
    gm: torch.fx.GraphModule, param_chain: set[torch.fx.Node] = frozenset()
) -> tuple[list[torch.fx.Node], set[torch.fx.Node]]:
    """Forward nodes whose outputs the backward keeps, estimated as PyTorch's
    min-cut partitioner chooses them.

    A forward value is needed by the backward when a backward node reads it,
    or reads a value recomputed from it. It is recomputed rather than kept
    when activation checkpointing tagged it ``PREFER_RECOMPUTE`` or
    ``MUST_RECOMPUTE``, or, untagged, when the partitioner may recompute it
    for free: a view, or an op on its recomputable list (pointwise and
    friends, ``torch._functorch.partitioners.get_default_op_list``) that no
    backward op must materialise (every backward reader fuses with it) and
    that is not a reduction (4x smaller than its inputs), the rules of its
    ``should_ban_recomputation``. A value tagged for recompute that a
    recomputed node of a later AC region reads is saved (the region
    boundary, its ``cleanup_recompute_tags``). What a recomputed value reads
    is needed in turn. Graph inputs (parameters, the batch) are held anyway and not
    counted; a multi-output op is counted through its ``getitem`` nodes.
    Nor are ``param_chain`` nodes (a parameter's casts and views in the
    forward): the apply stage recomputes a parameter's cast and all-gather
    for the backward (:mod:`autoparallel.passes.recompute_all_gathers`).

    The partitioner's cut is a min-cut over these candidates, so it may keep
    a different but equally large set (``a + b`` for ``a`` and ``b``); the
    estimate is checked against runs in tests/autoparallel/problem/test_memory_budget.py.
    """
    from torch._functorch.partitioners import get_default_op_list

    ops = get_default_op_list()
    fwd = forward_nodes(gm)

    def is_view(n: torch.fx.Node) -> bool:
        return n.op == "call_function" and (ops.is_view(n) or n.target in VIEW_OPS)

    def fusible(a: torch.fx.Node, b: torch.fx.Node) -> bool:
        return b.target is torch.ops.aten.cat.default or (ops.is_fusible(a) and ops.is_fusible(b))

    def materialized_in_backward(n: torch.fx.Node) -> bool:
        todo, seen = [n], {n}
        while todo:
            cur = todo.pop()
            for u in cur.users:
                if u not in fwd and u.op != "output" and not fusible(cur, u):
                    return True
                if is_view(u) and u not in seen:
                    seen.add(u)
                    todo.append(u)
        return False

    def region_output(n: torch.fx.Node) -> bool:
        # the partitioner's cleanup_recompute_tags: a recomputed value read
        # by a recomputed node of a later AC region (the next block's input)
        # is saved at the boundary
        region = n.meta.get("ac_graph_id")
        return region is not None and any(
            u.meta.get("recompute") in _RECOMPUTED and u.meta.get("ac_graph_id", region) > region for u in n.users
        )

    def recomputed(n: torch.fx.Node) -> bool:
        if n in param_chain:
            return True
        tag = n.meta.get("recompute")
        if tag in _RECOMPUTED:
            return not region_output(n)
        if tag == CheckpointPolicy.MUST_SAVE or n.op != "call_function":
            return False
        if n.target is operator.getitem:
            return recomputed(n.args[0])
        if is_view(n):
            return True
        if not ops.is_recomputable(n) or materialized_in_backward(n):
            return False
        return 4 * nbytes(n) >= sum(nbytes(a) for a in n.args if isinstance(a, torch.fx.Node))

    needed: set[torch.fx.Node] = set()
    # the graph's output node returns the forward's results (held by the
    # caller, not saved) beside the gradients: not a backward reader
    stack = [a for n in gm.graph.nodes if n not in fwd and n.op != "output" for a in n.all_input_nodes if a in fwd]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        if recomputed(n):
            stack.extend(a for a in n.all_input_nodes if a in fwd)
    saved = [
        n
        for n in gm.graph.nodes  # graph order
        if n in needed and n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor) and not recomputed(n)
    ]
    return saved, {n for n in needed if n.op == "call_function" and recomputed(n) and not is_view(n)}


def nbytes(n: torch.fx.Node) -> int:
    val = n.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def redistributed_inputs(gm, strategies: dict, chain: set, remade: set, counted: set, terms: dict) -> dict[str, list]:
    """Lay saved values out as the backward reads them; returns the
    :attr:`StepMemoryModel.recomputed_inputs` of the terms it adds.

    The backward reads the inputs of the forward's matmuls (the partitioner's
    compute-intensive ops: for their weight gradients) and of the ops it
    recomputes (``remade``). An input that arrives in another layout than it
    was produced gets it through a collective the apply stage adds; outside
    an AC region that recomputes it (:func:`_regathers`) the partitioner
    keeps the redistributed tensor, not the value as produced. A local
    slice (the reader takes it more sharded, each rank a part of what it
    has) is recomputed like a view. Per activation, at its
    first such reader in graph order:

    * when it is kept anyway (saved), its term moves to the reader's input,
      sharded as the reader's option needs it: its own layout when no
      collective is needed;
    * when it is recomputed itself, the reader's redistributed copy is kept
      and what recomputing it would have kept is not (its inputs, about its
      own size: tiny LLaMA-3 on 2 x 2 LocalTensorMode ranks keeps the same
      bytes when the residual is produced sequence-sharded and read
      batch-sharded, an all-to-all, as without the collective; the
      all-gather costs its gathered size less the shard). Per rank that is
      ``max(0, bytes / shard(input) - bytes / shard(output))``: zero when
      the layouts agree or the reader slices, the gathered size less its
      shard for an all-gather. (The term was ``+bytes / shard(input)``
      on the reader and ``-bytes / shard(output)`` on the producer, below
      zero for a slice: -7.3 GB of activations on a 70B plan.) The plan's
      estimate (:meth:`StepMemoryModel.estimate`) evaluates it at both
      placements. The ILP's resource rows weigh one option at a time, so
      the row charges ``max(0, bytes / shard(input) - bytes / F)`` on the
      reader's input alone, ``F`` the producer's largest shard factor over
      its options: never below the pair's value (``shard(output) <= F``),
      equal to it when the producer is as sharded as it can be, above it by
      ``bytes / max(shard(input), shard(output)) - bytes / F`` otherwise.
      No per-option split can be exact (both diagonals hold nothing more,
      the all-gather between them does); this one is tight where a budget
      binds (sharded activations), loose for replicated ones (tiny LLaMA-3,
      selective AC, cheapest plan: row 6.67 MB, estimate 1.89 MB, run 2.00 MB).
    """
    from torch._functorch.partitioners import get_default_op_list

    ops = get_default_op_list()
    views = VIEW_OPS | set(ops.view_ops)
    fwd = forward_nodes(gm)
    seen: set[torch.fx.Node] = set()
    recomputed_inputs: dict[str, list] = {}
    most_sharded: dict[int, int] = {}  # per option list, for _most_sharded
    for c in gm.graph.nodes:
        if c not in fwd or c.op != "call_function" or not (c in remade or ops.is_compute_intensive(c)):
            continue
        strat = strategies.get(c)
        if strat is None or strat.getitem_index is not None or _regathers(c):
            continue
        for k, v in enumerate(strat.inputs):
            p = v
            while p.op == "call_function" and p.target in views and isinstance(p.args[0], torch.fx.Node):
                p = p.args[0]
            if p in seen or p in chain or p.op != "call_function" or p not in strategies:
                continue
            seen.add(p)
            key = f"{c.name}:in:{k}"
            if p in counted:
                own = terms[p.name]
                del own["activations"]
                if not own:
                    del terms[p.name]
            elif single_output(strategies[p]) or strategies[p].getitem_index is not None:
                recomputed_inputs[key] = [p.name, _most_sharded(strategies[p], most_sharded)]
            else:
                continue
            # one value per reader input: the term is new
            terms[key] = {"activations": float(nbytes(p))}
    return recomputed_inputs


def _regathers(reader: torch.fx.Node) -> bool:
    """The collectives apply emits for ``reader``'s inputs are recomputed in
    the backward (its AC region's policy recomputes all-gathers and
    all-to-alls): what is kept is the value as produced, so its term stays
    on the producer. LLaMA-3 8B on 16 x 8 under selective AC: the backward
    re-gathers each layer's feed-forward input over tp; counting the
    gathered copy put the estimate at 7.54 GB against 4.20 GB saved. (A
    reduce-scatter, which the default policy saves, into a matmul input is
    not told apart: charged as produced.)"""
    return all(
        recomputes_op(reader, op)
        for op in (
            torch.ops._c10d_functional.all_gather_into_tensor.default,
            torch.ops._c10d_functional.all_to_all_single.default,
        )
    )


def _most_sharded(strat, cache: dict[int, int]) -> int:
    """The largest number of ways any option of ``strat`` splits its output,
    cached per option list (repeated layers share theirs)."""
    hit = cache.get(id(strat.options))
    if hit is None:
        factors: dict[tuple, int] = {}  # per distinct output placements
        for o in strat.options:
            spec = o.output_specs
            if spec.placements not in factors:
                factors[spec.placements] = math.prod(
                    spec.mesh.size(d) for d, pl in enumerate(spec.placements) if pl.is_shard()
                )
        hit = cache[id(strat.options)] = max(factors.values())
    return hit


def single_output(strat) -> bool:
    return bool(strat.options) and not isinstance(strat.options[0].output_specs, (tuple, list))
