"""Apply a placement plan: the stages of :mod:`autoparallel.apply` with the
rewrite passes of :mod:`autoparallel.passes` run between them (on the plan,
on the local joint graph, on the forward and backward graphs). It sits above
both packages: the passes use apply's pieces (redistributions, layer folding),
and this module drives the two.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor.placement_types import Shard, _StridedShard
from torch.utils._pytree import tree_flatten_with_path

from . import passes
from .apply.cudagraphs import CudaGraphSession, check_capturable, static_inputs
from .apply.fold import MIDDLE, FoldRejected
from .apply.inductor import compile_step
from .apply.fold import fold_layers as fold_layers_of
from .apply.local_graph import LocalJoint, build_local_joint, full_local_joint
from .apply.module import InputSlot, make_parallel_module
from .apply.partition import Partitioner, split_joint
from .apply.runtime import ParallelStep
from .apply.state import ApplyState, GradReduction
from .apply.unfold import check_shift, layer_tags, stamp, unfold_step
from .capture.repeated_layers import find_repeated_layers
from .capture.tracing import normalize_inputs
from .checks.provenance import resolve_choice

if TYPE_CHECKING:
    from .plan import Plan

# apply_placement's messages, under the logger name they always had.
logger = logging.getLogger("autoparallel.apply")


def _input_slots(inputs, local: LocalJoint, input_nodes) -> tuple:
    if callable(inputs) and not isinstance(inputs, (torch.Tensor, nn.Module)):
        with torch.device("meta"):
            inputs = inputs()
    args, kwargs = normalize_inputs(inputs)
    leaves, in_spec = tree_flatten_with_path((args, kwargs))
    specs = iter(local.input_specs)
    slots: list[InputSlot] = []
    tensor_index = 0
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            node = input_nodes[tensor_index] if tensor_index < len(input_nodes) else None
            tensor_index += 1
            if node is None:
                slots.append(InputSlot(str(path), None, kind="unused"))
            else:
                slots.append(InputSlot(str(path), next(specs)))
        else:
            slots.append(InputSlot(str(path), None, leaf, kind="const"))
    return in_spec, slots


def _apply_folded(state: ApplyState, ctx: passes.PassContext, disabled, partitioner):
    """(local joint, step graphs, joint-stage pass stats) through layer
    folding, or None when the model's layers do not fold."""
    traced, strategies, choice = state.traced, ctx.strategies, ctx.choice
    repeats = state.repeats if state.repeats is not None else find_repeated_layers(traced)
    try:
        fold = fold_layers_of(traced, strategies, choice, repeats)
    except FoldRejected as e:
        logger.info("layers not folded: %s", e)
        return None
    try:
        short = build_local_joint(fold.traced, fold.strategies, choice, state.mesh, device=state.device)
        stamp(short.gm, fold, short.param_fqns)
        tags = layer_tags(short.gm.graph)
        check_shift(short.gm.graph, tags, "local joint graph")
        ctx.local = short
        ctx.folded_copies = {n.name: fold.middle_copies for n, t in tags.items() if t is not None and t[0] == MIDDLE}
        joint_stats = passes.run_stage("joint", ctx, disabled, short.gm)
        ctx.folded_copies = {}
        graphs = unfold_step(split_joint(short, partitioner), short, fold, list(traced.param_nodes))
    except FoldRejected as e:
        logger.warning("layer folding failed, applying the full graph instead (slower): %s", e)
        ctx.folded_copies = {}
        return None
    local = full_local_joint(short, traced, strategies, choice)
    return local, graphs, joint_stats


