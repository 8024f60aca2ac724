"""How much of FSDP-style parameter/gradient collectives the cost model counts."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .devices import DeviceSpec


@dataclass(frozen=True)
class CommOverlapPolicy:
    """How much of FSDP-style parameter/gradient collectives is counted.

    FSDP prefetches layer i+1's parameter all-gather while layer i computes
    and reduce-scatters layer i's gradients while layer i-1's backward runs,
    on their own link (the overlap scheduler's model,
    :mod:`autoparallel.passes.overlap_model`), so in steady state these
    collectives hide behind compute whenever they are shorter than it and
    their link is free.

    By default the share counted depends on the link each step of the
    redistribution runs on (:func:`counted_device`): ``network_fraction``
    (0.1) across nodes, where nothing else queues and the scheduler hides
    ~97% of them, ``nvlink_fraction`` (0.6) within a node, where they queue
    with the blocking tensor-parallel activation collectives and a good
    part stays exposed. The local copies around them (a gather along a
    non-leading dim, all-to-all staging) always count in full: they run on
    the compute stream. Measured on LLaMA-3 8B bf16 16x8 against the
    scheduler's estimate of the applied plan (docs/estimates.md): flat
    fractions of 0.25 pick a plan the scheduler rates 12% slower and
    under-count it by 13%; counting everything picks a good plan but
    over-counts it by a third; per link the plan is as good and the
    solver's figure within a few percent.

    Under the per-link policy two kinds of the backward have fractions of
    their own, on any link. A backward op that reads a parameter in a
    layout of its own (:data:`PARAM_BACKWARD_GATHER`: the transposed
    weight of a matmul's input gradient, gathered over tp too) gathers the
    parameter alone, which the scheduler starts anywhere before it under
    the backward's compute: ``backward_param_fraction`` (0.1). An
    activation or activation gradient redistributed for a backward op
    (:data:`BACKWARD_ACTIVATION`) waits for the op that produces it, but a
    matmul's backward has a second, independent product (the weight
    gradient beside the input gradient) for it to run under:
    ``backward_activation_fraction`` (0.5). The scheduler left 0% of the
    former and 37-51% of the latter exposed on LLaMA-3 8B and 70B (16 x 8,
    2 x 8 x 8, selective and full AC). The forward's activation
    collectives count in full: the next op needs them.

    ``network_fraction=None`` or ``nvlink_fraction=None`` falls back to the
    flat fractions ``param_allgather_discount`` and
    ``grad_reduce_scatter_discount`` (one per collective kind, any link).
    With ``compute_windows`` (opt-in, flat mode only) each such collective
    of a repeated block (``layers.3``) costs ``max(f * t, t - w)``: ``w`` is
    its share (by parameter bytes) of the compute it can hide under, one
    block's forward for a parameter gather, half a block's backward for a
    gradient reduction and for the parameter's re-gather in backward (with
    ``regather_in_backward``), and ``f`` the flat fraction still counted
    when it fits; parameters outside repeated blocks get ``f``. It is
    opt-in because the plans it picks scheduled worse than the flat
    fraction's on LLaMA-3 8B, and on small, latency-bound models it makes
    gathers cost nearly in full. ``enabled=False`` counts everything.
    """

    enabled: bool = True
    param_allgather_discount: float = 0.25
    grad_reduce_scatter_discount: float = 0.25
    compute_windows: bool = False
    # Per link, replacing the two flat fractions above: the share of such a
    # collective's time counted when it runs across nodes and within a node
    # (each step of a redistribution on its own link; the local copies
    # around the collectives always in full). See :func:`counted_device`.
    network_fraction: float | None = 0.1
    nvlink_fraction: float | None = 0.6
    # per-link policy only, any link: a backward op's own gather of a
    # parameter, and an activation's redistribution read by a backward op
    backward_param_fraction: float = 0.1
    backward_activation_fraction: float = 0.5
    # FSDP-style resharding after forward (PassOptions.reshard_after_forward):
    # a windowed parameter gather runs again in backward, costed likewise in
    # the backward's window
    regather_in_backward: bool = False


PARAM_ALL_GATHER = "param_all_gather"
GRAD_REDUCE_SCATTER = "grad_reduce_scatter"
# per-link policy only (see :class:`CommOverlapPolicy`): a backward op's read
# of a parameter, and a backward op's read of any other value
PARAM_BACKWARD_GATHER = "param_backward_gather"
BACKWARD_ACTIVATION = "backward_activation"


@dataclass(frozen=True)
class HiddenComm:
    """A parameter gather or gradient reduction that may hide under
    ``window`` seconds of compute (see :class:`CommOverlapPolicy`)."""

    kind: str  # PARAM_ALL_GATHER or GRAD_REDUCE_SCATTER
    window: float
    backward_window: float | None = None  # a parameter gather's re-gather in backward


def per_link(policy: CommOverlapPolicy) -> bool:
    """Whether ``policy`` counts hidden collectives per link
    (:func:`counted_device`) instead of by a flat fraction."""
    return (
        policy.enabled
        and not policy.compute_windows
        and policy.network_fraction is not None
        and policy.nvlink_fraction is not None
    )


def counted_device(device: DeviceSpec, policy: CommOverlapPolicy, kind: str | HiddenComm | None) -> DeviceSpec:
    """The device to cost an edge of ``kind`` on: for a parameter gather or
    gradient reduction under a per-link policy, ``device`` with each link's
    collectives counted at the policy's fraction for that link, so a
    redistribution that gathers over a dim across nodes and then over one
    within a node counts each step at its own link's fraction; otherwise
    ``device`` itself."""
    if kind is None or not per_link(policy) or policy.compute_windows:
        return device
    name = kind.kind if isinstance(kind, HiddenComm) else kind
    if name in (PARAM_ALL_GATHER, GRAD_REDUCE_SCATTER):
        intra, inter = policy.nvlink_fraction, policy.network_fraction
    elif name == PARAM_BACKWARD_GATHER:
        intra = inter = policy.backward_param_fraction
    elif name == BACKWARD_ACTIVATION:
        intra = inter = policy.backward_activation_fraction
    else:
        return device
    return dataclasses.replace(device, intra_node_counted=intra, inter_node_counted=inter)


def apply_discount(time: float, kind: str | HiddenComm, policy: CommOverlapPolicy = CommOverlapPolicy()) -> float:
    """``time`` as counted by the policy for ``kind``
    (``"param_all_gather"``, ``"grad_reduce_scatter"``, or a
    :class:`HiddenComm` with its compute window); other kinds and a
    disabled policy leave it unchanged, and so does a per-link policy
    (``time`` was costed on :func:`counted_device`). The caller decides
    what a parameter all-gather is."""
    if not policy.enabled or per_link(policy):
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
