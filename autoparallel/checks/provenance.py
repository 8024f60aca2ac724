"""What a plan was made for, and the check that it is applied to the same.

A plan chooses one option per graph node by name and index; applied to
another model, mesh or input shape those indices mean something else
(a plan for a (4, 2) mesh applied on a (2, 4) mesh shards by 4 where it
planned 2). :func:`provenance` records the traced graph's name-free
fingerprint, the input shapes, the mesh and the cost model;
:func:`check_applicable` compares them with a :class:`PlanTarget` (what an
``AutoParallel`` context holds: model, traced step, mesh, cost model, pins)
and names what differs, and :func:`resolve_choice` maps the plan's placements
back to option indices of the context's strategies (by placement, not by
position, so a plan survives a change in option enumeration order).
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import PlanMismatch
from ..options.strategies import format_specs

if TYPE_CHECKING:
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from ..capture.tracing import TracedStep
    from ..cost_model import DeviceSpec
    from ..plan import Plan


@dataclass(frozen=True)
class PlanTarget:
    """What a plan is made for, or applied to: the pieces of an
    ``AutoParallel`` context that its provenance records and checks."""

    model: nn.Module
    traced: TracedStep
    mesh: DeviceMesh
    device: DeviceSpec
    mp_policy: Any  # torch MixedPrecisionPolicy or None
    # node name -> (constraint name, placements): the layouts the user pinned
    pins: dict[str, tuple[str, tuple]]


# joint graph -> its fingerprint: hashing a large graph takes a while and
# both planning and every apply ask for it (held only while the graph lives)
_FINGERPRINTS: weakref.WeakKeyDictionary[torch.fx.GraphModule, str] = weakref.WeakKeyDictionary()


def graph_fingerprint(gm: torch.fx.GraphModule) -> str:
    """sha1 over the structural hashes of the joint graph (node names play
    no part; placeholders by position, shape and dtype)."""
    from ..apply.fingerprint import node_hashes

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    def key(i: int) -> str:
        v = placeholders[i].meta.get("val")
        return f"input{i}|{tuple(v.shape) if isinstance(v, torch.Tensor) else None}|{getattr(v, 'dtype', None)}"

    hashes = node_hashes(gm, key)
    return hashlib.sha1("\n".join(hashes[n] for n in gm.graph.nodes).encode()).hexdigest()


def _input_shapes(target: PlanTarget) -> list:
    out = []
    for node in target.traced.input_nodes:
        v = node.meta.get("val") if node is not None else None
        out.append(None if not isinstance(v, torch.Tensor) else [list(v.shape), str(v.dtype).replace("torch.", "")])
    return out


def provenance(target: PlanTarget) -> dict[str, Any]:
    """The record stored in the plan (JSON-able)."""
    gm = target.traced.gm
    fp = _FINGERPRINTS.get(gm)
    if fp is None:
        fp = _FINGERPRINTS[gm] = graph_fingerprint(gm)
    mp = target.mp_policy
    return {
        "model": type(target.model).__name__,
        # distinct parameters (tied weights once), for the report's title
        "parameters": sum(p.numel() for p in target.model.parameters()),
        "graph_fingerprint": fp,
        "num_graph_nodes": len(target.traced.gm.graph.nodes),
        "input_shapes": _input_shapes(target),
        "device": dataclasses.asdict(target.device),
        "mp_policy": None
        if mp is None
        else {k: str(getattr(mp, k, None)).replace("torch.", "") for k in ("param_dtype", "reduce_dtype")},
        "torch_version": torch.__version__,
    }


def check_applicable(plan: "Plan", target: PlanTarget) -> None:
    """Raise :class:`PlanMismatch` naming the first thing that differs
    between what ``plan`` was made for and ``target`` (input shapes, mesh,
    model graph); the cost model only matters for the solve, so a different
    one is allowed (the plan's estimates are then the plan's own)."""
    mesh = target.mesh
    names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    if [int(s) for s in plan.mesh_shape] != list(mesh.shape) or (
        plan.mesh_dim_names is not None and names is not None and list(plan.mesh_dim_names) != names
    ):
        raise PlanMismatch(
            f"the plan was made for mesh {tuple(plan.mesh_shape)} named {plan.mesh_dim_names}, "
            f"but is applied on mesh {tuple(mesh.shape)} named {names}: plan again for this mesh"
        )
    prov = plan.provenance
    if not prov:
        _check_pins(plan, target)  # a plan without a record (older JSON): only its layouts can be checked
        return
    mine = provenance(target)
    want, got = prov.get("input_shapes"), mine["input_shapes"]
    if want is not None and want != got:
        if len(want) != len(got):
            raise PlanMismatch(f"the plan was made for {len(want)} inputs, the model is given {len(got)}")
        i = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
        raise PlanMismatch(
            f"input {i}: the plan was made for shape/dtype {want[i]}, but the input is {got[i]}: "
            "plan again for this input shape"
        )
    if prov.get("graph_fingerprint") not in (None, mine["graph_fingerprint"]):
        raise PlanMismatch(
            f"the model differs from the one the plan was made for: traced graph fingerprint "
            f"{mine['graph_fingerprint'][:12]} ({mine['num_graph_nodes']} nodes) vs the plan's "
            f"{prov['graph_fingerprint'][:12]} ({prov.get('num_graph_nodes')} nodes); same model code, "
            "config, activation checkpointing and mixed-precision policy are needed"
        )
    _check_pins(plan, target)


def _check_pins(plan: "Plan", target: PlanTarget) -> None:
    """The constraints of ``target`` hold in ``plan``: a plan made with other
    input or output layouts would run on inputs laid out another way than
    the caller feeds (wrong numbers, no error)."""
    from ..options.placements import format_placement

    for node_name, (cname, placements) in target.pins.items():
        n = plan.nodes.get(node_name)
        want = "".join(format_placement(p) for p in placements)
        if n is not None and n.output_placements != want:
            raise PlanMismatch(
                f"{cname} asks for {want} but the plan lays node {node_name} out as {n.output_placements}: "
                "the plan was made with other constraints; plan again, or add the constraints it was made with"
            )


def resolve_choice(plan: "Plan", strategies: dict) -> dict[str, int]:
    """Option index per node name: the plan's index when its placements
    match that option, else the option with the plan's placements."""
    choice: dict[str, int] = {}
    for node, strat in strategies.items():
        n = plan.nodes.get(node.name)
        if n is None:
            raise PlanMismatch(f"the plan has no entry for graph node {node.name}")
        want = ([*n.input_placements], n.output_placements)

        def sig(o) -> tuple:
            return ([format_specs(s) for s in o.input_specs], format_specs(o.output_specs))

        if 0 <= n.option < len(strat.options) and sig(strat.options[n.option]) == want:
            choice[node.name] = n.option
            continue
        match = next((i for i, o in enumerate(strat.options) if sig(o) == want), None)
        if match is None:
            raise PlanMismatch(
                f"node {node.name} ({n.module_path or '-'}): the plan's placements "
                f"{','.join(want[0])} -> {want[1]} are not among its {len(strat.options)} options"
            )
        choice[node.name] = match
    return choice
