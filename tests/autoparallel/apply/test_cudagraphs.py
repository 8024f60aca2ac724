"""CUDA graphs for the parallel step: which graph inputs keep their
addresses, what cannot be captured, the refusals and the replay checks (on
CPU), and bitwise equality with eager on a GPU (skipped without CUDA)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from autoparallel import CudaGraphError
from autoparallel.apply.cudagraphs import (
    CudaGraphSession,
    GraphedCall,
    StaticInputs,
    check_capturable,
    static_inputs,
    uncapturable_nodes,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]


def _llama_step(fake_world):
    from test_apply import _apply

    fake_world(4)
    parallel, _, _ = _apply("llama", (2, 2))
    return parallel, parallel.parallel_state.step


def test_static_inputs_of_the_llama_step(fake_world):
    """Parameters and unmutated buffers keep their addresses, the token batch
    and the mesh coordinates are copied; every saved value the backward reads
    is static, the tangent (the loss gradient) is copied."""
    parallel, step = _llama_step(fake_world)
    found = static_inputs(step.local, step.graphs)
    roles = [i.role for i in found.forward]
    n_params = len(step.local.param_fqns)
    assert roles[:n_params] == ["parameter"] * n_params
    assert all(i.static for i in found.forward[:n_params])
    assert [i.role for i in found.forward if not i.static] == ["input", "mesh coordinates"]
    tokens = next(i for i in found.forward if i.role == "input")
    assert tokens.nbytes == (8 // 4) * 16 * 8  # this rank's int64 tokens: batch split over both dims
    assert {i.role for i in found.backward} == {"saved", "tangent"}
    assert all(i.static == (i.role == "saved") for i in found.backward)
    tangents = [i for i in found.backward if i.role == "tangent"]
    assert len(tangents) == len(step.local.differentiable_outputs)
    assert found.copied_bytes("backward") == sum(i.nbytes for i in tangents) > 0
    assert found.copied_bytes("forward") == tokens.nbytes + 2 * 8  # tokens + two int64 coordinates
    text = found.describe()
    assert "forward:" in text and "backward:" in text and "input #0" in text
    # the plain step captures nothing and reports no static inputs
    assert parallel.cuda_graph_inputs is None and parallel.release_cuda_graphs() is False
    # nothing in the dense step stops a capture; without CUDA it is refused
    assert uncapturable_nodes(step.graphs) == []
    check_capturable(step.graphs, cuda_available=True)
    with pytest.raises(CudaGraphError, match="needs a CUDA device"):
        check_capturable(step.graphs, cuda_available=False)


@pytest.mark.slow  # plans and applies a MoE: ~20 s
def test_moe_all_to_all_step_is_refused_naming_nodes(fake_world):
    """The expert-parallel all-to-all exchanges token counts before the
    tokens: sizes that depend on the data, which no CUDA graph can hold."""
    from test_moe import EP_ON_DIM1, SMALL, _plan

    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2))
    parallel, _ = _plan(mesh, SMALL, pin=(Shard(2), Shard(0)), routed_out=(Shard(0), Shard(0)), mesh_roles=EP_ON_DIM1)
    graphs = parallel.parallel_state.step.graphs
    bad = uncapturable_nodes(graphs)
    assert bad, "the all-to-all expert dispatch should not be capturable"
    assert {b.graph for b in bad} == {"forward", "backward"}
    assert all("moe" in b.module_path for b in bad), [str(b) for b in bad]
    with pytest.raises(CudaGraphError, match=r"cannot be captured in a CUDA graph") as e:
        check_capturable(graphs, cuda_available=True)
    assert bad[0].node in str(e.value) and "cudagraphs=False" in str(e.value)
    # the static-input analysis still holds for the MoE step
    found = static_inputs(parallel.parallel_state.local, graphs)
    assert all(i.static for i in found.forward if i.role == "parameter")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_apply_placement_refuses_on_cpu(fake_world):
    from autoparallel import AutoParallel
    from autoparallel.models import FFN

    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    with torch.device("meta"):
        model = FFN(16, 64, bias=True)
    with AutoParallel(model, mesh, torch.empty(8, 4, 16, device="meta")) as autop:
        plan = autop.optimize_placement()
        with pytest.raises(CudaGraphError, match="needs a CUDA device"):
            autop.apply_placement(plan, cudagraphs=True)


def test_graphed_call_refuses_cpu_tensors():
    session = CudaGraphSession(StaticInputs((), ()))
    call = GraphedCall("forward", [True, False], session)
    with pytest.raises(CudaGraphError, match="not a CUDA device"):
        call(lambda a, b: (a + b,), [torch.zeros(2), torch.ones(2)])


class _RecordedReplay:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1

    def reset(self):
        pass


def _captured(static_input, copied_buffer, output):
    """A GraphedCall in its captured state, without a GPU: the replay checks
    and copies are plain tensor bookkeeping."""
    from autoparallel.apply.cudagraphs import _uses

    call = GraphedCall("backward", [True, False], CudaGraphSession(StaticInputs((), ())))
    call.graph = _RecordedReplay()
    call.args = [static_input, copied_buffer]
    call.outputs = (output,)
    call.aliases = [None]  # the output lives in the graph's pool
    call.addresses = [static_input.data_ptr(), None]
    call.output_uses = [_uses(output)]
    return call


def test_replay_copies_inputs_and_checks_addresses_and_outputs():
    weight, buffer, grad = torch.ones(4), torch.zeros(3), torch.zeros(4)
    call = _captured(weight, buffer, grad)
    outs = call._replay([weight, torch.full((3,), 7.0)])
    assert outs == (grad,) and call.graph.replays == 1
    assert torch.equal(buffer, torch.full((3,), 7.0))  # the copied input landed in the graph's buffer
    del outs
    # a parameter reallocated since capture: refused, not read from old memory
    with pytest.raises(CudaGraphError, match="static input #0 moved since capture"):
        call._replay([torch.ones(4), torch.zeros(3)])
    # a gradient of the previous step still held (accumulation): refused
    kept = call.outputs[0]
    held = torch.nn.Parameter(torch.zeros(4))
    held.grad = kept
    with pytest.raises(CudaGraphError, match="zero_grad"):
        call._replay([weight, torch.zeros(3)])
    held.grad = None
    del kept
    call._replay([weight, torch.zeros(3)])
    assert call.graph.replays == 2


def test_forward_output_held_by_a_pending_backward_is_refused():
    saved = torch.zeros(4)
    call = _captured(torch.ones(2), torch.zeros(2), saved)
    call.name = "forward"

    class Save(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, s):
            ctx.save_for_backward(s)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g, None

    x = torch.ones(2, requires_grad=True)
    out = Save.apply(x, call.outputs[0])
    with pytest.raises(CudaGraphError, match="backward has not run"):
        call._replay([call.args[0], torch.zeros(2)])
    out.sum().backward()
    del out
    call._replay([call.args[0], torch.zeros(2)])


class _EagerGraph:
    """Stands in for a captured CUDA graph on CPU: a replay runs the captured
    function again on the captured input buffers and writes the results into
    the captured outputs' memory without touching autograd's version counters,
    as a CUDA graph replay does. Outputs that are (views of) input buffers are
    not written: the graph reads that memory, it does not own it."""

    def __init__(self, fn, buffers, outs):
        self.fn, self.buffers, self.outs = fn, buffers, outs
        self.inputs_memory = {b.untyped_storage().data_ptr() for b in buffers}
        self.replays = 0

    def replay(self):
        with torch.no_grad():
            new = self.fn(*self.buffers)
            for o, n in zip(self.outs, new):
                if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in self.inputs_memory:
                    o.data.copy_(n)  # .data: a new version counter, so the write is invisible to autograd
        self.replays += 1

    def reset(self):
        self.fn = self.buffers = self.outs = None


class _EagerSession(CudaGraphSession):
    """The CUDA-graph session's bookkeeping on CPU: warm-up, capture and
    replay as the module runs them, the device work done eagerly."""

    device_type = "cpu"

    def ensure_pool(self, device):
        pass

    @contextlib.contextmanager
    def warm_up(self, device):
        yield

    def capture(self, fn, buffers, device):
        outs = tuple(fn(*buffers))
        return _EagerGraph(fn, buffers, outs), outs


class _SavesWeight(torch.autograd.Function):
    """A step that saves its parameter for the backward as it is and as a
    view (what the forward graph does with a norm weight), run through a
    GraphedCall the way ParallelStep runs the forward graph."""

    @staticmethod
    def forward(ctx, call, w, x):
        y, w_saved, w_tail = call(lambda w, x: (w * x, w, w[1:]), [w, x])
        ctx.save_for_backward(w_saved, w_tail, x)
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        w, w_tail, x = ctx.saved_tensors
        assert torch.equal(w[1:], w_tail)
        return None, g * x, g * w


def test_replay_hands_out_this_steps_view_of_a_saved_parameter(fake_world):
    """The replayed forward returns the parameter it saves for the backward
    (and a view of it) as views of this step's ``to_local()``, not the ones
    captured a step earlier, which the optimizer's in-place update (CUDA's
    foreach kernels bump the version counter) made stale: unpacking those
    raised "Output 0 of _ToTorchTensorBackward is a view and its base ...
    has been modified inplace"."""
    from torch.distributed.tensor import Replicate

    fake_world(1)
    mesh = init_device_mesh("cpu", (1,))
    p = torch.nn.Parameter(distribute_tensor(torch.arange(4.0), mesh, [Replicate()]))
    call = GraphedCall("forward", [True, False], _EagerSession(StaticInputs((), ())))
    grads = []
    for step in range(3):
        x = torch.full((4,), float(step + 1))
        _SavesWeight.apply(call, p.to_local(), x).sum().backward()
        grads.append(p.grad.to_local().clone())
        with torch.no_grad():
            p.sub_(p.grad)
            torch.autograd.graph.increment_version(p.to_local())  # as AdamW's CUDA foreach kernels do
        p.grad = None
    assert call.graph.replays == 2
    assert [a is not None and a.whole for a in call.aliases] == [False, True, False]
    assert call.aliases[2].storage_offset == 1
    assert [g.tolist() for g in grads] == [[1.0] * 4, [2.0] * 4, [3.0] * 4]
    assert p.to_local().tolist() == [-6.0, -5.0, -4.0, -3.0]


