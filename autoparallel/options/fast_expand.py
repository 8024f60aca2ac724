"""DTensor's ``expand_to_full_mesh_op_strategy`` as a numpy table, and
cheaper DTensorSpecs while options are enumerated.

DTensor writes matmul, pointwise, embedding, ... rules for one mesh dim and
expands them over the mesh: every combination of per-dim rules becomes an
OpSpec with new DTensorSpecs (~40 us each: shard-order bookkeeping), 9^4 =
6561 combinations for ``neg`` on a 4-D mesh. Here the combinations are a
numpy table (one row per combination, in ``itertools.product`` order): per
argument position, the distinct placements tuples occurring there are
numbered once, DTensor's filters (mixed Partial kinds, shardability,
the input count) run once per distinct tuple, and rows are kept or
dropped with array operations. :class:`ExpandedStrategy` is the
OpStrategy it returns: :mod:`.strategies` reads its table directly; whoever
reads ``strategies`` gets the OpSpecs DTensor's own function would have
built (same specs, order and costs).

Placements are numbered by value once per process
(:func:`placement_number`): memo keys are int tuples, which hash in C (a
placement's ``__hash__`` runs in Python).

Calls this version does not handle the same way (in-place and out= ops,
multi-mesh arguments, ``_StridedShard`` inputs) go to DTensor's own
function. :func:`fast_expansion` patches the function where DTensor's rule
modules bound it, and memoises ``DTensorSpec.__post_init__`` on the
placements, for the duration of a ``with``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import numpy as np

from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSpec, OpStrategy, StrategyType
from torch.distributed.tensor.placement_types import Partial, Replicate, _StridedShard

from ..torch_compat import Swap, accepts_like, modules_binding, say_once, swapped
from ..torch_compat import is_shard_like as _is_shard_like

_ORIGINAL = None


# The replacement must take exactly the parameters of the running torch's
# function (torch_compat.swapped checks before installing it): one adapter
# per form the supported releases have, each naming the keywords as torch
# does and passing them on to _expand.


def expand_with_strategy_filter(
    mesh,
    op_schema,
    single_mesh_dim_strategies,
    *,
    output_tensor_meta=None,
    input_index: int = 1,
    inplace_op: bool = False,
    allow_unbacked_sharding=None,
    allow_uneven_sharding: bool = False,
    full_mesh_strategy_filter=None,
    different_mesh_args=None,
):
    return _expand(
        mesh,
        op_schema,
        single_mesh_dim_strategies,
        dict(
            output_tensor_meta=output_tensor_meta,
            input_index=input_index,
            inplace_op=inplace_op,
            allow_unbacked_sharding=allow_unbacked_sharding,
            allow_uneven_sharding=allow_uneven_sharding,
            full_mesh_strategy_filter=full_mesh_strategy_filter,
            different_mesh_args=different_mesh_args,
        ),
        strategy_filter=full_mesh_strategy_filter,
    )


def expand_with_valid_strategy_cb(
    mesh,
    op_schema,
    single_mesh_dim_strategies,
    *,
    output_tensor_meta=None,
    input_index: int = 1,
    inplace_op: bool = False,
    allow_unbacked_sharding=None,
    allow_uneven_sharding: bool = False,
    is_valid_strategy_cb=None,
    different_mesh_args=None,
):
    return _expand(
        mesh,
        op_schema,
        single_mesh_dim_strategies,
        dict(
            output_tensor_meta=output_tensor_meta,
            input_index=input_index,
            inplace_op=inplace_op,
            allow_unbacked_sharding=allow_unbacked_sharding,
            allow_uneven_sharding=allow_uneven_sharding,
            is_valid_strategy_cb=is_valid_strategy_cb,
            different_mesh_args=different_mesh_args,
        ),
        strategy_filter=is_valid_strategy_cb,
    )


def expand_even_single_mesh(
    mesh,
    op_schema,
    single_mesh_dim_strategies,
    *,
    output_tensor_meta=None,
    input_index: int = 1,
    inplace_op: bool = False,
    allow_unbacked_sharding=None,
    is_valid_strategy_cb=None,
):
    """The form without ``allow_uneven_sharding`` and ``different_mesh_args``."""
    return _expand(
        mesh,
        op_schema,
        single_mesh_dim_strategies,
        dict(
            output_tensor_meta=output_tensor_meta,
            input_index=input_index,
            inplace_op=inplace_op,
            allow_unbacked_sharding=allow_unbacked_sharding,
            is_valid_strategy_cb=is_valid_strategy_cb,
        ),
        strategy_filter=is_valid_strategy_cb,
    )


ADAPTERS = (expand_with_strategy_filter, expand_with_valid_strategy_cb, expand_even_single_mesh)


def adapter_for(original):
    """The adapter taking exactly ``original``'s parameters, else None."""
    return next((a for a in ADAPTERS if accepts_like(a, original) is None), None)


