"""Apply stage 2: split the rank-local joint graph into forward and backward.

PyTorch's partitioners do the work: ``min_cut_rematerialization_partition``
(default; honours the ``recompute`` tags of selective/full AC, recomputes
cheap ops) or ``default_partition`` (saves what the backward needs, except
tagged recomputation). The forward graph returns the forward outputs and then
the saved tensors; the backward graph's placeholders are saved tensors (by
the name of the forward output that saves them) and tangents.
"""

from __future__ import annotations

import copy
import logging
import operator
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx
from torch._functorch.partitioners import default_partition, is_not_collective, min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module, _use_lazy_graph_module

from .local_graph import LocalJoint

logger = logging.getLogger(__name__)

Partitioner = Literal["min_cut", "default"]
# meta["custom"] key on forward nodes whose values the backward reads
SAVE_TAG = "ap_must_save"


@dataclass
class StepGraphs:
    """Forward and backward graphs of one rank-local training step."""

    fw: torch.fx.GraphModule
    bw: torch.fx.GraphModule
    num_fwd_outputs: int
    num_saved: int
    # Per backward input: ("saved", index into saved tensors) or ("tangent", k).
    bw_inputs: list[tuple[str, int]]
    partitioner: str
    seconds: float = 0.0


def output_nodes(gm: torch.fx.GraphModule) -> list:
    """The values ``gm``'s output node returns, in order."""
    (out,) = gm.graph.find_nodes(op="output")
    return list(out.args[0])


