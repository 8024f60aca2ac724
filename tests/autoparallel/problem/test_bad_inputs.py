"""Bad inputs through the public API: each raises a short message
that names the thing (argument, input/output index, node, constraint) and
says what would be valid; nothing is silently accepted. Also: the `with`
body runs outside the tracing's fake mode, and plans are byte-identical in a
fresh process with another hash seed. Tiny models on fake meshes: fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import solver
from autoparallel import AutoParallel, ConstraintError, PlanMismatch
from autoparallel.problem.infeasibility import InfeasibleConstraintError

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 32)

    def forward(self, x):
        return self.l(x)

    def init_weights(self):
        nn.init.normal_(self.l.weight, std=0.02)
        nn.init.zeros_(self.l.bias)


class ReturnsNone(Lin):
    def forward(self, x):
        self.l(x)


class ReturnsInt(Lin):
    def forward(self, x):
        return self.l(x), 3


class ReturnsScalar(Lin):
    def forward(self, x):
        return self.l(x).sum()


def _model(cls=Lin):
    with torch.device("meta"):
        return cls()


def _x(batch: int = 8):
    return torch.empty(batch, 16, device="meta")


@pytest.fixture
def mesh2(fake_world):
    fake_world(8)
    return init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))


# -- AutoParallel(...) arguments: checked before tracing ---------------------------


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        ({"mp_policy": "bf16"}, TypeError, r"mp_policy must be None or a .*MixedPrecisionPolicy.*got str 'bf16'"),
        (
            {"mp_policy": types.SimpleNamespace(param_dtype="bf16")},
            TypeError,
            r"mp_policy.param_dtype must be None or a torch.dtype",
        ),
        (
            {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.int8)},
            ValueError,
            r"mp_policy.param_dtype must be a floating dtype, got torch.int8",
        ),
        ({"gpus_per_node": 0}, ValueError, r"gpus_per_node must be >= 1, got 0"),
        ({"gpus_per_node": 2.5}, TypeError, r"gpus_per_node must be an int, got float"),
        ({"device": "Z100"}, ValueError, r"unknown device 'Z100'; presets: A100, B200, H100, H200"),
        ({"device": 100}, TypeError, r"device must be a DeviceSpec or a preset name"),
        ({"time_limit": -1}, ValueError, r"time_limit must be > 0, got -1"),
        ({"time_limit": "10"}, TypeError, r"time_limit must be a number, got str"),
        ({"rel_gap": float("nan")}, ValueError, r"rel_gap must be a finite number, got nan"),
        ({"rel_gap": 5}, ValueError, r"rel_gap must be <= 1, got 5"),
        ({"backend": "gurobi"}, ValueError, r"unknown solver backend 'gurobi'; known: "),
        ({"link_repeated_layers": "yes"}, TypeError, r"link_repeated_layers must be a bool"),
        ({"overlap": 0.5}, TypeError, r"overlap must be None or a cost_model.CommOverlapPolicy"),
    ],
    ids=lambda v: ",".join(f"{k}={v[k]!r}" for k in v) if isinstance(v, dict) else None,
)
def test_bad_arguments(mesh2, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        AutoParallel(_model(), mesh2, _x(), **kwargs)


def test_bad_model_and_mesh(mesh2):
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got str"):
        AutoParallel("model", mesh2, _x())
    with pytest.raises(TypeError, match=r"mesh must be a DeviceMesh .*got tuple"):
        AutoParallel(_model(), (2, 4), _x())


# -- the traced step ----------------------------------------------------------------


def test_forward_returning_none(mesh2):
    with pytest.raises(ValueError, match=r"forward returned no tensor \(None\): .*must return the tensor"):
        with AutoParallel(_model(ReturnsNone), mesh2, _x()):
            pass


def test_dtensor_input_on_another_mesh(mesh2):
    other = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    x = DTensor.from_local(torch.empty(1, 16, device="meta"), other, [Shard(0)], run_check=False)
    with pytest.raises(
        ValueError,
        match=r"DTensor input 0 lives on mesh \(8,\) \('dp',\), but AutoParallel plans for mesh \(2, 4\) \('dp', 'tp'\)",
    ):
        with AutoParallel(_model(), mesh2, x):
            pass


def test_dtensor_input_on_another_mesh_from_a_callable(mesh2):
    other = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))

    def inputs():  # built while tracing: the mesh is seen through its placements
        return DTensor.from_local(torch.empty(1, 16, device="meta"), other, [Shard(0)], run_check=False)

    with pytest.raises(
        ConstraintError,
        match=r"DTensor input 0: a DTensor with 1 placements lives on another mesh than the 2-D mesh \(2, 4\)",
    ):
        with AutoParallel(_model(), mesh2, inputs):
            pass


# -- constraint methods ---------------------------------------------------------------

RR = (Replicate(), Replicate())
S0R = (Shard(0), Replicate())


@pytest.mark.parametrize(
    "cls, call, exc, message",
    [
        (
            Lin,
            lambda a: a.add_parameter_memory_constraint(high="0.5"),
            TypeError,
            r"parameter memory constraint high must be a number, got str '0.5'",
        ),
        (Lin, lambda a: a.add_parameter_memory_constraint(high=-1), ValueError, r"high must be >= 0, got -1"),
        (
            Lin,
            lambda a: a.add_parameter_memory_constraint(low=2.0),
            ConstraintError,
            r"low=2.0 exceeds 1.0, the fully replicated size",
        ),
        (Lin, lambda a: a.add_parameter_memory_constraint(low=0.5, high=0.25), ConstraintError, r"low=0.5 > high=0.25"),
        (
            ReturnsInt,
            lambda a: a.add_output_constraints([None, S0R]),
            ConstraintError,
            r"output constraint 1: the traced value there is 3, not a tensor; pass None",
        ),
        (
            ReturnsScalar,
            lambda a: a.add_output_constraints([S0R]),
            ConstraintError,
            r"output constraint 0: S\(0\) is out of range for a 0-D tensor .*Replicate\(\) or Partial\(\)",
        ),
        (
            Lin,
            lambda a: a.add_input_constraints([Shard(0)]),
            ConstraintError,
            r"input constraint 0: placements must be a tuple with one Placement per mesh dim, e.g. \(Shard\(0\), Replicate\(\),\)",
        ),
        (
            Lin,
            lambda a: a.add_input_constraints(Shard(0)),
            TypeError,
            r"input constraints must be a list with one placement tuple \(or None\) per input",
        ),
        (
            Lin,
            lambda a: a.add_input_constraints([("S0", "R")]),
            ConstraintError,
            r"input constraint 0: 'S0' is not a Placement",
        ),
        (
            Lin,
            lambda a: a.add_input_constraints([(Shard(0),)]),
            ConstraintError,
            r"1 placements given for a 2-D mesh \(2, 4\) \('dp', 'tp'\); give one per mesh dim",
        ),
        (
            Lin,
            lambda a: a.add_input_constraints([(Shard(2), Replicate())]),
            ConstraintError,
            r"input constraint 0: S\(2\) is out of range for a 2-D tensor .*valid: Shard\(0\) .. Shard\(1\)",
        ),
        (
            Lin,
            lambda a: a.add_node_constraint(5, RR),
            TypeError,
            r"node must be an FX node or a node name \(str\), got int",
        ),
    ],
)
def test_bad_constraints(mesh2, cls, call, exc, message):
    with AutoParallel(_model(cls), mesh2, _x()) as autop:
        with pytest.raises(exc, match=message):
            call(autop)


def test_conflicting_constraints_on_one_node(mesh2):
    with AutoParallel(_model(), mesh2, _x()) as autop:
        autop.add_input_constraints([S0R])
        node = autop.traced.input_nodes[0]
        autop.add_node_constraint(node, S0R)  # the same layout again is fine
        with pytest.raises(
            ConstraintError,
            match=rf"node constraint {node.name} pins node {node.name} to \(R, R\), but input constraint 0 already pins it to \(S\(0\), R\)",
        ):
            autop.add_node_constraint(node, RR)
        # nothing half-recorded: the plan keeps the first constraint only
        plan = autop.optimize_placement()
    assert plan.nodes[node.name].output_placements == "S(0)R"
    # the budget is on by default; the mesh's "tp" name gives that dim its role
    pins = {
        k: v for k, v in plan.constraints.items() if k not in ("memory budget", "parameter memory budget", "mesh roles")
    }
    assert set(pins) == {"input constraint 0", f"node constraint {node.name}"}
    assert all(c["placements"] == ["S(0)", "R"] for c in pins.values())


def test_dtensor_input_conflicts_with_input_constraint(mesh2):
    x = DTensor.from_local(torch.empty(4, 16, device="meta"), mesh2, S0R, run_check=False)
    with AutoParallel(_model(), mesh2, x) as autop:
        with pytest.raises(
            ConstraintError,
            match=r"input constraint 0 pins node \w+ to \(R, R\), but DTensor input 0 already pins it to \(S\(0\), R\)",
        ):
            autop.add_input_constraints([RR])


# -- infeasibility in user terms, before the ILP --------------------------------------


def _budget(high):
    return lambda a: (a.add_parameter_memory_constraint(high=high), a.optimize_placement())


def _pin_weight(a):
    a.add_parameter_memory_constraint()  # as sharded as the mesh allows
    a.add_node_constraint(a.traced.param_nodes["l.weight"], RR)
    a.optimize_placement()


def _pin_weight_sharded_low(a):
    a.add_node_constraint(a.traced.param_nodes["l.weight"], (Shard(0), Shard(1)))
    a.add_parameter_memory_constraint(low=0.9, high=1.0)
    a.optimize_placement()


@pytest.mark.parametrize(
    "batch, call, message",
    [
        (
            7,
            lambda a: a.add_input_constraints([S0R]),
            r"input constraint 0: input 0 has size 7 on dim 0, which Shard\(0\) cannot split over 'dp' \(2 ranks\): dims must divide evenly \(layouts it can take: RR, RS\(1\), S\(1\)R, S\(1\)S\(1\)\)",
        ),
        (
            4,
            lambda a: a.add_input_constraints([(Shard(0), Shard(0))]),
            r"input 0 has size 4 on dim 0, which Shard\(0\) cannot split over 'dp' x 'tp' \(8 ranks\)",
        ),
        (
            8,
            lambda a: a.add_input_constraints([(Partial(), Replicate())]),
            r"input constraint 0: input 0 cannot be Partial\(\) on 'dp': a graph input is a whole value",
        ),
        (
            8,
            lambda a: a.add_output_constraints([(Partial(), Replicate())]),
            r"output constraint 0: output 0 \(its incoming gradient, tangents_1, takes the same layout\) cannot be Partial\(\) on 'dp'",
        ),
        (
            8,
            _budget(0.01),
            r"parameter memory budget: high=0.01 is below the smallest per-rank parameter memory reachable, 0.125 of the replicated size; use high >= 0.125",
        ),
        (
            8,
            _pin_weight,
            r"the bound high=None \(every parameter as sharded as the mesh allows, 0.125 of the replicated size\) cannot hold with node constraint primals_1 \(l.weight as \(R, R\)\); call add_parameter_memory_constraint\(high=0.9",
        ),
        (
            8,
            lambda a: (a.add_parameter_memory_constraint(low=0.5), a.optimize_placement()),
            r"low=0.5 is above high=None \(every parameter as sharded as the mesh allows, 0.125 of the replicated size\); pass high as well",
        ),
        (
            8,
            _pin_weight_sharded_low,
            r"low=0.9 is above the largest per-rank parameter memory reachable with node constraint primals_1 \(l.weight as \(S\(0\), S\(1\)\)\), 0.1765 of the replicated size; use low <= 0.1765",
        ),
    ],
    ids=[
        "batch7-dp2",
        "batch4-dp-x-tp",
        "partial-input",
        "partial-output",
        "budget-below-min",
        "pin-vs-fully-sharded",
        "low-above-fully-sharded",
        "low-above-pinned-max",
    ],
)
def test_infeasible_explained(mesh2, batch, call, message):
    with AutoParallel(_model(), mesh2, _x(batch)) as autop:
        with pytest.raises(InfeasibleConstraintError, match=message) as info:
            call(autop)
    assert isinstance(info.value, solver.InfeasibleError)  # what callers of optimize_placement catch
    assert info.value.conflict


def test_batch_32_on_128_ranks(fake_world):
    fake_world(128)
    mesh = init_device_mesh("cpu", (128,), mesh_dim_names=("dp",))
    with AutoParallel(_model(), mesh, _x(32)) as autop:
        with pytest.raises(
            InfeasibleConstraintError,
            match=r"input 0 has size 32 on dim 0, which Shard\(0\) cannot split over 'dp' \(128 ranks\)",
        ):
            autop.add_input_constraints([(Shard(0),)])


def test_solver_conflict_names_what_each_constraint_asked(mesh2):
    # param and gradient pinned apart: only the graph's edges conflict, so the
    # solver's diagnosis names them, with what each asked for
    with AutoParallel(_model(), mesh2, _x()) as autop:
        autop.add_parameter_memory_constraint(high=1.0)
        weight, grad = autop.traced.param_nodes["l.weight"], autop.traced.grad_nodes["l.weight"]
        autop.add_node_constraint(weight, RR)
        autop.add_node_constraint(grad, (Shard(0), Shard(0)))
        with pytest.raises(
            solver.InfeasibleError,
            match=rf"'node constraint {weight.name}' \({weight.name}, parameter l.weight, as RR\), 'node constraint {grad.name}' \({grad.name}, the gradient of l.weight, as S\(0\)S\(0\)\) \(a parameter's gradient takes the parameter's layout\)",
        ):
            autop.optimize_placement()


# -- the context's lifetime and fake-mode scope ----------------------------------------


def test_apply_after_the_context_closed(mesh2):
    with AutoParallel(_model(), mesh2, _x()) as autop:
        plan = autop.optimize_placement()
    with pytest.raises(RuntimeError, match=r"this AutoParallel context has closed: .*inside `with AutoParallel"):
        autop.apply_placement(plan)
    with pytest.raises(RuntimeError, match=r"context has closed"):
        autop.add_input_constraints([S0R])


def _apply_lin(mesh):
    with AutoParallel(_model(), mesh, _x()) as autop:
        autop.add_input_constraints([(Shard(0),) * mesh.ndim])
        return autop.apply_placement(autop.optimize_placement())


def test_with_body_runs_outside_fake_mode(fake_world):
    fake_world(8)
    mesh = init_device_mesh("cpu", (8,))
    with AutoParallel(_model(), mesh, _x()) as autop:
        assert type(torch.randn(2)) is torch.Tensor
        autop.add_input_constraints([(Shard(0),)])
        parallel = autop.apply_placement(autop.optimize_placement())
        # initialise and run the parallel module inside the body (8 simulated ranks)
        with LocalTensorMode(8) as lm:
            parallel.to_empty(device="cpu")
            parallel.init_weights()
            x = lm.rank_map(lambda r: torch.randn(1, 16))
            parallel(x).sum().backward()
        assert parallel.l.weight.grad is not None


@pytest.fixture
def lin_parallel(fake_world):
    fake_world(8)
    return _apply_lin(init_device_mesh("cpu", (8,)))


@pytest.mark.parametrize(
    "call, exc, message",
    [
        (
            lambda m: m(x=torch.randn(1, 16)),
            TypeError,
            r"traced with inputs structured as 1 positional arg and no keyword args, got 0 positional args and keyword args \['x'\]: call it",
        ),
        (
            lambda m: m.load_state_dict({"l.weight": torch.zeros(16, 32), "l.bias": torch.zeros(32)}),
            ValueError,
            r"load_state_dict key 'l.weight': expected a full tensor of shape \(32, 16\) .*got shape \(16, 32\)",
        ),
    ],
    ids=["keyword-for-positional", "load-state-dict-shape"],
)
def test_bad_parallel_module_calls(lin_parallel, call, exc, message):
    with LocalTensorMode(8):
        lin_parallel.to_empty(device="cpu")
        with pytest.raises(exc, match=message):
            call(lin_parallel)


# -- a plan applies only where it was made (its provenance) ----------------------------


def test_plan_for_another_mesh_is_refused(fake_world):
    fake_world(8)
    with AutoParallel(_model(), init_device_mesh("cpu", (4, 2)), _x()) as autop:
        plan = autop.optimize_placement()
    with AutoParallel(_model(), init_device_mesh("cpu", (2, 4)), _x()) as autop:
        with pytest.raises(PlanMismatch, match=r"\(4, 2\)"):
            autop.apply_placement(plan)


# -- plans do not depend on the hash seed -----------------------------------------------

_PLAN_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from autoparallel import AutoParallel
from autoparallel.models import FFN
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
with torch.device("meta"):
    model = torch.nn.Sequential(FFN(32, 64, bias=True), FFN(32, 64, bias=True), FFN(32, 64, bias=True))
with AutoParallel(model, mesh, torch.empty(8, 4, 32, device="meta")) as autop:
    autop.add_input_constraints([(Shard(0), Shard(1))])
    plan = autop.optimize_placement()
plan.dump_json(sys.argv[1])
"""


# slow (two fresh interpreters): by default, test_apply_gloo.py's
# test_llama_2x2_init_forward_backward checks that 4 spawned processes (each
# its own hash seed) make the same plan, and test_strategies_sharing.py's
# test_plan_identical_across_runs that repeated runs give the same plan JSON
@pytest.mark.slow
def test_plan_json_identical_across_hash_seeds(tmp_path):
    paths = []
    for seed in ("0", "4242"):
        path = tmp_path / f"plan_{seed}.json"
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=ROOT)
        subprocess.run(
            [sys.executable, "-c", _PLAN_SCRIPT, str(path)],
            env=env,
            cwd=ROOT,
            check=True,
            capture_output=True,
            timeout=300,
        )
        paths.append(path)
    a, b = (json.loads(p.read_text()) for p in paths)
    assert a["nodes"] and len(a["nodes"]) > 10
    # stage timings are wall-clock; everything else must be identical
    a.pop("timings"), b.pop("timings")
    assert json.dumps(a, sort_keys=False) == json.dumps(b, sort_keys=False)
