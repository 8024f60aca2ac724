"""``torch.compile`` backend for parallel modules that keeps the first partition.

``apply_placement`` already split the training step into a forward and a
backward graph (:mod:`autoparallel.apply.partition`) and tagged every forward
node whose value the backward reads with ``meta["custom"]["ap_must_save"]``.
Compiling the parallel module re-traces both graphs into one joint graph (the
tags survive: ``custom`` is one of ``torch.fx.proxy._COPY_META_FIELDS``);
PyTorch's min-cut partitioner would then decide again what to save and what
to recompute, and decide differently (re-gathering or saving other values).
The backend's partitioner instead saves exactly the tagged values:

* forward = the primal inputs and the nodes that do not depend on a tangent
  and that the forward outputs or a tagged node need;
* saved = the forward values some backward node reads (tagged nodes, a tagged
  multi-output op's getitems, primal inputs and views of them); an untagged
  computed one is saved too (correctness first) and listed in
  :data:`LAST_PARTITION`.

Compilers are aot_eager-style (the graphs run as FX code), so this runs on
CPU; ``autoparallel_backend(fw_compiler=..., bw_compiler=...)`` swaps them.
For the step compiled by Inductor, use ``apply_placement(plan, compile=True)``
(:mod:`.inductor`): it compiles the planned graphs directly, with no dynamo
re-trace and no second partition (docs/compile.md).

>>> # compiled = torch.compile(parallel_module, backend=autoparallel_backend())
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch._aot_autograd.utils import make_boxed_func
from torch._functorch.partitioners import (
    _extract_fwd_bwd_outputs,
    _is_primal,
    _is_tangent,
    classify_nodes,
    is_sym_node,
)

from ..torch_compat import extract_fwd_bwd_modules, is_opaque_node
from .partition import SAVE_TAG, drop_dead_collectives

__all__ = ["PartitionRecord", "autoparallel_backend", "LAST_PARTITION"]


@dataclass
class PartitionRecord:
    """What the backend's partitioner did on its last call (for tests, logs)."""

    fw: fx.GraphModule | None = None
    bw: fx.GraphModule | None = None
    saved: list[fx.Node] = field(default_factory=list)  # forward graph's saved outputs
    untagged_saved: list[str] = field(default_factory=list)  # saved but not tagged by the first partition


LAST_PARTITION = PartitionRecord()


def _tagged(node: fx.Node) -> bool:
    if node.meta.get("custom", {}).get(SAVE_TAG):
        return True
    parent = node.args[0] if node.target is operator.getitem and node.args else None
    return isinstance(parent, fx.Node) and bool(parent.meta.get("custom", {}).get(SAVE_TAG))


def _is_input(node: fx.Node) -> bool:
    """A primal or a view of one (a DTensor parameter's ``to_local``)."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        node = node.args[0]
    return _is_primal(node)


def save_tagged_partition(joint: fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int, **_kw):
    """Partition ``joint`` saving the values the first partition saved (see
    the module docstring)."""
    info = classify_nodes(joint, [], num_fwd_outputs)
    after_tangent = info.tangents_closure
    fwd_outputs, bwd_outputs, *_ = _extract_fwd_bwd_outputs(joint, num_fwd_outputs=num_fwd_outputs)
    bwd_outputs = set(bwd_outputs)
    # forward: what the forward outputs or the tagged values need (by data
    # flow only: classify_nodes' forward also pulls in collectives the
    # backward re-runs on primals)
    roots = [n for n in fwd_outputs if isinstance(n, fx.Node)] + [
        n for n in joint.graph.nodes if (_tagged(n) or _is_primal(n)) and n not in after_tangent
    ]
    forward: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in forward or n in after_tangent or _is_tangent(n):
            continue
        forward.add(n)
        stack.extend(n.all_input_nodes)
    saved, sym, opaque, untagged = [], [], [], []
    for n in joint.graph.nodes:
        if n not in forward or n.op == "output":
            continue
        if n not in bwd_outputs and not any(u not in forward and u.op != "output" for u in n.users):
            continue
        if is_sym_node(n):
            sym.append(n)
            continue
        if is_opaque_node(n):  # e.g. the DeviceMesh of a DTensor input
            opaque.append(n)
            continue
        if all(u.target is operator.getitem for u in n.users) and n.users:
            continue  # a multi-output op: its getitems are saved
        saved.append(n)
        if not _is_input(n) and not _tagged(n):
            untagged.append(n.name)
    fw, bw = extract_fwd_bwd_modules(joint, saved, sym, opaque, num_fwd_outputs=num_fwd_outputs)
    # the extraction copies every node whose inputs are available
    drop_dead_collectives(fw, bw)
    LAST_PARTITION.fw, LAST_PARTITION.bw = fw, bw
    LAST_PARTITION.saved = list(fw.graph.find_nodes(op="output")[0].args[0][num_fwd_outputs:])
    LAST_PARTITION.untagged_saved = untagged
    return fw, bw


def _eager(gm: fx.GraphModule, _example_inputs) -> Callable:
    return make_boxed_func(gm.forward)


def autoparallel_backend(
    fw_compiler: Callable | None = None,
    bw_compiler: Callable | None = None,
) -> Callable:
    """A ``torch.compile`` backend (``torch.compile(m, backend=autoparallel_backend())``)
    whose partitioner keeps the save/recompute decisions of ``apply_placement``."""
    return aot_autograd(
        fw_compiler=fw_compiler or _eager,
        bw_compiler=bw_compiler or _eager,
        partition_fn=save_tagged_partition,
    )
