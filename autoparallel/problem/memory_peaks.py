"""Where a training step's memory peaks beyond what it holds throughout.

A rank holds its parameters, gradients and optimizer state, and at the end
of the forward the activations saved for backward and the step's outputs
(:mod:`.memory_budget`). On top of those, three moments allocate more:

* the backward (:func:`backward_transients`): while a block's backward
  runs, the values it recomputes (activation checkpointing), the gradients
  of its activations and its ops' outputs are live beside everything saved.
  Which values are live together is read off the joint graph: each
  backward value lives from its op to its last reader, a value the backward
  recomputes from its first backward reader to its last, a parameter's
  gradient only as its op's output (the reduced gradient is counted with
  the parameter's state). The largest such live set (by replicated bytes)
  is the term; each of its values is sharded as its node's chosen layout.
* the caller's loss (:data:`CROSS_ENTROPY`): a language model's loss reads
  its logits in fp32 (``cross_entropy(logits.float(), labels)``); at the
  loss's backward the fp32 log-softmax, its gradient and the input's fp32
  gradient are live beside the logits themselves (3 fp32 copies of each
  floating output; the outputs term already counts the output and its
  incoming gradient).
* the optimizer's step (:func:`optimizer_step_bytes`): AdamW's ``foreach``
  implementation allocates an fp32 intermediate the size of the local
  parameters (the second moment's square root).

These moments do not overlap: the step's peak is the state plus the saved
activations and outputs plus the largest of the three.

Two saved tensors the joint graph does not show, both where a matmul's
output arrives Partial at its reader through a reduce-scatter the AC policy
saves: where the backward recomputes the reader, the reduced tensor is
kept (:func:`reduced_inputs`); where the matmul's output is itself saved,
the reduced tensor is kept instead of it (:func:`reduce_scattered_saves`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..capture.activation_checkpointing import forward_nodes, recomputes_op
from ..capture.saved_activations import VIEW_OPS, nbytes, single_output
from ..cost_model.comm import redistribute_steps
from ..cost_model.devices import H100
from ..options.placements import SpecLabels
from .param_memory import placement_tokens


@dataclass(frozen=True)
class LossSpec:
    """What the caller's loss holds beyond each floating output and its
    incoming gradient: ``fp32_copies`` fp32 tensors the output's size at
    the loss's peak, and its targets (``target_bytes`` per output row)
    through the step."""

    name: str = "cross-entropy in fp32"
    # the log-softmax (saved), its incoming gradient and the gradient of the
    # fp32 input, live together in the log-softmax's backward
    fp32_copies: int = 3
    # the targets per output row (int64 class indices), held by the caller
    target_bytes: int = 8
    # the loss value (an fp32 scalar)
    value_bytes: int = 4


CROSS_ENTROPY = LossSpec()
NO_LOSS = LossSpec("none", 0, 0, 0)

# AdamW (foreach, torch.optim.adam._multi_tensor_adam): fp32 intermediates
# per parameter element beyond its state: the second moment's square root
# (the moments and the parameter update in place)
ADAMW_FOREACH_INTERMEDIATES = 1


def _is_view(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target in VIEW_OPS


def backward_transients(
    gm: torch.fx.GraphModule,
    held: set[torch.fx.Node],
    remade: set[torch.fx.Node],
    grads: set[torch.fx.Node],
) -> list[torch.fx.Node]:
    """The largest set of values live together in the backward of the joint
    graph ``gm`` beyond ``held`` (saved activations, outputs, tangents:
    counted elsewhere), by replicated bytes.

    A backward value lives from its node to its last reader. A forward value
    the backward recomputes (``remade``) is made just before its first
    backward reader (after the recomputed values it reads, as the
    partitioner places recomputation) and lives to its last reader. A
    gradient in ``grads`` lives only at its node (then it is reduced and
    counted with its parameter). Views and graph inputs take no memory of
    their own. Returns the values of the largest live set, in backward order.

    Worked graphs: tests/autoparallel/problem/test_memory_peaks.py.
    """
    fwd = forward_nodes(gm)

    def base(n: torch.fx.Node) -> torch.fx.Node:
        while _is_view(n) and n.args and isinstance(n.args[0], torch.fx.Node):
            n = n.args[0]
        return n

    # the backward's order, each recomputed value made (after what it reads)
    # just before its first reader, as the partitioner places recomputation
    order: list[torch.fx.Node] = []
    made: set[torch.fx.Node] = set()

    def make(root: torch.fx.Node) -> None:
        stack = [(root, False)]
        while stack:
            n, ready = stack.pop()
            if n in made:
                continue
            if ready:
                made.add(n)
                order.append(n)
                continue
            stack.append((n, True))
            stack.extend((b, False) for b in map(base, n.all_input_nodes) if b in remade and b not in made)

    for n in gm.graph.nodes:
        if n in fwd or n.op == "output":
            continue
        for b in map(base, n.all_input_nodes):
            if b in remade:
                make(b)
        order.append(n)
    pos = {n: i for i, n in enumerate(order)}
    last: dict[torch.fx.Node, int] = {}
    for n in order:
        for a in n.all_input_nodes:
            b = base(a)
            last[b] = max(last.get(b, -1), pos[n])

    def counts(n: torch.fx.Node) -> bool:
        return (
            n.op == "call_function"
            and n not in held
            and not _is_view(n)
            and isinstance(n.meta.get("val"), torch.Tensor)
        )

    # (start, end) per transient value, in positions of ``order``
    spans: dict[torch.fx.Node, tuple[int, int]] = {}
    for n in order:
        if counts(n):
            spans[n] = (pos[n], pos[n] if n in grads else max(pos[n], last.get(n, pos[n])))
    if not spans:
        return []
    delta = [0] * (len(order) + 1)
    for n, (s, e) in spans.items():
        delta[s] += nbytes(n)
        delta[e + 1] -= nbytes(n)
    live, best, at = 0, -1, 0
    for i in range(len(order)):
        live += delta[i]
        if live > best:
            best, at = live, i
    return sorted((n for n, (s, e) in spans.items() if s <= at <= e), key=lambda n: pos.get(n, -1))


def optimizer_step_bytes(param_numel_local: float, intermediates: int = ADAMW_FOREACH_INTERMEDIATES) -> float:
    """fp32 intermediates of a ``foreach`` optimizer step over
    ``param_numel_local`` local parameter elements."""
    return 4.0 * intermediates * param_numel_local


def reduces(producer: str, reader: str) -> bool:
    """Whether a value laid out as ``producer`` (``format_specs`` notation)
    reaches a reader laid out as ``reader`` through a reduction (a
    reduce-scatter or an all-reduce): Partial on a mesh dim the reader does
    not take Partial.

    >>> reduces("S(0)P", "S(0)S(1)"), reduces("S(0)P", "S(0)P"), reduces("S(0)S(1)", "S(0)R")
    (True, False, False)
    """
    return any(
        a.startswith("P") and not b.startswith("P")
        for a, b in zip(placement_tokens(producer), placement_tokens(reader))
    )


def reduced_inputs(gm, strategies: dict, counted: set, remade: set, terms: dict) -> dict[str, str]:
    """Reader-input terms of the forward ops of a checkpointed region that
    the backward recomputes (``remade``) whose input comes from a matmul
    (through views) with a Partial option, through a reduction the region's
    policy saves (a selective policy keeps reduce-scatters): the
    partitioner keeps the reduced tensor for the recomputation. LLaMA-3 8B
    at 131072 tokens on dp 4 x 8 x tp 4 under selective AC: each layer's
    attention output, reduce-scattered into the residual add the backward
    recomputes. A reader the backward does not recompute (the block's last
    residual add, saved at the region's boundary) keeps nothing of its
    input (:func:`~autoparallel.apply.partition.drop_unread_saved`).
    Returns the keys' producers (see :attr:`StepMemoryModel.reduced_inputs`);
    the terms go into ``terms``."""
    from torch._functorch.partitioners import get_default_op_list

    ops = get_default_op_list()
    reduce_scatter = torch.ops._c10d_functional.reduce_scatter_tensor.default
    out: dict[str, str] = {}
    seen: set[torch.fx.Node] = set()
    fwd = forward_nodes(gm)
    for c in gm.graph.nodes:
        # a forward op of a checkpointed region whose policy saves reductions
        if c not in remade or c not in fwd or _is_view(c) or c.meta.get("recompute") is None:
            continue
        if recomputes_op(c, reduce_scatter):
            continue
        strat = strategies.get(c)
        if strat is None or strat.getitem_index is not None:
            continue
        for k, p in enumerate(strat.inputs):
            # the contraction (a matmul) makes the Partial value; the
            # reduction may sit on any edge of the views between
            producer = p
            while _is_view(producer) and isinstance(producer.args[0], torch.fx.Node):
                producer = producer.args[0]
            key = f"{c.name}:in:{k}"
            ps = strategies.get(producer)
            if key in terms or producer in seen or p in counted or producer in counted:
                continue
            if ps is None or not single_output(ps):
                continue
            if producer.op != "call_function" or not ops.is_compute_intensive(producer):
                continue
            if not any(pl.is_partial() for o in ps.options for pl in o.output_specs.placements):
                continue
            # one reduced copy per value (apply redistributes it once for all readers)
            seen.add(producer)
            terms[key] = {"activations": float(nbytes(p))}
            out[key] = producer.name
    return out


def reduce_scattered_saves(
    gm, strategies: dict, counted: set, remade: set, terms: dict, device=None
) -> tuple[dict[str, list[list]], dict[str, dict[str, int]]]:
    """Saved matmul outputs (output terms in ``terms``, with a Partial
    option) read (through views) by ops the backward
    recomputes (``remade``) in a checkpointed region whose policy saves
    reduce-scatters, and otherwise by backward ops or forward ones the
    backward does not need: where the plan reduce-scatters the Partial
    value on one edge of the views into every such reader alike (the
    redistribution apply runs there,
    :func:`~autoparallel.cost_model.comm.redistribute_steps` for ``device``,
    has a reduce-scatter and no all-gather or all-reduce, before any view
    that changes the size; apply redistributes a value once for all readers
    of one layout), the partitioner keeps the reduce-scattered tensor and
    not the Partial one.
    LLaMA-3 8B at 131072 tokens under selective AC: on dp 4 x 8 x tp 4 each
    layer's query projection, Partial over tp and reduce-scattered into the
    rotary embedding, 134 MB per rank counted, 34 MB saved; on
    dp 2 x 16 x tp 4 each layer's gate projection, reduce-scattered into the
    SiLU and its backward, 235 MB counted, 59 MB saved; LLaMA-3 70B on
    16 x 8, each layer's value projection, reduce-scattered before the
    grouped-query expand, 34 MB counted, 4 MB saved. Returns (producer
    key -> per reader, per edge from the producer through its views to the
    reader ``[the edge's source, its reader-input key, a table id]``; table
    id -> ``{"<source's placements>|<reader's input placements>": shard
    factor of the kept copy}``, the pairs that reduce-scatter) (see
    :attr:`StepMemoryModel.reduce_scattered`)."""
    from torch._functorch.partitioners import get_default_op_list

    ops = get_default_op_list()
    reduce_scatter = torch.ops._c10d_functional.reduce_scatter_tensor.default
    fwd = forward_nodes(gm)
    table_ids: dict[tuple, str] = {}
    tables: dict[str, dict[str, int]] = {}

    def edge(src: torch.fx.Node, dst: torch.fx.Node, size: int) -> list | None:
        ss, ds = strategies.get(src), strategies.get(dst)
        if ss is None or ds is None or ds.getitem_index is not None or not single_output(ss) or src not in ds.inputs:
            return None
        k = ds.inputs.index(src)
        # a view that changes the size (an expand) before the reduction:
        # not counted as reduced there
        key = (id(ss.options), id(ds.options), k, nbytes(src) == size)
        if key not in table_ids:
            table_ids[key] = str(len(table_ids))
            tables[table_ids[key]] = _reduce_scatter_table(ss, ds, k, device or H100) if key[3] else {}
        return [src.name, f"{dst.name}:in:{k}", table_ids[key]]

    out: dict[str, list[list]] = {}
    for p in gm.graph.nodes:
        if p not in counted or "activations" not in terms.get(p.name, {}) or not ops.is_compute_intensive(p):
            continue
        ps = strategies.get(p)
        if ps is None or not single_output(ps):
            continue
        if not any(pl.is_partial() for o in ps.options for pl in o.output_specs.placements):
            continue
        readers: list[list] = []
        recomputed = False
        for chain in _chains_through_views(p):
            r = chain[-1]
            backward = r not in fwd
            if not backward and r not in remade:
                continue  # read in the forward only
            ok = backward or (r.meta.get("recompute") is not None and not recomputes_op(r, reduce_scatter))
            edges = [edge(a, b, nbytes(p)) for a, b in zip(chain, chain[1:])] if ok else [None]
            if None in edges or not any(tables[e[2]] for e in edges):
                readers = []
                break
            recomputed |= not backward
            readers.append(edges)
        if recomputed and readers:
            out[p.name] = readers
    used = {e[2] for readers in out.values() for edges in readers for e in edges}
    return out, {t: tables[t] for t in sorted(used, key=int)}


def _reduce_scatter_table(src_strat, dst_strat, k: int, device) -> dict[str, int]:
    """Per pair of the source's output placements and the reader's ``k``-th
    input placements that apply turns into each other with reduce-scatters
    (and all-to-alls, local slices), the kept copy's shard factor
    (:func:`reduce_scattered_factor`)."""
    fmt = SpecLabels()
    values = {fmt(o.output_specs): o.output_specs for o in src_strat.options}
    reads = {fmt(o.input_specs[k]): o.input_specs[k] for o in dst_strat.options}
    table: dict[str, int] = {}
    for vl, vspec in values.items():
        if not any(pl.is_partial() for pl in vspec.placements) or vspec.tensor_meta is None:
            continue
        mesh_shape = list(vspec.mesh.shape)
        for rl, rspec in reads.items():
            factor = reduce_scattered_factor(vl, [rl], mesh_shape)
            if factor is None:
                continue
            kinds = [s.kind for s in redistribute_steps(vspec, rspec, device)]
            if any("reduce_scatter" in kd for kd in kinds) and not any(
                bad in kd for kd in kinds for bad in ("all_gather", "all_reduce", "forbidden")
            ):
                table[f"{vl}|{rl}"] = factor
    return table


def _chains_through_views(p: torch.fx.Node) -> list[list[torch.fx.Node]]:
    """``[p, its views..., reader]`` for every non-view user of ``p`` and
    of its views."""
    out, todo = [], [[p]]
    while todo:
        chain = todo.pop()
        for u in chain[-1].users:
            if _is_view(u) and u.args and u.args[0] is chain[-1]:
                todo.append([*chain, u])
            elif u.op != "output":
                out.append([*chain, u])
    return out


def reduce_scattered_factor(producer: str, readers: list[str], mesh_shape: list[int]) -> int | None:
    """The shard factor of what is kept of a saved value laid out as
    ``producer`` (``format_specs`` notation) that every reader (its
    ``readers`` layouts) takes through a reduce-scatter: every Partial mesh
    dim of the producer Shard in the reader (the reduce-scatter, saved) or
    Partial still, every sharded one sharded still (no all-gather; an
    all-to-all keeps the size). None where the readers differ or any needs
    more than that (an all-reduce, an all-gather) or none reduces: the value
    is kept as produced. A dim the producer replicates and the reader
    shards is a local slice, counted unsliced.

    >>> reduce_scattered_factor("S(0)S(1)P", ["S(0)S(2)S(2)"], [4, 8, 4])
    128
    >>> reduce_scattered_factor("S(0)S(1)P", ["S(0)S(2)R"], [4, 8, 4]) is None  # all-reduced
    True
    >>> reduce_scattered_factor("S(0)RP", ["S(0)S(1)S(1)"], [4, 8, 4])  # the slice over dim 1 not counted
    16
    """
    if not readers or len(set(readers)) > 1:
        return None
    factor, reduced = 1, False
    for size, a, b in zip(mesh_shape, placement_tokens(producer), placement_tokens(readers[0])):
        if a.startswith("P"):
            if b.startswith("S"):
                factor, reduced = factor * size, True
            elif not b.startswith("P"):
                return None
        elif a.startswith("S"):
            if not b.startswith("S"):
                return None
            factor *= size
    return factor if reduced else None
