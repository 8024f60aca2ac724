"""Find structurally identical layers (transformer blocks) in the joint graph.

Nodes are grouped by the first numbered component of their module path
(``layers.3.attention.wq`` -> group ``("layers", 3)``); parameters by their
FQN. Two groups with the same prefix are *repeats* when their nodes, in graph
order, have the same op, the same output shape/dtype and the same argument
structure (in-group producers referenced by position, parameters by their
FQN inside the layer). Each node of a repeat is then paired with the node at
the same position in the first group, so the solver can link their decisions.
Wholly identical layers link node for node. A layer with no identical twin
(the first block of a T5 stack alone computes the relative position bias
that later blocks receive as an input; the first layer of a stack may compute
no gradient for a model input that needs none) is *aligned* with its stack's
reference layer instead, when it is a variant of that layer (the parameters
of one are a subset of the other's: T5's block 0 has one more, the
position bias's embedding; LLaMA-MoE's dense and MoE layers are different
layers): the longest matching runs of nodes (same op, output
shape/dtype, parameter names and argument shapes; :mod:`difflib`), less the
nodes whose argument's producer is aligned with another node than their
twin's argument's producer. The aligned nodes link; the rest (the bias and
its gradient) stay free decisions. A layer aligned on
less than :data:`MIN_ALIGNED_FRACTION` of its nodes stays unlinked: those are
different layers (a Sequential's conv and norm), not variants of one.
Unlinked and partly linked layers are logged with their counts.

Autograd's gradient accumulations (the ``add`` summing the residual stream's
gradient with a block's input gradient) run outside any module's forward and
carry no module path. Left out, they are ~11 unlinked decisions per
transformer layer between linked ones, which keeps the ILP growing with the
number of layers (32 layers: 486 instead of ~160 decisions after presolve).
So a node without a module path joins the layer of its producers: the one
layer that its producers with a module path (or layer parameters) belong
to. Producers that only joined a layer this way count only when no producer
has a module path: an accumulation ``add(grad so far, this layer's part)``
belongs to this layer, not to the one that produced the gradient so far.
"""

from __future__ import annotations

import difflib
import logging
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx

from .tracing import TracedStep, module_path

logger = logging.getLogger(__name__)

# A layer without an identical twin is partly linked when at least this
# fraction of its nodes aligns with its stack's reference layer.
MIN_ALIGNED_FRACTION = 0.5


def layer_of(path: str | None) -> tuple[tuple[str, int], str] | None:
    """``"layers.3.attention.wq"`` -> ``(("layers", 3), "attention.wq")``."""
    if not path:
        return None
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return (".".join(parts[:i]), int(part)), ".".join(parts[i + 1 :])
    return None


@dataclass
class RepeatedLayers:
    # (prefix, index) -> nodes of that layer in graph order
    groups: dict[tuple[str, int], list[torch.fx.Node]] = field(default_factory=dict)
    # node -> its twin in the reference layer (same position, or aligned: ``partial``)
    reference: dict[torch.fx.Node, torch.fx.Node] = field(default_factory=dict)
    # layers whose structure no other layer shares and that align with no
    # reference layer (not linked)
    mismatched: list[tuple[str, int]] = field(default_factory=list)
    # layer -> (reference layer, nodes linked, nodes left free) of layers
    # with no identical twin, linked where they align with the reference
    partial: dict[tuple[str, int], tuple[tuple[str, int], int, int]] = field(default_factory=dict)
    # node -> its group (the inverse of ``groups``)
    group_of: dict[torch.fx.Node, tuple[str, int]] = field(default_factory=dict)

    def layer_name(self, node: torch.fx.Node) -> str | None:
        """``"layers.3"`` for a node of group ``("layers", 3)``, else None."""
        key = self.group_of.get(node)
        return None if key is None else f"{key[0]}.{key[1]}"


