"""Command line for plan files (written by ``Plan.dump_json`` or the
``AUTOPARALLEL_DUMP_DIR`` dumps; ``.gz`` is read as gzip)::

    python -m autoparallel report plan.json -o report.html   # self-contained HTML
    python -m autoparallel summary plan.json                  # the summary text
    python -m autoparallel diff a.json b.json                 # what differs

Exit status: 0 done (``diff``: the plans place every node alike), 1 the
plans differ, 2 a file could not be read.
"""

from __future__ import annotations

import argparse
import json
import sys

from .plan import Plan, diff


def _load(path: str) -> Plan:
    try:
        return Plan.load_json(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        kind = "not valid JSON" if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        raise SystemExit(f"autoparallel: {path}: cannot read the plan ({kind}: {exc})") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autoparallel", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="write the HTML report of a plan")
    r.add_argument("plan")
    r.add_argument("-o", "--output", default="report.html")
    s = sub.add_parser("summary", help="print the plan's summary")
    s.add_argument("plan")
    d = sub.add_parser("diff", help="nodes placed differently by two plans")
    d.add_argument("a")
    d.add_argument("b")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "report":
            _load(args.plan).to_html(args.output)
            print(f"wrote {args.output}")
            return 0
        if args.cmd == "summary":
            print(_load(args.plan).summary())
            return 0
        a, b = _load(args.a), _load(args.b)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    lines = []
    if (a.mesh_shape, a.mesh_dim_names) != (b.mesh_shape, b.mesh_dim_names):
        lines.append(f"mesh: {a.mesh_shape} {a.mesh_dim_names}  vs  {b.mesh_shape} {b.mesh_dim_names}")
    fa, fb = (p.provenance.get("graph_fingerprint") for p in (a, b))
    if fa and fb and fa != fb:
        lines.append(f"model graph: fingerprint {fa[:12]} vs {fb[:12]} (different models or input shapes)")
    nodes = diff(a, b)
    lines += nodes
    for line in lines:
        print(line)
    ea, eb = a.solution.objective, b.solution.objective
    print(f"{len(nodes)} of {len(a.nodes.keys() | b.nodes.keys())} nodes differ; objective {ea:.6g} vs {eb:.6g}")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
