"""The plan as one self-contained HTML file: inline CSS and SVG, no script
or style from the network (the file opens on an air-gapped cluster).

Sections: summary in words + legend + numbers; placements per module
(repeated layers folded to ``layers.*``, each module expandable); the
overlap scheduler's timeline of the forward and backward (compute stream,
communication stream, exposed communication in red); per-rank memory over
the step with the HBM line; collectives; pass stats.
"""

from __future__ import annotations

import math
from collections import defaultdict

import jinja2
import markupsafe

from ..problem import memory
from . import numbers, units, words
from .baseline_table import table_lines

_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>autoparallel plan: {{ title }}</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1100px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
pre { background: #f6f6f6; padding: 8px 12px; font-size: 12.5px; white-space: pre-wrap; overflow-wrap: anywhere; }
table { border-collapse: collapse; font-size: 12.5px; } td, th { padding: 2px 8px; text-align: left; }
tr:nth-child(even) { background: #f6f6f6; } th { background: #e8e8e8; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
details { margin: 2px 0; } summary { cursor: pointer; font-family: monospace; }
.warn { color: #b00; font-weight: bold; } .muted { color: #777; }
code { font-size: 12.5px; }
svg { display: block; width: 100%; height: auto; }
.legend span.swatch { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 14px; vertical-align: -1px; }
.legend span.swatch:first-child { margin-left: 0; }
</style></head><body>
<h1>autoparallel plan: {{ title }}</h1>
<p id="setup">{% for item in setup %}{{ item }}{% if not loop.last %} &middot; {% endif %}{% endfor %}</p>
<p class="muted">{{ header }}</p>

<h2 id="summary">Summary</h2>
<ul>{% for line in words %}<li>{{ line }}</li>{% endfor %}</ul>
<ul>{% for line in step %}<li>{{ line }}</li>{% endfor %}</ul>
{% if baselines %}<pre>{% for line in baselines %}{{ line }}
{% endfor %}</pre>{% endif %}
<pre>{% for line in legend %}{{ line }}
{% endfor %}</pre>

<h2 id="memory">Memory per rank ({{ unit }})</h2>
<table>{% for name, value in mem_rows %}<tr><td>{{ name }}</td><td class="num">{{ value }}</td></tr>{% endfor %}</table>
{% for line in mem_notes %}<p class="{{ 'warn' if line.startswith('WARNING') else 'muted' }}">{{ line }}</p>{% endfor %}
{{ memory_svg | safe }}

<h2 id="timeline">Timeline (overlap scheduler's estimate)</h2>
{% if timeline_svg %}<p class="legend">{% for color, label in timeline_legend %}<span class="swatch" style="background: {{ color }}"></span>{{ label }}{% endfor %}</p>
{{ timeline_svg | safe }}
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


# the timeline's colours, also drawn as the legend's swatches
COMPUTE, COMM, EXPOSED = "#4a7fd0", "#3aa566", "#d33"
TIMELINE_LEGEND = [
    (COMPUTE, "compute stream"),
    (COMM, "communication stream (collectives)"),
    (EXPOSED, "exposed: compute waiting for communication"),
]


def nice_ticks(top: float, count: int = 6) -> list[float]:
    """Round tick values from 0 to ``top`` (1, 2 or 5 times a power of ten apart).

    >>> nice_ticks(0.0093)
    [0.0, 0.002, 0.004, 0.006, 0.008]
    """
    if top <= 0:
        return [0.0]
    raw = top / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(top / step + 1e-9) + 1)]


def _time_axis(x0: float, x1: float, y: float, total: float, scale: float) -> str:
    """A horizontal time axis under a chart: line, ticks, labels in s/ms/us,
    and its title."""
    out = [f'<line x1="{x0}" x2="{x1}" y1="{y}" y2="{y}" stroke="#444"/>']
    unit, factor = ("s", 1.0) if total >= 2 else ("ms", 1e3) if total >= 2e-3 else ("us", 1e6)
    for t in nice_ticks(total):
        x = x0 + t * scale
        out.append(f'<line class="tick" x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + 4}" stroke="#444"/>')
        out.append(
            f'<text class="tick-label" x="{x:.1f}" y="{y + 16}" font-size="11" text-anchor="middle">'
            f"{t * factor:g} {unit}</text>"
        )
    out.append(
        f'<text x="{(x0 + x1) / 2:.1f}" y="{y + 32}" font-size="11" text-anchor="middle">'
        "time in the step (forward, then backward)</text>"
    )
    return "".join(out)


def _timeline_svg(timeline: dict) -> str:
    phases = [p for p in ("forward", "backward") if p in timeline]
    if not phases:
        return ""
    width, lane, left, right = 1000, 18, 100, 20
    total = sum(timeline[p]["end"] for p in phases) or 1.0
    scale = (width - left - right) / total
    parts, x0 = [], 0.0
    axis_y = 2 * lane + 36
    height = axis_y + 40
    for phase in phases:
        t = timeline[phase]
        for s, e in t["compute"]:
            parts.append(_rect(left + (x0 + s) * scale, 22, (e - s) * scale, lane, COMPUTE))
        for s, e, label in t["comm"]:
            parts.append(_rect(left + (x0 + s) * scale, 26 + lane, (e - s) * scale, lane, COMM, label))
        for s, e in t["exposed"]:
            parts.append(_rect(left + (x0 + s) * scale, 22, (e - s) * scale, lane, EXPOSED, "exposed"))
        parts.append(
            f'<text x="{left + x0 * scale + 2:.1f}" y="14" font-size="11">{phase} {units.seconds(t["end"])}</text>'
        )
        x0 += t["end"]
        parts.append(
            f'<line x1="{left + x0 * scale:.1f}" x2="{left + x0 * scale:.1f}" y1="4" y2="{axis_y}" stroke="#999"/>'
        )
    labels = (
        f'<text x="4" y="{22 + lane - 5}" font-size="11">compute</text>'
        f'<text x="4" y="{26 + 2 * lane - 5}" font-size="11">communication</text>'
    )
    axis = _time_axis(left, width - right, axis_y, total, scale)
    return (
        f'<svg id="timeline-chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="timeline">{labels}{"".join(parts)}{axis}</svg>'
    )


def _rect(x, y, w, h, color, title=None) -> str:
    t = f"<title>{markupsafe.escape(title)}</title>" if title else ""
    return f'<rect x="{x:.2f}" y="{y}" width="{max(w, 0.4):.2f}" height="{h}" fill="{color}">{t}</rect>'


def _memory_svg(timeline: dict, persistent: float, hbm: float) -> str:
    phases = [p for p in ("forward", "backward") if p in timeline]
    if not phases:
        return ""
    width, height, left, right, top, bottom = 1000, 260, 80, 20, 10, 70
    points, x0 = [], 0.0
    for phase in phases:
        t = timeline[phase]
        points += [(x0 + x, persistent + b) for x, b in t["memory"]]
        x0 += t["end"]
    xmax = x0 or 1.0
    peak = max((b for _, b in points), default=1.0)
    # the HBM line only when the curve comes near it (else the curve is flat at the bottom)
    show_hbm = peak >= 0.25 * hbm
    ymax = max(peak, hbm if show_hbm else 0.0) * 1.05 or 1.0
    plot_h = height - top - bottom
    sx, sy = (width - left - right) / xmax, plot_h / ymax

    def y(v):
        return top + plot_h - v * sy

    path = " ".join(f"{left + x * sx:.1f},{y(b):.1f}" for x, b in points)
    unit, factor = next((u, f) for u, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0)) if ymax >= 2 * f)
    ticks = "".join(
        f'<text class="tick-label" x="{left - 6}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end">'
        f"{v / factor:g} {unit}</text>"
        f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>'
        for v in nice_ticks(ymax, 5)
    )
    hbm_line = (
        f'<line x1="{left}" x2="{width - right}" y1="{y(hbm):.1f}" y2="{y(hbm):.1f}" stroke="{EXPOSED}" '
        f'stroke-dasharray="6 3"/><text x="{width - 200}" y="{y(hbm) - 4:.1f}" font-size="11" fill="{EXPOSED}">'
        f"HBM {units.size(hbm)}</text>"
        if show_hbm
        else ""
    )
    axis = _time_axis(left, width - right, top + plot_h, xmax, sx)
    note = (
        f'<text x="{left}" y="{height - 4}" font-size="11">per rank: live bytes of the step + parameters, gradients '
        f"and optimizer state{'' if show_hbm else f' (peak {units.size(peak)}, far below HBM {units.size(hbm)})'}"
        "</text>"
    )
    return (
        f'<svg id="memory-chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="memory">{ticks}{hbm_line}'
        f'<polyline fill="none" stroke="{COMPUTE}" stroke-width="1.5" points="{path}"/>{axis}{note}</svg>'
    )