def split_joint(local: LocalJoint, partitioner: Partitioner = "min_cut") -> StepGraphs:
    """Partition ``local.gm`` (left untouched) into forward and backward."""
    t0 = time.perf_counter()
    fn = {"min_cut": min_cut_rematerialization_partition, "default": default_partition}.get(partitioner)
    if fn is None:
        raise ValueError(f"partitioner must be 'min_cut' or 'default', got {partitioner!r}")
    n_out = local.num_fwd_outputs
    # Lazy graph modules: the partitioner's intermediate modules (and the
    # passes' recompiles of the results) generate no Python code; forward
    # and backward get theirs once, on first call (or ``.code``).
    with _use_lazy_graph_module(True):
        joint = _copy_graph_module(local.gm)
        # Recomputed random ops make the partitioner build RNG-state inputs,
        # for which it looks up the ambient fake mode.
        with unset_fake_temporarily(), FakeTensorMode(allow_non_fake_inputs=True):
            fw, bw = fn(joint, None, num_fwd_outputs=n_out)
    # the partitioner builds some of its results as plain graph modules,
    # whose every recompile (one per pass) generates Python code
    fw, bw = _LazyGraphModule.from_graphmodule(fw), _LazyGraphModule.from_graphmodule(bw)
    drop_dead_collectives(fw, bw)
    _drop_needless_rng_states(fw, bw)
    drop_unread_saved(fw, bw, n_out)
    fw_outs = output_nodes(fw)
    saved = fw_outs[n_out:]
    for node in saved:
        if not isinstance(node, torch.fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
            raise NotImplementedError(f"forward saves a non-tensor value {node!r} (symbolic shapes?)")
    saved_index = {n.name: j for j, n in enumerate(saved)}
    _tag_saved(saved)
    bw_inputs: list[tuple[str, int]] = []
    tangent_names = [n.name for n in local.gm.graph.find_nodes(op="placeholder") if "tangents" in str(n.target)]
    # Random ops recomputed in the backward (e.g. SDPA under full AC) get their
    # RNG state saved by the forward: the partitioner appends those states to
    # the saved values and names the backward placeholders rng_state_output_<k>,
    # in the same order.
    rng_states = iter([j for j, n in enumerate(saved) if _is_saved_rng_state(n)])
    for ph in bw.graph.find_nodes(op="placeholder"):
        if ph.name.startswith("rng_state_output_"):
            j = next(rng_states, None)
            if j is None:
                raise RuntimeError(f"backward input {ph.name} has no RNG state saved by the forward")
            bw_inputs.append(("saved", j))
        elif ph.name in saved_index:
            bw_inputs.append(("saved", saved_index[ph.name]))
        elif ph.name in tangent_names:
            bw_inputs.append(("tangent", tangent_names.index(ph.name)))
        else:
            raise RuntimeError(f"backward input {ph.name} is neither saved by the forward nor a tangent")
    seconds = time.perf_counter() - t0
    logger.info(
        "partitioned (%s): forward %d nodes, backward %d nodes, %d saved tensors in %.2fs",
        partitioner,
        len(fw.graph.nodes),
        len(bw.graph.nodes),
        len(saved),
        seconds,
    )
    return StepGraphs(fw, bw, n_out, len(saved), bw_inputs, partitioner, seconds)


def _keep_if_dead(node: torch.fx.Node) -> bool:
    """DCE predicate: keep a user-less node only if it has a side effect other
    than being a functional collective (mutations, RNG, placeholders)."""
    return is_not_collective(node) and node.is_impure()


def drop_dead_collectives(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> None:
    """Remove the collectives (and the pure nodes around them) whose results
    nobody reads. The partitioners copy into each graph every node whose
    inputs it has, and their dead-code elimination keeps collectives
    (impure): the forward gets the backward's own gathers of a parameter
    (a weight re-laid out for a backward matmul, recomputed there from the
    shard), the backward the forward's. Dead, they would still run: a
    collective per layer on the link and its buffer at the forward's end.
    A multi-step gather's dead tail (wait -> split -> getitem -> cat) keeps
    each step alive, so dead collectives and dead pure nodes go together.
    Every rank runs the same graph: dropping a collective on all of them
    keeps them matched."""
    for gm in (fw, bw):
        gm.graph.eliminate_dead_code(is_impure_node=_keep_if_dead)
        gm.recompile()


def drop_unread_saved(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, num_fwd_outputs: int) -> None:
    """Stop saving the values the backward no longer reads. The partitioner
    drops a saved value its backward does not read, but a value read only
    by a recomputed collective the backward does not need stays saved until
    :func:`drop_dead_collectives` removes that reader: LLaMA-3 8B on 16 x 8
    under selective AC kept each layer's reduce-scattered feed-forward
    output (its residual add is saved; the all-to-all after the
    reduce-scatter was copied into the backward), 537 MB per rank."""
    unread = {ph.name: ph for ph in bw.graph.find_nodes(op="placeholder") if not ph.users}
    if not unread:
        return
    (out,) = fw.graph.find_nodes(op="output")
    outputs = list(out.args[0])
    saved = outputs[num_fwd_outputs:]
    dropped = {
        o.name for o in saved if isinstance(o, torch.fx.Node) and o.name in unread and not _is_saved_rng_state(o)
    }
    if not dropped:
        return
    out.args = (tuple(outputs[:num_fwd_outputs] + [o for o in saved if getattr(o, "name", None) not in dropped]),)
    for name in dropped:
        bw.graph.erase_node(unread[name])
    fw.graph.eliminate_dead_code(is_impure_node=_keep_if_dead)
    fw.recompile()
    bw.recompile()
    logger.debug("partition: %d saved values the backward does not read dropped", len(dropped))


def _dropout_free(op, args: tuple, kwargs: dict) -> bool:
    """True for a random-tagged op called with ``dropout_p == 0`` (attention
    without dropout): its result does not depend on the RNG."""
    names = [a.name for a in getattr(op, "_schema").arguments] if hasattr(op, "_schema") else []
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    p = args[i] if i < len(args) else kwargs.get("dropout_p", 0.0)
    return isinstance(p, (int, float)) and p == 0


def _drop_needless_rng_states(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> None:
    """Call recomputed random-tagged ops directly when they draw no random
    numbers (SDPA with dropout_p=0 under full AC), instead of saving and
    restoring the RNG state around them: one saved tensor less each, and the
    graphs run under modes without higher-order-op support (LocalTensorMode).

    The partitioner wraps the k-th such op as ``run_and_save_rng_state`` in the
    forward and ``run_with_rng_state(rng_state_output_<k>, ...)`` in the
    backward; its state is the k-th RNG state among the forward's outputs.
    Pairs are matched by that ``k`` (the backward runs the layers in
    reverse: graph order would pair layer 1's forward with layer L-2's
    backward)."""
    save, restore = torch._prims.rng_prims.run_and_save_rng_state, torch._prims.rng_prims.run_with_rng_state
    fw_calls = [n for n in fw.graph.nodes if n.op == "call_function" and n.target is save]
    bw_calls = [n for n in bw.graph.nodes if n.op == "call_function" and n.target is restore]
    if not fw_calls or len(fw_calls) != len(bw_calls):
        return
    (out,) = fw.graph.find_nodes(op="output")
    outputs = list(out.args[0])
    call_of_state = {
        u: f for f in fw_calls for u in f.users if u.target is operator.getitem and u.args[1] == 0 and out in u.users
    }
    fw_by_k = [call_of_state[o] for o in outputs if o in call_of_state]
    bw_by_k = {}
    for b in bw_calls:
        name = getattr(b.args[0], "name", "")
        if not name.startswith("rng_state_output_"):
            return
        bw_by_k[int(name.removeprefix("rng_state_output_"))] = b
    if len(fw_by_k) != len(fw_calls) or sorted(bw_by_k) != list(range(len(fw_by_k))):
        return
    for k, f in enumerate(fw_by_k):
        b = bw_by_k[k]
        op, args = f.args[0], tuple(f.args[1:])
        if not _dropout_free(op, args, f.kwargs) or b.args[1] is not op:
            continue
        state = [u for u in f.users if u.target is operator.getitem and u.args[1] == 0]
        result = [u for u in f.users if u.target is operator.getitem and u.args[1] == 1]
        if len(state) != 1 or any(u is not out for u in state[0].users):
            continue
        with fw.graph.inserting_before(f):
            direct = fw.graph.call_function(op, args, dict(f.kwargs))
        # the forward op's meta (the partitioner copies it to the result):
        # the backward's recomputation is the same op, and keeps its stamps
        # (layer folding's keys, AC tags) as other recomputed ops do
        op_meta = copy.copy(result[0].meta) if result else {}
        if result:
            direct.meta = op_meta
            result[0].replace_all_uses_with(direct)
            fw.graph.erase_node(result[0])
        outputs = [o for o in outputs if o is not state[0]]
        out.args = (tuple(outputs),)
        fw.graph.erase_node(state[0])
        fw.graph.erase_node(f)
        placeholder = b.args[0]
        with bw.graph.inserting_before(b):
            direct = bw.graph.call_function(op, tuple(b.args[2:]), dict(b.kwargs))
        direct.meta = {**op_meta, **b.meta}
        b.replace_all_uses_with(direct)
        bw.graph.erase_node(b)
        if not placeholder.users:
            bw.graph.erase_node(placeholder)
    fw.recompile()
    bw.recompile()


def _is_saved_rng_state(node: torch.fx.Node) -> bool:
    """The RNG state output of a ``run_and_save_rng_state`` the partitioner built."""
    return (
        node.target is operator.getitem
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].target is torch._prims.rng_prims.run_and_save_rng_state
        and node.args[1] == 0
    )


def _copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """What ``copy.deepcopy(gm)`` gives the partitioner (new nodes, shallow
    copies of their meta, the same codegen), without generating code."""
    graph = torch.fx.Graph(tracer_cls=gm.graph._tracer_cls)
    out = graph.graph_copy(gm.graph, {}, return_output_node=True)
    out, out_node = out
    # Shallow: the codegen's pytree info is immutable, and deep-copying its
    # TreeSpecs warns (LeafSpec FutureWarning) on every apply.
    graph._codegen = copy.copy(gm.graph._codegen)
    graph.output(out, type_expr=getattr(out_node, "type", None)).meta = copy.copy(out_node.meta)
    copied = _make_graph_module(gm, graph)
    copied.meta = copy.deepcopy(gm.meta)
    return copied


def _tag_saved(saved: list) -> None:
    """Mark the forward nodes saved for backward (``meta["custom"]`` survives
    re-tracing): a later partition (:func:`autoparallel.apply.compile.autoparallel_backend`)
    then saves the same values. A getitem's tag goes on its multi-output
    parent (getitem meta does not survive re-tracing)."""
    for node in saved:
        if node.op == "placeholder":
            continue
        if node.target is operator.getitem:
            node = node.args[0]
        node.meta["custom"] = {**node.meta.get("custom", {}), SAVE_TAG: True}
