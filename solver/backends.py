"""MILP backends: hand an :class:`~solver.ilp.IlpModel` to a solver.

* ``"highs"`` (default): HiGHS through ``highspy``. The arrays are passed in
  one call (``Highs.passModel``); ``pulp.HiGHS`` makes one Python call per
  column and row (measured: 0.5 s to load 60k columns). The LP
  relaxation is solved first, without HiGHS' presolve: the pairwise
  encoding is integral on trees and, in practice, on most transformer
  problems, and an integral LP optimum is a proven MIP optimum (on big
  models the LP is solved by column generation first, :mod:`solver.colgen`,
  falling back to the full LP). Otherwise
  the MIP is solved, started from the LP optimum rounded (each decision
  its largest option) and polished by :mod:`solver.local_search`; its
  reported bound is at least the LP's. So a time limit that stops the
  search early still gives a good plan with a proven gap.
* ``"cbc"``: CBC as bundled with PuLP (``pulp.PULP_CBC_CMD``), via
  :meth:`IlpModel.to_pulp` and an MPS file; the bound (hence the gap) is
  read from its log.

HiGHS was faster on every problem measured: 10x to 100x on transformer
problems (the 4-layer LLaMA-3 8B problem after presolve: 0.7 s against
490 s for CBC).

Both are deterministic for a given model and options: HiGHS with its fixed
default random seed, CBC single-threaded. The search stops on counted work
(``node_limit`` MIP nodes, :data:`solver.highs_bb.NODE_BUDGET` decision
nodes); ``time_limit`` is a safety cap, and only a solve that reaches it can
differ between runs (see :mod:`solver.work`).

Example::

    >>> "cbc" in available_backends()
    True
"""

from __future__ import annotations

import logging
import math
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import numpy as np

from . import colgen, highs_quiet
from .highs_bb import branch_and_bound
from .ilp import IlpModel

logger = logging.getLogger(__name__)

# A solve counts as "optimal" only when the relative gap is below this.
OPTIMAL_GAP = 1e-9
# An LP relaxation whose binaries are this close to 0/1 is taken as integral.
INTEGRALITY_TOL = 1e-9


class SolverError(RuntimeError):
    """The backend failed, or stopped without any feasible solution."""


@dataclass
class BackendResult:
    """What a backend found.

    ``status``: ``"optimal"`` (proven), ``"feasible"`` (stopped by time limit
    or gap with an incumbent), ``"infeasible"``, or ``"unknown"`` (stopped
    without an incumbent). ``values`` holds column values (``None`` unless a
    solution exists); ``objective`` and ``bound`` are in true (unscaled)
    units. ``timings`` has the backend's ``build``/``solve``/``extract``.
    """

    status: str
    values: Sequence[float] | None = None
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    timings: dict[str, float] = field(default_factory=dict)


class Backend:
    name = ""

    def available(self) -> bool:
        raise NotImplementedError

    def solve(
        self,
        model: IlpModel,
        *,
        time_limit: float | None = None,
        rel_gap: float | None = None,
        node_limit: int | None = None,
    ) -> BackendResult:
        raise NotImplementedError


def _relative_gap(objective: float, bound: float | None) -> float | None:
    if bound is None or not math.isfinite(bound):
        return None
    return max(0.0, objective - bound) / max(abs(objective), 1e-12)


def _trivial(model: IlpModel) -> BackendResult:
    """A model without columns: everything is fixed by domain reduction."""
    if model.num_rows:  # only constant rows can remain; build() checked them
        raise AssertionError("rows without columns")
    obj = model.objective_offset
    return BackendResult("optimal", [], obj, obj, 0.0, {"build": 0.0, "solve": 0.0, "extract": 0.0})


