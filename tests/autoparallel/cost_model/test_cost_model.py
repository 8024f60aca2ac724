import dataclasses
import itertools
import math
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoparallel.cost_model import (
    A100,
    B200,
    H100,
    H200,
    TRANSITION_TIEBREAK,
    CommOverlapPolicy,
    DeviceSpec,
    TensorSig,
    apply_discount,
    clear_caches,
    collective_time,
    compute_time,
    is_free_op,
    local_shape,
    mesh_dim_topology,
    node_compute_time,
    op_compute_time,
    op_cost_from_shapes,
    op_flops_and_bytes,
    redistribute_steps,
    redistribute_time,
)

aten = torch.ops.aten
WORLD = 128
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def mesh():
    """A 16x8 ("dp", "tp") mesh on a fake process group of 128 ranks."""
    created = False
    if dist.is_initialized() and dist.get_world_size() != WORLD:
        dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
        created = True
    yield init_device_mesh("cpu", (16, 8), mesh_dim_names=("dp", "tp"))
    if created and dist.is_initialized():
        dist.destroy_process_group()


def spec(mesh, placements, shape=(4096, 4096), dtype=BF16):
    t = torch.empty(shape, dtype=dtype, device="meta")
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(t.shape, t.stride(), dtype))


# ---------------------------------------------------------------- devices


def test_presets_and_get():
    assert DeviceSpec.get("h100") is H100
    assert DeviceSpec.get("B200") is B200
    with pytest.raises(ValueError, match="A100, B200, H100, H200"):
        DeviceSpec.get("TPUv5")
    assert H100.peak_flops(BF16) == H100.peak_flops(torch.float16) == 989e12
    assert H100.peak_flops(torch.float32) == 67e12  # PyTorch default: no TF32
    assert dataclasses.replace(H100, fp32_uses_tf32=True).peak_flops(torch.float32) == 495e12
    assert H100.peak_flops(torch.float8_e4m3fn) == 1979e12
    assert A100.peak_flops(torch.float8_e4m3fn) == A100.peak_bf16  # no fp8 units


def test_presets_ordered_for_big_matmul():
    m = n = k = 8192
    flops, nbytes = 2 * m * n * k, 3 * m * n * 2
    t = {d.name: compute_time(flops, nbytes, BF16, d) for d in (A100, H100, H200, B200)}
    assert t["B200"] < t["H100"] < t["A100"]
    assert t["H200"] == pytest.approx(t["H100"])  # compute-bound: same SMs


def test_h200_faster_for_memory_bound():
    nbytes = 1 << 30
    assert compute_time(0, nbytes, BF16, H200) < compute_time(0, nbytes, BF16, H100)


# ---------------------------------------------------------------- compute


def test_roofline_and_launch_floor():
    assert compute_time(1e3, 1e3, BF16, H100) == H100.launch_floor
    assert compute_time(0, 0, BF16, H100) == 0.0
    big = 2 * 8192**3
    assert compute_time(big, 1e3, BF16, H100) == pytest.approx(big / (989e12 * 0.7))
    assert compute_time(1, 1e9, BF16, H100) == pytest.approx(1e9 / (3.35e12 * 0.8))


def test_views_are_free():
    for op in (
        aten.view.default,
        aten._unsafe_view.default,
        aten.t.default,
        aten.transpose.int,
        aten.permute.default,
        aten.expand.default,
        aten.detach.default,
        aten.split.Tensor,
        aten.slice.Tensor,
        aten.unsqueeze.default,
        aten.as_strided.default,
    ):
        assert is_free_op(op), op
    import operator

    assert is_free_op(operator.getitem) and is_free_op("placeholder")
    assert not is_free_op(aten.mm.default) and not is_free_op(aten.clone.default)
    x = torch.empty(64, 64, device="meta")
    assert op_compute_time(aten.view.default, (x, [4096]), {}, x.view(4096), None, None) == 0.0