def _expand(mesh, op_schema, single_mesh_dim_strategies, keywords: dict, *, strategy_filter):
    """DTensor's expansion as a table; ``keywords`` are the call's keyword
    arguments as torch's function names them (passed on unchanged where
    DTensor's own function runs)."""
    from torch.distributed.tensor._ops import utils as ops_utils

    output_tensor_meta = keywords["output_tensor_meta"]
    input_index = keywords["input_index"]
    allow_unbacked_sharding = keywords["allow_unbacked_sharding"]
    allow_uneven_sharding = keywords.get("allow_uneven_sharding", False)
    input_args_strategy = op_schema.args_strategy + op_schema.kwargs_strategy
    if (
        keywords["inplace_op"]
        or keywords.get("different_mesh_args")
        or op_schema.is_out_variant_op()
        or input_index == 0
        or any(
            isinstance(p, _StridedShard) for s in input_args_strategy for p in s.strategies[0].output_spec.placements
        )
    ):
        return _ORIGINAL(mesh, op_schema, single_mesh_dim_strategies, **keywords)
    rows = single_mesh_dim_strategies
    n_rows = len(rows)
    n_positions = len(rows[0]) if rows else 0
    ndim = mesh.ndim
    # Combinations in itertools.product order: the first mesh dim's row
    # varies slowest.
    combo_rows = np.indices((n_rows,) * ndim).reshape(ndim, -1) if n_rows else np.zeros((ndim, 0), dtype=np.int64)
    n_combos = combo_rows.shape[1]
    counts_of = [_counts(r, input_index) for r in rows]
    # DTensor tells a None position by the first mesh dim's row, and counts
    # outputs / inputs before a position on that row too.
    first_inputs = np.array([counts_of[r][-1][1] for r in range(n_rows)], dtype=np.int64)

    # per position: per entry, its placements' numbers (None: no tensor
    # there) and its tensor meta
    numbers_at: list[list] = []
    metas_at: list[list] = []
    table = np.empty((n_combos, n_positions), dtype=np.int64)  # entry per combination, -1: None
    keep = np.ones(n_combos, dtype=bool)
    shardable_rows = np.ones(n_combos, dtype=bool)
    n_inputs = len(input_args_strategy)
    for position in range(n_positions):
        # Placements numbered by value (see placement_number); the first mesh dim's
        # row also brings its counts and whether the position is None there.
        placement_no = np.array([placement_number(r[position]) for r in rows], dtype=np.int64)
        firsts: dict = {}
        first_no = np.array(
            [
                firsts.setdefault(
                    (rows[r][position] is None, counts_of[r][position], placement_no[r].item()), len(firsts)
                )
                for r in range(n_rows)
            ],
            dtype=np.int64,
        )
        base = len(_PLACEMENTS)
        code = first_no[combo_rows[0]]
        for d in range(1, ndim):
            code = code * base + placement_no[combo_rows[d]]
        distinct, inverse = np.unique(code, return_inverse=True)
        # digits of the distinct codes: the first mesh dim's key, then one
        # placement number per further mesh dim
        digits = []
        rest = distinct
        for _ in range(ndim - 1):
            rest, digit = np.divmod(rest, base)
            digits.append(digit)
        # per first-dim key: None there, or (its number, tensor meta, and for
        # an input: the memo key prefix of its shardability and the numbers
        # of the placements allow_uneven_sharding lets through)
        first_info = []
        for is_none, (out_count, in_count), first_number in firsts:
            if is_none:
                first_info.append(None)
                continue
            meta, input_strategy = _meta_at(
                position, out_count, in_count, input_index, output_tensor_meta, input_args_strategy
            )
            shard_prefix = uneven = None
            if input_strategy is not None:
                shard_prefix = (id(mesh), tuple(input_strategy.shape), allow_unbacked_sharding)
                if allow_uneven_sharding:
                    uneven = tuple(placement_number(p) for p in input_strategy.strategies[0].output_spec.placements)
            first_info.append((first_number, meta, input_strategy, shard_prefix, uneven))
        numbers_list, metas, mixed, shardable = [], [], [], []
        for first, *others in zip(rest.tolist(), *reversed([d.tolist() for d in digits])):
            info = first_info[first]
            if info is None:
                numbers_list.append(None)
                metas.append(None)
                mixed.append(False)
                shardable.append(True)
                continue
            first_number, meta, input_strategy, shard_prefix, uneven = info
            numbers = (first_number, *others)
            numbers_list.append(numbers)
            metas.append(meta)
            m = _MIXED.get(numbers)
            mixed.append(_mixed_partial(numbers) if m is None else m)
            if shard_prefix is None:
                shardable.append(True)
            else:
                ok = _SHARDABLE.get((shard_prefix, shard_key(numbers)))
                if ok is None:
                    ok = _shardable(mesh, input_strategy.shape, numbers, meta, allow_unbacked_sharding)
                shardable.append(ok or numbers == uneven)
        none = np.array([n is None for n in numbers_list], dtype=bool)
        column = np.where(none, -1, np.arange(len(numbers_list)))[inverse.reshape(-1)]
        table[:, position] = column
        # -1 reads the appended entry: no tensor there, neither mixed nor unshardable
        keep &= ~np.array(mixed + [False], dtype=bool)[column]
        if position >= input_index:
            # applied after the input-count check below, as DTensor orders them
            shardable_rows &= np.array(shardable + [True], dtype=bool)[column]
        numbers_at.append(numbers_list)
        metas_at.append(metas)
    wrong = keep & (first_inputs[combo_rows[0]] != n_inputs)
    if wrong.any():
        got = int(first_inputs[combo_rows[0][int(np.argmax(wrong))]])
        raise AssertionError(
            f"input_specs({got}) != strategies({n_inputs}: "
            f"{len(op_schema.args_strategy)} args + {len(op_schema.kwargs_strategy)} kwargs)"
        )
    table = table[keep & shardable_rows]
    if input_index == 1 and n_positions and (table[:, 0] < 0).any():
        raise RuntimeError("output spec is None")
    strategy = ExpandedStrategy(
        mesh, numbers_at, metas_at, table, input_index, input_args_strategy, ops_utils.generate_redistribute_costs
    )
    if strategy_filter is not None:
        ok = [strategy_filter(ins, outs) for outs, ins in strategy.specs()]
        strategy.table = table[np.array(ok, dtype=bool)] if ok else table
    return strategy


