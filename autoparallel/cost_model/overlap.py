"""How much of FSDP-style parameter/gradient collectives the cost model counts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommOverlapPolicy:
    """Fraction of FSDP-style parameter/gradient collectives still counted.

    FSDP prefetches layer i+1's parameter all-gather while layer i computes
    and reduce-scatters layer i's gradients while layer i-1's backward runs,
    so in steady state these collectives hide behind compute whenever they
    are shorter than it. What stays exposed is the first/last layer (not
    overlappable), the SM and HBM bandwidth NCCL kernels take from
    concurrent compute (~10-20% slowdown), and layers where comm exceeds
    compute. 0.25 keeps that residual, and keeps the ILP from treating
    parameter sharding as free (it would then shard and re-gather
    everything, and cross-node all-gathers can really exceed a layer's
    compute). The backward has ~2x the compute window of the forward, but
    gradient reduce-scatters are often in fp32 (2x the bytes), so both
    default to the same fraction. ``enabled=False`` counts everything.
    """

    enabled: bool = True
    param_allgather_discount: float = 0.25
    grad_reduce_scatter_discount: float = 0.25


PARAM_ALL_GATHER = "param_all_gather"
GRAD_REDUCE_SCATTER = "grad_reduce_scatter"


def apply_discount(time: float, kind: str, policy: CommOverlapPolicy = CommOverlapPolicy()) -> float:
    """``time`` scaled by the policy's fraction for ``kind``
    (``"param_all_gather"`` or ``"grad_reduce_scatter"``); other kinds and a
    disabled policy leave it unchanged. The caller decides what a parameter
    all-gather is."""
    if not policy.enabled:
        return time
    if kind == PARAM_ALL_GATHER:
        return time * policy.param_allgather_discount
    if kind == GRAD_REDUCE_SCATTER:
        return time * policy.grad_reduce_scatter_discount
    return time
