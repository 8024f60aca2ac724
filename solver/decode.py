"""Decoding of solver dumps (see :mod:`solver.serialize` for the format):
every field checked, errors as :class:`~solver.serialize.DumpError` naming
the JSON path and what was expected."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
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
from .dump_format import NONFINITE, SCHEMA, Bundle, DumpError, json_key

# ------------------------------------------------------------------ decoding


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
        return NONFINITE[v]
    expected = "a number" + "".join(f' or "{s}"' for s in special)
    raise _fail(path, expected, v)


_DECODERS: dict[tuple[str, ...], dict] = {}


def _numbers(v: Any, path: str, special: tuple[str, ...] = ()) -> list:
    v = _list(v, path)
    types = set(map(type, v))
    if types <= _PLAIN:  # fast path: plain numbers (bool is not int here)
        return list(v)
    if special and types <= _PLAIN_OR_STR:  # "inf" among numbers: decode at C speed
        dec = _DECODERS.get(special) or _DECODERS.setdefault(special, {k: NONFINITE[k] for k in special})
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
            dec = _DECODERS.get(special) or _DECODERS.setdefault(special, {k: NONFINITE[k] for k in special})
            out = [list(map(dec.get, r, r)) for r in rows]
            if set(map(type, itertools.chain.from_iterable(out))) <= _PLAIN:
                return out
    return [_numbers(r, f"{path}[{i}]", special) for i, r in enumerate(rows)]


_PLAIN = {float, int}
_PLAIN_OR_STR = {float, int, str}


def _unmeta(v: Any) -> Any:
    if isinstance(v, dict):
        if len(v) == 1 and "$float" in v and v["$float"] in NONFINITE:
            return NONFINITE[v["$float"]]
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
        raise DumpError(f"{path}.schema: unsupported schema {_show(d['schema'])}, expected {SCHEMA!r}")
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
    _obj(
        d,
        path,
        ("decisions",),
        (*_HEADER, "name", "metadata", "edges", "pins", "links", "resources", "tables", "status"),
    )
    tables = _shared(d.get("tables"), f"{path}.tables")
    decisions = []
    for i, x in enumerate(_list(d["decisions"], f"{path}.decisions")):
        where = f"{path}.decisions[{i}]"
        _obj(x, where, ("name", "options", "costs"))
        options = _deref(x["options"], tables, "options", f"{where}.options")
        if options is None:
            options = [_str(o, f"{where}.options[{j}]") for j, o in enumerate(_list(x["options"], f"{where}.options"))]
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
        allowed = [_int(o, f"{where}.allowed[{j}]") for j, o in enumerate(_list(x["allowed"], f"{where}.allowed"))]
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
            row = _deref(w, tables, "rows", json_key(f"{where}.terms", name))
            terms[name] = row if row is not None else _numbers(w, json_key(f"{where}.terms", name))
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
        (*_HEADER, "gap", "backend", "timings", "num_variables", "num_constraints", "presolve", "stopped_by"),
    )
    choice_in = d["choice"]
    if not isinstance(choice_in, dict):
        raise _fail(f"{path}.choice", "an object", choice_in)
    choice = {k: _int(v, json_key(f"{path}.choice", k)) for k, v in choice_in.items()}
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
        timings={k: _number(v, json_key(f"{path}.timings", k), special) for k, v in timings_in.items()},
        num_variables=_int(d.get("num_variables", 0), f"{path}.num_variables"),
        num_constraints=_int(d.get("num_constraints", 0), f"{path}.num_constraints"),
        presolve=stats,
        stopped_by=None if d.get("stopped_by") is None else _str(d["stopped_by"], f"{path}.stopped_by"),
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
            raise DumpError(f"{json_key(where, name)}: no decision {name!r} in the problem")
        if not 0 <= o < by[name].num_options:
            raise DumpError(f"{json_key(where, name)}: option {o} out of range 0..{by[name].num_options - 1}")
    missing = [d.name for d in p.decisions if d.name not in s.choice]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise DumpError(f"{where}: no option for decision(s) {', '.join(map(repr, missing[:3]))}{more}")
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
        found = _huge_int_path(x, json_key(path, k) if isinstance(k, str) else f"{path}[{k}]")
        if found:
            return found
    return None


def _reject_constant(name: str):
    raise DumpError(f'non-standard JSON constant {name} (write infinity as the string "inf")')