class HighsBackend(Backend):
    name = "highs"

    def available(self) -> bool:
        try:
            import highspy  # noqa: F401
        except ImportError:
            return False
        return True

    def solve(self, model, *, time_limit=None, rel_gap=None, node_limit=None):
        if model.num_cols == 0:
            return _trivial(model)
        run = _HighsRun(model, time_limit, rel_gap, node_limit)
        # The LP relaxation first: the pairwise encoding is integral on trees
        # and often on transformer graphs, and an integral LP optimum is a
        # proven MIP optimum. Without HiGHS' presolve it takes a fraction of
        # the MIP's root processing. Infeasible LP => infeasible MIP.
        # Big models: the same LP optimum by column generation first (see
        # solver.colgen); an integral one ends the solve here.
        # The time limit bounds the search after this LP, not the LP: without
        # its optimum there is no rounded start, hence no plan at all (a
        # 16x8x8 LLaMA-3 70B problem's LP took 12 s against a 10 s limit).
        if model.num_cols - model.num_x >= colgen.MIN_PAIR_COLUMNS:
            result = run.column_generation()
            if result is not None:
                return result
        result = run.relaxation()
        if result is None:
            logger.debug("highs: LP relaxation is fractional, solving the MIP")
            result = run.branch_on_decisions()
        if result is None:
            result = run.mip()
        return result

    @staticmethod
    def _highs(options: dict, time_limit: float | None):

        h = highs_quiet.new_highs()
        h.setOptionValue("output_flag", False)
        for key, value in options.items():
            h.setOptionValue(key, value)
        if time_limit is not None:
            h.setOptionValue("time_limit", float(time_limit))
        return h

    @staticmethod
    def _lp(model: IlpModel):
        """The model as a (continuous) ``HighsLp``, built from whole arrays."""
        import highspy
        import numpy as np

        lp = highspy.HighsLp()
        lp.num_col_ = model.num_cols
        lp.num_row_ = model.num_rows
        lp.col_cost_ = model.col_cost
        lp.col_lower_ = np.zeros(model.num_cols)
        lp.col_upper_ = model.col_upper
        # kHighsInf is IEEE inf, as in the model's bounds.
        lp.row_lower_ = model.row_lower
        lp.row_upper_ = model.row_upper
        a = lp.a_matrix_
        a.format_ = highspy.MatrixFormat.kRowwise
        a.num_col_ = model.num_cols
        a.num_row_ = model.num_rows
        a.start_ = model.row_start.astype(np.int32)
        a.index_ = model.row_index.astype(np.int32)
        a.value_ = model.row_value
        return lp


