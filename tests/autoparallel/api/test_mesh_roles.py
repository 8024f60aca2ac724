"""Mesh-dim roles (autoparallel.problem.mesh_roles) and grad_reduction="mean": roles
pin what they say (HSDP replicates parameters over dp_replicate and
all-reduces their gradients there; ep gives all-to-all expert dispatch), the
step matches a single device on LocalTensorMode ranks, and the mean option
gives DDP's gradients for the global batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel
from autoparallel.api import ConstraintError
from autoparallel.problem.mesh_roles import resolve
from autoparallel.models import FFN, MOE_CONFIGS, MoETransformer
from autoparallel.passes import PassOptions

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
]

HSDP = ("dp_replicate", "dp_shard", "tp")
LOCAL_TENSOR_PASSES = PassOptions(column_major_all_gather="reorder")
BATCH, SEQ, DIM, HIDDEN = 8, 4, 16, 64


def test_roles_from_names_and_validation(fake_world):
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=HSDP)
    assert resolve(mesh, None) == {0: "replicate", 1: "shard", 2: "tp"}
    assert resolve(mesh, {}) == {}
    assert resolve(mesh, {"dp_shard": "shard", 0: "replicate"}) == {0: "replicate", 1: "shard"}
    with pytest.raises(ConstraintError, match=r"'dp' is not a dim of the mesh; its dims are 'dp_replicate', 'dp_sh"):
        resolve(mesh, {"dp": "replicate"})
    with pytest.raises(ConstraintError, match=r"unknown role 'fsdp' for 'dp_shard'; valid roles: 'replicate' \("):
        resolve(mesh, {"dp_shard": "fsdp"})
    with pytest.raises(ConstraintError, match="all-to-all expert dispatch runs over one mesh dim"):
        resolve(mesh, {"dp_shard": "ep", "tp": "ep"})
    with pytest.raises(TypeError, match="mesh_roles must be a dict"):
        resolve(mesh, ["replicate"])
    # names outside torchtitan's convention have no role
    assert resolve(init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp")), None) == {1: "tp"}
    with pytest.raises(ValueError, match="grad_reduction must be 'sum'"):
        AutoParallel(FFN(4, 8), mesh, torch.empty(2, 4), grad_reduction="avg")


def _plan_ffn(mesh, **kwargs):
    with torch.device("meta"):
        model = FFN(DIM, HIDDEN)
    with AutoParallel(model, mesh, torch.empty(BATCH, SEQ, DIM, device="meta"), **kwargs) as autop:
        # fully sharded as far as the roles let: the toy FFN would
        # otherwise fit, and be planned, replicated everywhere
        autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan, pass_options=LOCAL_TENSOR_PASSES)
    return parallel, plan


def _grad_reductions(parallel, mesh) -> dict[str, set[str]]:
    """Collective kinds of the backward graph, by mesh dim name."""
    from autoparallel.apply import collectives

    out: dict[str, set[str]] = {}
    for c in collectives(parallel.backward_graph, mesh):
        out.setdefault(c.group, set()).add(c.kind)
    return out


def test_hsdp_roles_replicate_over_dp_replicate_and_match_ddp(fake_world):
    """Roles from the names on a 2x2x2 (dp_replicate, dp_shard, tp) mesh:
    every parameter replicated over dp_replicate (gradients all-reduced
    there), the batch split over both data-parallel dims; with
    grad_reduction="mean" and each rank's loss the mean over its shard,
    gradients equal the single-device gradients of the global batch's mean
    loss."""
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=HSDP)
    parallel, plan = _plan_ffn(mesh, grad_reduction="mean")
    params = {n.module_path: n.output_placements for n in plan.nodes.values() if n.is_parameter}
    assert params and all(p.startswith("R") for p in params.values()), params
    # the fully-sharded bound still shards what it can within the replica
    assert any(p != "RRR" for p in params.values()), params
    assert "all_reduce" in _grad_reductions(parallel, mesh).get("dp_replicate", set()), _grad_reductions(parallel, mesh)
    inputs = [n for n in plan.nodes.values() if n.name.startswith("primals") and not n.is_parameter]
    assert [n.output_placements for n in inputs] == ["S(0)S(0)R"]
    text = plan.summary()
    assert "dp_replicate: role 'replicate' (parameters replicated and gradients all-reduced over it)" in text, text

    torch.manual_seed(0)
    ref = FFN(DIM, HIDDEN)
    x = torch.randn(BATCH, SEQ, DIM)
    ref(x).pow(2).mean().backward()
    per = BATCH // 4  # the batch splits over dp_replicate x dp_shard
    with LocalTensorMode(mesh.size()) as lm:
        parallel.to_empty(device="cpu")
        parallel.load_state_dict(ref.state_dict())
        out = parallel(lm.rank_map(lambda r: x[(r // 2) * per : (r // 2 + 1) * per].clone()))
        out.pow(2).mean().backward()  # each rank: the mean over its own shard
        grads = {n: p.grad.full_tensor() for n, p in parallel.named_parameters()}
    for name, p in ref.named_parameters():
        g = grads[name]
        for r in range(1, mesh.size()):
            torch.testing.assert_close(g._local_tensors[r], g._local_tensors[0], rtol=0, atol=0)
        torch.testing.assert_close(g._local_tensors[0], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_no_roles_leave_the_planner_free(fake_world):
    """mesh_roles={}: the same mesh without roles; the summary says what
    each dim did and why. The toy FFN fits replicated: bounded by the step
    memory budget alone, it is planned DDP over the data-parallel dims;
    bounded to fully sharded, it shards over every dim it can."""
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=HSDP)
    with torch.device("meta"):
        model = FFN(DIM, HIDDEN)
    with AutoParallel(model, mesh, torch.empty(BATCH, SEQ, DIM, device="meta"), mesh_roles={}) as autop:
        autop.add_input_constraints([(Shard(0), Shard(0), Replicate())])
        free = autop.optimize_placement()
        autop.add_parameter_memory_constraint()
        sharded = autop.optimize_placement()
    assert "mesh roles" not in free.constraints
    assert all(n.output_placements == "RRR" for n in free.nodes.values() if n.is_parameter)
    text = free.summary()
    assert "dp_replicate: no role, the planner's choice:" in text and "100% of parameters) replicated" in text, text
    params = [n.output_placements for n in sharded.nodes.values() if n.is_parameter]
    assert any(not p.startswith("R") for p in params), params
    text = sharded.summary()
    assert "dp_replicate: no role, the planner's choice:" in text and "because" in text, text


def test_grad_reduction_sum_is_the_sum_of_local_losses(fake_world):
    """The default: gradients of the sum of the shards' losses, dp times the mean's."""
    fake_world(4)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    parallel, _ = _plan_ffn(mesh)
    torch.manual_seed(0)
    ref = FFN(DIM, HIDDEN)
    x = torch.randn(BATCH, SEQ, DIM)
    ref(x).pow(2).mean().backward()
    per = BATCH // 4
    with LocalTensorMode(4) as lm:
        parallel.to_empty(device="cpu")
        parallel.load_state_dict(ref.state_dict())
        parallel(lm.rank_map(lambda r: x[r * per : (r + 1) * per].clone())).pow(2).mean().backward()
        grads = {n: p.grad.full_tensor()._local_tensors[0] for n, p in parallel.named_parameters()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], 4 * p.grad, rtol=1e-5, atol=1e-7)


# one block, a MoE one: the role rules act on the routed-experts ops
MOE = dataclasses.replace(MOE_CONFIGS["debug"], n_layers=1, n_dense_layers=0)


def test_ep_role_gives_all_to_all_dispatch(fake_world):
    """The role 'ep' (from the dim's name) on the tiny MoE's second mesh
    dim: every routed-experts op in the all-to-all mode there (tokens
    sharded, experts Shard(0)), which at this toy size the planner alone
    does not choose (the in-op all-to-alls cost more than gathering the
    tiny expert weights); apply lowers it to the all-to-all dispatch ops
    (tests/autoparallel/models/test_moe.py runs that step)."""
    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    with torch.device("meta"):
        model = MoETransformer(MOE)
    x = torch.empty(4, 8, dtype=torch.long, device="meta")
    with AutoParallel(model, mesh, x) as autop:
        plan = autop.optimize_placement()
    routed = [n for n in plan.nodes.values() if n.op.startswith("autoparallel.moe_experts")]
    assert routed
    for n in routed:
        off = 1 if "backward" in n.op else 0
        x_pl, w1_pl = n.input_placements[off], n.input_placements[off + 3]
        assert x_pl.endswith("S(0)") and w1_pl.endswith("S(0)"), (n.name, n.input_placements)
    assert "expert parallel (tokens by all-to-all) over ep" in plan.summary()
    # the batch splits over both dims (every dim has a role)
    assert plan.constraints["mesh roles (input 0)"]["placements"] == ["S(0)", "S(0)"]


def test_hand_layouts_are_solved_without_the_role_rules(fake_world):
    """A hand layout says itself what each dim does: inside
    ``scoped_constraints(without_role_rules=True)`` (the baselines' scope)
    the roles' option rules do not hold, and they hold again after it."""
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=HSDP)
    with torch.device("meta"):
        model = FFN(DIM, HIDDEN)
    with AutoParallel(model, mesh, torch.empty(BATCH, SEQ, DIM, device="meta")) as autop:
        autop.add_parameter_memory_constraint()  # fully sharded where the rules let
        autop.optimize_placement()
        rules = dict(autop._constraints.option_rules)
        assert rules  # dp_replicate keeps parameters replicated
        with autop.scoped_constraints(without_role_rules=True):
            plan = autop.optimize_placement()
            assert autop._constraints.option_rules == {}
        assert autop._constraints.option_rules == rules
        again = autop.optimize_placement()
    assert [n.output_placements for n in again.nodes.values() if n.is_parameter][0].startswith("R")
    # free of the rules, the fully-sharded bound shards over dp_replicate too
    params = [n.output_placements for n in plan.nodes.values() if n.is_parameter]
    assert any(not p.startswith("R") for p in params), params
