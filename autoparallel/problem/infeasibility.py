"""Infeasibility in the user's terms, found before the ILP is built.

The solver can only say which named constraints conflict ("'input constraint
0' cannot be satisfied"). Most conflicts a user makes have a plain reason
that the placement options already show:

* a pinned layout no option offers: a dim that does not divide by the ranks
  sharding it (the planner offers even shards only, see
  :func:`autoparallel.options.placements.is_evenly_sharded`), ``Partial()`` where a
  node cannot be partial (an input), or a layout the op has no rule for;
* a parameter-memory budget outside what the parameters' options (and the
  pins on them) can reach: the message gives the reachable fraction.

What is left (pins that conflict only through the graph's edges or the
repeated-layer links) comes back from the solver's diagnosis;
:func:`describe_conflict` adds what each named constraint asked for.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Shard

import solver

from ..errors import InfeasibleConstraintError
from ..options.placements import format_placement, placements_of
from ..validation import describe_placements, mesh_dim_name

# how many layouts a message lists before "..."
_MAX_LISTED = 12
# how many conflicting constraints a message describes before "and N more"
_MAX_CONFLICTS = 24


def _layouts(options: Sequence[Any]) -> list[tuple]:
    seen: dict[tuple, None] = {}
    for o in options:
        p = placements_of(o.output_specs)
        if isinstance(p, tuple) and all(isinstance(x, Placement) for x in p):
            seen.setdefault(p, None)
    return list(seen)


def _format_layouts(layouts: list[tuple]) -> str:
    text = ", ".join("".join(format_placement(p) for p in lay) for lay in layouts[:_MAX_LISTED])
    return text + (", ..." if len(layouts) > _MAX_LISTED else "")


def _mesh_dims_text(mesh: DeviceMesh, dims: list[int]) -> str:
    names = " x ".join(mesh_dim_name(mesh, d) for d in dims)
    ranks = 1
    for d in dims:
        ranks *= mesh.size(d)
    return f"{names} ({ranks} ranks)"


def explain_unavailable_layout(
    what: str, subject: str, node: torch.fx.Node, placements: tuple, options: Sequence[Any], mesh: DeviceMesh
) -> str | None:
    """Why ``node`` cannot take ``placements`` (None when an option offers it).

    ``what`` names the constraint (``input constraint 0``), ``subject`` the
    tensor in user terms (``input 0``, ``output 1``, ``node addmm``).
    """
    layouts = _layouts(options)
    if tuple(placements) in layouts:
        return None
    valid = f"layouts it can take: {_format_layouts(layouts)}" if layouts else "it has no layout options"
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    # uneven shards: the planner offers only layouts whose sharded dims divide
    by_dim: dict[int, list[int]] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard) and 0 <= p.dim < len(shape):
            by_dim.setdefault(p.dim, []).append(mesh_dim)
    for dim, mesh_dims in by_dim.items():
        ranks = 1
        for d in mesh_dims:
            ranks *= mesh.size(d)
        if shape[dim] % ranks:
            return (
                f"{what}: {subject} has size {shape[dim]} on dim {dim}, which Shard({dim}) cannot split over "
                f"{_mesh_dims_text(mesh, mesh_dims)}: dims must divide evenly ({valid})"
            )
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial) and not any(isinstance(lay[mesh_dim], Partial) for lay in layouts):
            why = (
                "a graph input is a whole value, never a pending sum"
                if node.op == "placeholder"
                else f"no option of {node.name} leaves a pending sum there"
            )
            return f"{what}: {subject} cannot be Partial() on {mesh_dim_name(mesh, mesh_dim)}: {why} ({valid})"
    return f"{what}: {subject} (node {node.name}) has no option laid out as {describe_placements(placements)} ({valid})"


def check_pin(
    what: str, subject: str, node: torch.fx.Node, placements: tuple, options: Sequence[Any], mesh: DeviceMesh
) -> None:
    """Raise :class:`InfeasibleConstraintError` if no option of ``node`` has
    ``placements`` (checked when the constraint is added)."""
    reason = explain_unavailable_layout(what, subject, node, placements, options, mesh)
    if reason is not None:
        raise InfeasibleConstraintError(reason, conflict=[what])


def check_memory_budget(
    traced: Any,
    strategies: dict[torch.fx.Node, Any],
    mesh: DeviceMesh,
    pins: dict[str, tuple[str, tuple]],
    low: float | None,
    high: float | None,
    repeats: Any = None,
    option_rules: dict | None = None,
) -> None:
    """The budget ``[low, high]`` (fractions of replicated parameter bytes)
    must meet the range the parameters' options reach, given the pins on
    parameters. ``high=None`` is "every parameter as sharded as the mesh
    allows" (as far as its gradient can follow and its repeated layers
    agree: :func:`~autoparallel.problem.param_budget.param_floor`), which a pin
    to a less sharded layout breaks. ``option_rules`` (mesh-dim roles:
    parameters kept replicated over a dim) narrow what "as sharded as the
    mesh allows" reaches."""
    from .param_budget import param_floor, param_option_bytes, rule_masks

    weights = param_option_bytes(traced, strategies, mesh)
    floor = param_floor(traced, strategies, weights, repeats, rule_masks(traced, strategies, option_rules or {}))
    total = smallest = largest = unpinned_smallest = 0.0
    pinned: list[tuple[str, str]] = []  # (constraint name, what it pins)
    for fqn, node in traced.param_nodes.items():
        if fqn not in weights:
            continue
        strat, val, w = strategies[node], node.meta["val"], weights[fqn]
        reach = floor[fqn]
        unpinned_smallest += reach
        pin = pins.get(node.name)
        if pin is not None:
            allowed = [x for x, o in zip(w, strat.options) if tuple(o.output_spec.placements) == tuple(pin[1])]
            if allowed and (min(allowed) > reach or max(allowed) < max(w)):
                pinned.append((pin[0], f"{fqn} as {describe_placements(pin[1])}"))
            w = allowed or w
            reach = min(w)
        total += val.numel() * val.element_size()
        smallest += reach
        largest += max(w)
    if total == 0:
        return
    lo, hi = smallest / total, largest / total
    with_pins = f" with {', '.join(f'{c} ({t})' for c, t in pinned)}" if pinned else ""
    conflict = ["parameter memory budget"] + [c for c, _ in pinned]
    # the builder's relative slack of 1e-9 is the tolerance here too
    default_high = unpinned_smallest / total  # what high=None means to the builder
    if high is None and smallest > unpinned_smallest * (1 + 1e-9):
        raise InfeasibleConstraintError(
            f"parameter memory budget: the bound high=None (every parameter as sharded as the mesh allows, "
            f"{unpinned_smallest / total:.4g} of the replicated size) cannot hold{with_pins}; call "
            f"add_parameter_memory_constraint(high={lo:.4g}) or higher to allow it",
            conflict=conflict,
        )
    if high is not None and high * (1 + 1e-9) < lo:
        raise InfeasibleConstraintError(
            f"parameter memory budget: high={high:g} is below the smallest per-rank parameter memory "
            f"reachable{with_pins}, {lo:.4g} of the replicated size; use high >= {lo:.4g} "
            "(or high=None for as sharded as possible)",
            conflict=conflict,
        )
    if low is not None and low * (1 - 1e-9) > hi:
        raise InfeasibleConstraintError(
            f"parameter memory budget: low={low:g} is above the largest per-rank parameter memory "
            f"reachable{with_pins}, {hi:.4g} of the replicated size; use low <= {hi:.4g}",
            conflict=conflict,
        )
    if low is not None and high is None and low * (1 - 1e-9) > default_high:
        raise InfeasibleConstraintError(
            f"parameter memory budget: low={low:g} is above high=None (every parameter as sharded as "
            f"the mesh allows, {default_high:.4g} of the replicated size); pass high as well, e.g. high=1.0",
            conflict=conflict,
        )


