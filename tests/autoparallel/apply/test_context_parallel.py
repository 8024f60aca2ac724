"""Context parallelism: attention sequence-sharded over a ``cp`` mesh dim
(K and V gathered, causal attention as blocks merged by their logsumexps).

The CP step of the LLaMA-3 debug model on a 2x2 ("dp", "cp") mesh equals the
single-device step (loss and every gradient) on LocalTensorMode ranks; the
local graph gathers K/V and reduce-scatters dK/dV over "cp"."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _parity import check_step, plan_and_apply, slow_compute_device

from torch.distributed.device_mesh import init_device_mesh

from autoparallel import AutoParallel
from autoparallel.api import ConstraintError
from autoparallel.apply.collectives import collectives
from autoparallel.models.llama3 import LLAMA3_CONFIGS, Transformer
from autoparallel.options.rules import attention as attention_rules


pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"
SDPA_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"


class LlamaLoss(nn.Module):
    """The debug LLaMA-3 and its next-token loss: one scalar per step."""

    def __init__(self, seq: int, **changes):
        super().__init__()
        self.model = Transformer(replace(LLAMA3_CONFIGS["debug"], max_seq_len=seq, **changes))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@pytest.mark.parametrize("seq", [64, pytest.param(256, marks=pytest.mark.slow)])
def test_cp_step_matches_single_device(fake_world, seq):
    fake_world(4)
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, seq))
    targets = torch.randint(0, 256, (2, seq))

    def build():
        return LlamaLoss(seq)

    parallel, plan, mesh = plan_and_apply(build, (tokens, targets), mesh_dim_names=("dp", "cp"))
    attention = [n for n in plan.nodes.values() if n.op in (SDPA, SDPA_BACKWARD)]
    assert len(attention) == 4, [n.op for n in plan.nodes.values() if "attention" in n.op]
    for n in attention:
        # every attention tensor split on the sequence (dim 2 of [B, H, L, D]) over "cp"
        assert n.output_placements.endswith("S(2))") or ", S(2)" in n.output_placements, n
    check_step(parallel, mesh, build, (tokens, targets), rel=1e-4)
    kinds = {(c.kind, c.mesh_dim, c.phase) for c in collectives(parallel.parallel_graph, mesh)}
    assert ("all_gather_into_tensor", 1, "forward") in kinds
    assert ("reduce_scatter_tensor", 1, "backward") in kinds


def _attention_placements(seq: int, heads: int, budget: float | None = None) -> list[str]:
    """The forward attention placements the planner picks for one sequence
    of ``seq`` tokens (the batch cannot split) on 4 ranks, free on its mesh dim."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    with torch.device("meta"):
        model = LlamaLoss(seq, n_heads=heads, n_kv_heads=heads)
        inputs = (torch.randint(0, 256, (1, seq)), torch.randint(0, 256, (1, seq)))
    with AutoParallel(model, mesh, inputs, mesh_roles={}) as autop:
        if budget is not None:
            autop.add_memory_budget(bytes=budget)
        plan = autop.optimize_placement()
    return [n.output_placements for n in plan.nodes.values() if n.op == SDPA]


def test_planner_chooses_context_parallel_by_its_price(fake_world, monkeypatch):
    """One sequence of 4096 tokens on 4 ranks. Two heads cannot split over 4
    ranks: the sequence split (K/V gathers priced) beats attention run
    replicated, also under a 16 MB memory budget (the smallest
    reachable is 14.9 MB); without the option the
    planner replicates attention. Four heads split over the ranks with no
    gathers at all: the planner prefers that to the sequence split."""
    fake_world(4)
    assert _attention_placements(4096, heads=2) == ["(S(2), S(2))"] * 2
    assert _attention_placements(4096, heads=2, budget=16e6) == ["(S(2), S(2))"] * 2
    assert _attention_placements(4096, heads=4) == ["(S(1), S(1))"] * 2
    monkeypatch.setattr(attention_rules, "sequence_options", lambda *args: [])
    assert all("S(2)" not in p for p in _attention_placements(4096, heads=2))


