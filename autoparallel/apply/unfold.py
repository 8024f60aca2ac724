"""Unfold: the full forward and backward graphs from the folded ones.

:mod:`.fold` applies a plan to layers ``0, 1, L-2, L-1`` of a stack; this
module copies layer 1's nodes back in for layers ``2 .. L-3`` after the
partitioner has split the folded graph, so the expensive stages run on four
layers and the result is the graph a full apply would give (same ops per
layer, same collectives, same saved tensors per layer).

Every node of the folded local graph carries ``meta[FOLD_KEY] = (short
layer, key)`` (:func:`stamp`), where the key names the node within its layer
(its joint node's position in the layer and its index among the local nodes
made for that joint node), so twins in different layers share a key. The
partitioner copies node meta, so forward and backward nodes (recomputed ones
included) keep their stamps.

Before copying, :func:`check_shift` proves that layer 1 is a template:
layer ``L-2``'s nodes are layer 1's, one layer further (same ops and
constants, inputs at the same keys one layer up, the same saved tensors).
Nodes computed from graph-wide values only (mesh coordinates, factories)
are not per layer: the partitioner's common-subexpression elimination may
have shared them between layers, and the copies share them too.

A node of layer 1 copied as real layer ``r`` reads, for an input of short
layer ``s`` (the node's own being 1), the node with the same key in real
layer ``r + s - 1``. Each run of consecutive layer-1 nodes is repeated in
place, once per copy, in increasing ``r`` where layer 1 reads the layer
below, decreasing where it reads the layer above (gradients flow down);
:func:`unfolded_order` has the rules. Saved tensors and backward inputs
follow the order PyTorch's partitioner gives a full graph.
"""

from __future__ import annotations

import copy as _copy
import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from .node_templates import insert_like
from .fold import FIRST, LAST, MIDDLE, NEXT, FoldRejected, LayerFold, arg_pairs
from .partition import StepGraphs, output_nodes
from ..graph_vocab import FOLD_KEY, SOURCE_KEY

if TYPE_CHECKING:
    from .local_graph import LocalJoint

logger = logging.getLogger(__name__)


Tag = tuple  # (short layer, key)


def stamp(gm: fx.GraphModule, fold: LayerFold, param_fqns: list[str]) -> None:
    """Set ``meta[FOLD_KEY]`` on the folded local joint graph's nodes."""
    slot = fold.slot
    param_slot = {}
    for fqn in param_fqns:
        joint = fold.traced.param_nodes[fqn]
        if joint.name in slot:
            param_slot[fqn] = slot[joint.name]
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for ph, fqn in zip(placeholders, param_fqns):
        s = param_slot.get(fqn)
        if s is not None:
            ph.meta[FOLD_KEY] = (s[0], (s[1], 0))
    count: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        src = n.meta.get(SOURCE_KEY)
        s = slot.get(src) if src is not None else None
        if s is None:
            continue
        k = count.get(src, 0)
        count[src] = k + 1
        n.meta[FOLD_KEY] = (s[0], (s[1], k))


