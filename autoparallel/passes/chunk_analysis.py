"""Which regions :mod:`.chunk_regions` can chunk, and how: the analysis half
of the pass (the rewrite is in :mod:`.chunk_regions`).

* :func:`find_regions`: the module instances the ``chunk_modules`` patterns
  name, with their joint-graph nodes.
* :func:`split_seeds`: where the split dim starts (user inputs at the mode's
  dim, tangents like the forward outputs they are the gradients of).
* :func:`plan_region`: for one region, which live-ins are split, which
  nodes are duplicated, which values are rebuilt, and what each chunk's
  node reads (a :class:`RegionPlan`); or :class:`~.chunk_dims.ChunkRefused`
  with the reason a user can act on.
* :func:`reason_key`: a refusal reason without graph node names, so the same
  refusal in every layer counts once.
"""

from __future__ import annotations

import fnmatch
import operator
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
import torch.fx as fx

from ..capture.tracing import module_path
from .base import ChunkExactness, ChunkMode, PassContext
from .chunk_dims import (
    PER_CHUNK,
    ATTENTION_NAMES,
    FILLS,
    MESH_SIZES,
    REDUCED,
    ChunkRefused,
    acts_along,
    probe_op,
    UnknownSplitDim,
    fake_val,
    group_split,
    merge_factor,
    propagate_split_dims,
)

__all__ = [
    "MODE_INPUT_DIM",
    "RegionPlan",
    "find_regions",
    "plan_region",
    "reason_key",
    "region_of",
    "split_seeds",
]

# Which dim of a user input each mode splits (inputs are [batch, seq, ...]).
MODE_INPUT_DIM: dict[ChunkMode, int] = {"batch": 0, "seq": 1}

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

# Ops whose result, where it lost the split dim, is a *sum* over it: the
# chunks' results add up to the whole (weight gradients are sums over tokens).
_SUM_REDUCTIONS = {
    _aten.mm.default,
    _aten.bmm.default,
    _aten.sum.dim_IntList,
    _aten.sum.default,
}


def _extra_sum_reductions() -> set:
    # custom ops that are sums over tokens in the outputs they reduce
    out = set()
    ops = getattr(torch.ops, "autoparallel", None)
    for name in ("moe_experts_backward", "moe_a2a_expert_rows_backward"):
        op = getattr(ops, name, None) if ops is not None else None
        if op is not None:
            out.add(op.default)
    return out


# ---------------------------------------------------------------------------
# regions


def region_of(path: str | None, pattern: str) -> str | None:
    """The module instance of ``path`` that ``pattern`` names (``*`` matches
    one path component), or None. ``region_of("layers.3.moe.gate",
    "layers.*.moe") == "layers.3.moe"``."""
    if not path:
        return None
    comps, pcomps = path.split("."), pattern.split(".")
    if len(comps) < len(pcomps):
        return None
    if all(fnmatch.fnmatchcase(c, p) for c, p in zip(comps, pcomps)):
        return ".".join(comps[: len(pcomps)])
    return None


