"""Split selected module regions into two chunks so one chunk's communication
overlaps the other's compute.

Opt-in: ``PassOptions(chunk_modules={"layers.*.moe": "batch",
"layers.*.attention": "seq"})`` (module-path patterns, ``*`` one path
component; the dim to split). The pass runs on the rank-local joint graph,
before the forward/backward split, so the partitioner and the recompute tags
see the chunked graph.

For each module instance a pattern matches (``layers.3.moe``) the region is
every joint node whose module path is in it, forward and backward. Then:

* **Which values carry the split dim.** The step's user inputs carry it at a
  known dim (batch: 0, seq: 1) and tangents like their forward outputs; it
  is propagated through the whole graph by *probing*: each op is run on fake
  inputs whose split dim is halved, and the output dim whose size halved is
  the output's split dim (none halved: the op reduced it away; several, or
  not by half: ambiguous). Ops with size arguments (``view``, ``expand``,
  ``slice_backward``...) get their sizes rewritten by shape factorisation.
  No value is matched by its size alone, so a batch equal to the sequence
  length (or the hidden size) cannot be mistaken for it.
* **Live-ins** that carry it (activations, incoming gradients) are split in
  two (``split`` views); the others (parameters, their all-gather/cast
  chains, masks, reduced values) are shared and never duplicated.
* **Duplication**: only the region nodes that depend on a split live-in;
  the original node becomes chunk A (on the halves), a copy right after it
  chunk B. The node-by-node interleave is what ``schedule_overlap`` needs:
  it issues chunk A's collective as soon as its input exists and waits as
  late as possible, so chunk B's compute runs while A's collective is in
  flight, under its usual compute cap and memory limit.
* **Escaping values**: split-dim values used outside the region are
  concatenated; sums over the split dim (weight gradients: ``mm`` over the
  tokens, ``sum``) are added at once, before any gradient collective, so
  gradient communication is not doubled.
* **Refusals** (a stats entry with the reason, the region left as is): a
  reduction across the split dim other than a sum (a norm or mean over the
  batch), a sum used together with per-chunk values, ops acting along the
  split dim (softmax, cat, slicing), attention under sequence chunking, an
  odd or ambiguous split size, random ops, live-ins whose split dim cannot
  be told.

Redistributions (apply's layout changes, tagged ``REDISTRIBUTE_KEY``) keep
their dims' meaning outside regions; inside a region they run per chunk, as
redistributing each eager chunk would (a ``[group, per-rank]`` reshape keeps
the mesh group factor and halves the per-rank one).

Limits (refused, with the reason in the stats): a split dim that a reshape
merges with an outer dim (sequence chunking where batch and sequence are
flattened together with a batch > 1), one row per rank (nothing to split),
redistributions that flatten a region value for a collective, factories
whose sizes do not follow a split value.

Buffer mutations stay where they are: their new values are rebuilt from
both chunks (concatenated or summed) before the mutation output reads them.
The result is exactly eager module-level chunking (run the module on each
half, concatenate): the same ops on the same halves, gradients added once.

>>> # stats = chunk_regions(local.gm, ctx)   # doctest: +SKIP
>>> # ChunkRegionsStats(regions_chunked=2, refused={...}, nodes_added=310, ...)
"""

from __future__ import annotations

import contextvars
import fnmatch
import logging
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..apply.redistribute import REDISTRIBUTE_KEY
from ..tracing import module_path
from . import PassContext, register_pass

__all__ = [
    "CHUNK_KEY",
    "ChunkRefused",
    "ChunkRegionsStats",
    "RegionReport",
    "chunk_graph",
    "chunk_regions",
    "exposed_comm_by_region",
    "region_of",
]

logger = logging.getLogger(__name__)

# node.meta key: (region, chunk 0 or 1) on the nodes this pass duplicated
CHUNK_KEY = "ap_chunk"
# Which dim of a user input each mode splits (inputs are [batch, seq, ...]).
MODE_INPUT_DIM = {"batch": 0, "seq": 1}

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
    for name in ("moe_experts_backward",):
        op = getattr(ops, name, None) if ops is not None else None
        if op is not None:
            out.add(op.default)
    return out


