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
    mesh = plan.mesh_shape
    names = plan.mesh_dim_names or [f"dim{d}" for d in range(len(mesh))]
    nodes = list(plan.nodes.values())

    # -- weights: stored placement ---------------------------------------
    weight_desc: Counter = Counter()
    weight_bytes: Counter = Counter()
    sharded_on = [0.0] * len(mesh)
    total_bytes = 0.0
    for n in nodes:
        if not n.is_parameter or n.shape is None:
            continue
        toks = placement_tokens(n.output_placements)
        dims = [names[d] for d, t in enumerate(toks) if _kind(t) == "S"]
        size = math.prod(n.shape)
        total_bytes += size
        for d, t in enumerate(toks):
            if _kind(t) == "S":
                sharded_on[d] += size
        if not dims:
            desc = "replicated"
        else:
            desc = "sharded over " + "*".join(dims)
            if toks and toks[0].startswith("_S") and len(dims) > 1:
                desc += " (tp-outer layout)"
        weight_desc[desc] += 1
        weight_bytes[desc] += size

    # -- matmuls: per family and mesh dim ----------------------------------
    roles: dict[str, list[Counter]] = defaultdict(lambda: [Counter() for _ in mesh])
    leaves: dict[tuple, dict[str, None]] = defaultdict(dict)  # (family, dim, role) -> module names
    last_family = None  # the output projection: the last forward matmul
    for n in nodes:
        if n.phase != "forward" or n.op not in _MATMULS or not n.module_path:
            continue
        fam = _family(n.module_path)
        leaf = n.module_path.rsplit(".", 1)[-1]
        for d in range(len(mesh)):
            role = matmul_role(n.input_placements, n.output_placements, d)
            roles[fam][d][role] += 1
            leaves[(fam, d, role)].setdefault(leaf, None)
        last_family = fam
    # (outside the repeated layers: the vocabulary projection)
    logits_family = last_family if last_family and "*" not in last_family else None

    # -- sequence split of norms / element-wise ops (3-D activations) -------
    seq_split = [Counter() for _ in mesh]
    for n in nodes:
        if n.phase != "forward" or not n.module_path or "norm" not in n.module_path or not n.shape or len(n.shape) != 3:
            continue
        for d, t in enumerate(placement_tokens(n.output_placements)):
            seq_split[d][_dim(t) if _kind(t) == "S" else None] += 1

    # -- per mesh dim: the parallelism it carries ---------------------------
    mains = []
    for d in range(len(mesh)):
        dim_roles: Counter = sum((r[d] for r in roles.values()), Counter())
        mains.append(dim_roles.most_common(1)[0][0] if dim_roles else "replicated")
    sharded = [bool(total_bytes and sharded_on[d] / total_bytes > 0.5) for d in range(len(mesh))]
    # HSDP: data parallel over several mesh dims, weights replicated across
    # the outer ones (between nodes) and sharded within the inner ones
    hsdp_replicate = [d for d in range(len(mesh)) if mains[d] == "data" and not sharded[d]]
    hsdp_shard = [d for d in range(len(mesh)) if mains[d] == "data" and sharded[d]]
    hsdp = bool(hsdp_replicate and hsdp_shard) and max(hsdp_replicate) < min(hsdp_shard)
    overall = []
    for d, name in enumerate(names):
        main, weights_sharded = mains[d], sharded[d]
        if mesh[d] == 1:
            # one rank along it: every layout there is Replicate
            overall.append(f"{name} ({mesh[d]}): size 1, nothing split over it")
            continue
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
            if seq_split[d] and seq_split[d].most_common(1)[0][0] == 1:
                what += " with sequence parallel norms"
        elif main == "replicated":
            what = "not used for the matmuls (replicated)"
            if weights_sharded:
                what += "; weights stored sharded (FSDP-style storage)"
        else:
            what = "mixed"
        # families that use this dim differently from most matmuls
        odd: dict[str, list] = defaultdict(list)
        for fam, per_dim in roles.items():
            role = per_dim[d].most_common(1)[0][0]
            if role != main:
                odd[
                    "tensor parallel" if role in ("column", "row") else ("data parallel" if role == "data" else role)
                ].append("logits" if fam == logits_family else fam)
        if odd:
            what += "; except " + "; ".join(f"{k} for {', '.join(v)}" for k, v in odd.items())
        overall.append(f"{name} ({mesh[d]}): {what}")
    lines = ["parallelism per mesh dim: " + "; ".join(overall)]
    from ..problem.mesh_roles import dim_notes  # roles asked for, or why the planner chose

    lines += ["  " + note for note in dim_notes(plan, mains, sharded)]
    if hsdp:
        lines.append(
            "HSDP (hybrid sharded data parallel): weights replicated across "
            + "*".join(names[d] for d in hsdp_replicate)
            + ", sharded within "
            + "*".join(names[d] for d in hsdp_shard)
        )

    if weight_desc:
        parts = []
        for desc, count in weight_desc.most_common():
            share = weight_bytes[desc] / total_bytes if total_bytes else 0
            parts.append(f"{count} tensors ({units.percent(share)} of parameters) {desc}")
        lines.append("weights: " + "; ".join(parts))
    for fam, per_dim in roles.items():
        words = []
        for d, counter in enumerate(per_dim):
            role = counter.most_common(1)[0][0]
            mixed = len(counter) > 1
            if role == "data":
                w = f"data parallel over {names[d]} (tokens split)"
            elif role == "column" and fam == logits_family and len(roles) > 1:
                w = f"vocab-parallel over {names[d]} (column-parallel logits)"
            elif role in ("column", "row"):
                kinds = sorted(k for k in counter if k in ("column", "row"))
                w = (
                    f"tensor parallel over {names[d]} ({' then '.join(kinds)}-parallel)"
                    if len(kinds) > 1
                    else (f"{role}-parallel over {names[d]} (TP)")
                )
            elif role == "replicated":
                w = f"replicated over {names[d]}"
            else:
                w = f"other split over {names[d]}"
            if mixed and not set(counter) <= {"column", "row"}:
                # say which projection does what
                w = (
                    ", ".join(
                        f"{'/'.join(leaves[(fam, d, r)])} {_ROLE_WORDS.get(r, r)}" for r, _ in counter.most_common()
                    )
                    + f" over {names[d]}"
                )
            words.append(w)
        label = "logits" if fam == logits_family and len(roles) > 1 else fam
        lines.append(f"{label} matmuls: " + ", ".join(words))
    lines += _expert_lines(nodes, names)
    if any(seq_split[d].get(1) for d in range(len(mesh))):
        dims = [names[d] for d in range(len(mesh)) if seq_split[d].most_common(1)[0][0] == 1]
        if dims:
            lines.append(f"norms: sequence split over {'*'.join(dims)} (sequence parallel)")
    return lines
