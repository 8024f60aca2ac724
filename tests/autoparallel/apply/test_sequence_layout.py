"""The balanced sequence layout (causal load balancing for context
parallelism): the layout functions, redistributions between the two
layouts on simulated ranks, and which shards of a LLaMA-3 plan take it."""

from __future__ import annotations

import pytest
import torch
from _parity import check_step, plan_and_apply, slow_compute_device
from test_context_parallel import LlamaLoss

from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from autoparallel.apply import local_graph
from autoparallel.apply.balanced_layout import (
    balanced_chunk_order,
    balanced_shard_of_replicated,
    from_balanced,
    to_balanced,
)
from autoparallel.apply.redistribute import redistribute
from autoparallel.apply.sequence_layout import SequenceLayout, _why_not_balanced

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_balanced_shards_are_head_and_tail_chunks(n):
    x = torch.arange(4 * n * 3).reshape(4 * n, 3)
    shards = [balanced_shard_of_replicated(x, 0, n, torch.tensor([r])) for r in range(n)]
    c = x.shape[0] // (2 * n)
    for r, s in enumerate(shards):
        assert torch.equal(s, torch.cat([x[r * c : (r + 1) * c], x[(2 * n - 1 - r) * c : (2 * n - r) * c]]))
    assert torch.equal(torch.cat(shards), to_balanced(x, 0, n))
    assert torch.equal(from_balanced(to_balanced(x, 0, n), 0, n), x)
    assert sorted(balanced_chunk_order(n)) == list(range(2 * n))


def _spec(mesh, placements, shape):
    meta = TensorMeta(torch.Size(shape), torch.empty(shape).stride(), torch.float32)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


def test_redistribute_between_contiguous_and_balanced_shards(fake_world):
    fake_world(4)
    n = 4
    mesh = init_device_mesh("cpu", (n,))
    x = torch.randn(16, 8)
    s0, s1, rep = (_spec(mesh, [p], x.shape) for p in (Shard(0), Shard(1), Replicate()))
    partial = _spec(mesh, [Partial()], x.shape)
    bal = frozenset({0})
    with LocalTensorMode(n) as lm:
        coords = lm.rank_map(lambda r: torch.tensor([r]))
        natural = lm.rank_map(lambda r: x.chunk(n)[r].clone())
        balanced = lm.rank_map(lambda r: balanced_shard_of_replicated(x, 0, n, torch.tensor([r])))
        parts = lm.rank_map(lambda r: x / n)

        def each(t):
            return [t._local_tensors[r] for r in range(n)]

        def expect(t, want):
            for r, got in enumerate(each(t)):
                torch.testing.assert_close(got, want(r), msg=lambda m: f"rank {r}: {m}")

        expect(redistribute(natural, s0, s0, coords, dst_balanced=bal), lambda r: each(balanced)[r])
        expect(redistribute(balanced, s0, s0, coords, src_balanced=bal), lambda r: x.chunk(n)[r])
        expect(redistribute(balanced, s0, rep, coords, src_balanced=bal), lambda r: x)
        expect(redistribute(x, rep, s0, coords, dst_balanced=bal), lambda r: each(balanced)[r])
        expect(redistribute(parts, partial, s0, coords, dst_balanced=bal), lambda r: each(balanced)[r])
        expect(redistribute(balanced, s0, s1, coords, src_balanced=bal), lambda r: x.chunk(n, dim=1)[r])
        columns = lm.rank_map(lambda r: x.chunk(n, dim=1)[r].clone())
        expect(redistribute(columns, s1, s0, coords, dst_balanced=bal), lambda r: each(balanced)[r])
        expect(redistribute(natural, s0, s0, coords, src_balanced=bal, dst_balanced=bal), lambda r: x.chunk(n)[r])


