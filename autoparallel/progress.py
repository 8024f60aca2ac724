"""Stage progress: each long stage logs its start and end with its time,
and on a terminal a tqdm bar shows which stage is running.

    with stages.stage("tracing"):
        ...
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

logger = logging.getLogger("autoparallel")

# The stages of one plan-and-apply, in order (for the bar's total).
STAGES = ("tracing", "options", "repeated layers", "problem build", "solve", "apply")


class Stages:
    def __init__(self, timings: dict[str, float]):
        self.timings = timings
        self._bar = None
        if sys.stderr.isatty():
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
