"""Activation checkpointing (AC) for eager runs and for traced joint graphs.

``apply_ac(model, mode)`` marks each transformer block as a checkpoint region
without changing parameter FQNs: like FSDP2's ``fully_shard``, it swaps the
block's class for a cached dynamic subclass whose ``forward`` wraps the
original one. The region's settings live in one attribute, ``_ac_config``.

Two ways the wrapped forward runs:

* Eager (default): ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``;
  selective mode adds ``create_selective_checkpoint_contexts`` with the
  torchtitan op policy (``SACPolicy``).
* Graph AC, inside ``graph_ac_tracing()``: the block runs plainly under
  ``torch.fx.traceback.annotate({"ac_region": id, "ac_mode": mode, ...})``. The
  annotation lands in ``node.meta["custom"]`` of every node the block emits
  in a joint graph from ``aot_export_joint_with_descriptors``, and
  ``tag_recompute(joint_gm)`` then turns it into the tags the min-cut
  partitioner honours: ``node.meta["recompute"]`` (a ``CheckpointPolicy``) and
  ``node.meta["ac_graph_id"]`` (the region id), on forward nodes only.

Why not let eager checkpoint run under the tracer: non-reentrant checkpoint's
machinery does run during AOT tracing, but plain AC leaves no tags at all and
selective AC tags nodes with ``recompute`` but no ``ac_graph_id`` and also tags
backward nodes (pytorch/pytorch#178935). Graph AC makes the traced graph carry
exactly the decisions eager AC would make.

Example::

    >>> apply_ac(model, "selective")                          # doctest: +SKIP
    >>> with graph_ac_tracing():                              # doctest: +SKIP
    ...     jd = aot_export_joint_with_descriptors(stack, model, args)
    >>> tag_recompute(jd.graph_module)                        # doctest: +SKIP
    ACTagStats(regions=2, must_save=14, prefer_recompute=161, backward_cleared=0, region_ids=[0, 1])
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

# Keys under node.meta["custom"] written by the wrapped forward in graph mode.
from ..graph_vocab import AC_MODE_KEY, AC_POLICY_KEY, AC_REGION_KEY

__all__ = [
    "ACMode",
    "ACConfig",
    "SACPolicy",
    "DEFAULT_SAC_POLICY",
    "ACTagStats",
    "apply_ac",
    "remove_ac",
    "graph_ac_tracing",
    "is_graph_ac_tracing",
    "tag_recompute",
    "forward_nodes",
    "AC_REGION_KEY",
    "AC_MODE_KEY",
    "AC_POLICY_KEY",
]

aten = torch.ops.aten

ACMode = Literal["full", "selective", "none"]

# node.meta keys read by torch._functorch.partitioners.
_RECOMPUTE = "recompute"
_AC_GRAPH_ID = "ac_graph_id"


def _op_name(op: Any) -> str:
    # "aten.mm.default"; also what str() gives for higher-order ops. Names,
    # not op objects, so a policy can travel in node.meta["custom"] and be
    # dumped as JSON.
    return op if isinstance(op, str) else str(op)


# torchtitan's save list: compute-heavy ops whose outputs are worth keeping.
# Listed by name: some only exist in some builds or once torch.distributed is
# imported.
_DEFAULT_SAVE_OPS = frozenset(
    {
        "aten.mm.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        # for low-precision training, max feeds the scale computation
        "aten.max.default",
        "_c10d_functional.reduce_scatter_tensor.default",
        "c10d.reduce_scatter_.default",
    }
)


@dataclass(frozen=True)
class SACPolicy:
    """Selective-AC op policy, torchtitan style.

    Outputs of ``save_ops`` are MUST_SAVE, everything else PREFER_RECOMPUTE,
    except that every ``recompute_every``-th call of a ``counted_ops`` op in a
    region (counting from 1, so the 2nd, 4th, ... mm by default) is
    recomputed to halve the matmul memory. ``recompute_every=0`` saves all.
    Ops may be given as OpOverloads or names ("aten.mm.default").

    >>> decide = SACPolicy().decider()
    >>> [decide(aten.mm.default).name for _ in range(3)]
    ['MUST_SAVE', 'PREFER_RECOMPUTE', 'MUST_SAVE']
    """

    save_ops: frozenset[str] = _DEFAULT_SAVE_OPS
    counted_ops: frozenset[str] = frozenset({"aten.mm.default"})
    recompute_every: int = 2

    def __post_init__(self):
        object.__setattr__(self, "save_ops", frozenset(map(_op_name, self.save_ops)))
        object.__setattr__(self, "counted_ops", frozenset(map(_op_name, self.counted_ops)))
        # A plain function (not a bound method) for ``checkpoint(context_fn=...)``:
        # under torch.compile, dynamo takes a method's underlying function and
        # calls it without ``self``. Made here, outside any traced code, so
        # dynamo sees an existing function object (not a field: eq/hash and
        # the annotation stay the policy's fields).
        policy = self

        def checkpoint_context_fn():
            return policy.context_fn()

        object.__setattr__(self, "checkpoint_context_fn", checkpoint_context_fn)

    def __reduce__(self):
        # the local function above does not pickle: rebuild from the fields
        return (type(self), (self.save_ops, self.counted_ops, self.recompute_every))

    def decider(self) -> Callable[[Any], CheckpointPolicy]:
        """A fresh stateful decision function for one run of one region."""
        count = 0

        def decide(op: Any) -> CheckpointPolicy:
            nonlocal count
            name = _op_name(op)
            if name in self.counted_ops:
                count += 1
                if self.recompute_every and count % self.recompute_every == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            if name in self.save_ops:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return decide

    def context_fn(self):
        """Eager ``checkpoint(context_fn=...)`` contexts for this policy."""
        # Forward and recompute each see the region's ops from the start, so
        # each needs its own counter (as torchtitan keeps separate counts).
        forward, recompute = self.decider(), self.decider()

        def policy_fn(ctx, op, *args, **kwargs):
            return (recompute if ctx.is_recompute else forward)(op)

        return create_selective_checkpoint_contexts(policy_fn)

    def to_annotation(self) -> dict[str, Any]:
        """Plain-data form stored in ``node.meta["custom"]["ac_policy"]``."""
        return {
            "save_ops": tuple(sorted(self.save_ops)),
            "counted_ops": tuple(sorted(self.counted_ops)),
            "recompute_every": self.recompute_every,
        }

    @classmethod
    def from_annotation(cls, data: dict[str, Any]) -> SACPolicy:
        return cls(
            frozenset(data["save_ops"]),
            frozenset(data["counted_ops"]),
            int(data["recompute_every"]),
        )


DEFAULT_SAC_POLICY = SACPolicy()


@dataclass(frozen=True)
class ACConfig:
    """Checkpointing of one block: ``region_id`` orders regions in forward
    order (the partitioner saves the boundary between consecutive ids)."""

    mode: ACMode
    region_id: int
    policy: SACPolicy | None = None  # selective mode only; None: default

    def __post_init__(self):
        if self.mode not in ("full", "selective"):
            raise ValueError(f"ACConfig.mode must be 'full' or 'selective', got {self.mode!r}")


# ---------------------------------------------------------------------------
# Module wrapping (FQN-preserving class swap)
# ---------------------------------------------------------------------------

_AC_ATTR = "_ac_config"
_graph_ac = False


def is_graph_ac_tracing() -> bool:
    return _graph_ac


@contextlib.contextmanager
def graph_ac_tracing() -> Iterator[None]:
    """While active, AC-wrapped blocks annotate their ops instead of running
    eager checkpoint; use around ``aot_export_joint_with_descriptors`` and
    follow with ``tag_recompute``."""
    global _graph_ac
    prev, _graph_ac = _graph_ac, True
    try:
        yield
    finally:
        _graph_ac = prev


def _tracing_with_proxy_mode() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


class _ACBlock:
    """Mixin put in front of the block's class; see ``_ac_class``."""

    def forward(self, *args, **kwargs):
        cfg: ACConfig = getattr(self, _AC_ATTR)
        inner = super().forward  # the original class's forward
        policy = cfg.policy or DEFAULT_SAC_POLICY
        if _graph_ac:
            annotation = {AC_REGION_KEY: cfg.region_id, AC_MODE_KEY: cfg.mode}
            if cfg.mode == "selective":
                annotation[AC_POLICY_KEY] = policy.to_annotation()
            with fx_traceback.annotate(annotation):
                return inner(*args, **kwargs)
        if _tracing_with_proxy_mode():
            warnings.warn(
                "eager activation checkpointing is being traced; the joint graph "
                "will not carry correct recompute tags. Trace under "
                "graph_ac_tracing() and call tag_recompute() instead.",
                stacklevel=2,
            )
        if cfg.mode == "full":
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=policy.checkpoint_context_fn, **kwargs)


