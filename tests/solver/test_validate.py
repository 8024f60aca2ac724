"""Problem.validate's errors, and solve() reporting the same ones with and
without presolve (which checks edge matrices itself, reading equal copies of
a repeated layer's matrix once)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from solver import solve
from solver.presolve import presolve
from solver.problem import INF, Decision, Edge, Link, Pin, Problem, ProblemError

M = [[0.0, 2.0, 1.0], [2.0, 0.0, 3.0]]


def layers(n: int = 3, *, diag: bool = False) -> Problem:
    """``n`` linked layers a -> b, each edge matrix a deep copy of ``M``."""
    decisions, edges, links = [], [], []
    for k in range(n):
        decisions.append(Decision(f"a{k}", ["R", "S"], [1.0, 0.5]))
        decisions.append(Decision(f"b{k}", ["R", "S", "P"], [1.0, 0.5, 0.7]))
        edges.append(Edge(f"a{k}", f"b{k}", 0, copy.deepcopy(M)))
        if k:
            links.append(Link("layers", f"a{k - 1}", f"a{k}", [0, 1]))
            links.append(Link("layers", f"b{k - 1}", f"b{k}", [0, 1, 2]))
    if diag:  # an edge between two linked decisions: only its diagonal is paid
        edges.append(Edge("a0", "a1", 0, [[0.0, 1.0], [1.0, 0.0]]))
    return Problem(decisions, edges, links=links)


def errors(p: Problem) -> list[str]:
    """The message of Problem.validate, solve() without and with presolve."""
    out = []
    for f in (p.validate, lambda: solve(p, presolve=False), lambda: solve(p)):
        with pytest.raises(ProblemError) as exc:
            f()
        out.append(str(exc.value))
    return out


def test_valid_layers_agree():
    p = layers()
    a, b = solve(p, presolve=False), solve(p)
    assert a.objective == pytest.approx(b.objective)
    assert b.presolve.pairs_before == 3 * 6


@pytest.mark.parametrize(
    "bad, message",
    [
        (math.nan, "entry [1][0]: cost nan is not a number or +inf"),
        (-INF, "entry [1][0]: cost -inf is not a number or +inf"),
        ("1.0", "entry [1][0]: cost '1.0' is not a number or +inf"),
        (None, "entry [1][0]: cost None is not a number or +inf"),
    ],
)
@pytest.mark.parametrize("k", [0, 1, 2])
def test_bad_entry_in_one_copy_names_its_edge(bad, message, k):
    p = layers()
    p.edges[k].costs[1][0] = bad  # one copy differs: it must be checked
    msgs = errors(p)
    assert msgs == [f"edge #{k} ('a{k}' -> 'b{k}'), {message}"] * 3


def test_bad_entries_in_every_copy_name_the_first():
    p = layers()
    for e in p.edges:
        e.costs[0][2] = math.nan  # the copies are still equal (nan != nan though)
    assert errors(p) == ["edge #0 ('a0' -> 'b0'), entry [0][2]: cost nan is not a number or +inf"] * 3
    p = layers()
    for e in p.edges[1:]:
        e.costs[0][2] = "x"  # equal to each other, not to the first
    assert errors(p) == ["edge #1 ('a1' -> 'b1'), entry [0][2]: cost 'x' is not a number or +inf"] * 3


def test_bad_shapes_in_one_copy():
    p = layers()
    p.edges[2].costs[1] = [2.0, 0.0]
    assert errors(p) == ["edge #2 ('a2' -> 'b2'): row 1 has 2 entries, consumer has 3 options"] * 3
    p = layers()
    p.edges[1].costs.append([0.0, 0.0, 0.0])
    assert errors(p) == ["edge #1 ('a1' -> 'b1'): cost matrix has 3 rows, producer has 2 options"] * 3


def test_bad_entry_on_an_edge_between_linked_decisions():
    p = layers(diag=True)
    assert solve(p).objective == pytest.approx(solve(p, presolve=False).objective)
    p.edges[-1].costs[1][0] = math.nan  # off the diagonal: presolve would not read it
    assert errors(p) == ["edge #3 ('a0' -> 'a1'), entry [1][0]: cost nan is not a number or +inf"] * 3


def test_first_error_wins_across_kinds():
    # A matrix error comes before a pin's, a link's, a resource's ...
    p = layers()
    p.edges[1].costs[0][0] = math.nan
    p.pins.append(Pin("bad pin", "a0", [7]))
    p.links.append(Link("bad link", "a0", "b2", [0, 0]))
    msgs = errors(p)
    assert msgs == [msgs[0]] * 3 and msgs[0].startswith("edge #1 ")
    # ... and after a decision's.
    p.decisions[3].costs[0] = math.nan
    msgs = errors(p)
    assert msgs == [msgs[0]] * 3 and msgs[0].startswith("decision 'b1' (#3)")


def test_bad_matrix_reported_before_infeasibility_or_a_bad_backend():
    p = layers()
    p.decisions[0].costs = [INF, INF]  # presolve finds this before the edges
    p.edges[2].costs[0][1] = -INF
    assert len(set(errors(p))) == 1
    with pytest.raises(ProblemError, match="edge #2"):
        solve(p, backend="no such backend")
    with pytest.raises(ProblemError, match="edge #2"):
        presolve(p, check_costs=True)


def test_numpy_entries_are_valid_costs():
    p = layers()
    p.edges[1].costs = [[np.float64(x) for x in row] for row in M]  # slow path
    p.edges[2].costs = [[np.float64(x) for x in row] for row in M[::-1]]
    p.validate()
    assert solve(p).objective == pytest.approx(solve(p, presolve=False).objective)


@pytest.mark.parametrize("mapping", [[0.0, 1.0], [np.int64(0), np.int64(1)], [0, 1.0]])
def test_identity_like_mapping_of_non_ints_is_rejected(mapping):
    p = layers()
    p.links[0].mapping = mapping
    msgs = errors(p)
    assert msgs == [msgs[0]] * 3
    assert msgs[0].startswith("link 'layers' ('a0' ~ 'a1'): mapping[")


def test_bool_identity_mapping_still_accepted():
    p = layers()
    p.links[0].mapping = [False, True]  # bools are ints, as before
    p.validate()
    assert solve(p).objective == pytest.approx(solve(p, presolve=False).objective)


def test_mixed_identity_and_permuted_links():
    # One component with an identity and a permuting link, one identity only.
    p = layers(4)
    p.links[2] = Link("layers", "a1", "a2", [1, 0])
    p.edges[2].costs = [M[1], M[0]]
    p.decisions[4].costs = [0.5, 1.0]
    p.validate()
    a, b = solve(p, presolve=False), solve(p)
    assert a.objective == pytest.approx(b.objective)
    assert b.choice["a2"] == 1 - b.choice["a1"]


def test_copy_equal_to_a_checked_matrix_is_not_type_checked_by_presolve():
    # Documented (solver.presolve.presolve): presolve's check skips a matrix
    # equal to a checked one, so numpy integers equal to the float costs pass
    # there, while Problem.validate (and solve without presolve) reject them.
    p = layers()
    p.edges[1].costs = [[np.int64(x) for x in row] for row in M]
    with pytest.raises(ProblemError, match=r"edge #1 .*entry \[0\]\[0\]"):
        p.validate()
    with pytest.raises(ProblemError, match=r"edge #1 "):
        solve(p, presolve=False)
    assert solve(p).objective == pytest.approx(solve(layers()).objective)
