"""Options of view-like ops converted once per input candidate.

DTensor's view, transpose and slice_backward rules map each candidate
layout of their one input to one OpSpec, independently of the others. On a
4-D mesh a tensor has thousands of candidate layouts, and the same view
(op, arguments, shapes) appears in many places whose candidate sets overlap
but differ (layer 0 reads the embedding, later layers a layer's output;
forward and backward views of the same shapes): the enumerator's cache,
keyed by candidate set, computes each of them anew. Here each (view,
candidate) is run through DTensor and converted to an :class:`Option` once;
a node's options are its candidates' options, deduplicated in candidate
order, which is what the all-at-once call gives (and, when some candidates
raise, what :func:`~autoparallel.options.strategies.dtensor_options`' one-by-one
retry gives). ``_StridedShard(d, split_factor=1)`` is read as ``Shard(d)``
here as in the all-at-once conversion. The options of an extra rule
(:data:`~autoparallel.options.rule_registry.EXTRA_RULES`) are appended by
the enumerator after these, in both ways, from the node's candidates.
"""

from __future__ import annotations

import torch.fx
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

from ..torch_compat import TORCH_VERSION, CODE_ERRORS, rule_error, say_once, strategy_function
from .cache_keys import arg_key, val_key
from .conversion import OpSpecConverter, SpecPool
from .dtensor_query import build_schema, dtensor_rule_name, dtensor_strategy_for, node_out_meta, propagator
from .placements import Option, plain_shards, tensor_meta_of
from .rule_registry import RULES

# DTensor strategy functions (module, qualified name) that map each input
# candidate to exactly one OpSpec, in order, whatever the other candidates
MAP_STRATEGIES = frozenset(
    {
        ("torch.distributed.tensor._ops._view_ops", "register_op_strategy_map.<locals>.reshape_strategy"),
        ("torch.distributed.tensor._ops._matrix_ops", "transpose_strategy"),
        ("torch.distributed.tensor._ops._tensor_ops", "slice_backward_rules"),
    }
)


def _say_missing_map_strategies(prop) -> None:
    """Log once each :data:`MAP_STRATEGIES` entry that no op of the running
    DTensor uses (renamed, or the op moved to a single-dim strategy, which
    needs no per-candidate memo)."""
    registered = {
        (fn.__module__, fn.__qualname__)
        for fn in map(strategy_function, prop.op_strategy_funcs.values())
        if fn is not None and hasattr(fn, "__qualname__")
    }
    for module, name in sorted(MAP_STRATEGIES - registered):
        say_once(
            ("map strategy", module, name),
            "candidate memo: DTensor in torch %s registers no %s.%s; its ops are computed per candidate set",
            TORCH_VERSION,
            module,
            name,
        )


