"""``local_map`` regions: traced as one region node with the declared
layouts (not as global ops), planned around, applied on local shards; the
numbers equal the declared semantics on one device, forward and backward.
A region the planner cannot honour is refused naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _dist_utils import run_ranks
from _parity import check_step, check_step_on_rank, plan_and_apply, slow_compute_device
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


# -- redistribute_inputs ---------------------------------------------------------------------------------------


def _whole_rows(x):
    """Every rank reads every row (its local width is the whole width)."""
    return torch.tanh(x) * x.shape[0]


gathered_rows = local_map(
    _whole_rows, out_placements=[(Replicate(), Replicate())], in_placements=[(Replicate(), Replicate())]
)
gathered_rows_redistributed = local_map(
    _whole_rows,
    out_placements=[(Replicate(), Replicate())],
    in_placements=[(Replicate(), Replicate())],
    redistribute_inputs=True,
)


class GatheredNet(nn.Module):
    """A linear on the batch-split input, then a region declaring its input
    replicated."""

    def __init__(self, region=gathered_rows, d: int = 128):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.region = region

    def forward(self, x):
        return self.region(self.inp(x)).pow(2).mean()


def _region_nodes(plan):
    return [n for n in plan.nodes.values() if n.op == "autoparallel.local_map_region.default"]


def test_redistribute_inputs_false_lays_the_producer_out_as_declared(fake_world):
    """``redistribute_inputs=False`` (local_map's default): the plan puts no
    redistribution in front of the region: the linear producing its input
    is replicated, where with ``redistribute_inputs=True`` the plan (on a
    device whose compute is slow) splits the linear and gathers in front of
    the region. Both steps equal the single device."""
    fake_world(4)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    for region, redistributed in ((gathered_rows, False), (gathered_rows_redistributed, True)):

        def build(region=region):
            return GatheredNet(region)

        # compute so slow that the plan splits the linear wherever it may
        parallel, plan, mesh = plan_and_apply(build, (x,), device=slow_compute_device())
        (node,) = _region_nodes(plan)
        assert node.input_placements == ["RR"], node
        assert bool(node.incoming) == redistributed, node.incoming
        check_step(parallel, mesh, build, (x,))


class InputRegion(nn.Module):
    """A region on the step's input itself."""

    def __init__(self, region, d: int = 8):
        super().__init__()
        self.out = nn.Linear(d, d)
        self.region = region

    def forward(self, x):
        return self.out(self.region(x)).pow(2).mean()


pending_rows = local_map(
    _whole_rows, out_placements=[(Replicate(), Replicate())], in_placements=[(Partial(), Replicate())]
)


@pytest.mark.parametrize(
    "region, says",
    [
        (
            gathered_rows,
            "to (S(0), R), but local_map region {name}: input 0 declared (R, R) with redistribute_inputs=False",
        ),
        (pending_rows, "local_map region {name}: input 0 declared (P, R) with redistribute_inputs=False"),
    ],
    ids=["pinned-otherwise", "no-such-layout"],
)
def test_redistribute_inputs_false_refuses_an_input_laid_out_otherwise(fake_world, region, says):
    """An input that cannot reach the region as declared without a
    redistribution (the step's input pinned batch-split; a graph input asked
    to be a pending sum) is refused at planning, naming the region, the
    input, its layout and the declared one."""
    from autoparallel import AutoParallel
    from autoparallel.errors import AutoParallelError
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = InputRegion(region)
    x = torch.empty(8, 8, device="meta")
    with pytest.raises(AutoParallelError) as info:
        with AutoParallel(model, mesh, (x,), input_constraints=[(Shard(0), Replicate())]) as autop:
            autop.optimize_placement()
    msg = str(info.value)
    name = f"{__name__}._whole_rows (called in the root module)"
    assert says.format(name=name) in msg, msg
    if region is pending_rows:
        assert "cannot be Partial()" in msg and "a graph input is a whole value" in msg, msg


# -- the body's backward ----------------------------------------------------------------------------------------

BODY_CALLS: list[tuple[int, ...]] = []


def _counted_tanh(x):
    """Row-local (the same on shards and on the whole), and its backward
    needs its output: a residual of the forward."""
    BODY_CALLS.append(tuple(x.shape))
    return torch.tanh(x) * 2


counted_tanh = local_map(
    _counted_tanh, out_placements=[(Shard(0), Replicate())], in_placements=[(Shard(0), Replicate())]
)


class CountedNet(nn.Module):
    def __init__(self, reference: bool = False, d: int = 8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.region = _counted_tanh if reference else counted_tanh

    def forward(self, x):
        return self.region(self.inp(x)).pow(2).mean()


def test_backward_reuses_the_forward_and_does_not_rerun_the_body(fake_world):
    """The region's backward runs the body's backward graph on the values
    its forward saved (the tanh output, put out by the forward region node
    as a rank-local residual): the body is not run again in the backward,
    the input is not kept for it, and the step equals the single device."""
    from _parity import local_inputs
    from torch.distributed._local_tensor import LocalTensorMode

    fake_world(4)
    inputs = (torch.randn(8, 8, generator=torch.Generator().manual_seed(7)),)
    parallel, plan, mesh = plan_and_apply(CountedNet, inputs)
    (forward,) = _region_nodes(plan)
    assert forward.output_placements == "(S(0)R, RR)", forward  # the output, then the residual
    # the backward takes the output's gradient and the residual, not the input (its backward never reads it)
    (backward,) = [n for n in plan.nodes.values() if n.op == "autoparallel.local_map_region_backward.default"]
    assert backward.input_placements == ["S(0)R", "RR"], backward
    check_step(parallel, mesh, lambda: CountedNet(reference=True), inputs)
    with LocalTensorMode(mesh.size()) as lm:
        loss = parallel(*local_inputs(lm, inputs, mesh))
        before = len(BODY_CALLS)
        loss.backward()
    assert len(BODY_CALLS) == before, BODY_CALLS[before:]


def test_a_body_not_traced_apart_reruns_in_its_backward(fake_world, monkeypatch, caplog):
    """Where the body's forward and backward cannot be traced apart, capture
    says so naming the region, and the backward re-runs the body (autograd
    of it on the saved inputs): the step still equals the single device."""
    from autoparallel.ops import local_map as ops_local_map

    def cannot(region, shards):
        raise RuntimeError("not splittable here")

    monkeypatch.setattr(ops_local_map, "body_graphs", cannot)
    fake_world(4)
    inputs = (torch.randn(8, 8, generator=torch.Generator().manual_seed(7)),)
    with caplog.at_level("WARNING", logger="autoparallel.capture.local_map"):
        parallel, plan, mesh = plan_and_apply(CountedNet, inputs)
    assert f"local_map region {__name__}._counted_tanh (called in the root module)" in caplog.text
    assert "its backward re-runs the body" in caplog.text
    (forward,) = _region_nodes(plan)
    assert forward.output_placements == "(S(0)R)", forward  # no residual
    # the re-running backward reads the input
    (backward,) = [n for n in plan.nodes.values() if n.op == "autoparallel.local_map_region_backward.default"]
    assert backward.input_placements == ["S(0)R", "S(0)R"], backward
    check_step(parallel, mesh, lambda: CountedNet(reference=True), inputs)


@local_map(
    out_placements=[(Shard(0), Replicate())],
    in_placements=[(Shard(0), Replicate()), None, None],
    redistribute_inputs=True,
)
def scaled(x, bias, k):
    """Non-tensor arguments, None among them (a pytree leaf of its own)."""
    return torch.tanh(x) * k if bias is None else x + bias


class ScaledNet(nn.Module):
    def __init__(self, reference: bool = False, d: int = 8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.region = scaled.args[0] if reference else scaled

    def forward(self, x):
        return self.region(self.inp(x), None, 3.0).pow(2).mean()


def test_a_region_with_none_and_constant_arguments(fake_world):
    """A None argument is passed to the body as None (not taken for a
    tensor's slot), a constant as itself; the step equals the single device."""
    fake_world(4)
    inputs = (torch.randn(8, 8, generator=torch.Generator().manual_seed(9)),)
    parallel, plan, mesh = plan_and_apply(ScaledNet, inputs)
    check_step(parallel, mesh, lambda: ScaledNet(reference=True), inputs)


ROWS = (Shard(0), Replicate())


def _view_of_input(x, w, m):
    return x.view(x.shape[0], -1)  # an output aliasing the input


def _saves_views_of_inputs(x, w, m):
    return torch.sigmoid((w.t() @ x.t()).t())  # the backward saves x.t() and w.t(): residuals copied


def _in_place_inside(x, w, m):
    y = x * 2
    y.add_(1)
    return torch.sigmoid(y)


def _integer_input(x, w, m):
    return torch.tanh(x) * m.float()  # no gradient for m


class BodyNet(nn.Module):
    """A row-local body (the same on row shards and on the whole) of the
    activations, a replicated weight (its gradient a partial sum over the
    row shards) and an integer tensor."""

    def __init__(self, body, reference: bool = False, d: int = 8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.w = nn.Parameter(torch.randn(d, d))
        self.body = (
            body
            if reference
            else local_map(
                body,
                out_placements=[ROWS],
                in_placements=[ROWS, (Replicate(), Replicate()), ROWS],
                in_grad_placements=[ROWS, (Partial(), Replicate()), ROWS],
                redistribute_inputs=True,
            )
        )

    def forward(self, x, m):
        # the weight also feeds the loss directly: it has a gradient where the body leaves it unused
        return self.body(self.inp(x), self.w, m).pow(2).mean() + self.w.pow(2).mean()


@pytest.mark.parametrize("body", [_view_of_input, _saves_views_of_inputs, _in_place_inside, _integer_input])
def test_bodies_split_into_forward_and_backward(fake_world, body):
    """Bodies whose split needs care (an output aliasing an input, saved
    views of inputs, an in-place op, an integer input): split at capture,
    and the step equals the single device."""
    from autoparallel.ops.local_map import REGIONS

    fake_world(4)
    g = torch.Generator().manual_seed(11)
    inputs = (torch.randn(8, 8, generator=g), torch.randint(0, 3, (8, 8), generator=g))
    parallel, plan, mesh = plan_and_apply(lambda: BodyNet(body), inputs)
    assert REGIONS[-1].graphs is not None
    check_step(parallel, mesh, lambda: BodyNet(body, reference=True), inputs)


def _compiled_gloo_rank(rank: int, world: int) -> None:
    import warnings

    from autoparallel import AutoParallel
    from _parity import batch_placement
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    inputs = (torch.randn(8, 8, generator=torch.Generator().manual_seed(7)),)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = CountedNet()
    with AutoParallel(model, mesh, (inputs[0].to("meta"),)) as autop:
        autop.add_input_constraints([batch_placement(inputs[0], mesh)])
        parallel = autop.apply_placement(autop.optimize_placement(), compile=True)
    forward, backward = parallel.parallel_state.step.compiled.records
    assert forward.compiled and backward.compiled
    check_step_on_rank(parallel, mesh, lambda: CountedNet(reference=True), inputs, rank)


@pytest.mark.slow
def test_compiled_regions_on_gloo():
    """``compile=True``: Inductor compiles the graphs around the region ops
    (opaque to it: its forward graph with residuals, its backward graph),
    and the step on 4 gloo processes equals the single device."""
    run_ranks(_compiled_gloo_rank, 4, timeout=600)
