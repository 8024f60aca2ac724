"""In-place updates in the traced step reach the real tensors, and non-tensor
arguments are constants of the step: BatchNorm in training mode (running
statistics, ``num_batches_tracked``) and an in-place op on an input give
eager's results on 4 simulated ranks (2x2 ("dp", "tp") mesh, batch on dp)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.cost_model import DeviceSpec
from autoparallel.passes import PassOptions

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

LOCAL_TENSOR_PASSES = PassOptions(column_major_all_gather="reorder")
N, DP = 4, 2  # ranks, size of the batch (dp) mesh dim
BATCH = 8
BATCH_ON_DP = (Shard(0), Replicate())


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x, y):
        y.mul_(2)  # an in-place update of an input: the caller sees it
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(h.mean((2, 3))) + y


# compute so slow that the plan shards it (conv over the batch, BatchNorm
# over channels): the updates then come from sharded compute
SLOW_COMPUTE = DeviceSpec(
    name="slow",
    peak_bf16=1e9,
    peak_fp32=1e9,
    peak_tf32=1e9,
    peak_fp8=None,
    hbm_bw=1e9,
    intra_node_bw=1e12,
    inter_node_bw=1e12,
    launch_floor=0.0,
)


def _plan(model_fn, inputs, constraints, mesh, outputs=(BATCH_ON_DP,), buffers=None, device="H100"):
    with torch.device("meta"):
        model = model_fn()
    with AutoParallel(model, mesh, inputs, device=device) as autop:
        autop.add_input_constraints(constraints)
        autop.add_output_constraints(list(outputs))
        for fqn, placements in (buffers or {}).items():
            autop.add_node_constraint(autop.traced.buffer_nodes[fqn], placements)
        plan = autop.optimize_placement()
        return autop.apply_placement(plan, pass_options=LOCAL_TENSOR_PASSES)


def _shard(lm, x, placements, mesh):
    """Each simulated rank's local piece of ``x`` under ``placements``."""
    coords = {r: [int(c) for c in (mesh.mesh == r).nonzero()[0]] for r in range(N)}

    def piece(r):
        t = x
        for d, p in enumerate(placements):
            if isinstance(p, Shard):
                t = t.chunk(mesh.size(d), dim=p.dim)[coords[r][d]]
        return t.clone()

    return lm.rank_map(piece)


def _full(t):
    full = t.full_tensor() if isinstance(t, DTensor) else t
    return full.reconcile() if isinstance(full, LocalTensor) else full


def _gathered(lm_out: LocalTensor, mesh, placements) -> torch.Tensor:
    # rows of dp rank i live on ranks with coordinate i on dim 0
    rows = [lm_out._local_tensors[int(mesh.mesh[i, 0])] for i in range(mesh.size(0))]
    return torch.cat(rows) if isinstance(placements[0], Shard) else rows[0]


