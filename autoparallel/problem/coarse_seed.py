"""Seed option pricing with the optimal plan of a coarser mesh.

Option pricing (:mod:`autoparallel.problem.pricing`) starts from a few
options per node and grows them by LP duals; on a 4-D mesh its first
restricted problems hold poor plans (LLaMA-3 70B on 4x4x8x8: the greedy
seed's plan costs ~3x what a data x context x tensor parallel layout
does). A plan on the mesh with two adjacent dims merged into one (4x4x8x8
-> 16x8x8) is a plan on the full mesh too: a placement on the merged dim
is the same placement on both (``Shard(d)`` over 16 ranks in row-major
order is ``Shard(d), Shard(d)`` over 4 x 4; ``Replicate`` and ``Partial``
alike). That coarser problem is dense and solved exactly; its optimum,
lifted, joins the seed, so the priced plan is never worse (in the full
mesh's costs, which charge a collective over both dims as two steps, where
the coarse mesh charges one; with min-cost redistribution plans the two
steps cost about what the one does, see below) than the lifted plan. A
parameter whose coarse
layout is a strided (tp-outer) shard of the merged dim has no lifted
counterpart and is left to the other seeds.

Which dims merge: every adjacent pair that no pin places differently, each
a plan of its own (seeded together, the restricted ILP takes the best of
their pieces). Which pair gives the best plan is not predictable from the
mesh: on LLaMA-3 70B 4x4x8x8 (dp_replicate, dp_shard, cp, tp), one layer,
the 16x8x8 plan (dp dims merged) seeds pricing to a 0.210 s plan (0.367 s
from the greedy seed alone), while the 4x4x64 plan, 0.123 s on its own mesh,
cost 0.535 s lifted (figures of 2026-11-23). Not because its 64-rank
collectives become two steps (an all-gather or all-to-all over 8 x 8 ranks
as two steps moves about the bytes of one), but because redistributions
were then costed (and applied) with DTensor's greedy plan, which on >= 3-D
meshes first un-shards the inner mesh dims, so the later steps move 8-64x
bigger buffers (LLaMA-3 70B's activation ``S(2) S(2) S(2) S(2) -> S(0) S(0)
S(1) S(1)``: 11.8 ms greedily, 0.74 ms as six all-to-alls at the local
size). Costs and apply now follow the min-cost plan
(:mod:`autoparallel.cost_model.redistribute_plan`), never dearer than the
greedy one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec

import solver

from .. import cost_model
from ..options.placements import placements_of
from .builder import Constraints, build_problem
from ..options.strategies import NodeStrategy, StrategyEnumerator

logger = logging.getLogger(__name__)

# Seconds for the coarse problem's ILP when the caller limits ILP time: it
# is a full dense 3-D problem (LLaMA-3 70B on 16x8x8, one layer: 673K
# columns, no incumbent within 10 s).
COARSE_TIME_LIMIT = 60.0

# Coarse ILPs solved at once (each in a worker thread; HiGHS's solve runs
# without the GIL). Two: the planning machine has at least two cores, and
# at most two coarse problems are in memory at a time anyway.
SOLVER_THREADS = 2


def merge_candidates(mesh: DeviceMesh) -> list[int]:
    """``i`` for each adjacent pair of mesh dims ``(i, i + 1)`` to merge
    (none on a 1-D or 2-D mesh: option pricing is for bigger ones)."""
    return list(range(mesh.ndim - 1)) if mesh.ndim >= 3 else []


def _merge(placements: tuple, i: int):
    """Placements on the full mesh as the coarse mesh's, or None when dims
    ``i`` and ``i + 1`` differ (no coarse placement says the same)."""
    if placements[i] != placements[i + 1]:
        return None
    return placements[: i + 1] + placements[i + 2 :]


def _lift(placements, i: int):
    """A coarse placements tuple (or a tuple of them) on the full mesh."""
    if placements is None:
        return None
    if placements and isinstance(placements[0], tuple):
        return tuple(_lift(p, i) for p in placements)
    return placements[: i + 1] + (placements[i],) + placements[i + 1 :]


class _OptionIndex:
    """Per full option list (by identity), each option's index by its
    placements (output, inputs), the first option on ties; built once for
    every coarse mesh. Placements are keyed as small ints, one per distinct
    placements tuple, memoised per spec object (specs are pooled: a few
    thousand serve 300K options; a tuple of placements hashes in Python)."""

    def __init__(self):
        self._ids: dict[tuple, int] = {}  # placements -> int
        self._by_spec: dict[int, int] = {}  # id(spec) -> int (the specs outlive this index's use)
        self._tables: dict[int, dict] = {}  # id(option list) -> {key: option index}

    def _code(self, spec):
        if isinstance(spec, DTensorSpec):
            code = self._by_spec.get(id(spec))
            if code is None:
                code = self._by_spec[id(spec)] = self._ids.setdefault(spec.placements, len(self._ids))
            return code
        if isinstance(spec, (tuple, list)):
            return tuple(self._code(s) for s in spec)
        return None

    def _lifted_code(self, placements):
        """The code of placements as :func:`placements_of` gives them (a
        tuple of placements, a tuple of those, None); -1 for placements no
        spec of the full lists has (no option matches)."""
        if placements is None:
            return None
        if placements and isinstance(placements[0], tuple):
            return tuple(self._lifted_code(p) for p in placements)
        return self._ids.get(placements, -1)

    def find(self, options: list, output_placements, input_placements) -> int | None:
        """Index in ``options`` of the option with these placements, or None."""
        table = self._tables.get(id(options))
        if table is None:
            table = self._tables[id(options)] = {
                (self._code(o.output_specs), tuple(self._code(s) for s in o.input_specs)): k
                for k, o in reversed(list(enumerate(options)))
            }
        key = (self._lifted_code(output_placements), tuple(self._lifted_code(p) for p in input_placements))
        return table.get(key)


def lifted_plans(traced, strategies, mesh: DeviceMesh, constraints: Constraints, **kw) -> list[dict[str, int]]:
    """:func:`lifted_plan` for every adjacent pair of mesh dims.

    Each coarse problem is built in this thread and solved in a worker
    thread (:data:`SOLVER_THREADS`): HiGHS releases the GIL, so the next
    coarse mesh's options and build (Python) run while the previous one's
    ILP solves, and the ILPs of two coarse meshes solve side by side
    (LLaMA-3 70B on 4x4x8x8: the 16x8x8 ILP, ~8 s, beside the 4x4x64
    options, build and ILP). The plans are the same as one after the other."""
    index = _OptionIndex()
    backend, time_limit = kw.pop("backend", None), kw.pop("time_limit", None)
    plans, pending = [], None
    with ThreadPoolExecutor(max_workers=SOLVER_THREADS, thread_name_prefix="coarse-seed") as worker:
        for i in merge_candidates(mesh):
            coarse = _coarse_problem(traced, mesh, constraints, merge=i, **kw)
            if coarse is None:
                continue
            future = worker.submit(_solve, coarse, backend, time_limit)
            # lift the previous plan now, so that at most two coarse
            # problems are in memory (the previous one's, this one's)
            if pending is not None:
                plans.append(_lifted(pending[0], pending[1].result(), strategies, index))
            pending = (coarse, future)
        if pending is not None:
            plans.append(_lifted(pending[0], pending[1].result(), strategies, index))
    return [p for p in plans if p]


@dataclasses.dataclass
class _CoarseProblem:
    """The dense problem of the mesh with dims ``merge`` and ``merge + 1``
    merged, and when its making began (for the log)."""

    merge: int
    shape: tuple[int, ...]
    built: object  # problem_builder.BuiltProblem
    started: float


def lifted_plan(
    traced,
    strategies: dict[torch.fx.Node, NodeStrategy],
    mesh: DeviceMesh,
    constraints: Constraints,
    *,
    device: cost_model.DeviceSpec,
    overlap: cost_model.CommOverlapPolicy,
    repeats,
    merge: int,
    backend: str | None = None,
    time_limit: float | None = None,
    option_index: _OptionIndex | None = None,
) -> dict[str, int]:
    """Per node, the option (index into ``strategies``) the optimal plan of
    the mesh with dims ``merge`` and ``merge + 1`` merged lifts to; empty
    when that problem is itself too big or has no plan. Nodes whose lifted
    option the full mesh's list lacks are left out."""
    coarse = _coarse_problem(traced, mesh, constraints, device=device, overlap=overlap, repeats=repeats, merge=merge)
    if coarse is None:
        return {}
    return _lifted(coarse, _solve(coarse, backend, time_limit), strategies, option_index or _OptionIndex())