def test_redistribute_a_balanced_shard_split_further_by_a_later_mesh_dim(fake_world):
    """On a (cp, tp) mesh splitting one tensor dim over both, the cp shard is
    balanced and tp splits it contiguously (DTensor's nesting in mesh order);
    changing the cp layout gathers tp first."""
    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.randn(16, 4)
    nested, cp_only, rep = (
        _spec(mesh, p, x.shape) for p in ([Shard(0), Shard(0)], [Shard(0), Replicate()], [Replicate()] * 2)
    )
    bal = frozenset({0})
    with LocalTensorMode(4) as lm:
        coords = lm.rank_map(lambda r: torch.tensor([r // 2, r % 2]))

        def cp_shard(r, balanced):
            if balanced:
                return balanced_shard_of_replicated(x, 0, 2, torch.tensor([r // 2]))
            return x.chunk(2)[r // 2]

        def per_rank(t):
            return [t._local_tensors[r] for r in range(4)]

        natural = lm.rank_map(lambda r: cp_shard(r, False).chunk(2)[r % 2].clone())
        balanced = lm.rank_map(lambda r: cp_shard(r, True).chunk(2)[r % 2].clone())
        cases = [
            (balanced, nested, cp_only, bal, bal, lambda r: cp_shard(r, True)),
            (balanced, nested, rep, bal, frozenset(), lambda r: x),
            (natural, nested, nested, frozenset(), bal, lambda r: per_rank(balanced)[r]),
            (balanced, nested, nested, bal, frozenset(), lambda r: per_rank(natural)[r]),
        ]
        for value, src, dst, src_bal, dst_bal, want in cases:
            got = redistribute(value, src, dst, coords, src_balanced=src_bal, dst_balanced=dst_bal)
            for r in range(4):
                torch.testing.assert_close(per_rank(got)[r], want(r))


def test_a_shard_without_two_equal_chunks_is_not_balanced(fake_world):
    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2))
    assert _why_not_balanced(_spec(mesh, [Shard(0), Shard(0)], (8, 4)), 0) is None  # nested: 4 rows on dim 0
    assert _why_not_balanced(_spec(mesh, [Shard(0), Shard(0)], (8, 4)), 1) is None
    assert "odd" in _why_not_balanced(_spec(mesh, [Shard(0), Shard(0)], (12, 4)), 1)
    assert "strided" in _why_not_balanced(_spec(mesh, [Replicate(), _StridedShard(0, split_factor=2)], (8, 4)), 1)
    assert "odd" in _why_not_balanced(_spec(mesh, [Replicate(), Shard(0)], (6, 4)), 1)
    assert _why_not_balanced(_spec(mesh, [Replicate(), Replicate()], (6, 4)), 1) is None


@pytest.fixture
def recorded_layouts(monkeypatch):
    """The sequence layouts apply chose, in order."""
    seen: list[SequenceLayout] = []
    real = local_graph.plan_sequence_layout

    def record(*args):
        seen.append(real(*args))
        return seen[-1]

    monkeypatch.setattr(local_graph, "plan_sequence_layout", record)
    return seen


def test_llama_cp_step_runs_on_balanced_shards(fake_world, recorded_layouts):
    """Every causal attention op of the LLaMA-3 debug model split over "cp"
    (mesh dim 1) runs on the balanced layout, the ops around it (rotary
    embeddings from the frequency buffer included: compute so slow that the
    plan splits them too) share it, and the step equals one device:
    positions line up with the permuted rows."""
    fake_world(4)
    torch.manual_seed(0)
    seq = 64
    tokens, targets = torch.randint(0, 256, (2, seq)), torch.randint(0, 256, (2, seq))

    def build():
        return LlamaLoss(seq)

    parallel, plan, mesh = plan_and_apply(
        build, (tokens, targets), mesh_dim_names=("dp", "cp"), device=slow_compute_device()
    )
    (layout,) = recorded_layouts
    assert len(layout.attention[1]) == 4  # 2 layers, forward and backward
    balanced_ops = {n.target for n in layout.balanced}
    assert {torch.ops.aten.mul.Tensor, torch.ops.aten.neg.default} <= balanced_ops  # the rotary embeddings
    assert all(n.op == "call_function" for n in layout.balanced)
    check_step(parallel, mesh, build, (tokens, targets), rel=1e-4)


def test_llama_cp_step_on_contiguous_shards(fake_world, monkeypatch):
    """The contiguous layout (what a group that cannot be balanced keeps)
    still computes the same step."""
    fake_world(4)
    monkeypatch.setattr(local_graph, "plan_sequence_layout", lambda *args: SequenceLayout())
    torch.manual_seed(0)
    seq = 64
    tokens, targets = torch.randint(0, 256, (2, seq)), torch.randint(0, 256, (2, seq))

    def build():
        return LlamaLoss(seq)

    parallel, plan, mesh = plan_and_apply(build, (tokens, targets), mesh_dim_names=("dp", "cp"))
    check_step(parallel, mesh, build, (tokens, targets), rel=1e-4)
