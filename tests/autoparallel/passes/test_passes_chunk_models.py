"""Chunking on models nobody here wrote (Hugging Face Llama and Mixtral,
tiny configs from config objects, nothing downloaded) and on our LLaMA-3
and MoE: chunked steps equal unchunked ones, on LocalTensorMode ranks and
on 4 gloo processes."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh

from autoparallel import AutoParallel
from autoparallel.passes import PassOptions

sys.path.insert(0, str(Path(__file__).parents[1]))
from _parity import batch_placement, slow_compute_device  # noqa: E402
from test_passes_chunk import LOCAL  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

# ---------------------------------------------------------------------------
# models nobody here wrote: chunked steps equal unchunked ones


def _hf_lm(kind: str):
    """A tiny Hugging Face causal LM (config object, nothing downloaded),
    returning a scalar loss."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation="sdpa",
    )

    class LMLoss(nn.Module):
        def __init__(self):
            super().__init__()
            if kind == "llama":
                self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
            else:
                cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
                self.model = transformers.MixtralForCausalLM(cfg)

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).logits.float().pow(2).mean()

    return LMLoss


def _local_step(parallel, mesh, state, inputs):
    """Loss and gradients of one step of ``parallel`` on the mesh's
    LocalTensorMode ranks, from ``state``."""
    from _parity import _full, _load, local_inputs

    with LocalTensorMode(mesh.size()) as lm:
        parallel.to_empty(device="cpu")
        _load(parallel, state)
        loss = parallel(*local_inputs(lm, inputs, mesh))
        loss.backward()
        grads = {n: _full(p.grad, n) for n, p in parallel.named_parameters() if p.grad is not None}
        return _full(loss, "loss"), grads


def chunked_vs_unchunked(build, inputs, modules, device=None):
    """Plan ``build()`` on 2x2, apply the plan without and with
    ``chunk_modules``; one step of each from the same weights. Returns the
    chunk stats and the two (loss, gradients)."""
    from _parity import reference_step

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = build()
    kwargs = {"device": device} if device is not None else {}
    with AutoParallel(model, mesh, tuple(t.to("meta") for t in inputs), **kwargs) as autop:
        autop.add_input_constraints([batch_placement(t, mesh) for t in inputs])
        plan = autop.optimize_placement()
        plain = autop.apply_placement(plan, pass_options=PassOptions(**LOCAL))
        chunked = autop.apply_placement(plan, pass_options=PassOptions(**LOCAL, chunk_modules=modules))
    stats = plan.pass_stats["chunk_regions"]
    state = reference_step(build, inputs)[0]
    return stats, _local_step(plain, mesh, state, inputs), _local_step(chunked, mesh, state, inputs)


def assert_same_step(a, b, rel=1e-6):
    from _parity import assert_close_rel

    assert_close_rel(a[0], b[0], rel, "loss")
    assert a[1].keys() == b[1].keys()
    for name, g in b[1].items():
        assert_close_rel(a[1][name], g, rel, f"gradient of {name}")


@pytest.mark.slow  # two Hugging Face models planned and applied twice: ~30 s each
@pytest.mark.parametrize(
    "kind, modules",
    [
        # the attention mask, built outside the layers with the literal batch, is split with them
        ("llama", {"model.model.layers.*": "batch"}),
        # the MoE block's views to (-1, hidden) resolve
        ("mixtral", {"model.model.layers.*.mlp": "batch"}),
    ],
)
def test_hugging_face_chunked_equals_unchunked(fake_world, kind, modules):
    fake_world(4)
    build = _hf_lm(kind)
    tokens = (torch.randint(1, 128, (4, 8), generator=torch.Generator().manual_seed(1)),)
    stats, plain, chunked = chunked_vs_unchunked(build, tokens, modules)
    assert stats.regions_chunked == 2 and not stats.refused, stats.refused
    assert_same_step(chunked, plain)


@pytest.mark.slow  # 40-120 s each: the tiny model planned, applied twice and stepped twice
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_hugging_face_decoder_layers_compute_bound(fake_world, kind):
    """Whole Hugging Face decoder layers (Mixtral's with its MoE block)
    under a plan that shards the batch over both mesh dims: 8 sequences,
    2 per rank (one per rank could not be halved: refused)."""
    fake_world(4)
    build = _hf_lm(kind)
    tokens = (torch.randint(1, 128, (8, 8), generator=torch.Generator().manual_seed(1)),)
    modules = {"model.model.layers.*": "batch"}
    stats, plain, chunked = chunked_vs_unchunked(build, tokens, modules, device=slow_compute_device())
    assert stats.regions_chunked == 2 and not stats.refused, stats.refused
    assert_same_step(chunked, plain, rel=step_tolerance(tokens[0].numel()))


