"""CUDA graphs for the parallel step: which graph inputs keep their
addresses, what cannot be captured, the refusals and the replay checks (on
CPU), and bitwise equality with eager on a GPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_three_adamw_steps_bitwise_equal_with_and_without_cuda_graphs(fake_world):
    """One GPU over a fake process group (collectives are no-ops): three
    AdamW steps with and without CUDA graphs give bitwise-equal losses and
    parameters. Prints the step time and peak memory of both."""
    import time

    from test_apply import MODELS

    from autoparallel import AutoParallel

    results = {}
    for graphed in (False, True):
        fake_world(4)
        mesh = init_device_mesh("cpu", (2, 2))
        build, example = MODELS["llama"]
        with torch.device("meta"):
            model = build()
        tokens = example()
        with AutoParallel(model, mesh, torch.empty_like(tokens, device="meta")) as autop:
            autop.add_input_constraints([(Shard(0), Shard(0))])
            plan = autop.optimize_placement()
            parallel = autop.apply_placement(plan, cudagraphs=graphed)
        parallel.to_empty(device="cuda")
        torch.manual_seed(0)
        parallel.init_weights()
        opt = torch.optim.AdamW(parallel.parameters(), lr=1e-3)
        local = tokens[: tokens.shape[0] // 2].cuda()
        torch.cuda.reset_peak_memory_stats()
        losses, times = [], []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = parallel(local).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(loss.detach().clone())
        params = [p.to_local().detach().clone() for p in parallel.parameters()]
        results[graphed] = (losses, params, times[-1], torch.cuda.max_memory_allocated())
        parallel.release_cuda_graphs()
    (l0, p0, t0, m0), (l1, p1, t1, m1) = results[False], results[True]
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    print(
        f"eager: step {t0 * 1e3:.2f} ms, peak {m0 / 2**20:.1f} MiB; "
        f"CUDA graphs: step {t1 * 1e3:.2f} ms, peak {m1 / 2**20:.1f} MiB"
    )
