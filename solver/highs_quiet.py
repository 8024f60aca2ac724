"""A HiGHS instance that prints nothing.

HiGHS writes its banner ("Running HiGHS 1.16.0 ... Copyright ...") to the
process's standard output from C++ when the first ``Highs`` object of the
process is made, before any option (``output_flag``) can be set; under
torchrun every rank printed it into the job's stdout. The first
construction therefore runs with file descriptor 1 pointed at
``os.devnull``; later ones print nothing anyway, and every instance gets
``output_flag`` off.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from typing import Iterator

_lock = threading.Lock()
_banner_done = False


@contextlib.contextmanager
def _stdout_to_devnull() -> Iterator[None]:
    """File descriptor 1 (C and Python writers alike) to /dev/null for the body."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all: nothing to protect
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).fflush(None)  # C stdio's buffer goes to /dev/null, not to the restored fd
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def new_highs():
    """``highspy.Highs()`` with its output off, banner included."""
    global _banner_done
    import highspy

    with _lock:
        if _banner_done:
            h = highspy.Highs()
        else:
            with _stdout_to_devnull():
                h = highspy.Highs()
            _banner_done = True
    h.setOptionValue("output_flag", False)
    return h
