"""Models users bring, built from tiny configs (no downloads): each planned
on a 2x2 ("dp", "tp") mesh twice, with the default cost model and with a
slow-compute device that makes the plan shard compute, applied, and one
training step on 4 simulated ranks checked against single-device: the loss,
every gradient and every buffer (fp32, relative 1e-4); the same on a 2x2x2
("dp_replicate", "dp_shard", "tp") mesh (8 ranks). Every plan must be proven
optimal (no solve limits: benchmarks/plan_zoo.py times them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _dist_utils import run_ranks
from _parity import check_step, check_step_on_rank, plan_and_apply, sharded_matmul_fraction, slow_compute_device

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

B, S, VOCAB, HIDDEN = 4, 8, 128, 32


def _tokens(seed=1):
    return torch.randint(1, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


class LMLoss(nn.Module):
    """A Hugging Face model and a mean-square loss of its logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        return out.logits.float().pow(2).mean()


def _hf(config_cls, model_cls, **config):
    def build():
        return LMLoss(model_cls(config_cls(**config)))

    return build


def _llama():
    return _hf(
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
        use_cache=False,
    ), (_tokens(),)


def _gpt2():
    return _hf(
        transformers.GPT2Config,
        transformers.GPT2LMHeadModel,
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        attn_implementation="eager",
    ), (_tokens(),)


def _bert():
    return _hf(
        transformers.BertConfig,
        transformers.BertForMaskedLM,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    ), (_tokens(),)


def _t5():
    return _hf(
        transformers.T5Config,
        transformers.T5ForConditionalGeneration,
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
    ), {"input_ids": _tokens(1), "decoder_input_ids": _tokens(2)}


def _vit():
    return _hf(
        transformers.ViTConfig,
        transformers.ViTForImageClassification,
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_labels=8,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ), (torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(1)),)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.features(x)).pow(2).mean()


def _convnet():
    return ConvNet, (torch.randn(B, 3, 8, 8, generator=torch.Generator().manual_seed(1)),)


class OurLlama(nn.Module):
    """autoparallel's own LLaMA-3 (debug config) with a mean-square loss."""

    def __init__(self):
        super().__init__()
        from autoparallel.models import LLAMA3_CONFIGS, Transformer

        self.model = Transformer(LLAMA3_CONFIGS["debug"])
        if not next(self.parameters()).is_meta:
            self.model.init_weights()

    def forward(self, tokens):
        return self.model(tokens).float().pow(2).mean()


def _llama3_debug():
    from autoparallel.models import LLAMA3_CONFIGS

    vocab = LLAMA3_CONFIGS["debug"].vocab_size
    return OurLlama, (torch.randint(0, vocab, (8, 16), generator=torch.Generator().manual_seed(1)),)


CASES = [
    pytest.param("llama", _llama),
    pytest.param("gpt2", _gpt2),
    pytest.param("bert", _bert),
    pytest.param("t5", _t5),
    pytest.param("vit", _vit),
    pytest.param("convnet", _convnet),
    pytest.param("llama3_debug", _llama3_debug),
]


# Slow on 2x2: T5 and GPT-2 with the slow-compute device (both are planned
# and stepped on 2x2 with the default cost model; HF LLaMA, BERT, ViT and
# the ConvNet keep their sharded-compute cases), and our own LLaMA-3 (HF
# LLaMA here has the same op families under both cost models;
# test_passes_bucket.py's test_llama_debug_2x2_buckets_and_matches_reference
# steps our LLaMA-3 on 2x2).
SLOW_2D = {
    ("t5", "sharded_compute"),
    ("gpt2", "sharded_compute"),
    ("llama3_debug", "default"),
    ("llama3_debug", "sharded_compute"),
}


@pytest.mark.parametrize(
    "name,case,cost",
    [
        pytest.param(*p.values, cost, marks=[pytest.mark.slow] if (p.values[0], cost) in SLOW_2D else [])
        for p in CASES
        for cost in ("default", "sharded_compute")
    ],
)
def test_zoo(fake_world, name, case, cost):
    fake_world(4)
    build, inputs = case()
    device = slow_compute_device() if cost == "sharded_compute" else None
    parallel, plan, mesh = plan_and_apply(build, inputs, device=device)
    assert plan.solution.status == "optimal", f"{name}: {plan.solution.status}, gap {plan.solution.gap}"
    if cost == "sharded_compute":
        frac = sharded_matmul_fraction(plan)
        assert frac > 0.5, f"{name}: only {frac:.0%} of forward matmuls split\n{plan.summary()}"
    check_step(parallel, mesh, build, inputs)