def find_regions(gm: fx.GraphModule, modules: dict[str, ChunkMode]) -> dict[str, tuple[ChunkMode, list[fx.Node]]]:
    """region -> (mode, its call nodes in graph order); first pattern wins."""
    out: dict[str, tuple[ChunkMode, list[fx.Node]]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        path = module_path(n)
        for pattern, mode in modules.items():
            r = region_of(path, pattern)
            if r is not None:
                out.setdefault(r, (mode, []))[1].append(n)
                break
    return out


# ---------------------------------------------------------------------------
# what to split, duplicate and rebuild


@dataclass
class RegionPlan:
    """What :func:`plan_region` decided for one region; the rewrite's input."""

    region: str
    mode: ChunkMode
    nodes: list[fx.Node]  # region nodes that depend on split live-ins, graph order
    live_ins: dict[fx.Node, int]  # split ones -> dim
    shared: int
    state: dict[fx.Node, Any]  # node -> dim | REDUCED | tuple of them
    probe: dict[fx.Node, tuple]  # node -> (A value, (args, kwargs) with chunk sizes)
    joins: dict[fx.Node, fx.Node] = field(default_factory=dict)  # rebuilt value -> original node
    # values without the split dim that line up with it at full size (a mask
    # built outside the region with the literal batch, a constant fill):
    # value -> dim; each chunk reads its own half
    partners: dict[fx.Node, int] = field(default_factory=dict)
    # how a chunk's rows are grouped along the split dim (see
    # chunk_dims.rows_of_chunk), for the values split where the region reads
    # them (live-ins, partners) and those rebuilt where they leave it; absent: 1
    # (contiguous halves)
    groups: dict[fx.Node, int] = field(default_factory=dict)


def _is_random(n: fx.Node) -> bool:
    t = n.target
    if not (isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags):
        return False
    # attention is tagged random for its dropout; without dropout it is not
    for k, a in enumerate(t._schema.arguments):
        if a.name == "dropout_p":
            p = n.args[k] if k < len(n.args) else n.kwargs.get("dropout_p", a.default_value)
            return bool(p)
    return True


def _late_sum_closure(n: fx.Node, members: set[fx.Node]) -> set[fx.Node] | None:
    """The region nodes after sum ``n`` when every one of them is linear in
    it (waits, sum reductions over ranks, layout copies), so each chunk's
    partial sum may go through them on its own and be added where it
    leaves the region; None when some use is not (sum it at once)."""
    closure: set[fx.Node] = set()
    inside = {n}
    changed = True
    while changed:  # to a fixpoint: a cat joins once all its pieces are in
        changed = False
        for x in list(inside):
            for u in x.users:
                if u in members and u not in inside and _is_linear(u) and all(a in inside for a in u.all_input_nodes):
                    inside.add(u)
                    closure.add(u)
                    changed = True
    for x in inside:
        if any(u in members and u not in inside for u in x.users):
            return None
    return closure


def _is_linear(n: fx.Node) -> bool:
    t = n.target
    if t in (
        _c10d.wait_tensor.default,
        _aten.clone.default,
        operator.getitem,
        _aten.cat.default,
        _aten.split.Tensor,
        _aten.split_with_sizes.default,
    ):
        return True
    if t in (_c10d.reduce_scatter_tensor.default, _c10d.all_reduce.default):
        return n.args[1] == "sum"
    if "grad_layout" in str(t):  # autoparallel.moe_grad_layout: a copy
        return True
    return isinstance(t, torch._ops.OpOverload) and t.is_view


class _Regroup(Exception):
    """Live-ins to split rank by rank (live-in -> grouping) so their rows line
    up with rows gathered over a mesh dim inside the region; plan again."""

    def __init__(self, groups: dict[fx.Node, int]):
        super().__init__(groups)
        self.groups = groups


def plan_region(
    region: str,
    mode: ChunkMode,
    members: list[fx.Node],
    global_dims: dict,
    early_sums: bool = True,
    why: dict | None = None,
    exactness: ChunkExactness = "tolerance",
) -> RegionPlan:
    """Decide what to split, duplicate and rebuild; raise :class:`ChunkRefused`.

    ``exactness="bitwise"``: every live-in is split in contiguous halves, so
    each chunk computes exactly what the region computes on the halves
    (eager module-level chunking); a region that gathers rows along the split
    dim and combines them with rows it did not gather is refused.
    ``"tolerance"``: such live-ins are split rank by rank instead (each
    chunk holds the first or second half of every rank's rows, the order the
    gathered rows have), and values leaving the region with that grouping
    are rebuilt rank by rank; the step then equals the unchunked one up to
    the order in which sums over the split dim add their terms."""
    if exactness not in ("bitwise", "tolerance"):
        raise ValueError(f"chunk exactness {exactness!r}: give 'bitwise' or 'tolerance'")
    live_in_groups: dict[fx.Node, int] = {}
    for _ in range(len(members) + 1):  # each retry regroups at least one more live-in
        try:
            return _plan_region(region, mode, members, global_dims, early_sums, why, exactness, live_in_groups)
        except _Regroup as r:
            live_in_groups.update(r.groups)
    raise ChunkRefused(f"{region}: the live-ins' row groupings did not settle")  # unreachable in practice


def _live_in_roots(nodes: list[fx.Node], live_ins: dict[fx.Node, int], state: dict) -> set[fx.Node]:
    """The split live-ins that ``nodes`` (region values) are computed from."""
    roots: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if x in live_ins:
            roots.add(x)
        elif x in state:
            stack.extend(a for a in x.all_input_nodes if a in state)
    return roots


def _plan_region(
    region: str,
    mode: ChunkMode,
    members: list[fx.Node],
    global_dims: dict,
    early_sums: bool,
    why: dict | None,
    exactness: ChunkExactness,
    live_in_groups: dict[fx.Node, int],
) -> RegionPlan:
    member_set = set(members)
    if mode == "seq":
        att = next((n for n in members if any(s in str(n.target) for s in ATTENTION_NAMES)), None)
        if att is not None:
            raise ChunkRefused(f"{att.name} ({att.target}): attention under sequence chunking needs every key")
    sums = _SUM_REDUCTIONS | _extra_sum_reductions()
    state: dict[fx.Node, Any] = {}
    half: dict[fx.Node, Any] = {}
    probe: dict[fx.Node, tuple] = {}
    live_ins: dict[fx.Node, int] = {}
    shared: set[fx.Node] = set()
    dependent: list[fx.Node] = []
    summed: set[fx.Node] = set()  # sums over the split dim, added up at once
    partners: dict[fx.Node, int] = {}  # full-size inputs each chunk reads its part of
    late_reduced: dict[fx.Node, fx.Node] = {}  # linear ops on a partial sum, duplicated -> its producer
    # see merge_factor: 1 where a chunk's rows are a contiguous half, G where
    # they are the halves of G groups (rows gathered over G ranks)
    grouping: dict[fx.Node, Fraction] = {}
    partner_groups: dict[fx.Node, Fraction] = {}
    mesh_sizes = MESH_SIZES.get()
    for n in members:
        ins = n.all_input_nodes
        deps = []
        for a in ins:
            if a in member_set:
                if a in state and a not in summed:
                    deps.append(a)
                continue
            g = global_dims.get(a, "absent")
            if isinstance(g, int):
                if a not in live_ins:
                    v = fake_val(a)
                    k = live_in_groups.get(a, 1)
                    if v.shape[g] % (2 * k):
                        raise ChunkRefused(
                            f"live-in {a.name} has odd size {v.shape[g]} on the split dim {g}"
                            + (f" per group of {k} ranks' rows" if k > 1 else "")
                        )
                    live_ins[a] = g
                    half[a] = v.narrow(g, 0, v.shape[g] // 2)
                    state[a] = g
                    grouping[a] = Fraction(k)
                deps.append(a)
            elif g is None:
                lost = (why or {}).get(a)
                raise ChunkRefused(
                    f"cannot tell the split dim of live-in {a.name} (feeding {n.name})" + (f": {lost}" if lost else "")
                )
            else:
                shared.add(a)
        if not deps or n.target in FILLS:
            continue  # a fill reads its input for the dtype only: shared
        if n in late_reduced:
            # a linear op on one chunk's partial sum (its gradient collective)
            out, st, sized = probe_op(n, state, half)
            state[n], half[n], probe[n] = REDUCED, out, (out, sized)
            dependent.append(n)
            continue
        if any(a in summed for a in ins):
            raise ChunkRefused(
                f"{n.name} ({n.target}) uses a sum over the split dim together with per-chunk values "
                "(a norm or statistic over the split dim)"
            )
        if _is_random(n):
            raise ChunkRefused(f"{n.name} ({n.target}) is random: the chunks would draw other numbers")
        if mode == "seq" and any(s in str(n.target) for s in ATTENTION_NAMES):
            raise ChunkRefused(f"{n.name} ({n.target}): attention under sequence chunking needs every key")
        in_dims = [state[a] for a in deps if isinstance(state.get(a), int)]
        first = next((a for a in deps if isinstance(state.get(a), int)), None)
        regroup = first is not None and group_split(n, state[first], grouping.get(first, Fraction(1)), mesh_sizes)
        if (
            first is not None
            and not regroup
            and acts_along(n, state[first], fake_val(first).dim() if isinstance(fake_val(first), torch.Tensor) else 0)
        ):
            if n.target not in sums:
                raise ChunkRefused(f"{n.name} ({n.target}) acts along the split dim")
        found: dict[fx.Node, int] = {}
        try:
            out, st, sized = probe_op(n, state, half, partners=found)
        except UnknownSplitDim as e:
            raise ChunkRefused(str(e)) from None
        sts = st if isinstance(st, list) else [st]
        if REDUCED in sts and n.target not in sums and n.target is not operator.getitem:
            raise ChunkRefused(f"{n.name} ({n.target}) reduces across the split dim (only sums can be rebuilt)")
        if not in_dims and n.target is not operator.getitem and not any(state.get(a) == PER_CHUNK for a in deps):
            raise ChunkRefused(f"{n.name} ({n.target}) depends on the split only through multi-output values")
        for f, i in found.items():
            if partners.setdefault(f, i) != i:
                raise ChunkRefused(f"{f.name} lines up with the split dim along two different dims")
        # (a partial sum has no rows: its grouping does not matter)
        groups = {grouping.get(a, Fraction(1)) for a in deps if state.get(a) != REDUCED}
        if len(groups) > 1:
            _regroup_or_refuse(n, deps, grouping, groups, live_ins, live_in_groups, state, exactness)
        base = groups.pop() if groups else Fraction(1)
        for f in found:
            if base != 1 and (exactness == "bitwise" or base.denominator != 1):
                if exactness == "tolerance":
                    # scattered rows: split the live-ins so that the chunks hold halves of the rows the rank has here
                    _regroup(deps, 1 / base, live_ins, live_in_groups, state)
                raise ChunkRefused(
                    f"{n.name} ({n.target}) reads {f.name}, full size along the split dim, with rows "
                    "gathered or scattered over a mesh dim inside the region" + _BITWISE_HINT.get(exactness, "")
                )
            if partner_groups.setdefault(f, base) != base:
                raise ChunkRefused(f"{f.name} lines up with the split dim in two different row orders")
        if regroup:
            # each part: one rank's rows again
            v = fake_val(n.args[0])
            grouping[n] = base / (v.shape[state[first]] // n.args[1])
        elif st == REDUCED:
            grouping[n] = Fraction(1)
        else:
            grouping[n] = base * (merge_factor(n, state[first], st, mesh_sizes) if first is not None else 1)
        state[n] = tuple(st) if isinstance(st, list) else st
        half[n] = out
        probe[n] = (out, sized)
        dependent.append(n)
        if st == REDUCED:
            late = _late_sum_closure(n, member_set) if not early_sums else None
            if late is None:
                summed.add(n)
            else:
                # each chunk's sum runs through its own collectives; added at the end
                for m in late:
                    late_reduced[m] = n
    if not dependent:
        raise ChunkRefused("no node of the region depends on a value carrying the split dim")
    leaving: dict[fx.Node, int] = {}
    for n in dependent:
        u = next((u for u in n.users if u not in member_set), None)
        k = grouping.get(n, Fraction(1))
        if u is not None and k != 1 and isinstance(state[n], int):
            rows = fake_val(n).shape[state[n]] * 2
            if exactness == "tolerance" and k.denominator != 1:
                _regroup([n], 1 / k, live_ins, live_in_groups, state)
            if exactness == "bitwise" or k.denominator != 1 or rows % (2 * k):
                raise ChunkRefused(
                    f"{n.name} ({n.target}) was gathered or scattered over a mesh dim along the split dim and "
                    f"{u.name} outside the region reads it: the chunks' rows interleave rank by rank"
                    + _BITWISE_HINT.get(exactness, "")
                )
            leaving[n] = int(k)
        if state[n] == PER_CHUNK:
            u = next((u for u in n.users if u not in member_set), None)
            if u is not None:
                raise ChunkRefused(
                    f"{n.name} ({n.target}) is per-chunk (MoE routing or exchanged rows) and {u.name} "
                    "outside the region reads it: it cannot be rebuilt from the chunks"
                )
    split_groups = {a: k for a, k in live_in_groups.items() if a in live_ins and k != 1}
    split_groups.update({f: int(k) for f, k in partner_groups.items() if k != 1})
    return RegionPlan(
        region,
        mode,
        dependent,
        live_ins,
        len(shared),
        state,
        probe,
        partners=partners,
        groups={**split_groups, **leaving},
    )


# appended to refusals that the tolerance mode would chunk
_BITWISE_HINT = {"bitwise": " (chunk_exactness='tolerance' splits the live-ins rank by rank instead)"}


def _regroup(nodes, factor: Fraction, live_ins, live_in_groups, state) -> None:
    """Raise :class:`_Regroup` splitting the live-ins ``nodes`` are computed
    from with ``factor`` times their grouping, where that is whole; return
    when it cannot be (the caller refuses)."""
    roots = _live_in_roots(nodes, live_ins, state)
    regrouped = {r: live_in_groups.get(r, 1) * factor for r in roots}
    if roots and all(k.denominator == 1 for k in regrouped.values()):
        raise _Regroup({r: int(k) for r, k in regrouped.items()})


def _regroup_or_refuse(n, deps, grouping, groups, live_ins, live_in_groups, state, exactness) -> None:
    """``n`` combines values whose chunks group their rows differently: in
    tolerance mode, raise :class:`_Regroup` to split the live-ins of the
    less grouped ones like the most grouped one; else refuse."""
    top = max(groups)
    reason = (
        f"{n.name} ({n.target}) combines rows in different orders (one gathered over a mesh dim "
        "along the split dim inside the region)"
    )
    if exactness == "tolerance":
        high = [a for a in deps if grouping.get(a, Fraction(1)) == top]
        low = [a for a in deps if grouping.get(a, Fraction(1)) != top and state.get(a) != REDUCED]
        factors = {top / grouping.get(a, Fraction(1)) for a in low}
        if len(factors) == 1 and not _live_in_roots(low, live_ins, state) & _live_in_roots(high, live_ins, state):
            _regroup(low, factors.pop(), live_ins, live_in_groups, state)
        raise ChunkRefused(reason + ": the less gathered rows do not come from live-ins that could be split like them")
    raise ChunkRefused(reason + _BITWISE_HINT.get(exactness, ""))


_WORD = re.compile(r"(?<![\w.])([A-Za-z_]\w*)(?: \(([^()]*)\))?(?![\w.])")


def reason_key(reason: str, names: set[str]) -> str:
    """``reason`` without its graph node names (``mul_7 (aten.mul.Tensor)``
    -> ``aten.mul.Tensor``, other names -> ``<node>``), so that the same
    refusal in every layer counts as one."""

    def sub(m):
        name, target = m.group(1), m.group(2)
        if name not in names:
            return m.group(0)
        if target:
            return target
        # a bare word that is also a node name ("split") stays
        return "<node>" if "_" in name.strip("_") else m.group(0)

    return _WORD.sub(sub, reason)


def split_seeds(gm: fx.GraphModule, ctx: PassContext) -> dict[str, dict[fx.Node, int]]:
    """User inputs split at the mode's dim; tangents like their outputs."""
    local = ctx.local
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    n_params = len(local.param_fqns) + len(local.buffer_fqns)
    inputs = placeholders[n_params : n_params + len(local.input_specs)]
    tangents = placeholders[n_params + len(local.input_specs) + 1 :]
    out: dict[str, dict[fx.Node, int]] = {}
    for mode, d in MODE_INPUT_DIM.items():
        seeds = {}
        for p in inputs:
            v = fake_val(p)
            if isinstance(v, torch.Tensor) and v.dim() > d and v.shape[d] % 2 == 0:
                seeds[p] = d
        # tangents: like the forward outputs they are the gradients of
        (output,) = gm.graph.find_nodes(op="output")
        outs = list(output.args[0])
        dims = propagate_split_dims(gm, seeds)
        for k, t in enumerate(tangents):
            if k < len(local.differentiable_outputs):
                o = outs[local.differentiable_outputs[k]]
                od = dims.get(o) if isinstance(o, fx.Node) else None
                if isinstance(od, int):
                    seeds[t] = od
        out[mode] = seeds
    return out
