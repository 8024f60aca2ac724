"""The one owner of the cost model's memoised results.

Every cache of :mod:`autoparallel.cost_model` (dicts of costs, step plans,
interned ids, state graphs, and ``functools.lru_cache`` functions) is
registered here when its module is imported, and :func:`clear_caches`
clears them all at once. Clear after building a new mesh, or once a
problem's costs are built, to free memory: every cost is a pure function
of its inputs, so a cleared cache only costs recomputation, never a
different figure. Interned ids start over after a clear, so no caller may
keep one across it.
"""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")

_REGISTERED: list[Any] = []


def register(cache: T) -> T:
    """Register a cache (anything with ``clear()`` or, for an
    ``lru_cache`` function, ``cache_clear()``) and return it."""
    if not (hasattr(cache, "cache_clear") or hasattr(cache, "clear")):
        raise TypeError(f"{cache!r} has neither clear() nor cache_clear(): not a cache")
    _REGISTERED.append(cache)
    return cache


def registered() -> tuple[Any, ...]:
    """Every registered cache (for tests and memory reports)."""
    return tuple(_REGISTERED)


def clear_caches() -> None:
    """Drop every memoised cost, step plan and interned id of the cost model."""
    for cache in _REGISTERED:
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
        else:
            cache.clear()
