"""The registry of placement rules: ops whose options a registered function
gives instead of DTensor's sharding propagation (:data:`RULES`), or adds
after DTensor's (:data:`EXTRA_RULES`). :mod:`autoparallel.options.strategies`
consults them and :mod:`autoparallel.options.rules` fills them."""

from __future__ import annotations

from typing import Any, Callable

import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .conversion import SpecPool
from .placements import Option

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


ExtraRuleFn = Callable[[torch.fx.Node, list[list[DTensorSpec]], SpecPool], list[Option]]
EXTRA_RULES: dict[Any, ExtraRuleFn] = {}


def register_extra_rule(*ops: Any) -> Callable[[ExtraRuleFn], ExtraRuleFn]:
    """Register ``fn(node, input_candidates, pool) -> list[Option]`` for
    ``ops``: options DTensor's rule lacks, appended to its options (those
    equal to one of them dropped). ``pool`` gives the specs (one object per
    placements and tensor meta, as DTensor's converted options use); the
    options must depend only on the candidates, the node's arguments and
    its tensors' metas, the keys the enumeration caches them under.
    """

    def wrap(fn: ExtraRuleFn) -> ExtraRuleFn:
        for op in ops:
            EXTRA_RULES[op] = fn
        return fn

    return wrap