def _coarse_problem(
    traced, mesh: DeviceMesh, constraints: Constraints, *, device, overlap, repeats, merge: int
) -> _CoarseProblem | None:
    """The coarse mesh's dense problem; None when a pin places the merged
    dims differently or the problem cannot be built (too big)."""
    i = merge
    t0 = time.perf_counter()
    shape = list(mesh.shape)
    coarse_shape = shape[:i] + [shape[i] * shape[i + 1]] + shape[i + 2 :]
    names = mesh.mesh_dim_names
    coarse_names = None if names is None else names[:i] + (f"{names[i]}*{names[i + 1]}",) + names[i + 2 :]
    # planning only: no process groups (a real job's planning runs on every rank)
    coarse = DeviceMesh(
        mesh.device_type, mesh.mesh.reshape(coarse_shape), mesh_dim_names=coarse_names, _init_backend=False
    )
    pins = {}
    for name, (cname, placements) in constraints.pins.items():
        merged = _merge(tuple(placements), i)
        if merged is None:
            # its plan would break the pin: not a plan of the full mesh
            logger.info("coarse mesh merging dims %d and %d: %s places them differently, skipped", i, i + 1, cname)
            return None
        pins[name] = (cname, merged)
    # a rule on dim i or i + 1 holds on the merged dim (its plans lift to the
    # same placement on both); later dims shift down by one
    rules = {
        name: [dataclasses.replace(r, mesh_dim=r.mesh_dim - (r.mesh_dim > i)) for r in node_rules]
        for name, node_rules in constraints.option_rules.items()
    }
    coarse_constraints = dataclasses.replace(constraints, pins=pins, option_rules=rules, option_pricing=False)
    coarse_strategies = StrategyEnumerator(coarse).enumerate(traced.gm, set(traced.param_nodes.values()))
    try:
        built = build_problem(
            traced, coarse_strategies, coarse, coarse_constraints, device=device, overlap=overlap, repeats=repeats
        )
    except _NO_PLAN as exc:
        logger.info("coarse mesh %s: no plan to seed pricing with (%s)", tuple(coarse_shape), exc)
        return None
    return _CoarseProblem(i, tuple(coarse_shape), built, t0)