_ac_class_cache: dict[type, type] = {}


def _ac_class(cls: type) -> type:
    """The cached AC subclass of ``cls`` (``AC<Name>``)."""
    if cls not in _ac_class_cache:
        _ac_class_cache[cls] = type(f"AC{cls.__name__}", (_ACBlock, cls), {})
    return _ac_class_cache[cls]


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    raise ValueError(f"{type(model).__name__} has no `layers` ModuleList/ModuleDict; pass blocks= explicitly")


def _unwrap_class(module: nn.Module) -> None:
    if not isinstance(module, _ACBlock):
        return
    cls = type(module)
    if cls.__bases__[0] is not _ACBlock:
        raise RuntimeError(
            f"cannot remove AC from a {cls.__name__}: its class was swapped again after apply_ac (e.g. by fully_shard)"
        )
    module.__class__ = cls.__bases__[1]
    delattr(module, _AC_ATTR)


def apply_ac(
    model: nn.Module,
    mode: ACMode = "selective",
    *,
    blocks: Iterable[nn.Module] | None = None,
    policy: SACPolicy | None = None,
) -> nn.Module:
    """Checkpoint each block of ``model`` (default: ``model.layers``) in place.

    Region ids follow block order. FQNs and state_dict keys are unchanged.
    ``mode="none"`` removes AC. Re-applying replaces the previous config.
    Returns ``model``.
    """
    if mode not in ("full", "selective", "none"):
        raise ValueError(f"unknown AC mode {mode!r}")
    if policy is not None and mode != "selective":
        raise ValueError("policy only applies to mode='selective'")
    blocks = _default_blocks(model) if blocks is None else list(blocks)
    for region_id, block in enumerate(blocks):
        if mode == "none":
            _unwrap_class(block)
            continue
        if not isinstance(block, _ACBlock):
            block.__class__ = _ac_class(type(block))
        setattr(block, _AC_ATTR, ACConfig(mode, region_id, policy))
    return model


