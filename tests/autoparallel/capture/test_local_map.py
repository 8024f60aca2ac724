"""``local_map`` regions: traced as one region node with the declared
layouts (not as global ops), planned around, applied on local shards; the
numbers equal the declared semantics on one device, forward and backward.
A region the planner cannot honour is refused naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _dist_utils import run_ranks
from _parity import check_step, check_step_on_rank, plan_and_apply
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import local_map

from autoparallel.capture.local_map import LocalMapError


pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]

RANKS_DP = 2  # the first dim of _parity's 2x2 mesh


@local_map(out_placements=[(Shard(0), Shard(2))], in_placements=[(Shard(0), Shard(2))], redistribute_inputs=True)
def center_rows(x):
    """Each rank centres its own rows and scales by its local width: a body
    written for its shard (on global tensors it would compute otherwise)."""
    return (x - x.mean(0, keepdim=True)) * x.shape[-1]


@local_map(out_placements=[(Partial(), Replicate())], in_placements=[(Shard(0), Replicate())])
def row_sum(x):
    """A local reduction: each rank's sum of its rows, pending across ranks."""
    return x.sum(0, keepdim=True)


def center_rows_reference(x):
    """What ``center_rows`` means on one device: per dp shard of the rows,
    the local width being half of the last dim."""
    b = x.shape[0]
    chunks = x.reshape(RANKS_DP, b // RANKS_DP, *x.shape[1:])
    out = (chunks - chunks.mean(1, keepdim=True)) * (x.shape[-1] // 2)
    return out.reshape(x.shape)


class RegionNet(nn.Module):
    def __init__(self, d: int = 8, reference: bool = False):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.reference = reference

    def forward(self, x):
        h = self.inp(x)
        if self.reference:
            c, s = center_rows_reference(h), h.sum(0, keepdim=True)
        else:
            c, s = center_rows(h), row_sum(h)
        return self.out(torch.tanh(c) + s).pow(2).mean()


def _inputs():
    return (torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(3)),)


def test_regions_are_honoured_on_simulated_ranks(fake_world):
    """The plan lays the regions out as declared, and one step on 4
    simulated ranks equals the declared semantics on one device: the loss
    and every gradient (the backward runs autograd of the bodies on the
    shards)."""
    fake_world(4)
    inputs = _inputs()
    parallel, plan, mesh = plan_and_apply(RegionNet, inputs)
    regions = [n for n in plan.nodes.values() if "local_map_region" in n.op]
    by_op = {}
    for n in regions:
        by_op.setdefault(n.op, []).append(n)
    fwd = by_op["autoparallel.local_map_region.default"]
    assert sorted(n.input_placements[0] for n in fwd) == ["S(0)R", "S(0)S(2)"]
    assert len(by_op["autoparallel.local_map_region_backward.default"]) == 2
    check_step(parallel, mesh, lambda: RegionNet(reference=True), inputs)


def _gloo_rank(rank: int, world: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    inputs = _inputs()
    parallel, _, mesh = plan_and_apply(RegionNet, inputs)
    check_step_on_rank(parallel, mesh, lambda: RegionNet(reference=True), inputs, rank)


@pytest.mark.slow
def test_regions_are_honoured_on_gloo():
    """The same step on 4 real gloo processes: each rank's loss and the
    gathered gradients equal the declared semantics on one device."""
    run_ranks(_gloo_rank, 4, timeout=600)


@local_map(out_placements=[(Shard(0), Replicate())], in_placements=[(Shard(0), Replicate())])
def normalise(x):
    return x / x.shape[0]


@local_map(out_placements=[(Shard(0),)], in_placements=[(Shard(0),)])
def one_dim(x):
    return x * 2


@local_map(out_placements=[(Shard(0), Replicate()), None], in_placements=[(Shard(0), Replicate())])
def with_count(x):
    return x * 2, x.shape[0]


class Calls(nn.Module):
    def __init__(self, region, d: int = 8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.region = region

    def forward(self, x):
        out = self.region(self.inp(x))
        return (out[0] if isinstance(out, tuple) else out).pow(2).mean()


@pytest.mark.parametrize(
    "region, inputs, says",
    [
        (one_dim, (8, 8), "placements (S(0)) for a 1-dim mesh, but the plan's mesh is (2, 2)"),
        (normalise, (5, 8), "input 0 of shape (5, 8) cannot be split by S(0) over 2 ranks"),
        (with_count, (8, 8), "returns Tensor, int; the planner lays out tensor outputs only"),
    ],
)
def test_a_region_that_cannot_be_honoured_is_refused_naming_it(fake_world, region, inputs, says):
    """Refused at trace time, naming the function and the module calling it,
    never traced as global ops."""
    from autoparallel import AutoParallel
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Calls(region)
    with pytest.raises(LocalMapError) as info:
        with AutoParallel(model, mesh, (torch.empty(*inputs, device="meta"),)):
            pass
    msg = str(info.value)
    assert f"local_map region {__name__}.{region.args[0].__qualname__} (called in the root module)" in msg, msg
    assert says in msg, msg


def test_region_traces_as_one_node_with_its_layouts(fake_world):
    """The traced graph holds the region (forward and backward), not the
    body's ops on global tensors."""
    from autoparallel import AutoParallel
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Calls(normalise)
    with AutoParallel(model, mesh, (torch.empty(8, 8, device="meta"),)) as autop:
        targets = [str(n.target) for n in autop.traced.gm.graph.nodes if n.op == "call_function"]
    assert targets.count("autoparallel.local_map_region.default") == 1
    assert targets.count("autoparallel.local_map_region_backward.default") == 1
    assert "aten.div.Tensor" not in targets  # the body's division stays inside the region


def _trace(model, inputs):
    from autoparallel import AutoParallel
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with AutoParallel(model, mesh, (torch.empty(*inputs, device="meta"),)) as autop:
        return [n for n in autop.traced.gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("how", ["shape", "missing"])
def test_local_map_is_refused_where_torch_wrapper_cannot_be_intercepted(fake_world, monkeypatch, how):
    """A torch whose local_map wrapper has another shape: a local_map call is
    refused, naming the function and the release, never traced as global ops
    ("shape": the wrapper's code is swapped for a refusal; "missing": no
    wrapper function to swap, the calls are caught on entry); a model
    without local_map traces as before."""
    from torch.distributed.tensor.experimental import _func_map

    from autoparallel import torch_compat

    wrapper_code = normalise.func.__code__
    if how == "shape":
        monkeypatch.setattr(torch_compat, "local_map_wrapper_problem", lambda wrapped: "changed (test)")
    else:
        monkeypatch.delattr(_func_map, "_local_map_wrapped")
    fake_world(4)
    with torch.device("meta"):
        with_region, without = Calls(normalise), Calls(nn.Identity())
    with pytest.raises(LocalMapError) as info:
        _trace(with_region, (8, 8))
    msg = str(info.value)
    assert f"local_map region {__name__}.normalise (called in the root module)" in msg, msg
    assert "this torch release is not supported for local_map regions" in msg, msg
    assert _trace(without, (8, 8))  # traces: nothing calls local_map
    # the wrapper is left as it was
    assert normalise.func.__code__ is wrapper_code
    assert _func_map.__dict__.get(torch_compat._LOCAL_MAP_REFUSAL) is None
