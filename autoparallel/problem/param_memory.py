"""The vocabulary of per-rank memory: how many ways a placement splits a
tensor (:func:`shard_factor`), the bytes a parameter's state takes per rank
(:func:`param_state_bytes`, :class:`OptimizerSpec`), device memory per preset,
and the one unit every figure is printed in (GB, 10^9 bytes). Both the
memory budget (:mod:`.memory_budget`) and a plan's breakdown
(:mod:`.memory`) build on it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from solver import units

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
    # per parameter tensor, whatever its size (AdamW's step count: one fp32
    # scalar, on the parameter's device on CPU; on the host beside a GPU)
    bytes_per_tensor: int = 0


ADAMW = OptimizerSpec(bytes_per_tensor=4)


def param_state_bytes(
    numel: int, factor: int, param_bytes: int, grad_bytes: int, optimizer: OptimizerSpec = ADAMW
) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes per rank of one parameter of
    ``numel`` elements split ``factor`` ways: the per-option coefficients."""
    local = numel / factor
    opt = local * (optimizer.state_bytes_per_element + optimizer.master_bytes_per_element)
    return local * param_bytes, local * grad_bytes, opt


# Every memory figure the project prints is in GB, 10^9 bytes (as HBM sizes
# are quoted: an H100 has 80 GB).
GB = 1e9
UNIT_NOTE = "GB = 10^9 bytes"


def size_text(b: float) -> str:
    """Bytes in GB, MB or kB (powers of 10, as :data:`GB`): the report's
    unit system (:func:`autoparallel.report.units.size`)."""
    return units.size(b)
