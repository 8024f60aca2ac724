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
import itertools
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Union

from .problem import (
    Decision,
    Edge,
    Link,
    Pin,
    PresolveStats,
    Problem,
    ProblemError,
    ResourceConstraint,
    Solution,
)

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

SCHEMA = "autoparallel.solver/1"

_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


class DumpError(ValueError):
    """A dump is malformed; the message gives the JSON path of the fault."""


@dataclass
class Bundle:
    """A problem together with a solution of it (one dump file)."""

    problem: Problem
    solution: Solution


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
            out[k] = _meta(v, _key(path, k))
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
        "decisions": [
            {"name": d.name, "options": list(d.options), "costs": _nums(d.costs)}
            for d in p.decisions
        ],
        "edges": [
            {
                "producer": e.producer,
                "consumer": e.consumer,
                "arg_index": e.arg_index,
                "costs": [_nums(row) for row in e.costs],
            }
            for e in p.edges
        ],
        "pins": [
            {"name": pin.name, "decision": pin.decision, "allowed": list(pin.allowed)}
            for pin in p.pins
        ],
        "links": [
            {"name": link.name, "a": link.a, "b": link.b, "mapping": list(link.mapping)}
            for link in p.links
        ],
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


def dumps(
    obj: Problem | Solution | Bundle | tuple, *, indent: int | None = None, shared: bool = False
) -> str:
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
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ------------------------------------------------------------------ decoding

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _key(path: str, key: str) -> str:
    return f"{path}.{key}" if _IDENT.match(key) else f"{path}[{json.dumps(key)}]"


def _show(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, (str, int, float, bool, type(None))) else None
    if text is None:
        text = {dict: "an object", list: "an array"}.get(type(v), type(v).__name__)
    return text if len(text) <= 40 else text[:37] + "..."


def _fail(path: str, expected: str, got: Any) -> DumpError:
    return DumpError(f"{path}: expected {expected}, got {_show(got)}")


