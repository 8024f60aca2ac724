"""Ranks agree on the plan before the first collective.

Every rank of a job plans on its own (planning is deterministic: counted work,
fixed tie-breaks, see :mod:`solver.work`), then each rank of the mesh posts a
fingerprint of its plan to the process group's key-value store and reads
everyone else's. Equal fingerprints: the job goes on. Different ones: every
rank raises :class:`PlanDisagreement` naming which ranks planned what and
what differs (constraints, model graph, inputs, solver options, or the
placements of the first nodes that differ). A rank that failed to plan posts
its error, so the others fail at once naming it; a rank that never posts is
named after :data:`TIMEOUT_ENV` seconds (default :data:`DEFAULT_TIMEOUT`).
Nothing waits forever, and no collective runs (the check needs no device).

Skipped where there is nothing to agree with: one process (world size 1,
or the "fake" process group planning for a cluster on one machine).

A plan file skips planning on every rank: ``Plan.load_json(path)`` then
``autop.apply_placement(plan)``, which runs the same check (a rank that
loaded another file is named).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import logging
import os
import zlib
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from ..plan import Plan

logger = logging.getLogger(__name__)

# Seconds a rank waits for the others' fingerprints once its own is posted:
# ranks plan the same problem, so they finish close together; the wait
# covers load differences between machines, not another solve.
DEFAULT_TIMEOUT = 300.0
TIMEOUT_ENV = "AUTOPARALLEL_AGREEMENT_TIMEOUT"
_KEY = "autoparallel/agreement"
# Per process: how many checks it ran. Ranks run the same program, so the
# n-th check of one rank meets the n-th of the others under its own keys.
_calls = {"count": 0}


class PlanDisagreement(RuntimeError):
    """Ranks of one mesh hold different plans (or one failed to plan)."""


def plan_digest(plan: "Plan") -> str:
    """sha1 over every node's name, option and placements (what apply runs)."""
    h = hashlib.sha1()
    for name in sorted(plan.nodes):
        n = plan.nodes[name]
        h.update(f"{name}|{n.option}|{','.join(n.input_placements)}|{n.output_placements}\n".encode())
    return h.hexdigest()


def _summary(plan: "Plan", solver_options: dict[str, Any]) -> dict[str, Any]:
    prov = plan.provenance or {}
    return {
        "plan": plan_digest(plan),
        "objective": plan.solution.objective,
        "status": plan.solution.status,
        "stopped_by": getattr(plan.solution, "stopped_by", None),
        "mesh": [list(plan.mesh_shape), plan.mesh_dim_names],
        "model graph": prov.get("graph_fingerprint"),
        "cost model": prov.get("device"),
        "inputs": prov.get("input_shapes"),
        "constraints": {name: _short(value) for name, value in plan.constraints.items()},
        "solver options": solver_options,
    }


def _short(value: Any) -> str:
    """A constraint's value, compared by digest and shown in part (the
    memory budget's record holds the whole step's memory model)."""
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 160 else f"{text[:150]}... (sha1 {hashlib.sha1(text.encode()).hexdigest()[:12]})"


def _placements(plan: "Plan") -> str:
    rows = {name: [n.input_placements, n.output_placements] for name, n in plan.nodes.items()}
    return base64.b64encode(zlib.compress(json.dumps(rows, sort_keys=True).encode())).decode()


def mesh_ranks(mesh) -> list[int]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # the mesh tensor, outside tracing's fake mode
        return sorted(int(r) for r in mesh.mesh.flatten().tolist())


def needs_agreement() -> bool:
    """More than one process holds a plan: a real (not "fake") group of
    more than one rank."""
    return dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"