def test_mm_flops_and_bytes_local_shapes():
    m, k, n = 256, 512, 128
    a, b = torch.empty(m, k, dtype=BF16, device="meta"), torch.empty(k, n, dtype=BF16, device="meta")
    flops, nbytes = op_flops_and_bytes(aten.mm.default, (a, b), {}, a @ b)
    assert flops == 2 * m * n * k
    assert nbytes == (m * k + k * n + m * n) * 2


def test_pointwise_costs_by_bytes():
    x = TensorSig((1024, 1024), BF16)
    flops, nbytes = op_cost_from_shapes(aten.add.Tensor, (x, x), {}, x)
    assert flops == 0 and nbytes == 3 * 1024 * 1024 * 2


def test_embedding_reads_rows_not_table():
    w, idx, out = TensorSig((128256, 4096), BF16), TensorSig((8, 128), torch.int64), TensorSig((8, 128, 4096), BF16)
    _, nbytes = op_cost_from_shapes(aten.embedding.default, (w, idx), {}, out)
    assert nbytes == 8 * 128 * 8 + 2 * 8 * 128 * 4096 * 2


def test_sdpa_flops_and_causal_halving():
    q = TensorSig((2, 8, 1024, 64), BF16)
    lse = TensorSig((2, 8, 1024), torch.float32)
    full = 2 * (2 * 2 * 8 * 1024 * 1024 * 64)
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert op_cost_from_shapes(op, (q, q, q), {}, (q, lse))[0] == full
    assert op_cost_from_shapes(op, (q, q, q, 0.0, True), {}, (q, lse))[0] == full / 2
    assert op_cost_from_shapes(op, (q, q, q), {"is_causal": True}, (q, lse))[0] == full / 2


def test_attention_costed_at_attention_efficiency():
    # Fused attention runs far below GEMM efficiency (calibrate_device.py on an
    # H100: ~0.3 vs ~0.8); a GEMM with the same FLOPs keeps compute_efficiency.
    q = torch.empty(4, 32, 4096, 128, dtype=BF16, device="meta")
    lse = torch.empty(4, 32, 4096, device="meta")
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    flops = op_cost_from_shapes(op, (q, q, q), {}, (q, lse))[0]
    t = op_compute_time(op, (q, q, q), {}, (q, lse), None, None, H100)
    assert t == pytest.approx(flops / (H100.peak_bf16 * H100.attention_efficiency))
    faster = dataclasses.replace(H100, attention_efficiency=2 * H100.attention_efficiency)
    assert op_compute_time(op, (q, q, q), {}, (q, lse), None, None, faster) == pytest.approx(t / 2)
    a, b = torch.empty(8192, 8192, dtype=BF16, device="meta"), torch.empty(8192, 8192, dtype=BF16, device="meta")
    mm = aten.mm.default
    t_mm = op_compute_time(mm, (a, b), {}, torch.empty(8192, 8192, dtype=BF16, device="meta"), None, None, faster)
    assert t_mm == op_compute_time(mm, (a, b), {}, torch.empty(8192, 8192, dtype=BF16, device="meta"), None, None, H100)


@pytest.mark.smoke
def test_op_compute_time_uses_local_shapes(mesh):
    m, k, n = 65536, 4096, 4096  # 16 x 4096 tokens through a 4096x4096 linear
    a, b = torch.empty(m, k, dtype=BF16, device="meta"), torch.empty(k, n, dtype=BF16, device="meta")
    out = torch.empty(m, n, dtype=BF16, device="meta")
    rep = op_compute_time(aten.mm.default, (a, b), {}, out, None, None)
    # Data parallel on dp, column-parallel on tp: 1/128 of the work.
    a_s = spec(mesh, (Shard(0), Replicate()), (m, k))
    b_s = spec(mesh, (Replicate(), Shard(1)), (k, n))
    o_s = spec(mesh, (Shard(0), Shard(1)), (m, n))
    sharded = op_compute_time(aten.mm.default, (a, b), {}, out, (a_s, b_s), o_s)
    assert sharded == pytest.approx(rep / 128)
    assert sharded == pytest.approx(2 * (m / 16) * (n / 8) * k / (989e12 * 0.7))