def _our_model(kind: str, n_layers: int = 2):
    from autoparallel.models import LLAMA3_CONFIGS, MOE_CONFIGS, MoETransformer, Transformer

    if kind == "llama3":
        args = dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=n_layers)
        body = Transformer
    else:  # the balance loss averages over the batch: off (chunking it is refused)
        args = dataclasses.replace(MOE_CONFIGS["debug"], n_layers=n_layers, aux_loss_alpha=0.0)
        body = MoETransformer

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = body(args)

        def forward(self, tokens):
            return self.body(tokens).float().pow(2).mean()

    return Loss, args


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama3", "moe"])
@pytest.mark.parametrize("device", ["default", "compute-bound"])
def test_our_decoder_layers_chunked_equal_unchunked(fake_world, kind, device):
    """Whole decoder layers (attention with the dense feed-forward or the
    MoE block) of our LLaMA-3 and MoE, under the default plan and one that
    shards the batch over both mesh dims (all-gathers and all-to-alls of the
    split dim inside the layers)."""
    fake_world(4)
    build, args = _our_model(kind)
    tokens = (torch.randint(0, args.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1)),)
    dev = slow_compute_device() if device == "compute-bound" else None
    stats, plain, chunked = chunked_vs_unchunked(build, tokens, {"body.layers.*": "batch"}, device=dev)
    assert stats.regions_chunked == 2 and not stats.refused, stats.refused
    assert_same_step(chunked, plain, rel=step_tolerance(tokens[0].numel()))


def step_tolerance(tokens: int, dtype=torch.float32) -> float:
    """The relative tolerance of a chunked step against the unchunked one
    (docs/chunking.md): reordering a sum of ``tokens`` terms changes its
    rounding by at most ``2 * tokens * eps`` of the terms' magnitude."""
    return 2 * tokens * torch.finfo(dtype).eps


def test_sequence_parallel_layer_chunks_within_tolerance(fake_world, monkeypatch):
    """A whole LLaMA-3 layer under the hand FSDP x TP + SP layout (the layer
    gathers the sequence-parallel rows over tp inside it and pairs them with
    rows gathered before it), on a compute-bound device: bitwise chunking
    refuses it in one line per reason; the default splits the gathered
    live-ins rank by rank and chunks it; the chunked step equals the
    unchunked one within the reordered-sum tolerance. Attention runs as in
    the hand layout, heads over tp: the sequence-sharded option (context
    parallelism, the same causal compute on this device) is not offered."""
    from _hand_plan import pin_hand_layout
    from _parity import reference_step

    from autoparallel.options.rules import attention as attention_rules

    monkeypatch.setattr(attention_rules, "sequence_options", lambda *args: [])
    fake_world(4)
    build, args = _our_model("llama3", n_layers=1)
    tokens = (torch.randint(0, args.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1)),)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = build()
    modules = {"body.layers.*": "batch"}
    with AutoParallel(model, mesh, (tokens[0].to("meta"),), device=slow_compute_device()) as autop:
        autop.add_input_constraints([batch_placement(tokens[0], mesh)])
        pin_hand_layout(autop)
        plan = autop.optimize_placement()
        autop.apply_placement(plan, pass_options=PassOptions(**LOCAL, chunk_modules=modules, chunk_exactness="bitwise"))
        bitwise = plan.pass_stats["chunk_regions"]
        plain = autop.apply_placement(plan, pass_options=PassOptions(**LOCAL))
        chunked = autop.apply_placement(plan, pass_options=PassOptions(**LOCAL, chunk_modules=modules))
    assert bitwise.regions_chunked == 0 and bitwise.regions_refused == 1
    (line,) = bitwise.refusal_lines()
    assert "chunk_exactness='tolerance'" in line, line
    stats = plan.pass_stats["chunk_regions"]
    assert stats.regions_chunked == 1 and not stats.refused, stats.refused
    state = reference_step(build, tokens)[0]
    assert_same_step(
        _local_step(chunked, mesh, state, tokens),
        _local_step(plain, mesh, state, tokens),
        rel=step_tolerance(tokens[0].numel()),
    )


def _hf_llama_gloo_step(rank: int, world: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from _parity import check_step_on_rank

    build = _hf_lm("llama")
    tokens = (torch.randint(1, 128, (4, 8), generator=torch.Generator().manual_seed(1)),)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = build()
    with AutoParallel(model, mesh, (tokens[0].to("meta"),), time_limit=300) as autop:
        autop.add_input_constraints([batch_placement(tokens[0], mesh)])
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(
            plan, pass_options=PassOptions(chunk_modules={"model.model.layers.*": "batch"})
        )
    assert plan.pass_stats["chunk_regions"].regions_chunked == 2, plan.pass_stats["chunk_regions"].refused
    check_step_on_rank(parallel, mesh, build, tokens, rank, rel=1e-5)


@pytest.mark.slow
def test_hf_llama_chunked_gloo_2x2():
    """Hugging Face Llama's decoder layers chunked (the attention mask built
    outside them split with the batch) on 4 gloo processes: every rank's
    step equals single device."""
    from _dist_utils import run_ranks

    run_ranks(_hf_llama_gloo_step, 4, timeout=600)
