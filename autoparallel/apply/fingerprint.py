"""Name-free fingerprints of a step's forward and backward graphs.

Two applies of the same plan (say, with and without layer folding) give the
same graphs when their fingerprints are equal: every node is hashed from its
op, target, output shape, recompute tag and its inputs' hashes (placeholders
by what they are: a primal's position, a saved tensor's forward hash, a
tangent's index), and the fingerprint lists the hashes in graph order.
Node names play no part.
"""

from __future__ import annotations

import hashlib

import torch
import torch.fx as fx

from .partition import StepGraphs


def _group_key(name: str) -> str:
    """A process group by its ranks, not its name: equal meshes created in
    another session (or context) get new group names."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return "group" + repr(dist.get_process_group_ranks(_resolve_process_group(name)))
    except Exception:  # not a registered group name: keep the string
        return repr(name)


def node_hashes(gm: fx.GraphModule, placeholder_key) -> dict[fx.Node, str]:
    """Structural hash of every node; ``placeholder_key(i)`` names the i-th placeholder."""
    h: dict[fx.Node, str] = {}
    collective = False

    def arg(a) -> str:
        if collective and isinstance(a, str):
            return _group_key(a)
        if isinstance(a, fx.Node):
            return h[a]
        if isinstance(a, (list, tuple)):
            return "(" + ",".join(arg(x) for x in a) + ")"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}:{arg(v)}" for k, v in a.items()) + "}"
        return repr(a)

    i = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            s = placeholder_key(i)
            i += 1
        else:
            collective = "c10d_functional" in str(n.target)
            v = n.meta.get("val")
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else None
            s = f"{n.op}|{n.target}|{shape}|{arg(n.args)}|{arg(n.kwargs)}|{n.meta.get('recompute')}"
        h[n] = hashlib.sha1(s.encode()).hexdigest()
    return h


def fingerprint(graphs: StepGraphs) -> dict[str, list]:
    """Per part of the step (forward/backward node order, forward outputs,
    saved tensors, gradients, backward inputs): its list of hashes."""
    fw, bw = graphs.fw, graphs.bw
    hf = node_hashes(fw, lambda i: f"primal{i}")
    (fw_out,) = fw.graph.find_nodes(op="output")
    outs = list(fw_out.args[0])
    saved = outs[graphs.num_fwd_outputs :]

    def bw_input(i: int) -> str:
        kind, j = graphs.bw_inputs[i]
        return "saved" + hf[saved[j]] if kind == "saved" else f"tangent{j}"

    hb = node_hashes(bw, bw_input)
    (bw_out,) = bw.graph.find_nodes(op="output")
    return {
        "forward order": [hf[n] for n in fw.graph.nodes],
        "backward order": [hb[n] for n in bw.graph.nodes],
        "forward outputs": [hf[o] for o in outs[: graphs.num_fwd_outputs]],
        "saved": [hf[s] for s in saved],
        "gradients": [hb[o] if o is not None else None for o in bw_out.args[0]],
        "backward inputs": [bw_input(i) for i in range(len(graphs.bw_inputs))],
    }


def differences(a: dict[str, list], b: dict[str, list]) -> list[str]:
    """Parts in which two fingerprints differ (empty: the same graphs)."""
    return [k for k in a if a[k] != b.get(k)]
