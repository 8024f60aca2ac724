"""LLaMA-3 transformer, in the style of torchtitan's llama3 model.

Written for planning: every op is a plain real-valued aten op, so DTensor
sharding propagation sees ordinary matmuls, pointwise ops and views (RoPE uses
real cos/sin buffers instead of complex multiplication).

Build on the meta device, then materialise::

    >>> with torch.device("meta"):
    ...     model = Transformer(LLAMA3_CONFIGS["debug"])
    >>> model.to_empty(device="cpu")  # doctest: +SKIP
    >>> torch.manual_seed(0); model.init_weights()  # doctest: +SKIP

Tracing note: with parameters on the meta device, SDPA takes its math path
(bmm + softmax + bmm) in traced graphs. Parameters that are fake tensors on
"cpu" (``with FakeTensorMode(allow_non_fake_inputs=True):
model.to_empty(device="cpu")``) keep the
fused ``_scaled_dot_product_flash_attention_for_cpu`` op.

RoPE convention: "rotate half" (the first and second halves of each head
dimension form the rotated pairs), as in HF transformers. Meta's original
checkpoints use the interleaved-pair convention; loading them needs the usual
wq/wk row permutation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from autoparallel.capture.activation_checkpointing import apply_ac  # re-exported

__all__ = [
    "ModelArgs",
    "LLAMA3_CONFIGS",
    "RMSNorm",
    "precompute_rope",
    "apply_rotary_emb",
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "Transformer",
    "ffn_hidden_dim",
    "count_params",
    "register_rope_buffers",
    "init_rope_buffers",
    "apply_ac",
]


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters; frozen so the shared presets can't be edited in
    place (derive variants with ``dataclasses.replace``)."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: same as n_heads (no GQA)
    vocab_size: int = 128256
    multiple_of: int = 256  # SwiGLU hidden dim is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 8192
    tie_embeddings: bool = False
    # torchtitan's depth_init: output-projection std shrinks with the layer id
    # (True) or with the total depth (False).
    depth_init: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


LLAMA3_CONFIGS: dict[str, ModelArgs] = {
    "debug": ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        multiple_of=32,
        rope_theta=500000.0,
        max_seq_len=64,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
    ),
}
LLAMA3_CONFIGS["tiny"] = replace(LLAMA3_CONFIGS["debug"])


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """SwiGLU hidden size as in LLaMA: 2/3 of 4*dim, scaled, rounded up.

    >>> ffn_hidden_dim(4096, 1024, 1.3)
    14336
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, normalised in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def init_weights(self) -> None:
        self.reset_parameters()


def precompute_rope(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, head_dim] for rotate-half RoPE (fp32)."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, inv_freq)  # [seq, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [seq, head_dim]
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [bsz, seq, heads, head_dim] by cos/sin [seq, head_dim]."""
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).type_as(x)


def trunc_normal(w: torch.Tensor, std: float) -> None:
    """torchtitan's weight init: a normal of ``std`` truncated at +-2, in place."""
    # torchtitan truncates at absolute +-2 (not +-2 std).
    nn.init.trunc_normal_(w, mean=0.0, std=std, a=-2.0, b=2.0)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} not a multiple of n_kv_heads={self.n_kv_heads}")
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq = apply_rotary_emb(xq, rope_cos, rope_sin)
        xk = apply_rotary_emb(xk, rope_cos, rope_sin)
        xk = self._repeat_kv(xk)
        xv = self._repeat_kv(xv)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
        out = out.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.head_dim)
        return self.wo(out)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        # [b, s, kv, d] -> [b, s, kv * n_rep, d]; each kv head serves n_rep
        # consecutive query heads.
        if self.n_rep == 1:
            return x
        b, s, kv, d = x.shape
        return x.unsqueeze(3).expand(b, s, kv, self.n_rep, d).reshape(b, s, kv * self.n_rep, d)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal(linear.weight, 0.02)
        trunc_normal(self.wo.weight, init_std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
    ):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        trunc_normal(self.w1.weight, 0.02)
        for linear in (self.w2, self.w3):
            trunc_normal(linear.weight, init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(
            args.dim,
            ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier),
        )
        if args.depth_init:
            self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
        else:
            self.weight_init_std = 0.02 / (2 * args.n_layers) ** 0.5

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cos, rope_sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


def register_rope_buffers(module: nn.Module, args: ModelArgs) -> None:
    """Register non-persistent fp32 ``freqs_cos``/``freqs_sin`` on ``module``."""
    # Non-persistent: derived data, not checkpointed; recomputed by
    # _init_buffers so a meta-built model gets real values after to_empty.
    cos, sin = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta)
    module.register_buffer("freqs_cos", cos, persistent=False)
    module.register_buffer("freqs_sin", sin, persistent=False)


def init_rope_buffers(module: nn.Module, args: ModelArgs, buffer_device=None) -> None:
    """(Re)compute the RoPE buffers, e.g. after ``to_empty`` from meta."""
    device = buffer_device if buffer_device is not None else module.freqs_cos.device
    cos, sin = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta, device=device)
    module.freqs_cos = cos
    module.freqs_sin = sin


class Transformer(nn.Module):
    """tokens [bsz, seqlen] int64 -> logits [bsz, seqlen, vocab] (param dtype)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        register_rope_buffers(self, args)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        cos = self.freqs_cos[:seqlen]
        sin = self.freqs_sin[:seqlen]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def _apply(self, fn, recurse=True):
        # to_empty()/to() replace each module's parameters independently,
        # which would silently untie a shared embedding/output weight.
        out = super()._apply(fn, recurse)
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        return out

    def _init_buffers(self, buffer_device=None) -> None:
        init_rope_buffers(self, self.args, buffer_device)

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Deterministic given the RNG state (torchtitan's scheme)."""
        self._init_buffers(buffer_device)
        final_out_std = self.args.dim**-0.5
        cutoff = 3.0
        if self.args.tie_embeddings:
            # One matrix serves both roles; use the output projection's scale
            # (std 1 embeddings would make logits explode).
            nn.init.trunc_normal_(
                self.tok_embeddings.weight,
                mean=0.0,
                std=final_out_std,
                a=-cutoff * final_out_std,
                b=cutoff * final_out_std,
            )
        else:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers:
            layer.init_weights()
        self.norm.reset_parameters()
        if not self.args.tie_embeddings:
            nn.init.trunc_normal_(
                self.output.weight,
                mean=0.0,
                std=final_out_std,
                a=-cutoff * final_out_std,
                b=cutoff * final_out_std,
            )

    reset_parameters = init_weights


def count_params(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once); meta-safe."""
    return sum(p.numel() for p in model.parameters())
