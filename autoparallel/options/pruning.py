"""Drop Partial placements that no computation can make useful.

On a 3-D mesh most options of a linear op (add, mul, view, neg, ...) carry
a ``Partial`` of some reduce op on some mesh dim: DTensor lets ``Partial(avg)``,
``Partial(max)`` and ``Partial(min)`` flow through every linear op, and a
``Replicate -> Partial`` redistribution (a local copy) can start such a flow
anywhere. On LLaMA-3 that is over half of all options, and pair matrices
grow with their square. Most of them can never be part of a better plan:

For a family ``F`` of reduce ops ({avg}, {max, min}: ``neg`` swaps max and
min; {sum}) and a mesh dim ``d``, take the static graph whose vertices are
the nodes with an option holding ``Partial(F)`` on ``d`` and whose edges
join a producer that can output it to a consumer that can take it. In a
plan, the nodes holding ``Partial(F)`` on ``d`` form components of that
graph's edges. In a component with no *creator* (an option that outputs
``Partial(F)`` on ``d`` without taking one there, like ``mean`` over a
sharded dim), every ``Partial(F)`` was started by a ``Replicate -> Partial``
copy. Replacing ``Partial(F)`` by ``Replicate`` on ``d`` in the whole
component does not raise the plan's cost when each such option has that
substitute in its list with no more compute:

* edges inside the component stay identity moves on ``d`` (other mesh dims
  are planned and sized the same: Partial and Replicate both leave the
  local shape whole);
* an edge starting the flow (``R -> P`` copy) becomes ``R -> R`` (free);
* an edge ending it (``P -> R`` all-reduce, ``P -> S`` reduce-scatter)
  becomes ``R -> R`` (free) or ``R -> S`` (a local slice, cheaper than the
  reduce-scatter: checked on the device figures below).

So the options holding ``Partial(F)`` on ``d`` are dropped from every node
of such components (if every node sharing an option list is in one), and
the optimum of the cost model is unchanged. Components with a creator,
a pinned or tangent/output node, or an option lacking its substitute keep
all their options.

Tried and not kept (measured on tiny LLaMA-3, 2x2x2): dropping an option
when another with the same output costs no more on compute and on every
incoming edge for every layout the producer can give (exact) removed 48 of
19,852 options: input variants such as ``mul(P, R)`` vs ``mul(R, P)`` are
each cheaper for some producer layout. A bound (drop options whose extra
compute exceeds a feasible plan's cost less the sum of per-node minimal
compute) was estimated, not built: on LLaMA-3 8B 4x4x8 the gap is tens of
ms, so it would only reach options replicated >= ~16x on a big matmul;
communication, which the bound leaves out, is where plans differ.

Measured on LLaMA-3 70B, 4x4x8x8, one layer, after this pruning:
143,187 options, 113.8M option pairs, held by pointwise ops (``mul.Tensor``
39.0M pairs into 35 nodes, ``add.Tensor`` 28.1M into 19, then ``mm`` 9.3M,
``view`` 6.8M, ``slice`` 4.8M); a ``mul`` node has 2,302 options over 1,218
output layouts, 1,736 of them outputting a ``Partial`` on 1-4 mesh dims (a
layout with k Partial dims comes in up to 2^k input variants). The same
compute bound with the 80 linked layers multiplying each option's extra
compute still leaves 94.1M pairs at a gap of only 0.25 s (the pointwise
options differ in communication, not compute); arc consistency over the
infinite (structural) entries drops 2% of the options (8B 4x4x8). An exact
cut of the pointwise options needs bounds that see edge costs (LP duals,
min-marginals over a spanning forest), and pricing an option against its
neighbours' layouts needs the distinct-placement costs (~1.2K x 1.2K per
pointwise edge on 4-D) that make the problem too big in the first place.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch.fx
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ..cost_model.placement_codes import PARTIAL, REPLICATE_KEY, key as placement_key
from .strategies import NodeStrategy, Option

logger = logging.getLogger(__name__)

FAMILIES: tuple[frozenset[str], ...] = (frozenset({"avg"}), frozenset({"max", "min"}), frozenset({"sum"}))


@dataclass
class PruneStats:
    options_before: int = 0
    options_after: int = 0
    # (family, mesh dim) -> nodes whose options lost that Partial
    pruned: dict[tuple[str, int], int] = field(default_factory=dict)
    seconds: float = 0.0
    # id(original list) -> (kept indices, the new list), for lists that lost options
    kept: dict[int, tuple[list[int], list]] = field(default_factory=dict)

    def describe(self) -> str:
        where = ", ".join(f"P({fam}) on dim {d}: {n} nodes" for (fam, d), n in sorted(self.pruned.items()))
        return f"options {self.options_before} -> {self.options_after} ({where or 'nothing pruned'}) in {self.seconds:.2f}s"


def copy_cheaper_than_collectives(device) -> bool:
    """A local slice (read + write at HBM speed, no launch floor) costs less
    than a reduce-scatter of the same tensor on any link: the premise of
    ending a flow with a slice instead of a reduce-scatter."""
    copy = 2 / (device.hbm_bw * device.memory_efficiency)  # s per byte of the shard
    fastest_link = max(device.intra_node_bw, device.inter_node_bw) * device.comm_efficiency
    # reduce-scatter over n >= 2 moves (n-1)/n >= 1/2 of the input = n/2 >= 1 shards
    return copy <= 1 / fastest_link


@dataclass
class _ListInfo:
    mask: list[bool]  # option holds Partial(F) on d (input or output)
    mask_any: bool
    outputs: bool  # some option outputs it
    takes: list[bool]  # per input: some option takes it there
    why: str | None  # why its Partials must stay (creator, no substitute)


class _Codes:
    """Per-slot codes (:func:`~autoparallel.cost_model.placement_codes.key`
    per mesh dim of a spec: any Partial as ("P", reduce op, type), or an output
    slot's non-spec value) interned as small ints, for one prune_partials
    call: option keys become int tuples (nested tuples of placement codes
    hash in Python, per option and per substitution lookup), and a code's
    held bits and substitutes are computed once, not per option. Ints start
    at 1, so a memo miss (None) reads as false."""

    def __init__(self, ndim: int):
        self.ndim = ndim
        self._ids: dict = {}  # codes -> int
        self.values: list = [None]  # int -> codes
        # int -> bit (family index * ndim + mesh dim) set where the codes hold Partial(F)
        self.bits: list[int] = [0]
        # id(spec) -> int: specs are pooled (one object per layout and
        # shape) and outlive the call, as the option lists holding them do
        self.by_spec: dict[int, int] = {}
        self._subs: dict[tuple[int, int], int] = {}  # (int, bit) -> the substitute's int
        # id(placements tuple) -> (its int, the tuple: kept alive, so the id stays its own)
        self._by_placements: dict[int, tuple[int, tuple]] = {}

    def intern(self, codes) -> int:
        i = self._ids.get(codes)
        if i is None:
            i = self._ids[codes] = len(self.values)
            self.values.append(codes)
            self.bits.append(_held_bits(codes, self.ndim))
        return i

    def spec(self, spec: DTensorSpec) -> int:
        i = self.by_spec.get(id(spec))
        if i is None:
            # specs of one layout on different shapes share their placements
            # tuple (fast_expand numbers them): code it once
            placements = spec.placements
            hit = self._by_placements.get(id(placements))
            if hit is None:
                hit = self._by_placements[id(placements)] = (
                    self.intern(tuple(placement_key(p) for p in placements)),
                    placements,
                )
            i = self.by_spec[id(spec)] = hit[0]
        return i

    def slot(self, value) -> int:
        """An output slot: a spec, or a non-spec value (kept as is)."""
        return self.spec(value) if isinstance(value, DTensorSpec) else self.intern(value)

    def substitute(self, key: tuple[int, ...], d: int, family, bit: int) -> tuple[int, ...]:
        """:func:`_substitute` on interned codes."""
        bits, subs = self.bits, self._subs
        out = []
        for c in key:
            if bits[c] & bit:
                sub = subs.get((c, bit))
                if sub is None:
                    sub = subs[(c, bit)] = self.intern(_substitute((self.values[c],), d, family)[0])
                c = sub
            out.append(c)
        return tuple(out)


@dataclass
class _ListPre:
    """Per option list, computed once for all (family, mesh dim) passes."""

    codes: _Codes
    outs: list[tuple[int, ...]]  # per option: per output slot, interned codes
    ins: list[tuple[int, ...]]  # per option: per input, interned codes
    _index: dict | None  # see index()
    # per option: bit (family index * ndim + mesh dim) set where some output
    # / each input holds Partial(F) there (the passes test bits, not codes)
    out_bits: np.ndarray  # (options,)
    in_bits: np.ndarray  # (options, inputs)

    def index(self) -> dict:
        """(outs, ins) -> index in the list (the last on ties); built on
        first use (only lists holding a Partial look substitutes up)."""
        if self._index is None:
            self._index = {key: i for i, key in enumerate(zip(self.outs, self.ins))}
        return self._index


def _held_bits(codes, ndim: int) -> int:
    return sum(1 << (f * ndim + d) for f, family in enumerate(FAMILIES) for d in range(ndim) if _held(codes, d, family))


def _list_pre(options: list[Option], codes: _Codes) -> _ListPre:
    """``codes``: shared by every list of one prune_partials call (lists
    repeat a few hundred specs). Memo hits are inlined (a call per spec of
    332K options cost seconds)."""
    known, spec = codes.by_spec.get, codes.spec
    outs = [
        (known(id(o.output_specs)) or spec(o.output_specs),)
        if type(o.output_specs) is DTensorSpec
        else tuple(codes.slot(s) for s in o.output_specs)
        if isinstance(o.output_specs, (tuple, list))
        else (codes.slot(o.output_specs),)
        for o in options
    ]
    ins = [tuple([known(id(s)) or spec(s) for s in o.input_specs]) for o in options]
    bits = np.asarray(codes.bits, dtype=np.int64)
    widths = {len(slots) for slots in outs}
    if len(widths) == 1 and 0 not in widths:
        out_bits = np.bitwise_or.reduce(bits[np.asarray(outs, dtype=np.int64)], axis=1)
    else:  # outputs of differing arity
        out_bits = np.asarray(
            [int(np.bitwise_or.reduce(bits[list(slots)])) if slots else 0 for slots in outs], dtype=np.int64
        )
    n_in = len(ins[0]) if ins else 0
    in_bits = bits[np.asarray(ins, dtype=np.int64).reshape(len(ins), n_in)]
    return _ListPre(codes, outs, ins, None, out_bits, in_bits)


def _held(code, d: int, family) -> bool:
    """A spec's codes hold Partial(F) on mesh dim ``d``."""
    if not isinstance(code, tuple):
        return False
    c = code[d]
    return c is not None and c is not REPLICATE_KEY and type(c) is tuple and c[0] == PARTIAL and c[1] in family


def _substitute(codes: tuple, d: int, family) -> tuple:
    """Codes with Partial(F) on mesh dim ``d`` replaced by Replicate."""
    return tuple(c[:d] + (REPLICATE_KEY,) + c[d + 1 :] if _held(c, d, family) else c for c in codes)


def _list_info(
    options: list[Option], pre: _ListPre, kept: list[int], costs: list[float], d: int, family, bit: int
) -> _ListInfo:
    """``bit``: the (family, d) bit of :attr:`_ListPre.out_bits`."""
    n_in = len(options[kept[0]].input_specs) if kept else 0
    rows = np.asarray(kept, dtype=np.int64)
    outs = (pre.out_bits[rows] & bit) != 0
    ins = (pre.in_bits[rows] & bit) != 0
    ins_any = ins.any(axis=1) if n_in else np.zeros(len(rows), dtype=bool)
    held = outs | ins_any
    takes = ins.any(axis=0).tolist() if n_in else []
    why, kept_set = None, None
    # why its Partials must stay: the first held option creating one, or
    # lacking a substitute no costlier
    for j in np.flatnonzero(held).tolist():
        i = kept[j]
        o = options[i]
        if outs[j] and not ins_any[j]:
            why = f"creates it ({o.label})"
            break
        if kept_set is None:
            kept_set = set(kept)
        sub = pre.index().get(
            (pre.codes.substitute(pre.outs[i], d, family, bit), pre.codes.substitute(pre.ins[i], d, family, bit))
        )
        if sub is None or sub not in kept_set:
            why = f"no substitute for {o.label}"
            break
        if costs[sub] > costs[i]:
            why = f"substitute costlier than {o.label}"
            break
    mask = held.tolist()
    return _ListInfo(mask, any(mask), bool(outs.any()), takes, why)


def prune_partials(
    strategies: dict[torch.fx.Node, NodeStrategy],
    unary: dict[int, list[float]],
    frozen: set[torch.fx.Node],
    ndim: int,
    linked: list[tuple[torch.fx.Node, torch.fx.Node]] = (),
) -> tuple[dict[torch.fx.Node, NodeStrategy], PruneStats]:
    """Strategies without the Partial options described in the module
    docstring. ``unary``: id(option list) -> compute cost per option (the
    entries of new lists are added). ``frozen``: nodes whose options hold
    (pinned to a Partial). ``linked``: pairs of linked decisions (repeated
    layers); a link maps options by placements, as the substitution does, so
    linked nodes are put in one component: both change or neither."""
    t0 = time.perf_counter()
    stats = PruneStats()
    original = {id(s.options): s.options for s in strategies.values()}
    stats.options_before = sum(len(o) for o in original.values())
    current = {k: list(range(len(o))) for k, o in original.items()}  # kept indices
    codes = _Codes(ndim)
    pre = {k: _list_pre(o, codes) for k, o in original.items()}
    users: dict[int, list[torch.fx.Node]] = {}
    for node, strat in strategies.items():
        users.setdefault(id(strat.options), []).append(node)

    for f, family in enumerate(FAMILIES):
        name = "/".join(sorted(family))
        for d in range(ndim):
            bit = 1 << (f * ndim + d)
            # per option list: which options hold Partial(F) on d, whether
            # some option outputs / takes it (per input), why it must stay
            info = {
                key: _list_info(original[key], pre[key], current[key], unary[key], d, family, bit) for key in original
            }
            # vertices: nodes with an option holding Partial(F) on d
            holds = {node for node, strat in strategies.items() if info[id(strat.options)].mask_any}
            if not holds:
                continue
            # union-find over static flow edges
            parent = {n: n for n in holds}

            def find(n):
                while parent[n] is not n:
                    parent[n] = parent[parent[n]]
                    n = parent[n]
                return n

            sticky: set = set()
            why: dict = {}
            for node in holds:
                strat = strategies[node]
                mine = info[id(strat.options)]
                if node in frozen:
                    sticky.add(node)
                    why.setdefault(node, "pinned to a Partial")
                if mine.why is not None:
                    sticky.add(node)
                    why.setdefault(node, mine.why)
                if strat.getitem_index is not None:
                    inputs = [(strat.inputs[0], mine.outputs)]
                else:
                    inputs = [(p, mine.takes[k]) for k, p in enumerate(strat.inputs)]
                for producer, takes in inputs:
                    if takes and producer in holds and info[id(strategies[producer].options)].outputs:
                        parent[find(producer)] = find(node)
            for a, b in linked:
                if a in holds and b in holds:
                    parent[find(a)] = find(b)
            sticky_roots = {find(n) for n in sticky}
            if logger.isEnabledFor(logging.DEBUG):
                for n, reason in why.items():
                    members = [m.name for m in holds if find(m) is find(n)]
                    logger.debug(
                        "P(%s) on dim %d kept at %s (%d nodes joined: %s): %s",
                        name,
                        d,
                        n.name,
                        len(members),
                        " ".join(members[:12]),
                        reason,
                    )
            # a shared option list is pruned only if all its users may be
            prunable_lists = {
                key for key, nodes in users.items() if all(n in holds and find(n) not in sticky_roots for n in nodes)
            }
            for key in prunable_lists:
                current[key] = [i for i, m in zip(current[key], info[key].mask) if not m]
                stats.pruned[(name, d)] = stats.pruned.get((name, d), 0) + len(users[key])

    result = {}
    for node, strat in strategies.items():
        key = id(strat.options)
        if len(current[key]) == len(original[key]):
            result[node] = strat
            continue
        if key not in stats.kept:
            new = [original[key][i] for i in current[key]]
            stats.kept[key] = (current[key], new)
            unary[id(new)] = [unary[key][i] for i in current[key]]
        result[node] = NodeStrategy(strat.node, strat.inputs, stats.kept[key][1], strat.source, strat.getitem_index)
    stats.options_after = sum(len(v) for v in current.values())
    stats.seconds = time.perf_counter() - t0
    logger.info("option pruning: %s", stats.describe())
    return result, stats
