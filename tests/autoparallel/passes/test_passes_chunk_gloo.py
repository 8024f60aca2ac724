"""chunk_regions on real processes: 4 gloo ranks, 2x2 ("dp", "tp") mesh.

Each rank plans the tiny model once, applies the plan twice (unchunked, and
with ``chunk_modules``), and runs one training step of each from the same
weights on its own batch chunk: the loss and every (full) gradient of the
chunked step equal the unchunked step's within the reordered-sum tolerance
(``step_tolerance``: 2 * tokens * eps relative, with a floor of that times the
largest entry; docs/chunking.md). Under the default plan (H100 cost model)
and a compute-bound one (the plan shards the layers' compute: batch over
both mesh dims, rows gathered and scattered inside the layers). The same
comparison on LocalTensorMode ranks is in test_passes_chunk_models.py. Slow:
every rank traces and solves on the shared cores.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autoparallel import AutoParallel
from autoparallel.passes import PassOptions

pytestmark = pytest.mark.slow

# model -> (chunk_modules, (batch, seq)): the regions chunked under the
# default plan, as in the LocalTensorMode tests
CASES = {
    # the attention mask, built outside the layers with the literal batch, is split with them
    "llama": ({"model.model.layers.*": "batch"}, (4, 8)),
    # the MoE block's views to (-1, hidden) resolve
    "mixtral": ({"model.model.layers.*.mlp": "batch"}, (4, 8)),
    # our decoder layers: attention with the dense feed-forward or the MoE block
    "llama3": ({"body.layers.*": "batch"}, (4, 8)),
    "moe": ({"body.layers.*": "batch"}, (4, 8)),
}
# ... under the compute-bound plan: whole decoder layers, 2 sequences per rank
COMPUTE_BOUND = {
    "llama": ({"model.model.layers.*": "batch"}, (8, 16)),
    "mixtral": ({"model.model.layers.*": "batch"}, (8, 16)),
    "llama3": ({"body.layers.*": "batch"}, (8, 16)),
    "moe": ({"body.layers.*": "batch"}, (8, 16)),
}


def _build(kind: str):
    """The loss-returning module of ``kind`` and its vocabulary size."""
    from test_passes_chunk_models import _hf_lm, _our_model

    if kind in ("llama", "mixtral"):
        return _hf_lm(kind), 128
    build, args = _our_model(kind)
    return build, args.vocab_size


def _step(parallel, state, local_tokens):
    """Loss and full gradients of one step of ``parallel`` from ``state``
    (full_tensor is a collective: every rank runs this in the same order)."""
    from _parity import _load

    parallel.to_empty(device="cpu")
    _load(parallel, state)
    loss = parallel(local_tokens)
    loss.backward()
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    grads = {n: p.grad.full_tensor() for n, p in parallel.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _chunked_vs_unchunked_step(rank: int, world: int, kind: str, device: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from _parity import _batch_chunk, assert_close_rel, batch_placement, reference_step, slow_compute_device
    from test_passes_chunk_models import step_tolerance

    modules, (batch, seq) = (COMPUTE_BOUND if device == "compute-bound" else CASES)[kind]
    rel = step_tolerance(batch * seq)
    kwargs = {"device": slow_compute_device()} if device == "compute-bound" else {}
    build, vocab = _build(kind)
    tokens = torch.randint(1, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = build()
    # four processes each solve, sharing the cores: give HiGHS time
    with AutoParallel(model, mesh, (tokens.to("meta"),), time_limit=300, **kwargs) as autop:
        autop.add_input_constraints([batch_placement(tokens, mesh)])
        plan = autop.optimize_placement()
        plain = autop.apply_placement(plan)
        chunked = autop.apply_placement(plan, pass_options=PassOptions(chunk_modules=modules))
    stats = plan.pass_stats["chunk_regions"]
    assert stats.regions_chunked == 2 and not stats.refused, stats.refused

    state = reference_step(build, (tokens,))[0]
    local = _batch_chunk(tokens, mesh, rank)
    loss_plain, grads_plain = _step(plain, state, local)
    loss_chunked, grads_chunked = _step(chunked, state, local)
    assert_close_rel(loss_chunked, loss_plain, rel, f"loss on rank {rank}")
    assert grads_chunked.keys() == grads_plain.keys()
    for name, g in grads_plain.items():
        assert_close_rel(grads_chunked[name], g, rel, f"gradient of {name} on rank {rank}")


@pytest.mark.parametrize("device", ["default", "compute-bound"])
@pytest.mark.parametrize("kind", list(CASES))
def test_chunked_equals_unchunked_gloo_2x2(kind, device):
    if kind in ("llama", "mixtral"):
        pytest.importorskip("transformers")
    from _dist_utils import run_ranks

    run_ranks(_chunked_vs_unchunked_step, 4, kind, device, timeout=600)
