"""DTensor's strategies as :class:`~autoparallel.options.placements.Option` lists
(the conversion step of :mod:`.strategies`): DTensor's OpSpecs, or the
numpy table of :mod:`.fast_expand`, become options over pooled specs with
the node's tensor metas, ``_StridedShard(d, split_factor=1)`` read as
``Shard(d)`` (:func:`~autoparallel.options.placements.plain_shards`), uneven
layouts (and every other ``_StridedShard``) dropped, deduplicated in
DTensor's order.
"""

from __future__ import annotations

import numpy as np
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSpec, TupleStrategy

from .dtensor_query import node_out_meta
from .fast_expand import ExpandedStrategy, even_key, new_spec, placements_of_numbers
from .placements import Option, Specs, format_specs, is_evenly_sharded, placements_of, plain_shards, tensor_meta_of


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
        :func:`~autoparallel.options.fast_expand.placements_of_numbers`) with
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


def for_each_output(out, meta):
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
        return (
            isinstance(out, (tuple, list))
            and len(out) == len(meta)
            and all(o is None or _same_structure(o, m) for o, m in zip(out, meta) if m is not None)
        )
    return True


def out_placements_ok(out, meta, mesh: DeviceMesh) -> bool:
    """Whether every output spec of ``out`` shards its tensor (``meta``) evenly over ``mesh``."""
    if isinstance(out, DTensorSpec):
        m = meta if isinstance(meta, TensorMeta) else out.tensor_meta
        return not isinstance(m, TensorMeta) or is_evenly_sharded(m.shape, plain_shards(out.placements), mesh)
    if isinstance(out, (tuple, list)):
        metas = meta if isinstance(meta, (tuple, list)) else [None] * len(out)
        return all(out_placements_ok(o, m, mesh) for o, m in zip(out, metas))
    return True


def pooled_output(out, meta, pool: SpecPool) -> Specs:
    """Output spec(s) from the pool, with the node's own tensor metas: DTensor
    may leave them unset, and some of its view rules hand back the input's
    spec (with the input's shape) for a replicated output."""
    if isinstance(out, DTensorSpec):
        m = meta if isinstance(meta, TensorMeta) else out.tensor_meta
        return pool.get(plain_shards(out.placements), m if isinstance(m, TensorMeta) else None)
    if isinstance(out, (tuple, list)):
        metas = meta if isinstance(meta, (tuple, list)) else [None] * len(out)
        return tuple(pooled_output(o, m, pool) for o, m in zip(out, metas))
    return out


def options_from_op_strategy(
    node: torch.fx.Node,
    strategy,
    inputs: list[torch.fx.Node],
    pool: SpecPool,
) -> list[Option]:
    """``node``'s options from DTensor's ``strategy``: every OpSpec's placements with the input specs it needs, uneven layouts dropped."""
    out_meta = node_out_meta(node)
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
    the node's tensor metas, uneven layouts (and _StridedShard other than
    :func:`plain_shards` reads as Shard) filtered.

    DTensor's options share spec objects (fast_expand builds one per
    placements), so the filters and the pool run once per (position, spec
    object); the memos keep those objects alive, so ids stay unique. A
    pooled spec stands for its placements (one object per placements and
    meta): options deduplicate on the ids of their pooled specs.
    """

    def __init__(self, node: torch.fx.Node, inputs: list[torch.fx.Node], pool: SpecPool, in_metas=None, out_meta=None):
        self.node, self.inputs, self.pool = node, inputs, pool
        self.out_meta = node_out_meta(node) if out_meta is None else out_meta
        self.in_metas = [tensor_meta_of(n.meta["val"]) for n in inputs] if in_metas is None else in_metas
        self._in_memo: dict[tuple[int, int], tuple] = {}
        self._out_memo: dict[int, tuple] = {}

    def _pooled_input(self, k: int, spec):
        hit = self._in_memo.get((k, id(spec)))
        if hit is None:
            p, m, pool = plain_shards(spec.placements), self.in_metas[k], self.pool
            hit = self._in_memo[(k, id(spec))] = (pool.get(p, m) if pool.evenly_sharded(m.shape, p) else None, spec)
        return hit[0]

    def option(self, op_spec: OpSpec) -> tuple[tuple, Specs, tuple[DTensorSpec, ...]] | None:
        """(dedup key, output spec(s), input specs) of the option of
        ``op_spec``; None where it is filtered."""
        raw_out = op_spec.output_specs
        out_hit = self._out_memo.get(id(raw_out))
        if out_hit is None:
            out_meta = self.out_meta
            out = for_each_output(raw_out, out_meta)
            if not _same_structure(out, out_meta):
                raise ValueError(
                    f"DTensor's strategy for {self.node.target} gives output specs {format_specs(out)} "
                    f"for a node with outputs {out_meta}"
                )
            pooled = (
                pooled_output(out, out_meta, self.pool) if out_placements_ok(out, out_meta, self.pool.mesh) else None
            )
            # multi-output: a new tuple per strategy, keyed by its placements
            out_key = id(pooled) if isinstance(pooled, DTensorSpec) else placements_of(pooled)
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


def _options_from_table(
    node, strategy: ExpandedStrategy, inputs, in_metas, out_meta, pool: SpecPool
) -> list[Option] | None:
    """What the loop of :func:`options_from_op_strategy` makes of an
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
            out = for_each_output(specs[0] if n_out == 1 else tuple(specs), out_meta)
            if not _same_structure(out, out_meta):
                raise ValueError(
                    f"DTensor's strategy for {node.target} gives output specs {format_specs(out)} "
                    f"for a node with outputs {out_meta}"
                )
            if not out_placements_ok(out, out_meta, pool.mesh):
                outs.append(None)
                continue
            pooled = pooled_output(out, out_meta, pool)
            outs.append((id(pooled) if isinstance(pooled, DTensorSpec) else placements_of(pooled), pooled))
        out_code, out_pooled = _numbered_distinct(outs)
        codes = [np.array(out_code, dtype=np.int64)[out_inverse.reshape(-1)]]
    in_pooled: list[list[DTensorSpec]] = []
    for k, p in enumerate(in_cols):
        m = in_metas[k]
        entry_code, pooled_list = _numbered_distinct(map(_by_id, pool.even_specs(strategy.numbers_at[p], m)))
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
