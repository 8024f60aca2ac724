"""Flatten and unflatten views that keep the sequence split
(:mod:`autoparallel.options.rules.flat_views`).

A linear on ``[B, L, D]`` is traced as ``view`` to ``[B*L, D]``, ``mm``,
``_unsafe_view`` back. With the batch over dp and the sequence over cp and a
local batch of 1, the flattened rows are ``Shard(0)`` over dp and cp: the
flatten gets it (DTensor's ``_StridedShard(0, split_factor=1)`` read as
``Shard(0)``) and the unflatten back gets it from the extra rule. The
layouts are checked against mesh-order chunking of real tensors, the option
lists of the debug LLaMA-3 on a 2x2 ("dp", "cp") mesh hold them, and a step
whose linears run on the sequence split equals the single-device step on
LocalTensorMode ranks.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _parity import LOCAL_TENSOR_PASSES, check_step
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from autoparallel import AutoParallel
from autoparallel.graph_vocab import module_path
from autoparallel.models.llama3 import LLAMA3_CONFIGS, Transformer
from autoparallel.options.placements import plain_shards
from autoparallel.options.rules.flat_views import MergedDims, flattened, merged_dims, unflattened

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

aten = torch.ops.aten
VIEWS = (aten.view.default, aten._unsafe_view.default)
S, R = Shard, Replicate


def _local(t: torch.Tensor, placements, mesh_shape, coords) -> torch.Tensor:
    """The block of ``t`` a rank at ``coords`` holds: each mesh dim, in mesh
    order, splits its dim of what the earlier ones left (DTensor's default
    shard order)."""
    for p, size, c in zip(placements, mesh_shape, coords):
        if isinstance(p, Shard):
            t = t.chunk(size, dim=p.dim)[c]
    return t


def _same_layout(wide_shape, wide_p, narrow_shape, narrow_p, mesh_shape) -> bool:
    """Every rank's block of the wide tensor, viewed flat, is its block of
    the narrow (flattened) tensor."""
    wide = torch.arange(torch.Size(wide_shape).numel()).view(wide_shape)
    narrow = wide.reshape(narrow_shape)
    for coords in itertools.product(*map(range, mesh_shape)):
        a = _local(wide, wide_p, mesh_shape, coords)
        b = _local(narrow, narrow_p, mesh_shape, coords)
        if a.numel() != b.numel() or not torch.equal(a.reshape(-1), b.reshape(-1)):
            return False
    return True


def test_merged_dims():
    assert merged_dims((4, 4096, 64), (16384, 64)) == MergedDims(0, (4, 4096))
    assert merged_dims((2, 2, 4), (2, 8)) == MergedDims(1, (2, 4))
    assert merged_dims((4, 4, 1), (16, 1)) == MergedDims(0, (4, 4))
    assert merged_dims((2, 8, 4, 16), (16, 64)) is None  # two runs merged
    assert merged_dims((4, 1, 8), (4, 8)) == MergedDims(1, (1, 8))  # a squeeze: merging a dim of size 1
    assert merged_dims((4, 8), (4, 8)) is None
    assert merged_dims((16, 64), (4, 4, 64)) is None  # an unflatten read this way round


@pytest.mark.parametrize(
    "mesh_shape, wide_shape, wide_p, narrow_p",
    [
        # batch = dp degree, sequence over cp: the linear's flatten and its inverse
        ((2, 2), (2, 8, 4), (S(0), S(1)), (S(0), S(0))),
        ((4, 8), (4, 64, 3), (S(0), S(1)), (S(0), S(0))),
        # a third mesh dim on the hidden dim, and the sequence over two mesh dims
        ((2, 2, 2), (2, 8, 4), (S(0), S(1), S(2)), (S(0), S(0), S(1))),
        ((2, 2, 2), (2, 8, 4), (S(0), S(1), S(1)), (S(0), S(0), S(0))),
        # the batch over two mesh dims; a replicated and a partial mesh dim kept
        ((2, 2, 2), (4, 8, 4), (S(0), S(0), S(1)), (S(0), S(0), S(0))),
        ((2, 2, 2), (2, 8, 4), (S(0), R(), S(1)), (S(0), R(), S(0))),
        ((2, 2, 2), (2, 8, 4), (S(0), Partial(), S(1)), (S(0), Partial(), S(0))),
        # a batch of one: the sequence split alone
        ((2, 2), (1, 8, 4), (S(1), S(1)), (S(0), S(0))),
    ],
)
def test_contiguous_layouts_flatten_and_unflatten(mesh_shape, wide_shape, wide_p, narrow_p):
    narrow_shape = (wide_shape[0] * wide_shape[1], *wide_shape[2:])
    merge = merged_dims(wide_shape, narrow_shape)
    assert flattened(wide_p, mesh_shape, merge) == narrow_p
    assert unflattened(narrow_p, mesh_shape, merge) == wide_p
    plain = tuple(R() if isinstance(p, Partial) else p for p in wide_p)
    assert _same_layout(
        wide_shape, plain, narrow_shape, tuple(R() if isinstance(p, Partial) else p for p in narrow_p), mesh_shape
    )


@pytest.mark.parametrize(
    "mesh_shape, wide_shape, wide_p",
    [
        ((2, 2), (4, 8, 4), (S(0), S(1))),  # local batch 2: rows strided
        ((2, 2), (2, 8, 4), (S(1), S(0))),  # the sequence on the earlier mesh dim
        ((2, 2), (4, 8, 4), (R(), S(1))),  # the batch whole: strided
    ],
)
def test_strided_layouts_have_no_plain_flatten(mesh_shape, wide_shape, wide_p):
    narrow_shape = (wide_shape[0] * wide_shape[1], *wide_shape[2:])
    merge = merged_dims(wide_shape, narrow_shape)
    assert flattened(wide_p, mesh_shape, merge) is None
    # and no plain layout of the flat rows is the same one
    for narrow_p in itertools.product([R(), S(0), S(1)], repeat=len(mesh_shape)):
        assert not _same_layout(wide_shape, wide_p, narrow_shape, narrow_p, mesh_shape), narrow_p


def test_unflatten_needs_the_leading_mesh_dims_to_cover_the_outer_dim():
    # 4 x 64 rows over 2 x 4 ranks: 2 batch rows per dp rank, split in 4
    # blocks of half a row each over cp: not a plain layout of [4, 64]
    assert unflattened((S(0), S(0)), (2, 4), MergedDims(0, (4, 64))) is None
    assert unflattened((S(0), S(0)), (4, 2), MergedDims(0, (4, 64))) == (S(0), S(1))
    # one mesh dim on the flat dim: DTensor's rule covers it
    assert unflattened((S(0), R()), (4, 2), MergedDims(0, (4, 64))) is None
    # dims after the merged one shift
    assert unflattened((S(0), S(0), S(1)), (2, 2, 2), MergedDims(0, (2, 8))) == (S(0), S(1), S(2))


def test_strided_shard_of_one_group_reads_as_shard():
    assert plain_shards((S(0), _StridedShard(0, split_factor=1))) == (S(0), S(0))
    strided = (S(0), _StridedShard(0, split_factor=2))
    assert plain_shards(strided) is strided


class LlamaLoss(nn.Module):
    """The debug LLaMA-3 and its next-token loss: one scalar per step."""

    def __init__(self, seq: int):
        super().__init__()
        self.model = Transformer(replace(LLAMA3_CONFIGS["debug"], max_seq_len=seq))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


B, SEQ = 2, 64  # batch = dp degree


def _meta_inputs():
    return (torch.empty(B, SEQ, dtype=torch.long, device="meta"),) * 2


def _llama_strategies() -> dict:
    """The options of the debug LLaMA-3 traced on a 2x2 ("dp", "cp") mesh."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    with torch.device("meta"):
        model = LlamaLoss(SEQ)
    with AutoParallel(model, mesh, _meta_inputs()) as autop:
        return autop.strategies