class ExpandedStrategy(OpStrategy):
    """DTensor's expansion as a table, its OpSpecs built on first use.

    ``table[i, p]`` is combination ``i``'s entry at position ``p`` (outputs
    first, then inputs, as in DTensor's single-mesh-dim strategies): an index
    into ``numbers_at[p]`` (the entry's placements as :func:`placement_number` numbers
    them) and ``metas_at[p]`` (the tensor meta DTensor gives its spec), or
    -1 where the position holds no tensor. Rows are the kept combinations in
    DTensor's order. :mod:`.strategies` reads the table; anything reading
    ``strategies`` gets the OpSpecs DTensor's own function would build
    (redistribution costs from the cost function in force at expansion).
    """

    def __init__(self, mesh, numbers_at, metas_at, table, input_index, input_args_strategy, redistribute_costs):
        StrategyType.__init__(self)
        self.mesh_ = mesh
        self.numbers_at = numbers_at
        self.metas_at = metas_at
        self.table = table
        self.input_index = input_index
        self._input_args_strategy = input_args_strategy
        self._redistribute_costs = redistribute_costs
        self._specs_at = None
        self._op_specs = None

    def spec_at(self, position: int, entry: int) -> DTensorSpec | None:
        if self._specs_at is None:
            self._specs_at = [
                [None if n is None else _shared_spec(self.mesh_, placements_of_numbers(n), m) for n, m in zip(ns, ms)]
                for ns, ms in zip(self.numbers_at, self.metas_at)
            ]
        return None if entry < 0 else self._specs_at[position][entry]

    def specs(self):
        """(output specs, input specs) per kept combination."""
        n_out = self.input_index
        for row in self.table.tolist():
            specs = [self.spec_at(p, e) for p, e in enumerate(row)]
            outs = tuple(specs[:n_out]) if n_out > 1 else specs[0]
            yield outs, [s for s in specs[n_out:] if s is not None]

    @property
    def strategies(self) -> list[OpSpec]:
        if self._op_specs is None:
            self._op_specs = [
                OpSpec(
                    output_specs=outs,
                    input_specs=ins,
                    redistribute_cost=[
                        self._redistribute_costs(strategy, spec)
                        for strategy, spec in zip(self._input_args_strategy, ins)
                    ],
                )
                for outs, ins in self.specs()
            ]
        return self._op_specs

    @strategies.setter
    def strategies(self, value) -> None:
        raise AttributeError("an ExpandedStrategy's OpSpecs follow from its table")


