"""How much of FSDP-style parameter/gradient collectives the cost model counts."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable


@dataclass(frozen=True)
class CommOverlapPolicy:
    """How much of FSDP-style parameter/gradient collectives is counted.

    FSDP prefetches layer i+1's parameter all-gather while layer i computes
    and reduce-scatters layer i's gradients while layer i-1's backward runs,
    on their own link (the overlap scheduler's model,
    :mod:`autoparallel.passes.overlap_model`), so in steady state these
    collectives hide behind compute whenever they are shorter than it.

    With ``compute_windows`` (opt-in, see below) each such collective of a
    repeated block (``layers.3``) costs ``max(f * t, t - w)``: ``w`` is its
    share (by parameter bytes) of the compute it can hide under, one block's
    forward for a parameter gather, half a block's backward for a gradient
    reduction and for the parameter's re-gather in backward (both on the same
    link; the re-gather is counted with ``regather_in_backward``), and
    ``f`` the fraction still counted when it fits. A gather longer than its
    window (a cross-node gather of a whole block) costs what sticks out, as
    the scheduler finds.
    Each edge is costed on its own (the ILP stays linear and exact for this
    model), which is exact when a block's parameters are laid out alike.
    Parameters outside repeated blocks, and ``compute_windows=False``, get
    the flat fraction ``f``. ``enabled=False`` counts everything.

    ``f``: 0.25 for both by default. Measured against the overlap
    scheduler's estimate of LLaMA-3 8B bf16 on 16x8
    (``examples/example_llama3.py``; estimated step of the plan each value
    picks, 4 / 32 layers): 0.25: 104.2 / 601.6 ms, 0.6: 93.9 / 518.7,
    everything counted (the classic FSDP x TP+SP layout): 95.3 / 517.1.
    With 0.25 parameter gathers look nearly free and the solver shards
    attention weights over dp*tp: their gathers crowd the links (on NVLink
    they queue ahead of the blocking TP activation collectives). 0.6 picks
    a plan about as fast as the hand layout and keeps the solver's terms
    closer to the scheduler's estimate (-9% against -35% at 32 layers),
    but it also moves
    small, latency-bound models off FSDP (the test LLaMA on 8 ranks goes
    tensor parallel, estimated 1.6 ms per step against 2.0; a dim-8192
    block on 2x4 keeps weights sharded over dp, 27.4 against 30.7 ms),
    plans that tests of the apply stage and passes rely on.

    Why the windows are opt-in: on that model every block's dp gather fits
    its window (about 2.2 ms of gather against 2.4 ms of the block's
    cheapest forward compute), and the plans they pick scheduled worse than
    the flat fraction's (f = 0.25, 4 / 32 layers: 103.3 / 667.9 ms against
    101.6 / 538.7); on small, latency-bound models (the test LLaMA on 8
    ranks) they make gathers cost nearly in full and the solver replicates
    small parameters instead of sharding them.
    """

    enabled: bool = True
    param_allgather_discount: float = 0.25
    grad_reduce_scatter_discount: float = 0.25
    compute_windows: bool = False
    # FSDP-style resharding after forward (PassOptions.reshard_after_forward):
    # a windowed parameter gather runs again in backward, costed likewise in
    # the backward's window
    regather_in_backward: bool = False


PARAM_ALL_GATHER = "param_all_gather"
GRAD_REDUCE_SCATTER = "grad_reduce_scatter"


@dataclass(frozen=True)
class HiddenComm:
    """A parameter gather or gradient reduction that may hide under
    ``window`` seconds of compute (see :class:`CommOverlapPolicy`)."""

    kind: str  # PARAM_ALL_GATHER or GRAD_REDUCE_SCATTER
    window: float
    backward_window: float | None = None  # a parameter gather's re-gather in backward


def apply_discount(time: float, kind: str | HiddenComm, policy: CommOverlapPolicy = CommOverlapPolicy()) -> float:
    """``time`` as counted by the policy for ``kind``
    (``"param_all_gather"``, ``"grad_reduce_scatter"``, or a
    :class:`HiddenComm` with its compute window); other kinds and a
    disabled policy leave it unchanged. The caller decides what a parameter
    all-gather is."""
    if not policy.enabled:
        return time
    window = again = None
    if isinstance(kind, HiddenComm):
        kind, window, again = kind.kind, kind.window, kind.backward_window
    if kind == PARAM_ALL_GATHER:
        fraction = policy.param_allgather_discount
    elif kind == GRAD_REDUCE_SCATTER:
        fraction = policy.grad_reduce_scatter_discount
    else:
        return time
    if window is None or not policy.compute_windows:
        return time * fraction
    counted = max(time * fraction, time - window)
    if again is not None and policy.regather_in_backward:
        counted += max(time * fraction, time - again)
    return counted


_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")


def block_of(path: str | None) -> str | None:
    """The repeated block a module path or parameter FQN lies in
    (``layers.3.attention.wq.weight`` -> ``layers.3``), None outside one."""
    m = _BLOCK.match(path or "")
    return m.group(1) if m else None


@dataclass
class ComputeWindows:
    """Per repeated block: forward and backward compute (seconds, each op at
    its cheapest option: plans differ little in per-rank compute) and the
    bytes of its parameters; from these, the window of each parameter's
    gather and gradient reduction (:meth:`kind`)."""

    forward: dict[str, float] = field(default_factory=dict)
    backward: dict[str, float] = field(default_factory=dict)
    param_bytes: dict[str, int] = field(default_factory=dict)  # block -> bytes
    own_bytes: dict[str, int] = field(default_factory=dict)  # param FQN -> bytes

    @classmethod
    def of(
        cls,
        nodes: Iterable,
        params: dict[str, object],
        compute: Callable[[object], float],
        module_path: Callable[[object], str | None],
        is_backward: Callable[[object], bool],
    ) -> "ComputeWindows":
        """``nodes``: the joint graph's nodes; ``params``: FQN -> parameter
        placeholder (its ``meta["val"]`` gives the bytes); ``compute``: a
        node's cheapest compute time."""
        out = cls()
        for n in nodes:
            block = block_of(module_path(n))
            if block is None:
                continue
            t = compute(n)
            if t:
                side = out.backward if is_backward(n) else out.forward
                side[block] = side.get(block, 0.0) + t
        for fqn, p in params.items():
            val = getattr(p, "meta", {}).get("val")
            size = val.numel() * val.element_size() if val is not None else 0
            out.own_bytes[fqn] = size
            block = block_of(fqn)
            if block is not None:
                out.param_bytes[block] = out.param_bytes.get(block, 0) + size
        return out

    def kind(self, kind: str, fqn: str, edges: int = 1) -> str | HiddenComm:
        """``kind`` with the window of parameter ``fqn``'s collective, split
        over the ``edges`` that move it; ``kind`` alone outside a block."""
        block = block_of(fqn)
        total = self.param_bytes.get(block or "", 0)
        if block is None or not total:
            return kind
        share = self.own_bytes.get(fqn, 0) / total / max(edges, 1)
        # the backward's link carries the re-gather and the reduction: half
        # its window each; rounded: repeated blocks share cost matrices
        half_backward = float(f"{self.backward.get(block, 0.0) / 2 * share:.4g}")
        if kind == PARAM_ALL_GATHER:
            return HiddenComm(kind, float(f"{self.forward.get(block, 0.0) * share:.4g}"), half_backward)
        return HiddenComm(kind, half_backward)
