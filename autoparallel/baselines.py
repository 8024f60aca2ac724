"""The layouts people write by hand, planned and estimated like the plan.

Each baseline is a rule that says, per parameter and mesh dim, how the
parameter is laid out: replicated, or sharded along one of its dims. The
parameters are pinned to it through the planner's own node constraints
(the gradients follow their parameters); activations are left to the solver,
which lays them out at least as well as a hand layout would for those
weights. Each baseline is then solved, applied and scheduled by the same
passes as the plan, so its estimated step is the overlap scheduler's figure,
like the plan's.

Mesh dims are read by name, torchtitan's convention: ``tp`` tensor
parallel, ``ep`` expert parallel, ``dp_replicate`` replicated (HSDP), any
other dim (``dp``, ``dp_shard``, ``cp``...) sharded FSDP-style.

* **DDP**: every parameter replicated on every dim.
* **FSDP**: every parameter sharded along its first dim over every dim.
* **FSDP x TP + SP** (torchtitan's LLaMA layout): column-parallel
  projections (``wq wk wv w1 w3``, the output head) split their output dim
  over ``tp``, row-parallel ones (``wo w2``) their input dim, the embedding
  its vocabulary, norms replicated over ``tp``; FSDP over the other dims.
* **HSDP** (x TP + SP with a ``tp`` dim): as FSDP (x TP), replicated over
  ``dp_replicate``.
* **FSDP x EP**: routed experts (3-D ``w1 w2 w3``) split along the expert
  dim over ``ep`` and along their next dim over the other dims; every other
  parameter FSDP.

A baseline that does not apply (no ``tp`` dim, no experts) is left out; one
whose memory does not fit the plan's memory budget is listed as not fitting.

>>> # results = compare(autop, plan)      # after autop.apply_placement(plan)  # doctest: +SKIP
>>> # print("\\n".join(table_lines(plan)))                                       # doctest: +SKIP
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import asdict, dataclass
from typing import Callable

from torch.distributed.tensor.placement_types import Replicate, Shard

import solver

from .report.baseline_table import margin_line, table_lines  # noqa: F401  (re-exported)
from .report.numbers import step_estimate
from .validation import ConstraintError

logger = logging.getLogger(__name__)

__all__ = ["BaselineResult", "BASELINES", "compare", "hand_layouts", "table_lines", "margin_line"]

# per mesh dim: None (replicated) or the tensor dim sharded over it
Layout = tuple  # tuple[int | None, ...]

_COLWISE = re.compile(
    r"(^|\.)(wq|wk|wv|w1|w3|q_proj|k_proj|v_proj|gate_proj|up_proj|c_fc|query|key|value|fc1|output|lm_head)\.weight$"
)
_ROWWISE = re.compile(r"(^|\.)(wo|w2|o_proj|down_proj|c_proj|dense|fc2)\.weight$")
_EMBEDDING = re.compile(r"(^|\.)(tok_embeddings|embed_tokens|wte|word_embeddings)\.weight$")
_EXPERT = re.compile(r"(^|\.)(w1|w2|w3)$")


def _roles(names: tuple[str, ...]) -> list[str]:
    out = []
    for n in names:
        n = n.lower()
        out.append({"tp": "tp", "ep": "ep", "dp_replicate": "replicate"}.get(n, "shard"))
    return out


def _fsdp(ndim_param: int, roles: list[str], replicate_dims: bool, dim: int = 0) -> Layout:
    return tuple(None if (r == "replicate" and replicate_dims) else dim for r in roles)


def _tp_dim(fqn: str, shape: tuple[int, ...]) -> int | None | str:
    """The dim a parameter is split along over ``tp`` (None: replicated;
    "other": no rule names it)."""
    if len(shape) != 2:
        return None  # norms, biases: replicated over tp (sequence parallel around them)
    if _COLWISE.search(fqn) or _EMBEDDING.search(fqn):
        return 0
    if _ROWWISE.search(fqn):
        return 1
    return "other"


@dataclass(frozen=True)
class HandLayout:
    """A named rule: ``layout(fqn, shape)`` gives per mesh dim None or a tensor dim."""

    name: str
    layout: Callable[[str, tuple[int, ...]], Layout]


def hand_layouts(mesh_dim_names: tuple[str, ...], param_shapes: dict[str, tuple[int, ...]]) -> list[HandLayout]:
    """The baselines that apply to a mesh with these dim names and these parameters."""
    roles = _roles(mesh_dim_names)
    ndim = len(roles)
    has_tp, has_ep, has_rep = "tp" in roles, "ep" in roles, "replicate" in roles
    experts = {f for f, s in param_shapes.items() if len(s) == 3 and _EXPERT.search(f)}
    tp_known = any(_tp_dim(f, s) in (0, 1) and f not in experts for f, s in param_shapes.items())
    out = [HandLayout("DDP", lambda fqn, shape: (None,) * ndim)]

    def fsdp_all(fqn, shape):
        return (0,) * ndim

    out.append(HandLayout("FSDP", fsdp_all))

    def tp_layout(replicate: bool):
        def layout(fqn, shape):
            d = _tp_dim(fqn, shape)
            tp = None if d == "other" else d
            return tuple(
                tp if r == "tp" else (None if (r == "replicate" and replicate) else 0)
                for r in roles  # FSDP on the data dims: along dim 0 (the tp shard's rows for colwise)
            )

        return layout

    if has_tp and tp_known:
        out.append(HandLayout("FSDP x TP + SP", tp_layout(False)))
    if has_rep:
        name = "HSDP x TP + SP" if has_tp and tp_known else "HSDP"
        out.append(
            HandLayout(
                name, tp_layout(True) if has_tp and tp_known else lambda fqn, shape: _fsdp(len(shape), roles, True)
            )
        )
    if experts and ndim > 1:

        def ep_layout(fqn, shape):
            if fqn in experts:
                # experts over ep (or the last dim when none is named ep), their next dim FSDP
                ep_dim = roles.index("ep") if has_ep else ndim - 1
                return tuple(0 if i == ep_dim else 1 for i in range(ndim))
            return (0,) * ndim

        out.append(HandLayout("FSDP x EP", ep_layout))
    return out


@dataclass
class BaselineResult:
    name: str
    step_s: float | None  # the overlap scheduler's estimate (applied), None when not applied
    solver_s: float | None  # the solver's objective under the baseline's pins
    memory_bytes: float | None  # per rank (parameters, gradients, optimizer state, activations)
    pinned: int = 0  # parameters laid out as the rule says
    free: int = 0  # parameters the rule's layout is not offered for (left to the solver)
    note: str = ""  # why there is no figure (does not fit, ...)
    seconds: float = 0.0  # planning + applying it

    def to_json(self) -> dict:
        return asdict(self)


# the layouts compared by default, in table order
BASELINES = ("DDP", "FSDP", "FSDP x TP + SP", "HSDP", "HSDP x TP + SP", "FSDP x EP")


def _as_placements(layout: Layout) -> tuple:
    return tuple(Replicate() if d is None else Shard(d) for d in layout)


def _matches(placements: tuple, layout: Layout) -> bool:
    # Shard and _StridedShard alike (a tp-outer FSDP x TP layout is _StridedShard on dp)
    for p, d in zip(placements, layout):
        if d is None:
            if not p.is_replicate():
                return False
        elif not (p.is_shard() and p.dim == d):
            return False
    return len(placements) == len(layout)


def _pin_parameters(autop, layout: HandLayout, skip: set[str]) -> tuple[int, int]:
    """Pin every parameter (but those in ``skip``) to the first option
    matching the rule (plain Shard before strided); returns (pinned, left free)."""
    from .options.placements import placements_of

    pinned = free = 0
    for fqn, node in autop.traced.param_nodes.items():
        shape = tuple(node.meta["val"].shape)
        want = layout.layout(fqn, shape)
        options = [placements_of(o.output_specs) for o in autop.strategies[node].options]
        exact = _as_placements(want)
        hit = exact if exact in options else next((p for p in options if _matches(p, want)), None)
        if hit is None or node.name in skip:
            free += 1
            continue
        autop.add_node_constraint(node, hit)
        pinned += 1
    return pinned, free


# a parameter pin the rest of the step cannot follow (its gradient's layout)
# is dropped and the layout solved again, at most this many times
_UNPIN_ROUNDS = 4
_PIN_PREFIX = "node constraint "


def _solve_pinned(autop, layout: HandLayout, apply: bool, pass_options):
    """(plan or None, pinned, free, note) of ``layout``, applied with
    ``apply`` (inside the pins' scope: the plan's option indices are those of
    the problem built under them): a pin that conflicts with the step (the
    solver names it) is dropped and counted free; a layout that does not fit
    the memory budget gives no plan."""
    skip: set[str] = set()
    for _ in range(_UNPIN_ROUNDS + 1):
        with autop.scoped_constraints(without_role_rules=True):
            # a hand layout may replicate: a user's parameter-memory bound does not hold it
            autop.add_parameter_memory_constraint(high=1.0)
            pinned, free = _pin_parameters(autop, layout, skip)
            try:
                base = autop.optimize_placement()
            except (ConstraintError, solver.InfeasibleError) as exc:
                conflict = list(getattr(exc, "conflict", None) or ())
                pins = {c.removeprefix(_PIN_PREFIX) for c in conflict if c.startswith(_PIN_PREFIX)}
                if not pins or len(pins) < len(conflict):
                    # the memory budget (or the user's constraints) against the layout: it does not fit
                    return None, pinned, free, _short(exc)
                skip |= pins  # pins that only conflict with each other and the step
                continue
            if apply:
                autop.apply_placement(base, pass_options=pass_options)
            return base, pinned, free, ""
    return None, pinned, free, "pins conflict with the step"


def _step(plan) -> float | None:
    return step_estimate(plan)["step"]


def _memory(plan) -> float:
    from .problem.memory import breakdown

    return breakdown(plan).total


def compare(autop, plan, *, apply: bool = True, pass_options=None, names=BASELINES) -> list[BaselineResult]:
    """Plan (and with ``apply`` apply and schedule) each hand layout that
    applies to ``autop``'s model and mesh; the results are stored on
    ``plan.baselines`` (shown by ``plan.summary()``) and returned. Call it
    after ``autop.apply_placement(plan)`` so the plan's own estimate is the
    scheduler's too."""
    names_of_mesh = tuple(autop.mesh.mesh_dim_names or (f"dim{i}" for i in range(autop.mesh.ndim)))
    shapes = {fqn: tuple(n.meta["val"].shape) for fqn, n in autop.traced.param_nodes.items()}
    results = []
    for layout in hand_layouts(names_of_mesh, shapes):
        if layout.name not in names:
            continue
        t0 = time.perf_counter()
        base, pinned, free, note = _solve_pinned(autop, layout, apply, pass_options)
        if base is None:
            results.append(BaselineResult(layout.name, None, None, None, pinned, free, note, time.perf_counter() - t0))
            continue
        results.append(
            BaselineResult(
                layout.name,
                _step(base) if apply else None,
                base.compute_cost + base.comm_cost,
                _memory(base),
                pinned,
                free,
                _outside_bound(plan, base),
                time.perf_counter() - t0,
            )
        )
        logger.info("baseline %s: %s", layout.name, results[-1])
    plan.baselines = [r.to_json() for r in results]
    return results


def _outside_bound(plan, base) -> str:
    """A note when ``base`` holds more parameter bytes per rank than the
    plan's parameter memory bound allows (a "fully sharded" bound, the
    default without a step memory budget, keeps the plan from replicating:
    DDP, HSDP and TP's replicated norms then lie outside its search space)."""
    high = ((plan.constraints or {}).get("parameter memory budget") or {}).get("high")
    if high is not None and high >= 1.0:
        return ""
    allowed = plan.parameter_bytes_total * high if high is not None else plan.parameter_bytes_per_rank
    if base.parameter_bytes_per_rank > allowed * (1 + 1e-6):
        return "outside the plan's parameter memory bound"
    return ""


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "memory budget" in text:
        return "does not fit the memory budget"
    return text[:100]
