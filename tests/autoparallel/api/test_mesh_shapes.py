"""Meshes a new user brings: size-1 dims ((1, 4, 2) HSDP on one
node, (2, 1, 4), 4-D with a dim of 1), odd names, batches and widths that
do not divide. Planned on a fake process group, applied, and one step on
LocalTensorMode ranks checked against the single-device model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.models import FFN, LLAMA3_CONFIGS, Transformer

from test_apply import LOCAL_TENSOR_PASSES, _apply, _train_and_compare  # same directory

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

HSDP = ("dp_replicate", "dp_shard", "tp")


def _options_shard_over(strategies, mesh_dim: int) -> list[str]:
    """Nodes with an option that shards some tensor over ``mesh_dim``."""
    bad = []
    for node, strat in strategies.items():
        for o in strat.options:
            specs = [o.output_specs] if not isinstance(o.output_specs, tuple) else list(o.output_specs)
            specs += list(o.input_specs)
            if any(s is not None and not isinstance(s.placements[mesh_dim], (Replicate, Partial)) for s in specs):
                bad.append(node.name)
                break
    return bad


def test_size_one_dim_adds_no_options(fake_world, shape=(1, 4, 2)):
    """A mesh dim of size 1 holds whole tensors: the planner offers only
    Replicate there, so (1, 4, 2) is planned like (4, 2), not like 2x2x2
    (27x the option pairs: 1-layer LLaMA took 100 s on (1, 4, 2), 190 s on
    (2, 1, 4), over 7 min on (1, 1, 8), load 3-5; after: ~6-20 s). A user's Shard(0) pin on that dim means Replicate."""
    fake_world(8)
    one = shape.index(1)
    flat = tuple(s for s in shape if s != 1)
    sizes = {}
    for mesh_shape in (shape, flat):
        mesh = init_device_mesh("cpu", mesh_shape)
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=1))
        tokens = torch.empty(8, 16, dtype=torch.long, device="meta")
        with AutoParallel(model, mesh, tokens) as autop:
            autop.add_input_constraints([(Shard(0),) * mesh.ndim])
            if mesh.ndim == 3:
                assert _options_shard_over(autop.strategies, one) == []
                pin = autop._constraints.pins[autop.traced.input_nodes[0].name][1]
                assert pin[one] == Replicate() and pin.count(Shard(0)) == 2, pin
            sizes[mesh_shape] = autop.build_problem().size
    # the 2-D mesh also offers tp-outer parameter layouts; nothing else differs
    assert sizes[shape].options <= sizes[flat].options
    assert sizes[shape].pairs <= sizes[flat].pairs


@pytest.mark.parametrize(
    "shape",
    # (2, 1, 2, 2) and (2, 2, 2, 1) are 2x2x2 problems (~20-40 s on a loaded
    # machine): slow; (1, 4, 2) plans, applies and steps with a size-one dim
    [(1, 4, 2), pytest.param((2, 1, 2, 2), marks=pytest.mark.slow), pytest.param((2, 2, 2, 1), marks=pytest.mark.slow)],
)
def test_size_one_dims_plan_apply(fake_world, shape):
    """FFN with the batch pinned Shard(0) on every mesh dim: planned,
    applied, and two AdamW steps on the 8 simulated ranks equal the
    single-device model's."""
    fake_world(8)
    parallel, mesh, plan = _apply("ffn", shape)
    assert plan.solution.status == "optimal"
    for name, p in parallel.named_parameters():
        for dim, size in enumerate(shape):
            if size == 1:
                assert p.placements[dim] == Replicate(), (name, p.placements)
    from autoparallel.report.words import describe

    words = describe(plan)[0]
    for dim, size in enumerate(shape):
        if size == 1:
            assert f"dim{dim} (1): size 1, nothing split over it" in words, words
    _train_and_compare("ffn", parallel, mesh, steps=2)


def test_example_cli_refuses_bad_meshes(capsys):
    """The example's --mesh / --mesh-names mistakes stop at argument parsing
    with what is wrong (they used to reach init_device_mesh or
    init_process_group and fail there in torch's words)."""
    from test_example import _load_example

    example = _load_example()
    cases = {
        ("--mesh", "2", "0", "2"): "--mesh sizes must be positive",
        ("--mesh", "1", "1", "1", "1", "2"): "has 5 dims: name them with --mesh-names",
        ("--mesh", "2", "2", "2", "--mesh-names", "tp", "tp", "dp"): "--mesh-names must be distinct",
    }
    for argv, expected in cases.items():
        with pytest.raises(SystemExit):
            example.parse_args(list(argv))
        assert expected in capsys.readouterr().err, argv
    # five dims, named, are fine
    args = example.parse_args(["--mesh", "1", "1", "1", "1", "2", "--mesh-names", "a", "b", "c", "d", "e"])
    assert example.mesh_names(args, 5) == ("a", "b", "c", "d", "e")


