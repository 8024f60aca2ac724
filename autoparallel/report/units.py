"""The unit system of every figure a plan prints (:mod:`solver.units`, shared
with ``python -m solver``): SI units with a space (``382.6 ms``,
``12.5 us``, ``1.23 GB``), decimal sizes, counts as ``8.03B``.
"""

from __future__ import annotations

from solver.units import count, percent, seconds, size

__all__ = ["count", "percent", "seconds", "size"]
