"""Which dim of each graph value carries the split of :mod:`.chunk_regions`.

The step's user inputs carry it at a known dim and tangents like their
forward outputs; it is propagated by *probing*: each op is run on fake
inputs whose split dim is halved, and the output dim whose size halved is
the output's split dim (none: the op reduced it away, REDUCED; several, or
not by half: ambiguous, refused). Ops with size arguments (``view``,
``expand``, ``slice_backward``, ``new_zeros``...) get their sizes rewritten
by shape factorisation; no value is matched by its size alone.

>>> # dims = propagate_split_dims(gm, {tokens_placeholder: 0})   # doctest: +SKIP
>>> # dims[mm_node]  -> 0 (rows), REDUCED (a sum over the batch), or None
"""

from __future__ import annotations

import contextvars
import logging
import operator
from fractions import Fraction
from typing import Any

import torch
import torch.fx as fx

from ..apply.redistribute import REDISTRIBUTE_KEY

__all__ = [
    "ATTENTION_NAMES",
    "FILLS",
    "MESH_SIZES",
    "PER_CHUNK",
    "REDUCED",
    "ChunkRefused",
    "UnknownSplitDim",
    "acts_along",
    "fake_mode_of",
    "fake_val",
    "group_split",
    "merge_factor",
    "probe_op",
    "propagate_split_dims",
    "rows_of_chunk",
    "stamp_like",
]

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

ATTENTION_NAMES = ("scaled_dot_product", "flash_attention", "efficient_attention", "flex_attention", "cudnn_attention")
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
MESH_SIZES: contextvars.ContextVar[frozenset] = contextvars.ContextVar("chunk_mesh_sizes", default=frozenset())
_NEW_FACTORIES = {_aten.new_zeros.default, _aten.new_empty.default, _aten.new_ones.default, _aten.new_full.default}
_SIZE_ARG_NAMES = {"size", "sizes", "input_sizes", "shape", "stride"}


class ChunkRefused(Exception):
    """A region cannot be chunked without changing the math; says why."""


class UnknownSplitDim(Exception):
    """The split dim of a value cannot be told."""


# ---------------------------------------------------------------------------
# split-dim propagation by probing


