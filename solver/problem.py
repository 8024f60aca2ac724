"""The placement problem as the solver sees it: plain dataclasses, no torch.

A :class:`Problem` has one :class:`Decision` per graph node. A decision picks
exactly one of its options; each option has a unary cost (compute). An
:class:`Edge` from a producer decision to a consumer decision carries a cost
matrix ``costs[producer_option][consumer_option]`` (communication plus a
transition tie-break). Infinite costs forbid an option or an option pair.

Constraints each carry a user-facing ``name``; constraints sharing a name form
one group, and infeasibility diagnosis reports groups by that name:

* :class:`Pin` restricts a decision to a subset of its options.
* :class:`Link` says two decisions take "the same" option, via an explicit
  mapping between their option lists (repeated layers, forward/backward pairs).
* :class:`ResourceConstraint` bounds a weighted sum over chosen options
  (the parameter-memory budget).

Example::

    >>> p = Problem(
    ...     decisions=[Decision("a", ["R", "S0"], [1.0, 0.5]),
    ...                Decision("b", ["R", "S0"], [1.0, 0.5])],
    ...     edges=[Edge("a", "b", 0, [[0.0, 0.0], [2.0, 0.0]])],
    ... )
    >>> p.validate()
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

INF = math.inf


class ProblemError(ValueError):
    """A problem is malformed (unknown decision, wrong matrix shape, ...)."""


@dataclass
class Decision:
    """One graph node's choice among ``options`` (labels, used in dumps).

    An option's id is its index in ``options``; ``costs[i]`` is its unary
    cost, ``math.inf`` meaning the option is forbidden.
    """

    name: str
    options: list[str]
    costs: list[float]

    @property
    def num_options(self) -> int:
        return len(self.options)


@dataclass
class Edge:
    """Data flows from ``producer`` into argument ``arg_index`` of ``consumer``.

    ``costs[i][j]`` is paid when the producer takes option ``i`` and the
    consumer option ``j``; ``math.inf`` forbids the pair.
    """

    producer: str
    consumer: str
    arg_index: int
    costs: list[list[float]]


@dataclass
class Pin:
    """Decision ``decision`` may only take one of ``allowed`` (option ids)."""

    name: str
    decision: str
    allowed: list[int]


@dataclass
class Link:
    """Decisions ``a`` and ``b`` take corresponding options.

    ``mapping[i]`` is the option of ``b`` that corresponds to option ``i`` of
    ``a``, or ``None`` when option ``i`` of ``a`` has no counterpart (and is
    therefore forbidden). Options of ``b`` outside the mapping's image are
    forbidden too. The mapping must be injective.
    """

    name: str
    a: str
    b: str
    mapping: list[int | None]


@dataclass
class ResourceConstraint:
    """``low <= sum over terms of weights[chosen option] <= high``.

    ``terms`` maps a decision name to one weight per option of that decision.
    Either bound may be ``None`` (unbounded).
    """

    name: str
    terms: dict[str, list[float]]
    low: float | None = None
    high: float | None = None


@dataclass
class Problem:
    decisions: list[Decision]
    edges: list[Edge] = field(default_factory=list)
    pins: list[Pin] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    resources: list[ResourceConstraint] = field(default_factory=list)
    name: str = ""
    # Free-form, JSON-serialisable context for dumps (model, mesh, ...).
    metadata: dict = field(default_factory=dict)

    def decision_index(self) -> dict[str, Decision]:
        return {d.name: d for d in self.decisions}

    def constraint_names(self) -> list[str]:
        """User-facing constraint group names, in first-appearance order."""
        names: dict[str, None] = {}
        for c in [*self.pins, *self.links, *self.resources]:
            names.setdefault(c.name, None)
        return list(names)

    def validate(self) -> None:
        """Raise :class:`ProblemError` naming the first inconsistency found."""
        self._validate(edge_costs=True)

    def _validate(self, edge_costs: bool) -> None:
        """:meth:`validate`; ``edge_costs=False`` skips reading the edges' cost
        matrices (their shapes and entries), for a caller that checks them
        itself (:func:`solver.presolve.presolve` with ``check_costs=True``).
        When that finds nothing wrong, :meth:`validate` may still raise an
        earlier error about a matrix."""
        by_name = _checked_decisions(self.decisions)
        _check_edges(self.edges, by_name, edge_costs)
        _check_pins(self.pins, by_name)
        _check_links(self.links, by_name)
        _check_resources(self.resources, by_name)


def _checked_decisions(decisions: list[Decision]) -> dict[str, Decision]:
    """The decisions by name, each checked (unique name, options, one valid
    cost per option)."""
    by_name: dict[str, Decision] = {}
    for i, d in enumerate(decisions):
        if d.name not in by_name and d.options and len(d.costs) == len(d.options) and _all_costs(d.costs):
            by_name[d.name] = d
            continue  # fast path: the checks below, without building messages
        where = f"decision {d.name!r} (#{i})"
        if d.name in by_name:
            raise ProblemError(f"{where}: duplicate decision name")
        if not d.options:
            raise ProblemError(f"{where}: has no options")
        if len(d.costs) != len(d.options):
            raise ProblemError(f"{where}: {len(d.costs)} costs for {len(d.options)} options")
        if not _all_costs(d.costs):
            for j, c in enumerate(d.costs):
                _check_cost(c, f"{where}, option {j}")
        by_name[d.name] = d
    return by_name


def _lookup(by_name: dict[str, Decision], name: str, where: str) -> Decision:
    if name not in by_name:
        raise ProblemError(f"{where}: unknown decision {name!r}")
    return by_name[name]


def _check_edges(edges: list[Edge], by_name: dict[str, Decision], edge_costs: bool) -> None:
    """Edges between two distinct known decisions, with (when
    ``edge_costs``) a well-formed cost matrix of their shape."""
    # Matrices already found well-formed, by id, with their shape: repeated
    # layers share one matrix object, read once instead of once per layer.
    checked: dict[int, tuple[int, int]] = {}
    for k, e in enumerate(edges):
        p = by_name.get(e.producer)
        c = by_name.get(e.consumer)
        if p is not None and c is not None and p is not c:
            if not edge_costs:
                continue
            shape = (len(p.options), len(c.options))
            if checked.get(id(e.costs)) == shape:
                continue
            if _matrix_ok(e.costs, *shape):
                checked[id(e.costs)] = shape
                continue  # fast path: big problems have millions of entries
        where = f"edge #{k} ({e.producer!r} -> {e.consumer!r})"
        p = _lookup(by_name, e.producer, where)
        c = _lookup(by_name, e.consumer, where)
        if e.producer == e.consumer:
            raise ProblemError(f"{where}: self-loop")
        if len(e.costs) != p.num_options:
            raise ProblemError(f"{where}: cost matrix has {len(e.costs)} rows, producer has {p.num_options} options")
        n_c = c.num_options
        for i, row in enumerate(e.costs):
            if len(row) != n_c:
                raise ProblemError(f"{where}: row {i} has {len(row)} entries, consumer has {n_c} options")
            if _all_costs(row):
                continue
            for j, v in enumerate(row):
                _check_cost(v, f"{where}, entry [{i}][{j}]")


def _check_pins(pins: list[Pin], by_name: dict[str, Decision]) -> None:
    for pin in pins:
        where = f"pin {pin.name!r} on {pin.decision!r}"
        d = _lookup(by_name, pin.decision, where)
        for o in pin.allowed:
            if not isinstance(o, int) or not 0 <= o < d.num_options:
                raise ProblemError(f"{where}: option {o!r} out of range 0..{d.num_options - 1}")


def _check_links(links: list[Link], by_name: dict[str, Decision]) -> None:
    """Links between two distinct known decisions, each mapping an
    injective map of ``a``'s options into ``b``'s (``None``: unmapped)."""
    ranges: dict[int, list[int]] = {}  # n -> list(range(n))
    for link in links:
        a = by_name.get(link.a)
        b = by_name.get(link.b)
        if a is not None and b is not None and a is not b and _link_ok(link, a, b, ranges):
            continue  # fast path
        where = f"link {link.name!r} ({link.a!r} ~ {link.b!r})"
        a = _lookup(by_name, link.a, where)
        b = _lookup(by_name, link.b, where)
        if link.a == link.b:
            raise ProblemError(f"{where}: links a decision to itself")
        if len(link.mapping) != a.num_options:
            raise ProblemError(
                f"{where}: mapping has {len(link.mapping)} entries, {link.a!r} has {a.num_options} options"
            )
        seen: set[int] = set()
        for i, o in enumerate(link.mapping):
            if o is None:
                continue
            if not isinstance(o, int) or not 0 <= o < b.num_options:
                raise ProblemError(f"{where}: mapping[{i}] = {o!r} out of range 0..{b.num_options - 1}")
            if o in seen:
                raise ProblemError(f"{where}: mapping is not injective ({o} twice)")
            seen.add(o)


def _link_ok(link: Link, a: Decision, b: Decision, ranges: dict[int, list[int]]) -> bool:
    """The checks of :func:`_check_links` at C speed, without messages."""
    n = len(a.options)
    if n == len(b.options):
        ident = ranges.get(n) or ranges.setdefault(n, list(range(n)))
        # Identity (repeated layers): entries equal to 0..n-1 whose
        # sum is a plain int are ints (a float, numpy integer or
        # Fraction would make the sum one), at C speed.
        if link.mapping == ident and type(sum(link.mapping)) is int:
            return True
    vals = link.mapping
    if None in vals:
        vals = [o for o in vals if o is not None]
    return len(link.mapping) == len(a.options) and (
        not vals
        or (
            set(map(type, vals)) == {int}
            and 0 <= min(vals)
            and max(vals) < len(b.options)
            and len(set(vals)) == len(vals)
        )
    )


def _check_resources(resources: list[ResourceConstraint], by_name: dict[str, Decision]) -> None:
    """One finite weight per option of each known decision, numeric bounds."""
    for r in resources:
        where = f"resource constraint {r.name!r}"
        for name, weights in r.terms.items():
            d = _lookup(by_name, name, where)
            if len(weights) != d.num_options:
                raise ProblemError(f"{where}: {len(weights)} weights for {name!r}, which has {d.num_options} options")
            for j, w in enumerate(weights):
                if not isinstance(w, (int, float)) or not math.isfinite(w):
                    raise ProblemError(f"{where}: weight {w!r} for {name!r}[{j}]")
        for bound in (r.low, r.high):
            if bound is not None and (not isinstance(bound, (int, float)) or math.isnan(bound)):
                raise ProblemError(f"{where}: bound {bound!r} is not a number")


def _matrix_ok(costs: list, n_rows: int, n_cols: int) -> bool:
    """Fast path of :meth:`Problem.validate`'s cost matrix check: ``costs`` has
    ``n_rows`` rows of ``n_cols`` entries, each a number or ``+inf``. False
    does not mean malformed (e.g. numpy floats take the slow path)."""
    return len(costs) == n_rows and set(map(len, costs)) == {n_cols} and _all_costs(costs, nested=True)


def _all_costs(values: list, nested: bool = False) -> bool:
    """Fast path of :func:`_check_cost` over a list (of lists), at C speed.

    True when the sum is a plain float or int that is neither NaN nor -inf:
    then no entry is NaN or -inf (they would propagate) and no entry is a
    string or None (summing would fail). Otherwise check one by one.
    """
    try:
        total = sum(map(sum, values)) if nested else sum(values)
    except (TypeError, OverflowError):
        return False
    if type(total) is int:  # all integers: each must fit a float
        return abs(total) <= _FLOAT_MAX
    return type(total) is float and total == total and total != -INF


_FLOAT_MAX = sys.float_info.max


def _check_cost(value: float, where: str) -> None:
    if isinstance(value, int) and abs(value) > _FLOAT_MAX:  # JSON allows any digits
        raise ProblemError(
            f"{where}: cost is an integer of {len(str(abs(value)))} digits, too large for a float "
            f"(at most {_FLOAT_MAX:.3g}; +inf forbids an option)"
        )
    if not isinstance(value, (int, float)) or math.isnan(value) or value == -INF:
        raise ProblemError(f"{where}: cost {value!r} is not a number or +inf")


@dataclass
class PresolveStats:
    """How much presolve shrank a problem."""

    decisions_before: int = 0
    decisions_after: int = 0
    options_before: int = 0
    options_after: int = 0
    edges_before: int = 0
    edges_after: int = 0
    # Option pairs over all edge matrices (pairwise variables before encoding).
    pairs_before: int = 0
    pairs_after: int = 0
    merged_by_links: int = 0
    options_removed_forbidden: int = 0
    options_removed_dominated: int = 0
    # Decisions decided by presolve: one option left (fixed), or folded into
    # their neighbours (eliminated); edges folded into unary costs.
    decisions_fixed: int = 0
    decisions_eliminated: int = 0
    edges_folded: int = 0
    # Option pairs forbidden because no optimum uses them (presolve).
    pairs_removed_dominated: int = 0


@dataclass
class Solution:
    """The solver's answer.

    ``choice`` maps every decision name to its chosen option id. ``status`` is
    ``"optimal"`` (proven) or ``"feasible"`` (time limit or gap reached with an
    incumbent). ``gap`` is the relative optimality gap reported by the backend
    (0.0 when proven optimal) and ``bound`` the proven lower bound: no choice
    costs less than ``bound``. ``stopped_by`` says why a solution not proven
    optimal stopped (``"work limit"`` or ``"time limit"``). ``timings`` maps phase names (``presolve``,
    ``build``, ``solve``, ...) to seconds.
    """

    choice: dict[str, int]
    objective: float
    unary_cost: float
    edge_cost: float
    status: str
    optimal: bool
    gap: float | None = None
    backend: str = ""
    # The backend's proven lower bound on the objective (true units); equal
    # to the objective when optimal, ``None`` when the backend gave none.
    bound: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    num_variables: int = 0
    num_constraints: int = 0
    presolve: PresolveStats | None = None
    # Why a solution not proven optimal stopped: "work limit" (a count: the
    # same on every run) or "time limit" (the wall-clock safety cap: may
    # depend on the machine's load); None when optimal (solver.work).
    stopped_by: str | None = None