# running statistics replicated (what the cost model picks here), or pinned
# sharded over channels: the update reaches each rank's shard
@pytest.mark.parametrize(
    "buffers, device",
    [
        (None, "H100"),
        ({"bn.running_mean": (Replicate(), Shard(0)), "bn.running_var": (Shard(0), Shard(0))}, "H100"),
        (None, SLOW_COMPUTE),
    ],
    ids=["default", "sharded-stats", "sharded-compute"],
)
def test_batchnorm_running_stats_and_input_update(fake_world, buffers, device):
    fake_world(N)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(BATCH, 3, 6, 6, generator=g) for _ in range(2)]
    ys = [torch.randn(BATCH, 4, generator=g) for _ in range(2)]
    meta = (torch.empty(BATCH, 3, 6, 6, device="meta"), torch.empty(BATCH, 4, device="meta"))
    parallel = _plan(ConvBN, meta, [BATCH_ON_DP, BATCH_ON_DP], mesh, buffers=buffers, device=device)
    if device is SLOW_COMPUTE:
        conv = [
            n for n in parallel.parallel_state.local.gm.graph.nodes if n.target == torch.ops.aten.convolution.default
        ]
        assert conv and all(n.meta["val"].shape[0] < BATCH or n.meta["val"].shape[1] < 8 for n in conv)
    if buffers:
        assert parallel.bn.running_var.placements == (Shard(0), Shard(0))

    torch.manual_seed(0)
    ref = ConvBN()
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_outs, ref_ys, ref_grads = [], [], []
    for x, y in zip(xs, ys):
        y = y.clone()
        out = ref(x, y)
        ref.zero_grad()
        out.pow(2).sum().backward()
        ref_outs.append(out.detach())
        ref_ys.append(y)
        ref_grads.append({k: p.grad.clone() for k, p in ref.named_parameters()})

    with LocalTensorMode(N) as lm:
        parallel.to_empty(device="cpu")
        parallel.load_state_dict(start)
        for step, (x, y) in enumerate(zip(xs, ys)):
            ly = _shard(lm, y, BATCH_ON_DP, mesh)
            out = parallel(_shard(lm, x, BATCH_ON_DP, mesh), ly)
            parallel.zero_grad()
            out.pow(2).sum().backward()
            got = _gathered(out, mesh, BATCH_ON_DP)
            torch.testing.assert_close(got, ref_outs[step], rtol=1e-5, atol=1e-5)
            # the caller's input tensor was updated in place, as in eager
            torch.testing.assert_close(_gathered(ly, mesh, BATCH_ON_DP), ref_ys[step])
        state = {k: _full(v) for k, v in parallel.state_dict().items()}
        grads = {k: _full(p.grad) for k, p in parallel.named_parameters()}
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert int(state["bn.num_batches_tracked"]) == 2
    # (DTensor's convention: every copy of a replicated output carries the
    # whole loss's gradient, so the local losses are not summed over tp)
    for k, g_ref in ref_grads[-1].items():
        torch.testing.assert_close(grads[k], g_ref, rtol=1e-4, atol=1e-5, msg=k)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, scale, x, repeat=1, *, flip=False, act="relu", bias=None):
        h = self.proj(x) * scale
        for _ in range(repeat):
            h = torch.relu(h) if act == "relu" else torch.tanh(h)
        if bias is not None:
            h = h + bias
        return -h if flip else h


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((0.5, "X"), {}),
        ((2.0, "X", 2), {"flip": True, "act": "tanh"}),
        ((3, "X"), {"bias": "B", "act": "tanh"}),  # an int constant, a tensor keyword input
    ],
)
def test_non_tensor_arguments_are_constants(fake_world, args, kwargs):
    fake_world(N)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    tensors = {"X": torch.randn(BATCH, 8, generator=g), "B": torch.randn(BATCH, 8, generator=g)}

    def fill(f):
        return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}

    def meta(a):
        return torch.empty_like(tensors[a], device="meta") if isinstance(a, str) and a in tensors else a

    n_tensors = sum(isinstance(a, str) and a in tensors for a in list(args) + list(kwargs.values()))
    # constraints index the tensor inputs only, in flattened (args, kwargs) order
    parallel = _plan(Scaled, fill(meta), [BATCH_ON_DP] * n_tensors, mesh)

    torch.manual_seed(0)
    ref = Scaled()
    ref_args, ref_kwargs = fill(lambda a: tensors[a] if isinstance(a, str) and a in tensors else a)
    expected = ref(*ref_args, **ref_kwargs)
    with LocalTensorMode(N) as lm:
        parallel.to_empty(device="cpu")
        parallel.load_state_dict(ref.state_dict())
        local_args, local_kwargs = fill(
            lambda a: _shard(lm, tensors[a], BATCH_ON_DP, mesh) if isinstance(a, str) and a in tensors else a
        )
        out = parallel(*local_args, **local_kwargs)
        torch.testing.assert_close(_gathered(out, mesh, BATCH_ON_DP), expected.detach(), rtol=1e-5, atol=1e-6)
        # another value of a constant: the step was traced with the first one
        other = (args[0] + 1,) + tuple(local_args[1:])
        with pytest.raises(ValueError, match=r"traced with args\[0\]=" + str(args[0])):
            parallel(*other, **local_kwargs)
