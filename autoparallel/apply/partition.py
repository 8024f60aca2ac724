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
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
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


def _output_nodes(gm: torch.fx.GraphModule) -> list:
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
    fw_outs = _output_nodes(fw)
    saved = fw_outs[n_out:]
    for node in saved:
        if not isinstance(node, torch.fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
            raise NotImplementedError(f"forward saves a non-tensor value {node!r} (symbolic shapes?)")
    saved_index = {n.name: j for j, n in enumerate(saved)}
    _tag_saved(saved)
    bw_inputs: list[tuple[str, int]] = []
    tangent_names = [
        n.name for n in local.gm.graph.find_nodes(op="placeholder") if "tangents" in str(n.target)
    ]
    for ph in bw.graph.find_nodes(op="placeholder"):
        if ph.name in saved_index:
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
    re-tracing): a later partition (:func:`autoparallel.compile.autoparallel_backend`)
    then saves the same values. A getitem's tag goes on its multi-output
    parent (getitem meta does not survive re-tracing)."""
    for node in saved:
        if node.op == "placeholder":
            continue
        if node.target is operator.getitem:
            node = node.args[0]
        node.meta["custom"] = {**node.meta.get("custom", {}), SAVE_TAG: True}
