"""What a training step's memory model holds: bytes per term (a decision's
output or one of its inputs) and category, turned into per-rank bytes for
a plan's placements (:class:`StepMemoryModel`). Built from the traced step
by :func:`autoparallel.problem.memory_budget.step_memory_model`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .memory_peaks import reduces
from .param_memory import shard_factor

# "outputs": the step's outputs (held by the caller through its loss and
# the optimizer step), "output_grads": their incoming gradients, by their
# layout; the last three are the moments
# the step allocates more (:mod:`.memory_peaks`): the backward's largest
# live set of transients, the caller's loss's fp32 copies of the outputs,
# the optimizer step's intermediates. They do not overlap: the peak counts
# the largest (:meth:`StepMemoryModel.peak`).
CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer",
    "inputs",
    "activations",
    "outputs",
    "output_grads",
    "transients",
    "loss",
    "optimizer_step",
)
# held throughout the step ("inputs": the batch and the buffers)
STATE = ("parameters", "gradients", "optimizer", "inputs")
# the moments beyond the saved activations and outputs, one of which the
# peak counts; the optimizer's step competes with all activations
DURING_BACKWARD = ("transients", "loss")


@dataclass
class StepMemoryModel:
    """Replicated bytes per term and category. A term is a decision's output
    (key: the decision's name), sharded as its chosen output placement, or
    the ``k``-th input of a decision (key ``name:in:k``), sharded as the
    chosen option needs that input (see :func:`step_memory_model`).

    A reader-input term of a value the backward recomputes holds the
    redistributed copy beyond the producer's own bytes, which depends on
    the producer's placement too: the plan's estimate
    (:meth:`estimate`) evaluates it at both, the ILP's per-option weights
    (:meth:`per_rank`, the resource row) bound it from above by the
    producer at its most sharded (see :func:`~autoparallel.capture.saved_activations.redistributed_inputs`).

    >>> m = StepMemoryModel({"w": {"parameters": 400.0, "optimizer": 800.0}})
    >>> m.per_rank("w", "S(0)R", [4, 2])
    {'parameters': 100.0, 'optimizer': 200.0}
    >>> m = StepMemoryModel({"mm:in:0": {"activations": 800.0}}, recomputed_inputs={"mm:in:0": ["add", 8]})
    >>> m.per_rank("mm:in:0", "RS(0)", [4, 2])  # the row: 800 / 2 - 800 / 8
    {'activations': 300.0}
    >>> m.held("mm:in:0", "RS(0)", "S(0)R", [4, 2])  # the plan: 800 / 2 - 800 / 4
    {'activations': 200.0}
    >>> m.held("mm:in:0", "S(0)S(0)", "S(0)R", [4, 2])  # a local slice
    {'activations': 0.0}
    """

    terms: dict[str, dict[str, float]] = field(default_factory=dict)
    optimizer: str = "AdamW"
    optimizer_bytes_per_element: int = 8
    # how the saved activations were chosen, for the report
    activations_rule: str = ""
    # reader-input terms of values the backward recomputes (key -> [the
    # producer's name, its largest shard factor over its options]): the
    # redistributed copy is charged only beyond the producer at that
    # factor, never below zero (see :func:`~autoparallel.capture.saved_activations.redistributed_inputs`)
    recomputed_inputs: dict[str, list] = field(default_factory=dict)
    # reader-input terms of a value the backward recomputes whose forward
    # value arrives through a reduction (a Partial producer read unreduced
    # by the reader's layout): the AC policy saves the reduced tensor, kept
    # in full (key -> the producer's name); the row charges it per reader
    # option, from above (:func:`reduced_inputs`)
    reduced_inputs: dict[str, str] = field(default_factory=dict)
    # saved matmul outputs read through reduce-scatters the AC policy saves
    # (key -> per reader, per edge of the views between: [the edge's
    # source, its reader-input key, a table id]; table id ->
    # {"<source's placements>|<reader's input placements>": the kept copy's
    # shard factor}): where every reader takes the value through one such
    # reduce-scatter, the reduced tensor is kept instead
    # (:func:`~.memory_peaks.reduce_scattered_saves`); the row charges the
    # value as produced, from above
    reduce_scattered: dict[str, list[list]] = field(default_factory=dict)
    reduce_scatter_tables: dict[str, dict[str, int]] = field(default_factory=dict)
    # the categories the budget's one linear row sums: the state, and of the
    # moments that do not overlap (:meth:`peak`) the one largest with every
    # term at its most sharded layout (:func:`step_memory_model`)
    row_categories: list[str] = field(default_factory=lambda: list(CATEGORIES[:6]))
    # what the peak assumes of the caller's loss (:class:`~.memory_peaks.LossSpec`)
    loss_rule: str = ""
    # bytes per rank whatever the placements, per category (the optimizer's
    # per-tensor state): in the estimate, and off the row's bound
    fixed: dict[str, float] = field(default_factory=dict)

    def peak(self, parts: dict[str, float]) -> float:
        """The step's peak per rank from per-category bytes: the state and
        the outputs (the caller holds them to the step's end), plus the
        larger of (saved activations + the outputs' gradients + the larger
        of the backward's transients and the loss's copies) and the
        optimizer step's intermediates."""
        state = sum(parts.get(c, 0.0) for c in STATE) + parts.get("outputs", 0.0)
        during = parts.get("activations", 0.0) + parts.get("output_grads", 0.0)
        during += max(parts.get(c, 0.0) for c in DURING_BACKWARD)
        return state + max(during, parts.get("optimizer_step", 0.0))

    def row_bytes(self, parts: dict[str, float]) -> float:
        """What the budget's row sums of per-category bytes."""
        return sum(parts.get(c, 0.0) for c in self.row_categories)

    def per_rank(self, key: str, placements: str, mesh_shape: list[int]) -> dict[str, float]:
        """Bytes per rank of term ``key`` laid out as ``placements``
        (``format_specs`` notation): the ILP's weight and the report's term."""
        most = self.recomputed_inputs[key][1] if key in self.recomputed_inputs else None
        return self._per_rank(key, shard_factor(placements, mesh_shape), most)

    def held(self, key: str, placements: str, producer_placements: str, mesh_shape: list[int]) -> dict[str, float]:
        """:meth:`per_rank`, a recomputed value's reader-input term at its
        producer's placements (``producer_placements``) as well."""
        if key in self.reduced_inputs:
            out = self.per_rank(key, placements, mesh_shape)
            if not reduces(producer_placements, placements):
                out["activations"] = 0.0
            return out
        most = shard_factor(producer_placements, mesh_shape) if key in self.recomputed_inputs else None
        return self._per_rank(key, shard_factor(placements, mesh_shape), most)

    def kept_reduce_scattered(
        self, key: str, placements: str, read: list[list[tuple[str, str]]], mesh_shape: list[int]
    ) -> dict[str, float]:
        """:meth:`per_rank` of a term of :attr:`reduce_scattered` laid out
        as ``placements``, ``read`` its readers' edges' placements (per
        reader, per edge: the source's output, the reader's input): one
        reduce-scattered copy where every reader takes the value through the
        same reduce-scatter (every other edge keeps the layout), else the
        value as produced (never more than :meth:`per_rank`)."""
        out = self.per_rank(key, placements, mesh_shape)
        copies = set()
        for edges, pairs in zip(self.reduce_scattered[key], read):
            moved = [(src, a, b, tid) for (src, _, tid), (a, b) in zip(edges, pairs) if a != b]
            if len(moved) != 1:
                return out
            src, a, b, tid = moved[0]
            factor = self.reduce_scatter_tables.get(tid, {}).get(f"{a}|{b}")
            if factor is None:
                return out
            copies.add((src, a, b, factor))
        if len(copies) == 1:
            factor = copies.pop()[3]
            out["activations"] = min(out["activations"], self.terms[key]["activations"] / factor)
        return out

    def two_decision(self) -> dict[str, str]:
        """Terms whose bytes depend on their producer's placement too: key ->
        the producer's name."""
        return {**{k: v[0] for k, v in self.recomputed_inputs.items()}, **self.reduced_inputs}

    def _per_rank(self, key: str, factor: int, producer_factor: int | None) -> dict[str, float]:
        out = {cat: b / factor for cat, b in self.terms[key].items()}
        if producer_factor is not None:
            b = self.terms[key]["activations"]
            out["activations"] = max(0.0, b / factor - b / producer_factor)
        return out

    def weights(self, key: str, labels: list[str], mesh_shape: list[int]) -> list[float]:
        """The row's weight of term ``key`` per option (its row categories)."""
        return [self.row_bytes(self.per_rank(key, p, mesh_shape)) for p in labels]

    def category_weights(self, key: str, labels: list[str], mesh_shape: list[int]) -> dict[str, list[float]]:
        """Per category, term ``key``'s bytes per option."""
        per = [self.per_rank(key, p, mesh_shape) for p in labels]
        return {c: [d.get(c, 0.0) for d in per] for c in self.terms[key]}

    @staticmethod
    def site(key: str) -> tuple[str, int | None]:
        """(decision name, input index or None for its output) of a term."""
        name, _, k = key.partition(":in:")
        return name, int(k) if k else None

    def estimate(self, plan_nodes: dict, mesh_shape: list[int], *, row: bool = False) -> dict[str, float]:
        """Per-rank bytes by category for a plan's chosen placements
        (``plan.nodes``: name -> NodePlan); ``row``: the budget row's value
        there, which bounds it (recomputed values at their per-option bound)."""
        out = dict.fromkeys(CATEGORIES, 0.0)
        out.update({c: b for c, b in self.fixed.items()})
        for key in self.terms:
            name, k = self.site(key)
            n = plan_nodes[name]
            placements = n.output_placements if k is None else n.input_placements[k]
            pair = self.two_decision()
            if not row and key in self.reduce_scattered:
                read = [
                    [
                        (plan_nodes[src].output_placements, plan_nodes[r].input_placements[j])
                        for src, (r, j) in ((src, self.site(site)) for src, site, _ in edges)
                    ]
                    for edges in self.reduce_scattered[key]
                ]
                parts = self.kept_reduce_scattered(key, placements, read, mesh_shape)
            elif row or key not in pair:
                parts = self.per_rank(key, placements, mesh_shape)
            else:
                parts = self.held(key, placements, plan_nodes[pair[key]].output_placements, mesh_shape)
            for cat, b in parts.items():
                out[cat] += b
        return out

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "StepMemoryModel":
        return cls(
            **{
                **d,
                "terms": {k: dict(v) for k, v in d["terms"].items()},
                "recomputed_inputs": {k: list(v) for k, v in d.get("recomputed_inputs", {}).items()},
                "row_categories": list(d.get("row_categories", CATEGORIES[:6])),
                "reduced_inputs": dict(d.get("reduced_inputs", {})),
                "reduce_scattered": {
                    k: [[list(e) for e in edges] for edges in v] for k, v in d.get("reduce_scattered", {}).items()
                },
                "reduce_scatter_tables": {k: dict(v) for k, v in d.get("reduce_scatter_tables", {}).items()},
                "fixed": dict(d.get("fixed", {})),
            }
        )