def agree(
    plan: "Plan | None",
    ranks: list[int],
    *,
    what: str = "plan",
    solver_options: dict[str, Any] | None = None,
    error: BaseException | None = None,
    timeout: float | None = None,
) -> None:
    """Post this rank's plan (or ``error``) and check every rank of
    ``ranks`` posted the same plan; raise :class:`PlanDisagreement` naming
    the ranks and what differs, or those that did not post in ``timeout``
    seconds. No-op where :func:`needs_agreement` is False or this rank is
    not in ``ranks``."""
    if not needs_agreement():
        return
    me = dist.get_rank()
    if me not in ranks:
        return
    if timeout is None:
        timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
    # private torch API: see torch_compat (the store every process group was built on)
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    _calls["count"] += 1
    prefix = f"{_KEY}/{_calls['count']}/{what}"
    if error is not None:  # the others fail at once, naming this rank; it raises its own error
        store.set(f"{prefix}/{me}/summary", json.dumps({"error": f"{type(error).__name__}: {error}"}))
        return
    posted = _summary(plan, solver_options or {})
    store.set(f"{prefix}/{me}/placements", _placements(plan))
    store.set(f"{prefix}/{me}/summary", json.dumps(posted, default=str))
    keys = [f"{prefix}/{r}/summary" for r in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception:  # the store's timeout (DistStoreError or RuntimeError by release)
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        raise PlanDisagreement(
            f"rank {me}: ranks {missing} did not report their {what} within {timeout:.0f} s "
            f"(set {TIMEOUT_ENV} for a longer wait); they may still be planning, have failed, or "
            "run another program; every rank of the mesh must plan the same model, or load the same plan file"
        ) from None
    summaries = {r: json.loads(store.get(k)) for r, k in zip(ranks, keys)}
    failed = {r: s["error"] for r, s in summaries.items() if "error" in s}
    if failed:
        raise PlanDisagreement(
            f"rank {me}: no common {what}: "
            + "; ".join(f"rank {r} failed to plan ({e})" for r, e in sorted(failed.items()))
        )
    groups: dict[str, list[int]] = {}
    for r, s in summaries.items():
        groups.setdefault(s["plan"], []).append(r)
    if len(groups) == 1:
        logger.info("all %d ranks hold the same %s (%s)", len(ranks), what, posted["plan"][:12])
        return
    raise PlanDisagreement(_describe(me, what, summaries, groups, store, prefix))


def _describe(me: int, what: str, summaries: dict, groups: dict, store, prefix: str) -> str:
    """Which ranks hold which plan and what differs between the first two."""
    lines = [f"rank {me}: the ranks hold {len(groups)} different {what}s:"]
    for digest, rs in sorted(groups.items(), key=lambda kv: kv[1]):
        s = summaries[rs[0]]
        lines.append(
            f"  ranks {rs}: plan {digest[:12]}, objective {s['objective']:.6g}, {s['status']}"
            + (f" (stopped by its {s['stopped_by']})" if s.get("stopped_by") else "")
        )
    (a, *_), (b, *_) = sorted(groups.values())[:2]
    sa, sb = summaries[a], summaries[b]
    differ = [
        k for k in ("mesh", "model graph", "cost model", "inputs", "constraints", "solver options") if sa[k] != sb[k]
    ]
    for k in differ:
        if k == "constraints":
            names = sorted(set(sa[k]) | set(sb[k]))
            for name in (n for n in names if sa[k].get(n) != sb[k].get(n)):
                lines.append(f"  constraint {name!r}: rank {a} {sa[k].get(name)}, rank {b} {sb[k].get(name)}")
        else:
            lines.append(f"  {k}: rank {a} {sa[k]}, rank {b} {sb[k]}")
    pa, pb = (json.loads(zlib.decompress(base64.b64decode(store.get(f"{prefix}/{r}/placements")))) for r in (a, b))
    nodes = [n for n in sorted(set(pa) | set(pb)) if pa.get(n) != pb.get(n)]
    for n in nodes[:5]:
        lines.append(f"  node {n}: rank {a} {_fmt(pa.get(n))}, rank {b} {_fmt(pb.get(n))}")
    if len(nodes) > 5:
        lines.append(f"  ... {len(nodes)} nodes differ in all")
    if not differ:
        lines.append(
            "  same model, inputs, mesh, constraints and solver options: the solve itself differed "
            "(a plan stopped by its time limit depends on load); give the solve more time, or plan once "
            "and load the plan file on every rank (Plan.load_json + apply_placement)"
        )
    else:
        lines.append("  every rank must plan with the same constraints and options, or load the same plan file")
    return "\n".join(lines)


def _fmt(row) -> str:
    return "absent" if row is None else f"{','.join(row[0])} -> {row[1]}"
