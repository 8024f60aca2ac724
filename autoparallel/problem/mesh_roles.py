"""Mesh-dim roles: say what a mesh dim is for, with torchtitan's names.

A role constrains the plan on one mesh dim and leaves the rest to the
planner::

    AutoParallel(model, mesh, inputs, mesh_roles={"dp_replicate": "replicate", "dp_shard": "shard", "tp": "tp"})

==============  ===========================================================
role            what the plan does over that dim
==============  ===========================================================
``replicate``   data parallel, parameters (and so their gradients)
                replicated: gradients are all-reduced (DDP; HSDP's
                replicate dim)
``shard``       data parallel, parameters may be sharded (FSDP; HSDP's
                shard dim): the planner decides, the default parameter-
                memory rule shards them as far as the mesh allows
``tp``          tensor parallel: the batch is not split over it
``cp``          context parallel: the sequence (tensor dim 1) is split,
                attention included (K and V gathered over the dim,
                :mod:`autoparallel.options.rules.context_parallel`)
``ep``          routed experts sharded by expert with all-to-all token
                dispatch (the routed-experts op of
                :mod:`autoparallel.models.moe`); data parallel elsewhere
==============  ===========================================================

Where every mesh dim has a role, the tensor inputs and outputs no
``add_input_constraints`` / ``add_output_constraints`` pins are laid out by
the roles: ``Shard(0)`` (the batch) over ``replicate``, ``shard`` and
``ep``, ``Shard(1)`` (the sequence) over ``cp``, ``Replicate()`` over
``tp``; one whose shape does not split so is left to the planner (logged).

``mesh_roles=None`` (the default) takes the roles from the mesh's dim
names: ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` and ``ep`` have the
roles above, other names none. ``mesh_roles={}`` gives no dim a role: the
planner is free on every dim, and :func:`dim_notes` says in the plan's
summary what each dim ended up doing and why.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Replicate, Shard

from ..options.rules.context_parallel import SEQUENCE_SHARDED_ATTENTION
from .option_rules import OptionRule, allowed_mask
from ..validation import ConstraintError

logger = logging.getLogger(__name__)

ROLES = {
    "replicate": "data parallel, parameters replicated, gradients all-reduced (DDP / HSDP replicate)",
    "shard": "data parallel, parameters may be sharded (FSDP / HSDP shard)",
    "tp": "tensor parallel, the batch not split",
    "cp": "context parallel, the sequence split",
    "ep": "routed experts sharded by expert, tokens dispatched by all-to-all",
}
# torchtitan's mesh dim names and the role each stands for
NAMED_ROLES = {"dp_replicate": "replicate", "dp_shard": "shard", "cp": "cp", "tp": "tp", "ep": "ep"}
# roles whose dim splits the batch (tensor dim 0 of inputs and outputs)
DATA_ROLES = ("replicate", "shard", "ep")
# the constraint log's key
LOG_KEY = "mesh roles"

_EXPERTS_FORWARD = "autoparallel.moe_experts.default"
_EXPERTS_BACKWARD = "autoparallel.moe_experts_backward.default"


def _dim_names(mesh: DeviceMesh) -> list[str]:
    return list(mesh.mesh_dim_names) if mesh.mesh_dim_names else [f"dim{d}" for d in range(mesh.ndim)]


def resolve(mesh: DeviceMesh, mesh_roles: Mapping[str | int, str] | None) -> dict[int, str]:
    """Mesh dim index -> role. ``None``: from the dim names
    (:data:`NAMED_ROLES`); a mapping: its keys are dim names (or indices),
    its values roles (:data:`ROLES`), every other dim without a role."""
    names = _dim_names(mesh)
    if mesh_roles is None:
        return {d: NAMED_ROLES[n] for d, n in enumerate(names) if n in NAMED_ROLES}
    if not isinstance(mesh_roles, Mapping):
        raise TypeError(
            f"mesh_roles must be a dict of mesh dim name -> role, None (roles from the dim names) or {{}} (no "
            f"roles), got {type(mesh_roles).__name__} {mesh_roles!r}"
        )
    roles: dict[int, str] = {}
    for key, role in mesh_roles.items():
        if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < mesh.ndim:
            d = key
        elif isinstance(key, str) and key in names:
            d = names.index(key)
        else:
            raise ConstraintError(
                f"mesh_roles: {key!r} is not a dim of the mesh; its dims are "
                + ", ".join(repr(n) for n in names)
                + (f" (or indices 0..{mesh.ndim - 1})" if mesh.ndim else "")
            )
        if role not in ROLES:
            raise ConstraintError(
                f"mesh_roles: unknown role {role!r} for {names[d]!r}; valid roles: "
                + "; ".join(f"{r!r} ({what})" for r, what in ROLES.items())
            )
        if d in roles and roles[d] != role:
            raise ConstraintError(f"mesh_roles: {names[d]!r} is given two roles, {roles[d]!r} and {role!r}")
        roles[d] = role
    ep = [names[d] for d, r in roles.items() if r == "ep"]
    if len(ep) > 1:
        raise ConstraintError(
            f"mesh_roles: 'ep' on {ep}: all-to-all expert dispatch runs over one mesh dim; give 'ep' to one of them "
            "(and 'shard' to the others to shard the experts' hidden dim, FSDP-style)"
        )
    return roles


def describe(mesh: DeviceMesh, roles: dict[int, str]) -> dict[str, str]:
    """Dim name -> role, for the constraint log and the plan."""
    names = _dim_names(mesh)
    return {names[d]: roles[d] for d in sorted(roles)}


def option_rules(
    traced: Any, strategies: dict[torch.fx.Node, Any], mesh: DeviceMesh, roles: dict[int, str]
) -> dict[str, list[OptionRule]]:
    """Per node name, the rules the roles put on it: every parameter
    replicated over a ``replicate`` dim; every routed-experts op (forward
    and backward) in the all-to-all mode over the ``ep`` dim (tokens
    sharded, expert weights ``Shard(0)``). Raises :class:`ConstraintError`
    naming the node when no option of it can follow its rule; every
    attention op sequence-sharded over a ``cp`` dim (context parallelism,
    :mod:`autoparallel.options.rules.context_parallel`)."""
    names = _dim_names(mesh)
    rules: dict[str, list[OptionRule]] = {}
    for d, role in sorted(roles.items()):
        cname = f"mesh role {names[d]}={role}"
        if role == "replicate":
            for fqn, node in traced.param_nodes.items():
                if node in strategies:
                    rules.setdefault(node.name, []).append(OptionRule(cname, d, output="R"))
        elif role == "cp":
            _cp_rules(strategies, d, cname, mesh, rules)
        elif role == "ep":
            found = 0
            for node, strat in strategies.items():
                op = str(getattr(node, "target", ""))
                if op == _EXPERTS_FORWARD:
                    rule = OptionRule(cname, d, inputs=((0, "S"), (3, "S(0)")))
                elif op == _EXPERTS_BACKWARD:
                    rule = OptionRule(cname, d, inputs=((1, "S"), (4, "S(0)")))
                else:
                    continue
                found += 1
                if not any(allowed_mask([rule], strat.options)):
                    from ..capture.tracing import module_path

                    raise ConstraintError(
                        f"{cname}: the routed-experts op {node.name} ({module_path(node) or 'no module path'}) has "
                        f"no all-to-all expert-parallel option over {names[d]!r} ({mesh.size(d)} ranks): its expert "
                        "count and the tokens must divide evenly by that many ranks, and no other mesh dim may "
                        "shard the experts; use another mesh shape or give the dim the role 'shard'"
                    )
                rules.setdefault(node.name, []).append(rule)
            if not found:
                logger.info("%s: the model has no routed-experts op; the dim is data parallel", cname)
    return rules


def _cp_rules(strategies: dict, d: int, cname: str, mesh: DeviceMesh, rules: dict[str, list[OptionRule]]) -> None:
    """Every attention op (forward and backward) takes its query split on the
    sequence over ``cp`` dim ``d``: the sequence-sharded option, which
    gathers K and V over the dim."""
    found = 0
    for node, strat in strategies.items():
        sig = SEQUENCE_SHARDED_ATTENTION.get(getattr(node, "target", None))
        if sig is None:
            continue
        found += 1
        rule = OptionRule(cname, d, inputs=((sig.query, f"S({sig.seq_dim})"),))
        if not any(allowed_mask([rule], strat.options)):
            from ..capture.tracing import module_path

            raise ConstraintError(
                f"{cname}: the attention op {node.name} ({module_path(node) or 'no module path'}) has no "
                f"sequence-sharded option over {_dim_names(mesh)[d]!r} ({mesh.size(d)} ranks): the sequence must "
                "divide evenly by that many ranks (and be a multiple of 32 for the memory-efficient kernel), a causal op "
                "needs as many keys as queries, the op may carry no dropout, and a mask (attn_mask) must have its "
                "query dim (-2) whole or broadcast (size 1); use another mesh shape or give the dim another role"
            )
        rules.setdefault(node.name, []).append(rule)
    if not found:
        logger.info("%s: the model has no sequence-shardable attention op; only the inputs are split", cname)


def io_placements(mesh: DeviceMesh, roles: dict[int, str]) -> tuple | None:
    """The layout the roles give the step's inputs and outputs, when every
    mesh dim has a role (else None): the batch split over the data-parallel
    roles, the sequence over ``cp``, replicated over ``tp``."""
    if len(roles) != mesh.ndim:
        return None
    return tuple(
        Shard(0) if roles[d] in DATA_ROLES else (Shard(1) if roles[d] == "cp" else Replicate())
        for d in range(mesh.ndim)
    )


def io_pins(traced, strategies: dict, mesh: DeviceMesh, roles: dict[int, str], pinned) -> list[tuple]:
    """The pins the roles add to the step's tensor inputs and outputs no
    constraint pinned (``pinned``: names already pinned), as
    ``(node, placements, constraint name, subject)``: :func:`io_placements`
    where the node and its incoming gradient can take that layout; the
    others are left to the planner (logged)."""
    from ..validation import check_placements
    from .infeasibility import explain_unavailable_layout

    placements = io_placements(mesh, roles)
    if placements is None:
        return []
    ends = [("input", i, n, None) for i, n in enumerate(traced.input_nodes)]
    ends += [("output", i, n, traced.tangent_nodes.get(i)) for i, n in enumerate(traced.output_nodes)]
    out = []
    for kind, i, node, tangent in ends:
        if node is None or node.name in pinned or node not in strategies:
            continue
        cname = f"{LOG_KEY} ({kind} {i})"
        try:
            checked = check_placements(placements, node, mesh, cname)
        except ConstraintError:
            checked = None
        usable = checked is not None and all(
            n is None
            or n not in strategies
            or explain_unavailable_layout(cname, kind, n, checked, strategies[n].options, mesh) is None
            for n in (node, tangent)
        )
        if not usable:
            logger.info("%s: %s does not split as %s; left to the planner", cname, node.name, placements)
            continue
        out.append((node, checked, cname, f"{kind} {i}"))
    return out


# -- what each dim did, for the plan's summary -----------------------------------------


def dim_notes(plan, mains: list[str], sharded: list[bool]) -> list[str]:
    """One line per mesh dim of size > 1: its role and what the plan does
    there, or, without a role, what the planner chose and why. ``mains``:
    the dim's main matmul split (``data``, ``column``, ``row``,
    ``replicated``); ``sharded``: whether most parameter bytes are sharded
    over it."""
    names = plan.mesh_dim_names or [f"dim{d}" for d in range(len(plan.mesh_shape))]
    constraints = plan.constraints or {}
    roles = constraints.get(LOG_KEY) or {}
    memory = constraints.get("parameter memory budget") or {}
    fully_sharded = memory.get("high") is None
    out = []
    for d, name in enumerate(names):
        if plan.mesh_shape[d] == 1:
            continue
        did = _what(mains[d], sharded[d])
        role = roles.get(name)
        if role is not None:
            out.append(f"{name}: role {role!r} ({_ROLE_ASKS[role]}); the plan: {did}")
        else:
            out.append(f"{name}: no role, the planner's choice: {did}, {_reason(mains[d], sharded[d], fully_sharded)}")
    return out


# what each role asks of the plan
_ROLE_ASKS = {
    "replicate": "parameters replicated and gradients all-reduced over it",
    "shard": "data parallel, parameters free to shard",
    "tp": "the batch not split in the step's inputs and outputs",
    "cp": "the sequence split in the step's inputs and outputs",
    "ep": "routed experts split by expert, tokens sent by all-to-all",
}


def _what(main: str, weights_sharded: bool) -> str:
    if main == "data":
        return "data parallel, weights sharded (FSDP)" if weights_sharded else "data parallel, weights replicated (DDP)"
    if main in ("column", "row"):
        return "tensor parallel"
    if main == "replicated":
        return "matmuls replicated" + (", weights stored sharded" if weights_sharded else "")
    return "mixed"


def _reason(main: str, weights_sharded: bool, fully_sharded: bool) -> str:
    if main == "data" and weights_sharded and fully_sharded:
        return (
            "because the parameter-memory bound keeps every parameter as sharded as the mesh allows "
            "(add_parameter_memory_constraint(high=1.0) lets the planner replicate where that is cheaper; "
            "the role 'replicate' asks for it)"
        )
    if main == "data" and weights_sharded:
        return "because gathering sharded weights costs less than it saves, or the memory bounds ask for it"
    if main == "data":
        return "because all-reducing their gradients costs less than gathering sharded weights, and memory allows it"
    if main in ("column", "row"):
        return "because splitting the matmuls costs less than data parallelism over this dim would"
    if main == "replicated":
        return (
            "because the model is small enough that splitting its work over this dim costs more communication "
            "than it saves compute"
        )
    return "different layers split differently over it"
