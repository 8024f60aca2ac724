"""Hugging Face mixture-of-experts models (Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss)
built from tiny configs (no downloads): every ``experts_implementation``
traces, plans on a 2x2 ("dp", "tp") mesh, applies, and one step on 4
simulated ranks equals single-device (loss and every gradient, fp32).

Gated SiLU experts run as ``autoparallel::moe_experts`` whatever the
implementation (see :func:`autoparallel.capture.trace_wrappers.route_hf_experts`),
so the planner may pick expert parallelism; experts that do not fit that op
(gpt-oss: biases, its own gating) run transformers' ``batched_mm`` forward
when their implementation cannot be traced."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re

import pytest
import torch
import torch.nn as nn
from _dist_utils import run_ranks
from _parity import check_step, check_step_on_rank, plan_and_apply
from torch.distributed.tensor import Shard

from autoparallel.cost_model import DeviceSpec
from autoparallel.capture.tracing import trace_training_step

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

B, S, VOCAB, HIDDEN = 4, 8, 128, 64
IMPLS = ["grouped_mm", "eager", "batched_mm"]  # grouped_mm: transformers' default


class LMLoss(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits.float().pow(2).mean()


def _common(impl):
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        experts_implementation=impl,
    )


def mixtral(impl="grouped_mm", intermediate=128):
    def build():
        cfg = transformers.MixtralConfig(
            intermediate_size=intermediate,
            num_local_experts=4,
            num_experts_per_tok=2,
            attn_implementation="sdpa",
            **_common(impl),
        )
        return LMLoss(transformers.MixtralForCausalLM(cfg))

    return build


def qwen3_moe(impl="grouped_mm"):
    def build():
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=128,
            moe_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
            attn_implementation="sdpa",
            **_common(impl),
        )
        return LMLoss(transformers.Qwen3MoeForCausalLM(cfg))

    return build


def qwen2_moe(impl="grouped_mm"):
    def build():
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=128,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            attn_implementation="sdpa",
            **_common(impl),
        )
        return LMLoss(transformers.Qwen2MoeForCausalLM(cfg))

    return build


def deepseek_v3(impl="grouped_mm"):
    def build():
        cfg = transformers.DeepseekV3Config(
            intermediate_size=128,
            moe_intermediate_size=64,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            v_head_dim=16,
            qk_nope_head_dim=8,
            attn_implementation="sdpa",
            **{**_common(impl), "num_key_value_heads": 4},
        )
        return LMLoss(transformers.DeepseekV3ForCausalLM(cfg))

    return build


def gpt_oss(impl="grouped_mm"):
    def build():
        cfg = transformers.GptOssConfig(
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
            attn_implementation="eager",
            layer_types=["full_attention"] * 2,
            **_common(impl),
        )
        return LMLoss(transformers.GptOssForCausalLM(cfg))

    return build


def _tokens():
    return (torch.randint(1, VOCAB, (B, S), generator=torch.Generator().manual_seed(1)),)


def compute_bound_device() -> DeviceSpec:
    """H100 with 1e4x slower compute (memory and links unchanged): the tiny
    model's step is compute-bound, as a real MoE step is, so the plan splits
    the experts' work rather than replicating it."""
    return dataclasses.replace(
        DeviceSpec.get("H100"), name="compute-bound", peak_bf16=1e11, peak_fp32=1e11, peak_tf32=1e11
    )


def _per_dim(placements: str) -> list[str]:
    """ "S(0)P" -> ["S(0)", "P"] (a plan's placement string, one per mesh dim)."""
    return re.findall(r"_StridedShard\([^)]*\)|[SRP](?:\([^)]*\))?", placements)


