"""Graph queries the overlap scheduler (:mod:`.schedule_overlap`) asks:
what only prepares a reduction's input, which reduction is reachable
soonest, whether a gathered value is read only by the graph output, a
range-max table over the live-bytes curve, and the topological check of a
new order. Pure functions over the graph and its :class:`Info`.
"""

from __future__ import annotations

import torch.fx as fx

from ..graph_vocab import COLLECTIVE_START, NOT_A_CALL, WAIT_NODE
from .overlap_model import STARTS, WAIT, Info

__all__ = ["RangeMax", "check_order", "closest_reduction", "only_output_reads", "preparation"]


def only_output_reads(wait: fx.Node | None, output: fx.Node) -> bool:
    """Whether the result of ``wait`` (through views and layout ops: the
    split and concatenation of a gather along another dim) is read only by
    the graph output."""
    from .recompute_all_gathers import is_chain_op

    if wait is None:
        return False
    stack, seen = [wait], {wait}
    while stack:
        for u in stack.pop().users:
            if u is output or u in seen:
                continue
            if is_chain_op(u) and u.target not in STARTS and u.target is not WAIT:
                seen.add(u)
                stack.append(u)
            else:
                return False
    return True


def preparation(start: fx.Node, info: Info) -> tuple[set[fx.Node], list[fx.Node]]:
    """The ops that only prepare ``start``'s input, and the collectives among
    them: its ancestors used by nothing else (directly or through each
    other), no compute op (matmul, attention), gradient reduction or
    placeholder among them. For a bucketed reduce-scatter: the casts, views
    and the concatenation of the layer's gradients, and a small collective
    that moves one of them into the bucket's layout first (a norm weight's
    gradient gathered over another mesh dim) with its wait."""
    ins, kind, compute, reductions = info.ins, info.kind, info.compute, info.reductions
    prep: set[fx.Node] = set()
    inner: list[fx.Node] = []
    stack = list(ins[start])
    while stack:
        a = stack.pop()
        k = kind.get(a)
        if a in prep or a in compute or a in reductions or k is None or k == NOT_A_CALL:
            continue
        if k == WAIT_NODE and (not isinstance(a.args[0], fx.Node) or a.args[0] in reductions):
            continue  # another reduction's wait: that reduction is issued on its own
        if all(u is start or u in prep for u in a.users):
            prep.add(a)
            if k == COLLECTIVE_START:
                inner.append(a)
            stack.extend(ins[a])
    return prep, inner


class RangeMax:
    """``max(values[lo:hi], default=0)`` in O(1) after an O(n log n) table
    (built on first use)."""

    def __init__(self, values: list[int]):
        self.values = values
        self.table: list[list[int]] | None = None

    def __call__(self, lo: int, hi: int) -> int:
        hi = min(hi, len(self.values))
        if hi <= lo:
            return 0
        if self.table is None:
            table = [self.values]
            step = 1
            while 2 * step <= len(self.values):
                prev = table[-1]
                table.append(list(map(max, prev, prev[step:])))
                step *= 2
            self.table = table
        k = (hi - lo).bit_length() - 1
        row = self.table[k]
        return max(row[lo], row[hi - (1 << k)])


def closest_reduction(n, nodes, i, done, dist_to_rs, info: Info):
    """A not-yet-run reduction reachable soonest from the nodes about to run
    (looking a short way ahead in the original order)."""
    ins, compute, reductions = info.ins, info.compute, info.reductions
    best, best_d = None, dist_to_rs.get(n, 1 << 30)
    for m in nodes[i : i + 64]:
        if m in done or m not in reductions:
            continue
        # cost to reach m: compute ops among its missing ancestors
        missing, stack, seen = 0, [m], {m}
        while stack:
            x = stack.pop()
            for a in ins[x]:
                if a not in done and a not in seen:
                    seen.add(a)
                    missing += 1 if a in compute else 0
                    stack.append(a)
        if missing < best_d:
            best, best_d = m, missing
    return best


def check_order(order: list[fx.Node], info: Info) -> None:
    """Every node after its inputs (what ``graph.lint`` would catch of a reorder)."""
    pos = {n: p for p, n in enumerate(order)}
    ins = info.ins
    for p, n in enumerate(order):
        for a in ins[n]:
            if pos[a] >= p:
                raise RuntimeError(f"schedule_overlap put {n.name} before its input {a.name}")
