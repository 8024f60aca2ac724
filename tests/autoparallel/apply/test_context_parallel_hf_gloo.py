"""Context parallelism on Hugging Face Llama on 4 real gloo processes: a tiny
``LlamaForCausalLM`` (``attn_implementation="sdpa"``, built from a config) on
a 2x2 ("dp", "cp") mesh, the sequence split over "cp" in every attention op
(K/V all-gathered and dK/dV reduce-scattered by gloo, the traced causal mask's
query rows split like the queries). Three AdamW steps equal the single-device
steps (each step's loss and gradients, the parameters after), also with every
decoder layer checkpointed. Slow: 4 processes each plan the model."""

from __future__ import annotations

import pytest
import torch

from _dist_utils import run_ranks

pytest.importorskip("transformers")

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]

B, SEQ = 2, 128


def _hf_cp_steps(rank: int, world: int, ac: str | None) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    from _parity import check_steps_on_rank, plan_and_apply
    from test_context_parallel_hf import SDPA, SDPA_BACKWARD, VOCAB, HFLlamaLoss, cp_placement

    tokens = torch.randint(1, VOCAB, (B, SEQ), generator=torch.Generator().manual_seed(1))

    def build():
        return HFLlamaLoss(ac, seq=SEQ)

    parallel, plan, mesh = plan_and_apply(build, (tokens,), mesh_dim_names=("dp", "cp"), time_limit=300)
    attention = [n for n in plan.nodes.values() if n.op in (SDPA, SDPA_BACKWARD)]
    assert len(attention) == 4, [n.op for n in attention]
    for n in attention:
        assert all(cp_placement(p) == "S(2)" for p in n.input_placements), n
        assert cp_placement(n.output_placements) == "S(2)", n
    errors = check_steps_on_rank(parallel, mesh, build, (tokens,), rank, steps=3, rel=1e-4)
    if rank == 0:
        print(f"largest relative gradient error over 3 steps (ac={ac}): {max(errors.values()):.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("ac", [None, "full"], ids=["plain", "checkpointed"])
def test_hf_llama_cp_gloo_2x2_adamw_steps(ac):
    run_ranks(_hf_cp_steps, 4, ac, timeout=1200)
