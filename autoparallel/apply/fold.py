"""Layer folding: apply a plan to four transformer layers instead of all.

A deep model's layers are identical, and so is their rank-local code under
a plan whose repeated layers are linked (:mod:`autoparallel.capture.repeated_layers`).
Building the local joint graph and partitioning it costs time per node, so
for a stack of ``L`` layers apply works on a *folded* joint graph that keeps
only layers ``0, 1, L-2, L-1``: the first and last layers (their context
may differ: the embedding before, the head after) and two middle layers.
Layer 1 stands for all middle layers ``1 .. L-3``; layer ``L-2`` is kept so
that the folded graph can be checked: after partitioning, its nodes must be
exactly layer 1's, one layer further (:mod:`.unfold` checks this and then
copies layer 1's forward and backward nodes back in for layers ``2 .. L-3``).

The folded graph is built from the traced joint graph by dropping layers
``2 .. L-3``. The only edges into dropped layers come from their neighbours
(layer 1's backward reads layer 2's input gradient; layer ``L-2``'s forward
reads layer ``L-3``'s output), and they are re-pointed *by shift*: a node of
layer 1 that reads layer 2's node at position ``p`` reads layer ``L-2``'s
node at ``p`` instead, and layer ``L-2`` reads layer 1's. In the folded
graph, "the layer after 1" is ``L-2`` and "the layer before ``L-2``" is 1.

:func:`fold_layers` returns None (and logs why) when the model does not
qualify: fewer than ``MIN_LAYERS`` layers; middle layers that differ in
structure, plan or wiring from layer 1; an edge that skips a layer; a node
outside the stack that reads a dropped layer.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from ..capture.repeated_layers import RepeatedLayers
from ..options.strategies import NodeStrategy
from ..capture.tracing import TracedStep

logger = logging.getLogger(__name__)

# Folding keeps four layers; below this many there is little to gain.
MIN_LAYERS = 6

# Short (folded) layer index of the kept real layers 0, 1, L-2, L-1.
FIRST, MIDDLE, NEXT, LAST = 0, 1, 2, 3


class FoldRejected(Exception):
    """The model's layers cannot be folded (the message says why)."""


@dataclass
class LayerFold:
    """A folded training step and how it maps to the full one."""

    prefix: str  # module path of the layer stack, e.g. "layers"
    n_layers: int  # L
    traced: TracedStep  # the folded joint graph (layers 0, 1, L-2, L-1)
    strategies: dict[torch.fx.Node, NodeStrategy]  # its options (the plan's)
    # folded node name -> (short layer FIRST..LAST, position in its layer)
    slot: dict[str, tuple[int, int]]
    # full parameter FQN -> (real layer, FQN of the folded parameter that
    # stands for it); only for parameters of the stack
    param_layer: dict[str, tuple[int, str]]

    @property
    def real_layers(self) -> tuple[int, int, int, int]:
        """Real layer of each short layer: 0, 1, L-2, L-1."""
        return (0, 1, self.n_layers - 2, self.n_layers - 1)

    @property
    def middle_copies(self) -> int:
        """How many real layers short layer 1 stands for (1 .. L-3)."""
        return self.n_layers - 3

    def layer_fqn(self, fqn: str, real_layer: int) -> str:
        """``layers.1.attention.wq.weight`` -> ``layers.<real_layer>.attention.wq.weight``."""
        head = f"{self.prefix}.1."
        if not fqn.startswith(head):
            raise ValueError(f"{fqn} is not a parameter of layer {self.prefix}.1")
        return f"{self.prefix}.{real_layer}.{fqn[len(head) :]}"


def _stack(repeats: RepeatedLayers) -> tuple[str, int]:
    counts: dict[str, list[int]] = {}
    for prefix, index in repeats.groups:
        counts.setdefault(prefix, []).append(index)
    if not counts:
        raise FoldRejected("no repeated layers")
    prefix, indices = max(counts.items(), key=lambda kv: len(kv[1]))
    n = len(indices)
    if sorted(indices) != list(range(n)):
        raise FoldRejected(f"layers of {prefix!r} are not numbered 0..{n - 1}")
    if n < MIN_LAYERS:
        raise FoldRejected(f"{n} layers in {prefix!r} (folding needs {MIN_LAYERS})")
    return prefix, n


def arg_pairs(a, b, what: str):
    """Walk two argument structures in step; yield (a, b) node pairs; raise
    when their constants or structure differ."""
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
            raise FoldRejected(f"{what}: a node argument against a constant")
        yield a, b
    elif isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            raise FoldRejected(f"{what}: argument structure differs")
        for x, y in zip(a, b):
            yield from arg_pairs(x, y, what)
    elif isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            raise FoldRejected(f"{what}: keyword arguments differ")
        for k in a:
            yield from arg_pairs(a[k], b[k], what)
    elif type(a) is not type(b) or a != b:
        raise FoldRejected(f"{what}: constant argument {a!r} vs {b!r}")