class _HighsRun:
    """One :meth:`HighsBackend.solve` of a model with columns, phase by
    phase: LP relaxation (by column generation, then whole), branching on
    decisions from its rounded optimum, HiGHS' MIP. Each phase returns the
    result when it ends the solve, ``None`` to go on."""

    def __init__(self, model: IlpModel, time_limit, rel_gap, node_limit):
        self.model = model
        self.time_limit, self.rel_gap, self.node_limit = time_limit, rel_gap, node_limit
        self.t1 = time.perf_counter()  # "solve" starts here, less the build
        self.timings = {"build": 0.0}
        self.scale, self.off = model.objective_scale, model.objective_offset
        self.lp = None  # the HighsLp, once built
        self.relaxed = None  # the LP relaxation's Highs, when solved to optimality
        self.t_search = None  # the search's time limit starts with it
        self.start = None  # binary MIP start
        self.lp_bound = None  # the relaxation's optimum (true units)
        self.incumbent = None  # (values, objective) found before the MIP

    def _ended(self, *args) -> BackendResult:
        self.timings.update(solve=time.perf_counter() - self.t1, extract=0.0)
        return BackendResult(*args, timings=self.timings)

    def column_generation(self) -> BackendResult | None:
        """The LP optimum by column generation; ends the solve when integral."""
        import numpy as np

        model = self.model
        cg = colgen.solve_lp(model, None)
        if cg is None:
            return None
        x = np.asarray(cg.values[: model.num_x])
        logger.debug(
            "highs: column generation: %d of %d pair columns, %d rounds",
            cg.columns,
            model.num_cols - model.num_x,
            cg.rounds,
        )
        if not np.all(np.minimum(np.abs(x), np.abs(1.0 - x)) <= INTEGRALITY_TOL):
            return None
        objective = cg.objective * self.scale + self.off
        logger.debug("highs: LP relaxation (column generation) is integral")
        return self._ended("optimal", cg.values, objective, objective, 0.0)

    def relaxation(self) -> BackendResult | None:
        """The full LP relaxation: ends the solve when infeasible or integral."""
        import numpy as np

        model = self.model
        # The full model for HiGHS: only now, as column generation may have
        # ended the solve (its arrays cost 0.4 s on a 1M-column model).
        t0 = time.perf_counter()
        self.lp = HighsBackend._lp(model)
        self.timings["build"] = time.perf_counter() - t0
        self.t1 += self.timings["build"]  # "solve" and the time limit leave the build out, as before
        h = HighsBackend._highs({"presolve": "off"}, None)
        h.passModel(self.lp)
        h.run()
        ms = h.getModelStatus()
        self.t_search = time.perf_counter()  # the search's time limit starts now
        S = _highs_status()
        if ms == S.kInfeasible:
            return self._ended("infeasible")
        if ms != S.kOptimal:
            return None
        self.relaxed = h
        values = h.getSolution().col_value
        x = np.asarray(values[: model.num_x])
        if np.all(np.minimum(np.abs(x), np.abs(1.0 - x)) <= INTEGRALITY_TOL):
            objective = h.getInfo().objective_function_value * self.scale + self.off
            logger.debug("highs: LP relaxation is integral")
            return self._ended("optimal", values, objective, objective, 0.0)
        return None

    def branch_on_decisions(self) -> BackendResult | None:
        """From the LP optimum rounded, branching on decisions
        (:mod:`solver.highs_bb`); ends the solve when it proves its plan (or
        meets ``rel_gap``), else leaves the MIP its plan and bound."""
        import numpy as np

        if self.relaxed is None:
            return None
        model, h, rel_gap = self.model, self.relaxed, self.rel_gap
        # The LP optimum rounded (each decision takes its largest option) is
        # a MIP start: on the 1-layer LLaMA it is within 0.03% of the
        # optimum, where HiGHS' own heuristics spent 20 s at a 10% gap. With
        # a time limit, the plan is then this good however early HiGHS stops.
        self.start = _rounded(model, h.getSolution().col_value)
        # The relaxation's optimum bounds the MIP: the bound to report if the
        # MIP stops (time limit) before its own root LP is solved.
        self.lp_bound = h.getInfo().objective_function_value * self.scale + self.off
        # Our own branching on decisions first (see solver.highs_bb):
        # it proved the 1-layer LLaMA in 15 LP re-solves (2 s) where
        # HiGHS' MIP took 50 s. Most of the time limit: on placement
        # problems HiGHS' MIP rarely proves anything in the rest (its
        # root alone took 30 s on the LLaMA), but keeps improving on
        # problems like random grids where cuts pay.
        # its node budget is the normal stop; the time limit a safety cap
        deadline = None if self.time_limit is None else self.t_search + self.time_limit
        bb = branch_and_bound(h, model, h.getInfo().objective_function_value, self.start, deadline, rel_gap)
        if bb.values is not None:
            self.start = np.asarray(bb.values[: model.num_x])
            objective = bb.objective * self.scale + self.off
            bound = bb.bound * self.scale + self.off
            self.lp_bound = max(self.lp_bound, bound)
            gap = _relative_gap(objective, bound)
            if bb.proven or (rel_gap is not None and gap is not None and gap <= rel_gap):
                status = "optimal" if bb.proven else "feasible"
                return self._ended(
                    status, bb.values, objective, objective if bb.proven else bound, 0.0 if bb.proven else gap
                )
            self.incumbent = (bb.values, objective)
        logger.debug("highs: branching on decisions did not finish; solving the MIP")
        return None

    def mip(self) -> BackendResult:
        """HiGHS' MIP from the start, for what is left of the time limit."""
        import highspy
        import numpy as np

        model, rel_gap, node_limit = self.model, self.rel_gap, self.node_limit
        remaining = None
        if self.time_limit is not None:
            remaining = max(0.0, self.time_limit - (time.perf_counter() - self.t_search))
        kint, kcont = highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous
        self.lp.integrality_ = [kint] * model.num_x + [kcont] * (model.num_cols - model.num_x)
        h = HighsBackend._highs(
            # The objective is scaled to unit max coefficient: an absolute
            # gap would be meaningless, so rely on the relative one alone.
            # The default integrality tolerance (1e-6) let a nearly
            # integral x pick cheaper pairs: on a real LLaMA problem the
            # decoded choice came out 6e-8 (relative) above the optimum.
            {
                "mip_rel_gap": 0.0 if rel_gap is None else float(rel_gap),
                "mip_abs_gap": 0.0,
                "mip_feasibility_tolerance": INTEGRALITY_TOL,
                # Feasibility checks (diagnosis) found a solution about twice
                # as fast without HiGHS' presolve; optimisation was faster
                # with it.
                **({} if model.col_cost.any() else {"presolve": "off"}),
                # counted, so the incumbent does not depend on the machine's load
                **({} if node_limit is None else {"mip_max_nodes": int(node_limit)}),
            },
            remaining,
        )
        h.passModel(self.lp)
        if self.start is not None:
            # Only the binaries: HiGHS completes the pair variables with an
            # LP and drops the start if it violates a (resource) row.
            h.setSolution(model.num_x, np.arange(model.num_x, dtype=np.int32), self.start)
        h.run()
        t2 = time.perf_counter()
        self.timings["solve"] = t2 - self.t1
        return self._mip_result(h, t2)

    def _mip_result(self, h, t2: float) -> BackendResult:
        """The MIP's plan (or the incumbent, when HiGHS found none better),
        its bound (at least the relaxation's) and gap; ``t2``: when the MIP
        ended (the extraction's start)."""
        S = _highs_status()
        ms = h.getModelStatus()
        info = h.getInfo()
        has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
        if ms in (S.kInfeasible, S.kUnboundedOrInfeasible):
            self.timings["extract"] = 0.0
            return BackendResult("infeasible", timings=self.timings)
        if not has_solution and self.incumbent is None:
            self.timings["extract"] = 0.0
            if ms in (S.kTimeLimit, S.kIterationLimit, S.kInterrupt, S.kSolutionLimit):
                return BackendResult("unknown", timings=self.timings)
            raise SolverError(f"HiGHS stopped with status {h.modelStatusToString(ms)}")

        if has_solution:
            values = h.getSolution().col_value
            objective = info.objective_function_value * self.scale + self.off
        if self.incumbent is not None and (not has_solution or objective > self.incumbent[1]):
            # HiGHS stopped without improving on (or dropped) the start.
            values, objective = self.incumbent
        bound = info.mip_dual_bound * self.scale + self.off if math.isfinite(info.mip_dual_bound) else None
        gap = info.mip_gap if math.isfinite(info.mip_gap) else _relative_gap(objective, bound)
        lp_bound = self.lp_bound
        if lp_bound is not None and (bound is None or lp_bound > bound):
            bound, gap = lp_bound, _relative_gap(objective, lp_bound)
        # Asked for no gap, HiGHS stops at optimality within its tolerances.
        optimal = ms == S.kOptimal and (self.rel_gap is None or (gap is not None and gap <= OPTIMAL_GAP))
        if optimal:
            gap = 0.0
        self.timings["extract"] = time.perf_counter() - t2
        return BackendResult("optimal" if optimal else "feasible", values, objective, bound, gap, self.timings)