# Attention ops: under sequence chunking every query needs every key.
_ATTENTION_NAMES = ("scaled_dot_product", "flash_attention", "efficient_attention", "flex_attention", "cudnn_attention")
# Views whose dim arguments name every dim (they act along none of them).
_DIM_FREE = {
    _aten.permute.default,
    _aten.transpose.int,
    _aten.unsqueeze.default,
    _aten.squeeze.dim,
    _aten.squeeze.dims,
    _aten.sum.dim_IntList,
}
# The mesh dim sizes of the graph being chunked (see _view_dim).
_MESH_SIZES: contextvars.ContextVar[frozenset] = contextvars.ContextVar("chunk_mesh_sizes", default=frozenset())
_NEW_FACTORIES = {_aten.new_zeros.default, _aten.new_empty.default, _aten.new_ones.default, _aten.new_full.default}
_SIZE_ARG_NAMES = {"size", "sizes", "input_sizes", "shape", "stride"}
# Ops that only forward or regroup values: a wait, a getitem.
_WAIT = _c10d.wait_tensor.default


class ChunkRefused(Exception):
    """A region cannot be chunked without changing the math; says why."""


class _Unknown(Exception):
    """The split dim of a value cannot be told."""


@dataclass
class RegionReport:
    region: str  # module path of the instance (layers.3.moe)
    mode: str  # "batch" | "seq"
    chunked: bool
    reason: str = ""  # why refused
    nodes_added: int = 0
    live_ins_split: int = 0
    live_ins_shared: int = 0
    exposed_comm_before_s: float = 0.0  # estimated, this region's collectives
    exposed_comm_after_s: float = 0.0


@dataclass
class ChunkRegionsStats:
    regions_chunked: int = 0
    regions_refused: int = 0
    refused: dict[str, str] = field(default_factory=dict)  # region -> reason
    nodes_added: int = 0
    live_ins_split: int = 0
    live_ins_shared: int = 0
    # estimated exposed communication of the chunked regions' collectives
    # (joint graph in the overlap scheduler's order), summed over regions
    exposed_comm_before_s: float = 0.0
    exposed_comm_after_s: float = 0.0
    regions: list[RegionReport] = field(default_factory=list)


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


def _regions(gm: fx.GraphModule, modules: dict[str, str]) -> dict[str, tuple[str, list[fx.Node]]]:
    """region -> (mode, its call nodes in graph order); first pattern wins."""
    out: dict[str, tuple[str, list[fx.Node]]] = {}
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
# split-dim propagation by probing


def _val(n: Any):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _fake_mode(vals):
    for v in vals:
        if isinstance(v, torch.Tensor):
            m = getattr(v, "fake_mode", None)
            if m is not None:
                return m
    return None


