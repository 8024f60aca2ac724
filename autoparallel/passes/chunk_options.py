"""``chunk_modules`` options checked against the model's module paths,
before any trace: a pattern that names no module, or a mode that does not
exist, is a typo the user should hear about in the first second, not a
region silently left alone after the apply.

Patterns are module paths where ``*`` (or any ``fnmatch`` pattern) matches
one path component: ``layers.*.attention`` names ``layers.0.attention``,
``layers.1.attention``... The chunking pass (:mod:`.chunk_regions`) reads
the same patterns.

>>> check_chunk_modules({"layers.*.attention": "batch"}, ["", "layers", "layers.0", "layers.0.attention"])
>>> parse_chunk_args(["layers.*.attention=seq", "layers.*.feed_forward"])
{'layers.*.attention': 'seq', 'layers.*.feed_forward': 'batch'}
"""

from __future__ import annotations

import difflib
import fnmatch
from typing import Iterable, Mapping

# the dim each mode splits: the batch (dim 0 of the inputs) or the sequence (dim 1)
CHUNK_MODES = ("batch", "seq")


class ChunkOptionError(ValueError):
    """A ``chunk_modules`` entry names no module or no mode."""


def pattern_matches(path: str, pattern: str) -> bool:
    """``path`` is a module the pattern names (same depth, each component
    matching): ``pattern_matches("layers.3.moe", "layers.*.moe")``."""
    comps, pcomps = path.split("."), pattern.split(".")
    return len(comps) == len(pcomps) and all(fnmatch.fnmatchcase(c, p) for c, p in zip(comps, pcomps))


def parse_chunk_args(values: Iterable[str], default_mode: str = "batch") -> dict[str, str]:
    """``PATTERN=MODE`` strings (command-line form; no ``=MODE``: ``default_mode``)
    as ``chunk_modules``."""
    out: dict[str, str] = {}
    for v in values:
        pattern, _, mode = v.partition("=")
        if not pattern:
            raise ChunkOptionError(f"--chunk {v!r}: give PATTERN=MODE, e.g. layers.*.attention=batch")
        out[pattern] = mode or default_mode
    return out


def _fold(path: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def check_chunk_modules(chunk_modules: Mapping[str, str] | None, module_paths: Iterable[str]) -> None:
    """Every pattern of ``chunk_modules`` names at least one of
    ``module_paths`` (``model.named_modules()``'s names) and every mode is
    one of :data:`CHUNK_MODES`; else :class:`ChunkOptionError` naming the
    entry and what would be valid."""
    if not chunk_modules:
        return
    if not isinstance(chunk_modules, Mapping):
        raise ChunkOptionError(
            f"chunk_modules must be a dict of module-path pattern -> mode, got {type(chunk_modules).__name__}"
        )
    paths = [p for p in module_paths if p]
    for pattern, mode in chunk_modules.items():
        if mode not in CHUNK_MODES:
            raise ChunkOptionError(
                f"chunk {pattern}={mode}: the mode must be one of {', '.join(CHUNK_MODES)} "
                "(the dim to split: batch = input dim 0, seq = input dim 1)"
            )
        if not isinstance(pattern, str) or not pattern:
            raise ChunkOptionError(f"chunk pattern {pattern!r}: give a module path such as layers.*.attention")
        if any(pattern_matches(p, pattern) for p in paths):
            continue
        depth = len(pattern.split("."))
        same_depth = sorted({_fold(p) for p in paths if len(p.split(".")) == depth})
        near = difflib.get_close_matches(pattern, same_depth, n=3, cutoff=0.5) or same_depth[:6]
        hint = f"; modules at that depth: {', '.join(near)}" if near else ""
        raise ChunkOptionError(f"chunk {pattern}={mode}: the pattern names no module of the model{hint}")


__all__ = ["CHUNK_MODES", "ChunkOptionError", "check_chunk_modules", "parse_chunk_args", "pattern_matches"]