def _highs_status():
    import highspy

    return highspy.HighsModelStatus


def _rounded(model: IlpModel, values) -> "np.ndarray":
    """Binary values: per decision, its option with the largest LP value,
    then polished by :func:`solver.local_search.improve`.

    When that breaks a resource row (a binding memory budget: the LP mixes
    a plan that fits with one that does not), per decision the option among
    those the LP uses that weighs least in the rows instead: with a single
    row, its weight is at most the LP's (a mix of those options), so the
    choice fits as the LP does."""
    import numpy as np

    values = np.asarray(values)
    choice = _round(model, lambda c: -values[c])
    x = _polished(model, choice)
    if model.resource_rows and not _fits(model, x):
        score = _resource_score(model)
        light = _round(model, lambda c: (score[c], -values[c]), used=values)
        x_light = _polished(model, light)
        if _fits(model, x_light):
            logger.debug("highs: the rounded LP breaks a resource row; starting from its lightest options")
            return x_light
    return x


def _round(model: IlpModel, key, used=None) -> dict[str, int]:
    """Per decision, its option whose column minimises ``key`` (among those
    with a positive value in ``used``, if given)."""
    choice = {}
    for name, cols in model.option_cols.items():
        live = [(o, c) for o, c in enumerate(cols) if c is not None]
        if used is not None:
            live = [(o, c) for o, c in live if used[c] > 1e-9] or live
        if live:  # linked decisions share columns and agree on their choice
            choice[name] = min(live, key=lambda oc: key(oc[1]))[0]
    return choice


def _resource_score(model: IlpModel) -> "np.ndarray":
    """Per option column: its weight summed over the resource rows, signed
    so that smaller moves away from the bounds (upper: lighter, lower:
    heavier)."""
    import numpy as np

    score = np.zeros(model.num_x)
    for r in model.resource_rows:
        a, b = model.row_start[r], model.row_start[r + 1]
        sign = (1.0 if math.isfinite(model.row_upper[r]) else 0.0) - (1.0 if math.isfinite(model.row_lower[r]) else 0.0)
        np.add.at(score, model.row_index[a:b], sign * model.row_value[a:b])
    return score


def _fits(model: IlpModel, x) -> bool:
    """Do binary option values ``x`` meet every resource row (with the
    MIP's feasibility tolerance)?"""
    for r in model.resource_rows:
        a, b = model.row_start[r], model.row_start[r + 1]
        act = float(x[model.row_index[a:b]] @ model.row_value[a:b])
        if not model.row_lower[r] - 1e-9 <= act <= model.row_upper[r] + 1e-9:
            return False
    return True


