"""Correct a DeviceSpec's compute efficiencies from measured kernel times.

The roofline prices three kinds of work at three efficiencies: matrix
multiplies at ``compute_efficiency``, fused attention at
``attention_efficiency`` and everything else (element-wise, copies,
reductions: bound by memory) at ``memory_efficiency``. A measurement of one
rank's step on a GPU (``benchmarks/gpu_rank_check.py``) gives, per kind, the
device time the profiler attributed to that kind's ops and the time the plan
estimated for the same ops. Where the estimate said ``e`` seconds at
efficiency ``f`` and the GPU took ``m`` seconds, the efficiency that makes
the two agree is ``f * e / m`` (the roofline time is inversely proportional
to the efficiency of the bound term).

>>> from autoparallel.cost_model import H100
>>> record = {"preset": "H100", "efficiencies": {"compute_efficiency": 0.7},
...           "ranks": {"autoparallel": {"estimated_by_kind_ms": {"matmul": 100.0},
...                                      "measured_by_kind_ms": {"matmul": 125.0}}}}
>>> corrected_device_spec(H100, [record]).compute_efficiency
0.56
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from .devices import DeviceSpec

__all__ = ["KIND_EFFICIENCY", "op_kind", "estimated_by_kind", "implied_efficiencies", "corrected_device_spec"]

# kind of work -> the DeviceSpec field that prices it
KIND_EFFICIENCY = {
    "matmul": "compute_efficiency",
    "attention": "attention_efficiency",
    "memory": "memory_efficiency",
}

_MATMUL_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm", "convolution", "convolution_backward", "_grouped_mm"}
)
_COMM_WORDS = ("c10d", "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "wait_tensor", "broadcast", "nccl")
# Ops that launch nothing of their own (or only their children's kernels,
# which the profiler attributes to the children).
_NO_KERNEL = frozenset(
    {"matmul", "linear", "view", "reshape", "t", "transpose", "permute", "expand", "as_strided", "_unsafe_view"}
)


def op_kind(name: str) -> str | None:
    """``"matmul"``, ``"attention"``, ``"memory"`` or None (collectives and ops
    without kernels of their own) for an aten op named as in FX
    (``aten.mm.default``) or in the profiler (``aten::mm``).

    >>> op_kind("aten.mm.default"), op_kind("aten::_flash_attention_backward"), op_kind("aten::add_")
    ('matmul', 'attention', 'memory')
    """
    base = name.replace("aten::", "").replace("aten.", "").split(".")[0]
    if any(w in name for w in _COMM_WORDS):
        return None
    if base in _MATMUL_OPS:
        return "matmul"
    if "attention" in base or base.startswith(("_flash_", "_efficient_", "_cudnn_attention")):
        return "attention"
    if base in _NO_KERNEL:
        return None
    return "memory"


def estimated_by_kind(plan) -> dict[str, float]:
    """Seconds per kind of work the plan estimated for one rank's forward and
    backward (the solver's per-node compute at the chosen placements; a node
    that selective activation checkpointing recomputes is counted twice)."""
    out = dict.fromkeys(KIND_EFFICIENCY, 0.0)
    for node in plan.nodes.values():
        kind = op_kind(node.op or "")
        if kind is None or not node.compute_cost:
            continue
        repeats = 2 if node.phase == "forward" and node.recompute == "PREFER_RECOMPUTE" else 1
        out[kind] += repeats * node.compute_cost
    return out


def implied_efficiencies(records: Iterable[Mapping]) -> dict[str, float]:
    """The efficiencies that make the estimates match the measurements,
    pooled over ``records`` (the script's JSON output): per kind,
    ``efficiency * sum(estimated) / sum(measured)``, using each record's own
    efficiencies and only ranks that carry both figures. Kinds without
    time on either side are left out."""
    est: dict[str, float] = {}
    meas: dict[str, float] = {}
    for record in records:
        effs = record["efficiencies"]
        for rank in record["ranks"].values():
            e, m = rank.get("estimated_by_kind_ms"), rank.get("measured_by_kind_ms")
            if not e or not m:
                continue
            for kind, field in KIND_EFFICIENCY.items():
                if e.get(kind, 0.0) > 0 and m.get(kind, 0.0) > 0 and field in effs:
                    # estimate at efficiency 1.0 (an efficiency-free amount of work), then pooled
                    est[kind] = est.get(kind, 0.0) + e[kind] * effs[field]
                    meas[kind] = meas.get(kind, 0.0) + m[kind]
    return {KIND_EFFICIENCY[k]: est[k] / meas[k] for k in est if meas[k] > 0}


def corrected_device_spec(spec: DeviceSpec, records: Iterable[Mapping], *, digits: int = 3) -> DeviceSpec:
    """``spec`` with ``compute_efficiency``, ``attention_efficiency`` and
    ``memory_efficiency`` replaced by what ``records`` imply (rounded to
    ``digits``, capped at 1.0); fields without evidence keep their value.

    Raises ValueError when a record was measured against another preset
    (its efficiencies would not apply to ``spec``'s peaks)."""
    records = list(records)
    for r in records:
        if r.get("preset") not in (None, spec.name):
            raise ValueError(
                f"record measured against preset {r['preset']!r}, not {spec.name!r}: "
                f"correct DeviceSpec.get({r['preset']!r}) with it"
            )
    fields = {}
    for field, value in implied_efficiencies(records).items():
        if not math.isfinite(value) or value <= 0:
            continue
        fields[field] = round(min(value, 1.0), digits)
    return dataclasses.replace(spec, **fields)
