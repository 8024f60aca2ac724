"""Stage 2: placement options for every node of the joint graph.

An :class:`Option` of a node is one DTensor sharding of the op: the specs its
tensor inputs must have and the spec(s) of its output. Options come from
PyTorch's own DTensor sharding propagation (strategy functions, single-mesh-dim
strategies expanded over the mesh, decomposition-based strategies), called
with every candidate placement of every input at once. Rules DTensor lacks,
or that a user wants to override, go in :data:`RULES` via
:func:`register_rule`. Ops without any rule, or whose DTensor rule raises,
fall back to replicate-only (every input gathered, the op run in full on
every rank: correct for any deterministic op), with one warning listing
them, why, and their module paths.

Options that shard a tensor dim unevenly, or use ``_StridedShard``, are
dropped at planning time so that planning and apply always agree. One
exception: a parameter on a 2-D mesh may also be sharded on one tensor dim
over both mesh dims tp-outer (``_StridedShard(d, tp), Shard(d)``, FSDP2 +
TP's layout, :func:`~autoparallel.cost_model.tp_outer_placements`), where
gathering it over dp is one all-gather that leaves the tp shard. Only the
placeholder offers it; every consumer takes a plain layout, reached through
a redistribution on the edge.
"""

from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpSpec,
    OpStrategy,
    TupleStrategy,
)
from torch.distributed.tensor.placement_types import Replicate

from .dtensor_query import _build_schema, _propagator, _dtensor_strategy, _out_meta, _without_dtensor_redistribute_costs
from .fast_expand import ExpandedStrategy, even_key, fast_expansion, new_spec, placements_of_numbers

# the placement helpers moved to .placements; imported from here by rules and users
from .placements import (  # noqa: F401
    Specs,
    all_placements,
    format_specs,
    is_evenly_sharded,
    option_label,
    placements_of,
    tensor_meta_of,
    tp_outer_placements,
)

logger = logging.getLogger(__name__)


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
            raise TypeError("multi-output option has no single output spec")
        return self.output_specs


@dataclass
class NodeStrategy:
    node: torch.fx.Node
    inputs: list[torch.fx.Node]
    options: list[Option]
    # How the options were obtained: "dtensor", "rule", "placeholder",
    # "factory", "getitem", "fallback".
    source: str = "dtensor"
    # For getitem nodes: which element of the parent's output tuple. The
    # parent is then ``inputs[0]`` and options carry no input specs.
    getitem_index: int | None = None


RuleFn = Callable[[torch.fx.Node, list[list[DTensorSpec]], DeviceMesh], list[Option]]
RULES: dict[Any, RuleFn] = {}


