"""A plan in the words practitioners use: FSDP, DDP, tensor parallel,
sequence parallel, vocab-parallel.

Read from the chosen placements only (so it works on a loaded plan):
weights by their stored placement (sharded over which mesh dims, and the
tp-outer strided layout), matmuls by how their two operands are split on
each mesh dim (rows = data parallel, weight columns / rows = tensor
parallel), norms by whether their tokens are split along the sequence.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ..problem.memory import placement_tokens
from . import units

LEGEND = [
    "notation: one placement per mesh dim, in mesh order",
    "  S(d)      sharded along tensor dim d over that mesh dim",
    "  R         replicated (every rank holds all of it)",
    "  P         partial sums: each rank holds a summand, a reduction is pending",
    "  _S(d, k)  strided shard of dim d: the dim is first cut into k blocks for the next mesh",
    "            dim; with S(d) after it (e.g. _S(0, 8)S(0)) the weight is split over dp*tp",
    "            with tp outermost (tp-outer layout: a tp shard is contiguous)",
    "  e.g. S(0)R = dim 0 split over the first mesh dim, replicated over the second",
    "  'a,b -> c' = an op's input placements and its output's;",
    "  'forward'/'backward' = the phase the op runs in; in the backward, 'input grad' and",
    "  'weight grad' tell the two matmuls of a linear layer apart",
]

_MATMULS = ("aten.mm.default", "aten.addmm.default")
_ROLE_WORDS = {"data": "data parallel", "column": "column-parallel", "row": "row-parallel", "replicated": "replicated"}


def _kind(tok: str) -> str:
    return "S" if "S(" in tok else ("P" if tok.startswith("P") else "R")


def _dim(tok: str) -> int | None:
    if "S(" not in tok:
        return None
    return int(tok.split("(")[1].split(",")[0].rstrip(")"))


def _fold(path: str) -> str:
    return ".".join("*" if p.isdigit() else p for p in path.split("."))


def _family(path: str) -> str:
    """Module family of a matmul: ``layers.*.attention.wq`` -> ``layers.*.attention``."""
    folded = _fold(path)
    return folded.rsplit(".", 1)[0] if "." in folded else folded


def matmul_role(inputs: list[str], output: str, d: int) -> str:
    """How an ``mm(A, B)`` is split on mesh dim ``d``: ``data`` (rows of A,
    B whole), ``column`` (columns of B), ``row`` (the contraction dim,
    partial output), ``replicated`` or ``other``."""
    if len(inputs) < 2:
        return "other"
    a, b = placement_tokens(inputs[-2]), placement_tokens(inputs[-1])
    out = placement_tokens(output)
    if d >= min(len(a), len(b), len(out)):
        return "other"
    ka, kb, ko = _kind(a[d]), _kind(b[d]), _kind(out[d])
    if ka == "S" and _dim(a[d]) == 0 and kb == "R":
        return "data"
    if ka == "R" and kb == "S" and _dim(b[d]) == 1:
        return "column"
    if ka == "S" and _dim(a[d]) == 1 and kb == "S" and _dim(b[d]) == 0 and ko == "P":
        return "row"
    if ka == "R" and kb == "R":
        return "replicated"
    return "other"


_EXPERT_OPS = ("autoparallel.moe_experts.default",)


def expert_role(inputs: list[str], d: int) -> str:
    """How the routed-experts op ``moe_experts(x, idx, w, w1, w3, w2, ...)`` is
    split on mesh dim ``d``: by expert (weights ``Shard(0)``; tokens either
    stay split and travel by all-to-all, or are gathered), by hidden dim, by
    token, or not at all."""
    if len(inputs) < 4:
        return "other"
    x, w1 = placement_tokens(inputs[0]), placement_tokens(inputs[3])
    if d >= min(len(x), len(w1)):
        return "other"
    if _kind(w1[d]) == "S" and _dim(w1[d]) == 0:
        return "expert parallel (tokens by all-to-all)" if _kind(x[d]) == "S" else ("expert parallel (tokens gathered)")
    if _kind(w1[d]) == "S":
        return "hidden split (TP)"
    if _kind(x[d]) == "S":
        return "token parallel (data)"
    return "replicated" if _kind(x[d]) == "R" else "other"


def _expert_lines(nodes, names) -> list[str]:
    per_family: dict[str, list[Counter]] = defaultdict(lambda: [Counter() for _ in names])
    for n in nodes:
        if n.phase != "forward" or n.op not in _EXPERT_OPS:
            continue
        fam = _fold(n.module_path or "experts")
        for d in range(len(names)):
            per_family[fam][d][expert_role(n.input_placements, d)] += 1
    return [
        f"routed experts ({fam}): "
        + ", ".join(f"{c.most_common(1)[0][0]} over {names[d]}" for d, c in enumerate(per_dim))
        for fam, per_dim in per_family.items()
    ]


def describe(plan) -> list[str]:
    """Lines saying what the plan is, mesh dim by mesh dim, then per kind of
    weight and activation."""
    from ..problem.mesh_roles import dim_notes  # roles asked for, or why the planner chose

    mesh = plan.mesh_shape
    names = plan.mesh_dim_names or [f"dim{d}" for d in range(len(mesh))]
    nodes = list(plan.nodes.values())
    weights = _Weights.read(nodes, names)
    matmuls = _Matmuls.read(nodes, len(mesh))
    seq_split = _sequence_split(nodes, len(mesh))

    mains = matmuls.main_roles(len(mesh))
    sharded = [weights.mostly_sharded(d) for d in range(len(mesh))]
    hsdp_replicate, hsdp_shard = _hsdp_dims(mains, sharded)
    overall = [
        f"{names[d]} ({mesh[d]}): "
        + _mesh_dim_words(d, mesh[d], mains[d], sharded[d], bool(hsdp_replicate), matmuls, seq_split[d])
        for d in range(len(mesh))
    ]
    lines = ["parallelism per mesh dim: " + "; ".join(overall)]
    lines += ["  " + note for note in dim_notes(plan, mains, sharded)]
    if hsdp_replicate:
        lines.append(
            "HSDP (hybrid sharded data parallel): weights replicated across "
            + "*".join(names[d] for d in hsdp_replicate)
            + ", sharded within "
            + "*".join(names[d] for d in hsdp_shard)
        )
    if weights.desc:
        lines.append(weights.line())
    lines += [matmuls.family_line(fam, names) for fam in matmuls.roles]
    lines += _expert_lines(nodes, names)
    lines += _norm_lines(seq_split, names)
    return lines


@dataclass
class _Weights:
    """Parameters by stored placement: per description (``replicated``,
    ``sharded over dp*tp``, ...) how many tensors and elements; elements
    sharded per mesh dim."""

    names: list[str]
    desc: Counter = field(default_factory=Counter)
    size: Counter = field(default_factory=Counter)
    sharded_on: list[float] = field(default_factory=list)
    total: float = 0.0

    @classmethod
    def read(cls, nodes, names: list[str]) -> _Weights:
        weights = cls(names, sharded_on=[0.0] * len(names))
        for n in nodes:
            if n.is_parameter and n.shape is not None:
                weights.add(placement_tokens(n.output_placements), math.prod(n.shape))
        return weights

    def add(self, toks: list[str], size: int) -> None:
        dims = [self.names[d] for d, t in enumerate(toks) if _kind(t) == "S"]
        self.total += size
        for d, t in enumerate(toks):
            if _kind(t) == "S":
                self.sharded_on[d] += size
        if not dims:
            desc = "replicated"
        else:
            desc = "sharded over " + "*".join(dims)
            if toks and toks[0].startswith("_S") and len(dims) > 1:
                desc += " (tp-outer layout)"
        self.desc[desc] += 1
        self.size[desc] += size

    def mostly_sharded(self, d: int) -> bool:
        """Are most parameter elements sharded over mesh dim ``d``?"""
        return bool(self.total and self.sharded_on[d] / self.total > 0.5)

    def line(self) -> str:
        parts = []
        for desc, count in self.desc.most_common():
            share = self.size[desc] / self.total if self.total else 0
            parts.append(f"{count} tensors ({units.percent(share)} of parameters) {desc}")
        return "weights: " + "; ".join(parts)


@dataclass
class _Matmuls:
    """Forward matmuls per module family: per mesh dim how many take each
    role (:func:`matmul_role`), and which projections take it."""

    roles: dict[str, list[Counter]]
    leaves: dict[tuple, dict[str, None]]  # (family, dim, role) -> module names
    logits_family: str | None  # outside the repeated layers: the vocabulary projection

    @classmethod
    def read(cls, nodes, ndim: int) -> _Matmuls:
        roles: dict[str, list[Counter]] = defaultdict(lambda: [Counter() for _ in range(ndim)])
        leaves: dict[tuple, dict[str, None]] = defaultdict(dict)
        last_family = None  # the output projection: the last forward matmul
        for n in nodes:
            if n.phase != "forward" or n.op not in _MATMULS or not n.module_path:
                continue
            fam = _family(n.module_path)
            leaf = n.module_path.rsplit(".", 1)[-1]
            for d in range(ndim):
                role = matmul_role(n.input_placements, n.output_placements, d)
                roles[fam][d][role] += 1
                leaves[(fam, d, role)].setdefault(leaf, None)
            last_family = fam
        return cls(roles, leaves, last_family if last_family and "*" not in last_family else None)

    def main_roles(self, ndim: int) -> list[str]:
        """Per mesh dim, the role most matmuls take on it."""
        mains = []
        for d in range(ndim):
            dim_roles: Counter = sum((r[d] for r in self.roles.values()), Counter())
            mains.append(dim_roles.most_common(1)[0][0] if dim_roles else "replicated")
        return mains

    def odd_families(self, d: int, main: str) -> dict[str, list[str]]:
        """Families that use mesh dim ``d`` differently from most matmuls,
        by what they do instead."""
        odd: dict[str, list] = defaultdict(list)
        for fam, per_dim in self.roles.items():
            role = per_dim[d].most_common(1)[0][0]
            if role != main:
                odd[
                    "tensor parallel" if role in ("column", "row") else ("data parallel" if role == "data" else role)
                ].append("logits" if fam == self.logits_family else fam)
        return odd

    def family_line(self, fam: str, names: list[str]) -> str:
        """How one family's matmuls are split, mesh dim by mesh dim."""
        logits = fam == self.logits_family and len(self.roles) > 1
        words = [self._dim_words(fam, d, counter, names[d], logits) for d, counter in enumerate(self.roles[fam])]
        return f"{'logits' if logits else fam} matmuls: " + ", ".join(words)

    def _dim_words(self, fam: str, d: int, counter: Counter, name: str, logits: bool) -> str:
        role = counter.most_common(1)[0][0]
        if len(counter) > 1 and not set(counter) <= {"column", "row"}:
            # mixed: say which projection does what
            return (
                ", ".join(
                    f"{'/'.join(self.leaves[(fam, d, r)])} {_ROLE_WORDS.get(r, r)}" for r, _ in counter.most_common()
                )
                + f" over {name}"
            )
        if role == "data":
            return f"data parallel over {name} (tokens split)"
        if role == "column" and logits:
            return f"vocab-parallel over {name} (column-parallel logits)"
        if role in ("column", "row"):
            kinds = sorted(k for k in counter if k in ("column", "row"))
            if len(kinds) > 1:
                return f"tensor parallel over {name} ({' then '.join(kinds)}-parallel)"
            return f"{role}-parallel over {name} (TP)"
        if role == "replicated":
            return f"replicated over {name}"
        return f"other split over {name}"


