"""The hand layouts beside the plan (:mod:`autoparallel.baselines`): one
table, the estimated step of each, memory per rank and the plan's margin
("-1.2 ms, -3.4% vs FSDP x TP + SP"), for the summary, the example and the HTML
report."""

from __future__ import annotations

from ..problem.memory import breakdown
from . import units
from .numbers import step_estimate

__all__ = ["margin_line", "table_lines"]


def _step(plan) -> float | None:
    return step_estimate(plan)["step"]


def _plan_step(plan) -> tuple[float, str]:
    step = _step(plan)
    if step is not None:
        return step, "scheduler"
    return plan.compute_cost + plan.comm_cost, "solver"


def _fmt_ms(s: float | None) -> str:
    return units.seconds(s)


def _fmt_bytes(b: float | None) -> str:
    return "" if b is None else units.size(b)


def margin_line(plan, row: dict) -> str:
    """``-X ms, -Y% vs NAME`` (negative: the plan is faster)."""
    mine, source = _plan_step(plan)
    theirs = row.get("step_s") if source == "scheduler" else row.get("solver_s")
    if theirs is None or not theirs:
        return f"vs {row['name']}: {row.get('note') or 'no figure'}"
    d = mine - theirs
    sign = "+" if d >= 0 else ""
    return f"{sign}{units.seconds(d)}, {sign}{units.percent(d / theirs)} vs {row['name']}"


def table_lines(plan) -> list[str]:
    """The baselines beside the plan: estimated step, memory per rank, margin."""
    rows = getattr(plan, "baselines", None) or []
    if not rows:
        return []
    mine, source = _plan_step(plan)
    key = "step_s" if source == "scheduler" else "solver_s"
    out = [
        f"hand layouts under the same estimate ({'overlap scheduler' if source == 'scheduler' else 'solver'}):",
        f"  {'layout':16s} {'est. step':>11s} {'memory/rank':>12s}  plan's margin",
        f"  {'this plan':16s} {_fmt_ms(mine):>11s} {_fmt_bytes(breakdown(plan).total):>12s}",
    ]
    for r in rows:
        mem = _fmt_bytes(r.get("memory_bytes"))
        figure = r.get(key)
        margin = margin_line(plan, r) if figure else r.get("note") or "no figure"
        if figure and r.get("note"):
            margin += f" ({r['note']})"
        free = f" ({r['free']} parameters unpinned)" if r.get("free") else ""
        out.append(f"  {r['name']:16s} {_fmt_ms(figure):>11s} {mem:>12s}  {margin}{free}")
    return out
