"""The parameter-memory range as one resource row of the problem, and the
floor it cannot go below: per parameter, its bytes per rank under each
option (:func:`param_option_bytes`), the least-memory plan every parameter
can reach together with its gradient and its linked copies
(:func:`param_floor`), and the row that bounds their sum
(:func:`parameter_memory_row`: with ``high=None`` that floor, "every
parameter as sharded as the mesh allows"; ``add_parameter_memory_constraint``
moves it, and without one the API allows full replication when a step
memory budget bounds the whole step).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Shard, _StridedShard

import solver

from .edge_matrices import gradient_partners
from ..options.strategies import Option, placements_of
from .constraints import Constraints
from .option_rules import OptionRule, allowed_mask


PARAM_BUDGET = "parameter memory budget"  # its name in the constraint log and errors


def default_bound_entry() -> dict:
    """The constraint log's entry until ``add_parameter_memory_constraint``:
    ``high`` is filled in at each build by :func:`with_default_bound`."""
    return {"low": None, "high": None, "default": "the step memory budget bounds parameters"}


def with_default_bound(c: "Constraints", entry: dict, budget: float | None) -> "Constraints":
    """``c`` with the parameter-memory bound the planner uses when the user
    set none (``entry`` is the default one): the step's memory budget
    bounds parameters together with everything else (high=1.0: a model
    that fits replicated may be planned DDP-like, a large one is sharded as
    far as it must be); without a budget, every parameter as sharded as the
    mesh allows (high=None). A user's entry leaves ``c`` as it is."""
    if not entry.get("default"):
        return c
    entry["high"] = None if budget is None else 1.0
    return dataclasses.replace(c, memory_low=None, memory_high=entry["high"])


