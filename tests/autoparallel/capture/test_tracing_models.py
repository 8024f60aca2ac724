"""Tracing models the way users bring them: Hugging Face transformers models
(built from tiny configs, no downloads) trace, because their "am I being
compiled/exported" guards see the trace; genuine data-dependent Python
control flow fails with an error that names the module and the source line."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from autoparallel import DataDependentTraceError
from autoparallel.capture.tracing import trace_training_step

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _tokens(*shape):
    return torch.empty(*shape, dtype=torch.long, device="meta")


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg), {"input_ids": _tokens(4, 16)}


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": _tokens(4, 16)}


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return transformers.BertForMaskedLM(cfg), {"input_ids": _tokens(4, 16)}


def _t5():
    cfg = transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, use_cache=False)
    return transformers.T5ForConditionalGeneration(cfg), {
        "input_ids": _tokens(4, 16),
        "decoder_input_ids": _tokens(4, 8),
    }


# model -> (builder, tied aliases expected: alias FQN -> canonical FQN)
HF_MODELS = {
    "llama": (_llama, {}),
    "gpt2": (_gpt2, {"lm_head.weight": "transformer.wte.weight"}),
    "bert": (_bert, {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight"}),
    "t5": (_t5, {"lm_head.weight": "shared.weight"}),
}


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_hugging_face_models_trace(name):
    build, tied = HF_MODELS[name]
    with torch.device("meta"):
        model, inputs = build()
    with contextlib.ExitStack() as stack:
        traced = trace_training_step(model, inputs, "cpu", stack=stack)
    # every parameter object is one graph input, reachable under every name
    n_unique = len({id(p) for p in model.parameters()})
    assert len(traced.param_nodes) == n_unique
    for alias, canonical in tied.items():
        assert traced.tied_params[alias] == canonical
    assert set(traced.param_nodes) | set(traced.tied_params) == {
        n for n, _ in model.named_parameters(remove_duplicate=False)
    }
    # the loss-free forward output (logits) has a tangent and every used
    # parameter a gradient
    assert traced.output_nodes and traced.tangent_nodes
    assert sum(g is not None for g in traced.grad_nodes.values()) >= n_unique - 2
    assert not torch.compiler.is_compiling()  # the flag does not leak


class _GuardedCheck(nn.Module):
    """A data-dependent check skipped under compile/export, as libraries do."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        if not (torch.compiler.is_compiling() and torch.compiler.is_exporting()):
            if (x[:, -1] == 0).all():  # would need the data
                x = x + 1
        return self.proj(x)


def test_library_guards_see_the_trace():
    with torch.device("meta"):
        model = _GuardedCheck()
    with contextlib.ExitStack() as stack:
        traced = trace_training_step(model, torch.empty(4, 8, device="meta"), "cpu", stack=stack)
    assert set(traced.param_nodes) == {"proj.weight", "proj.bias"}
    assert not torch.compiler.is_compiling() and not torch.compiler.is_exporting()


class _Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # depends on the data: cannot be traced
            return x * 2
        return x


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.gate = _Gate()

    def forward(self, x):
        return self.gate(self.proj(x))


def test_data_dependent_control_flow_is_a_named_error():
    with torch.device("meta"):
        model = _DataDependent()
    with contextlib.ExitStack() as stack, pytest.raises(DataDependentTraceError) as info:
        trace_training_step(model, torch.empty(4, 8, device="meta"), "cpu", stack=stack)
    msg = str(info.value)
    assert "module 'gate'" in msg
    assert "test_tracing_models.py" in msg and "if x.sum() > 0" in msg
    assert "torch.cond" in msg


def test_hugging_face_cache_output_says_use_cache_false():
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=4, n_positions=64, use_cache=True)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    with contextlib.ExitStack() as stack, pytest.raises(RuntimeError, match="use_cache=False"):
        trace_training_step(model, {"input_ids": _tokens(2, 8)}, "cpu", stack=stack)