def _counts(row, input_index: int) -> list[tuple[int, int]]:
    """Per position of ``row`` (and one past the end): non-None outputs and
    inputs before it."""
    out_count = in_count = 0
    result = []
    for q, p in enumerate(row):
        result.append((out_count, in_count))
        if p is not None:
            if q < input_index:
                out_count += 1
            else:
                in_count += 1
    result.append((out_count, in_count))
    return result


def _meta_at(position, out_count, in_count, input_index, output_tensor_meta, input_args_strategy) -> tuple:
    """(tensor meta, input strategy or None) DTensor gives the spec at
    ``position``: outputs from ``output_tensor_meta`` counting non-None
    outputs, inputs in order."""
    if position < input_index:
        if isinstance(output_tensor_meta, TensorMeta):
            return output_tensor_meta, None
        if isinstance(output_tensor_meta, (tuple, list)) and out_count < len(output_tensor_meta):
            return output_tensor_meta[out_count], None
        return None, None
    if in_count < len(input_args_strategy):
        return input_args_strategy[in_count].tensor_meta, input_args_strategy[in_count]
    return None, None


# Placements numbered by value, for the life of the process: memo keys of
# int tuples hash in C (a placement's __hash__ runs in Python, and tuples of
# them are hashed per lookup). Equal placements get one number.
_NUMBERS: dict = {}
_PLACEMENTS: list = []
_BY_NUMBERS: dict[tuple, tuple] = {}


def placement_number(placement) -> int:
    n = _NUMBERS.get(placement)
    if n is None:
        n = _NUMBERS[placement] = len(_PLACEMENTS)
        _PLACEMENTS.append(placement)
    return n


def _collapsed(numbers: tuple[int, ...], memo: dict, keeps) -> tuple[int, ...]:
    hit = memo.get(numbers)
    if hit is None:
        hit = memo[numbers] = tuple(n if keeps(_PLACEMENTS[n]) else -1 for n in numbers)
    return hit


