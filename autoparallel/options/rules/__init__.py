"""Sharding rules DTensor lacks, one op family per module.

Importing this package registers them in :data:`autoparallel.options.strategies.RULES`.
"""

from . import attention, flat_views, fused_attention, grouped_mm, linalg, local_map, moe, stack  # noqa: F401
