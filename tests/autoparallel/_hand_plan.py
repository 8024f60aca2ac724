"""The hand-written FSDP2 + tensor-parallel (+ sequence-parallel norms) plan
of our LLaMA-3 model, as torchtitan writes it, and collective counters.

Used by tests (our plan issues at most as many collectives per step) and by
``benchmarks/step_vs_hand.py`` (step time, bytes, memory side by side)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

_c10d = torch.ops._c10d_functional
STARTS = {
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_reduce.default: "all_reduce",
    _c10d.all_to_all_single.default: "all_to_all",
}


def hand_fsdp_tp(
    model: torch.nn.Module, mesh, *, reshard_after_forward: bool = True, mp_policy=None
) -> torch.nn.Module:
    """``model`` (a ``autoparallel.models.llama3.Transformer``) parallelized in
    place: TP with sequence-parallel norms on ``mesh["tp"]``, then FSDP2 per
    block and at the root on ``mesh["dp"]`` (``mp_policy``: FSDP2's
    ``MixedPrecisionPolicy``, None for none). Takes the dp-local batch
    (replicated over tp) and returns replicated logits."""
    tp = mesh["tp"]
    parallelize_module(
        model,
        tp,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
        # the local heads after the column split (views use them)
        block.attention.n_heads //= tp.size()
        block.attention.n_kv_heads //= tp.size()
    dp = mesh["dp"]
    mp = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in model.layers:
        fully_shard(block, mesh=dp, reshard_after_forward=reshard_after_forward, **mp)
    fully_shard(model, mesh=dp, reshard_after_forward=reshard_after_forward, **mp)
    return model


def count_hand_step(model: torch.nn.Module, tokens: torch.Tensor, loss_fn) -> Counter:
    """Collectives of one forward+backward of the hand plan (CommDebugMode)."""
    with CommDebugMode() as comm:
        loss_fn(model(tokens)).backward()
    counts = Counter()
    for op, n in comm.get_comm_counts().items():
        name = str(op).replace("_", "")  # functional and c10d spellings alike
        kind = next(
            (k for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all") if k.replace("_", "") in name),
            str(op),
        )
        counts[kind] += n
    return counts


def count_graph_collectives(*gms) -> Counter:
    """Collectives one run of each graph issues (start nodes)."""
    counts = Counter()
    for gm in gms:
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target in STARTS:
                counts[STARTS[n.target]] += 1
    return counts


def pin_hand_layout(autop, name: str = "FSDP x TP + SP", free: tuple[str, ...] = ("tok_embeddings.weight",)) -> None:
    """Pin every parameter but those named in ``free`` to the hand layout
    ``name`` of :mod:`autoparallel.baselines` (the tests of passes that
    need a known plan shape: the planner alone may pick another one on a
    toy model). The embedding is left free by default: its gradient (a
    scatter-add of Partial rows) cannot follow every hand layout."""
    from autoparallel import baselines

    shapes = {fqn: tuple(n.meta["val"].shape) for fqn, n in autop.traced.param_nodes.items()}
    (layout,) = [h for h in baselines.hand_layouts(tuple(autop.mesh.mesh_dim_names), shapes) if h.name == name]
    skip = {n.name for fqn, n in autop.traced.param_nodes.items() if fqn.endswith(free)}
    autop.add_parameter_memory_constraint(high=1.0)  # a hand layout may replicate (norms over tp)
    pinned, _ = baselines._pin_parameters(autop, layout, skip=skip)
    assert pinned, name
