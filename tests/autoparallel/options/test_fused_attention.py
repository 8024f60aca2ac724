"""The fused CUDA attention kernels (flash, memory-efficient, cuDNN) have
options like the CPU kernel's, and a model using them plans and applies.

The kernels cannot run on a CPU, but their meta functions trace under fake
tensors: ``traced_attention_kernel`` makes ``F.scaled_dot_product_attention``
call the chosen kernel, as torch does on a GPU, and autograd records its
backward."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _parity import check_step, plan_and_apply, slow_compute_device
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.capture.attention_kernels import FUSED_ATTENTION_KERNELS, traced_attention_kernel

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]

aten = torch.ops.aten
FORWARD = {
    "flash": aten._scaled_dot_product_flash_attention.default,
    "efficient": aten._scaled_dot_product_efficient_attention.default,
    "cudnn": aten._scaled_dot_product_cudnn_attention.default,
}
BACKWARD = {
    "flash": aten._scaled_dot_product_flash_attention_backward.default,
    "efficient": aten._scaled_dot_product_efficient_attention_backward.default,
    "cudnn": aten._scaled_dot_product_cudnn_attention_backward.default,
}
BATCH, SEQ, DIM, HEADS = 4, 16, 32, 4


class Attention(nn.Module):
    """One causal self-attention block; ``mask`` (a 2-D additive mask) is
    passed to SDPA instead of ``is_causal``."""

    def __init__(self, mask: bool = False):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)
        causal = torch.full((SEQ, SEQ), float("-inf")).triu(1)
        self.register_buffer("mask", causal if mask else None, persistent=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        if self.mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return self.out(o.transpose(1, 2).reshape(b, s, d)).pow(2).mean()


class BiasedEfficientAttention(nn.Module):
    """The efficient kernel called directly with a learned bias that
    broadcasts over batch and heads: its gradient is a partial sum where q
    is sharded."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.bias = nn.Parameter(torch.zeros(1, 1, SEQ, SEQ))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        o = aten._scaled_dot_product_efficient_attention(q, k, v, self.bias, True, 0.0, False)[0]
        return o.pow(2).mean()


def _inputs():
    return (torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(0)),)