def test_node_compute_time(mesh):
    gm = torch.fx.symbolic_trace(lambda a, b: torch.mm(a, b))
    a, b = torch.empty(512, 256, device="meta"), torch.empty(256, 128, device="meta")
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["val"] = a if node.name == "a" else b
        if node.op == "call_function":
            node.target = aten.mm.default
            node.meta["val"] = a @ b
            mm = node
    t = node_compute_time(mm, None, None, H100)
    assert t == compute_time(2 * 512 * 256 * 128, (512 * 256 + 256 * 128 + 512 * 128) * 4, torch.float32, H100)


def test_local_shape_matches_dtensor_rank0(mesh):
    for shape, placements in [
        ((4096, 4096), (Shard(0), Shard(1))),
        ((10, 7), (Shard(0), Shard(0))),
        ((13, 5, 3), (Replicate(), Shard(0))),
        ((13, 5, 3), (Partial(), Shard(2))),
    ]:
        ref, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
        assert local_shape(shape, (16, 8), placements) == tuple(ref)


# ---------------------------------------------------------------- communication


def test_mesh_topology(mesh):
    dp, tp = mesh_dim_topology(mesh, 8)
    assert (dp.group_size, dp.intra_node, dp.ranks_per_node) == (16, False, 1)
    assert (tp.group_size, tp.intra_node, tp.ranks_per_node) == (8, True, 8)
    (flat,) = mesh_dim_topology(DeviceMesh("cpu", torch.arange(WORLD)), 8)
    assert (flat.intra_node, flat.ranks_per_node) == (False, 8)
    a, b = mesh_dim_topology(DeviceMesh("cpu", torch.arange(WORLD).reshape(8, 16)), 8)
    assert (a.intra_node, a.ranks_per_node, b.intra_node, b.ranks_per_node) == (False, 1, False, 8)


def test_identical_spec_free(mesh):
    s = spec(mesh, (Shard(0), Shard(1)))
    assert redistribute_time(s, s) == 0.0
    assert redistribute_time(s, spec(mesh, (Shard(0), Shard(1)))) == 0.0


def test_allgather_intra_faster_than_inter(mesh):
    # Same tensor, gathered once along tp (NVLink) and once along dp (IB).
    intra = redistribute_time(spec(mesh, (Replicate(), Shard(0))), spec(mesh, (Replicate(), Replicate())))
    inter = redistribute_time(spec(mesh, (Shard(0), Replicate())), spec(mesh, (Replicate(), Replicate())))
    assert 0 < intra < inter
    # Same bytes and group size, only the link differs.
    assert collective_time("all_gather", 1e6, 8, True) < collective_time("all_gather", 1e6, 8, False)


@pytest.mark.smoke
def test_allgather_matches_ring_formula(mesh):
    t = redistribute_time(spec(mesh, (Replicate(), Shard(0))), spec(mesh, (Replicate(), Replicate())))
    shard = 4096 * 4096 * 2 / 8
    expect = H100.launch_floor + 7 * H100.intra_node_latency + 7 * shard / (450e9 * 0.8)
    assert t == pytest.approx(expect)


def test_allreduce_about_twice_reduce_scatter(mesh):
    shape = (8192, 8192)
    p = spec(mesh, (Replicate(), Partial()), shape)
    ar = redistribute_time(p, spec(mesh, (Replicate(), Replicate()), shape))
    rs = redistribute_time(p, spec(mesh, (Replicate(), Shard(0)), shape))
    assert ar == pytest.approx(2 * rs, rel=0.02)
    assert collective_time("all_reduce", 1e8, 16, False) == pytest.approx(
        2 * collective_time("reduce_scatter", 1e8, 16, False), rel=0.01
    )


