"""Re-solve a dumped problem: ``python -m solver DUMP.json``.

The dump is a problem, or a bundle (problem plus the solution found when it
was written), as written by :func:`solver.serialize.dump`. Prints a summary:
status, objective (unary + edge), gap, timings per phase, ILP size, what
presolve shrank, and for a bundle whether the new objective matches the
dumped one. Costs are seconds (the planner's step-time estimates): they are
printed with their unit, in the planner's unit system (``382.6 ms``).

Exit status: 0 solved, 1 infeasible or no solution found, 2 bad arguments or
malformed dump.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

from .problem import ProblemError, Solution
from .serialize import Bundle, DumpError, dump, load
from .units import percent, seconds

EXIT_OK, EXIT_NO_SOLUTION, EXIT_BAD_INPUT = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m solver",
        description="Re-solve a problem dump (or the problem inside a bundle) and print a summary.",
    )
    parser.add_argument("dump", help="problem or bundle JSON written by solver.serialize.dump")
    parser.add_argument(
        "--backend", choices=["highs", "cbc"], default=None, help="ILP backend (default: the fastest available)"
    )
    parser.add_argument(
        "--time-limit",
        type=_positive_seconds,
        default=None,
        metavar="S",
        help="stop after S seconds (> 0) with the best solution found",
    )
    parser.add_argument(
        "--gap",
        type=_relative_gap,
        default=None,
        metavar="G",
        help="stop at relative optimality gap G (0 <= G < 1, e.g. 0.01)",
    )
    parser.add_argument("--no-presolve", action="store_true", help="solve the problem as is")
    parser.add_argument(
        "--output", metavar="SOLUTION.json", help="write the new solution (as a bundle with the problem)"
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log solver progress (-vv for debug)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
        format="%(levelname)s %(name)s: %(message)s",
    )

    try:
        obj = load(args.dump)
    except OSError as exc:
        return _error(f"cannot read {args.dump}: {exc.strerror or exc}", EXIT_BAD_INPUT)
    except DumpError as exc:
        return _error(f"malformed dump: {exc}", EXIT_BAD_INPUT)
    except Exception as exc:  # noqa: BLE001 -- any other fault in the input is still rc 2
        logging.getLogger(__name__).debug("loading %s failed", args.dump, exc_info=True)
        return _error(f"malformed dump: {args.dump}: {type(exc).__name__}: {exc}", EXIT_BAD_INPUT)
    previous: Solution | None = None
    if isinstance(obj, Bundle):
        problem, previous = obj.problem, obj.solution
    elif isinstance(obj, Solution):
        return _error(
            f"{args.dump} holds a solution only; re-solving needs a problem or a bundle",
            EXIT_BAD_INPUT,
        )
    else:
        problem = obj

    from .api import solve  # after loading: a malformed dump fails fast
    from .backends import SolverError
    from .diagnose import InfeasibleError

    print(f"problem {problem.name or '(unnamed)'} from {args.dump}")
    print(
        f"  {len(problem.decisions)} decisions, "
        f"{sum(d.num_options for d in problem.decisions)} options, "
        f"{len(problem.edges)} edges, {len(problem.pins)} pins, "
        f"{len(problem.links)} links, {len(problem.resources)} resource constraints"
    )
    try:
        sol = solve(
            problem,
            backend=args.backend,
            time_limit=args.time_limit,
            rel_gap=args.gap,
            presolve=not args.no_presolve,
        )
    except InfeasibleError as exc:
        return _error(str(exc), EXIT_NO_SOLUTION)
    except SolverError as exc:
        return _error(f"no solution: {exc}", EXIT_NO_SOLUTION)
    except (ProblemError, ValueError) as exc:
        return _error(f"cannot solve: {exc}", EXIT_BAD_INPUT)

    print(summary(sol))
    if previous is not None:
        print(compare(previous, sol))
    if args.output:
        dump(Bundle(problem, sol), args.output)
        print(f"wrote {args.output}")
    return EXIT_OK


def summary(sol: Solution) -> str:
    """A few lines describing ``sol`` (status, costs, timings, size, presolve)."""
    lines = [
        f"status     {sol.status} ({sol.backend}), gap {percent(sol.gap)}"
        + ("" if sol.bound is None or sol.optimal else f", bound {seconds(sol.bound)}"),
        f"objective  {seconds(sol.objective)} = unary {seconds(sol.unary_cost)} + edge {seconds(sol.edge_cost)}"
        f" (exactly {sol.objective:.9g} s)",
        f"ILP        {sol.num_variables} variables, {sol.num_constraints} constraints",
        "timings    " + ", ".join(f"{k} {seconds(v)}" for k, v in sol.timings.items()),
    ]
    s = sol.presolve
    if s is None:
        lines.append("presolve   off")
    else:
        lines += [
            f"presolve   decisions {s.decisions_before} -> {s.decisions_after}, "
            f"options {s.options_before} -> {s.options_after}, "
            f"edges {s.edges_before} -> {s.edges_after}, pairs {s.pairs_before} -> {s.pairs_after}",
            f"           {s.merged_by_links} merged by links, {s.decisions_fixed} fixed, "
            f"{s.decisions_eliminated} eliminated; options removed: "
            f"{s.options_removed_forbidden} forbidden, {s.options_removed_dominated} dominated",
        ]
    return "\n".join(lines)


def compare(previous: Solution, new: Solution, rel_tol: float = 1e-6) -> str:
    """One line: does ``new`` reach the objective of the dumped ``previous``?"""
    a, b = previous.objective, new.objective
    same = math.isclose(a, b, rel_tol=rel_tol, abs_tol=rel_tol)
    if same:
        verdict = "matches"
    elif b < a:
        verdict = f"is better by {seconds(a - b)}"
    else:
        verdict = f"is WORSE by {seconds(b - a)}"
    changed = sum(1 for k, v in new.choice.items() if previous.choice.get(k) != v)
    return (
        f"dumped     objective {seconds(a)} ({previous.status}, {previous.backend or '?'}): "
        f"new objective {verdict}; {changed} decisions chose differently"
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value > 0):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _relative_gap(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a relative gap such as 0.01, got {text!r}") from None
    if not (0.0 <= value < 1.0):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (e.g. 0.01 for 1%), got {text!r}")
    return value


def _error(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