def remove_ac(model: nn.Module) -> nn.Module:
    """Undo ``apply_ac`` on every wrapped submodule."""
    for module in model.modules():
        _unwrap_class(module)
    return model


# ---------------------------------------------------------------------------
# Graph AC: annotations -> partitioner tags
# ---------------------------------------------------------------------------


@dataclass
class ACTagStats:
    regions: int = 0
    must_save: int = 0
    prefer_recompute: int = 0
    # backward nodes that carried recompute tags (e.g. from eager SAC having
    # run under the tracer) and had them removed
    backward_cleared: int = 0
    region_ids: list[int] = field(default_factory=list)


def _is_tangent(node: fx.Node) -> bool:
    if node.op != "placeholder":
        return False
    desc = node.meta.get("desc")
    if desc is not None:
        return type(desc).__name__ == "TangentAOTInput"
    return "tangents" in str(node.target)


def forward_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes of the forward half of a joint graph.

    AOT autograd tags them ``meta["partitioner_tag"] == "is_forward"``; for
    graphs without those tags, the forward is what does not depend on a
    tangent.
    """
    nodes = list(gm.graph.nodes)
    if any("partitioner_tag" in n.meta for n in nodes):
        return {n for n in nodes if n.meta.get("partitioner_tag") == "is_forward"}
    backward: set[fx.Node] = set()
    for n in nodes:
        if _is_tangent(n) or any(isinstance(a, fx.Node) and a in backward for a in n.all_input_nodes):
            backward.add(n)
    return {n for n in nodes if n not in backward and n.op != "output"}


def recomputes_op(node: fx.Node, op: Any) -> bool:
    """Whether an ``op`` node added next to ``node`` (same AC annotation: the
    apply stage copies it to the collectives it emits for ``node``'s inputs)
    would be recomputed in the backward by :func:`tag_recompute`: always in
    a full-AC region, unless the policy saves ``op`` in a selective one,
    never outside AC. (A counted op's every-n-th rule is not applied: the
    collectives apply emits are not counted ops.)"""
    custom = node.meta.get("custom") or {}
    if custom.get(AC_REGION_KEY) is None:
        return False
    if custom.get(AC_MODE_KEY, "full") != "selective":
        return True
    data = custom.get(AC_POLICY_KEY)
    policy = SACPolicy.from_annotation(data) if data else DEFAULT_SAC_POLICY
    return _op_name(op) not in policy.save_ops


def tag_recompute(joint_gm: fx.GraphModule) -> ACTagStats:
    """Set ``meta["recompute"]``/``meta["ac_graph_id"]`` on annotated forward nodes.

    Full regions: PREFER_RECOMPUTE on every op. Selective regions: the
    region's ``SACPolicy`` (carried in the annotation) evaluated on
    ``node.target`` in graph order with a per-region counter, so the decisions
    match eager selective AC. A getitem inherits the tag of the multi-output
    op it reads. Random ops are recomputed like any other (SDPA is one: it
    carries the ``nondeterministic_seeded`` tag); the partitioner then saves
    and replays their RNG state (``functionalize_rng_ops``), as eager AC does.
    Backward nodes lose any recompute tag (their annotation is copied from the
    forward node they differentiate). Mutates ``joint_gm`` in place.
    """
    fwd = forward_nodes(joint_gm)
    deciders: dict[int, Callable[[Any], CheckpointPolicy]] = {}
    stats = ACTagStats()
    for node in joint_gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        region = custom.get(AC_REGION_KEY)
        if node not in fwd:
            if node.meta.pop(_RECOMPUTE, None) is not None:
                stats.backward_cleared += 1
            node.meta.pop(_AC_GRAPH_ID, None)
            continue
        if region is None or node.op != "call_function":
            continue
        mode = custom.get(AC_MODE_KEY, "full")
        if node.target is operator.getitem and _RECOMPUTE in node.args[0].meta:
            decision = node.args[0].meta[_RECOMPUTE]
        elif mode == "selective":
            if region not in deciders:
                data = custom.get(AC_POLICY_KEY)
                policy = SACPolicy.from_annotation(data) if data else DEFAULT_SAC_POLICY
                deciders[region] = policy.decider()
            decision = deciders[region](node.target)
        else:
            decision = CheckpointPolicy.PREFER_RECOMPUTE
        node.meta[_RECOMPUTE] = decision
        node.meta[_AC_GRAPH_ID] = region
        if region not in stats.region_ids:
            stats.region_ids.append(region)
        if decision == CheckpointPolicy.MUST_SAVE:
            stats.must_save += 1
        else:
            stats.prefer_recompute += 1
    stats.regions = len(stats.region_ids)
    return stats