def _normalize(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _view_dim(in_shape, d: int, out_shape, mesh_sizes: frozenset = frozenset()) -> int:
    """The output dim of a reshape of ``in_shape`` to ``out_shape`` that
    carries input dim ``d``, halving with it: the dims before it hold the
    same elements (prefix products equal) and it is ``d`` merged with inner
    dims or split off ``d``'s outer part. Raises :class:`_Unknown`.

    ``mesh_sizes``: the reshape is a redistribution's ``[group, per-rank]``
    split of ``d`` (apply's layout change): the group factor is the mesh's
    and stays, the per-rank factor halves, as redistributing each eager
    chunk would do; ambiguous (refused) when both factors could be the
    group."""
    outer = 1
    for s in in_shape[:d]:
        outer *= s
    size = in_shape[d]
    if mesh_sizes and len(out_shape) == len(in_shape) + 1:
        prefix = 1
        for j, s in enumerate(out_shape[:-1]):
            if prefix == outer and s * out_shape[j + 1] == size:
                group, per = s, out_shape[j + 1]
                if group in mesh_sizes and per % 2 == 0 and per not in mesh_sizes:
                    return j + 1
                if group in mesh_sizes:
                    raise _Unknown(f"redistribution reshape {tuple(in_shape)} -> {tuple(out_shape)}: "
                                   "cannot tell the mesh group factor from the per-rank one")
                break
            prefix *= s
    prefix = 1
    for j, s in enumerate(out_shape):
        if prefix == outer and s != 1 and s % 2 == 0 and (s % size == 0 or size % s == 0):
            return j
        prefix *= s
        if prefix > outer:
            break
    raise _Unknown(f"reshape {tuple(in_shape)} -> {tuple(out_shape)} mixes split dim {d} with outer dims")


class _quiet_fake_tensor:
    """Fake tensor logs every failing op at error level; a failing probe is
    an expected answer here."""

    def __enter__(self):
        self.log = logging.getLogger("torch._subclasses.fake_tensor")
        self.level = self.log.level
        self.log.setLevel(logging.CRITICAL)

    def __exit__(self, *exc):
        self.log.setLevel(self.level)
        return False


def _halve(seq, j: int) -> list:
    out = list(seq)
    out[j] = out[j] // 2
    return out


def _size_args(node: fx.Node, dims: dict[fx.Node, int]) -> tuple[tuple, dict, int] | None:
    """(args, kwargs, output dim) for ops whose size arguments must shrink
    with the split input, or None when the op has no size arguments."""
    t = node.target
    src = node.args[0] if node.args else None
    d = dims.get(src) if isinstance(src, fx.Node) else None
    if t in (_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default):
        if d is None:
            raise _Unknown(f"{node.name}: sizes of a view of a value without the split dim")
        in_shape = _val(src).shape
        out_shape = list(node.args[1])
        chain = REDISTRIBUTE_KEY in node.meta
        j = _view_dim(list(in_shape), d, out_shape, _MESH_SIZES.get() if chain else frozenset())
        return (src, _halve(out_shape, j)), dict(node.kwargs), j
    if t is _aten.expand.default:
        if d is None:
            raise _Unknown(f"{node.name}: expand of a value without the split dim")
        sizes = list(node.args[1])
        j = d + len(sizes) - _val(src).dim()
        return (src, _halve(sizes, j), *node.args[2:]), dict(node.kwargs), j
    if t is _aten.slice_backward.default or t is _aten.select_backward.default:
        sizes = list(node.args[1])
        if d is None:
            raise _Unknown(f"{node.name}: {t} of a value without the split dim")
        along = _normalize(node.args[2], len(sizes))
        j = d if t is _aten.slice_backward.default or d < along else d + 1
        if j == along:
            raise ChunkRefused(f"{node.name} ({t}) acts along the split dim")
        return (src, _halve(sizes, j), *node.args[2:]), dict(node.kwargs), j
    if t in _NEW_FACTORIES:
        # a fresh tensor "like" src (a gradient's zeros): it carries the
        # split dim where its size matches src's there; the consumers'
        # probes check that the shapes then fit
        sizes = list(node.args[1])
        if d is None or len(sizes) != _val(src).dim() or sizes[d] != _val(src).shape[d]:
            raise _Unknown(f"{node.name}: {t} of sizes {sizes} does not line up with the split dim")
        return (src, _halve(sizes, d), *node.args[2:]), dict(node.kwargs), d
    schema = getattr(t, "_schema", None)
    if schema is not None:
        for a in schema.arguments:
            if a.name in _SIZE_ARG_NAMES and "List" in str(a.type):
                raise _Unknown(f"{node.name}: {t} has size arguments this pass cannot rewrite")
    return None


def _acts_along(node: fx.Node, d: int, rank: int) -> bool:
    """Whether ``node`` has a ``dim`` argument naming split dim ``d``."""
    if node.target in _DIM_FREE or node.target is operator.getitem:
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    for k, a in enumerate(schema.arguments):
        if a.name not in ("dim", "dims"):
            continue
        v = node.args[k] if k < len(node.args) else node.kwargs.get(a.name, a.default_value if a.has_default_value() else None)
        if v is None:
            # dim=None reductions (sum of everything) reduce the split dim
            return "sum" not in str(node.target) and "Optional" in str(a.type)
        vs = v if isinstance(v, (list, tuple)) else [v]
        if any(isinstance(x, int) and _normalize(x, rank) == d for x in vs):
            return True
    return False


REDUCED = "reduced"  # depends on the split values, carries no split dim


def _full_size_partners(node: fx.Node, dims: dict[fx.Node, Any]) -> dict[fx.Node, int]:
    """Inputs of a pointwise ``node`` that carry no split dim but broadcast
    against one at its full size (a gradient expanded from a scalar): input
    -> the dim of theirs that lines up with the split dim."""
    t = node.target
    if not (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
        return {}
    split = [(a, dims[a]) for a in node.all_input_nodes if isinstance(dims.get(a), int)]
    out = {}
    for a in node.all_input_nodes:
        v = _val(a)
        if isinstance(dims.get(a), int) or not isinstance(v, torch.Tensor):
            continue
        for c, d in split:
            cv = _val(c)
            i = d - cv.dim() + v.dim()
            if 0 <= i < v.dim() and v.shape[i] == cv.shape[d] and v.shape[i] != 1:
                out[a] = i
    return out


def _probe(node: fx.Node, dims: dict[fx.Node, Any], half_vals: dict[fx.Node, Any], implicit: bool = False):
    """(chunk value(s), state(s), (args, kwargs)) of ``node`` run on the
    halves: the fake output(s) for one chunk, per output its split dim or
    REDUCED, and the arguments with chunk sizes. ``implicit``: halve the
    full-size partners of pointwise ops too (else they are refused)."""
    sized = _size_args(node, dims)
    if sized is not None:
        args, kwargs, j = sized
    else:
        args, kwargs, j = node.args, node.kwargs, None
    partners = _full_size_partners(node, dims)
    if partners and not implicit:
        a = next(iter(partners))
        raise ChunkRefused(f"{node.name} ({node.target}) reads {a.name}, which is full size along the split dim")
    half_vals = dict(half_vals) if partners else half_vals
    for a, i in partners.items():
        half_vals[a] = _val(a).narrow(i, 0, _val(a).shape[i] // 2)

    def val(a):
        if isinstance(a, fx.Node):
            return half_vals[a] if a in half_vals else _val(a)
        return a

    a_vals = fx.node.map_aggregate(args, val)
    k_vals = fx.node.map_aggregate(kwargs, val)
    if node.target is operator.getitem:
        out = a_vals[0][a_vals[1]]
    else:
        mode = _fake_mode([_val(a) for a in node.all_input_nodes])
        if mode is None:
            raise _Unknown(f"{node.name}: no fake tensors to probe with")
        try:
            with mode, _quiet_fake_tensor():
                out = node.target(*a_vals, **k_vals)
        except Exception as e:  # shapes that do not fit: the split does not go through
            raise _Unknown(f"{node.name} ({node.target}) fails on the halves: {type(e).__name__}: {str(e)[:160]}")
    full = _val(node)

    def state(full_v, half_v):
        if not isinstance(full_v, torch.Tensor):
            if isinstance(half_v, torch.Tensor) or full_v != half_v:
                raise _Unknown(f"{node.name}: a non-tensor output changes with the split")
            return None
        if full_v.dim() != half_v.dim():
            raise _Unknown(f"{node.name}: rank changes with the split")
        changed = [i for i, (a, b) in enumerate(zip(full_v.shape, half_v.shape)) if a != b]
        if not changed:
            return REDUCED
        if len(changed) > 1 or full_v.shape[changed[0]] != 2 * half_v.shape[changed[0]]:
            raise _Unknown(
                f"{node.name}: split is ambiguous (shape {tuple(full_v.shape)} -> {tuple(half_v.shape)})"
            )
        if j is not None and changed[0] != j:
            raise _Unknown(f"{node.name}: sizes rewritten on dim {j} but dim {changed[0]} changed")
        return changed[0]

    if isinstance(full, (tuple, list)):
        return out, [state(f, h) for f, h in zip(full, out)], (args, kwargs)
    return out, state(full, out), (args, kwargs)


def _redistribution_chains(gm: fx.GraphModule) -> dict[fx.Node, tuple[list[fx.Node], set[fx.Node]]]:
    """node -> (inputs, outputs) of the redistribution (apply's layout change
    between a producer and a consumer) it belongs to: consecutive nodes with
    the same ``REDISTRIBUTE_KEY`` tag."""
    from ..apply.redistribute import REDISTRIBUTE_KEY

    out: dict[fx.Node, tuple[list[fx.Node], set[fx.Node]]] = {}
    run: list[fx.Node] = []

    def close():
        if not run:
            return
        members = set(run)
        ins = [a for m in run for a in m.all_input_nodes if a not in members]
        outs = {m for m in run if any(u not in members for u in m.users)}
        for m in run:
            out[m] = (ins, outs)
        run.clear()

    prev = None
    for n in gm.graph.nodes:
        tag = n.meta.get(REDISTRIBUTE_KEY) if n.op == "call_function" else None
        if tag is None or tag != prev:
            close()
        if tag is not None:
            run.append(n)
        prev = tag
    close()
    return out


def _input_dims(node: fx.Node, dims: dict) -> list[int]:
    return [dims[a] for a in node.all_input_nodes if isinstance(dims.get(a), int)]


def propagate_split_dims(gm: fx.GraphModule, seeds: dict[fx.Node, int]) -> dict[fx.Node, Any]:
    """Split dim of every graph value reachable from ``seeds`` (placeholder
    -> dim): an int, REDUCED, or None where it cannot be told (the reason in
    the log at debug level). Values not reachable are absent."""
    dims: dict[fx.Node, Any] = dict(seeds)
    half: dict[fx.Node, Any] = {}
    for p, d in seeds.items():
        v = _val(p)
        half[p] = v.narrow(d, 0, v.shape[d] // 2)
    chains = _redistribution_chains(gm)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        ins = n.all_input_nodes
        if not any(a in dims for a in ins):
            continue
        chain = chains.get(n)
        if chain is not None:
            # a layout change: the local value keeps its dims' meaning (a
            # DTensor shard), whatever slicing or gathering it takes
            src = [a for a in chain[0] if isinstance(dims.get(a), int)]
            v, out_v = _val(src[0]) if len(src) == 1 else None, _val(n)
            if n in chain[1] and v is not None and isinstance(out_v, torch.Tensor) and out_v.dim() == v.dim():
                d = dims[src[0]]
                if out_v.shape[d] % 2 == 0:
                    dims[n] = d
                    half[n] = out_v.narrow(d, 0, out_v.shape[d] // 2)
                    continue
            dims[n] = None
            continue
        if n.target is operator.getitem and isinstance(dims.get(n.args[0]), tuple):
            dims[n] = dims[n.args[0]][n.args[1]]
            half[n] = half[n.args[0]][n.args[1]]
            continue
        if not _input_dims(n, dims):
            # only reduced (shared from here) or unknown inputs
            dims[n] = None if any(a in dims and dims[a] is None for a in ins) else REDUCED
            continue
        # unknown inputs are read whole, as shared values: this only names
        # the dims; a region's own walk checks that its split is exact
        try:
            out, st, _ = _probe(n, dims, half, implicit=True)
        except (_Unknown, ChunkRefused) as e:
            logger.debug("split dim lost: %s", e)
            dims[n] = None
            continue
        half[n] = out
        dims[n] = tuple(st) if isinstance(st, list) else st
    return dims


# ---------------------------------------------------------------------------
# the rewrite


@dataclass
class _Plan:
    region: str
    mode: str
    nodes: list[fx.Node]  # region nodes that depend on split live-ins, graph order
    live_ins: dict[fx.Node, int]  # split ones -> dim
    shared: int
    state: dict[fx.Node, Any]  # node -> dim | REDUCED | tuple of them
    probe: dict[fx.Node, tuple]  # node -> (A value, (args, kwargs) with chunk sizes)
    joins: dict[fx.Node, fx.Node] = field(default_factory=dict)  # rebuilt value -> original node


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


def _plan_region(region: str, mode: str, members: list[fx.Node], global_dims: dict) -> _Plan:
    """Decide what to split, duplicate and rebuild; raise :class:`ChunkRefused`."""
    member_set = set(members)
    if mode == "seq":
        att = next((n for n in members if any(s in str(n.target) for s in _ATTENTION_NAMES)), None)
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
                    v = _val(a)
                    if v.shape[g] % 2:
                        raise ChunkRefused(f"live-in {a.name} has odd size {v.shape[g]} on the split dim {g}")
                    live_ins[a] = g
                    half[a] = v.narrow(g, 0, v.shape[g] // 2)
                    state[a] = g
                deps.append(a)
            elif g is None:
                raise ChunkRefused(f"cannot tell the split dim of live-in {a.name} (feeding {n.name})")
            else:
                shared.add(a)
        if not deps:
            continue
        if any(a in summed for a in ins):
            raise ChunkRefused(
                f"{n.name} ({n.target}) uses a sum over the split dim together with per-chunk values "
                "(a norm or statistic over the split dim)"
            )
        if _is_random(n):
            raise ChunkRefused(f"{n.name} ({n.target}) is random: the chunks would draw other numbers")
        if mode == "seq" and any(s in str(n.target) for s in _ATTENTION_NAMES):
            raise ChunkRefused(f"{n.name} ({n.target}): attention under sequence chunking needs every key")
        in_dims = [state[a] for a in deps if isinstance(state.get(a), int)]
        first = next((a for a in deps if isinstance(state.get(a), int)), None)
        if first is not None and _acts_along(n, state[first], _val(first).dim() if isinstance(_val(first), torch.Tensor) else 0):
            if n.target not in sums:
                raise ChunkRefused(f"{n.name} ({n.target}) acts along the split dim")
        try:
            out, st, sized = _probe(n, state, half)
        except _Unknown as e:
            raise ChunkRefused(str(e)) from None
        sts = st if isinstance(st, list) else [st]
        if REDUCED in sts and n.target not in sums and n.target is not operator.getitem:
            raise ChunkRefused(f"{n.name} ({n.target}) reduces across the split dim (only sums can be rebuilt)")
        if not in_dims and n.target is not operator.getitem:
            raise ChunkRefused(f"{n.name} ({n.target}) depends on the split only through multi-output values")
        state[n] = tuple(st) if isinstance(st, list) else st
        half[n] = out
        probe[n] = (out, sized)
        dependent.append(n)
        if st == REDUCED:
            summed.add(n)
    if not dependent:
        raise ChunkRefused("no node of the region depends on a value carrying the split dim")
    return _Plan(region, mode, dependent, live_ins, len(shared), state, probe)


def _stamp(new: fx.Node, like: fx.Node, tag: str) -> None:
    """Fold stamp (:mod:`autoparallel.apply.unfold`) for a node this pass
    made, keyed on ``like``'s so that twins in other layers share it."""
    from ..apply.unfold import FOLD_KEY

    t = like.meta.get(FOLD_KEY)
    if t is not None:
        new.meta[FOLD_KEY] = (t[0], (tag, t[1]))
    elif FOLD_KEY in new.meta:
        del new.meta[FOLD_KEY]


def _apply(gm: fx.GraphModule, plan: _Plan) -> int:
    """Rewrite ``gm`` per ``plan``; returns how many nodes were added."""
    from ..apply.unfold import FOLD_KEY

    g = gm.graph
    dep = set(plan.nodes)
    a_of: dict[fx.Node, fx.Node] = {}
    b_of: dict[fx.Node, fx.Node] = {}
    added = 0
    first_use = {}
    for n in plan.nodes:
        for a in n.all_input_nodes:
            if a in plan.live_ins and a not in first_use:
                first_use[a] = n
    for x, d in plan.live_ins.items():
        n0 = first_use[x]
        size = _val(x).shape[d] // 2
        with g.inserting_before(n0):
            sp = g.call_function(_aten.split.Tensor, (x, size, d))
            ha = g.call_function(operator.getitem, (sp, 0))
            hb = g.call_function(operator.getitem, (sp, 1))
        v = _val(x)
        with _fake_mode([v]) or _null():
            sp.meta["val"] = v.split(size, d)
        ha.meta["val"], hb.meta["val"] = sp.meta["val"][0], sp.meta["val"][1]
        for k, m in enumerate((sp, ha, hb)):
            # copy the consumer's module path and AC tags; stamp like the live-in
            for key in ("custom", "recompute", "ac_graph_id", "partitioner_tag", "stack_trace", "nn_module_stack"):
                if key in n0.meta:
                    m.meta[key] = n0.meta[key]
            if FOLD_KEY in n0.meta:
                key = x.meta.get(FOLD_KEY, (None, x.name))[1]
                m.meta[FOLD_KEY] = (n0.meta[FOLD_KEY][0], ("chunk_split", key, k))
        a_of[x], b_of[x] = ha, hb
        added += 3
    for n in plan.nodes:
        out, (args, kwargs) = plan.probe[n]

        def to_b(a):
            return b_of.get(a, a)

        def to_a(a):
            return a_of.get(a, a)

        b_args = fx.node.map_arg(args, to_b)
        b_kwargs = fx.node.map_arg(kwargs, to_b)
        with g.inserting_after(n):
            b = g.create_node("call_function", n.target, b_args, b_kwargs, name=f"{n.name}_chunk1")
        b.meta = dict(n.meta)
        _stamp(b, n, "chunk1")
        n.args = fx.node.map_arg(args, to_a)
        n.kwargs = fx.node.map_arg(kwargs, to_a)
        n.meta["val"] = out
        b.meta["val"] = _rerun(b, out)
        n.meta[CHUNK_KEY] = (plan.region, 0)
        b.meta[CHUNK_KEY] = (plan.region, 1)
        a_of[n], b_of[n] = n, b
        added += 1
    # rebuild the values that leave the chunked part
    for n in plan.nodes:
        st = plan.state[n]
        if isinstance(st, tuple):
            continue  # multi-output op: its getitems are rebuilt
        outside = [u for u in n.users if u not in dep and u is not b_of[n]]
        if st == REDUCED:
            outside = [u for u in n.users if u is not b_of[n]]
        if not outside:
            continue
        b = b_of[n]
        with g.inserting_after(b):
            if st == REDUCED:
                j = g.call_function(_aten.add.Tensor, (n, b))
            else:
                j = g.call_function(_aten.cat.default, ([n, b], st))
        j.meta = {k: v for k, v in n.meta.items() if k not in (CHUNK_KEY,)}
        j.meta["val"] = _rerun(j, None)
        _stamp(j, n, "chunk_join")
        for u in outside:
            u.replace_input_with(n, j)
        plan.joins[j] = n
        added += 1
    return added


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _rerun(n: fx.Node, fallback):
    """Fake value of ``n`` from its inputs' values."""
    vals = [_val(a) for a in n.all_input_nodes]
    mode = _fake_mode(vals if not isinstance(vals[0], (tuple, list)) else list(vals[0]) + vals[1:])
    args = fx.node.map_arg(n.args, _val)
    kwargs = fx.node.map_arg(n.kwargs, _val)
    if n.target is operator.getitem:
        return args[0][args[1]]
    if mode is None:
        return fallback
    with mode:
        return n.target(*args, **kwargs)


# ---------------------------------------------------------------------------
# estimates


def exposed_comm_by_region(nodes: list[fx.Node], costs, regions: dict[str, str]) -> dict[str, float]:
    """Estimated exposed communication (seconds) per region, for ``nodes``
    run in this order: the two-stream clock of
    :mod:`.overlap_model`, each wait's stall charged to the region of its
    collective (``regions``: pattern -> mode, as ``chunk_modules``)."""
    from .overlap_model import Info

    info = Info(list(nodes), costs)
    kind, time = info.kind, info.time
    now = comm_free = 0.0
    done: dict[fx.Node, float] = {}
    out: dict[str, float] = {}
    for n in nodes:
        k = kind[n]
        if k == 1:
            comm_free = done[n] = max(now, comm_free) + time[n]
        elif k == 2:
            end = done.get(n.args[0], 0.0)
            if end > now:
                start = n.args[0]
                r = next((region_of(module_path(start), p) for p in regions if region_of(module_path(start), p)), None)
                if r is not None:
                    out[r] = out.get(r, 0.0) + end - now
                now = end
        elif k == 3:
            now += time[n]
    return out


def _scheduled_exposure(gm: fx.GraphModule, ctx, modules: dict[str, str]) -> dict[str, float]:
    """:func:`exposed_comm_by_region` of ``gm`` in ``schedule_overlap``'s order."""
    from .overlap_model import Costs
    from .schedule_overlap import ScheduleStats, _schedule

    try:
        costs = Costs(ctx)
        order = _schedule(gm, ctx, ScheduleStats(), costs)
        return exposed_comm_by_region(order, costs, modules)
    except Exception as e:  # an estimate only: never fail the pass on it
        logger.warning("chunk_regions: no exposure estimate: %s", e)
        return {}


# ---------------------------------------------------------------------------
# entry points


def chunk_graph(
    gm: fx.GraphModule,
    modules: dict[str, str],
    seeds: dict[str, dict[fx.Node, int]],
    ctx: PassContext | None = None,
    *,
    copies=lambda node: 1,
) -> ChunkRegionsStats:
    """Chunk the regions of ``gm`` that ``modules`` (pattern -> "batch" or
    "seq") names, in place. ``seeds``: mode -> {placeholder: dim} where the
    split dim starts (user inputs, tangents)."""
    for pattern, mode in modules.items():
        if mode not in MODE_INPUT_DIM:
            raise ValueError(f"chunk_modules[{pattern!r}] = {mode!r}: the mode must be one of {sorted(MODE_INPUT_DIM)}")
    stats = ChunkRegionsStats()
    mesh = getattr(ctx, "mesh", None)
    token = _MESH_SIZES.set(frozenset(mesh.shape) if mesh is not None else frozenset())
    try:
        return _chunk_graph(gm, modules, seeds, ctx, copies, stats)
    finally:
        _MESH_SIZES.reset(token)


def _chunk_graph(gm, modules, seeds, ctx, copies, stats) -> ChunkRegionsStats:
    regions = _regions(gm, modules)
    if not regions:
        logger.warning("chunk_regions: no node belongs to a module matching %s", sorted(modules))
        return stats
    before = _scheduled_exposure(gm, ctx, modules)
    dims_by_mode = {mode: propagate_split_dims(gm, seeds.get(mode, {})) for mode in {m for m, _ in regions.values()}}
    for region, (mode, members) in regions.items():
        rep = RegionReport(region, mode, chunked=False)
        n_copies = copies(members[0])
        try:
            plan = _plan_region(region, mode, members, dims_by_mode[mode])
        except ChunkRefused as e:
            rep.reason = str(e)
            stats.regions_refused += n_copies
            stats.refused[region] = rep.reason
            logger.info("chunk_regions: %s (%s) refused: %s", region, mode, rep.reason)
            stats.regions.append(rep)
            continue
        rep.nodes_added = _apply(gm, plan)
        rep.chunked = True
        rep.live_ins_split, rep.live_ins_shared = len(plan.live_ins), plan.shared
        stats.regions_chunked += n_copies
        stats.nodes_added += n_copies * rep.nodes_added
        stats.live_ins_split += n_copies * rep.live_ins_split
        stats.live_ins_shared += n_copies * rep.live_ins_shared
        stats.regions.append(rep)
        # later regions read rebuilt values: same split dim as the originals
        for dims in dims_by_mode.values():
            for j, n in plan.joins.items():
                dims[j] = dims.get(n, REDUCED)
    gm.graph.lint()
    gm.recompile()
    if stats.regions_chunked:
        after = _scheduled_exposure(gm, ctx, modules)
        for rep in stats.regions:
            rep.exposed_comm_before_s = before.get(rep.region, 0.0)
            rep.exposed_comm_after_s = after.get(rep.region, 0.0)
            if rep.chunked:
                n_copies = copies(next(n for n in gm.graph.nodes if n.meta.get(CHUNK_KEY, (None,))[0] == rep.region))
                stats.exposed_comm_before_s += rep.exposed_comm_before_s * n_copies
                stats.exposed_comm_after_s += rep.exposed_comm_after_s * n_copies
    return stats


def _seeds(gm: fx.GraphModule, ctx: PassContext) -> dict[str, dict[fx.Node, int]]:
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
            v = _val(p)
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


@register_pass("chunk_regions", "joint")
def chunk_regions(gm: fx.GraphModule, ctx: PassContext) -> ChunkRegionsStats | None:
    """Chunk ``PassOptions.chunk_modules``'s regions of the joint graph (see
    the module docstring); a no-op (None) when no module is named."""
    modules = getattr(ctx.options, "chunk_modules", None)
    if not modules:
        return None
    if ctx.local is None:
        raise ValueError("chunk_regions runs on a rank-local joint graph (ctx.local is not set)")
    return chunk_graph(gm, dict(modules), _seeds(gm, ctx), ctx, copies=ctx.copies)