def grad_scales(local: LocalJoint, grad_reduction: GradReduction) -> list[float]:
    """Per differentiable output, what its incoming gradient is multiplied
    by: 1 for ``"sum"``; for ``"mean"``, 1 / the number of shards the
    output's layout cuts it into (the mesh dims it is sharded over), so the
    parameter gradients are those of the mean of the shards' losses (DDP's
    and FSDP's average over data-parallel ranks; a replicated output, such
    as a loss the model computes itself, is not scaled)."""
    scales = []
    for i in local.differentiable_outputs:
        spec = local.output_specs[i]
        shards = 1
        if grad_reduction == "mean":
            for d, p in enumerate(spec.placements):
                if isinstance(p, (Shard, _StridedShard)):
                    shards *= local.mesh.size(d)
        scales.append(1.0 / shards)
    return scales


def apply_placement(
    state: ApplyState,
    plan: Plan,
    *,
    partitioner: Partitioner = "min_cut",
    disable_passes: tuple[str, ...] | list[str] = (),
    pass_options: passes.PassOptions | None = None,
    fold_layers: bool = True,
    cudagraphs: bool = False,
    compile: bool = False,
) -> nn.Module:
    """Build the parallel module for ``plan`` (see :mod:`autoparallel.apply`),
    running the rewrite passes of :mod:`autoparallel.passes` on the way.
    ``state``: the traced step, its options and the settings (an
    :class:`ApplyState`, which ``AutoParallel.apply_placement`` builds).

    ``fold_layers``: build and partition the graphs of four layers of a
    deep layer stack and copy the middle one (:mod:`~autoparallel.apply.fold`, :mod:`~autoparallel.apply.unfold`;
    same graphs, much faster); falls back to the full graphs when the
    layers do not qualify.

    ``cudagraphs``: run the forward and the backward graph each as a
    captured CUDA graph after one warm-up step (:mod:`~autoparallel.apply.cudagraphs`);
    refused, naming the nodes, where the step cannot be captured, and
    without a CUDA device.

    ``compile``: compile the forward and the backward graph with Inductor
    (:mod:`.apply.inductor`), keeping the plan's saves, recomputes, buckets and
    collective order; a graph Inductor cannot compile runs eagerly, with a
    warning naming it."""
    strategies = state.strategies
    disabled = passes.check_disabled(disable_passes)
    traced = state.traced
    choice = resolve_choice(plan, strategies)
    ctx = passes.PassContext(
        mesh=state.mesh,
        plan=plan,
        options=pass_options or passes.PassOptions(),
        traced=traced,
        strategies=strategies,
        choice=choice,
    )
    stats = passes.run_stage("plan", ctx, disabled)
    folded = None
    if fold_layers and not traced.mutations:  # folding keeps no mutation outputs
        folded = _apply_folded(state, ctx, disabled, partitioner)
    if folded is not None:
        local, graphs, joint_stats = folded
    else:
        local = build_local_joint(traced, strategies, choice, state.mesh, device=state.device)
        ctx.local = local
        joint_stats = passes.run_stage("joint", ctx, disabled, local.gm)
        graphs = split_joint(local, partitioner)
    ctx.local = local
    stats.update(joint_stats)
    stats.update(passes.run_stage("graphs", ctx, disabled, graphs.fw, graphs.bw))
    plan.pass_stats = stats
    step = ParallelStep(local, graphs, grad_scales=grad_scales(local, state.grad_reduction))
    if cudagraphs:
        check_capturable(graphs)
        step.cuda_graphs = CudaGraphSession(static_inputs(local, graphs))
        logger.info("CUDA graphs after one warm-up step:\n%s", step.cuda_graphs.inputs.describe())
    if compile:
        step.compiled = compile_step(graphs)
    in_spec, slots = _input_slots(state.inputs, local, traced.input_nodes)
    out_spec = getattr(traced.joint, "out_spec", None)
    model = make_parallel_module(state.model, step, in_spec, slots, out_spec, traced.tied_params)
    logger.info(
        "applied plan: local joint %d nodes (%.2fs), forward %d / backward %d nodes (%.2fs)",
        len(local.gm.graph.nodes),
        local.seconds,
        len(graphs.fw.graph.nodes),
        len(graphs.bw.graph.nodes),
        graphs.seconds,
    )
    return model