def _labels(strategy) -> set[str]:
    return {o.label for o in strategy.options}


def test_linear_views_offer_the_sequence_split(fake_world):
    fake_world(4)
    strategies = _llama_strategies()
    flat, back = 0, 0
    for node, strategy in strategies.items():
        if node.target not in VIEWS or ".layers." not in (module_path(node) or ""):
            continue
        shapes = (tuple(node.args[0].meta["val"].shape), tuple(node.meta["val"].shape))
        if shapes == ((B, SEQ, 64), (B * SEQ, 64)):
            assert "S(0)S(1)->S(0)S(0)" in _labels(strategy), (node.name, sorted(_labels(strategy)))
            flat += 1
        elif shapes == ((B * SEQ, 64), (B, SEQ, 64)):
            assert "S(0)S(0)->S(0)S(1)" in _labels(strategy), (node.name, sorted(_labels(strategy)))
            back += 1
    # forward and backward, every linear of both layers
    assert flat >= 8 and back >= 8, (flat, back)


def test_flatten_reads_dtensors_strided_shard_of_one_group(fake_world, monkeypatch):
    """Without the extra rule, the flatten still takes the sequence split
    where DTensor's view rule gives ``_StridedShard(0, split_factor=1)``."""
    from torch.distributed.tensor._ops._view_ops import propagate_shape_and_sharding, view_groups

    from autoparallel.options import strategies as strategies_module

    rule = view_groups((B, SEQ, 64), (B * SEQ, 64))
    _, out = propagate_shape_and_sharding((S(0), S(1)), (B, SEQ, 64), rule, (2, 2), True)
    if tuple(out) != (S(0), _StridedShard(0, split_factor=1)):
        pytest.skip(f"DTensor's flatten of S(0)S(1) gives {out} on this torch")
    monkeypatch.setattr(strategies_module, "EXTRA_RULES", {})
    fake_world(4)
    strategies = _llama_strategies()
    flat = [
        (node, strategy)
        for node, strategy in strategies.items()
        if node.target in VIEWS and tuple(node.meta["val"].shape) == (B * SEQ, 64)
    ]
    assert flat
    for node, strategy in flat:
        assert "S(0)S(1)->S(0)S(0)" in _labels(strategy), node.name
        assert strategy.source == "dtensor"