def _strategies(build, kernel):
    """Trace ``build()`` on a 2x2 mesh with ``kernel`` (None: the CPU
    kernel) and return (options per node, fallback ops)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = build()
    x = torch.empty(BATCH, SEQ, DIM, device="meta")
    with traced_attention_kernel(kernel), AutoParallel(model, mesh, (x,)) as autop:
        return dict(autop.strategies), dict(autop.strategy_stats.fallback_ops)


def _node(strategies, op):
    (node,) = [n for n in strategies if n.target is op]
    return node, strategies[node]


def _tensor_specs(option, node):
    """(value, spec) of every tensor input and output of ``option``."""
    from autoparallel.options.strategies import tensor_inputs

    pairs = [(n.meta["val"], s) for n, s in zip(tensor_inputs(node), option.input_specs)]
    vals = node.meta["val"]
    pairs += [(v, s) for v, s in zip(vals, option.output_specs) if isinstance(v, torch.Tensor)]
    return pairs


@pytest.mark.parametrize("kernel", FUSED_ATTENTION_KERNELS)
def test_fused_kernel_options(fake_world, kernel):
    """Batch and heads on each mesh dim, every attention tensor alike, the
    random-number state and other small tensors replicated: the CPU
    kernel's nine layouts on a 2x2 mesh, forward and backward; and the
    sequence split (context parallelism) over one mesh dim with batch,
    heads or replicate on the other, except for the efficient kernel at 16
    tokens: it pads its logsumexp to 32 rows, which do not split as the
    queries do."""
    fake_world(4)
    strategies, fallback = _strategies(Attention, kernel)
    assert not fallback, fallback
    rep = (Replicate(), Replicate())
    every_layout = set(itertools.product((Replicate(), Shard(0), Shard(1)), repeat=2))
    if kernel != "efficient":
        others = (Replicate(), Shard(0), Shard(1))
        every_layout |= {(Shard(2), p) for p in others} | {(p, Shard(2)) for p in others}
    for op, query_index in ((FORWARD[kernel], 0), (BACKWARD[kernel], 1)):
        node, strat = _node(strategies, op)
        assert strat.source == "rule", (op, strat.source)
        offered = set()
        for option in strat.options:
            q = option.input_specs[query_index].placements
            offered.add(tuple(q))
            for val, spec in _tensor_specs(option, node):
                expected = q if val.dim() >= 3 else rep
                assert tuple(spec.placements) == tuple(expected), (op, option.label, tuple(val.shape))
        assert offered == every_layout, (op, offered)
    # the forward's small outputs exist and are the ones replicated: rng state
    node, strat = _node(strategies, FORWARD[kernel])
    small = [i for i, v in enumerate(node.meta["val"]) if isinstance(v, torch.Tensor) and v.dim() < 3]
    assert small, [getattr(v, "shape", v) for v in node.meta["val"]]


@pytest.mark.parametrize(
    "kernel",
    ["cudnn", pytest.param("flash", marks=pytest.mark.slow), pytest.param("efficient", marks=pytest.mark.slow)],
)
def test_fused_kernel_plans_and_applies(fake_world, caplog, kernel):
    fake_world(4)
    with caplog.at_level(logging.WARNING, logger="autoparallel.options.strategies"):
        with traced_attention_kernel(kernel):
            _, plan, _ = plan_and_apply(Attention, _inputs(), device=slow_compute_device())
    assert not [r for r in caplog.records if "no usable sharding rule" in r.getMessage()]
    for op in (FORWARD[kernel], BACKWARD[kernel]):
        (n,) = [n for n in plan.nodes.values() if n.op == str(op)]
        # compute dominates on the slow device: attention runs sharded
        assert all("S(" in p for p in n.input_placements[:3]), (n.op, n.input_placements)


@pytest.mark.slow
def test_cudnn_plan_equals_cpu_kernel_plan(fake_world):
    """Tracing cuDNN attention instead of the CPU kernel changes no
    placement outside the attention ops, nor the attention's own layout."""
    fake_world(4)
    plans = {}
    for kernel in (None, "cudnn"):
        with traced_attention_kernel(kernel):
            _, plans[kernel], _ = plan_and_apply(Attention, _inputs(), device=slow_compute_device())

    def kinds(plan):
        out = {}
        for k in plan.placements_by_kind():
            if "scaled_dot_product" in k.op:
                # q, k, v -> output of the forward
                sigs = {s.split(" -> ")[0].split(",")[:3][0] for s in k.placements}
                out[(k.role, k.module_path, "backward" in k.op)] = sigs
            else:
                out[(k.role, k.module_path, k.op)] = k.placements
        return out

    assert kinds(plans[None]) == kinds(plans["cudnn"])
    assert plans[None].objective == pytest.approx(plans["cudnn"].objective, rel=0.01)


def test_broadcast_mask_is_replicated_and_correct(fake_world):
    """A 2-D mask broadcasts over batch and heads: never sharded with them
    (its dim 0 is the query position, not the batch); under the sequence
    split its query rows (dim 0) split like the queries. The step is exact."""
    fake_world(4)
    strategies, _ = _strategies(lambda: Attention(mask=True), None)
    for op in (aten._scaled_dot_product_flash_attention_for_cpu.default,):
        node, strat = _node(strategies, op)
        mask = node.kwargs["attn_mask"]
        from autoparallel.options.strategies import tensor_inputs

        k = tensor_inputs(node).index(mask)
        batch_head = [o for o in strat.options if Shard(2) not in o.input_specs[0].placements]
        assert {tuple(o.input_specs[k].placements) for o in batch_head} == {(Replicate(), Replicate())}
        assert len(batch_head) == 9
        # sequence split over one mesh dim, batch / heads / replicate on the other
        sequence = [o for o in strat.options if Shard(2) in o.input_specs[0].placements]
        assert len(sequence) == 6
        for o in sequence:
            rows = [Shard(0) if p == Shard(2) else Replicate() for p in o.input_specs[0].placements]
            assert list(o.input_specs[k].placements) == rows, o
    parallel, plan, mesh = plan_and_apply(lambda: Attention(mask=True), _inputs(), device=slow_compute_device())
    check_step(parallel, mesh, lambda: Attention(mask=True), _inputs())


