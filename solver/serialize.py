"""JSON dumps of problems and solutions: versioned, lossless, no pickle.

A dump is a JSON object with ``"schema": "autoparallel.solver/1"`` and
``"kind"``: ``"problem"``, ``"solution"`` or ``"bundle"`` (a problem and a
solution of it, under the keys ``"problem"`` and ``"solution"``).

Numbers are written as JSON numbers, except the non-finite floats JSON lacks:
``math.inf`` is written as the string ``"inf"`` (``-inf`` as ``"-inf"`` and
NaN as ``"nan"``, which only some fields accept on load). Unmapped link
entries are ``null``. Non-finite floats inside ``metadata`` are written as
``{"$float": "inf"}``; tuples in metadata come back as lists (JSON has none).

Loading checks the shape of the document and reports the first problem with
its JSON path, as in ``$.decisions[3].costs[1]: expected a number or "inf",
got "abc"``, then runs :meth:`Problem.validate`; both raise
:class:`DumpError`.

Example::

    >>> from solver.problem import Decision, Problem
    >>> p = Problem([Decision("a", ["R", "S0"], [1.0, float("inf")])])
    >>> d = problem_to_json(p)
    >>> d["decisions"][0]["costs"]
    [1.0, 'inf']
    >>> problem_from_json(d) == p
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from .decode import from_json, load, problem_from_json, solution_from_json
from .dump_format import SCHEMA, Bundle, DumpError, json_key
from .problem import Problem, Solution

__all__ = [
    "SCHEMA",
    "Bundle",
    "DumpError",
    "dump",
    "dumps",
    "from_json",
    "load",
    "problem_from_json",
    "problem_to_json",
    "solution_from_json",
    "solution_to_json",
    "to_json",
]

# ------------------------------------------------------------------ encoding


def _num(x: float) -> float | int | str:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


_ENCODE = {math.inf: "inf", -math.inf: "-inf"}


def _nums(xs) -> list:
    # C-speed paths: rows are all finite, or hold +-inf but no NaN (NaN is
    # not equal to itself, so dict lookups miss it; a NaN makes the sum NaN).
    try:
        if all(map(math.isfinite, xs)):
            return list(xs)
        total = sum(xs)
    except TypeError:  # not numbers: leave them to json (and its error)
        return list(xs)
    if total == total or math.inf in xs and -math.inf in xs and not any(map(math.isnan, xs)):
        return list(map(_ENCODE.get, xs, xs))
    return [_num(x) for x in xs]


def _meta(obj: Any, path: str) -> Any:
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"$float": _num(obj)}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise DumpError(f"{path}: metadata keys must be strings, got {k!r}")
            out[k] = _meta(v, json_key(path, k))
        return out
    if isinstance(obj, (list, tuple)):
        return [_meta(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    raise DumpError(f"{path}: cannot write a value of type {type(obj).__name__} to JSON")


class _Table:
    """Content-deduplicated JSON values: repeated layers' option lists, cost
    rows and edge matrices are written once and referred to by index."""

    def __init__(self):
        self.items: list = []
        self._index: dict = {}
        self._by_id: dict[int, int] = {}

    def ref(self, obj, encode, key) -> int:
        i = self._by_id.get(id(obj))
        if i is not None:
            return i
        k = key(obj)
        i = self._index.get(k)
        if i is None:
            i = self._index[k] = len(self.items)
            self.items.append(encode(obj))
        self._by_id[id(obj)] = i
        return i


def _matrix_key(m) -> tuple:
    return tuple(map(tuple, m))


def problem_to_json(p: Problem, *, shared: bool = False) -> dict:
    """A JSON-ready dict (only JSON types; non-finite floats as strings).

    ``shared=True`` writes each distinct option list, cost row and edge
    matrix once under ``"tables"`` and refers to it by index (a model's
    linked layers then cost one layer's worth of numbers; a 32-layer model's
    dump shrinks about 30-fold); :func:`problem_from_json` reads both forms."""
    if shared:
        return _problem_to_json_shared(p)
    return {
        "schema": SCHEMA,
        "kind": "problem",
        "name": p.name,
        "metadata": _meta(p.metadata, "$.metadata"),
        "decisions": [{"name": d.name, "options": list(d.options), "costs": _nums(d.costs)} for d in p.decisions],
        "edges": [
            {
                "producer": e.producer,
                "consumer": e.consumer,
                "arg_index": e.arg_index,
                "costs": [_nums(row) for row in e.costs],
            }
            for e in p.edges
        ],
        "pins": [{"name": pin.name, "decision": pin.decision, "allowed": list(pin.allowed)} for pin in p.pins],
        "links": [{"name": link.name, "a": link.a, "b": link.b, "mapping": list(link.mapping)} for link in p.links],
        "resources": [
            {
                "name": r.name,
                "terms": {name: _nums(w) for name, w in r.terms.items()},
                "low": None if r.low is None else _num(r.low),
                "high": None if r.high is None else _num(r.high),
            }
            for r in p.resources
        ],
    }


def _problem_to_json_shared(p: Problem) -> dict:
    d = problem_to_json(dataclasses.replace(p, decisions=[], edges=[], resources=[]))
    opts, rows, mats = _Table(), _Table(), _Table()
    # ids are stable only while the objects live: ``p`` keeps them alive
    d["decisions"] = [
        {"name": x.name, "options": opts.ref(x.options, list, tuple), "costs": rows.ref(x.costs, _nums, tuple)}
        for x in p.decisions
    ]
    d["edges"] = [
        {
            "producer": e.producer,
            "consumer": e.consumer,
            "arg_index": e.arg_index,
            "costs": mats.ref(e.costs, lambda m: [_nums(r) for r in m], _matrix_key),
        }
        for e in p.edges
    ]
    d["resources"] = [
        {
            "name": r.name,
            "terms": {name: rows.ref(w, _nums, tuple) for name, w in r.terms.items()},
            "low": None if r.low is None else _num(r.low),
            "high": None if r.high is None else _num(r.high),
        }
        for r in p.resources
    ]
    d["tables"] = {"options": opts.items, "rows": rows.items, "matrices": mats.items}
    return d


def solution_to_json(s: Solution) -> dict:
    """A JSON-ready dict for ``s``."""
    return {
        "schema": SCHEMA,
        "kind": "solution",
        "choice": dict(s.choice),
        "objective": _num(s.objective),
        "unary_cost": _num(s.unary_cost),
        "edge_cost": _num(s.edge_cost),
        "status": s.status,
        "optimal": s.optimal,
        "gap": None if s.gap is None else _num(s.gap),
        "backend": s.backend,
        "timings": {k: _num(v) for k, v in s.timings.items()},
        "num_variables": s.num_variables,
        "num_constraints": s.num_constraints,
        "presolve": None if s.presolve is None else dataclasses.asdict(s.presolve),
        "stopped_by": s.stopped_by,
    }


def to_json(obj: Problem | Solution | Bundle | tuple) -> dict:
    """Problem, Solution, Bundle or ``(problem, solution)`` to a JSON-ready dict."""
    if isinstance(obj, tuple) and len(obj) == 2:
        obj = Bundle(*obj)
    if isinstance(obj, Problem):
        return problem_to_json(obj)
    if isinstance(obj, Solution):
        return solution_to_json(obj)
    if isinstance(obj, Bundle):
        return {
            "schema": SCHEMA,
            "kind": "bundle",
            "problem": problem_to_json(obj.problem),
            "solution": solution_to_json(obj.solution),
        }
    raise TypeError(f"cannot dump a {type(obj).__name__}")


def dumps(obj: Problem | Solution | Bundle | tuple, *, indent: int | None = None, shared: bool = False) -> str:
    """The JSON text of a dump (strict JSON: no NaN/Infinity literals);
    ``shared``: a problem's repeated numbers once (see :func:`problem_to_json`)."""
    separators = (",", ":") if indent is None else None
    d = problem_to_json(obj, shared=True) if shared and isinstance(obj, Problem) else to_json(obj)
    return json.dumps(d, allow_nan=False, indent=indent, separators=separators)


def dump(
    obj: Problem | Solution | Bundle | tuple,
    path: str | os.PathLike,
    *,
    shared: bool = False,
    extra: dict | None = None,
) -> None:
    """Write ``obj`` (see :func:`to_json`) to ``path`` as JSON, gzip when the
    name ends in ``.gz``, through a temporary file and ``os.replace`` (no
    half-written or stale file is ever left). ``extra``: more top-level keys
    (e.g. a ``status`` saying why a solve failed); loading ignores them."""
    if extra:
        d = problem_to_json(obj, shared=True) if shared and isinstance(obj, Problem) else to_json(obj)
        d.update(extra)
        text = json.dumps(d, allow_nan=False, separators=(",", ":"))
    else:
        text = dumps(obj, shared=shared)
    data = (text + "\n").encode("utf-8")
    path = os.fspath(path)
    if path.endswith(".gz"):
        import gzip

        data = gzip.compress(data, compresslevel=1, mtime=0)
    directory = os.path.dirname(os.path.abspath(path))
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=directory)
    try:
        # mkstemp makes the file 0600; give it the mode open() would (0666 less the umask)
        umask = os.umask(0o022)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