def test_all_to_all_cheaper_than_allgather(mesh):
    a2a = redistribute_time(spec(mesh, (Replicate(), Shard(0))), spec(mesh, (Replicate(), Shard(1))))
    ag = redistribute_time(spec(mesh, (Replicate(), Shard(0))), spec(mesh, (Replicate(), Replicate())))
    assert 0 < a2a < ag
    assert [
        s.kind for s in redistribute_steps(spec(mesh, (Replicate(), Shard(0))), spec(mesh, (Replicate(), Shard(1))))
    ] == ["pre_copy+all_to_all"]  # S(0) -> S(1): the input's dim-1 chunks are stacked first


def test_collectives_on_non_leading_dims_pay_their_local_copies(mesh):
    """A gather along tensor dim 1 concatenates the gathered chunks, a
    reduce-scatter along dim 1 stacks its input's chunks first: one local
    copy each (read + write) on top of the collective, as apply runs them."""
    from autoparallel.cost_model import H100
    from autoparallel.cost_model import steps
    from autoparallel.cost_model.placement_codes import PARTIAL, REPLICATE, SHARD
    from autoparallel.cost_model.steps import kinds_between

    assert kinds_between(SHARD, REPLICATE, 0, None) == ("all_gather",)
    assert kinds_between(SHARD, REPLICATE, 1, None) == ("all_gather", "local_copy")
    assert kinds_between(PARTIAL, SHARD, None, 0) == ("reduce_scatter",)
    assert kinds_between(PARTIAL, SHARD, None, 2) == ("pre_copy", "reduce_scatter")
    assert kinds_between(SHARD, SHARD, 1, 0) == ("all_to_all", "local_copy")

    def copy(nbytes):  # read + write
        return 2 * nbytes / (H100.hbm_bw * H100.memory_efficiency)

    topology = steps.mesh_dim_topology(mesh)[1]
    gather = steps.step_time(topology, ("all_gather",), 2**21, 2**24, H100)
    assert steps.step_time(topology, ("all_gather", "local_copy"), 2**21, 2**24, H100) == gather + copy(2**24)
    scatter = steps.step_time(topology, ("reduce_scatter",), 2**24, 2**21, H100)
    assert steps.step_time(topology, ("pre_copy", "reduce_scatter"), 2**24, 2**21, H100) == scatter + copy(2**24)
    # the plan the cost model prices avoids the concatenation where an
    # all-to-all of the shard is cheaper, never pays more than it
    src, dst = spec(mesh, (Replicate(), Shard(1))), spec(mesh, (Replicate(), Replicate()))
    plain = redistribute_time(spec(mesh, (Replicate(), Shard(0))), dst)
    assert plain < redistribute_time(src, dst) <= plain + copy(4096 * 4096 * 2)


def test_a_local_copy_costs_at_least_a_kernel_launch_and_its_share(mesh):
    """A slice of a small replica is one kernel: the launch floor, as the
    overlap scheduler's compute model costs it; an edge out of a value with
    three readers counts a third of it (apply slices the value once)."""
    from autoparallel.cost_model import H100, copies_device, steps
    from autoparallel.cost_model.steps import local_copy_time

    assert local_copy_time(1024, H100) == H100.launch_floor
    big = 2**30
    assert local_copy_time(big, H100) == 2 * big / (H100.hbm_bw * H100.memory_efficiency)
    third = copies_device(H100, 1 / 3)
    assert local_copy_time(1024, third) == H100.launch_floor * (1 / 3)
    assert copies_device(H100, 1.0) is H100
    # a collective is not shared out: only the copies around it are
    topology = steps.mesh_dim_topology(mesh)[1]
    gather = steps.step_time(topology, ("all_gather",), 2**21, 2**24, H100)
    assert steps.step_time(topology, ("all_gather",), 2**21, 2**24, third) == gather
    assert steps.step_time(topology, ("all_gather", "local_copy"), 2**21, 2**24, third) == gather + local_copy_time(
        2**24, third
    )
    sharded, whole = spec(mesh, (Shard(0), Replicate())), spec(mesh, (Replicate(), Replicate()))
    assert redistribute_time(whole, sharded, third) == pytest.approx(redistribute_time(whole, sharded, H100) / 3)