def _obj(v: Any, path: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    if not isinstance(v, dict):
        raise _fail(path, "an object", v)
    for k in required:
        if k not in v:
            raise DumpError(f"{path}: missing key {k!r}")
    allowed = set(required) | set(optional)
    for k in v:
        if k not in allowed:
            raise DumpError(f"{path}: unexpected key {k!r} (allowed: {', '.join(sorted(allowed))})")
    return v


def _list(v: Any, path: str) -> list:
    if not isinstance(v, list):
        raise _fail(path, "an array", v)
    return v


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise _fail(path, "a string", v)
    return v


def _int(v: Any, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(path, "an integer", v)
    return v


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise _fail(path, "true or false", v)
    return v


def _number(v: Any, path: str, special: tuple[str, ...] = ()) -> float | int:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    if isinstance(v, str) and v in special:
        return _NONFINITE[v]
    expected = "a number" + "".join(f' or "{s}"' for s in special)
    raise _fail(path, expected, v)


_DECODERS: dict[tuple[str, ...], dict] = {}


def _numbers(v: Any, path: str, special: tuple[str, ...] = ()) -> list:
    v = _list(v, path)
    types = set(map(type, v))
    if types <= _PLAIN:  # fast path: plain numbers (bool is not int here)
        return list(v)
    if special and types <= _PLAIN_OR_STR:  # "inf" among numbers: decode at C speed
        dec = _DECODERS.get(special) or _DECODERS.setdefault(
            special, {k: _NONFINITE[k] for k in special}
        )
        out = list(map(dec.get, v, v))
        if set(map(type, out)) <= _PLAIN:
            return out
    return [_number(x, f"{path}[{i}]", special) for i, x in enumerate(v)]


def _matrix(v: Any, path: str, special: tuple[str, ...]) -> list:
    """A list of number rows; whole-matrix checks at C speed, per row on error."""
    rows = _list(v, path)
    if set(map(type, rows)) <= {list}:
        types = set(map(type, itertools.chain.from_iterable(rows)))
        if types <= _PLAIN:
            return [r[:] for r in rows]
        if special and types <= _PLAIN_OR_STR:
            dec = _DECODERS.get(special) or _DECODERS.setdefault(
                special, {k: _NONFINITE[k] for k in special}
            )
            out = [list(map(dec.get, r, r)) for r in rows]
            if set(map(type, itertools.chain.from_iterable(out))) <= _PLAIN:
                return out
    return [_numbers(r, f"{path}[{i}]", special) for i, r in enumerate(rows)]


_PLAIN = {float, int}
_PLAIN_OR_STR = {float, int, str}


def _unmeta(v: Any) -> Any:
    if isinstance(v, dict):
        if len(v) == 1 and "$float" in v and v["$float"] in _NONFINITE:
            return _NONFINITE[v["$float"]]
        return {k: _unmeta(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_unmeta(x) for x in v]
    return v


def _header(d: Any, kind: str, path: str, nested: bool = False) -> None:
    if not isinstance(d, dict):
        raise _fail(path, "an object", d)
    if "schema" not in d and not nested:
        raise DumpError(f"{path}: missing key 'schema' (expected {SCHEMA!r})")
    if "schema" in d and d["schema"] != SCHEMA:
        raise DumpError(
            f"{path}.schema: unsupported schema {_show(d['schema'])}, expected {SCHEMA!r}"
        )
    if "kind" not in d and not nested:
        raise DumpError(f"{path}: missing key 'kind'")
    if "kind" in d and d["kind"] != kind:
        raise DumpError(f"{path}.kind: expected {kind!r}, got {_show(d['kind'])}")


_HEADER = ("schema", "kind")


def _shared(tables: Any, path: str) -> dict:
    """The ``tables`` of a shared dump, checked and decoded once."""
    if tables is None:
        return {}
    _obj(tables, path, (), ("options", "rows", "matrices"))
    out = {
        "options": [
            [_str(o, f"{path}.options[{i}][{j}]") for j, o in enumerate(_list(x, f"{path}.options[{i}]"))]
            for i, x in enumerate(_list(tables.get("options", []), f"{path}.options"))
        ],
        "rows": [
            _numbers(x, f"{path}.rows[{i}]", ("inf",))
            for i, x in enumerate(_list(tables.get("rows", []), f"{path}.rows"))
        ],
        "matrices": [
            _matrix(x, f"{path}.matrices[{i}]", ("inf",))
            for i, x in enumerate(_list(tables.get("matrices", []), f"{path}.matrices"))
        ],
    }
    return out


def _deref(v: Any, tables: dict, table: str, path: str) -> Any:
    """``v`` itself, or (an int in a shared dump) entry ``v`` of ``table``
    (a copy: decisions must not share lists the caller may edit)."""
    if isinstance(v, int) and not isinstance(v, bool):
        items = tables.get(table)
        if items is None:
            raise DumpError(f"{path}: an index ({v}) but the dump has no tables.{table}")
        if not 0 <= v < len(items):
            raise DumpError(f"{path}: index {v} out of range of tables.{table} (0..{len(items) - 1})")
        item = items[v]
        return [list(r) for r in item] if table == "matrices" else list(item)
    return None


def _problem(d: Any, path: str, nested: bool = False) -> Problem:
    _header(d, "problem", path, nested)
    _obj(d, path, ("decisions",), (*_HEADER, "name", "metadata", "edges", "pins", "links",
                                    "resources", "tables", "status"))
    tables = _shared(d.get("tables"), f"{path}.tables")
    decisions = []
    for i, x in enumerate(_list(d["decisions"], f"{path}.decisions")):
        where = f"{path}.decisions[{i}]"
        _obj(x, where, ("name", "options", "costs"))
        options = _deref(x["options"], tables, "options", f"{where}.options")
        if options is None:
            options = [
                _str(o, f"{where}.options[{j}]") for j, o in enumerate(_list(x["options"], f"{where}.options"))
            ]
        costs = _deref(x["costs"], tables, "rows", f"{where}.costs")
        if costs is None:
            costs = _numbers(x["costs"], f"{where}.costs", ("inf",))
        decisions.append(Decision(_str(x["name"], f"{where}.name"), options, costs))
    edges = []
    for k, x in enumerate(_list(d.get("edges", []), f"{path}.edges")):
        where = f"{path}.edges[{k}]"
        _obj(x, where, ("producer", "consumer", "arg_index", "costs"))
        costs = _deref(x["costs"], tables, "matrices", f"{where}.costs")
        if costs is None:
            costs = _matrix(x["costs"], f"{where}.costs", ("inf",))
        edges.append(
            Edge(
                _str(x["producer"], f"{where}.producer"),
                _str(x["consumer"], f"{where}.consumer"),
                _int(x["arg_index"], f"{where}.arg_index"),
                costs,
            )
        )
    pins = []
    for k, x in enumerate(_list(d.get("pins", []), f"{path}.pins")):
        where = f"{path}.pins[{k}]"
        _obj(x, where, ("name", "decision", "allowed"))
        allowed = [
            _int(o, f"{where}.allowed[{j}]")
            for j, o in enumerate(_list(x["allowed"], f"{where}.allowed"))
        ]
        pins.append(Pin(_str(x["name"], f"{where}.name"), _str(x["decision"], f"{where}.decision"), allowed))
    links = []
    for k, x in enumerate(_list(d.get("links", []), f"{path}.links")):
        where = f"{path}.links[{k}]"
        _obj(x, where, ("name", "a", "b", "mapping"))
        mapping = [
            None if o is None else _int(o, f"{where}.mapping[{j}]")
            for j, o in enumerate(_list(x["mapping"], f"{where}.mapping"))
        ]
        links.append(
            Link(
                _str(x["name"], f"{where}.name"),
                _str(x["a"], f"{where}.a"),
                _str(x["b"], f"{where}.b"),
                mapping,
            )
        )
    resources = []
    for k, x in enumerate(_list(d.get("resources", []), f"{path}.resources")):
        where = f"{path}.resources[{k}]"
        _obj(x, where, ("name", "terms"), ("low", "high"))
        terms_in = x["terms"]
        if not isinstance(terms_in, dict):
            raise _fail(f"{where}.terms", "an object", terms_in)
        terms = {}
        for name, w in terms_in.items():
            row = _deref(w, tables, "rows", _key(f"{where}.terms", name))
            terms[name] = row if row is not None else _numbers(w, _key(f"{where}.terms", name))
        bounds = []
        for b in ("low", "high"):
            v = x.get(b)
            bounds.append(None if v is None else _number(v, f"{where}.{b}", ("inf", "-inf")))
        resources.append(ResourceConstraint(_str(x["name"], f"{where}.name"), terms, *bounds))
    metadata = d.get("metadata", {})
    if not isinstance(metadata, dict):
        raise _fail(f"{path}.metadata", "an object", metadata)
    p = Problem(
        decisions=decisions,
        edges=edges,
        pins=pins,
        links=links,
        resources=resources,
        name=_str(d.get("name", ""), f"{path}.name"),
        metadata=_unmeta(metadata),
    )
    try:
        p.validate()
    except ProblemError as exc:
        raise DumpError(f"{path}: invalid problem: {exc}") from None
    return p


_STATS = {f.name for f in dataclasses.fields(PresolveStats)}


def _solution(d: Any, path: str, nested: bool = False) -> Solution:
    _header(d, "solution", path, nested)
    _obj(
        d,
        path,
        ("choice", "objective", "unary_cost", "edge_cost", "status", "optimal"),
        (*_HEADER, "gap", "backend", "timings", "num_variables", "num_constraints", "presolve"),
    )
    choice_in = d["choice"]
    if not isinstance(choice_in, dict):
        raise _fail(f"{path}.choice", "an object", choice_in)
    choice = {k: _int(v, _key(f"{path}.choice", k)) for k, v in choice_in.items()}
    special = ("inf", "-inf", "nan")
    timings_in = d.get("timings", {})
    if not isinstance(timings_in, dict):
        raise _fail(f"{path}.timings", "an object", timings_in)
    stats = None
    if d.get("presolve") is not None:
        where = f"{path}.presolve"
        x = _obj(d["presolve"], where, (), tuple(sorted(_STATS)))
        stats = PresolveStats(**{k: _int(v, f"{where}.{k}") for k, v in x.items()})
    gap = d.get("gap")
    return Solution(
        choice=choice,
        objective=_number(d["objective"], f"{path}.objective", special),
        unary_cost=_number(d["unary_cost"], f"{path}.unary_cost", special),
        edge_cost=_number(d["edge_cost"], f"{path}.edge_cost", special),
        status=_str(d["status"], f"{path}.status"),
        optimal=_bool(d["optimal"], f"{path}.optimal"),
        gap=None if gap is None else _number(gap, f"{path}.gap", special),
        backend=_str(d.get("backend", ""), f"{path}.backend"),
        timings={
            k: _number(v, _key(f"{path}.timings", k), special) for k, v in timings_in.items()
        },
        num_variables=_int(d.get("num_variables", 0), f"{path}.num_variables"),
        num_constraints=_int(d.get("num_constraints", 0), f"{path}.num_constraints"),
        presolve=stats,
    )


def _bundle(d: Any, path: str) -> Bundle:
    _header(d, "bundle", path)
    _obj(d, path, ("problem", "solution"), _HEADER)
    p = _problem(d["problem"], f"{path}.problem", nested=True)
    s = _solution(d["solution"], f"{path}.solution", nested=True)
    by = p.decision_index()
    where = f"{path}.solution.choice"
    for name, o in s.choice.items():
        if name not in by:
            raise DumpError(f"{_key(where, name)}: no decision {name!r} in the problem")
        if not 0 <= o < by[name].num_options:
            raise DumpError(
                f"{_key(where, name)}: option {o} out of range 0..{by[name].num_options - 1}"
            )
    missing = [d.name for d in p.decisions if d.name not in s.choice]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise DumpError(
            f"{where}: no option for decision(s) {', '.join(map(repr, missing[:3]))}{more}"
        )
    return Bundle(p, s)


def problem_from_json(d: Any) -> Problem:
    """Rebuild a problem from :func:`problem_to_json` output; :class:`DumpError` if malformed."""
    return _problem(d, "$")


def solution_from_json(d: Any) -> Solution:
    """Rebuild a solution from :func:`solution_to_json` output; :class:`DumpError` if malformed."""
    return _solution(d, "$")


def from_json(d: Any) -> Union[Problem, Solution, Bundle]:
    """Rebuild whatever the dump holds, dispatching on its ``kind``."""
    if not isinstance(d, dict):
        raise _fail("$", "an object", d)
    if "schema" not in d:
        raise DumpError(f"$: missing key 'schema' (expected {SCHEMA!r}); not a solver dump?")
    if d["schema"] != SCHEMA:
        raise DumpError(f"$.schema: unsupported schema {_show(d['schema'])}, expected {SCHEMA!r}")
    kind = d.get("kind")
    if kind == "problem":
        return _problem(d, "$")
    if kind == "solution":
        return _solution(d, "$")
    if kind == "bundle":
        return _bundle(d, "$")
    if "kind" not in d:
        raise DumpError("$: missing key 'kind'")
    raise DumpError(f'$.kind: expected "problem", "solution" or "bundle", got {_show(kind)}')


def load(path: str | os.PathLike) -> Union[Problem, Solution, Bundle]:
    """Read a dump written by :func:`dump`.

    Raises :class:`DumpError` when the file is not valid JSON or not a valid
    dump (the message names the file and the JSON path of the fault).
    """
    where = os.fspath(path)
    if where.endswith(".gz"):
        import gzip

        with gzip.open(path, "rb") as f:
            raw = f.read()
    else:
        with open(path, "rb") as f:
            raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DumpError(
            f"{where}: not a JSON text file (byte {exc.start} is not UTF-8); "
            "expected a dump written by solver.serialize.dump"
        ) from None
    try:
        d = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise DumpError(f"{where}: not valid JSON: {exc}") from None
    except DumpError as exc:
        raise DumpError(f"{where}: {exc}") from None
    except RecursionError:
        raise DumpError(f"{where}: JSON nested too deeply to be a solver dump") from None
    try:
        return from_json(d)
    except DumpError as exc:
        raise DumpError(f"{where}: {exc}") from None
    except OverflowError:
        # An integer literal beyond float range (JSON allows any digits).
        raise DumpError(
            f"{where}: {_huge_int_path(d) or '$'}: number too large for a float "
            f'(at most {sys.float_info.max:.3g}; write infinity as the string "inf")'
        ) from None


def _huge_int_path(v: Any, path: str = "$") -> str | None:
    """The JSON path of the first integer that does not fit a float."""
    if isinstance(v, int) and not isinstance(v, bool):
        try:
            float(v)
        except OverflowError:
            return path
        return None
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        found = _huge_int_path(x, _key(path, k) if isinstance(k, str) else f"{path}[{k}]")
        if found:
            return found
    return None


def _reject_constant(name: str):
    raise DumpError(f'non-standard JSON constant {name} (write infinity as the string "inf")')
