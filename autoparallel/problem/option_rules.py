"""Constraints that allow a set of a node's options, by placement on one mesh dim.

A pin (``Constraints.pins``) allows one layout of a node on every mesh dim.
An :class:`OptionRule` says something about one mesh dim only and leaves the
others free: "this parameter is replicated over ``dp_replicate``", "this
routed-experts op takes its tokens sharded and its expert weights
``Shard(0)`` over ``ep``". Mesh-dim roles (:mod:`autoparallel.problem.mesh_roles`)
are written in it; the problem builder turns each into a named
:class:`solver.Pin` over the options that satisfy it.

A placement pattern is a short string: ``"R"`` (Replicate), ``"P"`` (any
Partial), ``"S"`` (a shard of any tensor dim), ``"S(d)"`` (a shard of dim
``d``).

    >>> from torch.distributed.tensor import Replicate, Shard
    >>> matches(Shard(0), "S"), matches(Shard(0), "S(1)"), matches(Replicate(), "R")
    (True, False, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard


def matches(p: Placement, pattern: str) -> bool:
    """Whether placement ``p`` is of the kind ``pattern`` (see the module doc)."""
    if pattern == "R":
        return isinstance(p, Replicate)
    if pattern == "P":
        return isinstance(p, Partial)
    if pattern == "S":
        return isinstance(p, (Shard, _StridedShard))
    if pattern.startswith("S(") and pattern.endswith(")"):
        return isinstance(p, (Shard, _StridedShard)) and p.dim == int(pattern[2:-1])
    raise ValueError(f"placement pattern {pattern!r}: use 'R', 'P', 'S' or 'S(d)'")


@dataclass(frozen=True)
class OptionRule:
    """Allow the options of one node whose placements on ``mesh_dim`` match.

    ``output``: the pattern the output must match there (None: any; for a
    multi-output node, the first output); ``inputs``: ``(input index,
    pattern)`` pairs the option's input specs must match there. ``name``
    names the constraint in errors and in the solver's conflicts.
    """

    name: str
    mesh_dim: int
    output: str | None = None
    inputs: tuple[tuple[int, str], ...] = ()

    def allows(self, option) -> bool:
        if self.output is not None:
            spec = option.output_specs
            if isinstance(spec, (tuple, list)):
                spec = spec[0]
            if spec is None or not matches(spec.placements[self.mesh_dim], self.output):
                return False
        for i, pattern in self.inputs:
            if i >= len(option.input_specs) or option.input_specs[i] is None:
                return False
            if not matches(option.input_specs[i].placements[self.mesh_dim], pattern):
                return False
        return True

    def describe(self) -> str:
        parts = [f"output {self.output}"] if self.output else []
        parts += [f"input {i} {p}" for i, p in self.inputs]
        return f"{' and '.join(parts)} on mesh dim {self.mesh_dim}"


def allowed_mask(rules: Sequence[OptionRule], options: Sequence) -> list[bool]:
    """Per option, whether every rule allows it."""
    return [all(r.allows(o) for r in rules) for o in options]
