"""Planning end to end on a fake process group: FFN on 1D meshes (DDP vs FSDP
emerge from the memory budget), determinism, and the API's error messages."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel, ConstraintError


class FFN(nn.Module):
    def __init__(self, dim=1024, hidden=4096):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def _ffn():
    with torch.device("meta"):
        return FFN()


def _inputs():
    return torch.empty(64, 512, 1024, device="meta")


def _plan(mesh, high=None, model=None):
    with AutoParallel(model or _ffn(), mesh, _inputs()) as autop:
        autop.add_input_constraints([(Shard(0),) * mesh.ndim])
        autop.add_output_constraints([(Shard(0),) * mesh.ndim])
        autop.add_parameter_memory_constraint(high=high)
        return autop.optimize_placement()


def _param_placements(plan):
    return {
        n.module_path: n.output_placements
        for n in plan.nodes.values()
        if n.name.startswith("primals") and n.module_path
    }


def test_ddp_when_replication_allowed(fake_world):
    fake_world(8)
    mesh = init_device_mesh("cpu", (8,))
    plan = _plan(mesh, high=1.0)
    params = _param_placements(plan)
    assert params == {"w1.weight": "R", "w1.bias": "R", "w2.weight": "R", "w2.bias": "R"}
    # weight gradients come out of the matmul as Partial and get reduced
    grad_mms = [
        n
        for n in plan.nodes.values()
        if n.phase == "backward" and n.op == "aten.mm.default" and n.output_placements == "P"
    ]
    assert len(grad_mms) == 2
    assert plan.solution.optimal


@pytest.mark.smoke
def test_fsdp_with_default_budget(fake_world):
    fake_world(8)
    mesh = init_device_mesh("cpu", (8,))
    plan = _plan(mesh)
    params = _param_placements(plan)
    assert all(p.startswith("S(") for p in params.values()), params
    # parameters are gathered before their matmuls in forward
    fwd = [n for n in plan.nodes.values() if n.phase == "forward" and n.op == "aten.addmm.default"]
    assert fwd and all(n.input_placements[1] == "S(0)" and n.input_placements[2] == "R" for n in fwd)
    assert plan.parameter_bytes_per_rank == pytest.approx(plan.parameter_bytes_total / 8)


@pytest.mark.smoke
def test_plan_is_deterministic(fake_world, tmp_path):
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 4))
    dumps = []
    for i in range(2):
        plan = _plan(mesh)
        path = tmp_path / f"plan{i}.json"
        plan.dump_json(str(path))
        data = json.loads(path.read_text())
        data["solver"].pop("presolve")
        dumps.append(json.dumps(data["nodes"], sort_keys=True))
    assert dumps[0] == dumps[1]


def test_explain_and_dump_fields(fake_world, tmp_path):
    fake_world(8)
    plan = _plan(init_device_mesh("cpu", (8,)))
    text = plan.explain("addmm")
    assert "addmm" in text and "options considered" in text
    plan.dump_json(str(tmp_path / "p.json"))
    node = json.loads((tmp_path / "p.json").read_text())["nodes"][0]
    for key in (
        "name",
        "op",
        "module_path",
        "phase",
        "shape",
        "dtype",
        "output_placements",
        "num_options",
        "compute_cost",
        "comm_cost",
    ):
        assert key in node


def test_dump_dir_env(fake_world, tmp_path, monkeypatch):
    fake_world(8)
    monkeypatch.setenv("AUTOPARALLEL_DUMP_DIR", str(tmp_path))
    _plan(init_device_mesh("cpu", (8,)))
    assert {"problem.json", "solution.json", "plan.json"} <= {p.name for p in tmp_path.iterdir()}


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda a: a.add_input_constraints([(Shard(0),), (Shard(0),)]), "2 input constraints given for 1 inputs"),
        (lambda a: a.add_output_constraints([]), "0 output constraints given for 1 outputs"),
        (lambda a: a.add_input_constraints([(Shard(0), Replicate())]), "2 placements given for a 1-D mesh"),
        (lambda a: a.add_input_constraints([(Shard(5),)]), "out of range for a 3-D tensor"),
        (lambda a: a.add_node_constraint("no_such_node", (Replicate(),)), "no graph node named 'no_such_node'"),
    ],
)
def test_bad_constraints(fake_world, call, message):
    fake_world(8)
    mesh = init_device_mesh("cpu", (8,))
    with AutoParallel(_ffn(), mesh, _inputs()) as autop:
        with pytest.raises(ConstraintError, match=message):
            call(autop)


@pytest.mark.smoke
def test_infeasible_constraints_are_named(fake_world):
    fake_world(8)
    mesh = init_device_mesh("cpu", (8,))
    import solver

    with AutoParallel(_ffn(), mesh, _inputs()) as autop:
        # a replicated output with a tiny memory budget below fully sharded
        autop.add_parameter_memory_constraint(high=0.01)
        with pytest.raises(solver.InfeasibleError, match="parameter memory budget"):
            autop.optimize_placement()


def test_uninitialised_process_group():
    if dist.is_initialized():
        dist.destroy_process_group()
    with pytest.raises((RuntimeError, ValueError)):
        mesh = init_device_mesh("cpu", (8,))
        with AutoParallel(_ffn(), mesh, _inputs()):
            pass


@pytest.mark.smoke
def test_state_restored_after_exception(fake_world):
    fake_world(8)
    mesh = init_device_mesh("cpu", (8,))
    from torch._guards import detect_fake_mode

    with pytest.raises(ZeroDivisionError):
        with AutoParallel(_ffn(), mesh, _inputs()):
            1 / 0
    assert detect_fake_mode() is None
    # the user's model is untouched
    model = _ffn()
    with AutoParallel(model, mesh, _inputs()) as autop:
        autop.optimize_placement()
    assert model.w1.weight.device.type == "meta"