def test_step_with_linears_on_the_sequence_split_matches_single_device(fake_world):
    """Every linear of the layers runs on the rank's tokens (its ``mm``
    forward and input-gradient rows ``S(0)`` over dp and cp); the views
    around them take the new layouts and the step equals single device."""
    fake_world(4)
    torch.manual_seed(0)
    tokens, targets = torch.randint(0, 256, (B, SEQ)), torch.randint(0, 256, (B, SEQ))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    with torch.device("meta"):
        model = LlamaLoss(SEQ)
    with AutoParallel(model, mesh, _meta_inputs()) as autop:
        autop.add_input_constraints([(S(0), R()), (S(0), R())])
        pinned = 0
        for node in autop.traced.gm.graph.nodes:
            val = node.meta.get("val")
            if node.target is aten.mm.default and ".layers." in (module_path(node) or "") and val.shape[0] == B * SEQ:
                autop.add_node_constraint(node, (S(0), S(0)))
                pinned += 1
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan, pass_options=LOCAL_TENSOR_PASSES)
    assert pinned >= 28, pinned  # 7 linears x 2 layers, forward and input gradient
    views = [n for n in plan.nodes.values() if n.op in {str(v) for v in VIEWS}]
    taken = {(n.phase, n.input_placements[0], n.output_placements) for n in views}
    assert ("forward", "S(0)S(1)", "S(0)S(0)") in taken, taken
    assert ("forward", "S(0)S(0)", "S(0)S(1)") in taken, taken
    assert ("backward", "S(0)S(0)", "S(0)S(1)") in taken, taken
    check_step(parallel, mesh, lambda: LlamaLoss(SEQ), (tokens, targets), rel=1e-4)
