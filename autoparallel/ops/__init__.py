"""Custom ops of the planner, registered as ``torch.ops.autoparallel.*`` on import.

:mod:`autoparallel.ops.moe`: the routed-experts op ``moe_experts`` with its
backward and gradient-layout ops. :mod:`autoparallel.ops.local_map`: the
``local_map`` region ops (a user's kernel for local shards) and their
backward.
"""

from . import local_map, moe  # noqa: F401  (registers the ops)
