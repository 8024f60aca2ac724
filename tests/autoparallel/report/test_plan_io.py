"""Plans that travel: a plan written to JSON, loaded and applied gives the
same parallel graphs as the in-memory plan; applying it to another model,
mesh or input shape is refused, naming what differs."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from autoparallel import AutoParallel
from autoparallel.apply.fingerprint import differences, fingerprint
from autoparallel.models import LLAMA3_CONFIGS, Transformer
from autoparallel.plan import Plan
from autoparallel.checks.provenance import PlanMismatch

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
]

ARGS = dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=2)
BATCH, SEQ = 8, 16


def _world(size: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized() and dist.get_world_size() == size:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)


def _autop(mesh_shape, *, args=ARGS, batch=BATCH, names=("dp", "tp")):
    _world(8)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names[: len(mesh_shape)])
    with torch.device("meta"):
        model = Transformer(args)
    autop = AutoParallel(model, mesh, torch.empty(batch, SEQ, dtype=torch.long, device="meta"))
    autop.__enter__()
    spec = (Shard(0),) * mesh.ndim
    autop.add_input_constraints([spec])
    autop.add_output_constraints([spec])
    return autop


@pytest.fixture(scope="module")
def saved_plan(tmp_path_factory):
    import torch.distributed as dist

    autop = _autop((4, 2))
    try:
        plan = autop.optimize_placement()
        model = autop.apply_placement(plan)
        fp = fingerprint(model.parallel_state.step.graphs)
    finally:
        autop.__exit__(None, None, None)
    path = tmp_path_factory.mktemp("plan") / "plan.json.gz"
    plan.dump_json(str(path))
    yield plan, path, fp, autop.built.problem
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.smoke
def test_load_apply_gives_the_same_graphs(saved_plan):
    plan, path, fp, _ = saved_plan
    loaded = Plan.load_json(str(path))
    assert loaded.provenance == plan.provenance and loaded.provenance["graph_fingerprint"]
    assert {n: p.output_placements for n, p in loaded.nodes.items()} == {
        n: p.output_placements for n, p in plan.nodes.items()
    }
    autop = _autop((4, 2))  # a fresh context: no solve
    try:
        model = autop.apply_placement(loaded)
    finally:
        autop.__exit__(None, None, None)
    assert autop.built is None
    assert differences(fingerprint(model.parallel_state.step.graphs), fp) == []


@pytest.mark.parametrize(
    "what, kwargs, message",
    [
        ("mesh", dict(mesh_shape=(2, 4)), "mesh (4, 2)"),
        ("mesh names", dict(mesh_shape=(4, 2), names=("a", "b")), "named ['dp', 'tp']"),
        ("input shape", dict(mesh_shape=(4, 2), batch=16), "input 0"),
        ("model", dict(mesh_shape=(4, 2), args=dataclasses.replace(ARGS, n_layers=3)), "model differs"),
    ],
)
@pytest.mark.smoke
def test_mismatch_is_named(saved_plan, what, kwargs, message):
    _, path, _, _ = saved_plan
    loaded = Plan.load_json(str(path))
    mesh_shape = kwargs.pop("mesh_shape")
    autop = _autop(mesh_shape, **kwargs)
    try:
        with pytest.raises(PlanMismatch, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            autop.apply_placement(loaded)
    finally:
        autop.__exit__(None, None, None)


def test_memory_matches_traced_sizes(saved_plan):
    from autoparallel.problem import memory

    plan, _, _, _ = saved_plan
    b = memory.breakdown(plan)
    # the ILP's parameter-memory term is computed from the traced tensors
    assert b.parameters == pytest.approx(plan.parameter_bytes_per_rank)
    # AdamW's two fp32 moments, and its step count per parameter tensor
    assert b.optimizer == pytest.approx(2 * b.parameters, rel=1e-3) and b.optimizer > 2 * b.parameters
    assert b.activations > 0  # measured by the overlap scheduler on apply
    text = plan.summary()
    assert "estimated step" in text and "overlap scheduler" in text and "traffic/rank" in text


def test_problem_dump_round_trips_and_resolves(saved_plan, tmp_path):
    import json

    import solver
    from solver import serialize

    plan, _, _, problem = saved_plan
    for name in ("problem.json", "problem.json.gz"):
        path = tmp_path / name
        serialize.dump(problem, path, shared=True, extra={"status": "optimal"})
        assert serialize.load(path) == problem
    compact, plain = serialize.dumps(problem, shared=True), serialize.dumps(problem)
    assert len(compact) < len(plain) / 1.5  # the two linked layers' tables once
    assert "tables" in json.loads(compact) and serialize.from_json(json.loads(plain)) == problem  # old form
    again = solver.solve(serialize.load(tmp_path / "problem.json"))
    assert again.objective == pytest.approx(plan.solution.objective, rel=1e-6)


def test_failed_solve_still_dumps_the_problem(tmp_path, monkeypatch):
    import json

    import torch.distributed as dist

    import solver

    from autoparallel.models import FFN

    (tmp_path / "plan.json").write_text("stale")
    monkeypatch.setenv("AUTOPARALLEL_DUMP_DIR", str(tmp_path))

    def fail(*args, **kwargs):
        raise solver.InfeasibleError("no placement satisfies 'input constraint 0'")

    _world(2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        monkeypatch.setattr(solver, "solve", fail)
        with AutoParallel(FFN(16, 32), mesh, torch.randn(4, 16)) as autop:
            with pytest.raises(solver.InfeasibleError):
                autop.optimize_placement()
    finally:
        dist.destroy_process_group()
    d = json.loads((tmp_path / "problem.json").read_text())
    assert d["status"].startswith("InfeasibleError: no placement")
    assert not (tmp_path / "plan.json").exists()  # the previous run's plan is gone
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


def test_explain_by_module_path(saved_plan):
    plan, _, _, _ = saved_plan
    text = plan.explain("layers.1.attention.wq")
    assert text.startswith("module layers.1.attention.wq: 1 parameter, ")
    # each entry leads with the module and the op; the FX node's name comes last
    entries = [line for line in text.splitlines()[1:] if not line.startswith(" ")]
    assert entries[0].startswith("layers.1.attention.wq.weight parameter [")
    assert any(line.startswith("layers.1.attention.wq mm (forward) [") for line in entries)
    assert all(re.search(r"   \[node \w+\]$", line) for line in entries), entries
    assert "primals_" not in text.splitlines()[0]
    assert re.search(r"compute [\d.]+ (us|ms), incoming communication [\d.]+ (us|ms)", text)
    assert "runner-up" in text and "per step" in text
    deltas = [[d for _, d in n.runner_ups] for n in plan.nodes.values() if n.runner_ups]
    assert deltas and all(r == sorted(r) for r in deltas)  # cheapest first
    with pytest.raises(KeyError, match="no node or module named 'layers.1.attention.wz'"):
        plan.explain("layers.1.attention.wz")


def test_only_rank_zero_of_the_mesh_dumps(tmp_path, monkeypatch):
    import autoparallel.api as api
    from autoparallel.models import FFN

    import torch.distributed as dist

    monkeypatch.setenv("AUTOPARALLEL_DUMP_DIR", str(tmp_path))
    _world(2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        monkeypatch.setattr(api.dist, "get_rank", lambda *a: 1)
        with AutoParallel(FFN(16, 32), mesh, torch.randn(4, 16)) as autop:
            autop.optimize_placement()
        assert list(tmp_path.iterdir()) == []
        monkeypatch.undo()
        monkeypatch.setenv("AUTOPARALLEL_DUMP_DIR", str(tmp_path))
        with AutoParallel(FFN(16, 32), mesh, torch.randn(4, 16)) as autop:
            autop.optimize_placement()
    finally:
        dist.destroy_process_group()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "problem.json", "solution.json"]