def _polished(model: IlpModel, choice: dict[str, int]) -> "np.ndarray":
    """Binary option values of ``choice`` after :func:`solver.local_search.improve`."""
    import numpy as np

    from .local_search import improve

    x = np.zeros(model.num_x)
    if len(choice) == len(model.option_cols):
        t0 = time.perf_counter()
        full = model.decode([0.0] * model.num_x)  # fixed decisions' options
        full.update(choice)
        polished = improve(model.problem, full)
        logger.debug("highs: local search on the rounded LP took %.3fs", time.perf_counter() - t0)
        if all(model.option_cols[n][polished[n]] is not None for n in choice):
            choice = {n: polished[n] for n in choice}
    for name, o in choice.items():
        x[model.option_cols[name][o]] = 1.0
    return x


class CbcBackend(Backend):
    name = "cbc"

    def _solver(self, **kwargs):
        import pulp

        with warnings.catch_warnings():  # PuLP 3 deprecates the bundled CBC
            warnings.simplefilter("ignore")
            return pulp.PULP_CBC_CMD(msg=False, **kwargs)

    def available(self) -> bool:
        try:
            return bool(self._solver().available())
        except Exception:  # pulp missing or broken binary
            return False

    def solve(self, model, *, time_limit=None, rel_gap=None, node_limit=None):
        if model.num_cols == 0:
            return _trivial(model)
        import pulp

        t0 = time.perf_counter()
        lp, cols = model.to_pulp()
        t1 = time.perf_counter()
        fd, log_path = tempfile.mkstemp(prefix="cbc_", suffix=".log")
        os.close(fd)
        try:
            solver = self._solver(
                timeLimit=time_limit,
                maxNodes=node_limit,
                gapRel=rel_gap,
                gapAbs=0.0 if rel_gap is None else None,
                logPath=log_path,
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                lp.solve(solver)
            with open(log_path, errors="replace") as f:
                log = f.read()
        finally:
            os.unlink(log_path)
        t2 = time.perf_counter()
        timings = {"build": t1 - t0, "solve": t2 - t1}

        if lp.status == pulp.LpStatusInfeasible or lp.sol_status == pulp.LpSolutionInfeasible:
            timings["extract"] = 0.0
            return BackendResult("infeasible", timings=timings)
        if lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            timings["extract"] = 0.0
            if "Stopped" in log or "time limit" in log.lower():
                return BackendResult("unknown", timings=timings)
            raise SolverError(f"CBC ended with status {pulp.LpStatus[lp.status]}")

        values = [0.0 if v.varValue is None else v.varValue for v in cols]
        objective = model.objective_value(values)
        bound = None
        m = re.search(r"^Lower bound:\s*(\S+)", log, re.M)
        if m:
            try:
                bound = float(m.group(1)) * model.objective_scale + model.objective_offset
            except ValueError:
                bound = None
        result = re.search(r"^Result - (.*)$", log, re.M)
        result = result.group(1) if result else ""
        # "Optimal solution found", or "... (within gap tolerance)", or
        # "Stopped on time limit" (with an incumbent).
        proven = lp.sol_status == pulp.LpSolutionOptimal and result.startswith("Optimal") and "gap" not in result
        gap = 0.0 if proven else _relative_gap(objective, bound)
        optimal = proven or (gap is not None and gap <= OPTIMAL_GAP)
        if optimal:
            gap = 0.0
        timings["extract"] = time.perf_counter() - t2
        return BackendResult("optimal" if optimal else "feasible", values, objective, bound, gap, timings)


# In order of preference: the first available one is the default.
BACKENDS: dict[str, Backend] = {b.name: b for b in (HighsBackend(), CbcBackend())}

_available_cache: dict[str, bool] = {}


def _is_available(name: str) -> bool:
    if name not in _available_cache:
        _available_cache[name] = BACKENDS[name].available()
    return _available_cache[name]


def available_backends() -> list[str]:
    """Names of the usable backends, the default (fastest) first."""
    return [name for name in BACKENDS if _is_available(name)]


def get_backend(name: str | None = None) -> Backend:
    """The backend called ``name``, or the default one for ``None``."""
    if name is None:
        names = available_backends()
        if not names:
            raise SolverError("no MILP backend available: install highspy, or pulp with its CBC")
        return BACKENDS[names[0]]
    if name not in BACKENDS:
        raise ValueError(f"unknown solver backend {name!r}; known: {', '.join(BACKENDS)}")
    if not _is_available(name):
        raise ValueError(
            f"solver backend {name!r} is not available here; available: {', '.join(available_backends()) or 'none'}"
        )
    return BACKENDS[name]