def _trace(build):
    with torch.device("meta"):
        model = build()
    stack = contextlib.ExitStack()
    with stack:
        traced = trace_training_step(model, (torch.empty(B, S, dtype=torch.long, device="meta"),), "cpu", stack=stack)
    return [str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"]


def test_mixtral_every_experts_implementation_traces_as_moe_op(caplog):
    """eager (data-dependent nonzero loop), grouped_mm (opaque fp32 fallback
    op while compiling) and batched_mm all trace to the same graph: one
    moe_experts op per layer, forward and backward."""
    graphs = {}
    for impl in IMPLS:
        with caplog.at_level(logging.INFO, logger="autoparallel.capture.trace_wrappers"):
            graphs[impl] = _trace(mixtral(impl))
        assert (
            f"Hugging Face experts traced as moe_experts (was {impl}): model.model.layers.0.mlp.experts" in caplog.text
        )
        caplog.clear()
    ops = graphs["grouped_mm"]
    assert ops.count("autoparallel.moe_experts.default") == 2
    assert ops.count("autoparallel.moe_experts_backward.default") == 2
    assert not [op for op in ops if "nonzero" in op or "grouped_mm" in op or "bmm" in op]
    assert graphs["eager"] == ops and graphs["batched_mm"] == ops


def test_experts_that_do_not_fit_run_batched_mm(caplog):
    """gpt-oss experts (biases, interleaved gate/up with its own gating)
    cannot be moe_experts: with the untraceable eager implementation they
    run transformers' batched_mm forward, and the log says why."""
    with caplog.at_level(logging.INFO, logger="autoparallel.capture.trace_wrappers"):
        ops = _trace(gpt_oss("eager"))
    assert "traced as batched_mm (was eager; not moe_experts: its experts have biases)" in caplog.text
    assert "aten.bmm.default" in ops and not [op for op in ops if "nonzero" in op or "moe_experts" in op]


def test_grouped_mm_fallback_has_tensor_parallel_rule(fake_world):
    """gpt-oss experts on transformers' grouped_mm in fp32 trace to its
    opaque fallback op; the rule gives it replicated, column- and
    row-parallel options per mesh dim (3 x 3 on a 2x2 mesh), and FLOPs."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoparallel.cost_model.compute import op_flops_and_bytes
    from autoparallel.options.strategies import StrategyEnumerator

    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2))
    with torch.device("meta"):
        model = gpt_oss("grouped_mm")()
    stack = contextlib.ExitStack()
    with stack:
        traced = trace_training_step(model, (torch.empty(B, S, dtype=torch.long, device="meta"),), "cpu", stack=stack)
    nodes = [n for n in traced.gm.graph.nodes if "grouped_mm_fallback" in str(n.target)]
    assert len(nodes) == 8  # gate_up and down, forward and backward, 2 layers
    strategies = StrategyEnumerator(mesh).enumerate(traced.gm)
    for n in nodes:
        assert strategies[n].source == "rule" and len(strategies[n].options) == 9, (n, strategies[n].source)
    fwd = next(n for n in nodes if str(n.target).endswith("fallback.default"))
    x, w = fwd.args[0].meta["val"], fwd.args[1].meta["val"]
    flops, _ = op_flops_and_bytes(fwd.target, tuple(a.meta["val"] for a in fwd.args), {}, fwd.meta["val"])
    assert flops == 2 * x.shape[0] * x.shape[1] * w.shape[2]


def test_aten_grouped_mm_flops():
    """transformers' bf16 grouped_mm path is aten._grouped_mm (DTensor has its
    rule); the cost model counts 2 S K N FLOPs for it."""
    from torch.utils.flop_counter import FlopCounterMode

    import autoparallel.options.rules.grouped_mm  # noqa: F401  (registers the formula)

    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(4, 16, 32, dtype=torch.bfloat16)
    with FlopCounterMode(display=False) as counter:
        torch._grouped_mm(x, w, offs=torch.tensor([2, 4, 6, 8], dtype=torch.int32))
    assert counter.get_total_flops() == 2 * 8 * 16 * 32


def test_mixtral_expert_parallel_chosen_and_matches(fake_world):
    """On a compute-bound device with expert weights much larger than the
    step's tokens, the solver picks expert parallelism (weights Shard(0),
    routed op output Partial) on some mesh dim; the step matches."""
    fake_world(4)
    build = mixtral(intermediate=512)
    inputs = _tokens()
    parallel, plan, mesh = plan_and_apply(build, inputs, device=compute_bound_device())
    experts = {n: tuple(p.placements) for n, p in parallel.named_parameters() if ".experts." in n}
    assert len(experts) == 4
    ep_dims = set.intersection(*({i for i, p in enumerate(pl) if p == Shard(0)} for pl in experts.values()))
    assert ep_dims, f"no mesh dim shards every expert weight by expert: {experts}\n{plan.summary()}"
    fwd = [n for n in plan.nodes.values() if n.op == "autoparallel.moe_experts.default" and n.phase == "forward"]
    assert len(fwd) == 2
    for node in fwd:
        for dim in ep_dims:  # weights and expert ids split by expert, output partial on that dim
            assert all(_per_dim(pl)[dim] == "S(0)" for pl in node.input_placements[3:]), node
            assert _per_dim(node.output_placements)[dim] == "P", node
    check_step(parallel, mesh, build, inputs)


def _gloo_rank(rank: int, world: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    build = mixtral(intermediate=512)
    parallel, plan, mesh = plan_and_apply(build, _tokens(), device=compute_bound_device())
    experts = [tuple(p.placements) for n, p in parallel.named_parameters() if ".experts." in n]
    assert experts and all(Shard(0) in pl for pl in experts), experts
    check_step_on_rank(parallel, mesh, build, _tokens(), rank)


@pytest.mark.slow
def test_mixtral_expert_parallel_gloo():
    """The expert-parallel plan on 4 real gloo processes: every rank's step
    equals single-device."""
    run_ranks(_gloo_rank, 4, timeout=600)


@pytest.mark.slow
def test_gpt_oss_grouped_mm_tensor_parallel_matches(fake_world):
    """With compute that dominates, gpt-oss's grouped_mm experts run tensor
    parallel (gate_up column-, down row-parallel) and the step matches."""
    from _parity import slow_compute_device

    fake_world(4)
    build = gpt_oss("grouped_mm")
    parallel, plan, mesh = plan_and_apply(build, _tokens(), device=slow_compute_device())
    fwd = [n for n in plan.nodes.values() if n.op == "transformers.grouped_mm_fallback.default"]
    assert fwd and all(n.input_placements[1] != "RR" for n in fwd), fwd
    check_step(parallel, mesh, build, _tokens())


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_mixtral_plan_apply_matches(fake_world, impl):
    """Default (H100) cost model, each implementation: plan, apply, one step."""
    fake_world(4)
    build = mixtral(impl)
    parallel, _, mesh = plan_and_apply(build, _tokens())
    check_step(parallel, mesh, build, _tokens())


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [qwen3_moe(), qwen2_moe(), deepseek_v3(), gpt_oss("eager"), gpt_oss("grouped_mm")],
    ids=["qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss_eager", "gpt_oss_grouped_mm"],
)
def test_other_hf_moe_plan_apply_matches(fake_world, case):
    fake_world(4)
    parallel, _, mesh = plan_and_apply(case, _tokens())
    check_step(parallel, mesh, case, _tokens())


def test_example_mixtral_8x7b_shapes_choose_expert_parallel(capsys, monkeypatch):
    """examples/example_hf.py on Mixtral-8x7B's real shapes (2 layers,
    8 x 4096 tokens) with the default H100 cost model: the plan shards every
    experts module's weights by expert on some mesh dim."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).parents[3] / "examples" / "example_hf.py"
    spec = importlib.util.spec_from_file_location("example_hf", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(sys, "argv", ["example_hf.py", "--model", "mixtral-8x7b", "--seq", "4096"])
    example.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("experts (")]
    assert lines and sum(int(re.match(r"experts \((\d+):", line).group(1)) for line in lines) == 2, lines
    for line in lines:
        weights = re.search(r"expert weights (\S+) -> output (\S+)", line)
        assert weights and "S(0)" in _per_dim(weights.group(1)), line
        ep = [i for i, p in enumerate(_per_dim(weights.group(1))) if p == "S(0)"]
        assert all(_per_dim(weights.group(2))[i] == "P" for i in ep), line


class TrainingLoss(nn.Module):
    """transformers' own training loss: next-token cross-entropy plus the
    router's load-balancing loss (``output_router_logits``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


@pytest.mark.slow
def test_mixtral_training_loss_with_router_aux_loss(fake_world):
    fake_world(4)

    def build():
        cfg = transformers.MixtralConfig(
            intermediate_size=128,
            num_local_experts=4,
            num_experts_per_tok=2,
            attn_implementation="sdpa",
            output_router_logits=True,
            router_aux_loss_coef=0.02,
            **_common("grouped_mm"),
        )
        return TrainingLoss(transformers.MixtralForCausalLM(cfg))

    tokens = _tokens()[0]
    inputs = (tokens, tokens.clone())
    parallel, _, mesh = plan_and_apply(build, inputs)
    check_step(parallel, mesh, build, inputs)