@pytest.mark.parametrize(
    "shape, batch, placements, message",
    [
        (
            (2, 2, 2),
            8,
            (Shard(0), Replicate()),
            "2 placements given for a 3-D mesh (2, 2, 2) ('dp_replicate', 'dp_shard', 'tp'); give one per mesh dim",
        ),
        (
            (2, 2, 2),
            8,
            (Shard(0),) + (Replicate(),) * 3,
            "4 placements given for a 3-D mesh (2, 2, 2) ('dp_replicate', 'dp_shard', 'tp'); give one per mesh dim",
        ),
        # batch 6 over dp_replicate x dp_shard (4 ranks) does not divide
        (
            (2, 2, 2),
            6,
            (Shard(0), Shard(0), Replicate()),
            "size 6 on dim 0, which Shard(0) cannot split over "
            "'dp_replicate' x 'dp_shard' (4 ranks): dims must divide evenly",
        ),
        # the size-1 dim takes no share: only dp_shard's 4 ranks count
        ((1, 4, 2), 6, (Shard(0), Shard(0), Replicate()), "cannot split over 'dp_shard' (4 ranks)"),
        (
            (3, 2, 2),
            8,
            (Shard(0), Replicate(), Replicate()),
            "size 8 on dim 0, which Shard(0) cannot split over 'dp_replicate' (3 ranks)",
        ),
    ],
)
def test_bad_input_constraints_on_3d_meshes(fake_world, shape, batch, placements, message):
    """Placement tuples of the wrong length and batches that do not divide
    the data-parallel ranks stop at the constraint, naming the mesh dims
    and sizes (before any solve)."""
    from autoparallel.validation import ConstraintError

    fake_world(12)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=HSDP)
    with torch.device("meta"):
        model = FFN(8, 16)
    with AutoParallel(model, mesh, torch.empty(batch, 4, 8, device="meta")) as autop:
        with pytest.raises(ConstraintError) as err:
            autop.add_input_constraints([placements])
    assert message in str(err.value), str(err.value)


def test_saved_plan_with_other_input_layout_is_refused(fake_world, tmp_path):
    """A plan saved on a (1, 4, 2) mesh and applied in a context whose
    input constraint differs (batch over tp instead of dp_shard) is refused,
    naming the constraint: applied as it was, the parallel module would
    read each rank's local input as another shard than the one fed.
    With the same constraints it applies."""
    from autoparallel import Plan
    from autoparallel.checks.provenance import PlanMismatch

    fake_world(8)
    mesh = init_device_mesh("cpu", (1, 4, 2), mesh_dim_names=HSDP)
    x = torch.empty(8, 4, 16, device="meta")

    def context():
        with torch.device("meta"):
            model = FFN(16, 32)
        return AutoParallel(model, mesh, x)

    with context() as autop:
        autop.add_input_constraints([(Replicate(), Shard(0), Replicate())])
        autop.optimize_placement().dump_json(tmp_path / "plan.json")
    plan = Plan.load_json(tmp_path / "plan.json")
    with context() as autop:
        autop.add_input_constraints([(Replicate(), Replicate(), Shard(0))])
        with pytest.raises(
            PlanMismatch, match=r"input constraint 0 asks for RRS\(0\) but the plan lays node \S+ out as RS\(0\)R"
        ):
            autop.apply_placement(plan, pass_options=LOCAL_TENSOR_PASSES)
    with context() as autop:
        # Shard(0) on the size-1 dim is the same layout as Replicate there
        autop.add_input_constraints([(Shard(0), Shard(0), Replicate())])
        autop.apply_placement(plan, pass_options=LOCAL_TENSOR_PASSES)


@pytest.mark.parametrize(
    "shape, names, batch_dims, replicas",
    [
        ((2, 2, 2), ("dp_replicate", "dp_shard", "tp"), (0, 1), 2),
        ((1, 4, 2), ("dp_replicate", "dp_shard", "tp"), (0, 1), 2),  # 1 x 4 ranks split it
        ((2, 2, 2), ("data", "model", "pp"), (0,), 4),
        ((2, 2, 2), ("pp", "batch", "tp"), (1,), 4),
        ((2, 4), ("dp", "tp"), (0,), 4),
    ],
)
def test_example_batch_layout(fake_world, shape, names, batch_dims, replicas):
    """The example splits the batch over the dims named dp*/data*/batch*
    and, in --real, divides the all-reduced loss by the ranks holding each
    batch shard (it divided by mesh.size() // mesh.size(0): on HSDP
    2x2x2 it printed half the loss)."""
    from test_example import _load_example

    example = _load_example()
    fake_world(8)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    placements = example.data_placements(mesh)
    assert [i for i, p in enumerate(placements) if p == Shard(0)] == list(batch_dims)
    assert example.batch_replicas(mesh) == replicas


def test_dtensor_input_sharded_over_a_size_one_dim(fake_world):
    """A DTensor input laid out Shard(0) on every dim of a (1, 4, 2) mesh
    feeds a module planned for that (the plan stores Replicate on the
    size-1 dim, the same local tensor): it is accepted, not refused as
    "DTensor placements (S(0), S(0), S(0)) but the plan expects (R, S(0), S(0))"."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import distribute_tensor

    from test_apply import MODELS, _reference

    fake_world(8)
    parallel, mesh, _ = _apply("ffn", (1, 4, 2))
    ref = _reference("ffn")
    x = MODELS["ffn"][1]()
    expected = ref(x).detach()
    with LocalTensorMode(8):
        parallel.to_empty(device="cpu")
        parallel.load_state_dict(ref.state_dict())
        out = parallel(distribute_tensor(x, mesh, (Shard(0),) * 3))
        got = torch.cat([out._local_tensors[r] for r in range(8)])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