def fold_layers(
    traced: TracedStep,
    strategies: dict[torch.fx.Node, NodeStrategy],
    choice: dict[str, int],
    repeats: RepeatedLayers,
) -> LayerFold:
    """The folded step of ``traced`` under the plan ``choice`` (see the
    module docstring); raises :class:`FoldRejected` when it does not apply."""
    prefix, n_layers = _stack(repeats)
    groups = [repeats.groups[(prefix, r)] for r in range(n_layers)]
    layer_of: dict[torch.fx.Node, int] = {}
    position: dict[torch.fx.Node, int] = {}
    for r, nodes in enumerate(groups):
        for p, n in enumerate(nodes):
            layer_of[n] = r
            position[n] = p
    middle = groups[1]
    # Middle layers 2 .. L-2 must be layer 1 shifted: same ops, plan,
    # constants, and inputs at the same positions one layer further.
    for r in range(2, n_layers - 1):
        nodes = groups[r]
        if len(nodes) != len(middle):
            raise FoldRejected(f"layer {prefix}.{r} has {len(nodes)} nodes, layer {prefix}.1 {len(middle)}")
        for n, m in zip(nodes, middle):
            what = f"{n.name} (layer {prefix}.{r}) vs {m.name} (layer {prefix}.1)"
            if n.op != m.op or (n.op != "placeholder" and n.target != m.target):
                raise FoldRejected(f"{what}: different ops")
            if n.op != "placeholder":
                sn, sm = strategies.get(n), strategies.get(m)
                if sn is None or sm is None or sn.options[choice[n.name]] != sm.options[choice[m.name]]:
                    raise FoldRejected(f"{what}: planned differently")
            for a, b in arg_pairs((n.args, n.kwargs), (m.args, m.kwargs), what):
                ra = layer_of.get(a)
                if ra is None:
                    if a is not b:
                        raise FoldRejected(f"{what}: reads {a.name} where layer 1 reads {b.name}")
                    continue
                d = ra - r
                if d not in (-1, 0, 1) or layer_of.get(b) != 1 + d:
                    raise FoldRejected(f"{what}: input {a.name} is not layer 1's input {b.name} shifted")
                # Layer L-1 may differ from the middle layers: what layer
                # L-2 reads of it is kept as is, not matched by position.
                if position[a] != position[b] and not (ra == n_layers - 1):
                    raise FoldRejected(f"{what}: input {a.name} is not layer 1's input {b.name} shifted")
    dropped = {n for r in range(2, n_layers - 2) for n in groups[r]}
    last_middle = n_layers - 2

    def standin(user: torch.fx.Node, a: torch.fx.Node) -> torch.fx.Node:
        """What a kept node reads in place of the dropped node ``a``."""
        ru, ra = layer_of.get(user), layer_of[a]
        if ru == 1 and ra == 2:
            return groups[last_middle][position[a]]
        if ru == last_middle and ra == last_middle - 1:
            return groups[1][position[a]]
        where = f"layer {prefix}.{ru}" if ru is not None else "outside the layers"
        raise FoldRejected(f"{user.name} ({where}) reads {a.name} of dropped layer {prefix}.{ra}")

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in traced.gm.graph.nodes:
        if node in dropped:
            continue
        if node.op == "output":
            break

        def remap(a, node=node):
            return env[standin(node, a) if a in dropped else a]

        new = graph.node_copy(node, remap)
        if new.name != node.name:
            raise RuntimeError(f"folded copy of {node.name} was renamed {new.name}")
        env[node] = new

    def kept(n: torch.fx.Node) -> torch.fx.Node:
        if n in dropped:
            raise FoldRejected(f"{n.name} of a dropped layer is a graph input or output")
        return env[n]

    param_nodes = {fqn: env[n] for fqn, n in traced.param_nodes.items() if n not in dropped}
    grads: dict[str, torch.fx.Node | None] = {}
    for fqn, g in traced.grad_nodes.items():
        if fqn in param_nodes:
            grads[fqn] = kept(g) if g is not None else None
        elif g is not None and g not in dropped:
            raise FoldRejected(f"the gradient of {fqn} (a dropped layer) is computed outside it")
    outputs = [kept(n) for n in traced.output_nodes]
    graph.output(tuple(outputs) + tuple(g for g in grads.values() if g is not None))
    with _use_lazy_graph_module(True):
        gm = _make_graph_module(traced.gm, graph)
    short = dataclasses.replace(
        traced,
        gm=gm,
        param_nodes=param_nodes,
        buffer_nodes={fqn: kept(n) for fqn, n in traced.buffer_nodes.items()},
        input_nodes=[kept(n) if n is not None else None for n in traced.input_nodes],
        output_nodes=outputs,
        tangent_nodes={k: kept(n) for k, n in traced.tangent_nodes.items()},
        grad_nodes=grads,
    )

    short_strategies: dict[torch.fx.Node, NodeStrategy] = {}
    for node, new in env.items():
        strat = strategies.get(node)
        if strat is None:
            continue
        inputs = [env[standin(node, p) if p in dropped else p] for p in strat.inputs]
        short_strategies[new] = dataclasses.replace(strat, node=new, inputs=inputs)

    short_of_real = {0: FIRST, 1: MIDDLE, n_layers - 2: NEXT, n_layers - 1: LAST}
    slot = {env[n].name: (short_of_real[layer_of[n]], position[n]) for n in env if n in layer_of}
    param_layer: dict[str, tuple[int, str]] = {}
    fqn_at = {(layer_of[n], position[n]): fqn for fqn, n in traced.param_nodes.items() if n in layer_of}
    for fqn, n in traced.param_nodes.items():
        r = layer_of.get(n)
        if r is None:
            continue
        if n in dropped:
            rep = fqn_at.get((1, position[n]))
            if rep is None:
                raise FoldRejected(f"parameter {fqn} has no counterpart in layer {prefix}.1")
            param_layer[fqn] = (r, rep)
        else:
            param_layer[fqn] = (r, fqn)
    logger.info(
        "folded %d layers of %r to 4: joint graph %d -> %d nodes",
        n_layers,
        prefix,
        len(traced.gm.graph.nodes),
        len(graph.nodes),
    )
    return LayerFold(prefix, n_layers, short, short_strategies, slot, param_layer)