def _is_random(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def layer_tags(
    graph: fx.Graph,
    placeholder_tags: dict[fx.Node, Tag | None] | None = None,
    *,
    outputs_per_layer: bool = True,
) -> dict[fx.Node, Tag | None]:
    """Effective tag of every node: its stamp, or None (global) when it only
    reads global values and is not random. With ``outputs_per_layer`` graph
    outputs keep their stamps (gradients: each parameter gets its own
    tensor); a forward graph's saved tensors may be global (saved once)."""
    (output,) = graph.find_nodes(op="output")
    outputs = set(output.all_input_nodes) if outputs_per_layer else set()
    tags: dict[fx.Node, Tag | None] = {}
    for n in graph.nodes:
        if n.op == "output":
            continue
        if n.op == "placeholder":
            tags[n] = placeholder_tags.get(n) if placeholder_tags is not None else n.meta.get(FOLD_KEY)
            continue
        tag = n.meta.get(FOLD_KEY)
        if tag is not None and n not in outputs and not _is_random(n):
            if all(tags[a] is None for a in n.all_input_nodes):
                tag = None
        tags[n] = tag
    return tags


def check_shift(graph: fx.Graph, tags: dict[fx.Node, Tag | None], what: str) -> None:
    """Raise :class:`FoldRejected` unless layer 1 is a template of layers
    ``1 .. L-3`` in ``graph`` (see the module docstring)."""
    by_layer: dict[int, dict] = {MIDDLE: {}, NEXT: {}}
    for n, t in tags.items():
        if t is None:
            continue
        layer = by_layer.get(t[0])
        if layer is not None:
            if t[1] in layer:
                raise FoldRejected(f"{what}: {n.name} and {layer[t[1]].name} share the key {t[1]}")
            layer[t[1]] = n
    middle, nxt = by_layer[MIDDLE], by_layer[NEXT]
    if middle.keys() != nxt.keys():
        only = sorted(set(middle) ^ set(nxt))[:3]
        raise FoldRejected(f"{what}: layers 1 and L-2 differ ({len(middle)} vs {len(nxt)} nodes; e.g. keys {only})")
    same_global: dict[tuple[fx.Node, fx.Node], bool] = {}

    def equivalent_global(a: fx.Node, b: fx.Node) -> bool:
        # global values the two layers read: the same node, or the same
        # computation on the same global inputs
        if a is b:
            return True
        if a.op != "call_function" or a.target != b.target or a.meta.get(FOLD_KEY) is None:
            return False
        ta, tb = a.meta[FOLD_KEY], b.meta[FOLD_KEY]
        if ta[1] != tb[1]:
            return False
        memo = same_global.get((a, b))
        if memo is None:
            try:
                memo = all(
                    tags[x] is None and tags[y] is None and equivalent_global(x, y)
                    for x, y in arg_pairs((a.args, a.kwargs), (b.args, b.kwargs), what)
                )
            except FoldRejected:
                memo = False
            same_global[(a, b)] = memo
        return memo

    for key, n2 in nxt.items():
        n1 = middle[key]
        where = f"{what}: {n2.name} (layer L-2) vs {n1.name} (layer 1)"
        if n1.op != n2.op or (n1.op != "placeholder" and n1.target != n2.target):
            raise FoldRejected(f"{where}: different ops")
        for a2, a1 in arg_pairs((n2.args, n2.kwargs), (n1.args, n1.kwargs), where):
            t2, t1 = tags[a2], tags[a1]
            if t2 is None or t1 is None:
                if not (t2 is None and t1 is None and equivalent_global(a2, a1)):
                    raise FoldRejected(f"{where}: reads {a2.name} where layer 1 reads {a1.name}")
                continue
            if t2[0] == LAST:
                # layer L-1 may differ: layer 1 must read layer L-2 there,
                # something every middle copy has
                ok = t1[0] == NEXT and t1[1] in middle
            else:
                ok = t1 == (t2[0] - 1, t2[1])
            if not ok:
                raise FoldRejected(f"{where}: reads {a2.name} {t2} where layer 1 reads {a1.name} {t1}")
    # reads that skip a layer, or global values made from one middle copy
    for n, t in tags.items():
        for a in n.all_input_nodes:
            ta = tags[a]
            if ta is None:
                continue
            if t is None:
                if ta[0] == MIDDLE:
                    raise FoldRejected(f"{what}: {n.name} (not in a layer) reads {a.name} of layer 1")
            elif abs(ta[0] - t[0]) > 1:
                raise FoldRejected(f"{what}: {n.name} (short layer {t[0]}) reads {a.name} (short layer {ta[0]})")
            elif t[0] == MIDDLE and ta[0] != MIDDLE and ta[1] not in middle:
                raise FoldRejected(f"{what}: {n.name} of layer 1 reads {a.name}, which has no layer-1 twin")


class _Emitter:
    """Builds one unfolded graph node by node."""

    def __init__(self, fold: LayerFold, tags: dict[fx.Node, Tag | None]):
        self.fold = fold
        self.tags = tags
        self.graph = fx.Graph()
        self.real = fold.real_layers
        self.by_key: dict[tuple[int, tuple], fx.Node] = {}  # (real layer, key) -> new node
        self.globals: dict[fx.Node, fx.Node] = {}

    def real_layer(self, n: fx.Node, copy: int | None) -> int | None:
        t = self.tags[n]
        if t is None:
            return None
        return copy if t[0] == MIDDLE else self.real[t[0]]

    def lookup(self, a: fx.Node, real: int | None) -> fx.Node:
        t = self.tags[a]
        if t is None:
            return self.globals[a]
        got = self.by_key.get((real, t[1]))
        if got is None:
            raise FoldRejected(f"no copy of {a.name} (key {t[1]}) in layer {real}")
        return got

    def read(self, n: fx.Node, copy: int | None):
        """Argument mapper for a copy of ``n`` as real layer ``copy`` (or its own)."""
        tn = self.tags[n]
        r = self.real_layer(n, copy)

        def arg(a: fx.Node) -> fx.Node:
            ta = self.tags[a]
            if ta is None:
                return self.globals[a]
            if tn is None:
                return self.lookup(a, self.real[ta[0]] if ta[0] != MIDDLE else None)
            return self.lookup(a, r + ta[0] - tn[0])

        return arg

    def record(self, n: fx.Node, copy: int | None, new: fx.Node) -> None:
        t = self.tags[n]
        if t is None:
            self.globals[n] = new
        else:
            self.by_key[(self.real_layer(n, copy), t[1])] = new

    def name(self, n: fx.Node, copy: int | None) -> str:
        if copy is None or copy == 1 or self.tags[n] is None or self.tags[n][0] != MIDDLE:
            return n.name
        return f"{n.name}_l{copy}"

    def emit(self, n: fx.Node, copy: int | None = None) -> fx.Node:
        read = self.read(n, copy)
        args = fx.node.map_arg(n.args, read)
        kwargs = fx.node.map_arg(n.kwargs, read)
        new = insert_like(self.graph, n, args, kwargs, self.name(n, copy))
        new.meta = _copy.copy(n.meta)
        self.record(n, copy, new)
        return new

    def placeholder(self, n: fx.Node, copy: int | None, name: str) -> fx.Node:
        new = self.graph.placeholder(name, type_expr=n.type)
        new.meta = dict(n.meta)
        self.record(n, copy, new)
        return new


def _copies(fold: LayerFold) -> range:
    return range(1, fold.n_layers - 2)


def _runs(nodes: list[fx.Node], tags) -> list[tuple[str, list[fx.Node]]]:
    """Split the non-placeholder nodes, in order, into ("once", [node]) and
    ("run", nodes): a run is a maximal stretch of layer-1 nodes, with the
    global nodes between them, that a full graph holds once per layer."""
    out: list[tuple[str, list[fx.Node]]] = []
    i = 0
    while i < len(nodes):
        if not _is_middle(tags[nodes[i]]):
            out.append(("once", [nodes[i]]))
            i += 1
            continue
        j, last = i, i
        while j < len(nodes) and (_is_middle(tags[nodes[j]]) or tags[nodes[j]] is None):
            if _is_middle(tags[nodes[j]]):
                last = j
            j += 1
        out.append(("run", nodes[i : last + 1]))
        i = last + 1
    return out


def _neighbour_direction(runs, tags) -> dict[int, bool]:
    """Per run (by id): True when the layers around it go down (the nearest
    layer node before it is of layer L-2 or L-1 and the nearest after it of
    layer 0), False when they go up; absent when they do not say."""
    layer_at = [None] * len(runs)
    for i, (kind, nodes) in enumerate(runs):
        t = tags[nodes[0]]
        if kind == "once" and t is not None:
            layer_at[i] = t[0]
    out: dict[int, bool] = {}
    for i, (kind, nodes) in enumerate(runs):
        if kind != "run":
            continue
        before = next((layer_at[k] for k in range(i - 1, -1, -1) if layer_at[k] is not None), None)
        after = next((layer_at[k] for k in range(i + 1, len(runs)) if layer_at[k] is not None), None)
        if before == FIRST or after in (NEXT, LAST):
            out[id(nodes)] = False
        elif before in (NEXT, LAST) or after == FIRST:
            out[id(nodes)] = True
    return out


def _run_direction(run: list[fx.Node], tags, default_down: bool, what: str) -> bool:
    """Whether a run's copies go from the last middle layer down: they must
    when layer 1 reads values of the layer above that the run itself makes
    for the next copy (gradients flow down), must not when it reads such
    values of the layer below; else as the layers around the run go
    (``default_down``)."""
    # only reads whose layer-1 twin is in this run order its copies
    keys = {tags[n][1] for n in run if _is_middle(tags[n])}
    up = down = False
    for n in run:
        for a in n.all_input_nodes:
            ta = tags[a]
            if ta is None or a.op == "placeholder" or ta[1] not in keys:
                continue
            up |= ta[0] == FIRST
            down |= ta[0] == NEXT
    if up and down:
        raise FoldRejected(f"{what}: layer 1 ({run[0].name}...) reads computed values of both neighbouring layers")
    return down or (default_down and not up)


def unfolded_order(nodes: list[fx.Node], tags, copies: list[int], down: bool, what: str) -> list[tuple]:
    """(node, copy) in the unfolded graph's order: each run of layer-1 nodes
    (:func:`_runs`) once per middle layer, in place; upward, or downward
    (``down``: the backward graph) unless the run's reads or the layers
    around it say otherwise. Other nodes once (copy None); the global nodes
    inside a run go with the copy that comes first."""
    runs = _runs(nodes, tags)
    around = _neighbour_direction(runs, tags)
    out: list[tuple] = []
    for kind, run in runs:
        if kind == "once":
            out.append((run[0], None))
            continue
        order = list(reversed(copies)) if _run_direction(run, tags, around.get(id(run), down), what) else copies
        for k, r in enumerate(order):
            for n in run:
                if _is_middle(tags[n]):
                    out.append((n, r))
                elif k == 0:
                    out.append((n, None))
    return out


def unfold_graph(
    gm: fx.GraphModule,
    fold: LayerFold,
    tags: dict[fx.Node, Tag | None],
    placeholder_plan: list[tuple[fx.Node, int | None, str]],
    output_plan,
    what: str,
    down: bool,
) -> tuple[fx.GraphModule, list]:
    """Unfold ``gm`` (see the module docstring).

    ``placeholder_plan``: the unfolded graph's placeholders in order, as
    (folded placeholder, copy for layer-1 ones or None, name).
    ``output_plan(resolve)`` returns the unfolded output list, where
    ``resolve(node, copy)`` gives a folded node's copy (or the node itself).
    Nodes come in :func:`unfolded_order`."""
    em = _Emitter(fold, tags)
    for ph, copy, name in placeholder_plan:
        em.placeholder(ph, copy, name)
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    for n, copy in unfolded_order(body, tags, list(_copies(fold)), down, what):
        em.emit(n, copy)

    def resolve(n, copy=None):
        if n is None:
            return None
        t = tags[n]
        if t is None:
            return em.globals[n]
        return em.lookup(n, em.real_layer(n, copy))

    (out,) = gm.graph.find_nodes(op="output")
    outs = output_plan(resolve)
    em.graph.output(tuple(outs) if isinstance(out.args[0], tuple) else list(outs)).meta = dict(out.meta)
    em.graph._codegen = gm.graph._codegen
    with _use_lazy_graph_module(True):
        new = _make_graph_module(gm, em.graph)
    new.meta = dict(gm.meta)
    return new, outs


def _is_middle(tag: Tag | None) -> bool:
    return tag is not None and tag[0] == MIDDLE


def _joint_positions(joint: fx.GraphModule, fold: LayerFold, param_fqns: list[str], short_index: dict):
    """``position(node, copy)``: where the value of a forward node (by name)
    would sit in the unfolded joint graph (placeholders by full primal
    index, then nodes in :func:`unfolded_order`)."""
    tags = layer_tags(joint.graph)
    copies = list(_copies(fold))
    body = [n for n in joint.graph.nodes if n.op not in ("placeholder", "output")]
    position: dict[tuple[str, int | None], tuple[int, int]] = {}
    for i, (n, copy) in enumerate(unfolded_order(body, tags, copies, False, "joint graph")):
        position[(n.name, copy)] = (1, i)
        if copy is not None:  # a shared (global) use of a layer-1 value: its first copy
            first = position.get((n.name, None))
            position[(n.name, None)] = min(first, (1, i)) if first else (1, i)
    placeholders = list(joint.graph.find_nodes(op="placeholder"))
    n_short = len(short_index)
    for i, fqn in enumerate(param_fqns):
        real, rep = fold.param_layer.get(fqn, (None, fqn))
        ph = placeholders[short_index[rep]]
        position[(ph.name, real if _is_middle(tags[ph]) else None)] = (0, i)
    for t, ph in enumerate(placeholders[n_short:]):
        position[(ph.name, None)] = (0, len(param_fqns) + t)
    end = (2, 0)

    def lookup(node: fx.Node, copy: int | None) -> tuple[int, int]:
        return position.get((node.name, copy), position.get((node.name, None), end))

    return lookup


def unfold_step(graphs: StepGraphs, local: "LocalJoint", fold: LayerFold, param_fqns: list[str]) -> StepGraphs:
    """The full model's forward and backward graphs from the folded ones
    (``graphs``, partitioned from ``local``); ``param_fqns`` is the full
    model's parameter order. Raises :class:`FoldRejected` when layer 1 is
    not a template of the middle layers in either graph."""
    t0 = time.perf_counter()
    n_out = graphs.num_fwd_outputs
    short_index = {fqn: i for i, fqn in enumerate(local.param_fqns)}
    n_short = len(local.param_fqns)
    copies = _copies(fold)

    def param_source(fqn: str) -> tuple[int, int | None]:
        real, rep = fold.param_layer.get(fqn, (None, fqn))
        return short_index[rep], real

    joint_position = _joint_positions(local.gm, fold, param_fqns, short_index)

    # forward
    fw_tags = layer_tags(graphs.fw.graph, outputs_per_layer=False)
    check_shift(graphs.fw.graph, fw_tags, "forward graph")
    fw_ph = list(graphs.fw.graph.find_nodes(op="placeholder"))
    plan = []
    for i, fqn in enumerate(param_fqns):
        j, real = param_source(fqn)
        ph = fw_ph[j]
        middle = fw_tags[ph] is not None and fw_tags[ph][0] == MIDDLE
        plan.append((ph, real if middle else None, f"primals_{i + 1}"))
    for t, ph in enumerate(fw_ph[n_short:]):
        plan.append((ph, None, f"primals_{len(param_fqns) + t + 1}"))
    fw_outs = output_nodes(graphs.fw)
    saved = fw_outs[n_out:]
    saved_full: list[tuple[int, int | None]] = []

    def fw_output_plan(resolve):
        outs = []
        for o in fw_outs[:n_out]:
            if fw_tags.get(o) is not None and fw_tags[o][0] == MIDDLE:
                raise FoldRejected(f"forward output {o.name} is a layer-1 value")
            outs.append(resolve(o))
        # PyTorch's partitioner lists saved tensors in joint-graph order: so
        # do we, in the order the unfolded joint graph would have
        entries = [(j, copy) for j, s in enumerate(saved) for copy in (copies if _is_middle(fw_tags[s]) else (None,))]
        saved_full.extend(sorted(entries, key=lambda e: joint_position(saved[e[0]], e[1])))
        outs.extend(resolve(saved[j], copy) for j, copy in saved_full)
        return outs

    fw, fw_new_outs = unfold_graph(graphs.fw, fold, fw_tags, plan, fw_output_plan, "forward graph", down=False)
    saved_position = {key: n_out + k for k, key in enumerate(saved_full)}

    def saved_name(j: int, copy: int | None) -> str:
        return fw_new_outs[saved_position[(j, copy)]].name

    # backward: saved tensors arrive tagged like the forward values they are
    bw_ph = list(graphs.bw.graph.find_nodes(op="placeholder"))
    ph_tags = {}
    kinds = dict(zip(bw_ph, graphs.bw_inputs))
    saved_ph = {}
    for ph, (kind, j) in kinds.items():
        ph_tags[ph] = fw_tags[saved[j]] if kind == "saved" else None
        if kind == "saved":
            saved_ph[j] = ph
    # saved tensors first, in the forward's order (as the partitioner
    # does), then the tangents
    plan, bw_inputs = [], []
    for j, copy in saved_full:
        if j in saved_ph:
            plan.append((saved_ph[j], copy, saved_name(j, copy)))
            bw_inputs.append(("saved", saved_position[(j, copy)] - n_out))
    for ph, (kind, j) in kinds.items():
        if kind != "saved":
            plan.append((ph, None, ph.name))
            bw_inputs.append((kind, j))
    bw_tags = layer_tags(graphs.bw.graph, ph_tags)
    check_shift(graphs.bw.graph, bw_tags, "backward graph")
    bw_outs = output_nodes(graphs.bw)
    if len(bw_outs) != n_short:
        raise FoldRejected(f"backward graph returns {len(bw_outs)} values for {n_short} parameters")

    def bw_output_plan(resolve):
        outs = []
        for fqn in param_fqns:
            j, real = param_source(fqn)
            o = bw_outs[j]
            middle = o is not None and bw_tags[o] is not None and bw_tags[o][0] == MIDDLE
            outs.append(resolve(o, real if middle else None))
        return outs

    bw, _ = unfold_graph(graphs.bw, fold, bw_tags, plan, bw_output_plan, "backward graph", down=True)
    seconds = time.perf_counter() - t0
    logger.info(
        "unfolded %d layers: forward %d -> %d nodes, backward %d -> %d nodes, %d -> %d saved tensors in %.2fs",
        fold.n_layers,
        len(graphs.fw.graph.nodes),
        len(fw.graph.nodes),
        len(graphs.bw.graph.nodes),
        len(bw.graph.nodes),
        len(saved),
        len(saved_full),
        seconds,
    )
    return StepGraphs(fw, bw, n_out, len(saved_full), bw_inputs, graphs.partitioner, graphs.seconds + seconds)