def find_repeated_layers(traced: TracedStep) -> RepeatedLayers:
    groups: dict[tuple[str, int], list[torch.fx.Node]] = defaultdict(list)
    local_name: dict[torch.fx.Node, str] = {}
    param_of_node = {n: fqn for fqn, n in traced.param_nodes.items()}
    param_of_node.update({n: fqn for fqn, n in traced.buffer_nodes.items()})
    group_of: dict[torch.fx.Node, tuple[str, int]] = {}
    inherited: set[torch.fx.Node] = set()  # nodes placed by _producers_layer
    for node in traced.gm.graph.nodes:
        if node.op == "placeholder":
            fqn = param_of_node.get(node)
            found = layer_of(fqn) if fqn else None
            if found is None:
                continue
            key, rest = found
            local_name[node] = "param:" + rest
        elif node.op == "call_function":
            path = module_path(node)
            if path is None:
                key = _producers_layer(node, group_of, inherited)
                if key is None:
                    continue
                inherited.add(node)
            else:
                found = layer_of(path)
                if found is None:
                    continue
                key = found[0]
        else:
            continue
        groups[key].append(node)
        group_of[node] = key

    result = RepeatedLayers(groups=dict(groups), group_of=group_of)
    by_prefix: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for key in groups:
        by_prefix[key[0]].append(key)
    for prefix, keys in by_prefix.items():
        keys.sort(key=lambda k: k[1])
        # Layers can differ at the edges of the stack (the first layer computes
        # no gradient for a model input that needs none), so link each layer
        # to the first layer of identical structure, not just to layer 0.
        buckets: dict[tuple, list[tuple[str, int]]] = defaultdict(list)
        for key in keys:
            buckets[tuple(_signatures(groups[key], local_name))].append(key)
        alone = []
        for same in buckets.values():
            if len(same) < 2:
                alone.append(same[0])
                continue
            for key in same[1:]:
                for node, ref in zip(groups[key], groups[same[0]]):
                    result.reference[node] = ref
        if not alone:
            continue
        # The reference a lone layer aligns with: the first layer of the
        # largest identical set, or with none, the lone layer with the most
        # nodes (T5 with two blocks: block 0, which block 1 is a part of).
        largest = max(buckets.values(), key=len)
        anchor = largest[0] if len(largest) > 1 else max(alone, key=lambda k: (len(groups[k]), -k[1]))
        anchor_params = _param_names(groups[anchor], local_name)
        for key in alone:
            if key == anchor:
                continue
            params = _param_names(groups[key], local_name)
            if not (params <= anchor_params or anchor_params <= params):
                # another kind of layer (LLaMA-MoE's dense layer 0 and MoE
                # layer 1), not a variant of one: linking their common
                # parts (attention) would only constrain the plan
                result.mismatched.append(key)
                continue
            pairs = _align(groups[key], groups[anchor], local_name)
            if len(pairs) < MIN_ALIGNED_FRACTION * len(groups[key]):
                result.mismatched.append(key)
                continue
            result.reference.update(pairs)
            result.partial[key] = (anchor, len(pairs), len(groups[key]) - len(pairs))
        if anchor in alone and not any(ref == anchor for ref, _, _ in result.partial.values()):
            result.mismatched.append(anchor)
    if result.partial:
        logger.info(
            "layers partly linked (no identical layer; aligned with a reference layer): %s",
            ", ".join(
                f"{p}.{i} -> {ref[0]}.{ref[1]} ({n} nodes linked, {free} free)"
                for (p, i), (ref, n, free) in result.partial.items()
            ),
        )
    if result.mismatched:
        logger.info(
            "layers not linked (no other layer of the stack has the same ops, shapes and "
            "arguments, and none aligns on %.0f%% of its nodes): %s",
            100 * MIN_ALIGNED_FRACTION,
            [f"{prefix}.{i}" for prefix, i in result.mismatched],
        )
    logger.info(
        "repeated layers: %d groups, %d nodes linked to a reference layer",
        len(groups),
        len(result.reference),
    )
    return result


def _producers_layer(node: torch.fx.Node, group_of: dict, inherited: set) -> tuple[str, int] | None:
    """The one layer of the node's producers (see the module docstring)."""
    producers = [a for a in node.all_input_nodes if a in group_of]
    keys = {group_of[a] for a in producers if a not in inherited}
    if not keys:
        keys = {group_of[a] for a in producers}
    return keys.pop() if len(keys) == 1 else None


def _align(
    nodes: list[torch.fx.Node], ref_nodes: list[torch.fx.Node], local_name: dict
) -> dict[torch.fx.Node, torch.fx.Node]:
    """Node -> its twin in ``ref_nodes``: difflib's matching runs over
    signatures that name in-layer producers by shape only, kept (in graph
    order, so producers are decided first) unless an argument's producer is
    aligned with another node than the twin's argument's producer."""
    sigs = _signatures(nodes, local_name, by_shape=True)
    ref_sigs = _signatures(ref_nodes, local_name, by_shape=True)
    matcher = difflib.SequenceMatcher(None, sigs, ref_sigs, autojunk=False)
    candidate = {}
    for i, j, n in matcher.get_matching_blocks():
        for k in range(n):
            candidate[nodes[i + k]] = ref_nodes[j + k]
    twin: dict[torch.fx.Node, torch.fx.Node] = {}
    twin_of: dict[torch.fx.Node, torch.fx.Node] = {}  # the inverse
    for node in nodes:
        ref = candidate.get(node)
        if ref is None:
            continue
        ins, ref_ins = _node_args(node), _node_args(ref)
        # An argument may come from different places (T5's block 1 reads the
        # position bias block 0 computes): only a contradiction rejects,
        # an argument whose producer is aligned with another node.
        if len(ins) == len(ref_ins) and all(
            twin.get(a, b) is b and twin_of.get(b, a) is a for a, b in zip(ins, ref_ins)
        ):
            twin[node], twin_of[ref] = ref, node
    return twin


def _param_names(nodes: list[torch.fx.Node], local_name: dict) -> set[str]:
    """The layer's parameters and buffers, by their name inside the layer."""
    return {local_name[n] for n in nodes if n in local_name}


def _node_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The node's node arguments in argument order (positional, then keyword)."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def _val_sig(val):
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), val.dtype)
    if isinstance(val, (tuple, list)):
        return tuple(_val_sig(v) for v in val)
    return type(val).__name__


def _signatures(nodes: list[torch.fx.Node], local_name: dict, by_shape: bool = False) -> list:
    """Per node: op, output shape/dtype and arguments, in-layer producers by
    position (``by_shape``: by shape only, for :func:`_align`)."""
    position = {n: i for i, n in enumerate(nodes)}

    def arg_sig(a):
        if isinstance(a, torch.fx.Node):
            if a in position and not by_shape:
                return ("in", position[a])
            if a in local_name:
                return ("p", local_name[a])
            return ("ext", _val_sig(a.meta.get("val")))
        if isinstance(a, (list, tuple)):
            return tuple(arg_sig(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, arg_sig(v)) for k, v in a.items()))
        return repr(a)

    sigs = []
    for n in nodes:
        if n.op == "placeholder":
            sigs.append(("placeholder", local_name.get(n), _val_sig(n.meta.get("val"))))
        else:
            sigs.append((str(n.target), _val_sig(n.meta.get("val")), arg_sig(n.args), arg_sig(n.kwargs)))
    return sigs