def local_numel(shape, placements, mesh: DeviceMesh) -> int:
    """Elements of rank 0's shard of a tensor of ``shape`` laid out as ``placements``."""
    sizes = list(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            sizes[p.dim] //= mesh.size(mesh_dim)
    return math.prod(sizes)


def option_mapping(ref: list[Option], other: list[Option]) -> list[int | None]:
    """For each option of ``ref``, the index of the option of ``other`` with
    the same placements (None: none): how a repeated layer's copy maps onto
    its reference."""
    if ref is other:
        return list(range(len(ref)))
    index = {(placements_of(o.output_specs), placements_of(o.input_specs)): j for j, o in enumerate(other)}
    return [index.get((placements_of(o.output_specs), placements_of(o.input_specs))) for o in ref]


def rule_masks(traced, strategies, option_rules: dict[str, list[OptionRule]]) -> dict[str, list[bool]]:
    """Per parameter (by fqn) with option rules, which of its options they allow."""
    masks = {}
    for fqn, node in traced.param_nodes.items():
        rules = option_rules.get(node.name)
        if rules and node in strategies:
            masks[fqn] = allowed_mask(rules, strategies[node].options)
    return masks


def param_floor(
    traced, strategies, weights: dict[str, list[float]], repeats=None, allowed: dict[str, list[bool]] | None = None
) -> dict[str, float]:
    """Per parameter (by fqn), its bytes per rank in the least-memory plan
    of all parameters: what the default budget, "every parameter as
    sharded as the mesh allows", can reach. ``weights``: per fqn, the
    bytes of each option.

    Two things bound it beyond the parameter's own options: its gradient
    must be able to follow (:func:`~autoparallel.problem.edge_matrices.gradient_partners`:
    a norm's weight, whose gradient only comes Replicate or Partial, is not
    sharded except tp-outer), and repeated layers take one option for all
    their copies (a link), so a group of linked parameters has the option
    that every copy can take with the least bytes in all (GPT-2 on 2x2x2:
    the last layer's projection bias gradient has no sharded option while
    the first layer's has). ``allowed``: per fqn, the options its option
    rules leave (:func:`rule_masks`; a mesh-dim role keeping it replicated
    over a dim).
    """
    partners: dict[tuple, list[bool]] = {}
    ok: dict[str, list[bool]] = {}
    for fqn, node in traced.param_nodes.items():
        grad = traced.grad_nodes.get(fqn)
        if fqn not in weights:
            continue
        if grad is None or grad not in strategies:
            ok[fqn] = [True] * len(weights[fqn])
            continue
        key = (id(strategies[node].options), id(strategies[grad].options))
        if key not in partners:
            partners[key] = gradient_partners(strategies[node].options, strategies[grad].options)
        ok[fqn] = partners[key]
    for fqn, mask in (allowed or {}).items():
        if fqn in ok and any(a and b for a, b in zip(ok[fqn], mask)):
            ok[fqn] = [a and b for a, b in zip(ok[fqn], mask)]
    fqn_of = {node: fqn for fqn, node in traced.param_nodes.items() if fqn in weights}
    copies: dict[str, list[tuple[str, np.ndarray]]] = {}  # reference fqn -> (copy, option mapping, -1: none)
    mappings: dict[tuple[int, int], np.ndarray] = {}
    if repeats is not None:
        for node, ref in repeats.reference.items():
            if node in fqn_of and ref in fqn_of and node in strategies and ref in strategies:
                key = (id(strategies[ref].options), id(strategies[node].options))
                if key not in mappings:
                    raw = option_mapping(strategies[ref].options, strategies[node].options)
                    mappings[key] = np.asarray([-1 if j is None else j for j in raw], dtype=np.int64)
                copies.setdefault(fqn_of[ref], []).append((fqn_of[node], mappings[key]))
    linked = {c for members in copies.values() for c, _ in members}
    floor: dict[str, float] = {}
    for fqn in ok:
        if fqn in linked:
            continue
        members = copies.get(fqn, [])
        fits = np.asarray(ok[fqn], dtype=bool)
        total = np.asarray(weights[fqn], dtype=np.float64)
        for c, m in members:
            # the copy's option for each reference option (a missing one: out)
            j = np.where(m < 0, 0, m)
            fits &= (m >= 0) & np.asarray(ok[c], dtype=bool)[j]
            total = total + np.asarray(weights[c], dtype=np.float64)[j]
        if not fits.any():  # nothing fits every copy: the solver names the conflict
            for f in [fqn] + [c for c, _ in members]:
                floor[f] = min((w for w, k in zip(weights[f], ok[f]) if k), default=min(weights[f]))
            continue
        best = int(np.flatnonzero(fits)[np.argmin(total[fits])])
        floor[fqn] = weights[fqn][best]
        for c, m in members:
            floor[c] = weights[c][int(m[best])]
    return floor


def param_option_bytes(traced, strategies, mesh) -> dict[str, list[float]]:
    """Per parameter (by fqn, those with options and a tensor value), its
    bytes per rank under each of its options."""
    # per (option list, shape, itemsize): a repeated layer's parameters share them
    weights_of: dict[tuple, list[float]] = {}
    by_fqn: dict[str, list[float]] = {}
    for fqn, node in traced.param_nodes.items():
        val = node.meta.get("val")
        if node not in strategies or not isinstance(val, torch.Tensor):
            continue
        itemsize = val.element_size()
        options = strategies[node].options
        key = (id(options), tuple(val.shape), itemsize)
        weights = weights_of.get(key)
        if weights is None:
            weights = weights_of[key] = [
                float(local_numel(val.shape, o.output_spec.placements, mesh) * itemsize) for o in options
            ]
        by_fqn[fqn] = weights
    return by_fqn


def parameter_memory_row(
    traced, strategies, mesh, constraints: "Constraints", repeats=None
) -> solver.ResourceConstraint:
    """The parameter-memory budget row: the sum of every parameter's bytes
    per rank between the user's bounds, by default at most :func:`param_floor`."""
    by_fqn = param_option_bytes(traced, strategies, mesh)
    terms = {traced.param_nodes[fqn].name: weights for fqn, weights in by_fqn.items()}
    vals = [traced.param_nodes[fqn].meta["val"] for fqn in by_fqn]
    total = float(sum(v.numel() * v.element_size() for v in vals))
    masks = rule_masks(traced, strategies, constraints.option_rules)
    smallest = sum(param_floor(traced, strategies, by_fqn, repeats, masks).values())
    high = smallest if constraints.memory_high is None else constraints.memory_high * total
    low = None if constraints.memory_low is None else constraints.memory_low * total
    # Bytes are exact integers; a relative slack keeps float round-off from
    # turning "exactly fully sharded" into infeasible.
    return solver.ResourceConstraint(
        PARAM_BUDGET,
        terms,
        low=None if low is None else low * (1 - 1e-9),
        high=high * (1 + 1e-9),
    )