def test_broadcast_bias_gradient_is_partial(fake_world):
    """The efficient kernel's bias gradient, for a bias broadcast over batch
    and heads, is a partial sum on every mesh dim q is sharded on."""
    fake_world(4)
    strategies, fallback = _strategies(BiasedEfficientAttention, None)
    assert not fallback, fallback
    node, strat = _node(strategies, BACKWARD["efficient"])
    for option in strat.options:
        q = option.input_specs[1].placements
        grad_bias = option.output_specs[3].placements
        assert tuple(grad_bias) == tuple(Partial() if isinstance(p, Shard) else p for p in q), option.label
    assert len(strat.options) == 9


@pytest.mark.slow
def test_broadcast_bias_plan_applies(fake_world):
    fake_world(4)
    _, plan, _ = plan_and_apply(BiasedEfficientAttention, _inputs(), device=slow_compute_device())
    (n,) = [n for n in plan.nodes.values() if n.op == str(BACKWARD["efficient"])]
    assert "S(" in n.input_placements[1], n.input_placements


def test_flash_with_mask_and_unknown_kernel_are_errors():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="flash attention takes no attention mask"):
        with traced_attention_kernel("flash"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="expected None or one of flash, efficient, cudnn"):
        with traced_attention_kernel("math"):
            pass


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="a CUDA build traces on a 'cuda' mesh")
def test_cuda_mesh_on_cpu_build_says_what_to_do(fake_world):
    """A "cuda" mesh builds with the fake process group, but a CPU-only
    torch cannot trace on CUDA tensors (the process would abort): an error
    names the way that works."""
    fake_world(4)
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Attention()
    x = torch.empty(BATCH, SEQ, DIM, device="meta")
    with pytest.raises(RuntimeError, match="attention_kernel='cudnn'"):
        with AutoParallel(model, mesh, (x,)):
            pass


def test_variable_length_attention_runs_replicated(fake_world):
    """With cum_seq_q/k (packed sequences: dim 0 of q holds the tokens of
    every sequence, not the batch), the only option is replicated."""
    from autoparallel.options.rules.fused_attention import fused_attention_backward_rule

    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    graph = torch.fx.Graph()

    def placeholder(name, *shape, dtype=torch.float32):
        node = graph.placeholder(name)
        node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
        return node

    tokens = (64, HEADS, 8)  # 4 sequences of 16 tokens, packed
    grad, q, k, v, out = (placeholder(name, *tokens) for name in ("grad", "q", "k", "v", "out"))
    lse = placeholder("lse", HEADS, 64)
    cum_q, cum_k = placeholder("cum_q", 5, dtype=torch.int32), placeholder("cum_k", 5, dtype=torch.int32)
    seed, offset = placeholder("seed", 2, dtype=torch.int64), placeholder("offset", dtype=torch.int64)
    node = graph.call_function(
        BACKWARD["flash"], (grad, q, k, v, out, lse, cum_q, cum_k, 16, 16, 0.0, True, seed, offset)
    )
    node.meta["val"] = tuple(torch.empty(*tokens, device="meta") for _ in range(3))
    (option,) = fused_attention_backward_rule(node, [], mesh)
    specs = [*option.input_specs, *option.output_specs]
    assert all(tuple(s.placements) == (Replicate(), Replicate()) for s in specs)
