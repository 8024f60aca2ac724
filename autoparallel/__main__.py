"""Command line for plan files (written by ``Plan.dump_json`` or the
``AUTOPARALLEL_DUMP_DIR`` dumps; ``.gz`` is read as gzip).

    python -m autoparallel report plan.json -o report.html   # self-contained HTML
    python -m autoparallel summary plan.json                  # the summary text
    python -m autoparallel diff a.json b.json                 # what differs

Exit status: 0 done (``diff``: the plans place every node alike), 1 the
plans differ, 2 a file could not be read.
"""

from __future__ import annotations

import argparse
import sys

from .plan import Plan, diff
from .report import units


def _load(path: str) -> Plan:
    from .checks.preflight import PlanFileError, read_plan

    try:
        return read_plan(path)
    except PlanFileError as exc:
        raise SystemExit(f"python -m autoparallel: error: {exc}") from None


def main(argv=None) -> int:
    intro, examples, status = __doc__.split("\n\n")[:3]
    ap = argparse.ArgumentParser(
        prog="python -m autoparallel",
        description=intro.replace("``", ""),
        epilog="examples:\n" + examples + "\n\n" + status.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="write the HTML report of a plan")
    r.add_argument("plan", help="plan file (.json or .json.gz)")
    r.add_argument("-o", "--output", default="report.html", help="HTML file to write (default: report.html)")
    r.add_argument("--model", default=None, help="what the title calls the model (default: its class name)")
    s = sub.add_parser("summary", help="print the plan's summary")
    s.add_argument("plan", help="plan file (.json or .json.gz)")
    d = sub.add_parser("diff", help="nodes placed differently by two plans")
    d.add_argument("a", help="first plan file")
    d.add_argument("b", help="second plan file")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "report":
            _load(args.plan).to_html(args.output, model=args.model)
            print(f"wrote {args.output}")
            return 0
        if args.cmd == "summary":
            print(_load(args.plan).summary())
            return 0
        a, b = _load(args.a), _load(args.b)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    except OSError as exc:  # the report's output path
        print(f"python -m autoparallel: error: {exc}", file=sys.stderr)
        return 2
    warnings = _compared_what(a, b)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    lines = []
    if (a.mesh_shape, a.mesh_dim_names) != (b.mesh_shape, b.mesh_dim_names):
        lines.append(f"mesh: {a.mesh_shape} {a.mesh_dim_names}  vs  {b.mesh_shape} {b.mesh_dim_names}")
    nodes = diff(a, b)
    lines += nodes
    for line in lines:
        print(line)
    ea, eb = a.solution.objective, b.solution.objective
    print(
        f"{len(nodes)} of {len(a.nodes.keys() | b.nodes.keys())} nodes differ; estimated step (objective) "
        f"{units.seconds(ea)} vs {units.seconds(eb)}"
    )
    different_graphs = a.provenance.get("graph_fingerprint") != b.provenance.get("graph_fingerprint")
    return 1 if lines or (different_graphs and all(p.provenance.get("graph_fingerprint") for p in (a, b))) else 0


def _compared_what(a: Plan, b: Plan) -> list[str]:
    """Why a node-by-node diff may compare unlike things: different model
    graphs or input shapes (fingerprints), or plans without the record."""
    fa, fb = (p.provenance.get("graph_fingerprint") for p in (a, b))
    if fa and fb and fa != fb:
        sa, sb = (p.provenance.get("input_shapes") for p in (a, b))
        inputs = f"; input shapes {sa} vs {sb}" if sa != sb else ""
        return [
            f"the plans were made for different model graphs (fingerprint {fa[:12]} vs {fb[:12]}{inputs}): "
            "node names may not mean the same nodes"
        ]
    if not (fa and fb):
        return ["a plan has no record of its model graph: node names may not mean the same nodes"]
    return []


if __name__ == "__main__":
    sys.exit(main())