_SHARD_KEYS: dict[tuple, tuple] = {}
_EVEN_KEYS: dict[tuple, tuple] = {}


def shard_key(numbers: tuple[int, ...]) -> tuple[int, ...]:
    """``numbers`` with every placement that is not shard-like as -1: all
    DTensor's ``is_tensor_shardable`` reads of placements (Replicate and the
    Partials of a 4-D mesh collapse: ~5x fewer distinct keys)."""
    return _collapsed(numbers, _SHARD_KEYS, _is_shard_like)


def even_key(numbers: tuple[int, ...]) -> tuple[int, ...]:
    """``numbers`` with every Replicate and Partial as -1: all
    :func:`~autoparallel.options.placements.is_evenly_sharded` reads of placements."""
    return _collapsed(numbers, _EVEN_KEYS, lambda p: not isinstance(p, (Replicate, Partial)))


def placements_of_numbers(numbers: tuple[int, ...]) -> tuple:
    placements = _BY_NUMBERS.get(numbers)
    if placements is None:
        placements = _BY_NUMBERS[numbers] = tuple(_PLACEMENTS[n] for n in numbers)
    return placements


# Memos shared across calls while fast_expansion() is entered: the ops of a
# layer expand over the same few tensor metas and placements.
_SPECS: dict[tuple, DTensorSpec] = {}
_SHARDABLE: dict[tuple, bool] = {}
_MIXED: dict[tuple, bool] = {}


def _mixed_partial(numbers: tuple) -> bool:
    """DTensor's test for a combination mixing Partial kinds (other than
    sum with avg)."""
    mixed = _MIXED.get(numbers)
    if mixed is None:
        kinds = {(type(p), p.reduce_op) for p in placements_of_numbers(numbers) if isinstance(p, Partial)}
        mixed = False
        if len(kinds) > 1:
            reduce_ops = {ro for _, ro in kinds}
            types = {t for t, _ in kinds}
            mixed = not (len(types) == 1 and reduce_ops == {"sum", "avg"})
        _MIXED[numbers] = mixed
    return mixed


def _shardable(mesh, shape, numbers: tuple, meta, allow_unbacked_sharding) -> bool:
    from torch.distributed.tensor._ops import utils as ops_utils

    key = ((id(mesh), tuple(shape), allow_unbacked_sharding), shard_key(numbers))
    ok = _SHARDABLE.get(key)
    if ok is None:
        spec = _shared_spec(mesh, placements_of_numbers(numbers), meta)
        ok = _SHARDABLE[key] = ops_utils.is_tensor_shardable(
            shape, spec, allow_unbacked_sharding=allow_unbacked_sharding
        )
    return ok


def _shared_spec(mesh, placements: tuple, meta) -> DTensorSpec:
    key = (id(mesh), placements, meta)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _SPECS[key] = new_spec(mesh, placements, meta)
    return spec


# (id(mesh), placements) -> a spec of them without tensor meta (holding the mesh)
_TEMPLATES: dict[tuple, DTensorSpec] = {}


def new_spec(mesh, placements: tuple, meta) -> DTensorSpec:
    """A new ``DTensorSpec(mesh, placements, tensor_meta=meta)``, ~10x
    cheaper for placements seen before: what ``__post_init__`` derives
    (shard order, strided flag) depends on the placements only, so the
    fields are copied from a spec of the same placements and ``tensor_meta``
    set, as the constructor would (tests/autoparallel/options/test_options_fast_path.py
    checks the fields are equal to the constructor's)."""
    key = (id(mesh), placements)
    template = _TEMPLATES.get(key)
    if template is None:
        template = _TEMPLATES[key] = DTensorSpec(mesh, placements)
    if meta is not None and type(meta) is not TensorMeta:
        return DTensorSpec(mesh, placements, tensor_meta=meta)
    spec = object.__new__(DTensorSpec)
    fields = spec.__dict__
    fields.update(template.__dict__)
    fields["tensor_meta"] = meta
    fields["_hash"] = None
    return spec