def describe_conflict(
    err: solver.InfeasibleError, constraint_log: dict[str, Any], roles: dict[str, str] | None = None
) -> solver.InfeasibleError:
    """The solver's conflict with what each named constraint asked for
    (``'input constraint 0' (primals_3 as S(0)R)``). ``roles`` names what a
    node is to the user (``the gradient of w1.weight``); a parameter pinned
    apart from its own gradient gets the reason said."""
    roles = roles or {}
    described = []
    pinned_roles = []
    for name in err.conflict:
        entry = constraint_log.get(name)
        if isinstance(entry, dict) and "node" in entry:
            role = roles.get(entry["node"])
            pinned_roles.append(role or "")
            node = f"{entry['node']}, {role}," if role else entry["node"]
            described.append(f"'{name}' ({node} as {''.join(entry['placements'])})")
        elif isinstance(entry, dict) and entry.get("budget_bytes") is not None:
            from .memory_budget import describe_entry

            described.append(f"'{name}' ({describe_entry(entry, err.reachable.get(name))})")
        elif isinstance(entry, dict) and ("low" in entry or "high" in entry):
            described.append(f"'{name}' (low={entry.get('low')}, high={entry.get('high')})")
        else:
            described.append(f"'{name}'")
    if not described:
        return err
    reason = ""
    params = {r.removeprefix("parameter ") for r in pinned_roles if r.startswith("parameter ")}
    if any(r.removeprefix("the gradient of ") in params for r in pinned_roles if r.startswith("the gradient of ")):
        reason = " (a parameter's gradient takes the parameter's layout)"
    if err.unproven:
        # the solver's diagnosis ran out of work: the set conflicts, but may not be irreducible
        unproven = ", ".join(repr(n) for n in err.unproven[:_MAX_CONFLICTS])
        if len(err.unproven) > _MAX_CONFLICTS:
            unproven += f" and {len(err.unproven) - _MAX_CONFLICTS} more"
        tail = (
            f"; a partial diagnosis: {unproven} may not be needed (their checks reached the diagnosis' work "
            "limits, solver.work.DIAGNOSIS_NODE_LIMIT / DIAGNOSIS_MAX_CHECKS, or the time limit)"
        )
    else:
        tail = "; removing any one of them makes the problem feasible"
    listed = ", ".join(described[:_MAX_CONFLICTS])
    if len(described) > _MAX_CONFLICTS:
        listed += f" and {len(described) - _MAX_CONFLICTS} more"
    message = f"Infeasible: these constraints cannot hold together: {listed}{reason}{tail}"
    return solver.InfeasibleError(
        message,
        conflict=err.conflict,
        decisions=err.decisions,
        edges=err.edges,
        unproven=err.unproven,
        reachable=err.reachable,
    )