MESH_3D = dict(mesh_shape=(2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


# Over ~25 s on a loaded 2-core machine (23:20 UTC, load 3.7): slow. T5
# and LLaMA-3 (default) are not in it: planned by option
# pricing after presolve (solver.api.PRICING_MIN_PAIRS): 42 s and 27 s
# each, plan and apply, at load 6-7 on 2 cores (their planning: 8.8 s and
# 5.1 s CPU).
# Also slow: T5, HF LLaMA and ViT on 2x2x2 (each planned and stepped on 2x2
# above, under both cost models); by default 2x2x2 keeps GPT-2 (the parameter
# budget, below), BERT (three-stage gathers), the ConvNet, and LLaMA-3
# (default: an option-pricing plan applied and stepped).
SLOW_3D = {
    ("t5", "sharded_compute"),
    ("gpt2", "sharded_compute"),
    ("llama", "sharded_compute"),
    ("llama3_debug", "sharded_compute"),
    ("t5", "default"),
    ("llama", "default"),
    ("vit", "default"),
    ("vit", "sharded_compute"),
}


@pytest.mark.parametrize(
    "name,cost",
    [
        pytest.param(p.values[0], cost, marks=[pytest.mark.slow] if (p.values[0], cost) in SLOW_3D else [])
        for cost in ("default", "sharded_compute")
        for p in CASES
    ],
)
def test_zoo_3d_mesh(fake_world, name, cost):
    """Every zoo model on a 2x2x2 mesh (8 simulated ranks), both cost
    models, proven optimal. History: the default parameter budget
    counts what each parameter's gradient and its repeated layers can reach
    (GPT-2's norms and last-layer biases get gradients with no sharded
    option; the budget was infeasible), and bucketing keeps three-stage
    gathers apart (BERT: a third stage merged in the round of its second
    read an erased node)."""
    fake_world(8)
    build, inputs = dict((p.values[0], p.values[1]) for p in CASES)[name]()
    device = slow_compute_device() if cost == "sharded_compute" else None
    parallel, plan, mesh = plan_and_apply(build, inputs, device=device, **MESH_3D)
    assert plan.solution.status == "optimal", f"{name}: {plan.solution.status}, gap {plan.solution.gap}"
    check_step(parallel, mesh, build, inputs)


def test_t5_blocks_partly_linked(fake_world):
    """T5's first block of each stack alone computes the relative position
    bias, so no two blocks are identical: block 1 links to block 0 where
    they align (the bias's nodes and the node adding it stay free), and the
    plan gives every linked node its twin's placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._pytree import tree_map

    from autoparallel import AutoParallel
    from autoparallel.capture.tracing import module_path

    fake_world(4)
    build, inputs = _t5()
    with torch.device("meta"):
        model = build()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with AutoParallel(model, mesh, tree_map(lambda t: t.to("meta"), inputs)) as autop:
        repeats = autop.repeats
        assert repeats.mismatched == []
        stacks = {
            ("model.encoder.block", 1): ("model.encoder.block", 0),
            ("model.decoder.block", 1): ("model.decoder.block", 0),
        }
        assert {k: ref for k, (ref, _, _) in repeats.partial.items()} == stacks
        for key, ref_key in stacks.items():
            _, linked, free = repeats.partial[key]
            nodes, ref_nodes = repeats.groups[key], repeats.groups[ref_key]
            assert linked + free == len(nodes) and free <= 2, (key, linked, free)
            # block 0's bias computation (and its gradient) has no twin
            twins = {repeats.reference[n] for n in nodes if n in repeats.reference}
            assert len(twins) == linked and twins <= set(ref_nodes)
            fqn = {n: f for f, n in autop.traced.param_nodes.items()}
            bias = [n for n in ref_nodes if "relative_attention_bias" in (module_path(n) or fqn.get(n, ""))]
            assert bias and not twins & set(bias)
        plan = autop.optimize_placement()
    assert plan.solution.status == "optimal"
    for node, ref in repeats.reference.items():
        if node.name in plan.nodes and ref.name in plan.nodes:
            mine, theirs = plan.nodes[node.name], plan.nodes[ref.name]
            assert (mine.input_placements, mine.output_placements) == (
                theirs.input_placements,
                theirs.output_placements,
            ), node.name


def _gloo_rank(rank: int, world: int, name: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    build, inputs = {"gpt2": _gpt2, "bert": _bert}[name]()
    parallel, plan, mesh = plan_and_apply(build, inputs, device=slow_compute_device())
    check_step_on_rank(parallel, mesh, build, inputs, rank)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_zoo_gloo(name):
    """Every one of 4 real gloo processes plans (compute-sharding cost model),
    applies and takes one step equal to single-device."""
    run_ranks(_gloo_rank, 4, name, timeout=600)