def fake_val(n: Any):
    """The fake value in ``n.meta`` (None for a non-node or a node without one)."""
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def fake_mode_of(vals):
    """The fake mode of the first fake tensor among ``vals`` (None when there is none)."""
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
    dims or split off ``d``'s outer part. Raises :class:`UnknownSplitDim`.

    ``mesh_sizes``: the reshape is a redistribution's ``[group, per-rank]``
    split of ``d`` (apply's layout change): the group factor is the mesh's
    and stays (the outer factor: a Shard's ranks hold contiguous blocks),
    the per-rank factor halves, as redistributing each eager chunk would
    do; refused when the per-rank factor is odd."""
    outer = 1
    for s in in_shape[:d]:
        outer *= s
    size = in_shape[d]
    if mesh_sizes and len(out_shape) == len(in_shape) + 1:
        prefix = 1
        for j, s in enumerate(out_shape[:-1]):
            if prefix == outer and s * out_shape[j + 1] == size:
                # a Shard's ranks hold contiguous blocks: the group is the outer factor
                group, per = s, out_shape[j + 1]
                if group in mesh_sizes and per % 2 == 0:
                    return j + 1
                if group in mesh_sizes:
                    raise UnknownSplitDim(
                        f"redistribution reshape {tuple(in_shape)} -> {tuple(out_shape)}: "
                        f"{per} row(s) per rank of the mesh group of {group} do not halve"
                    )
                break
            prefix *= s
    if mesh_sizes and len(out_shape) == len(in_shape) - 1 and d >= 1 and in_shape[d - 1] in mesh_sizes:
        # the inverse: a gathered [group, per-rank] pair merged back; each
        # chunk's rows then interleave with the group's (see merge_factor)
        j = d - 1
        if list(out_shape[:j]) == list(in_shape[:j]) and out_shape[j] == in_shape[j] * size:
            return j
    prefix = 1
    for j, s in enumerate(out_shape):
        if prefix == outer and s != 1 and s % 2 == 0 and (s % size == 0 or size % s == 0):
            return j
        prefix *= s
        if prefix > outer:
            break
    raise UnknownSplitDim(f"reshape {tuple(in_shape)} -> {tuple(out_shape)} mixes split dim {d} with outer dims")


_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default}


def merge_factor(node: fx.Node, in_dim: int, out_dim, mesh_sizes: frozenset) -> Fraction:
    """How ``node`` changes the grouping of a chunk's rows along the split
    dim relative to the whole value's (see :func:`rows_of_chunk`): times
    ``g`` where it merges the split dim with a mesh group of ``g`` ranks (an
    all-gather along it, or a redistribution's ``[group, per-rank]`` merge:
    a chunk's rows then run rank by rank, interleaved with the other
    chunk's), divided by ``g`` where it splits one off (a reduce-scatter
    along it, a ``[group, per-rank]`` split), 1 otherwise. Inside a region
    any grouping works row by row as long as the values an op combines
    share it; a value leaving the region with grouping ``G > 1`` is
    rebuilt rank by rank."""
    t = node.target
    if not isinstance(out_dim, int):
        return Fraction(1)
    if t is _c10d.all_gather_into_tensor.default and in_dim == 0:
        return Fraction(node.args[1])
    if t is _c10d.reduce_scatter_tensor.default and in_dim == 0:
        return Fraction(1, node.args[2])
    if t in _VIEWS and REDISTRIBUTE_KEY in node.meta and mesh_sizes:
        in_shape, out_shape = list(fake_val(node.args[0]).shape), list(fake_val(node).shape)
        if (
            len(out_shape) == len(in_shape) - 1
            and out_dim == in_dim - 1
            and in_shape[in_dim - 1] in mesh_sizes
            and out_shape[out_dim] == in_shape[in_dim - 1] * in_shape[in_dim]
        ):
            return Fraction(in_shape[in_dim - 1])
        if (
            len(out_shape) == len(in_shape) + 1
            and out_dim == in_dim + 1
            and out_shape[in_dim] in mesh_sizes
            and out_shape[in_dim] * out_shape[out_dim] == in_shape[in_dim]
        ):
            return Fraction(1, out_shape[in_dim])
    return Fraction(1)


def rows_of_chunk(size: int, groups: int, chunk: int) -> list[int]:
    """The rows (indices along the split dim, of ``size``) that chunk
    ``chunk`` (0 or 1) holds of a value with grouping ``groups``: the dim
    viewed as ``[groups, size // groups]``, each chunk the first or second
    half of every group. ``groups == 1``: the contiguous halves.

    >>> rows_of_chunk(8, 2, 0)
    [0, 1, 4, 5]
    """
    per = size // groups
    return [g * per + chunk * (per // 2) + i for g in range(groups) for i in range(per // 2)]


def group_split(node: fx.Node, d: int, groups: Fraction, mesh_sizes: frozenset) -> bool:
    """Whether ``node`` splits a value gathered along split dim ``d``
    (``groups`` > 1, see :func:`merge_factor`) back into its ranks' parts,
    inside a redistribution (a gather along another dim: all-gather on dim
    0, split into the ranks' parts, concatenated along the gather dim).
    Each chunk splits its own gathered rows the same way."""
    if node.target is not _aten.split.Tensor or REDISTRIBUTE_KEY not in node.meta or groups <= 1:
        return False
    v = fake_val(node.args[0])
    dim = _normalize(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), v.dim())
    size = node.args[1]
    return dim == d and v.shape[d] % size == 0 and v.shape[d] // size in mesh_sizes and size % 2 == 0


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
            raise UnknownSplitDim(f"{node.name}: sizes of a view of a value without the split dim")
        in_shape = fake_val(src).shape
        out_shape = list(node.args[1])
        if any(not isinstance(s, int) or s < 0 for s in out_shape):
            # an inferred size (-1): the traced output's shape names it
            out_shape = list(fake_val(node).shape)
        chain = REDISTRIBUTE_KEY in node.meta
        j = _view_dim(list(in_shape), d, out_shape, MESH_SIZES.get() if chain else frozenset())
        return (src, _halve(out_shape, j)), dict(node.kwargs), j
    if t is _aten.split.Tensor and REDISTRIBUTE_KEY in node.meta and d is not None:
        dim = _normalize(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), fake_val(src).dim())
        if dim == d:  # a gathered value split back into its ranks' parts (see group_split)
            return (src, node.args[1] // 2, *node.args[2:]), dict(node.kwargs), None
    if t is _aten.expand.default:
        if d is None:
            raise UnknownSplitDim(f"{node.name}: expand of a value without the split dim")
        sizes = list(node.args[1])
        j = d + len(sizes) - fake_val(src).dim()
        return (src, _halve(sizes, j), *node.args[2:]), dict(node.kwargs), j
    if t is _aten.slice_backward.default or t is _aten.select_backward.default:
        sizes = list(node.args[1])
        if d is None:
            raise UnknownSplitDim(f"{node.name}: {t} of a value without the split dim")
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
        if d is None or len(sizes) != fake_val(src).dim() or sizes[d] != fake_val(src).shape[d]:
            raise UnknownSplitDim(f"{node.name}: {t} of sizes {sizes} does not line up with the split dim")
        return (src, _halve(sizes, d), *node.args[2:]), dict(node.kwargs), d
    schema = getattr(t, "_schema", None)
    if schema is not None:
        for a in schema.arguments:
            if a.name in _SIZE_ARG_NAMES and "List" in str(a.type):
                raise UnknownSplitDim(f"{node.name}: {t} has size arguments this pass cannot rewrite")
    return None


def _whole_slice(node: fx.Node) -> bool:
    """``slice(x, dim, 0, end >= size, 1)``: keeps all of ``x``."""
    args = list(node.args) + [None] * (5 - len(node.args))
    x, dim, start, end, step = args[:5]
    v = fake_val(x)
    if not isinstance(v, torch.Tensor):
        return False
    size = v.shape[_normalize(dim or 0, v.dim())]
    return (start in (None, 0)) and (end is None or end >= size) and (step in (None, 1))


def acts_along(node: fx.Node, d: int, rank: int) -> bool:
    """Whether ``node`` has a ``dim`` argument naming split dim ``d``."""
    if node.target in _DIM_FREE or node.target is operator.getitem:
        return False
    if node.target is _aten.slice.Tensor and _whole_slice(node):
        return False  # a no-op slice (padding removal after a gather): the chunk's is too
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    for k, a in enumerate(schema.arguments):
        if a.name not in ("dim", "dims"):
            continue
        v = (
            node.args[k]
            if k < len(node.args)
            else node.kwargs.get(a.name, a.default_value if a.has_default_value() else None)
        )
        if v is None:
            # dim=None reductions (sum of everything) reduce the split dim
            return "sum" not in str(node.target) and "Optional" in str(a.type)
        vs = v if isinstance(v, (list, tuple)) else [v]
        if any(isinstance(x, int) and _normalize(x, rank) == d for x in vs):
            return True
    return False


REDUCED = "reduced"  # depends on the split values, carries no split dim
# Depends on one chunk's values, carries no split dim and cannot be rebuilt
# from the two chunks' values (MoE routing: slots sorted by expert, rows
# exchanged with other ranks): it must stay inside its region, where each
# chunk computes its own.
PER_CHUNK = "per_chunk"

# Data movement that keeps a per-chunk value per-chunk.
_PER_CHUNK_MOVES = {
    torch.ops._c10d_functional.wait_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
}


def _per_chunk_rules() -> dict:
    """op -> what each output is when the op runs on one chunk: PER_CHUNK,
    REDUCED (a sum over the chunk's tokens) or ("like", k): the split dim of
    argument k. The all-to-all MoE phases (:mod:`autoparallel.apply.moe_a2a_phases`)
    are per token: each chunk routes, exchanges and combines its own tokens."""
    ops = torch.ops.autoparallel
    if not hasattr(ops, "moe_a2a_route"):
        return {}
    return {
        ops.moe_a2a_route.default: (PER_CHUNK, PER_CHUNK),
        ops.moe_a2a_gather_rows.default: PER_CHUNK,
        ops.moe_a2a_gather_grad_rows.default: PER_CHUNK,
        ops.moe_a2a_exchange.default: PER_CHUNK,
        ops.moe_a2a_expert_rows.default: PER_CHUNK,
        ops.moe_a2a_expert_rows_backward.default: (PER_CHUNK, REDUCED, REDUCED, REDUCED),
        ops.moe_a2a_combine.default: ("like", 2),
        ops.moe_a2a_combine_backward.default: (("like", 1), ("like", 3)),
    }


_RULES: dict = {}


def _rule_of(node: fx.Node, dims: dict):
    """The per-chunk rule of ``node`` (see :func:`_per_chunk_rules`), or None
    for ops probed by shape; raises ChunkRefused for an op that reads a
    per-chunk value without a rule."""
    if not _RULES:
        _RULES.update(_per_chunk_rules())
    rule = _RULES.get(node.target)
    if rule is not None:
        return rule
    if any(dims.get(a) == PER_CHUNK for a in node.all_input_nodes):
        if node.target in _PER_CHUNK_MOVES:
            return PER_CHUNK
        if node.target is operator.getitem:
            return None
        raise ChunkRefused(
            f"{node.name} ({node.target}) reads a per-chunk value (MoE routing or exchanged rows) and "
            "no rule says how its result would combine across chunks"
        )
    return None


def _rule_states(node: fx.Node, rule, dims: dict, out, full):
    def one(spec, full_v, half_v):
        if spec in (PER_CHUNK, REDUCED):
            return spec
        _, k = spec
        d = dims.get(node.args[k])
        if not isinstance(d, int) or full_v.shape[d] != 2 * half_v.shape[d]:
            raise UnknownSplitDim(f"{node.name}: argument {k} carries no split dim its result could follow")
        return d

    if isinstance(full, (tuple, list)):  # a multi-output op: one spec per output
        return [one(r, f, h) for r, f, h in zip(rule, full, out)]
    return one(rule, full, out)


FILLS = {
    _aten.new_zeros.default,
    _aten.new_ones.default,
    _aten.new_full.default,
    _aten.zeros.default,
    _aten.ones.default,
    _aten.full.default,
    _aten.zeros_like.default,
    _aten.ones_like.default,
    _aten.full_like.default,
    _aten.scalar_tensor.default,
}
_FILL_MOVES = {
    _aten.index_select.default,
    _aten.slice.Tensor,
    _aten.select.int,
    _aten.clone.default,
    _aten._to_copy.default,
    _aten.split.Tensor,
    _aten.contiguous.default,
    operator.getitem,
}


def is_fill(node: fx.Node, memo: dict | None = None) -> bool:
    """Whether ``node`` is a constant fill (zeros, ones, full), or a view,
    slice or index of one: every part of it holds the same value, so a
    chunk may read any half of it (a gradient's zeros, computed whole
    and then cut to this rank's piece)."""
    if node.op != "call_function":
        return False
    memo = {} if memo is None else memo
    hit = memo.get(node)
    if hit is None:
        t = node.target
        if t in FILLS:
            hit = True
        elif t in _FILL_MOVES or (isinstance(t, torch._ops.OpOverload) and t.is_view):
            first = node.args[0] if node.args else None
            hit = isinstance(first, fx.Node) and is_fill(first, memo)
        else:
            hit = False
        memo[node] = hit
    return hit


# Arguments that broadcast against the query's [batch, heads, query, key]
# dims (right-aligned): an attention mask or bias built outside the layer.
_BROADCAST_ARGS = ("attn_mask", "attn_bias")


def _broadcast_against(node: fx.Node) -> dict[fx.Node, fx.Node]:
    """Mask-like input -> the input it broadcasts against (``query``)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {}
    by_name = {}
    for k, a in enumerate(schema.arguments):
        v = node.args[k] if k < len(node.args) and not a.kwarg_only else node.kwargs.get(a.name)
        if isinstance(v, fx.Node):
            by_name[a.name] = v
    query = by_name.get("query")
    if query is None:
        return {}
    return {by_name[n]: query for n in _BROADCAST_ARGS if n in by_name}


def _full_size_partners(node: fx.Node, dims: dict[fx.Node, Any]) -> dict[fx.Node, int]:
    """Inputs of ``node`` that carry no split dim but line up with one at its
    full size, so each chunk must read its own part: of a pointwise op, by
    broadcasting (a gradient expanded from a scalar, a bias or position
    table built outside the region); of attention, a mask or bias against
    the query; of any op, a constant fill of the same rank (:func:`is_fill`).
    Broadcasting fixes what a dim means: a dim that lines up with the split
    dim at its full size holds one entry per row of it, whatever its size
    happens to equal elsewhere. Input -> its dim that lines up."""
    t = node.target
    pointwise = isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags
    split = [(a, dims[a]) for a in node.all_input_nodes if isinstance(dims.get(a), int)]
    masks = _broadcast_against(node)
    out = {}
    for a in node.all_input_nodes:
        v = fake_val(a)
        if isinstance(dims.get(a), int) or not isinstance(v, torch.Tensor):
            continue
        if a in masks:
            q = masks[a]
            d = dims.get(q)
            if isinstance(d, int):
                i = d - fake_val(q).dim() + v.dim()
                if 0 <= i < v.dim() and v.shape[i] == fake_val(q).shape[d] and v.shape[i] != 1:
                    out[a] = i
            continue
        fill = not pointwise and is_fill(a)
        if not (pointwise or fill):
            continue
        for c, d in split:
            cv = fake_val(c)
            if fill and v.dim() != cv.dim():
                continue
            i = d - cv.dim() + v.dim()
            if 0 <= i < v.dim() and v.shape[i] == cv.shape[d] and v.shape[i] != 1:
                out[a] = i
    return out


def probe_op(
    node: fx.Node, dims: dict[fx.Node, Any], half_vals: dict[fx.Node, Any], implicit: bool = False, partners=None
):
    """(chunk value(s), state(s), (args, kwargs)) of ``node`` run on the
    halves: the fake output(s) for one chunk, per output its split dim or
    REDUCED, and the arguments with chunk sizes. Full-size partners
    (:func:`_full_size_partners`) are halved too; ``partners`` collects
    them (input -> the dim each chunk reads its part of); without it they
    are refused unless ``implicit`` (naming dims only)."""
    if node.target is operator.getitem and isinstance(dims.get(node.args[0]), tuple):
        out = half_vals[node.args[0]][node.args[1]]
        return out, dims[node.args[0]][node.args[1]], (node.args, node.kwargs)
    rule = _rule_of(node, dims)
    if rule is not None:
        vals = fx.node.map_aggregate(
            node.args, lambda a: half_vals.get(a, fake_val(a)) if isinstance(a, fx.Node) else a
        )
        mode = fake_mode_of([fake_val(a) for a in node.all_input_nodes])
        with mode, _quiet_fake_tensor():
            out = node.target(*vals, **node.kwargs)
        return out, _rule_states(node, rule, dims, out, fake_val(node)), (node.args, node.kwargs)
    sized = _size_args(node, dims)
    if sized is not None:
        args, kwargs, j = sized
    else:
        args, kwargs, j = node.args, node.kwargs, None
    found = _full_size_partners(node, dims)
    if not implicit:
        if partners is None and found:
            a = next(iter(found))
            raise ChunkRefused(f"{node.name} ({node.target}) reads {a.name}, which is full size along the split dim")
        if partners is not None:
            partners.update(found)
    half_vals = dict(half_vals) if found else half_vals
    for a, i in found.items():
        half_vals[a] = fake_val(a).narrow(i, 0, fake_val(a).shape[i] // 2)

    def val(a):
        if isinstance(a, fx.Node):
            return half_vals[a] if a in half_vals else fake_val(a)
        return a

    a_vals = fx.node.map_aggregate(args, val)
    k_vals = fx.node.map_aggregate(kwargs, val)
    if node.target is operator.getitem:
        out = a_vals[0][a_vals[1]]
    else:
        mode = fake_mode_of([fake_val(a) for a in node.all_input_nodes])
        if mode is None:
            raise UnknownSplitDim(f"{node.name}: no fake tensors to probe with")
        try:
            with mode, _quiet_fake_tensor():
                out = node.target(*a_vals, **k_vals)
        except Exception as e:  # shapes that do not fit: the split does not go through
            raise UnknownSplitDim(
                f"{node.name} ({node.target}) fails on the halves: {type(e).__name__}: {str(e)[:160]}"
            )
    full = fake_val(node)

    def state(full_v, half_v):
        if not isinstance(full_v, torch.Tensor):
            if isinstance(half_v, torch.Tensor) or full_v != half_v:
                raise UnknownSplitDim(f"{node.name}: a non-tensor output changes with the split")
            return None
        if full_v.dim() != half_v.dim():
            raise UnknownSplitDim(f"{node.name}: rank changes with the split")
        changed = [i for i, (a, b) in enumerate(zip(full_v.shape, half_v.shape)) if a != b]
        if not changed:
            return REDUCED
        if len(changed) > 1 or full_v.shape[changed[0]] != 2 * half_v.shape[changed[0]]:
            raise UnknownSplitDim(
                f"{node.name}: split is ambiguous (shape {tuple(full_v.shape)} -> {tuple(half_v.shape)})"
            )
        if j is not None and changed[0] != j:
            raise UnknownSplitDim(f"{node.name}: sizes rewritten on dim {j} but dim {changed[0]} changed")
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


def stamp_like(new: fx.Node, like: fx.Node, tag) -> None:
    """Fold stamp (:mod:`autoparallel.apply.unfold`) for a node a pass made
    (chunk_regions, split_moe_a2a), keyed on ``like``'s so that twins in
    other layers share it."""
    from ..apply.unfold import FOLD_KEY

    t = like.meta.get(FOLD_KEY)
    if t is not None:
        new.meta[FOLD_KEY] = (t[0], (tag, t[1]))
    elif FOLD_KEY in new.meta:
        del new.meta[FOLD_KEY]


def _input_dims(node: fx.Node, dims: dict) -> list[int]:
    return [dims[a] for a in node.all_input_nodes if isinstance(dims.get(a), int)]


def propagate_split_dims(
    gm: fx.GraphModule, seeds: dict[fx.Node, int], why: dict[fx.Node, str] | None = None
) -> dict[fx.Node, Any]:
    """Split dim of every graph value reachable from ``seeds`` (placeholder
    -> dim): an int, REDUCED, or None where it cannot be told (the reason in
    ``why``, value -> where the split dim was lost, and in the log at debug
    level). Values not reachable are absent."""
    why = {} if why is None else why
    dims: dict[fx.Node, Any] = dict(seeds)
    half: dict[fx.Node, Any] = {}
    for p, d in seeds.items():
        v = fake_val(p)
        half[p] = v.narrow(d, 0, v.shape[d] // 2)
    chains = _redistribution_chains(gm)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        ins = n.all_input_nodes
        if not any(a in dims for a in ins) or n.target in FILLS:
            continue  # a fill reads its input for the dtype only
        chain = chains.get(n)
        if chain is not None:
            # a layout change: the local value keeps its dims' meaning (a
            # DTensor shard), whatever slicing or gathering it takes
            src = [a for a in chain[0] if isinstance(dims.get(a), int)]
            v, out_v = fake_val(src[0]) if len(src) == 1 else None, fake_val(n)
            if n in chain[1] and v is not None and isinstance(out_v, torch.Tensor) and out_v.dim() == v.dim():
                d = dims[src[0]]
                if out_v.shape[d] % 2 == 0:
                    dims[n] = d
                    half[n] = out_v.narrow(d, 0, out_v.shape[d] // 2)
                    continue
                why[n] = (
                    f"a layout change ({n.name}) leaves size {out_v.shape[d]} per rank on the split dim {d}, "
                    "which does not halve (split more rows per rank)"
                )
            dims[n] = None
            continue
        if n.target is operator.getitem and isinstance(dims.get(n.args[0]), tuple):
            dims[n] = dims[n.args[0]][n.args[1]]
            half[n] = half[n.args[0]][n.args[1]]
            continue
        if not _input_dims(n, dims) and not any(dims.get(a) == PER_CHUNK for a in ins):
            # only reduced (shared from here) or unknown inputs
            lost = [a for a in ins if a in dims and dims[a] is None]
            dims[n] = None if lost else REDUCED
            if lost and lost[0] in why:
                why[n] = why[lost[0]]
            continue
        # unknown inputs are read whole, as shared values: this only names
        # the dims; a region's own walk checks that its split is exact
        try:
            out, st, _ = probe_op(n, dims, half, implicit=True)
        except (UnknownSplitDim, ChunkRefused) as e:
            logger.debug("split dim lost: %s", e)
            dims[n] = None
            why[n] = str(e)
            continue
        half[n] = out
        dims[n] = tuple(st) if isinstance(st, list) else st
    return dims