def describe_setup(plan, model: str | None = None) -> tuple[str, list[str]]:
    """The title (model, parameter count) and the setup line's items (mesh,
    device, inputs as batch x sequence, dtypes) from what the plan records."""
    prov = plan.provenance or {}
    n_params = prov.get("parameters")
    if n_params is None:  # a plan without the record: its parameter nodes
        n_params = sum(math.prod(n.shape) for n in plan.nodes.values() if n.is_parameter and n.shape)
    name = model or prov.get("model")
    title = f"{name + ', ' if name else ''}{units.count(n_params)} parameters"
    names = plan.mesh_dim_names or [f"dim{i}" for i in range(len(plan.mesh_shape))]
    mesh = " x ".join(f"{n} {s}" for n, s in zip(names, plan.mesh_shape))
    items = [f"mesh {mesh} ({math.prod(plan.mesh_shape)} ranks)"]
    device = (prov.get("device") or {}).get("name")
    if device:
        items.append(f"device {device}")
    for i, shape_dtype in enumerate(prov.get("input_shapes") or []):
        if shape_dtype is None:
            continue
        shape, dtype = shape_dtype
        if i == 0 and len(shape) == 2 and "int" in dtype:  # token ids
            items.append(f"batch {shape[0]} x sequence {shape[1]} ({dtype} tokens)")
        elif i == 0 and shape:
            items.append(f"batch {shape[0]}, input [{', '.join(map(str, shape))}] {dtype}")
        else:
            items.append(f"input {i} [{', '.join(map(str, shape))}] {dtype}")
    mp = prov.get("mp_policy")
    if mp:
        items.append(f"{mp.get('param_dtype')} compute, {mp.get('reduce_dtype')} gradient reduction")
    else:
        dtypes = sorted({n.dtype for n in plan.nodes.values() if n.is_parameter and n.dtype})
        items.append(f"{'/'.join(dtypes) or 'float32'} (no mixed precision)")
    return title, items