def _dtensor_plan(src, dst):
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

    return [(i.mesh_dim, *i.src_dst_placements) for i in _gen_transform_infos_non_cached(src, dst)]


@pytest.mark.parametrize(
    "mesh_shape, choices",
    [
        ((16, 8), [Replicate(), Partial(), Partial("avg"), Shard(0), Shard(1), Shard(2)]),
        ((2, 8, 8), [Replicate(), Partial(), Shard(0), Shard(1)]),
    ],
)
def test_greedy_plan_matches_dtensor(mesh, mesh_shape, choices):
    from autoparallel.cost_model.comm import greedy_steps

    m = mesh if mesh_shape == (16, 8) else init_device_mesh("cpu", mesh_shape)
    shape = (64, 64, 64)
    combos = list(itertools.product(choices, repeat=len(mesh_shape)))
    specs = [spec(m, c, shape) for c in combos]
    for s in specs:
        for d in specs:
            assert greedy_steps(mesh_shape, s.placements, d.placements) == _dtensor_plan(s, d), (s, d)


def test_strided_shard_costs_via_gather(mesh, monkeypatch):
    from torch.distributed.tensor.placement_types import _StridedShard

    import autoparallel.cost_model as cm
    from autoparallel.cost_model import comm

    # DTensor's graph planner (~ms per call) must not be consulted.
    monkeypatch.setattr(comm, "_transform_steps", lambda *a: pytest.fail("graph planner called"))
    cm.clear_caches()
    src = spec(mesh, (Replicate(), _StridedShard(0, split_factor=32)))
    steps = redistribute_steps(src, spec(mesh, (Replicate(), Replicate())))
    assert [s.kind for s in steps] == ["all_gather+local_copy"]
    to_shard = redistribute_time(src, spec(mesh, (Shard(1), Shard(0))))
    assert math.isfinite(to_shard) and to_shard > steps[0].time
    cm.clear_caches()


def test_forbidden_transitions(mesh):
    assert redistribute_time(spec(mesh, (Shard(0), Replicate())), spec(mesh, (Partial(), Replicate()))) == math.inf
    assert (
        redistribute_time(spec(mesh, (Partial("sum"), Replicate())), spec(mesh, (Partial("max"), Replicate())))
        == math.inf
    )


def test_replicate_to_shard_is_cheap_local_copy(mesh):
    src = spec(mesh, (Replicate(), Replicate()))
    t = redistribute_time(src, spec(mesh, (Shard(0), Shard(1))))
    assert 0 < t < TRANSITION_TIEBREAK * 1000
    assert all(s.kind == "local_copy" for s in redistribute_steps(src, spec(mesh, (Shard(0), Partial()))))
    # Cheaper than any collective on the same tensor.
    assert t < redistribute_time(spec(mesh, (Replicate(), Shard(0))), src)