def _bump_local_versions(model):
    """What AdamW's step does to the parameters on CUDA, on CPU: its foreach
    kernels (the default on CUDA) bump the version counter of every local
    tensor they update, below autograd (``increment_version`` in ATen's CUDA
    foreach ops), so every view of it made before the step, such as the
    ``to_local()`` a captured step read, is stale to autograd afterwards. On
    CPU the update runs through DTensor's dispatch, which leaves them as
    they are."""
    with torch.no_grad():
        torch.autograd.graph.increment_version([p.to_local() for p in model.parameters()])


def _applied_llama(fake_world, device: str, cudagraphs: bool):
    """The debug LLaMA-3 planned on a 2 x 2 mesh of ``device`` over a fake
    process group of 4 (this process is rank 0; collectives are no-ops),
    applied; and rank 0's shard of the token batch, as the plan lays the
    input out (a quarter of the rows)."""
    from test_apply import MODELS

    from autoparallel import AutoParallel

    fake_world(4)
    mesh = init_device_mesh(device, (2, 2))
    build, example = MODELS["llama"]
    with torch.device("meta"):
        model = build()
    tokens = example()
    with AutoParallel(model, mesh, torch.empty_like(tokens, device="meta")) as autop:
        autop.add_input_constraints([(Shard(0), Shard(0))])
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan, cudagraphs=cudagraphs)
    placements = parallel.parallel_state.inputs[0].spec.placements
    local = distribute_tensor(tokens, mesh, placements, src_data_rank=None).to_local().to(device)
    return parallel, local


