"""Placements as plain data: which layouts a tensor may take on a mesh
(even shards only, plus the tp-outer layout for parameters) and how plans
print them (``S(0)R``). Used by option enumeration (:mod:`.strategies`),
rules, the problem builder and apply.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

__all__ = [
    "InOpWork",
    "Option",
    "Specs",
    "all_placements",
    "format_placement",
    "format_specs",
    "is_evenly_sharded",
    "placements_of",
    "plain_shards",
    "tensor_meta_of",
    "tp_outer_placements",
]

Specs = Any  # DTensorSpec | tuple[DTensorSpec | None, ...] | None


def tensor_meta_of(val: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=val.shape, stride=val.stride(), dtype=val.dtype)


def is_evenly_sharded(shape: torch.Size, placements: tuple[Placement, ...], mesh: DeviceMesh) -> bool:
    """Every sharded tensor dim divides by the product of mesh sizes sharding
    it, and every shard is a plain ``Shard``.

    ``_StridedShard`` (what DTensor's view rules produce for a dim split
    after sharding) is rejected: it is no ``Shard`` subclass any more, so it
    has to be caught as "neither Shard, Replicate nor Partial". ``Shard``
    over a mesh dim of size 1 is rejected too: it is ``Replicate`` under
    another name (:func:`on_mesh` reads user layouts the same way).
    """
    ways = [1] * len(shape)
    mesh_shape = _mesh_shape(mesh)
    for mesh_dim, p in enumerate(placements):
        t = type(p)  # exact type checks first: isinstance on placements is slow
        if t is not Shard:
            if t is Replicate or t is Partial or isinstance(p, (Replicate, Partial)):
                continue
            return False  # _StridedShard and any other shard-like placement
        d = p.dim
        if d < 0 or d >= len(shape) or mesh_shape[mesh_dim] == 1:
            # a mesh dim of size 1 holds the whole tensor: Shard there is
            # Replicate under another name, an option that only multiplies
            # the problem (as big as a 2x2x2 mesh's for a 1x4x2 one)
            return False
        ways[d] *= mesh_shape[mesh_dim]
    return all(ways[d] == 1 or shape[d] % ways[d] == 0 for d in range(len(shape)))


def plain_shards(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """``placements`` with every ``_StridedShard(d, split_factor=1)`` read
    as ``Shard(d)``: one group split over the mesh dim is the plain split
    (DTensor's flatten of ``[B, L, D]`` with ``S(0)`` over dp and ``S(1)``
    over cp gives it over cp when the local batch is 1: the rank's rows of
    ``[B*L, D]`` are then one contiguous block). Other placements, the
    same tuple when nothing changes."""
    if not any(type(p) is _StridedShard and p.split_factor == 1 for p in placements):
        return placements
    return tuple(Shard(p.dim) if type(p) is _StridedShard and p.split_factor == 1 else p for p in placements)


def on_mesh(placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> tuple[Placement, ...]:
    """``placements`` with Shard over a mesh dim of size 1 read as
    Replicate() (one rank holds the whole tensor either way): the layout the
    planner uses for it (see :func:`is_evenly_sharded`)."""
    return tuple(Replicate() if size == 1 and isinstance(p, Shard) else p for p, size in zip(placements, mesh_shape))


@functools.lru_cache(maxsize=None)
def _mesh_shape(mesh: DeviceMesh) -> tuple[int, ...]:
    return tuple(mesh.shape)


def all_placements(shape: torch.Size, mesh: DeviceMesh) -> list[tuple[Placement, ...]]:
    """Every Replicate/Shard(d) combination over the mesh that shards evenly.

    Order: Replicate first, then shard dims ascending, mesh dim 0 outermost;
    the order is the deterministic tie-break rule for equal-cost options.
    """
    per_dim: list[Placement] = [Replicate()] + [Shard(d) for d in range(len(shape))]
    return [combo for combo in itertools.product(per_dim, repeat=mesh.ndim) if is_evenly_sharded(shape, combo, mesh)]


def tp_outer_placements(shape: torch.Size, mesh: DeviceMesh) -> list[tuple[Placement, ...]]:
    """``(_StridedShard(d, tp), Shard(d))`` for every tensor dim ``d`` that
    splits evenly over a 2-D mesh of two non-trivial dims (none otherwise).

    >>> # 2x4 mesh, shape (8, 6): [(_StridedShard(dim=0, sf=4), Shard(dim=0))]
    """
    from ..cost_model import tp_outer_placements as layout

    mesh_shape = _mesh_shape(mesh)
    if len(mesh_shape) != 2 or min(mesh_shape) < 2:
        return []
    n = mesh_shape[0] * mesh_shape[1]
    return [layout(d, mesh_shape) for d in range(len(shape)) if shape[d] % n == 0]


def placements_of(specs: Specs):
    """The placements of a spec, or a tuple of them for multi-output specs."""
    if isinstance(specs, DTensorSpec):
        return specs.placements
    if isinstance(specs, (tuple, list)):
        return tuple(placements_of(s) for s in specs)
    return None


def format_placement(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    if isinstance(p, Replicate):
        return "R"
    return str(p)


def format_specs(specs: Specs) -> str:
    """``S(0)R`` for a spec on a 2-D mesh, ``(S(0)R, RR)`` for several, ``-``
    for none."""
    if specs is None:
        return "-"
    if isinstance(specs, (tuple, list)):
        return "(" + ", ".join(format_specs(s) for s in specs) + ")"
    return "".join(format_placement(p) for p in specs.placements)


class SpecLabels:
    """:func:`format_specs` memoised per spec object, for labelling many
    options at once: options share pooled specs (a 4-D mesh layer has ~143K
    options over a few thousand specs). Holds the specs it labelled, so
    their ids stay theirs while it lives; use one per labelling pass."""

    def __init__(self):
        self._memo: dict[int, tuple[str, object]] = {}

    def __call__(self, specs: Specs) -> str:
        hit = self._memo.get(id(specs))
        if hit is None:
            if isinstance(specs, (tuple, list)):
                text = "(" + ", ".join(self(s) for s in specs) + ")"
            else:
                text = format_specs(specs)
            hit = self._memo[id(specs)] = (text, specs)
        return hit[0]

    def option(self, option) -> str:
        """:func:`option_label` with the memo."""
        return option_label(option, self)


def option_label(option, fmt=format_specs) -> str:
    """An option's ``inputs->output`` placements, e.g. ``S(0)R,RR->S(0)R``
    (``fmt`` formats one spec or tuple of specs)."""
    out = fmt(option.output_specs)
    if not option.input_specs:
        return out
    return ",".join(fmt(s) for s in option.input_specs) + "->" + out


@dataclass(frozen=True)
class InOpWork:
    """Communication and extra FLOPs inside one op under one option."""

    flops: float = 0.0
    dtype: torch.dtype = torch.float32
    # (collective kind, bytes per rank, mesh dim), as cost_model.collective_time takes them
    collectives: tuple[tuple[str, float, int], ...] = ()


@dataclass(frozen=True)
class Option:
    """One way to run a node: required input specs and resulting output spec(s).

    ``input_specs[k]`` belongs to the node's k-th tensor input (the order of
    :func:`tensor_inputs`). ``output_specs`` is a DTensorSpec, or a tuple of
    them for multi-output ops.
    """

    output_specs: Specs
    input_specs: tuple[DTensorSpec, ...]
    # Work the op does itself beyond its flop formula on local shapes (e.g.
    # the MoE all-to-all dispatch): priced into its compute cost.
    in_op: "InOpWork | None" = None

    @property
    def label(self) -> str:
        """``inputs->output`` placements, e.g. ``S(0)R,RR->S(0)R``."""
        return option_label(self)

    @property
    def output_spec(self) -> DTensorSpec:
        if not isinstance(self.output_specs, DTensorSpec):
            raise TypeError(
                f"option {self.label} has no single output spec (its output: {format_specs(self.output_specs)})"
            )
        return self.output_specs
