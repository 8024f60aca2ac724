"""Writing report and plan files: atomically, gzip for ``.gz``."""

from __future__ import annotations

import contextlib
import gzip
import os
import tempfile

__all__ = ["file_mode", "write_atomic"]


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (gzip for ``.gz``) through a temporary file
    in the same directory and ``os.replace``: readers never see half a file,
    and a failed write leaves no stale or partial file behind."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=directory)
    try:
        # mkstemp makes the file 0600; the result gets the mode open() would give
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as raw:
            data = text.encode()
            if str(path).endswith(".gz"):
                data = gzip.compress(data, compresslevel=3, mtime=0)
            raw.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def file_mode() -> int:
    """The mode a new file gets from ``open``: 0666 less the process's umask."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask
