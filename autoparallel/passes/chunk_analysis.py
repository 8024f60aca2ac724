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
from typing import Any

import torch
import torch.fx as fx

from ..capture.tracing import module_path
from .base import ChunkMode, PassContext
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
    merge_depth,
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


def plan_region(
    region: str,
    mode: ChunkMode,
    members: list[fx.Node],
    global_dims: dict,
    early_sums: bool = True,
    why: dict | None = None,
) -> RegionPlan:
    """Decide what to split, duplicate and rebuild; raise :class:`ChunkRefused`."""
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
    depth: dict[fx.Node, int] = {}  # see merge_depth: 0 where a chunk's rows are a contiguous half
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
                    if v.shape[g] % 2:
                        raise ChunkRefused(f"live-in {a.name} has odd size {v.shape[g]} on the split dim {g}")
                    live_ins[a] = g
                    half[a] = v.narrow(g, 0, v.shape[g] // 2)
                    state[a] = g
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
        regroup = first is not None and group_split(n, state[first], depth.get(first, 0), mesh_sizes)
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
        depths = {depth.get(a, 0) for a in deps}
        if len(depths) > 1 or (found and depths != {0}):
            raise ChunkRefused(
                f"{n.name} ({n.target}) combines rows in different orders (one gathered over a mesh dim "
                "along the split dim inside the region)"
            )
        base = depths.pop() if depths else 0
        if regroup:
            depth[n] = base - 1  # each part: one rank's rows again
        else:
            depth[n] = base + (merge_depth(n, state[first], st, mesh_sizes) if first is not None else 0)
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
    for n in dependent:
        u = next((u for u in n.users if u not in member_set), None)
        if u is not None and depth.get(n, 0) and isinstance(state[n], int):
            raise ChunkRefused(
                f"{n.name} ({n.target}) was gathered or scattered over a mesh dim along the split dim and "
                f"{u.name} outside the region reads it: the chunks' rows interleave rank by rank"
            )
        if state[n] == PER_CHUNK:
            u = next((u for u in n.users if u not in member_set), None)
            if u is not None:
                raise ChunkRefused(
                    f"{n.name} ({n.target}) is per-chunk (MoE routing or exchanged rows) and {u.name} "
                    "outside the region reads it: it cannot be rebuilt from the chunks"
                )
    return RegionPlan(region, mode, dependent, live_ins, len(shared), state, probe, partners=partners)


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