# (placements, use_strided_shard_as_shard_order given) -> (the flag, shard order)
_POST_INIT: dict[tuple, tuple] = {}
_ORIGINAL_POST_INIT = DTensorSpec.__post_init__


def _memoised_post_init(self: DTensorSpec) -> None:
    """``DTensorSpec.__post_init__`` memoised on the placements: what it
    derives (the strided flag, the default shard order, verified) depends on
    them only. DTensor's view, transpose, slice and cat rules build two
    specs per input candidate (~50 us each: ~120K of them for one LLaMA-3
    layer on a 4-D mesh). Specs given a shard order take the original."""
    spec = self
    if spec.shard_order is not None:
        _ORIGINAL_POST_INIT(spec)
        return
    placements = spec.placements
    if type(placements) is not tuple:
        placements = tuple(placements)
    key = (placements, spec.use_strided_shard_as_shard_order)
    hit = _POST_INIT.get(key)
    if hit is None:
        _ORIGINAL_POST_INIT(spec)
        _POST_INIT[key] = (spec.use_strided_shard_as_shard_order, spec.shard_order)
        return
    fields = spec.__dict__
    fields["placements"] = placements
    fields["use_strided_shard_as_shard_order"], fields["shard_order"] = hit
    fields["_hash"] = None


# What _memoised_post_init assumes of DTensorSpec: these fields, the derived
# ones depending on the placements only.
_SPEC_FIELDS = frozenset({"mesh", "placements", "tensor_meta", "shard_order", "use_strided_shard_as_shard_order"})


def planning_swaps() -> list[Swap]:
    """The swaps :func:`fast_expansion` makes in the running torch: the
    adapter taking exactly the parameters of DTensor's
    ``expand_to_full_mesh_op_strategy`` wherever DTensor's modules bound it,
    and the memoised ``DTensorSpec.__post_init__``. Empty parts where this
    torch's function or spec differs from what they handle (logged once)."""
    global _ORIGINAL
    from torch.distributed.tensor._ops import utils as ops_utils

    original = ops_utils.expand_to_full_mesh_op_strategy
    if original in ADAPTERS:
        raise RuntimeError("fast_expansion() entered while already active")
    swaps = []
    adapter = adapter_for(original)
    if adapter is None:
        say_once(
            ("no adapter", id(original)),
            "fast expansion: torch's expand_to_full_mesh_op_strategy%s matches none of the forms handled; "
            "DTensor's own runs (slower, same options)",
            inspect.signature(original),
        )
    else:
        _ORIGINAL = original
        swaps += [
            Swap(m, "expand_to_full_mesh_op_strategy", adapter)
            for m in modules_binding(original, "expand_to_full_mesh_op_strategy")
        ]
    fields = frozenset(f.name for f in dataclasses.fields(DTensorSpec))
    if fields == _SPEC_FIELDS:
        swaps.append(Swap(DTensorSpec, "__post_init__", _memoised_post_init))
    else:
        say_once(
            ("spec fields", fields),
            "fast expansion: DTensorSpec has fields %s; its own __post_init__ runs",
            sorted(fields),
        )
    return swaps


@contextlib.contextmanager
def fast_expansion():
    """Use the table expansion in DTensor's rule modules, and
    :func:`_memoised_post_init` for DTensorSpec, where they take what torch's
    own take (:func:`planning_swaps`); everything restored on exit."""
    try:
        with swapped(planning_swaps(), what="fast expansion"):
            yield
    finally:
        _SPECS.clear()
        _SHARDABLE.clear()
        _MIXED.clear()
        _TEMPLATES.clear()
        _BY_NUMBERS.clear()
        _SHARD_KEYS.clear()
        _EVEN_KEYS.clear()
        _POST_INIT.clear()
