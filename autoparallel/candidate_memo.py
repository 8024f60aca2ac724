"""Options of view-like ops converted once per input candidate (issue 13).

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
raise, what :func:`~autoparallel.strategies._dtensor_options`' one-by-one
retry gives).
"""

from __future__ import annotations

import torch.fx
from torch.distributed.tensor._op_schema import OpStrategy

from .dtensor_query import _propagator
from .strategies import RULES, OpSpecConverter, Option, SpecPool, _arg_key, _val_key, dtensor_strategy_for

# DTensor strategy functions (module, qualified name) that map each input
# candidate to exactly one OpSpec, in order, whatever the other candidates
MAP_STRATEGIES = frozenset(
    {
        ("torch.distributed.tensor._ops._view_ops", "register_op_strategy_map.<locals>.reshape_strategy"),
        ("torch.distributed.tensor._ops._matrix_ops", "transpose_strategy"),
        ("torch.distributed.tensor._ops._tensor_ops", "slice_backward_rules"),
    }
)


class PerCandidateOptions:
    """(view, candidate) -> its option, for the life of one enumeration."""

    def __init__(self, pool: SpecPool):
        self.pool = pool
        # (op key, id(candidate spec)) -> (dedup key and option, or None where
        # filtered or DTensor raised; the exception; the candidate, kept
        # alive so that its id stays unique)
        self._memo: dict[tuple, tuple] = {}
        self._handles: dict = {}

    def handles(self, node: torch.fx.Node, inputs: list[torch.fx.Node]) -> bool:
        """One tensor input and a DTensor rule of :data:`MAP_STRATEGIES`."""
        if len(inputs) != 1:
            return False
        op = node.target
        hit = self._handles.get(op)
        if hit is None:
            prop = _propagator()
            fn = prop.op_strategy_funcs.get(op)
            hit = self._handles[op] = (
                op not in RULES
                and op not in prop.op_single_dim_strategy_funcs
                and fn is not None
                and (fn.__module__, fn.__qualname__) in MAP_STRATEGIES
            )
        return hit

    def options(self, node: torch.fx.Node, inputs: list[torch.fx.Node], candidates: list, failures: list) -> list[Option]:
        """The node's options given ``candidates`` (one list: its input's);
        the exceptions of candidates DTensor could not propagate are
        appended to ``failures``."""
        op_key = (node.target, _arg_key(node.args), _arg_key(node.kwargs), _val_key(node.meta.get("val")),
                  _val_key(inputs[0].meta["val"]))
        memo = self._memo
        missing = [c for c in candidates[0] if (op_key, id(c)) not in memo]
        if missing:
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
        except Exception:  # noqa: BLE001 - some candidate raised: find which, one by one
            batches = []
            for c in missing:
                try:
                    batches.append(([c], dtensor_strategy_for(node, inputs, [[c]], self.pool.mesh), None))
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