class Bidirectional(nn.Module):
    """One non-causal attention block (an encoder's) and a scalar loss."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.transpose(1, 2) for y in self.qkv(x).view(b, t, 3, self.heads, c // self.heads).unbind(2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        return self.proj(y.transpose(1, 2).reshape(b, t, c)).pow(2).mean()


def test_cp_non_causal_step_matches_single_device(fake_world):
    """Without a causal mask every rank's queries attend to the gathered keys
    unmasked; the "cp" role forces the sequence split on the 2x2 mesh."""
    fake_world(4)
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)
    parallel, plan, mesh = plan_and_apply(Bidirectional, (x,), mesh_dim_names=("dp", "cp"))
    attention = [n for n in plan.nodes.values() if n.op in (SDPA, SDPA_BACKWARD)]
    assert len(attention) == 2 and all("S(2)" in n.output_placements for n in attention), attention
    check_step(parallel, mesh, Bidirectional, (x,), rel=1e-4)


def test_cp_role_names_an_attention_op_it_cannot_split(fake_world):
    """A sequence that does not divide over the "cp" dim: the role's error
    names the attention op and says what would be valid."""
    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    with torch.device("meta"):
        model = Bidirectional()
        x = torch.randn(2, 15, 32)
    with AutoParallel(model, mesh, (x,)) as autop:
        with pytest.raises(ConstraintError, match=r"attention op .* no sequence-sharded option over 'cp' \(2 ranks\)"):
            autop.optimize_placement()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_sequence_option_prices_gathers_and_block_compute(fake_world, causal):
    """On 4 ranks the sequence-sharded option costs each rank, in all (the
    op's own price on its local shapes, halved when causal, plus the in-op
    flops): causal, half the unmasked attention / 4 (the balanced blocks:
    the causal diagonal and 2n-2 = 6 full blocks of L/8 x L/8); not causal,
    the unmasked attention / 4 (its queries against every key). Plus two
    all-gathers of the K/V shards, and in the backward two reduce-scatters
    of the full-length dK/dV."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    from autoparallel.options.rules.context_parallel import sequence_options

    fake_world(4)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
    aten = torch.ops.aten
    shape = (2, 4, 64, 8)

    def step(q, k, v, g):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, causal)

    gm = make_fx(step, tracing_mode="fake")(*(torch.randn(shape) for _ in range(4)))
    forward, backward = (n for n in gm.graph.nodes if n.op == "call_function" and "flash_attention" in str(n.target))
    local, kv_bytes = (2, 4, 16, 8), 2 * 4 * 16 * 8 * 4
    own = 0.5 if causal else 1.0
    for node, formula, args in (
        (forward, sdpa_flop_count, (shape, shape, shape)),
        (backward, sdpa_backward_flop_count, (shape, shape, shape, shape)),
    ):
        tensors = [a.meta["val"] for a in node.args if isinstance(a, torch.fx.Node)]
        (option,) = sequence_options(node, tensors, node.meta["val"], mesh, (torch.distributed.tensor.Replicate(),))
        local_args = (local,) * len(args)
        total = option.in_op.flops + own * formula(*local_args)
        assert total == pytest.approx(own * formula(*args) / 4)
        gathers = [("all_gather", kv_bytes, 0)] * 2
        assert list(option.in_op.collectives) == gathers + (
            [("reduce_scatter", 4 * kv_bytes, 0)] * 2 if node is backward else []
        )


@pytest.mark.slow
def test_cp_with_heads_split_on_3d_mesh(fake_world):
    """A 2x2x2 ("dp", "cp", "tp") mesh with compute so slow that the plan
    splits all it can: attention takes the batch over dp, the sequence over
    cp (K/V gathered) and the heads over tp, and the step matches single
    device on 8 LocalTensorMode ranks."""
    fake_world(8)
    torch.manual_seed(0)
    seq = 64
    tokens = torch.randint(0, 256, (2, seq))
    targets = torch.randint(0, 256, (2, seq))

    def build():
        return LlamaLoss(seq)

    parallel, plan, mesh = plan_and_apply(
        build,
        (tokens, targets),
        mesh_shape=(2, 2, 2),
        mesh_dim_names=("dp", "cp", "tp"),
        device=slow_compute_device(),
    )
    assert {n.output_placements for n in plan.nodes.values() if n.op == SDPA} == {"(S(0)S(2)S(1), S(0)S(2)S(1))"}
    check_step(parallel, mesh, build, (tokens, targets), rel=1e-4)


def test_cp_backward_gathers_again(fake_world):
    """The backward of the sequence-sharded attention gathers K and V (and
    stacks its blocks) again from the local tensors: the forward saves no
    gathered K/V and no stacked blocks for it (untagged, the partitioner
    merges the backward's gathers with the forward's and saves them)."""
    from autoparallel.apply.partition import output_nodes
    from autoparallel.graph_vocab import ALL_GATHER
    from autoparallel.passes.recompute_all_gathers import attention_input_chains, is_chain_op

    fake_world(4)
    seq = 64
    tokens = torch.randint(0, 256, (2, seq))
    parallel, plan, mesh = plan_and_apply(lambda: LlamaLoss(seq), (tokens, tokens), mesh_dim_names=("dp", "cp"))
    assert plan.pass_stats["recompute_all_gathers"].attention_chains > 0
    # the gathers and block stacks that feed the attention kernels (names as the partitioner keeps them)
    picks = (ALL_GATHER, torch.ops.aten.index_select.default)
    feeding = {n.name for c in attention_input_chains(parallel.parallel_graph) for n in c if n.target in picks}
    assert feeding
    graphs = parallel.parallel_state.step.graphs
    for saved in output_nodes(graphs.fw)[graphs.num_fwd_outputs :]:
        chain, stack = set(), [saved]
        while stack:  # the data moves that made the saved value
            n = stack.pop()
            if n not in chain and is_chain_op(n):
                chain.add(n)
                stack.extend(n.all_input_nodes)
        picked = [n.name for n in chain if n.name in feeding]
        assert not picked, (saved.name, picked)
    backward = [c for c in collectives(graphs.bw, mesh) if c.kind == "all_gather_into_tensor" and c.mesh_dim == 1]
    assert len(backward) >= 4, backward  # K and V of both layers