def _three_adamw_steps(parallel, local, session):
    """Three AdamW steps of ``parallel`` from the same seeded init, run
    through ``session`` (None: eager). Returns the losses, the parameters'
    local shards after the steps, the last step's seconds, the peak memory
    (CUDA) and the captured (forward, backward) graphs, released."""
    import time

    step = parallel.parallel_state.step
    step.cuda_graphs = session
    device = local.device
    parallel.to_empty(device=device)
    torch.manual_seed(0)
    parallel.init_weights()
    opt = torch.optim.AdamW(parallel.parameters(), lr=1e-3)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, seconds = [], 0.0
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = parallel(local).float().pow(2).mean()
        loss.backward()
        opt.step()
        if not cuda:
            _bump_local_versions(parallel)
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        losses.append(loss.detach().clone())
    params = [p.to_local().detach().clone() for p in parallel.parameters()]
    peak = torch.cuda.max_memory_allocated() if cuda else None
    captured = None if session is None else (session.forward.graph, session.backward.graph)
    assert parallel.release_cuda_graphs() == (session is not None)
    return losses, params, seconds, peak, captured


@pytest.mark.slow  # plans and applies the debug LLaMA-3: ~25 s of CPU
def test_three_adamw_steps_through_the_graph_bookkeeping_on_cpu(fake_world):
    """Warm-up, capture and two replays of the applied 2 x 2 step, with the
    stand-in session: the replayed forward hands the backward this step's
    parameter views, not the views captured a step earlier (whose base
    AdamW updated in place: unpacking those from the saved tensors raised
    "Output 0 of _ToTorchTensorBackward is a view and its base ... has been
    modified inplace"); losses and parameters bitwise equal to eager."""
    parallel, local = _applied_llama(fake_world, "cpu", cudagraphs=False)
    l0, p0, _, _, _ = _three_adamw_steps(parallel, local, None)
    step = parallel.parallel_state.step
    session = _EagerSession(static_inputs(step.local, step.graphs))
    l1, p1, _, _, (fw, bw) = _three_adamw_steps(parallel, local, session)
    assert fw.replays == bw.replays == 2  # captured at step 2 (and replayed), replayed at step 3
    assert len(l0) == len(l1) == 3 and len(p0) == len(p1) > 0
    assert all(torch.equal(a, b) for a, b in zip(l0, l1)), (l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert not torch.equal(l1[0], l1[2])  # the steps trained: the replays read the updated parameters


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_three_adamw_steps_bitwise_equal_with_and_without_cuda_graphs(fake_world):
    """One GPU over a fake process group of 4 (this process is rank 0;
    collectives are no-ops), a mesh of device type "cuda": three AdamW steps
    with and without CUDA graphs give bitwise-equal losses and parameters.
    Prints the step time and peak memory of both."""
    parallel, local = _applied_llama(fake_world, "cuda", cudagraphs=True)
    session = parallel.parallel_state.step.cuda_graphs
    l0, p0, t0, m0, _ = _three_adamw_steps(parallel, local, None)
    l1, p1, t1, m1, graphs = _three_adamw_steps(parallel, local, session)
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g in graphs)  # both graphs were captured
    assert all(torch.equal(a, b) for a, b in zip(l0, l1)), (l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    print(
        f"eager: step {t0 * 1e3:.2f} ms, peak {m0 / 2**20:.1f} MiB; "
        f"CUDA graphs: step {t1 * 1e3:.2f} ms, peak {m1 / 2**20:.1f} MiB"
    )
