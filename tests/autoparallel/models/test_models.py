import copy
from dataclasses import replace

import pytest
import torch

from autoparallel.models import (
    FFN,
    LLAMA3_CONFIGS,
    BlockModel,
    Transformer,
    count_params,
)
from autoparallel.models.llama3 import ffn_hidden_dim, precompute_rope

TINY = LLAMA3_CONFIGS["debug"]


def _tokens(bsz=2, seqlen=16, vocab=TINY.vocab_size):
    return torch.randint(0, vocab, (bsz, seqlen), generator=torch.Generator().manual_seed(1))


def _materialized(args=TINY, seed=0):
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_forward_backward_shapes():
    model = _materialized()
    logits = model(_tokens())
    assert logits.shape == (2, 16, TINY.vocab_size)
    assert logits.dtype == torch.float32
    logits.float().logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
        assert torch.isfinite(p.grad).all(), name


def test_meta_init_is_deterministic_and_matches_cpu_build():
    a, b = _materialized(seed=3), _materialized(seed=3)
    torch.manual_seed(3)
    c = Transformer(TINY)  # built on cpu: construction consumes RNG, init resets it
    torch.manual_seed(3)
    c.init_weights()
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sc.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
        assert torch.equal(sa[k], sc[k]), k
    d = _materialized(seed=4)
    assert not torch.equal(d.layers[0].attention.wq.weight, a.layers[0].attention.wq.weight)


def test_rope_buffers_recomputed_after_to_empty():
    model = _materialized()
    cos, sin = precompute_rope(TINY.head_dim, TINY.max_seq_len, TINY.rope_theta)
    assert torch.equal(model.freqs_cos, cos) and torch.equal(model.freqs_sin, sin)
    assert "freqs_cos" not in model.state_dict()  # derived, not checkpointed
    assert {n for n, _ in model.named_buffers()} == {"freqs_cos", "freqs_sin"}


def test_init_scheme():
    model = _materialized(replace(TINY, n_layers=4, dim=128, multiple_of=64))
    # norms are ones; output projections shrink with depth (depth_init)
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    stds = [blk.attention.wo.weight.std().item() for blk in model.layers]
    assert stds[0] > stds[-1]
    assert abs(model.tok_embeddings.weight.std().item() - 1.0) < 0.05


def test_tied_embeddings_share_one_parameter():
    args = replace(TINY, tie_embeddings=True)
    model = _materialized(args)
    assert model.output.weight is model.tok_embeddings.weight
    untied = count_params(_materialized())
    assert count_params(model) == untied - TINY.vocab_size * TINY.dim
    # both FQNs still in the state dict
    assert {"output.weight", "tok_embeddings.weight"} <= model.state_dict().keys()
    model(_tokens()).sum().backward()
    assert model.tok_embeddings.weight.grad is not None
    # deepcopy and to() keep the tie
    dup = copy.deepcopy(model)
    assert dup.output.weight is dup.tok_embeddings.weight
    moved = copy.deepcopy(model).to(torch.float64)
    assert moved.output.weight is moved.tok_embeddings.weight


def test_8b_and_70b_parameter_counts_on_meta():
    with torch.device("meta"):
        m8 = Transformer(LLAMA3_CONFIGS["8B"])
        m70 = Transformer(LLAMA3_CONFIGS["70B"])
    assert all(p.is_meta for p in m8.parameters())
    assert count_params(m8) == 8_030_261_248  # LLaMA-3 8B
    assert count_params(m70) == pytest.approx(70.55e9, rel=1e-3)
    assert m8.layers[0].feed_forward.w1.out_features == 14336
    assert m70.layers[0].feed_forward.w1.out_features == 28672


def test_ffn_hidden_dim():
    assert ffn_hidden_dim(4096, 1024, 1.3) == 14336
    assert ffn_hidden_dim(64, 32, None) == 192  # int(2*256/3)=170 -> 192


def test_gqa_matches_explicitly_repeated_heads():
    model = _materialized()
    attn = model.layers[0].attention
    assert attn.n_rep == 2
    x = torch.randn(2, 16, TINY.dim)
    cos, sin = model.freqs_cos[:16], model.freqs_sin[:16]
    # An MHA module whose k/v weights repeat each kv head n_rep times.
    mha_args = replace(TINY, n_kv_heads=TINY.n_heads)
    mha = type(attn)(mha_args)
    hd = attn.head_dim
    with torch.no_grad():
        mha.wq.weight.copy_(attn.wq.weight)
        mha.wo.weight.copy_(attn.wo.weight)
        for src, dst in ((attn.wk, mha.wk), (attn.wv, mha.wv)):
            w = src.weight.view(attn.n_kv_heads, hd, -1)
            dst.weight.copy_(w.repeat_interleave(attn.n_rep, dim=0).reshape(-1, TINY.dim))
    torch.testing.assert_close(attn(x, cos, sin), mha(x, cos, sin))


def test_attention_is_causal():
    model = _materialized()
    tok = _tokens()
    out = model(tok)
    tok2 = tok.clone()
    tok2[:, -1] = (tok2[:, -1] + 1) % TINY.vocab_size
    out2 = model(tok2)
    torch.testing.assert_close(out[:, :-1], out2[:, :-1])
    assert not torch.allclose(out[:, -1], out2[:, -1])


def test_bf16_params_give_bf16_logits():
    model = _materialized().to(torch.bfloat16)
    out = model(_tokens())
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()


def test_block_model_and_ffn():
    args = replace(TINY, n_layers=3)
    with torch.device("meta"):
        bm = BlockModel(args)
    bm.to_empty(device="cpu")
    torch.manual_seed(0)
    bm.init_weights()
    x = torch.randn(2, 16, TINY.dim, requires_grad=True)
    y = bm(x)
    assert y.shape == x.shape and len(bm.layers) == 3
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal(bm.freqs_cos, precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta)[0])

    for act in ("relu", "gelu"):
        ffn = FFN(32, 64, act)
        torch.manual_seed(0)
        ffn.init_weights()
        out = ffn(torch.randn(4, 32))
        assert out.shape == (4, 32)
    with pytest.raises(ValueError):
        FFN(4, 8, "tanh")


def test_fake_tensor_forward():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        model = Transformer(replace(LLAMA3_CONFIGS["8B"], n_layers=2))
    with FakeTensorMode(allow_non_fake_inputs=True):
        tok = torch.randint(0, 100, (1, 128), device="meta")
        out = model(tok)
    assert out.shape == (1, 128, 128256)