def register_rule(*ops: Any) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn(node, input_candidates, mesh) -> list[Option]`` for ``ops``.

    ``input_candidates[k]`` lists the distinct specs the node's k-th tensor
    input may arrive with. A registered rule takes precedence over DTensor's.
    """

    def wrap(fn: RuleFn) -> RuleFn:
        for op in ops:
            RULES[op] = fn
        return fn

    return wrap


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The node's tensor-valued inputs, flattened in argument order (dups kept)."""
    nodes: list[torch.fx.Node] = []
    _collect_nodes(node.args, nodes)
    _collect_nodes(node.kwargs, nodes)
    return [a for a in nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _collect_nodes(a, out: list) -> None:
    """The fx Nodes in FX arguments, in pytree leaf order (tuples, lists
    and dicts in insertion order: all FX arguments hold); ~4x faster than
    ``tree_leaves`` (tens of thousands of nodes on an 80-layer graph)."""
    if isinstance(a, torch.fx.Node):
        out.append(a)
    elif isinstance(a, (tuple, list)):
        for x in a:
            _collect_nodes(x, out)
    elif isinstance(a, dict):
        for x in a.values():
            _collect_nodes(x, out)


def _spec(mesh: DeviceMesh, placements, meta: TensorMeta) -> DTensorSpec:
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


def placeholder_options(val: torch.Tensor, mesh: DeviceMesh, *, parameter: bool = False) -> list[Option]:
    """Every even layout of a graph input; a ``parameter`` also gets the
    tp-outer layouts of :func:`tp_outer_placements` (after the others)."""
    meta = tensor_meta_of(val)
    placements = all_placements(val.shape, mesh)
    if parameter:
        placements += tp_outer_placements(val.shape, mesh)
    return [Option(_spec(mesh, p, meta), ()) for p in placements]


class SpecPool:
    """One DTensorSpec object per (placements, tensor meta).

    Building a DTensorSpec costs ~20 us (shard-order bookkeeping) and the
    options of one op repeat a handful of input specs hundreds of times;
    shared objects also make the cost model's spec-keyed caches hit on
    identity.
    """

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self._specs: dict[tuple, DTensorSpec] = {}
        self._even: dict[tuple, bool] = {}
        # (shape, even_key(placement numbers)) -> evenly sharded
        self._even_numbered: dict[tuple, bool] = {}
        # meta -> numbers -> spec (None: uneven)
        self._numbered: dict[TensorMeta, dict[tuple, DTensorSpec | None]] = {}

    def get(self, placements: tuple, meta: TensorMeta | None) -> DTensorSpec:
        key = (placements, meta)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = new_spec(self.mesh, tuple(placements), meta)
        return spec

    def evenly_sharded(self, shape, placements: tuple) -> bool:
        """:func:`is_evenly_sharded` on this mesh, memoised."""
        key = (shape, placements)
        even = self._even.get(key)
        if even is None:
            even = self._even[key] = is_evenly_sharded(shape, placements, self.mesh)
        return even

    def get_even(self, numbers: tuple[int, ...], meta: TensorMeta) -> DTensorSpec | None:
        """The spec of placements given by their numbers (see
        :func:`~autoparallel.fast_expand.placements_of_numbers`) with
        ``meta``, or None if they shard ``meta``'s shape unevenly; memoised on
        the numbers (int tuples hash much faster than placements)."""
        return self.even_specs([numbers], meta)[0]

    def even_specs(self, numbers_list, meta: TensorMeta) -> list[DTensorSpec | None]:
        """:meth:`get_even` of each numbers in ``numbers_list`` (None stays
        None), the meta hashed once for all."""
        memo = self._numbered.get(meta)
        if memo is None:
            memo = self._numbered[meta] = {}
        out = []
        for numbers in numbers_list:
            if numbers is None:
                out.append(None)
                continue
            hit = memo.get(numbers, self)
            if hit is self:
                even_key_ = (meta.shape, even_key(numbers))
                even = self._even_numbered.get(even_key_)
                placements = placements_of_numbers(numbers)
                if even is None:
                    even = self._even_numbered[even_key_] = is_evenly_sharded(meta.shape, placements, self.mesh)
                hit = memo[numbers] = self.get(placements, meta) if even else None
            out.append(hit)
        return out


def _for_each_output(out, meta):
    """DTensor gives one spec for every output of some multi-output ops
    (``linalg_qr``, ``_linalg_svd``: all replicated): one per output then."""
    # (TensorMeta is a NamedTuple: test for it first)
    if isinstance(out, DTensorSpec) and not isinstance(meta, TensorMeta) and isinstance(meta, (tuple, list)):
        return tuple(out if isinstance(m, TensorMeta) else None for m in meta)
    return out


def _same_structure(out, meta) -> bool:
    """``out`` (specs) has one spec per tensor output of the node."""
    if isinstance(meta, TensorMeta):
        return isinstance(out, DTensorSpec)
    if isinstance(meta, (tuple, list)):
        return isinstance(out, (tuple, list)) and len(out) == len(meta) and all(
            o is None or _same_structure(o, m) for o, m in zip(out, meta) if m is not None
        )
    return True


def _out_placements_ok(out, meta, mesh: DeviceMesh) -> bool:
    if isinstance(out, DTensorSpec):
        m = meta if isinstance(meta, TensorMeta) else out.tensor_meta
        return not isinstance(m, TensorMeta) or is_evenly_sharded(m.shape, out.placements, mesh)
    if isinstance(out, (tuple, list)):
        metas = meta if isinstance(meta, (tuple, list)) else [None] * len(out)
        return all(_out_placements_ok(o, m, mesh) for o, m in zip(out, metas))
    return True


def _pooled_out(out, meta, pool: SpecPool) -> Specs:
    """Output spec(s) from the pool, with the node's own tensor metas: DTensor
    may leave them unset, and some of its view rules hand back the input's
    spec (with the input's shape) for a replicated output."""
    if isinstance(out, DTensorSpec):
        m = meta if isinstance(meta, TensorMeta) else out.tensor_meta
        return pool.get(out.placements, m if isinstance(m, TensorMeta) else None)
    if isinstance(out, (tuple, list)):
        metas = meta if isinstance(meta, (tuple, list)) else [None] * len(out)
        return tuple(_pooled_out(o, m, pool) for o, m in zip(out, metas))
    return out


def _options_from_op_strategy(
    node: torch.fx.Node,
    strategy,
    inputs: list[torch.fx.Node],
    pool: SpecPool,
) -> list[Option]:
    out_meta = _out_meta(node)
    in_metas = [tensor_meta_of(n.meta["val"]) for n in inputs]
    if isinstance(strategy, TupleStrategy):
        # Ops over lists of tensors (e.g. foreach): one child per element; we
        # only support the case where all children agree on a common option
        # index, which is how DTensor builds them for list inputs.
        raise NotImplementedError("TupleStrategy")
    if isinstance(strategy, ExpandedStrategy):
        options = _options_from_table(node, strategy, inputs, in_metas, out_meta, pool)
        if options is not None:
            return options
    convert = OpSpecConverter(node, inputs, pool, in_metas, out_meta)
    options: list[Option] = []
    seen: set = set()
    for op_spec in strategy.strategies:
        hit = convert.option(op_spec)
        if hit is None or hit[0] in seen:
            continue
        seen.add(hit[0])
        options.append(Option(hit[1], hit[2]))
    return options


class OpSpecConverter:
    """DTensor's OpSpecs of one node as :class:`Option`: pooled specs with
    the node's tensor metas, uneven layouts (and _StridedShard) filtered.

    DTensor's options share spec objects (fast_expand builds one per
    placements), so the filters and the pool run once per (position, spec
    object); the memos keep those objects alive, so ids stay unique. A
    pooled spec stands for its placements (one object per placements and
    meta): options deduplicate on the ids of their pooled specs.
    """

    def __init__(self, node: torch.fx.Node, inputs: list[torch.fx.Node], pool: SpecPool, in_metas=None, out_meta=None):
        self.node, self.inputs, self.pool = node, inputs, pool
        self.out_meta = _out_meta(node) if out_meta is None else out_meta
        self.in_metas = [tensor_meta_of(n.meta["val"]) for n in inputs] if in_metas is None else in_metas
        self._in_memo: dict[tuple[int, int], tuple] = {}
        self._out_memo: dict[int, tuple] = {}

    def _pooled_input(self, k: int, spec):
        hit = self._in_memo.get((k, id(spec)))
        if hit is None:
            p, m, pool = spec.placements, self.in_metas[k], self.pool
            hit = self._in_memo[(k, id(spec))] = (pool.get(p, m) if pool.evenly_sharded(m.shape, p) else None, spec)
        return hit[0]

    def option(self, op_spec: OpSpec) -> tuple[tuple, Specs, tuple[DTensorSpec, ...]] | None:
        """(dedup key, output spec(s), input specs) of the option of
        ``op_spec``; None where it is filtered."""
        raw_out = op_spec.output_specs
        out_hit = self._out_memo.get(id(raw_out))
        if out_hit is None:
            out_meta = self.out_meta
            out = _for_each_output(raw_out, out_meta)
            if not _same_structure(out, out_meta):
                raise ValueError(
                    f"DTensor's strategy for {self.node.target} gives output specs {format_specs(out)} "
                    f"for a node with outputs {out_meta}"
                )
            pooled = _pooled_out(out, out_meta, self.pool) if _out_placements_ok(out, out_meta, self.pool.mesh) else None
            # multi-output: a new tuple per strategy, keyed by its placements
            out_key = id(pooled) if isinstance(pooled, DTensorSpec) else placements_of(out)
            out_hit = self._out_memo[id(raw_out)] = (pooled, out_key, raw_out)
        pooled_out, out_key = out_hit[0], out_hit[1]
        n_inputs = len(self.in_metas)
        if op_spec.input_specs is None:
            in_specs = tuple(self._pooled_input(k, op_spec.output_spec) for k in range(n_inputs))
        else:
            if len(op_spec.input_specs) != len(self.inputs):
                return None
            in_specs = tuple(self._pooled_input(k, s) for k, s in enumerate(op_spec.input_specs))
        # filtered: not evenly sharded (or a _StridedShard)
        if pooled_out is None or any(s is None for s in in_specs):
            return None
        return (out_key, *map(id, in_specs)), pooled_out, in_specs


def _options_from_table(node, strategy: ExpandedStrategy, inputs, in_metas, out_meta, pool: SpecPool) -> list[Option] | None:
    """What the loop of :func:`_options_from_op_strategy` makes of an
    :class:`ExpandedStrategy`, worked out once per distinct entry (and output
    combination) instead of once per OpSpec: each kept combination becomes a
    row of codes (its output's, then each input's pooled spec; -1 where
    filtered), and the options are the first occurrences of the rows without
    -1, in table order. None when positions are None in some rows only (the
    loop handles those)."""
    table = strategy.table
    if not len(table):
        return []
    n_out = strategy.input_index
    none = table[0] < 0
    if (table[:, none] >= 0).any() or (table[:, ~none] < 0).any():
        return None
    in_cols = [p for p in range(n_out, table.shape[1]) if not none[p]]
    if len(in_cols) != len(inputs):
        return []  # the loop skips every OpSpec
    # outputs: one code per distinct output combination (equal out keys, one code)
    if n_out == 1 and isinstance(out_meta, TensorMeta):
        # one spec, with the node's meta: pooled by placement numbers
        out_code, out_pooled = _numbered_distinct(map(_by_id, pool.even_specs(strategy.numbers_at[0], out_meta)))
        codes = [np.array(out_code + [-1], dtype=np.int64)[table[:, 0]]]
    else:
        if n_out == 1:
            out_rows, out_inverse = np.unique(table[:, 0], return_inverse=True)
            out_rows = out_rows[:, None]
        else:
            out_rows, out_inverse = np.unique(table[:, :n_out], axis=0, return_inverse=True)
        outs = []
        for row in out_rows.tolist():
            specs = [strategy.spec_at(p, e) for p, e in enumerate(row)]
            out = _for_each_output(specs[0] if n_out == 1 else tuple(specs), out_meta)
            if not _same_structure(out, out_meta):
                raise ValueError(
                    f"DTensor's strategy for {node.target} gives output specs {format_specs(out)} "
                    f"for a node with outputs {out_meta}"
                )
            if not _out_placements_ok(out, out_meta, pool.mesh):
                outs.append(None)
                continue
            pooled = _pooled_out(out, out_meta, pool)
            outs.append((id(pooled) if isinstance(pooled, DTensorSpec) else placements_of(out), pooled))
        out_code, out_pooled = _numbered_distinct(outs)
        codes = [np.array(out_code, dtype=np.int64)[out_inverse.reshape(-1)]]
    in_pooled: list[list[DTensorSpec]] = []
    for k, p in enumerate(in_cols):
        m = in_metas[k]
        entry_code, pooled_list = _numbered_distinct(
            map(_by_id, pool.even_specs(strategy.numbers_at[p], m))
        )
        codes.append(np.array(entry_code + [-1], dtype=np.int64)[table[:, p]])
        in_pooled.append(pooled_list)
    rows = np.stack(codes, axis=1)
    rows = rows[(rows >= 0).all(axis=1)]
    if not len(rows):
        return []
    _, first = np.unique(rows, axis=0, return_index=True)
    rows = rows[np.sort(first)].tolist()
    return [Option(out_pooled[r[0]], tuple(in_pooled[k][c] for k, c in enumerate(r[1:]))) for r in rows]


def _by_id(spec):
    return None if spec is None else (id(spec), spec)


def _numbered_distinct(items) -> tuple[list[int], list]:
    """``items``: (key, value) or None each. Per item, the index of the
    first value with its key among the distinct values (-1 for None), and
    the distinct values."""
    index: dict = {}
    values: list = []
    codes: list[int] = []
    for item in items:
        if item is None:
            codes.append(-1)
            continue
        code = index.get(item[0])
        if code is None:
            code = index[item[0]] = len(values)
            values.append(item[1])
        codes.append(code)
    return codes, values


def replicate_options(node: torch.fx.Node, inputs: list[torch.fx.Node], mesh: DeviceMesh) -> list[Option]:
    rep = tuple(Replicate() for _ in range(mesh.ndim))
    out_meta = _out_meta(node)

    def out(meta):
        if isinstance(meta, TensorMeta):
            return DTensorSpec(mesh, rep, tensor_meta=meta)
        if isinstance(meta, tuple):
            return tuple(out(m) for m in meta)
        return None

    ins = tuple(_spec(mesh, rep, tensor_meta_of(n.meta["val"])) for n in inputs)
    return [Option(out(out_meta), ins)]


# --------------------------------------------------------------------------
# Rules DTensor does not have (or that the graph needs differently).


# --------------------------------------------------------------------------


@dataclass
class StrategyStats:
    nodes: int = 0
    options: int = 0
    # Option lists actually computed (DTensor, rules, fallback); every other
    # node reuses one of them.
    computed: int = 0
    cache_hits: int = 0
    # Nodes run replicate-only for want of a usable rule: op -> count, and
    # op -> (why, module paths of its nodes).
    fallback_ops: dict[str, int] = field(default_factory=dict)
    fallback_nodes: dict[str, tuple[str, list[str]]] = field(default_factory=dict)

    def fallback_warning(self) -> str:
        """One message naming every replicate-only op, why, and where."""
        parts = []
        for op, count in sorted(self.fallback_ops.items()):
            why, paths = self.fallback_nodes[op]
            where = sorted(set(paths))
            shown = ", ".join(where[:6]) + (f" and {len(where) - 6} more" if len(where) > 6 else "")
            parts.append(f"{op} x{count} ({why}) in {shown}")
        return (
            f"{len(self.fallback_ops)} op(s) have no usable sharding rule and run replicated (correct, "
            f"but every rank computes them in full): " + "; ".join(parts)
            + ". Register a rule with autoparallel.strategies.register_rule."
        )


class StrategyEnumerator:
    """Computes :class:`NodeStrategy` for all nodes, caching by structure.

    Nodes of repeated layers have the same op, shapes and input candidate
    sets, so their options are computed once (the cache key is built from
    those, not from node identity).
    """

    def __init__(self, mesh: DeviceMesh, *, share: bool = True):
        """``share``: key single-mesh-dim ops on their inputs' metas (not
        their candidate sets) and convert each candidate of a view-like op
        once (:mod:`.candidate_memo`); False computes every distinct
        candidate set from scratch (the reference the tests compare with)."""
        from .candidate_memo import PerCandidateOptions

        self.mesh = mesh
        self.share = share
        self._cache: dict[Any, tuple[list[Option], str]] = {}
        self._pool = SpecPool(mesh)
        self._per_candidate = PerCandidateOptions(self._pool) if share else None
        self._interned: dict[Any, int] = {}
        # id(option list) -> (distinct output specs, their interned id, the
        # list): what a node offers its consumers, computed once per list.
        self._produced: dict[int, tuple[tuple, int, list[Option]]] = {}
        # Options of multi-output nodes, for their getitem users.
        self._multi_output_options: dict[torch.fx.Node, list[Option]] = {}
        # op -> why it fell back to replicate-only (for the warning)
        self._fallback_why: dict[str, str] = {}
        self.stats = StrategyStats()

    def _placeholder_options(self, val: torch.Tensor, parameter: bool) -> list[Option]:
        # One list per shape: the same parameter in every layer then shares
        # one option list, which is what downstream caches key on.
        key = ("placeholder", _val_key(val), parameter)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = (placeholder_options(val, self.mesh, parameter=parameter), "placeholder")
        return hit[0]

    def _offered(self, options: list[Option]) -> tuple[tuple, int]:
        """Distinct output specs of ``options`` and an id equal for equal sets."""
        hit = self._produced.get(id(options))
        if hit is None:
            specs = _dedup(o.output_specs for o in options)
            hit = (specs, self._interned.setdefault(specs, len(self._interned)), options)
            self._produced[id(options)] = hit
        return hit[0], hit[1]

    def enumerate(
        self, gm: torch.fx.GraphModule, parameters: frozenset[torch.fx.Node] | set = frozenset()
    ) -> dict[torch.fx.Node, NodeStrategy]:
        """Options of every tensor node of ``gm``; the placeholders in
        ``parameters`` also get the tp-outer layouts."""
        result: dict[torch.fx.Node, NodeStrategy] = {}
        # Distinct output specs each tensor node can produce, and their id.
        produced: dict[torch.fx.Node, tuple[tuple[DTensorSpec, ...], int]] = {}
        total, t0 = len(gm.graph.nodes), time.perf_counter()
        last = t0
        with fast_expansion():
            self._enumerate_nodes(gm, parameters, result, produced, total, t0, last)
        if self.stats.fallback_ops:
            logger.warning("%s", self.stats.fallback_warning())
        return result

    def _enumerate_nodes(self, gm, parameters, result, produced, total, t0, last) -> None:
        for node in gm.graph.nodes:
            if node.op == "output":
                continue
            if time.perf_counter() - last >= 5.0:  # progress on big meshes
                last = time.perf_counter()
                logger.info(
                    "options: %d/%d nodes, %d options, %d lists computed after %.0fs",
                    self.stats.nodes, total, self.stats.options, self.stats.computed, last - t0,
                )
            val = node.meta.get("val")
            if node.op == "placeholder":
                if not isinstance(val, torch.Tensor):
                    continue
                options = self._placeholder_options(val, node in parameters)
                result[node] = NodeStrategy(node, [], options, "placeholder")
            elif node.op == "call_function":
                if not _produces_tensors(val):
                    continue
                result[node] = self._node_strategy(node, produced)
            else:
                raise NotImplementedError(f"unsupported node kind {node.op} ({node.name})")
            self.stats.nodes += 1
            self.stats.options += len(result[node].options)
            if isinstance(val, torch.Tensor):
                produced[node] = self._offered(result[node].options)

    def _node_strategy(self, node, produced) -> NodeStrategy:
        inputs = tensor_inputs(node)
        if node.target is operator.getitem:
            # Options are the distinct specs the parent's options give this
            # element; the edge from the parent forbids mismatched pairs.
            parent, idx = node.args
            parent_options = self._multi_output_options[parent]
            key = ("getitem", id(parent_options), idx)
            hit = self._cache.get(key)
            if hit is None:
                specs = _dedup(o.output_specs[idx] for o in parent_options)
                hit = self._cache[key] = ([Option(s, ()) for s in specs], "getitem")
            return NodeStrategy(node, [parent], hit[0], "getitem", getitem_index=idx)
        candidates = [produced[n][0] for n in inputs]
        if self.share and _candidate_free(node.target):
            # DTensor sees one representative spec per input (its meta): the
            # options depend on the inputs' metas, not their candidate sets
            # (which differ between layers fed by different producers).
            inputs_key = ("metas", tuple(_val_key(n.meta["val"]) for n in inputs), tuple(map(inputs.index, inputs)))
        else:
            inputs_key = tuple(produced[n][1] for n in inputs)
        key = (
            node.target,
            _arg_key(node.args),
            _arg_key(node.kwargs),
            _val_key(node.meta.get("val")),
            inputs_key,
        )
        hit = self._cache.get(key)
        if hit is not None:
            self.stats.cache_hits += 1
            opts, source = hit
        else:
            opts, source = self._compute(node, inputs, candidates)
            self._cache[key] = (opts, source)
            self.stats.computed += 1
        if source == "fallback":
            name = str(node.target)
            self.stats.fallback_ops[name] = self.stats.fallback_ops.get(name, 0) + 1
            why, paths = self.stats.fallback_nodes.setdefault(name, (self._fallback_why.get(name, "no rule"), []))
            paths.append(_module_path(node))
        strat = NodeStrategy(node, inputs, opts, source)
        if not isinstance(node.meta.get("val"), torch.Tensor):
            self._multi_output_options[node] = opts
        return strat

    def _compute(self, node, inputs, candidates) -> tuple[list[Option], str]:
        op = node.target
        if op in RULES:
            return RULES[op](node, candidates, self.mesh), "rule"
        if not inputs:
            # Factories (zeros, full, arange, ...) may produce any layout.
            return placeholder_options(node.meta["val"], self.mesh), "factory"
        failures: list[Exception] = []
        if self._per_candidate is not None and self._per_candidate.handles(node, inputs):
            options = self._per_candidate.options(node, inputs, candidates, failures)
        else:
            options = _dtensor_options(node, inputs, candidates, self._pool, failures)
        if options:
            return options, "dtensor"
        self._fallback_why.setdefault(
            str(op), f"DTensor's rule raised {type(failures[0]).__name__}: {failures[0]}" if failures else "no rule"
        )
        return replicate_options(node, inputs, self.mesh), "fallback"


def dtensor_strategy_for(node, inputs, candidates, mesh: DeviceMesh):
    """DTensor's strategy for ``node`` given the candidate specs per input
    (None: no rule); raises whatever DTensor's strategy function raises."""
    cand_strategies: dict[torch.fx.Node, OpStrategy] = {}
    for n, c in zip(inputs, candidates):
        # A node used twice (mul(x, x)) has one strategy: the first wins.
        cand_strategies.setdefault(n, OpStrategy([OpSpec(s) for s in c]))
    schema = _build_schema(node, cand_strategies)
    with _without_dtensor_redistribute_costs():
        return _dtensor_strategy(node, schema, mesh)


def _propagate(node, inputs, candidates, pool: SpecPool) -> list[Option]:
    """Options from DTensor for the given candidate specs per input; raises
    whatever DTensor's strategy function raises."""
    strategy = dtensor_strategy_for(node, inputs, candidates, pool.mesh)
    if strategy is None:
        return []
    return _options_from_op_strategy(node, strategy, inputs, pool)


def _dtensor_options(node, inputs, candidates, pool: SpecPool, failures: list | None = None) -> list[Option]:
    """DTensor's options for ``node`` given every candidate of every input.

    Strategy functions that follow their input's layout (all view ops) go
    through the candidates one by one and raise as soon as one of them cannot
    be propagated: unflattening a dim sharded 16 ways into 8 heads raises
    "Cannot unflatten unevenly sharded tensor", which used to throw away the
    options of every other candidate and leave the view replicate-only. On
    such a failure, propagate one candidate of the first input at a time
    (the other inputs keep all of theirs) and keep what succeeds: for
    single-input ops that is exactly the set the all-at-once call would give
    if it skipped the bad candidates; the consumer can still get any layout
    through a redistribution on the incoming edge.
    """
    op = node.target
    failures = failures if failures is not None else []
    try:
        return _propagate(node, inputs, candidates, pool)
    except NotImplementedError as e:
        logger.debug("no DTensor strategy for %s: %s", op, e)
        return []
    except Exception as e:  # noqa: BLE001 - DTensor rules assert on odd inputs
        failures.append(e)
        if len(candidates[0]) < 2:
            logger.debug("DTensor strategy for %s (%s) failed: %r", op, node.name, e, exc_info=True)
            return []
        logger.debug("DTensor strategy for %s (%s) failed on all candidates (%r); retrying one by one", op, node.name, e)
    options: list[Option] = []
    seen: set = set()
    first = inputs[0]
    for spec in candidates[0]:
        # Restrict every occurrence of the first input, not just position 0.
        restricted = [(spec,) if n is first else c for n, c in zip(inputs, candidates)]
        try:
            found = _propagate(node, inputs, restricted, pool)
        except Exception as e:  # noqa: BLE001 - this candidate has no option
            logger.debug("%s (%s): no option for input layout %s: %r", op, node.name, format_specs(spec), e)
            continue
        for o in found:
            key = (placements_of(o.output_specs), tuple(s.placements for s in o.input_specs))
            if key not in seen:
                seen.add(key)
                options.append(o)
    return options


def _candidate_free(op) -> bool:
    """Whether ``op``'s options do not depend on its inputs' candidate
    specs: DTensor's single-mesh-dim strategies expand over the mesh
    whatever the inputs hold (:func:`_dtensor_strategy` hands them one
    representative spec per input); a registered rule sees the candidates."""
    return op not in RULES and op in _propagator().op_single_dim_strategy_funcs


def _module_path(node: torch.fx.Node) -> str:
    from .tracing import module_path

    return module_path(node) or "<top level>"


def _produces_tensors(val) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    if isinstance(val, (tuple, list)):
        return any(isinstance(v, torch.Tensor) for v in val)
    return False


def _dedup(items) -> tuple:
    out: dict = {}
    for it in items:
        out.setdefault(it, None)
    return tuple(out)


def _val_key(val):
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), tuple(val.stride()), val.dtype)
    if isinstance(val, (tuple, list)):
        return tuple(_val_key(v) for v in val)
    return None


def _arg_key(a):
    """Hashable structure of non-tensor arguments; tensor args become markers."""
    if isinstance(a, torch.fx.Node):
        return "T"
    if isinstance(a, (list, tuple)):
        return tuple(_arg_key(x) for x in a)
    if isinstance(a, dict):
        return tuple(sorted((k, _arg_key(v)) for k, v in a.items()))
    if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(a)
    return a
