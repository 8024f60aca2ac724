"""Per-rank memory of a training step, as a function of the chosen placements.

The persistent state of a parameter is linear in its local size: parameter
bytes + gradient bytes + optimizer state bytes, each ``numel / shard_factor``
elements, where ``shard_factor`` is the product of the mesh dims the chosen
placement shards it over. :func:`param_state_bytes` is that coefficient per
option, so an ILP can bound the sum (issue 13) the way the parameter-memory
constraint does today; :func:`breakdown` adds the activation peak the overlap
scheduler measured and compares the total with the device's HBM.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# One placement token per mesh dim: S(d), _S(d, k) (strided shard), P, P(op), R.
_TOKEN = re.compile(r"_S\(\d+, ?\d+\)|S\(\d+\)|P(?:\(\w+\))?|R")

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8, "int64": 8, "int32": 4}


# Device memory by cost-model preset name (datasheet, decimal GB).
HBM_BYTES = {"H100": 80e9, "A100": 80e9, "H200": 141e9, "B200": 192e9}


def placement_tokens(spec: str) -> list[str]:
    """``_S(0, 8)S(0)`` -> ``['_S(0, 8)', 'S(0)']``."""
    return _TOKEN.findall(spec)


def shard_factor(spec: str, mesh_shape: list[int]) -> int:
    """How many ways a tensor with placements ``spec`` is split per rank."""
    tokens = placement_tokens(spec)
    return math.prod(size for tok, size in zip(tokens, mesh_shape) if "S(" in tok)


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer state per parameter element (bytes). AdamW keeps two fp32
    moments (8 bytes); SGD with momentum one (4); plain SGD none."""

    name: str = "AdamW"
    state_bytes_per_element: int = 8
    # an fp32 master copy when parameters are kept in low precision
    master_bytes_per_element: int = 0


ADAMW = OptimizerSpec()


def param_state_bytes(
    numel: int, factor: int, param_bytes: int, grad_bytes: int, optimizer: OptimizerSpec = ADAMW
) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes per rank of one parameter of
    ``numel`` elements split ``factor`` ways: the per-option coefficients."""
    local = numel / factor
    opt = local * (optimizer.state_bytes_per_element + optimizer.master_bytes_per_element)
    return local * param_bytes, local * grad_bytes, opt


@dataclass
class MemoryBreakdown:
    """Bytes per rank."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float  # peak of activations and transient buffers
    hbm: float  # device memory, bytes
    optimizer_name: str = "AdamW"
    activations_source: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm

    def lines(self) -> list[str]:
        g = 1e9
        out = [
            f"parameters   {_size(self.parameters):>10s}",
            f"gradients    {_size(self.gradients):>10s}",
            f"optimizer    {_size(self.optimizer):>10s} ({self.optimizer_name})",
            f"activations  {_size(self.activations):>10s} peak"
            + (f" ({self.activations_source})" if self.activations_source else ""),
            f"total        {_size(self.total):>10s} of {self.hbm / g:.0f} GB HBM ({100 * self.total / self.hbm:.0f}%)",
        ]
        if not self.fits:
            out.append(
                f"WARNING: does not fit: {self.total / g:.1f} GB needed per rank, the device has "
                f"{self.hbm / g:.0f} GB (shard more, recompute more, or use a smaller batch)"
            )
        return out + self.notes


def _size(b: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= f:
            return f"{b / f:.2f} {unit}"
    return f"{int(b)} B"


def breakdown(plan, *, optimizer: OptimizerSpec = ADAMW, hbm_bytes: float | None = None) -> MemoryBreakdown:
    """Per-rank memory of ``plan`` (an :class:`~autoparallel.plan.Plan`) from
    its parameters' chosen placements and, once applied, the scheduler's
    live-bytes peak of the forward and backward graphs."""
    mesh = plan.mesh_shape
    prov = plan.provenance or {}
    reduce_dtype = (prov.get("mp_policy") or {}).get("reduce_dtype")
    params = grads = opt = 0.0
    for n in plan.nodes.values():
        if not n.is_parameter or n.shape is None:
            continue
        pbytes = DTYPE_BYTES.get(n.dtype or "float32", 4)
        gbytes = DTYPE_BYTES.get(reduce_dtype, pbytes) if reduce_dtype not in (None, "None") else pbytes
        p, g, o = param_state_bytes(math.prod(n.shape), shard_factor(n.output_placements, mesh), pbytes, gbytes, optimizer)
        params, grads, opt = params + p, grads + g, opt + o
    notes: list[str] = []
    if hbm_bytes is None:
        device = prov.get("device") or {}
        name = device.get("name", "H100")
        hbm_bytes = device.get("hbm_bytes") or HBM_BYTES.get(name)
        if hbm_bytes is None:
            hbm_bytes = HBM_BYTES["H100"]
            notes.append(f"device {name!r} has no known HBM size: 80 GB assumed (pass hbm_bytes=)")
    activations, source = 0.0, ""
    peaks = _scheduler_peaks(plan.pass_stats)
    if peaks:
        fw, bw = peaks.get("forward", 0), peaks.get("backward", 0)
        # the scheduler's live bytes count the parameter shards (inputs of
        # both graphs) and, in the backward, the gradients it produces
        activations = max(fw - params, bw - params - grads, 0.0)
        source = "scheduler's live-bytes peak less parameters and gradients"
    else:
        notes.append("activations not estimated: apply the plan (the overlap scheduler measures them)")
    return MemoryBreakdown(params, grads, opt, activations, hbm_bytes, optimizer.name, source, notes)


def _scheduler_peaks(pass_stats: dict) -> dict[str, float]:
    stats = (pass_stats or {}).get("schedule_overlap") or {}
    out = {}
    for graph, s in stats.items():
        v = s.get("peak_memory_after") if isinstance(s, dict) else getattr(s, "peak_memory_after", None)
        if v:
            out[graph] = float(v)
    return out
