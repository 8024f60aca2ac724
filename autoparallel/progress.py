"""Stage progress: each long stage logs its start and end with its time
(logger ``autoparallel.stages``: one line each, on a terminal or in a batch
log alike); on a terminal where those lines are not shown, a tqdm bar
says which stage is running.

    with stages.stage("tracing"):
        ...
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import time

# its own logger, so that a tool can show the stage lines without the
# planner's detail (``autoparallel.cli.setup_logging``)
logger = logging.getLogger("autoparallel.stages")

# The stages of one plan-and-apply, in order (for the bar's total).
STAGES = ("tracing", "options", "repeated layers", "problem build", "solve", "apply")


class Stages:
    def __init__(self, timings: dict[str, float]):
        self.timings = timings
        self._bar = None
        if sys.stderr.isatty() and not logger.isEnabledFor(logging.INFO):
            from tqdm import tqdm

            self._bar = tqdm(total=len(STAGES), desc="autoparallel", unit="stage", leave=False, file=sys.stderr)

    @contextlib.contextmanager
    def stage(self, name: str, key: str | None = None):
        logger.info("%s: start", name)
        if self._bar is not None:
            self._bar.set_description(f"autoparallel: {name}")
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        if key:
            self.timings[key] = seconds
        logger.info("%s: done in %.2fs", name, seconds)
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic collector off for the ``with`` body (restored after).

    Enumerating options and building the problem allocate millions of
    long-lived objects (options, specs, cost rows) and few cycles; each
    full collection walks all of them, and on a 4-D mesh collections took
    ~40% of the options stage (70B, 4x4x8x8). What cycles the body leaves
    are collected once the collector is back on.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