# what a coarse problem that cannot seed pricing raises
_NO_PLAN = (solver.InfeasibleError, solver.SolverError, ValueError, RuntimeError)


def _solve(coarse: _CoarseProblem, backend: str | None, time_limit: float | None) -> solver.Solution | None:
    """The coarse problem's optimum, or None (logged) when it has none."""
    limit = None if time_limit is None else max(time_limit, COARSE_TIME_LIMIT)
    try:
        return solver.solve(
            coarse.built.problem, backend=backend, time_limit=limit, node_limit=solver.DEFAULT_NODE_LIMIT
        )
    except _NO_PLAN as exc:
        logger.info("coarse mesh %s: no plan to seed pricing with (%s)", coarse.shape, exc)
        return None


def _lifted(coarse: _CoarseProblem, sol: solver.Solution | None, strategies, index: _OptionIndex) -> dict[str, int]:
    """Per node of ``strategies``, the index of the option the coarse
    solution lifts to (nodes whose lifted option their list lacks left out)."""
    if sol is None:
        return {}
    i = coarse.merge
    by_name = {n.name: n for n in strategies}
    lifted: dict[str, int] = {}
    for node, strat in coarse.built.strategies.items():
        full = strategies.get(by_name.get(node.name))
        if full is None:
            continue
        o = strat.options[sol.choice[node.name]]
        k = index.find(
            full.options,
            _lift(placements_of(o.output_specs), i),
            tuple(_lift(placements_of(s), i) for s in o.input_specs),
        )
        if k is not None:
            lifted[node.name] = k
    logger.info(
        "coarse mesh %s (dims %d and %d merged): plan %.6g (%s) lifted to %d of %d nodes in %.1fs",
        coarse.shape,
        i,
        i + 1,
        sol.objective,
        sol.status,
        len(lifted),
        len(strategies),
        time.perf_counter() - coarse.started,
    )
    return lifted
