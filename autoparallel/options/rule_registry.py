"""The registry of placement rules: ops whose options a registered function
gives instead of DTensor's sharding propagation (see
:mod:`autoparallel.options.strategies`, which consults it, and
:mod:`autoparallel.options.rules`, which fills it)."""

from __future__ import annotations

from typing import Any, Callable

import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec

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
