"""How the solver scales with the number of repeated transformer layers.

Builds a synthetic problem shaped like one training step of a transformer on
an 8 x 16 mesh: per layer ~300 decisions (forward and backward ops) with 9 to
36 placement options each, a chain with fan-in/fan-out (residual adds, saved
activations read by the backward), layer i feeding layer i + 1 (and its
gradient flowing back), layers linked as repeats, an embedding and an output
head that are not repeated, and a parameter-memory resource constraint.
Costs derive from the placement labels: compute divided by the sharding
factor, redistribution cost per mesh dimension (all-gather, reduce-scatter,
all-reduce, all-to-all) scaled by tensor bytes; some matrices are all-zero
and some separable.

Each configuration (layers x presolve on/off x backend) runs in a fresh
process, so times and peak memory (ru_maxrss) are its own; imports are not
timed. Prints a table, asserts nothing::

    python benchmarks/solver_scaling.py                  # 4 and 32 layers
    python benchmarks/solver_scaling.py --layers 8 --backends highs --no-off
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from solver.problem import Decision, Edge, Link, Problem, ResourceConstraint  # noqa: E402

MESH = (8, 16)
BANDWIDTH = (400e9, 50e9)  # bytes/s per mesh dim (intra-node, inter-node)
FLOPS = 400e12
LATENCY = 5e-6


def placements(ndim: int, partial: bool) -> list[tuple[str, ...]]:
    """All placements of an ``ndim`` tensor on the 2-D mesh."""
    per_dim = ["R"] + [f"S{d}" for d in range(ndim)] + (["P"] if partial else [])
    return [(a, b) for a in per_dim for b in per_dim]


def shard_factor(opt: tuple[str, ...]) -> int:
    f = 1
    for p, n in zip(opt, MESH):
        if p != "R":
            f *= n
    return f


def transition(src: str, dst: str, n: int, bw: float) -> tuple[float, float]:
    """(fixed time, time per byte of the full tensor) to redistribute one mesh
    dim of size ``n`` from ``src`` to ``dst``."""
    if src == dst:
        return 0.0, 0.0
    if dst == "P":
        return (1e-7, 0.0) if src == "R" else (float("inf"), 0.0)  # only R -> P
    if src == "P":  # all-reduce to R, reduce-scatter to S
        return LATENCY, (2 if dst == "R" else 1) * (n - 1) / n / bw
    if src == "R":  # local slice: free but for a tie-break
        return 1e-7, 0.0
    if dst == "R":  # all-gather
        return LATENCY, (n - 1) / n / bw
    return LATENCY, (n - 1) / n / n / bw  # all-to-all


@functools.lru_cache(maxsize=None)
def transition_table(src_ndim: int, src_partial: bool, dst_ndim: int, dst_partial: bool):
    """Per (producer option, consumer option): fixed time and time per byte."""
    so, do = placements(src_ndim, src_partial), placements(dst_ndim, dst_partial)

    def conv(p: str) -> str:  # a consumer's S(d) seen in the producer's dims
        return f"S{min(int(p[1:]), src_ndim - 1)}" if p.startswith("S") else p

    fixed, per_byte = [], []
    for a in so:
        frow, brow = [], []
        for b in do:
            f = v = 0.0
            for k in range(2):
                df, dv = transition(a[k], conv(b[k]), MESH[k], BANDWIDTH[k])
                f, v = f + df, v + dv
            frow.append(f)
            brow.append(v)
        fixed.append(frow)
        per_byte.append(brow)
    return fixed, per_byte


class Node:
    __slots__ = ("ndim", "partial", "flops", "nbytes", "param")

    def __init__(self, ndim, partial, flops, nbytes, param=False):
        self.ndim, self.partial, self.flops, self.nbytes, self.param = (ndim, partial, flops, nbytes, param)


def unary_costs(node: Node, opts) -> list[float]:
    out = []
    for o in opts:
        c = node.flops / FLOPS / shard_factor(o)
        if "P" in o and not node.partial:
            c = float("inf")
        out.append(c)
    return out


def edge_matrix(src: Node, dst: Node, kind: str, rng: random.Random) -> list[list[float]]:
    so, do = placements(src.ndim, src.partial), placements(dst.ndim, dst.partial)
    if kind == "zero":  # e.g. a scalar or shape-only input
        return [[0.0] * len(do) for _ in so]
    if kind == "separable":  # cost depends on each end alone (e.g. a layout change)
        r = [rng.random() * 1e-5 for _ in so]
        s = [rng.random() * 1e-5 for _ in do]
        return [[a + b for b in s] for a in r]

    fixed, per_byte = transition_table(src.ndim, src.partial, dst.ndim, dst.partial)
    nb = src.nbytes
    return [[f + nb * v for f, v in zip(fr, br)] for fr, br in zip(fixed, per_byte)]


def layer_template(rng: random.Random, n_fwd: int):
    """Nodes and edges of one layer: forward chain then backward chain.

    Returns (nodes, edges, params) where edges are (src, dst, kind) within the
    layer; node 0 is the layer input, n_fwd - 1 its output, n_fwd the gradient
    of the output and the last node the gradient of the input.
    """
    act = 8192 * 4096 * 2.0
    nodes = []
    for k in range(2 * n_fwd):
        ndim = rng.choice((2, 3, 3, 3, 4))
        nodes.append(Node(ndim, rng.random() < 0.3, rng.uniform(1e9, 5e11), act * rng.uniform(0.1, 2)))
    edges = []
    for k in range(1, 2 * n_fwd):
        edges.append((k - 1, k, "dense"))
        if k >= n_fwd + 1 and k % 4 != 0:  # the backward reads saved activations
            edges.append((2 * n_fwd - 1 - k, k, "dense"))
        if k < n_fwd - 2 and k % 5 == 0:  # an op feeding two consumers
            edges.append((k - 1, k + 2, "dense"))
    for k in (n_fwd // 2, n_fwd - 1):  # residual adds
        edges.append((0 if k == n_fwd // 2 else n_fwd // 2, k, "dense"))
    for k in range(3, 2 * n_fwd, 17):
        edges.append((k - 3, k, rng.choice(("zero", "separable"))))
    params = []
    for j, k in enumerate(range(5, n_fwd, n_fwd // 9)):
        if len(params) == 9:
            break
        p = Node(2, False, 0.0, 4096 * 4096 * 2.0 * (3 if j >= 6 else 1), param=True)
        params.append((p, k, n_fwd + (n_fwd - 1 - k)))  # read by fwd k and bwd grad
    return nodes, edges, params


def build_problem(n_layers: int, seed: int = 0, per_layer: int = 300, mem_slack: float = 1.0) -> Problem:
    rng = random.Random(seed)
    n_fwd = (per_layer - 9) // 2
    nodes, tedges, params = layer_template(rng, n_fwd)
    opts = [placements(n.ndim, n.partial) for n in nodes]
    labels = [["".join(o) for o in os_] for os_ in opts]
    unary = [unary_costs(n, o) for n, o in zip(nodes, opts)]
    mats = [edge_matrix(nodes[a], nodes[b], kind, rng) for a, b, kind in tedges]
    popts = placements(2, False)
    plabels = ["".join(o) for o in popts]
    pmats = [(edge_matrix(p, nodes[f], "dense", rng), edge_matrix(p, nodes[g], "dense", rng)) for p, f, g in params]
    weights = [[p.nbytes / shard_factor(o) for o in popts] for p, _, _ in params]

    decisions: list[Decision] = []
    edges: list[Edge] = []
    links: list[Link] = []
    terms: dict[str, list[float]] = {}

    def copy(m):  # fresh lists and floats per layer, as a cost model would produce
        return [[x + 0.0 for x in row] for row in m]

    # Embedding (not repeated): a parameter and its lookup, plus the gradient.
    emb_p = Node(2, False, 0.0, 128256 * 4096 * 2.0, param=True)
    emb = Node(3, False, 1e9, 8192 * 4096 * 2.0)
    emb_opts = placements(3, False)
    decisions.append(Decision("embed.weight", plabels, [0.0] * len(popts)))
    terms["embed.weight"] = [emb_p.nbytes / shard_factor(o) for o in popts]
    decisions.append(Decision("embed", ["".join(o) for o in emb_opts], unary_costs(emb, emb_opts)))
    decisions.append(Decision("embed.grad", ["".join(o) for o in emb_opts], unary_costs(emb, emb_opts)))
    edges.append(Edge("embed.weight", "embed", 0, edge_matrix(emb_p, emb, "dense", rng)))
    edges.append(Edge("embed.weight", "embed.grad", 0, edge_matrix(emb_p, emb, "dense", rng)))
    e_in = edge_matrix(emb, nodes[0], "dense", rng)
    g_out = edge_matrix(nodes[-1], emb, "dense", rng)
    link_out = edge_matrix(nodes[n_fwd - 1], nodes[0], "dense", rng)
    link_grad = edge_matrix(nodes[-1], nodes[n_fwd], "dense", rng)

    for layer in range(n_layers):
        pre = f"layers.{layer}."
        for k in range(len(nodes)):
            decisions.append(Decision(f"{pre}op{k}", labels[k], list(unary[k])))
        for (a, b, _), m in zip(tedges, mats):
            edges.append(Edge(f"{pre}op{a}", f"{pre}op{b}", 0, copy(m)))
        for j, ((p, f, g), (mf, mg)) in enumerate(zip(params, pmats)):
            name = f"{pre}w{j}"
            decisions.append(Decision(name, plabels, [0.0] * len(popts)))
            terms[name] = list(weights[j])
            edges.append(Edge(name, f"{pre}op{f}", 1, copy(mf)))
            edges.append(Edge(name, f"{pre}op{g}", 1, copy(mg)))
        if layer == 0:
            edges.append(Edge("embed", f"{pre}op0", 0, e_in))
            edges.append(Edge(f"{pre}op{len(nodes) - 1}", "embed.grad", 0, g_out))
        else:
            prev = f"layers.{layer - 1}."
            edges.append(Edge(f"{prev}op{n_fwd - 1}", f"{pre}op0", 0, copy(link_out)))
            edges.append(Edge(f"{pre}op{len(nodes) - 1}", f"{prev}op{n_fwd}", 0, copy(link_grad)))
            for k in range(len(nodes)):
                ident = list(range(len(labels[k])))
                links.append(Link("repeated layers", f"{prev}op{k}", f"{pre}op{k}", ident))
            for j in range(len(params)):
                links.append(Link("repeated layers", f"{prev}w{j}", f"{pre}w{j}", list(range(len(popts)))))

    # Output head (not repeated): final norm, projection weight, loss.
    last = f"layers.{n_layers - 1}."
    head = Node(3, True, 2 * 8192 * 4096 * 128256, 8192 * 128256 * 2.0)
    head_opts = placements(3, True)
    decisions.append(Decision("head.weight", plabels, [0.0] * len(popts)))
    terms["head.weight"] = [emb_p.nbytes / shard_factor(o) for o in popts]
    decisions.append(Decision("head", ["".join(o) for o in head_opts], unary_costs(head, head_opts)))
    decisions.append(Decision("loss", ["R"], [0.0]))
    decisions.append(Decision("head.grad", ["".join(o) for o in head_opts], unary_costs(head, head_opts)))
    edges.append(Edge(f"{last}op{n_fwd - 1}", "head", 0, edge_matrix(nodes[n_fwd - 1], head, "dense", rng)))
    edges.append(Edge("head.weight", "head", 1, edge_matrix(emb_p, head, "dense", rng)))
    edges.append(Edge("head", "loss", 0, edge_matrix(head, Node(0, False, 0, 4.0), "dense", rng)))
    edges.append(Edge("loss", "head.grad", 0, [[0.0] * len(head_opts)]))
    edges.append(Edge("head.grad", f"{last}op{n_fwd}", 0, edge_matrix(head, nodes[n_fwd], "dense", rng)))

    low = sum(min(w) for w in terms.values())
    mem = ResourceConstraint("parameter memory per rank", terms, high=low * mem_slack)
    meta = {"benchmark": "solver_scaling", "layers": n_layers, "seed": seed, "mesh": list(MESH)}
    return Problem(decisions, edges, links=links, resources=[mem], name=f"transformer-{n_layers}", metadata=meta)


# --------------------------------------------------------------------- runs


def worker(cfg: dict) -> dict:
    """One configuration, in this (fresh) process."""
    import solver.api  # noqa: F401  (imports are not timed)
    import solver.presolve  # noqa: F401
    from solver import solve
    from solver.backends import get_backend

    get_backend(cfg["backend"]).available()  # imports the backend
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    problem = build_problem(cfg["layers"], seed=cfg["seed"], mem_slack=cfg["mem_slack"])
    t_build = time.perf_counter() - t0
    stats_in = {
        "decisions": len(problem.decisions),
        "options": sum(d.num_options for d in problem.decisions),
        "edges": len(problem.edges),
        "pairs": sum(len(e.costs) * len(e.costs[0]) for e in problem.edges),
    }
    t0, c0 = time.perf_counter(), _cpu()
    sol = solve(problem, backend=cfg["backend"], presolve=cfg["presolve"], time_limit=cfg["time_limit"])
    t_solve, c_solve = time.perf_counter() - t0, _cpu() - c0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    s = sol.presolve
    return {
        **cfg,
        "in": stats_in,
        "out": None
        if s is None
        else {
            "decisions": s.decisions_after,
            "options": s.options_after,
            "edges": s.edges_after,
            "pairs": s.pairs_after,
        },
        "variables": sol.num_variables,
        "constraints": sol.num_constraints,
        "status": sol.status,
        "objective": sol.objective,
        "t_problem": t_build,
        "t_presolve": sol.timings.get("presolve", 0.0),
        "t_ilp": sol.timings.get("build", 0.0),
        "t_solve": sol.timings.get("solve", 0.0),
        "t_total": t_solve,  # solve() end to end (validate, presolve, ILP, backend, evaluate)
        "cpu_total": c_solve,  # CPU seconds of the same (all threads, CBC included)
        "rss_mb": rss1 / 1024,
        "rss_delta_mb": (rss1 - rss0) / 1024,
    }


def _cpu() -> float:
    """CPU seconds of this process and its finished children (CBC runs as one)."""
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + child.ru_utime + child.ru_stime


def run(cfg: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**cfg, "error": f"timed out after {timeout:.0f}s"}
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {**cfg, "error": tail}
    return json.loads(out.stdout.strip().splitlines()[-1])


def fmt_size(d: dict | None) -> str:
    if d is None:
        return "-"
    return f"{d['decisions']}/{d['options']}/{d['edges']}/{d['pairs']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--backends", nargs="+", default=["highs", "cbc"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--mem-slack", type=float, default=1.0, help="memory bound = slack x the fully-sharded parameter total"
    )
    ap.add_argument("--time-limit", type=float, default=30.0, help="backend time limit for presolve-off runs (s)")
    ap.add_argument("--timeout", type=float, default=120.0, help="wall-clock limit per configuration (s)")
    ap.add_argument("--no-off", action="store_true", help="skip presolve-off runs")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    load = os.getloadavg()[0]
    print(
        f"{os.cpu_count()} CPUs, load average {load:.2f} before starting"
        + (" (busy machine: wall times inflated, see cpu)" if load > 0.5 * (os.cpu_count() or 1) else "")
    )
    results = []
    for presolve in [True] if args.no_off else [True, False]:
        for backend in args.backends:
            for layers in args.layers:
                cfg = {
                    "layers": layers,
                    "backend": backend,
                    "presolve": presolve,
                    "seed": args.seed,
                    "mem_slack": args.mem_slack,
                    "time_limit": None if presolve else args.time_limit,
                }
                r = run(cfg, args.timeout)
                results.append(r)
                print(_row(r), flush=True) if len(results) > 1 else print(_header() + "\n" + _row(r), flush=True)

    print(
        "\nsizes are decisions/options/edges/pairs (pairs: matrix entries, inf included); "
        "times in seconds; 'problem' = building the Problem, 'total' = solve() end to end "
        "(validate, presolve, ILP build, backend, evaluate), 'cpu' = its CPU time"
    )
    for layers in args.layers:
        objs = [
            r["objective"] for r in results if r["layers"] == layers and "error" not in r and r["status"] == "optimal"
        ]
        if len(objs) > 1:
            spread = max(objs) - min(objs)
            agree = spread <= 1e-6 * max(1.0, abs(max(objs)))
            print(
                f"{layers} layers: optimal objectives of all configurations "
                f"{'agree' if agree else 'DIFFER'} (spread {spread:.3g})"
            )
    for presolve in (True, False):
        for backend in args.backends:
            rs = {
                r["layers"]: r
                for r in results
                if r["presolve"] == presolve and r["backend"] == backend and "error" not in r
            }
            if len(args.layers) >= 2 and all(l in rs for l in args.layers[:2]):
                a, b = (rs[l] for l in args.layers[:2])
                print(
                    f"{backend:5s} presolve {'on ' if presolve else 'off'}: "
                    f"{b['layers']}/{a['layers']} layers time ratio: "
                    f"solve() {b['t_total'] / a['t_total']:.2f}x "
                    f"(cpu {b['cpu_total'] / a['cpu_total']:.2f}x), "
                    f"problem+solve() {(b['t_total'] + b['t_problem']) / (a['t_total'] + a['t_problem']):.2f}x"
                )


def _header() -> str:
    return (
        f"{'layers':>6} {'backend':7} {'pre':3} {'size in':>28} {'size after presolve':>22} "
        f"{'vars':>7} {'cons':>7} {'problem':>7} {'presolve':>8} {'ilp':>6} {'solve':>6} "
        f"{'total':>6} {'cpu':>6} {'status':8} {'objective':>11} {'peakMB':>7}"
    )


def _row(r: dict) -> str:
    head = f"{r['layers']:>6} {r['backend']:7} {'on' if r['presolve'] else 'off':3}"
    if "error" in r:
        return f"{head} error: {r['error']}"
    return (
        f"{head} {fmt_size(r['in']):>28} {fmt_size(r['out']):>22} {r['variables']:>7} "
        f"{r['constraints']:>7} {r['t_problem']:7.2f} {r['t_presolve']:8.3f} {r['t_ilp']:6.2f} "
        f"{r['t_solve']:6.2f} {r['t_total']:6.2f} {r['cpu_total']:6.2f} {r['status']:8} {r['objective']:11.6g} "
        f"{r['rss_mb']:7.0f}"
    )


if __name__ == "__main__":
    main()
