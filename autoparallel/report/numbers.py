"""One set of numbers for a plan: estimated step time, collectives, memory,
pass stats as short tables with rounded figures."""

from __future__ import annotations

from ..passes import stats_to_json
from . import units


def step_estimate(plan) -> dict[str, float | None]:
    """Seconds per step and rank. ``exposed_after`` / ``exposed_before``:
    communication the overlap scheduler cannot hide, after and before it
    reorders the graphs (None until the plan is applied). ``compute``: the
    applied graphs' compute (recomputation included) when the scheduler's
    timeline is known, else the solver's compute term; ``step`` = compute +
    exposed_after (the scheduler's estimate); ``step_before_overlap`` =
    compute + exposed_before. ``solver_compute`` / ``solver_comm``: the
    ILP's terms (recomputation included; parameter gathers and gradient
    reductions counted per link by the overlap policy; the local copies
    around collectives in the communication term), for reference."""
    stats = stats_to_json(plan.pass_stats or {}).get("schedule_overlap") or {}
    after = sum(s.get("exposed_comm_after_s", 0.0) for s in stats.values()) if stats else None
    before = sum(s.get("exposed_comm_before_s", 0.0) for s in stats.values()) if stats else None
    timeline = plan.timeline or {}
    compute = plan.compute_cost
    if timeline and after is not None:
        compute = sum(t["end"] for t in timeline.values()) - sum(
            e - s for t in timeline.values() for s, e in t["exposed"]
        )
    return {
        "compute": compute,
        "exposed_after": after,
        "exposed_before": before,
        "step": compute + after if after is not None else None,
        "step_before_overlap": compute + before if before is not None else None,
        "solver_compute": plan.compute_cost,
        "solver_comm": plan.comm_cost,
    }


def _ms(s: float | None) -> str:
    return units.seconds(s)


def _size(b: float) -> str:
    return units.size(b)


def step_lines(plan) -> list[str]:
    e = step_estimate(plan)
    if e["step"] is None:
        return [
            f"estimated step: compute {_ms(e['compute'])} + communication {_ms(e['solver_comm'])} "
            "(solver's estimate, before the passes; apply the plan for the scheduler's figure)"
        ]
    solver = e["solver_compute"] + e["solver_comm"]
    diff = units.percent((solver - e["step"]) / e["step"]) if e["step"] else "n/a"
    diff = diff if diff.startswith("-") or diff == "n/a" else "+" + diff
    return [
        f"estimated step {_ms(e['step'])} = compute {_ms(e['compute'])} + exposed communication "
        f"{_ms(e['exposed_after'])} (overlap scheduler, after the passes; compute includes recomputation)",
        f"  before overlap scheduling: {_ms(e['step_before_overlap'])} (exposed {_ms(e['exposed_before'])})",
        f"  the solver's figure: {_ms(solver)} = compute {_ms(e['solver_compute'])} + communication "
        f"{_ms(e['solver_comm'])}, {diff} from the scheduler's estimate",
    ]


def collective_lines(plan) -> list[str]:
    rows = plan.collectives or []
    if not rows:
        return ["collectives: apply the plan to list them"]
    header = ("phase", "kind", "group (ranks)", "count", "traffic/rank", "est. time")
    table = [
        (
            r["phase"],
            r["kind"],
            f"{r['group']} ({r['group_size']})",
            str(r["count"]),
            _size(r["traffic_bytes"]),
            _ms(r["seconds"]),
        )
        for r in sorted(rows, key=lambda r: (r["phase"] != "forward", r["kind"], r["group"]))
    ]
    out = ["  " + line for line in format_table(header, table, right=(3, 4, 5))]
    total = sum(r["seconds"] for r in rows)
    out.append(f"  total collective time {_ms(total)} if nothing overlapped")
    return out


def format_table(header: tuple[str, ...], rows: list[tuple[str, ...]], right: tuple[int, ...] = ()) -> list[str]:
    """Lines of a plain-text table whose columns are as wide as their
    widest cell (long group names keep the columns aligned); columns in
    ``right`` are right-aligned (figures)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def line(cells) -> str:
        return "  ".join(
            str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(header)] + [line(r) for r in rows]


def _fmt(v, key: str = "") -> str:
    """A pass stat's value with its unit, told by its name: bytes
    (``*_bytes``, ``nbytes``, ``peak_memory_*``), seconds (``*_s``,
    ``*seconds``); other numbers are counts or ratios."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if "bytes" in key or "memory" in key:
        return units.size(v)
    if key.endswith(("_s", "seconds")):
        return units.seconds(v)
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def pass_stat_lines(plan) -> list[str]:
    """One short line per pass and graph, figures rounded, zeros left out."""
    out = []
    for name, stats in stats_to_json(plan.pass_stats or {}).items():
        per_graph = (
            stats if isinstance(stats, dict) and all(isinstance(v, dict) for v in stats.values()) else {"": stats}
        )
        for graph, s in per_graph.items():
            if isinstance(s, dict):
                fields = ", ".join(
                    f"{k} {_fmt(v, k)}" for k, v in s.items() if v not in (0, 0.0, "", None, [], {}) and k != "graph"
                )
            else:
                fields = _fmt(s)
            out.append(f"  {name:22s} {graph:9s} {fields or '(nothing to do)'}")
    return out