class PerCandidateOptions:
    """(view, candidate) -> its option, for the life of one enumeration."""

    def __init__(self, pool: SpecPool):
        _say_missing_map_strategies(propagator())
        self.pool = pool
        # (op key, id(candidate spec)) -> (dedup key and option, or None where
        # filtered or DTensor raised; the exception; the candidate, kept
        # alive so that its id stays unique)
        self._memo: dict[tuple, tuple] = {}
        self._handles: dict = {}

    def handles(self, node: torch.fx.Node, inputs: list[torch.fx.Node]) -> bool:
        """One tensor input and a DTensor rule of :data:`MAP_STRATEGIES`."""
        return len(inputs) == 1 and self._kind(node.target) is not None

    def _kind(self, op):
        """None (not handled), "map" (DTensor's rule run on the new
        candidates), or ("view", dim_map, strict_view): the parts of
        DTensor's reshape_strategy, whose per-candidate step
        (``propagate_shape_and_sharding``) is called directly, without the
        two DTensorSpecs and the OpSpec it builds per candidate."""
        hit = self._handles.get(op, self)
        if hit is self:
            prop = propagator()
            fn = strategy_function(prop.op_strategy_funcs.get(op))
            hit = None
            if (
                op not in RULES
                and op not in prop.op_single_dim_strategy_funcs
                and fn is not None
                and (fn.__module__, fn.__qualname__) in MAP_STRATEGIES
            ):
                hit = "map"
                cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
                if fn.__qualname__.endswith("reshape_strategy") and set(cells) == {"dim_map", "strict_view"}:
                    hit = ("view", cells["dim_map"], cells["strict_view"])
            self._handles[op] = hit
        return hit

    def options(
        self, node: torch.fx.Node, inputs: list[torch.fx.Node], candidates: list, failures: list
    ) -> list[Option]:
        """The node's options given ``candidates`` (one list: its input's);
        the exceptions of candidates DTensor could not propagate are
        appended to ``failures``."""
        op_key = (
            node.target,
            arg_key(node.args),
            arg_key(node.kwargs),
            val_key(node.meta.get("val")),
            val_key(inputs[0].meta["val"]),
        )
        memo = self._memo
        missing = [c for c in candidates[0] if (op_key, id(c)) not in memo]
        if missing:
            kind = self._kind(node.target)
            if kind != "map" and isinstance(node_out_meta(node), TensorMeta):
                self._convert_views(node, inputs, op_key, missing, *kind[1:])
            else:
                self._convert(node, inputs, op_key, missing)
        options: list[Option] = []
        seen: set = set()
        for c in candidates[0]:
            converted, exc, _ = memo[(op_key, id(c))]
            if exc is not None:
                failures.append(exc)
            if converted is None or converted[0] in seen:
                continue
            seen.add(converted[0])
            options.append(converted[1])
        return options

    def _convert(self, node, inputs, op_key, missing: list) -> None:
        convert = OpSpecConverter(node, inputs, self.pool)
        try:
            strategy = dtensor_strategy_for(node, inputs, [missing], self.pool.mesh)
            batches = [(missing, strategy, None)]
        except CODE_ERRORS as e:
            raise rule_error(node.target, node.name, dtensor_rule_name(node.target), e) from e
        except Exception:  # noqa: BLE001 - some candidate raised: find which, one by one
            batches = []
            for c in missing:
                try:
                    batches.append(([c], dtensor_strategy_for(node, inputs, [[c]], self.pool.mesh), None))
                except CODE_ERRORS as e:
                    raise rule_error(node.target, node.name, dtensor_rule_name(node.target), e) from e
                except Exception as e:  # noqa: BLE001 - this candidate has no option
                    batches.append(([c], None, e))
        for cands, strategy, exc in batches:
            if strategy is not None and (type(strategy) is not OpStrategy or len(strategy.strategies) != len(cands)):
                raise AssertionError(
                    f"DTensor's rule for {node.target} ({node.name}) gave {len(strategy.strategies)} OpSpecs for "
                    f"{len(cands)} candidates: not one per candidate (candidate_memo.MAP_STRATEGIES lists it)"
                )
            for i, c in enumerate(cands):
                converted = None
                if strategy is not None:
                    parts = convert.option(strategy.strategies[i])
                    if parts is not None:
                        converted = (parts[0], Option(parts[1], parts[2]))
                self._memo[(op_key, id(c))] = (converted, exc, c)

    def _convert_views(self, node, inputs, op_key, missing: list, dim_map, strict_view: bool) -> None:
        """What :meth:`_convert` makes of DTensor's reshape_strategy, from
        its per-candidate step: the input's target and the output's
        placements (``_StridedShard(d, 1)`` read as ``Shard(d)``), pooled
        with the node's metas where even."""
        from torch.distributed.tensor._ops._view_ops import propagate_shape_and_sharding

        pool, memo = self.pool, self._memo
        in_meta, out_meta = tensor_meta_of(inputs[0].meta["val"]), node_out_meta(node)
        try:
            schema = build_schema(node, {inputs[0]: OpStrategy([OpSpec(missing[0])])})
            rules = dim_map(*schema.args_schema, **schema.kwargs_schema)
        except CODE_ERRORS as e:
            raise rule_error(node.target, node.name, dtensor_rule_name(node.target), e) from e
        except Exception as e:  # noqa: BLE001 - DTensor's rule raises for every candidate then
            for c in missing:
                memo[(op_key, id(c))] = (None, e, c)
            return
        shape, mesh_shape = tuple(in_meta.shape), tuple(pool.mesh.shape)
        for c in missing:
            try:
                in_target, out = propagate_shape_and_sharding(c.placements, shape, rules, mesh_shape, strict_view)
            except CODE_ERRORS as e:
                raise rule_error(node.target, node.name, dtensor_rule_name(node.target), e) from e
            except Exception as e:  # noqa: BLE001 - this candidate has no option
                memo[(op_key, id(c))] = (None, e, c)
                continue
            # as OpSpecConverter reads DTensor's specs: _StridedShard(d, 1) is Shard(d)
            in_target, out = plain_shards(tuple(in_target)), plain_shards(tuple(out))
            converted = None
            if pool.evenly_sharded(out_meta.shape, out) and pool.evenly_sharded(in_meta.shape, in_target):
                out_spec, in_spec = pool.get(out, out_meta), pool.get(in_target, in_meta)
                converted = ((id(out_spec), id(in_spec)), Option(out_spec, (in_spec,)))
            memo[(op_key, id(c))] = (converted, None, c)
