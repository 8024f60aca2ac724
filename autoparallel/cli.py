"""What the command lines share: log lines like a training tool's, and a
user's mistake as one line with exit status 2 (the traceback with ``-v``).

    def main(argv=None):
        args = parse_args(argv)
        setup_logging(verbose=args.verbose)
        with user_errors("example_llama3.py", verbose=args.verbose):
            ...
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Iterator, Sequence

# the exit status of a user's mistake (argparse's for a bad flag)
USAGE_ERROR = 2

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def _rank() -> int:
    """This process's rank: the process group's once it exists, torchrun's
    ``RANK`` before that, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _RankZeroFilter(logging.Filter):
    """Rank 0 logs everything at the handler's level; other ranks only
    warnings and errors (so one line per stage, not one per rank)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or _rank() == 0


def setup_logging(verbose: bool = False, stream=None, also: Sequence[str] = ()) -> logging.Handler | None:
    """Log with timestamps to stderr, on rank 0: the planning stages' start
    and end lines (logger ``autoparallel.stages``) and the loggers named in
    ``also`` at INFO; ``verbose``: all of ``autoparallel`` at INFO (sizes,
    pruning, passes...); warnings from every rank and library.

    Where the application already configured the root logger (it has
    handlers), nothing is changed and None is returned: its configuration
    decides what shows."""
    root = logging.getLogger()
    if root.handlers:
        return None
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))
    handler.addFilter(_RankZeroFilter())
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("autoparallel").setLevel(logging.INFO if verbose else logging.WARNING)
    for name in ("autoparallel.stages", *also):
        logging.getLogger(name).setLevel(logging.INFO)
    return handler


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, unless its help text already
    says it (``default: 8192; 256 with --real``) or there is none to show
    (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        default = action.default
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})"


def user_error_types() -> tuple[type[BaseException], ...]:
    """Errors that describe a mistake in the arguments, inputs, constraints
    or files (each names what is wrong and what would be valid): printed
    in one line. Anything else (a plain ValueError or TypeError included:
    from a command line, whose flags are checked, those are bugs) keeps its
    traceback."""
    import solver

    from .checks.provenance import PlanMismatch
    from .validation import ConstraintError
    from .checks.preflight import PlanFileError
    from .passes.chunk_options import ChunkOptionError
    from .problem.builder import ProblemTooLarge
    from .capture.tracing import DataDependentTraceError
    from .apply.cudagraphs import CudaGraphError

    return (
        ConstraintError,
        CudaGraphError,
        PlanMismatch,
        PlanFileError,
        ChunkOptionError,
        ProblemTooLarge,
        DataDependentTraceError,
        solver.InfeasibleError,
        FileNotFoundError,
        PermissionError,
        IsADirectoryError,
    )


@contextlib.contextmanager
def user_errors(prog: str, verbose: bool = False) -> Iterator[None]:
    """Turn a user's mistake raised in the body into ``prog: error: ...``
    on stderr and ``SystemExit(2)``; with ``verbose`` the exception
    propagates with its traceback."""
    try:
        yield
    except user_error_types() as exc:
        if verbose:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{prog}: error: {first}  (-v: traceback)", file=sys.stderr)
        raise SystemExit(USAGE_ERROR) from None


__all__ = ["HelpFormatter", "LOG_FORMAT", "USAGE_ERROR", "setup_logging", "user_error_types", "user_errors"]
