"""Context parallelism on Hugging Face Llama (``attn_implementation="sdpa"``).

Under tracing, transformers materializes its causal mask (it skips the mask
for ``is_causal`` only in eager runs) and passes it to attention as
``attn_mask`` ([B, 1, L, L]). The sequence-sharded option then splits the
mask's query rows over "cp" like the queries (each rank keeps its rows
against every key: the keys are gathered) and attends with those rows.
The step on a 2x2 ("dp", "cp") mesh equals the single-device step (loss and
every gradient) on LocalTensorMode ranks, also with checkpointed blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _parity import check_step, plan_and_apply, slow_compute_device

from autoparallel.apply.collectives import collectives
from autoparallel.capture.activation_checkpointing import apply_ac
from autoparallel.problem.param_memory import placement_tokens

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"
SDPA_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
B, SEQ, VOCAB = 2, 64, 128


class HFLlamaLoss(nn.Module):
    """A tiny Hugging Face Llama (causal, sdpa attention) and a scalar loss
    of its logits; ``ac``: checkpoint each decoder layer; ``seq``: the
    longest sequence (rotary positions)."""

    def __init__(self, ac: str | None = None, seq: int = SEQ):
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=seq,
            attn_implementation="sdpa",
            use_cache=False,
        )
        self.model = transformers.LlamaForCausalLM(config)
        if ac is not None:
            apply_ac(self.model, ac, blocks=self.model.model.layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits.float().pow(2).mean()


def cp_placement(placements: str) -> str:
    """The placement on mesh dim 1 ("cp") of one tensor's ``"RS(2)"`` or of
    the first output of a tuple's ``"(RS(2), RS(2))"``."""
    first = placements[1:-1].split(", ")[0] if placements.startswith("(") else placements
    return placement_tokens(first)[1]


@pytest.mark.parametrize(
    "ac, slow_compute",
    [(None, False), ("full", False), pytest.param(None, True, marks=pytest.mark.slow)],
    ids=["plain", "checkpointed", "heads-over-dp"],
)
def test_hf_llama_cp_step_matches_single_device(fake_world, ac, slow_compute):
    """``slow_compute``: a device on which the plan splits all it can (the
    heads over dp: the [B, 1, L, L] mask is replicated there)."""
    fake_world(4)
    tokens = torch.randint(1, VOCAB, (B, SEQ), generator=torch.Generator().manual_seed(1))

    def build():
        return HFLlamaLoss(ac)

    device = slow_compute_device() if slow_compute else None
    parallel, plan, mesh = plan_and_apply(build, (tokens,), mesh_dim_names=("dp", "cp"), device=device)
    attention = [n for n in plan.nodes.values() if n.op in (SDPA, SDPA_BACKWARD)]
    assert len(attention) == 4, [n.op for n in attention]
    for n in attention:
        # q, k, v, the output and the mask's query rows split on the sequence over "cp"
        assert all(cp_placement(p) == "S(2)" for p in n.input_placements), n
        assert cp_placement(n.output_placements) == "S(2)", n
    check_step(parallel, mesh, build, (tokens,), rel=1e-4)
    kinds = {(c.kind, c.mesh_dim, c.phase) for c in collectives(parallel.parallel_graph, mesh)}
    assert ("all_gather_into_tensor", 1, "forward") in kinds
    assert ("reduce_scatter_tensor", 1, "backward") in kinds


class PaddedEncoder(nn.Module):
    """One bidirectional attention block with a key-padding mask
    ([B, 1, 1, L]: its query dim broadcasts) and a scalar loss."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.transpose(1, 2) for y in self.qkv(x).view(b, t, 3, self.heads, c // self.heads).unbind(2))
        bias = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, float("-inf"))[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(y.transpose(1, 2).reshape(b, t, c)).pow(2).mean()


def test_cp_with_broadcast_query_mask_matches_single_device(fake_world):
    """A mask whose query dim broadcasts is replicated over "cp" (every
    rank's rows read the same key mask) and the step equals single device."""
    fake_world(4)
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)
    keep = torch.ones(2, 16, dtype=torch.bool)
    keep[0, 11:] = False
    keep[1, 5:] = False
    parallel, plan, mesh = plan_and_apply(PaddedEncoder, (x, keep), mesh_dim_names=("dp", "cp"))
    attention = [n for n in plan.nodes.values() if n.op in (SDPA, SDPA_BACKWARD)]
    assert len(attention) == 2 and all(cp_placement(n.output_placements) == "S(2)" for n in attention), attention
    for n in attention:
        assert cp_placement(n.input_placements[-1]) == "R", n  # the [B, 1, 1, L] mask
    check_step(parallel, mesh, PaddedEncoder, (x, keep), rel=1e-4)
