"""apply_placement(compile=True): the step's forward and backward graphs
compiled by Inductor (C++ backend on CPU) compute what the eager graphs
compute, keep the plan's collectives in order, fall back to the eager graph
(with a warning naming it and the node) where Inductor fails, and compose
with the project's CUDA graphs.

Single-process tests use the fake process group (collectives deterministic:
all-gather copies, reduce-scatter keeps the local chunk), a valid compiled
vs eager comparison; the 4-rank gloo runs (slow) train 3 AdamW steps of our
LLaMA-3 and MoE debug models, HF Llama and GPT-2, with activation
checkpointing and with chunking, compiled against eager."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from autoparallel import AutoParallel, torch_compat
from autoparallel.apply import inductor
from autoparallel.apply.cudagraphs import CudaGraphError
from autoparallel.apply.runtime import ParallelStep

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning")]

REL = 1e-5


def _ffn():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def _plan_ffn(fake_world):
    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2))
    with torch.device("meta"):
        model = _ffn()
    batch = (Shard(0),) * 2
    autop = AutoParallel(model, mesh, torch.empty(16, 64, device="meta"))
    autop.__enter__()
    autop.add_input_constraints([batch])
    autop.add_output_constraints([batch])
    autop.add_parameter_memory_constraint(high=None)
    return autop, autop.optimize_placement()


def _step(parallel, state, x):
    parallel.to_empty(device="cpu")
    parallel.load_state_dict(state)
    out = parallel(x)
    out.pow(2).sum().backward()
    return out.detach(), {n: p.grad.to_local().clone() for n, p in parallel.named_parameters()}


def _assert_same_step(a, b):
    from _parity import assert_close_rel

    assert_close_rel(a[0], b[0], REL, "output")
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert_close_rel(a[1][name], b[1][name], REL, f"gradient of {name}")


def test_compiled_step_equals_eager_and_keeps_collective_order(fake_world):
    autop, plan = _plan_ffn(fake_world)
    try:
        eager = autop.apply_placement(plan)
        compiled = autop.apply_placement(plan, compile=True)
    finally:
        autop.__exit__(None, None, None)
    step = compiled.parallel_state.step
    assert step.compiled is not None and eager.parallel_state.step.compiled is None
    fw, bw = step.compiled.records
    assert fw.compiled and bw.compiled, step.compiled.describe()
    # the generated code calls the plan's collectives (and their waits) in the graph's order
    graphs = step.graphs
    assert "all_gather_into_tensor" in inductor.collective_sequence(graphs.fw)
    assert "reduce_scatter_tensor" in inductor.collective_sequence(graphs.bw)
    assert fw.collective_order_kept and bw.collective_order_kept
    assert inductor.compiled_collective_sequence(fw.source_code) == inductor.collective_sequence(graphs.fw)
    # kernels, not FX code: the generated wrapper runs C++ kernels
    assert "cpp_fused" in fw.source_code
    assert step.compiled.settings["reorder_for_peak_memory"] is False

    state = _ffn().state_dict()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    _assert_same_step(_step(compiled, state, x), _step(eager, state, x))


def test_graph_inductor_cannot_compile_runs_eagerly_with_a_warning(fake_world, monkeypatch):
    """A failing lowering (relu's) makes the forward graph eager, naming the
    node; the backward still compiles; the step computes what eager does.
    A compile call that raises outright makes both graphs eager."""
    from torch._inductor import lowering

    autop, plan = _plan_ffn(fake_world)

    def broken(*args, **kwargs):
        raise NotImplementedError("no lowering for this op here")

    try:
        eager = autop.apply_placement(plan)
        monkeypatch.setitem(lowering.lowerings, torch.ops.aten.relu.default, broken)
        with pytest.warns(inductor.InductorFallbackWarning) as caught:
            mixed = autop.apply_placement(plan, compile=True)
        monkeypatch.undo()

        def raising(*args, **kwargs):
            raise RuntimeError("compiler crashed")

        monkeypatch.setattr(torch_compat, "inductor_compile", raising)
        with pytest.warns(inductor.InductorFallbackWarning) as caught_all:
            all_eager = autop.apply_placement(plan, compile=True)
    finally:
        autop.__exit__(None, None, None)

    fw, bw = mixed.parallel_state.step.compiled.records
    assert not fw.compiled and bw.compiled
    assert fw.failed_nodes == ["relu"]
    (message,) = [str(w.message) for w in caught]
    assert "forward graph" in message and "relu" in message and "no lowering" in message
    messages = [str(w.message) for w in caught_all]
    assert len(messages) == 2 and "forward graph" in messages[0] and "backward graph" in messages[1]
    assert not any(r.compiled for r in all_eager.parallel_state.step.compiled.records)

    state = _ffn().state_dict()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    reference = _step(eager, state, x)
    _assert_same_step(_step(mixed, state, x), reference)
    _assert_same_step(_step(all_eager, state, x), reference)


def test_compile_with_cudagraphs_is_refused_on_cpu_before_compiling(fake_world, monkeypatch):
    autop, plan = _plan_ffn(fake_world)

    def must_not_compile(graphs):
        raise AssertionError("compiled although CUDA graphs were refused")

    monkeypatch.setattr("autoparallel.apply_plan.compile_step", must_not_compile)
    try:
        with pytest.raises(CudaGraphError, match="CUDA device"):
            autop.apply_placement(plan, compile=True, cudagraphs=True)
    finally:
        autop.__exit__(None, None, None)


class _RecordingSession:
    """Stands in for a CudaGraphSession: records which callable each graph gets."""

    def __init__(self):
        self.calls = []
        self.forward = self._graph("forward")
        self.backward = self._graph("backward")

    def _graph(self, name):
        def call(fn, args):
            self.calls.append((name, fn))
            return tuple(fn(*args))

        return call


def test_cuda_graphs_capture_the_compiled_callables():
    """With compile and CUDA graphs, what the session captures is Inductor's
    callable, not the FX graph (the graphs stay the plan's for inspection)."""
    graphs = type("G", (), {"fw": lambda *a: (a[0] * 2,), "bw": lambda *a: (a[0],), "num_fwd_outputs": 1})()
    compiled = inductor.CompiledStep(lambda *a: (a[0] * 3,), lambda *a: (a[0] + 1,), (), {})
    step = ParallelStep(local=None, graphs=graphs, compiled=compiled)
    step.cuda_graphs = _RecordingSession()
    (out,) = step.run_forward([torch.ones(2)])
    assert out.tolist() == [3.0, 3.0]
    assert step.run_backward([torch.ones(2)])[0].tolist() == [2.0, 2.0]
    assert step.cuda_graphs.calls == [("forward", compiled.forward), ("backward", compiled.backward)]


def test_inductor_settings_keep_only_what_this_torch_has():
    import torch._inductor.config as config

    settings = torch_compat.inductor_settings({**torch_compat.INDUCTOR_KEEP_PLAN, "no_such_setting.at_all": 1})
    assert "no_such_setting.at_all" not in settings
    # the settings that move or merge collectives on this torch are all off
    for key in ("reorder_for_compute_comm_overlap", "reorder_for_peak_memory", "bucket_all_gathers_fx"):
        if hasattr(config, key):
            assert key in settings
    with config.patch(settings):
        assert config.reorder_for_peak_memory is False and config.triton.cudagraphs is False


def test_collective_sequence_of_generated_code_ignores_strings_and_comments():
    code = (
        "# Original ATen: [_c10d_functional.all_gather_into_tensor]\n"
        "buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(arg0_1, 4, '5')\n"
        "assert_size_stride(buf0, (16, 64), (64, 1), 'torch.ops._c10d_functional.all_gather_into_tensor.default')\n"
        "torch.ops._c10d_functional.reduce_scatter_tensor_out.default(buf1, 'sum', 2, '3', out=buf2)\n"
        "torch.ops._c10d_functional.wait_tensor.default(buf0)\n"
        "torch.ops._c10d_functional.all_reduce_.default(buf3, 'sum', '1')\n"
    )
    assert inductor.compiled_collective_sequence(code) == [
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "wait_tensor",
        "all_reduce",
    ]


# ---------------------------------------------------------------------------
# 4 gloo ranks, 3 AdamW steps, compiled vs eager (slow)

GLOO_CASES = {
    # case: (model kind, chunk_modules or None, path of the blocks checkpointed (selective AC) or None)
    "llama3": ("llama3", None, None),
    "llama3-ac": ("llama3", None, "body.layers"),
    "llama3-chunked": ("llama3", {"body.layers.*": "batch"}, None),
    "moe": ("moe", None, None),
    "hf-llama": ("llama", None, None),
    "hf-llama-ac": ("llama", None, "model.model.layers"),
    "gpt2": ("gpt2", None, None),
}


def _gpt2_loss():
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=16, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = transformers.GPT2LMHeadModel(cfg)

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).logits.float().pow(2).mean()

    return Loss, 128


def _build(kind):
    from test_passes_chunk_models import _hf_lm, _our_model

    if kind == "llama":
        return _hf_lm(kind), 128
    if kind == "gpt2":
        return _gpt2_loss()
    build, args = _our_model(kind)
    return build, args.vocab_size


def _train(parallel, state, tokens, steps=3):
    from _parity import _load

    parallel.to_empty(device="cpu")
    _load(parallel, state)
    # Adam's first steps move every entry by about lr * sign(gradient): an
    # entry whose gradient is rounding noise (~1e-9; fused kernels sum in
    # another order) would get a random +-lr step and drift the next
    # gradients apart. eps 1e-6 makes such entries' steps proportional to
    # their (negligible) gradient; real entries (up to ~1e-2) take Adam's step.
    opt = torch.optim.AdamW(parallel.parameters(), lr=1e-3, eps=1e-6)
    losses, grads = [], []
    for _ in range(steps):
        loss = parallel(tokens)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.to_local().clone() for n, p in parallel.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _compiled_vs_eager_rank(rank: int, world: int, case: str) -> None:
    warnings.filterwarnings("ignore")
    from _parity import _batch_chunk, assert_close_rel, batch_placement, reference_step

    from autoparallel.capture.activation_checkpointing import apply_ac
    from autoparallel.passes import PassOptions

    kind, chunk, ac_blocks = GLOO_CASES[case]
    build, vocab = _build(kind)
    tokens = torch.randint(1, vocab, (4, 8), generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = build()
    if ac_blocks:
        apply_ac(model, "selective", blocks=model.get_submodule(ac_blocks))
    options = PassOptions(chunk_modules=chunk) if chunk else None
    with AutoParallel(model, mesh, (tokens.to("meta"),), time_limit=300) as autop:
        autop.add_input_constraints([batch_placement(tokens, mesh)])
        plan = autop.optimize_placement()
        eager = autop.apply_placement(plan, pass_options=options)
        compiled = autop.apply_placement(plan, pass_options=options, compile=True)
    records = compiled.parallel_state.step.compiled.records
    assert all(r.compiled for r in records), [r.describe() for r in records]
    assert all(r.collective_order_kept for r in records), [r.describe() for r in records]
    state = reference_step(build, (tokens,))[0]
    local = _batch_chunk(tokens, mesh, rank)
    eager_losses, eager_grads = _train(eager, state, local)
    losses, grads = _train(compiled, state, local)
    for step, (a, b) in enumerate(zip(losses, eager_losses)):
        assert_close_rel(a, b, REL, f"loss of step {step} on rank {rank}")
    for step, (ga, gb) in enumerate(zip(grads, eager_grads)):
        assert ga.keys() == gb.keys()
        for name in gb:
            assert_close_rel(ga[name], gb[name], REL, f"gradient of {name} at step {step} on rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(GLOO_CASES))
def test_compiled_equals_eager_gloo_2x2_three_adamw_steps(case):
    if GLOO_CASES[case][0] in ("llama", "gpt2"):
        pytest.importorskip("transformers")
    from _dist_utils import run_ranks

    run_ranks(_compiled_vs_eager_rank, 4, case, timeout=1200)