def _sequence_split(nodes, ndim: int) -> list[Counter]:
    """Per mesh dim, how many forward norm outputs (3-D activations) are
    split along which tensor dim (None: not split)."""
    seq_split = [Counter() for _ in range(ndim)]
    for n in nodes:
        if n.phase != "forward" or not n.module_path or "norm" not in n.module_path or not n.shape or len(n.shape) != 3:
            continue
        for d, t in enumerate(placement_tokens(n.output_placements)):
            seq_split[d][_dim(t) if _kind(t) == "S" else None] += 1
    return seq_split


def _hsdp_dims(mains: list[str], sharded: list[bool]) -> tuple[list[int], list[int]]:
    """HSDP: data parallel over several mesh dims, weights replicated across
    the outer ones (between nodes) and sharded within the inner ones.
    Returns (replicate dims, shard dims), both empty when the plan is not."""
    replicate = [d for d in range(len(mains)) if mains[d] == "data" and not sharded[d]]
    shard = [d for d in range(len(mains)) if mains[d] == "data" and sharded[d]]
    if replicate and shard and max(replicate) < min(shard):
        return replicate, shard
    return [], []


def _mesh_dim_words(
    d: int, size: int, main: str, weights_sharded: bool, hsdp: bool, matmuls: _Matmuls, seq_split: Counter
) -> str:
    """The parallelism mesh dim ``d`` carries, in words."""
    if size == 1:
        # one rank along it: every layout there is Replicate
        return "size 1, nothing split over it"
    if main == "data" and hsdp:
        what = (
            "HSDP shard-within (data parallel, weights sharded inside each replica, gathered for compute)"
            if weights_sharded
            else "HSDP replicate-across (data parallel, weights replicated across replicas, gradients all-reduced)"
        )
    elif main == "data":
        what = (
            "FSDP (data parallel, weights sharded, gathered for compute)"
            if weights_sharded
            else ("DDP (data parallel, weights replicated)")
        )
    elif main in ("column", "row"):
        what = "tensor parallel (TP)"
        if seq_split and seq_split.most_common(1)[0][0] == 1:
            what += " with sequence parallel norms"
    elif main == "replicated":
        what = "not used for the matmuls (replicated)"
        if weights_sharded:
            what += "; weights stored sharded (FSDP-style storage)"
    else:
        what = "mixed"
    odd = matmuls.odd_families(d, main)
    if odd:
        what += "; except " + "; ".join(f"{k} for {', '.join(v)}" for k, v in odd.items())
    return what


def _norm_lines(seq_split: list[Counter], names: list[str]) -> list[str]:
    if not any(c.get(1) for c in seq_split):
        return []
    dims = [names[d] for d, c in enumerate(seq_split) if c.most_common(1)[0][0] == 1]
    return [f"norms: sequence split over {'*'.join(dims)} (sequence parallel)"] if dims else []
