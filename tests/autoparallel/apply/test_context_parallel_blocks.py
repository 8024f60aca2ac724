"""The sequence-sharded attention lowering per rank, against one device.

Each of ``n`` simulated ranks (LocalTensorMode) holds its shard of q, k,
v (contiguous, or balanced: chunks ``r`` and ``2n-1-r`` of ``2n``), runs
the lowered forward and backward with the real collectives over a 1-d cp
mesh, and its output, logsumexp, dQ, dK and dV must be its rows of the
single-device kernel's.

The CPU kernel runs as itself. The CUDA kernels (flash, memory-efficient,
cuDNN) cannot run here: stand-ins with their schemas compute with the CPU
kernel and take and return the CUDA kernels' layouts (the efficient
kernel's logsumexp padded to a multiple of 32 rows, cuDNN's
``[B, H, L, 1]``, the random-number state, max_q / max_k, the efficient
kernel's positional ``attn_bias``), checking what the lowering passes
them. That tests the lowering's use of each kernel's arguments, not the
CUDA kernels' numerics."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Replicate, Shard

from autoparallel.apply.attention_blocks import block_plan, natural_chunk_order
from autoparallel.apply.context_parallel import lower_attention
from autoparallel.options.placements import Option, tensor_meta_of
from autoparallel.options.rules.context_parallel import SEQUENCE_SHARDED_ATTENTION

aten = torch.ops.aten
CPU_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class StandIn:
    """A CUDA attention kernel's schema and layouts, computed by the CPU kernel."""

    def __init__(self, real, kernel: str):
        self.real, self.kernel, self._schema = real, kernel, real._schema
        self.backward = "backward" in real._schema.name

    def __repr__(self) -> str:
        return f"StandIn({self._schema.name})"

    def _bind(self, args, kwargs) -> dict:
        arguments = self._schema.arguments
        return {
            a.name: args[i] if i < len(args) else kwargs.get(a.name, a.default_value) for i, a in enumerate(arguments)
        }

    def __call__(self, *args, **kwargs):
        a = self._bind(args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        mask = {"attn_mask": a["attn_bias"]} if a.get("attn_bias") is not None else {}
        lq = q.shape[2]
        if self.backward:
            lse = a["logsumexp"]
            if self.kernel == "efficient":
                assert lse.shape[-1] == math.ceil(lq / 32) * 32, (lse.shape, lq)
                lse = lse[..., :lq]
            elif self.kernel == "cudnn":
                assert lse.shape[-1] == 1 and lse.shape[-2] == lq, lse.shape
                lse = lse.squeeze(-1)
            if "max_q" in a:
                assert (a["max_q"], a["max_k"]) == (lq, k.shape[2]), (a["max_q"], a["max_k"], q.shape, k.shape)
            grad_out = a[self._schema.arguments[0].name]  # "grad_out_" for the efficient kernel
            grads = CPU_BACKWARD(grad_out, q, k, v, a["out"], lse, a["dropout_p"], a["is_causal"], **mask)
            return (*grads, None) if self.kernel == "efficient" else grads
        if "compute_log_sumexp" in a:
            assert a["compute_log_sumexp"]
        out, lse = CPU_FORWARD(q, k, v, a["dropout_p"], a["is_causal"], **mask)
        seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        if self.kernel == "efficient":
            padded = torch.full((*lse.shape[:-1], math.ceil(lq / 32) * 32), float("nan"), dtype=lse.dtype)
            padded[..., :lq] = lse
            return out, padded, seed, offset
        empty = torch.empty(0)
        if self.kernel == "cudnn":
            return out, lse.unsqueeze(-1), empty, empty, lq, k.shape[2], seed, offset, empty
        return out, lse, empty, empty, lq, k.shape[2], torch.zeros(2, dtype=torch.int64), seed, empty


@dataclass(frozen=True)
class Kernel:
    """How the traced graph calls a kernel: forward args from (q, k, v,
    causal, mask), backward args from (grad_out, q, k, v, the forward's
    result, causal, mask, max_q / max_k); results and arguments as the
    graph holds them (max_q / max_k: the global lengths the trace saw, which
    the lowering must replace by each call's own)."""

    forward: object
    backward: object
    forward_args: Callable
    backward_args: Callable
    mask_keyword: bool = False


def _kernels() -> dict[str, Kernel]:
    def stand_ins(kernel, forward, backward):
        return StandIn(forward, kernel), StandIn(backward, kernel)

    flash = stand_ins(
        "flash",
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_backward.default,
    )
    efficient = stand_ins(
        "efficient",
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_efficient_attention_backward.default,
    )
    cudnn = stand_ins(
        "cudnn",
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_cudnn_attention_backward.default,
    )
    return {
        "cpu": Kernel(
            CPU_FORWARD,
            CPU_BACKWARD,
            lambda q, k, v, c, m: (q, k, v, 0.0, c),
            lambda g, q, k, v, r, c, m, x: (g, q, k, v, r[0], r[1], 0.0, c),
            mask_keyword=True,
        ),
        "flash": Kernel(
            *flash,
            lambda q, k, v, c, m: (q, k, v, 0.0, c),
            lambda g, q, k, v, r, c, m, x: (g, q, k, v, r[0], r[1], None, None, *x, 0.0, c, r[6], r[7]),
        ),
        "efficient": Kernel(
            *efficient,
            lambda q, k, v, c, m: (q, k, v, m, True, 0.0, c),
            lambda g, q, k, v, r, c, m, x: (g, q, k, v, m, r[0], r[1], r[2], r[3], 0.0, [True, True, True, False], c),
        ),
        "cudnn": Kernel(
            *cudnn,
            lambda q, k, v, c, m: (q, k, v, m, True, 0.0, c, False),
            lambda g, q, k, v, r, c, m, x: (g, q, k, v, r[0], r[1], r[6], r[7], m, None, None, *x, 0.0, c),
        ),
    }


def _rows(n: int, seq: int, balanced: bool) -> list[torch.Tensor]:
    """The global sequence rows each rank holds, in its local order."""
    if not balanced:
        return list(torch.arange(seq).chunk(n))
    chunks = torch.arange(seq).chunk(2 * n)
    return [torch.cat([chunks[r], chunks[2 * n - 1 - r]]) for r in range(n)]


def _spec(mesh, t):
    if not isinstance(t, torch.Tensor):
        return None
    placement = Shard(2) if t.dim() > 2 else Replicate()
    return DTensorSpec(mesh, (placement,), tensor_meta=tensor_meta_of(t))


def _tensors(args) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def _run(n: int, balanced: bool, causal: bool, kernel: Kernel, mask: torch.Tensor | None = None, seq: int = 16):
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(n + 2 * balanced + 4 * causal)
    q, k, v, g = (torch.randn(2, 3, seq, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    keywords = {"attn_mask": mask} if mask is not None and kernel.mask_keyword else {}
    positional = None if kernel.mask_keyword else mask
    result = kernel.forward(*kernel.forward_args(q, k, v, causal, positional), **keywords)
    lengths = tuple(result[4:6]) if len(result) > 5 else None
    backward_args = kernel.backward_args(g, q, k, v, result, causal, positional, lengths)
    grads = kernel.backward(*backward_args, **keywords)
    rows = _rows(n, seq, balanced)
    forward_args = kernel.forward_args(q, k, v, causal, positional)
    fwd_option = Option(tuple(_spec(mesh, t) for t in result), tuple(_spec(mesh, t) for t in _tensors(forward_args)))
    in_specs = [_spec(mesh, t) for t in _tensors(backward_args)]
    bwd_option = Option(tuple(_spec(mesh, t) for t in grads), tuple(in_specs))

    def local(lm, x, dim=2):
        return lm.rank_map(lambda r: x.index_select(dim, rows[r]).clone())

    with LocalTensorMode(n) as lm:
        coords = lm.rank_map(lambda r: torch.tensor([r]))
        lq, lk, lv, lg = (local(lm, t) for t in (q, k, v, g))
        lmask = None if mask is None else local(lm, mask, dim=mask.dim() - 2)
        lkeywords = {"attn_mask": lmask} if keywords else {}
        lpositional = None if kernel.mask_keyword else lmask
        args = kernel.forward_args(lq, lk, lv, causal, lpositional)
        fn, args, kw = lower_attention(kernel.forward, fwd_option, mesh, coords, args, lkeywords, balanced=balanced)
        lresult = fn(*args, **kw)
        args = kernel.backward_args(lg, lq, lk, lv, lresult, causal, lpositional, lengths)
        fn, args, kw = lower_attention(kernel.backward, bwd_option, mesh, coords, args, lkeywords, balanced=balanced)
        lgrads = fn(*args, **kw)
    for r in range(n):
        for name, mine, full in (
            ("out", lresult[0], result[0]),
            ("logsumexp", lresult[1], result[1]),
            ("dq", lgrads[0], grads[0]),
            ("dk", lgrads[1], grads[1]),
            ("dv", lgrads[2], grads[2]),
        ):
            expected = full.index_select(2, rows[r])
            torch.testing.assert_close(mine._local_tensors[r], expected, msg=lambda m: f"{name} on rank {r}: {m}")


@pytest.fixture
def kernels(monkeypatch):
    """The kernels, their stand-ins registered as the CUDA kernels are."""
    found = _kernels()
    for kernel in found.values():
        for op in (kernel.forward, kernel.backward):
            if isinstance(op, StandIn):
                monkeypatch.setitem(SEQUENCE_SHARDED_ATTENTION, op, SEQUENCE_SHARDED_ATTENTION[op.real])
    return found


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("balanced", [False, True], ids=["contiguous", "balanced"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_lowering_matches_single_device(fake_world, kernels, n, balanced, causal):
    fake_world(n)
    _run(n, balanced, causal, kernels["cpu"])


@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn"])
@pytest.mark.parametrize("balanced", [False, True], ids=["contiguous", "balanced"])
def test_cuda_kernel_layouts_through_the_lowering(fake_world, kernels, kernel, balanced):
    """Causal on 4 ranks with each CUDA kernel's stand-in; 64 tokens (the
    efficient kernel's sequence split needs a multiple of 32; its blocks
    of 8 rows get logsumexps padded to 32)."""
    fake_world(4)
    _run(4, balanced, True, kernels[kernel], seq=64)
    if kernel != "flash":  # flash takes no mask
        mask = torch.full((2, 3, 64, 64), float("-inf"), dtype=torch.float64).triu(1)
        _run(4, balanced, False, kernels[kernel], mask=mask, seq=64)


@pytest.mark.parametrize("balanced", [False, True], ids=["contiguous", "balanced"])
def test_lowering_with_user_mask_matches_single_device(fake_world, kernels, balanced):
    """A causal additive mask given as attn_mask: its rows follow the
    queries' layout, its key dim stays natural (the balanced layout's
    gathered keys are reordered for it)."""
    fake_world(4)
    seq = 16
    mask = torch.full((seq, seq), float("-inf"), dtype=torch.float64).triu(1)
    _run(4, balanced, False, kernels["cpu"], mask=mask, seq=seq)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_balanced_blocks_cover_the_causal_triangle_once(n):
    """Every rank's diagonal (its two chunks, causal) and its 2n-2 blocks
    together cover each (query chunk, key chunk) pair at or below the
    diagonal exactly once, across ranks: the same 2n-2 blocks on every rank."""
    covered = torch.zeros(2 * n, 2 * n, dtype=torch.long)
    gathered = natural_chunk_order(n).argsort()  # gathered position -> global chunk
    for r in range(n):
        plan = block_plan(n, 2, torch.tensor(r), balanced=True)
        assert plan.blocks == 2 * n - 2 and plan.valid is None
        mine = (r, 2 * n - 1 - r)
        for a in mine:
            for b in mine:
                if b <= a:
                    covered[a, b] += 1
        for qc, kc in zip(plan.query_chunk.tolist(), plan.key_chunk.tolist()):
            covered[mine[qc], int(gathered[kc])] += 1
    assert torch.equal(covered, torch.ones(2 * n, 2 * n, dtype=torch.long).tril())
