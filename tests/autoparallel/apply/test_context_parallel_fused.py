"""Context parallelism with the CUDA attention kernels (flash,
memory-efficient, cuDNN).

They cannot run on a CPU, but they trace under fake tensors
(``traced_attention_kernel``): a LLaMA-style model plans with the sequence
split over a "cp" dim and the plan applies, the local graph running each
causal attention as the rank's diagonal block and one batched call of the
off-diagonal blocks with the same kernel, K/V gathered and dK/dV
reduce-scattered over "cp". Their argument and logsumexp layouts (the
efficient kernel's padding to 32 rows, cuDNN's trailing unit dim) are
checked numerically on CPU by stand-ins that compute with the CPU kernel
and return the CUDA kernels' layouts."""

from __future__ import annotations

import pytest
import torch
from _parity import plan_and_apply
from test_context_parallel import SDPA, LlamaLoss

from autoparallel.apply import local_graph
from autoparallel.apply.collectives import collectives
from autoparallel.apply.sequence_layout import SequenceLayout
from autoparallel.capture.attention_kernels import traced_attention_kernel

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

aten = torch.ops.aten
KERNELS = {
    "flash": (
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_backward.default,
    ),
    "efficient": (
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_efficient_attention_backward.default,
    ),
    "cudnn": (
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_cudnn_attention_backward.default,
    ),
}


@pytest.mark.parametrize("balanced", [False, True], ids=["contiguous", "balanced"])
@pytest.mark.parametrize(
    "kernel",
    ["cudnn", pytest.param("flash", marks=pytest.mark.slow), pytest.param("efficient", marks=pytest.mark.slow)],
)
def test_fused_kernel_plans_and_applies_sequence_split(fake_world, monkeypatch, kernel, balanced):
    """``balanced``: the local graph built on the balanced sequence layout
    (apply's default for causal attention); otherwise on the contiguous
    one: the graph's shapes, not its numbers, are checked here."""
    fake_world(4)
    seq = 64  # a multiple of 32: the efficient kernel's logsumexp is not padded
    tokens = torch.randint(0, 256, (2, seq))
    forward, backward = KERNELS[kernel]
    if not balanced:
        monkeypatch.setattr(local_graph, "plan_sequence_layout", lambda *args: SequenceLayout())
    with traced_attention_kernel(kernel):
        parallel, plan, mesh = plan_and_apply(lambda: LlamaLoss(seq), (tokens, tokens), mesh_dim_names=("dp", "cp"))
    attention = [n for n in plan.nodes.values() if n.op in (str(forward), str(backward))]
    assert len(attention) == 4, [n.op for n in plan.nodes.values() if "attention" in n.op]
    assert not [n for n in plan.nodes.values() if n.op == SDPA]
    for n in attention:
        # q, k, v (and the backward's grad_out) split on the sequence over "cp"
        assert all(p.endswith("S(2)") for p in n.input_placements[:3]), (n.op, n.input_placements)
    graph = parallel.parallel_graph.graph
    # per layer: the diagonal block (causal) and one batched call of the
    # off-diagonal blocks: local q [B, H, L/cp, D] = [2, 4, 32, 16]; the
    # blocks balanced: 2n-2 = 2 of L/(2 cp) rows, [2 * 2, 4, 16, 16];
    # contiguous: n-1 = 1 of L/cp rows, [1 * 2, 4, 32, 16]
    block = (4, 4, 16, 16) if balanced else (2, 4, 32, 16)
    for op in (forward, backward):
        found = [n for n in graph.nodes if n.target is op]
        assert len(found) == 4, (op, len(found))
        causal = [_argument(n, "is_causal") for n in found]
        assert sorted(causal) == [False, False, True, True], (op, causal)
        query = _argument(found[0], "query").meta["val"]
        shapes = {
            c: {tuple(_argument(n, "query").meta["val"].shape) for n, c2 in zip(found, causal) if c2 == c}
            for c in (True, False)
        }
        assert shapes == {True: {(2, 4, 32, 16)}, False: {block}}, (op, shapes, query.shape)
    kinds = {(c.kind, c.mesh_dim, c.phase) for c in collectives(parallel.parallel_graph, mesh)}
    assert ("all_gather_into_tensor", 1, "forward") in kinds
    assert ("reduce_scatter_tensor", 1, "backward") in kinds


def _argument(node, name: str):
    """A call's schema argument: given by position or by name, else its default."""
    arguments = node.target._schema.arguments
    position = [a.name for a in arguments].index(name)
    if position < len(node.args):
        return node.args[position]
    return node.kwargs.get(name, arguments[position].default_value)


def test_fused_kernel_with_bias_splits_its_rows(fake_world):
    """cuDNN attention given a mask (its positional attn_bias, expanded to
    [B, H, L, L]): under the "cp" role the bias's query rows split like the
    queries, its key dim whole, and the plan applies."""
    from test_fused_attention import Attention, _inputs

    fake_world(4)
    forward, backward = KERNELS["cudnn"]
    with traced_attention_kernel("cudnn"):
        parallel, plan, _ = plan_and_apply(lambda: Attention(mask=True), _inputs(), mesh_dim_names=("dp", "cp"))
    for op, bias in ((forward, 3), (backward, 8)):
        (n,) = [n for n in plan.nodes.values() if n.op == str(op)]
        assert all(p.endswith("S(2)") for p in n.input_placements[:3]), (n.op, n.input_placements)
        assert n.input_placements[bias].endswith("S(2)"), (n.op, n.input_placements)
    # the lowering gathers K/V and runs one call of the kernel with the local rows of the bias
    calls = [n for n in parallel.parallel_graph.graph.nodes if n.target in (forward, backward)]
    assert len(calls) == 2, calls
