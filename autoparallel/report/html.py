"""The plan as one self-contained HTML file: inline CSS and SVG, no script
or style from the network (the file opens on an air-gapped cluster).

Sections: summary in words + legend + numbers; placements per module
(repeated layers folded to ``layers.*``, each module expandable); the
overlap scheduler's timeline of the forward and backward (compute stream,
communication stream, exposed communication in red); per-rank memory over
the step with the HBM line; collectives; pass stats.
"""

from __future__ import annotations

from collections import defaultdict

import jinja2
import markupsafe

from ..problem import memory
from . import numbers, words

_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>autoparallel plan: mesh {{ mesh }}</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1100px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
pre { background: #f6f6f6; padding: 8px 12px; overflow-x: auto; font-size: 12.5px; }
table { border-collapse: collapse; font-size: 12.5px; } td, th { padding: 2px 8px; text-align: left; }
tr:nth-child(even) { background: #f6f6f6; } th { background: #e8e8e8; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
details { margin: 2px 0; } summary { cursor: pointer; font-family: monospace; }
.warn { color: #b00; font-weight: bold; } .muted { color: #777; }
code { font-size: 12.5px; }
</style></head><body>
<h1>autoparallel plan for mesh {{ mesh }}</h1>
<p class="muted">{{ header }}</p>

<h2 id="summary">Summary</h2>
<ul>{% for line in words %}<li>{{ line }}</li>{% endfor %}</ul>
<ul>{% for line in step %}<li>{{ line }}</li>{% endfor %}</ul>
<pre>{% for line in legend %}{{ line }}
{% endfor %}</pre>

<h2 id="memory">Memory per rank ({{ unit }})</h2>
<table>{% for name, value in mem_rows %}<tr><td>{{ name }}</td><td class="num">{{ value }}</td></tr>{% endfor %}</table>
{% for line in mem_notes %}<p class="{{ 'warn' if line.startswith('WARNING') else 'muted' }}">{{ line }}</p>{% endfor %}
{{ memory_svg | safe }}

<h2 id="timeline">Timeline (overlap scheduler's estimate)</h2>
{% if timeline_svg %}{{ timeline_svg | safe }}
<p class="muted">Blue: compute stream; green: communication stream; red: compute waiting for communication (exposed).</p>
{% else %}<p class="muted">Apply the plan (autop.apply_placement) to get the scheduler's timeline.</p>{% endif %}

<h2 id="collectives">Collectives per step and rank</h2>
{% if collectives %}<table><tr><th>phase</th><th>kind</th><th>group (ranks)</th><th>count</th>
<th>traffic / rank</th><th>output / rank</th><th>est. time</th></tr>
{% for r in collectives %}<tr><td>{{ r.phase }}</td><td>{{ r.kind }}</td><td>{{ r.group }} ({{ r.group_size }})</td>
<td class="num">{{ r.count }}</td><td class="num">{{ r.traffic }}</td><td class="num">{{ r.output }}</td>
<td class="num">{{ r.time }}</td></tr>{% endfor %}</table>
{% else %}<p class="muted">Apply the plan to list its collectives.</p>{% endif %}

<h2 id="placements">Placements per module</h2>
<p class="muted">Repeated layers folded to <code>layers.*</code>; (xN) counts the nodes with that choice.</p>
{% for module, rows in placements %}<details><summary>{{ module }} ({{ rows | length }})</summary>
<table><tr><th>phase</th><th>op</th><th>placements</th></tr>
{% for r in rows %}<tr><td>{{ r.role }}</td><td>{{ r.op }}</td><td><code>{{ r.placements }}</code></td></tr>{% endfor %}
</table></details>{% endfor %}

<h2 id="passes">Pass stats</h2>
{% if passes %}<pre>{% for line in passes %}{{ line }}
{% endfor %}</pre>{% else %}<p class="muted">No passes ran (the plan was not applied).</p>{% endif %}
</body></html>
"""


def _timeline_svg(timeline: dict) -> str:
    phases = [p for p in ("forward", "backward") if p in timeline]
    if not phases:
        return ""
    width, lane, left = 1000, 18, 90
    total = sum(timeline[p]["end"] for p in phases) or 1.0
    scale = (width - left - 10) / total
    parts, x0 = [], 0.0
    height = 2 * lane + 40
    for phase in phases:
        t = timeline[phase]
        for s, e in t["compute"]:
            parts.append(_rect(left + (x0 + s) * scale, 10, (e - s) * scale, lane, "#4a7fd0"))
        for s, e, label in t["comm"]:
            parts.append(_rect(left + (x0 + s) * scale, 14 + lane, (e - s) * scale, lane, "#3aa566", label))
        for s, e in t["exposed"]:
            parts.append(_rect(left + (x0 + s) * scale, 10, (e - s) * scale, lane, "#d33", "exposed"))
        parts.append(
            f'<text x="{left + x0 * scale + 2:.1f}" y="{2 * lane + 32}" font-size="11">{phase} '
            f"{t['end'] * 1e3:.1f} ms</text>"
        )
        x0 += t["end"]
        parts.append(
            f'<line x1="{left + x0 * scale:.1f}" x2="{left + x0 * scale:.1f}" y1="4" y2="{2 * lane + 20}" stroke="#999"/>'
        )
    labels = (
        f'<text x="4" y="{10 + lane - 5}" font-size="11">compute</text>'
        f'<text x="4" y="{14 + 2 * lane - 5}" font-size="11">communication</text>'
    )
    return f'<svg width="{width}" height="{height}" role="img" aria-label="timeline">{labels}{"".join(parts)}</svg>'


def _rect(x, y, w, h, color, title=None) -> str:
    t = f"<title>{markupsafe.escape(title)}</title>" if title else ""
    return f'<rect x="{x:.2f}" y="{y}" width="{max(w, 0.4):.2f}" height="{h}" fill="{color}">{t}</rect>'


def _memory_svg(timeline: dict, persistent: float, hbm: float) -> str:
    phases = [p for p in ("forward", "backward") if p in timeline]
    if not phases:
        return ""
    width, height, left, top = 1000, 220, 70, 10
    points, x0 = [], 0.0
    for phase in phases:
        t = timeline[phase]
        points += [(x0 + x, persistent + b) for x, b in t["memory"]]
        x0 += t["end"]
    xmax = x0 or 1.0
    ymax = max(max((b for _, b in points), default=1.0), hbm) * 1.05
    sx, sy = (width - left - 10) / xmax, (height - top - 30) / ymax

    def y(v):
        return top + (height - top - 30) - v * sy

    path = " ".join(f"{left + x * sx:.1f},{y(b):.1f}" for x, b in points)
    ticks = "".join(
        f'<text x="4" y="{y(v) + 4:.1f}" font-size="11">{v / 1e9:.0f} GB</text>'
        f'<line x1="{left}" x2="{width - 10}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>'
        for v in (ymax * f / 4 for f in range(5))
    )
    return (
        f'<svg width="{width}" height="{height}" role="img" aria-label="memory">'
        f"{ticks}"
        f'<line x1="{left}" x2="{width - 10}" y1="{y(hbm):.1f}" y2="{y(hbm):.1f}" stroke="#d33" stroke-dasharray="6 3"/>'
        f'<text x="{width - 200}" y="{y(hbm) - 4:.1f}" font-size="11" fill="#d33">HBM {hbm / 1e9:.0f} GB</text>'
        f'<polyline fill="none" stroke="#4a7fd0" stroke-width="1.5" points="{path}"/>'
        f'<text x="{left}" y="{height - 8}" font-size="11">step time (forward then backward); curve: live bytes '
        f"+ optimizer state, per rank</text></svg>"
    )


def render(plan) -> str:
    mem = memory.breakdown(plan)
    mem_lines = mem.lines()
    # the parts and the peak as a table, the budget and notes below it
    peak_row = next((i + 1 for i, line in enumerate(mem_lines) if line.startswith("peak")), len(mem_lines))
    by_module: dict[str, list] = defaultdict(list)
    for k in plan.placements_by_kind():
        module = k.module_path if k.role != "parameter" else k.module_path.rsplit(".", 1)[0]
        chosen = "; ".join(p + (f" (x{c})" if c > 1 else "") for p, c in k.placements.items())
        op = k.op.removeprefix("aten.").removesuffix(".default") if k.op else k.module_path.rsplit(".", 1)[-1]
        by_module[module].append({"role": k.role, "op": op, "placements": chosen})
    s = plan.solution
    rows = [
        {
            **r,
            "traffic": numbers._size(r["traffic_bytes"]),
            "output": numbers._size(r["output_bytes"]),
            "time": numbers._ms(r["seconds"]),
        }
        for r in sorted(plan.collectives or [], key=lambda r: (r["phase"] != "forward", r["kind"], r["group"]))
    ]
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(_TEMPLATE).render(
        mesh=tuple(plan.mesh_shape) if not plan.mesh_dim_names else dict(zip(plan.mesh_dim_names, plan.mesh_shape)),
        header=f"{len(plan.nodes)} nodes; solver {s.status} ({s.backend}, gap {s.gap})",
        words=words.describe(plan),
        legend=words.LEGEND,
        step=numbers.step_lines(plan),
        unit=memory.UNIT_NOTE,
        mem_rows=[(line.split()[0], " ".join(line.split()[1:])) for line in mem_lines[:peak_row]],
        mem_notes=mem_lines[peak_row:],
        memory_svg=_memory_svg(plan.timeline or {}, mem.optimizer, mem.hbm),
        timeline_svg=_timeline_svg(plan.timeline or {}),
        collectives=rows,
        placements=sorted(by_module.items()),
        passes=numbers.pass_stat_lines(plan),
    )


def write_html(plan, path: str) -> None:
    from ..plan import write_atomic

    write_atomic(path, render(plan))