def test_2d_redistribution_is_sum_of_steps(mesh):
    from autoparallel.cost_model import comm
    from autoparallel.cost_model.devices import H100

    src, dst = spec(mesh, (Shard(0), Shard(0))), spec(mesh, (Replicate(), Replicate()))
    full = 4096 * 4096 * 2
    # DTensor's greedy plan: tp all-gather of a 1/128 shard, then dp
    # all-gather of a 1/16 shard (the all-gather grew the local tensor).
    greedy = list(comm.dtensor_plan_steps(src, dst, H100))
    assert [(s[0], s[3]) for s in greedy] == [(1, ("all_gather",)), (0, ("all_gather",))]
    assert greedy[1][4] == full // 16
    expect = collective_time("all_gather", full / 128, 8, True) + collective_time(
        "all_gather", full / 16, 16, False, ranks_per_node=1
    )
    assert sum(s[-1] for s in greedy) == pytest.approx(expect)
    # The min-cost plan moves the tp shard to dim 1 first, so the
    # slow inter-node dp all-gather moves the 1/128 shard, not the 1/16 one;
    # it moves it back to dim 0 before the last gather, which then needs no
    # concatenation (an all-to-all of 1/8 is cheaper than copying the whole)
    steps = redistribute_steps(src, dst)
    assert [(s.mesh_dim, s.kind) for s in steps] == [
        (1, "pre_copy+all_to_all"),
        (0, "all_gather"),
        (1, "all_to_all+local_copy"),
        (1, "all_gather"),
    ]
    assert [s.bytes_per_rank for s in steps] == [full // 128, full // 128, full // 8, full // 8]
    assert redistribute_time(src, dst) == sum(s.time for s in steps) < expect


def test_reduce_scatter_shrinks_bytes(mesh):
    src, dst = spec(mesh, (Partial(), Partial())), spec(mesh, (Shard(0), Shard(1)))
    steps = redistribute_steps(src, dst)
    assert [s.kind for s in steps] == ["reduce_scatter", "pre_copy+all_to_all", "reduce_scatter"]
    # min-cost plan: the fast intra-node tp reduce-scatter first (along
    # dim 0: no copy; then an all-to-all moves its shard to dim 1), so the
    # slow inter-node dp one reduces an 8x smaller buffer (DTensor's greedy
    # plan goes dp first)
    assert [s.mesh_dim for s in steps] == [1, 1, 0]
    assert steps[2].bytes_per_rank == steps[0].bytes_per_rank // 8


def test_monotonic_in_size(mesh):
    for src_p, dst_p in [
        ((Shard(0), Replicate()), (Replicate(), Replicate())),
        ((Partial(), Partial()), (Replicate(), Replicate())),
        ((Replicate(), Shard(0)), (Replicate(), Shard(1))),
    ]:
        times = [
            redistribute_time(spec(mesh, src_p, (n, 1024)), spec(mesh, dst_p, (n, 1024)))
            for n in (256, 1024, 4096, 16384)
        ]
        assert times == sorted(times) and times[0] < times[-1], (src_p, dst_p, times)


def test_multi_node_group_uses_all_nics():
    # 128 ranks over 16 nodes drive 8 NICs per node; one rank per node only one.
    rails = collective_time("all_gather", 1e8, 16, False, ranks_per_node=8)
    single = collective_time("all_gather", 1e8, 16, False, ranks_per_node=1)
    assert rails < single / 4


def test_collective_edge_cases():
    assert collective_time("all_reduce", 1e6, 1, True) == 0.0
    assert collective_time("all_gather", 0, 8, True) == 0.0
    with pytest.raises(ValueError):
        collective_time("broadcast", 1e6, 8, True)


def test_overlap_policy_per_link(mesh):
    """By default a parameter gather is counted per link: each step of its
    redistribution at its link's fraction (dp crosses nodes on 16x8, tp
    stays within one), its local copies in full; other edges in full."""
    from autoparallel.cost_model import H100, counted_device

    p = CommOverlapPolicy()
    assert (p.network_fraction, p.nvlink_fraction) == (0.1, 0.6)
    counted = counted_device(H100, p, "param_all_gather")
    assert counted_device(H100, p, None) is H100 and counted_device(H100, p, "all_reduce") is H100
    assert apply_discount(1.0, "param_all_gather", p) == 1.0  # costed on the counted device instead
    for intra_node, fraction in ((False, 0.1), (True, 0.6)):
        full = collective_time("all_gather", 2**21, 8, intra_node, H100)
        assert collective_time("all_gather", 2**21, 8, intra_node, counted) == pytest.approx(fraction * full)
    tp_gather = (spec(mesh, (Replicate(), Shard(0))), spec(mesh, (Replicate(), Replicate())))
    assert redistribute_time(*tp_gather, counted) == pytest.approx(0.6 * redistribute_time(*tp_gather, H100))
    both = (spec(mesh, (Shard(0), Shard(1))), spec(mesh, (Replicate(), Replicate())))
    assert 0.1 * redistribute_time(*both, H100) < redistribute_time(*both, counted) < redistribute_time(*both, H100)


def test_overlap_policy_backward_kinds(mesh):
    """A backward op's gather of a parameter and its read of an activation
    count at their own fractions on either link; with the flat fractions
    they are not told apart from the other kinds."""
    from autoparallel.cost_model import BACKWARD_ACTIVATION, H100, PARAM_BACKWARD_GATHER, counted_device

    p = CommOverlapPolicy()
    both = (spec(mesh, (Shard(0), Shard(1))), spec(mesh, (Replicate(), Replicate())))
    full = redistribute_time(*both, H100)
    for kind, fraction in ((PARAM_BACKWARD_GATHER, p.backward_param_fraction), (BACKWARD_ACTIVATION, 0.5)):
        counted = counted_device(H100, p, kind)
        assert (counted.intra_node_counted, counted.inter_node_counted) == (fraction, fraction)
        for intra_node in (False, True):
            one = collective_time("all_gather", 2**21, 8, intra_node, H100)
            assert collective_time("all_gather", 2**21, 8, intra_node, counted) == pytest.approx(fraction * one)
        assert fraction * full < redistribute_time(*both, counted) < full  # local copies in full
    flat = CommOverlapPolicy(network_fraction=None)
    assert counted_device(H100, flat, BACKWARD_ACTIVATION) is H100
    assert apply_discount(1.0, BACKWARD_ACTIVATION, flat) == 1.0


def test_overlap_policy_flat():
    p = CommOverlapPolicy(network_fraction=None)
    assert apply_discount(1.0, "param_all_gather", p) == p.param_allgather_discount
    assert apply_discount(1.0, "grad_reduce_scatter", p) == p.grad_reduce_scatter_discount
    assert apply_discount(1.0, "all_reduce", p) == 1.0
    assert apply_discount(1.0, "param_all_gather", CommOverlapPolicy(enabled=False)) == 1.0


def test_overlap_compute_windows():
    from autoparallel.cost_model import ComputeWindows, HiddenComm

    flat = CommOverlapPolicy(param_allgather_discount=0.25, grad_reduce_scatter_discount=0.25, network_fraction=None)
    on = dataclasses.replace(flat, compute_windows=True)
    # fits its window: the flat fraction; longer: what sticks out
    assert apply_discount(1.0, HiddenComm("param_all_gather", 2.0), on) == 0.25
    assert apply_discount(3.0, HiddenComm("param_all_gather", 2.0), on) == pytest.approx(1.0)
    assert apply_discount(3.0, HiddenComm("param_all_gather", 2.0), flat) == 0.75  # windows off
    again = HiddenComm("param_all_gather", 2.0, backward_window=0.5)
    assert apply_discount(1.0, again, on) == 0.25
    assert apply_discount(1.0, again, dataclasses.replace(on, regather_in_backward=True)) == 0.75
    assert apply_discount(3.0, HiddenComm("grad_reduce_scatter", 2.0), CommOverlapPolicy(enabled=False)) == 3.0

    class Param:
        def __init__(self, numel):
            self.meta = {"val": torch.empty(numel, device="meta")}

    paths = {
        "a": "layers.0.attention",
        "b": "layers.0.feed_forward",
        "c": "layers.1.attention",
        "d": "norm",
        "e": "layers.0.attention",
    }
    windows = ComputeWindows.of(
        ["a", "b", "c", "d", "e"],
        {"layers.0.w1.weight": Param(300), "layers.0.w2.weight": Param(100), "norm.weight": Param(10)},
        compute={"a": 1.0, "b": 2.0, "c": 1.0, "d": 5.0, "e": 4.0}.__getitem__,
        module_path=paths.__getitem__,
        is_backward=lambda n: n == "e",
    )
    assert windows.forward == {"layers.0": 3.0, "layers.1": 1.0} and windows.backward == {"layers.0": 4.0}
    # w1 holds 3/4 of its block's bytes: 3/4 of the forward, 3/4 of half the backward
    assert windows.kind("param_all_gather", "layers.0.w1.weight") == HiddenComm("param_all_gather", 2.25, 1.5)
    assert windows.kind("grad_reduce_scatter", "layers.0.w2.weight", edges=2) == HiddenComm("grad_reduce_scatter", 0.25)
    assert windows.kind("param_all_gather", "norm.weight") == "param_all_gather"  # outside a block: flat


def test_cached_redistribute_benchmark(mesh):
    pairs = [
        (spec(mesh, a), spec(mesh, b))
        for a in [(Shard(0), Shard(1)), (Replicate(), Partial()), (Shard(1), Replicate())]
        for b in [(Replicate(), Replicate()), (Shard(0), Shard(0)), (Replicate(), Shard(1))]
    ]
    expected = [redistribute_time(s, d) for s, d in pairs]
    t0 = time.perf_counter()
    for i in range(10_000):
        s, d = pairs[i % len(pairs)]
        redistribute_time(s, d)
    dt = time.perf_counter() - t0
    print(f"\n10k cached redistribute_time calls: {dt * 1e3:.1f} ms ({dt * 1e2:.2f} us/call)")
    assert [redistribute_time(s, d) for s, d in pairs] == expected


def test_mesh_topology_read_under_fake_mode(mesh):
    """Apply costs redistributions while tracing under a fake mode that
    converts real tensors: the first read of a mesh's topology there (a
    saved plan applied without planning first) must see the real rank
    layout (it raised DataDependentOutputException)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autoparallel.cost_model import comm

    expected = comm.mesh_dim_topology(mesh, 8)
    clear_caches()
    with FakeTensorMode(allow_non_fake_inputs=True):
        got = comm.mesh_dim_topology(mesh, 8)
    assert got == expected
    assert [(t.group_size, t.intra_node) for t in got] == [(16, False), (8, True)]


def test_bucketed_gathers_and_reductions_count_their_copies(mesh):
    """A parameter gather counts its copy out of the bucket's gathered
    buffer (at least a kernel launch) and its bytes of the copy in; a
    gradient reduction its bytes of the copy in; other edges nothing."""
    from autoparallel.cost_model import GRAD_REDUCE_SCATTER, H100, PARAM_ALL_GATHER
    from autoparallel.cost_model.bucket_copies import bucket_copy_grid, bucket_copy_time
    from autoparallel.cost_model.steps import local_copy_time

    shard, whole = spec(mesh, (Shard(0), Replicate())), spec(mesh, (Replicate(), Replicate()))
    partial = spec(mesh, (Partial(), Replicate()))
    gathered = 4096 * 4096 * 2
    assert bucket_copy_time(shard, whole, PARAM_ALL_GATHER, H100) >= local_copy_time(gathered, H100)
    assert bucket_copy_time(whole, shard, PARAM_ALL_GATHER, H100) == 0.0  # a slice: no bucket
    assert bucket_copy_time(partial, shard, GRAD_REDUCE_SCATTER, H100) == pytest.approx(
        2 * gathered / (H100.hbm_bw * H100.memory_efficiency)
    )
    assert bucket_copy_time(shard, whole, None, H100) == 0.0
    specs = [shard, whole, partial]
    for kind in (PARAM_ALL_GATHER, GRAD_REDUCE_SCATTER):
        grid = bucket_copy_grid(specs, specs, kind, H100)
        assert grid.tolist() == [[bucket_copy_time(s, d, kind, H100) for d in specs] for s in specs]
    assert bucket_copy_grid(specs, specs, None, H100) is None
