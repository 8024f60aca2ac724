"""The plan and its estimates with each attention kernel traced: the CPU
kernel a "cpu" mesh traces, and the fused CUDA kernels a GPU runs (cuDNN,
flash, memory-efficient), traced on the CPU with
:func:`autoparallel.capture.attention_kernels.traced_attention_kernel`.

Per kernel, in its own subprocess: plan (the solver's figure: compute plus
communication), apply, and read the overlap scheduler's step estimate and
the memory per rank, as ``estimate_agreement.py`` does for its rows; then
the placements per kind of node (:meth:`Plan.placements_by_kind`) beside
the CPU kernel's, the attention ops compared on their attention tensors
(the CUDA kernels have more outputs: logsumexp, random-number state).
Asserts nothing::

    python benchmarks/attention_kernels.py                          # LLaMA-3 8B, 16 x 8, every kernel
    python benchmarks/attention_kernels.py --row debug_2x2 --kernels cpu cudnn
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

KERNELS = ("cpu", "cudnn", "flash", "efficient")


def _attention_op(op: str) -> bool:
    return "scaled_dot_product" in op


def _kinds(plan) -> dict[str, str]:
    """``role module op`` -> chosen placements; attention ops keyed without
    the kernel's name and read on q, k, v -> output only."""
    out = {}
    for kind in plan.placements_by_kind():
        op = kind.op
        signatures = kind.placements
        if _attention_op(op):
            backward = "backward" in op
            op = "attention backward" if backward else "attention"
            signatures = {}
            for sig, count in kind.placements.items():
                ins, outs = sig.split(" -> ")
                ins = ins.split(",")
                # forward: q, k, v (the first three); backward: grad_out, q, k, v
                ins = ",".join(ins[: 4 if backward else 3])
                first = outs.strip("()").split(", ")[0]
                key = f"{ins} -> {first}"
                signatures[key] = signatures.get(key, 0) + count
        out[f"{kind.role} {kind.module_path} {op}"] = "; ".join(f"{s} x{c}" for s, c in sorted(signatures.items()))
    return out


def run_one(row: str, kernel: str) -> dict:
    from autoparallel import AutoParallel
    from autoparallel.capture.attention_kernels import traced_attention_kernel
    from autoparallel.problem.memory import breakdown
    from autoparallel.report.numbers import step_estimate
    from estimate_agreement import ROWS, _setup

    kind, a = ROWS[row]
    model, mesh, inputs, mp, ins, outs = _setup(kind, a)
    t0 = time.perf_counter()
    with traced_attention_kernel(None if kernel == "cpu" else kernel):
        with AutoParallel(model, mesh, inputs, mp_policy=mp) as autop:
            autop.add_input_constraints(ins)
            autop.add_output_constraints(outs)
            plan = autop.optimize_placement()
            plan_s = time.perf_counter() - t0
            autop.apply_placement(plan)
            attention_ops = sorted({n.op for n in plan.nodes.values() if _attention_op(n.op)})
            fallback = sorted(autop.strategy_stats.fallback_ops)
    e = step_estimate(plan)
    return dict(
        kernel=kernel,
        plan_s=plan_s,
        total_s=time.perf_counter() - t0,
        status=plan.status,
        solver=plan.compute_cost + plan.comm_cost,
        solver_compute=plan.compute_cost,
        solver_comm=plan.comm_cost,
        step=e["step"],
        memory=breakdown(plan).total,
        attention_ops=attention_ops,
        fallback=fallback,
        kinds=_kinds(plan),
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="8b_16x8", help="a row of estimate_agreement.py (default 8b_16x8)")
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a subprocess's kernel
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.row, args.one)))
        return
    results = []
    for kernel in args.kernels:
        proc = subprocess.run(
            [sys.executable, __file__, "--row", args.row, "--one", kernel], capture_output=True, text=True
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{kernel}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}")
            continue
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    if not results:
        return
    base = results[0]
    print(f"{args.row}: per kernel, the solver's figure, the scheduled step, memory per rank")
    print(
        f"{'kernel':10s} {'plan s':>7s} {'solver ms':>10s} {'vs':>8s} {'compute':>8s} {'comm':>7s} {'step ms':>8s} {'vs':>8s} {'mem GB':>7s}  ops"
    )
    for r in results:
        print(
            f"{r['kernel']:10s} {r['plan_s']:7.1f} {r['solver'] * 1e3:10.2f} {(r['solver'] / base['solver'] - 1) * 100:+7.2f}% "
            f"{r['solver_compute'] * 1e3:8.2f} {r['solver_comm'] * 1e3:7.2f} {r['step'] * 1e3:8.2f} "
            f"{(r['step'] / base['step'] - 1) * 100:+7.2f}% {r['memory'] / 1e9:7.3f}  {', '.join(r['attention_ops'])}"
            + (f"; replicated for want of a rule: {', '.join(r['fallback'])}" if r["fallback"] else "")
        )
    for r in results[1:]:
        differ = sorted(
            k for k in base["kinds"].keys() | r["kinds"].keys() if base["kinds"].get(k) != r["kinds"].get(k)
        )
        print(
            f"{r['kernel']} vs {base['kernel']}: {len(differ)} of {len(base['kinds'])} kinds of node placed differently"
        )
        for k in differ[:20]:
            print(f"  {k}: {base['kinds'].get(k)}  vs  {r['kinds'].get(k)}")


if __name__ == "__main__":
    main()
