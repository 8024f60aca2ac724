"""``local_map`` regions on local shards: the traced region node
(``local=False``, global shapes) becomes the same op with ``local=True``,
which runs the user's body on this rank's shards (forward) or autograd of
it (backward). The plan has already laid its inputs out as declared."""

from __future__ import annotations

from ..ops.local_map import LOCAL_MAP_REGION, LOCAL_MAP_REGION_BACKWARD
from .moe_dispatch import LOCAL_LOWERINGS


def _on_shards(op):
    def lower(opt, mesh, largs, lkwargs):
        *tensors, _region, _local = largs
        return op, (*tensors, _region, True), lkwargs

    return lower


LOCAL_LOWERINGS[LOCAL_MAP_REGION] = _on_shards(LOCAL_MAP_REGION)
LOCAL_LOWERINGS[LOCAL_MAP_REGION_BACKWARD] = _on_shards(LOCAL_MAP_REGION_BACKWARD)