def render(plan, model: str | None = None) -> str:
    """The report's HTML; ``model`` names the model in the title (default:
    the class name the plan recorded)."""
    mem = memory.breakdown(plan)
    title, setup = describe_setup(plan, model)
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
            "traffic": units.size(r["traffic_bytes"]),
            "output": units.size(r["output_bytes"]),
            "time": units.seconds(r["seconds"]),
        }
        for r in sorted(plan.collectives or [], key=lambda r: (r["phase"] != "forward", r["kind"], r["group"]))
    ]
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(_TEMPLATE).render(
        title=title,
        setup=setup,
        header=f"{len(plan.nodes)} graph nodes; solver {s.status} ({s.backend}, gap {units.percent(s.gap)}); "
        f"{plan.optimality()}",
        timeline_legend=TIMELINE_LEGEND,
        words=words.describe(plan),
        legend=words.LEGEND,
        step=numbers.step_lines(plan),
        baselines=table_lines(plan),
        unit=memory.UNIT_NOTE,
        mem_rows=[(line.split()[0], " ".join(line.split()[1:])) for line in mem_lines[:peak_row]],
        mem_notes=mem_lines[peak_row:],
        memory_svg=_memory_svg(plan.timeline or {}, mem.optimizer, mem.hbm),
        timeline_svg=_timeline_svg(plan.timeline or {}),
        collectives=rows,
        placements=sorted(by_module.items()),
        passes=numbers.pass_stat_lines(plan),
    )


def write_html(plan, path: str, model: str | None = None) -> None:
    from .files import write_atomic

    write_atomic(path, render(plan, model))
