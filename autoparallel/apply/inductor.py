"""Compile the planned forward and backward graphs with Inductor.

``apply_placement(plan, compile=True)`` hands each of the step's two graphs
(:class:`~.partition.StepGraphs`, after every pass) to Inductor as it is:

* the graphs are re-traced with Inductor's decompositions on their own fake
  example inputs (the placeholders' ``meta["val"]``) and compiled with
  ``compile_fx_inner``, the call AOT autograd makes per partitioned graph,
  so nothing is partitioned again: what the backward saves and what it
  recomputes (the FSDP gathers the plan re-runs in the backward, the AC
  regions) stay the plan's;
* Inductor settings that would move or merge collectives are off while
  compiling (:data:`~autoparallel.torch_compat.INDUCTOR_KEEP_PLAN`): its
  compute/communication reordering, peak-memory and locality reordering,
  the aten-level overlap scheduler, its FX bucketing of all-gathers,
  reduce-scatters and all-reduces, micro-pipelined TP and DDP fusion. The
  plan's buckets and the overlap scheduler's order then reach the compiled
  code. Inductor still fuses pointwise and reduction ops into kernels
  (moving compute, never a collective, within what the data flow allows);
  :attr:`GraphCompile.collective_order_kept` checks the collectives and
  their waits appear in the generated code in the graph's order;
* functional collectives (``_c10d_functional.*`` and ``wait_tensor``) and
  custom ops without a lowering (the MoE ops of :mod:`autoparallel.ops`)
  run as Inductor fallback kernels (the ATen op called from the compiled
  wrapper);
* a graph Inductor cannot compile (an op whose lowering fails, data-dependent
  sizes it cannot handle) runs as before, eagerly as FX code, with a
  warning that names the graph, the node Inductor failed on (when its error
  says) and the nodes with data-dependent sizes. The other graph still
  compiles; the answer is never a different one.

The compiled callables stand in for ``graphs.fw`` / ``graphs.bw`` in
:class:`~.runtime.ParallelStep`; with ``cudagraphs=True`` the project's CUDA
graphs capture them (Inductor's own CUDA graph trees stay off).
"""

from __future__ import annotations

import logging
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .. import torch_compat
from ..graph_vocab import module_path
from .partition import StepGraphs

logger = logging.getLogger(__name__)

__all__ = ["CompiledStep", "GraphCompile", "InductorFallbackWarning", "collective_sequence", "compile_step"]

_FUNCTIONAL = "_c10d_functional"


class InductorFallbackWarning(UserWarning):
    """A graph of the step runs eagerly because Inductor could not compile it."""


@dataclass
class GraphCompile:
    """What compiling one of the step's graphs gave."""

    graph: str  # "forward" or "backward"
    nodes: int  # nodes of the planned graph
    compiled: bool
    seconds: float  # decomposition + Inductor (one-off, at apply)
    reason: str = ""  # why it runs eagerly
    failed_nodes: list[str] = field(default_factory=list)  # node(s) Inductor failed on
    data_dependent_nodes: list[str] = field(default_factory=list)
    # the collectives and waits of the generated code in the graph's order
    # (None: not compiled, or torch keeps no generated source)
    collective_order_kept: bool | None = None
    source_code: str | None = None

    def describe(self) -> str:
        if not self.compiled:
            return f"{self.graph}: eager ({self.nodes} nodes): {self.reason}"
        order = {True: "collective order kept", False: "collective order CHANGED", None: "order not checked"}
        return f"{self.graph}: compiled ({self.nodes} nodes, {self.seconds:.1f}s, {order[self.collective_order_kept]})"


@dataclass
class CompiledStep:
    """The step's graphs as Inductor compiled them (or the eager graph where
    it could not): ``forward(*primals)``, ``backward(*saved_and_tangents)``."""

    forward: Callable[..., Any]
    backward: Callable[..., Any]
    records: tuple[GraphCompile, GraphCompile]
    settings: dict[str, Any]  # the Inductor settings compiled under

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    def describe(self) -> str:
        return "\n".join(r.describe() for r in self.records)


def collective_sequence(gm: torch.fx.GraphModule) -> list[str]:
    """The functional collectives and waits of ``gm`` in graph order, by op
    name (``all_gather_into_tensor``, ``wait_tensor``, ...)."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == _FUNCTIONAL:
            out.append(node.target.__name__.split(".")[0])
    return out


_CALL = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.\w+\(")


def compiled_collective_sequence(source_code: str) -> list[str]:
    """The collectives and waits the generated wrapper calls, in code order
    (an ``_out`` or in-place variant counts as its op: Inductor re-inplaces
    ``all_reduce`` into ``all_reduce_``)."""
    return [name.removesuffix("_out").rstrip("_") for name in _CALL.findall(source_code)]


def _first_difference(planned: list[str], generated: list[str]) -> str:
    k = next((i for i, (p, g) in enumerate(zip(planned, generated)) if p != g), min(len(planned), len(generated)))
    return (
        f"{len(planned)} planned, {len(generated)} in the generated code; first difference at #{k}: "
        f"planned {planned[k : k + 4]}, compiled {generated[k : k + 4]}"
    )


def _data_dependent(gm: torch.fx.GraphModule) -> list[str]:
    found = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        if any(isinstance(v, (torch.Tensor, torch.SymInt)) and free_unbacked_symbols(v) for v in vals):
            found.append(node.name)
    return found


_EXECUTING = re.compile(r"While executing %(\w+)")


def _nodes_of_error(exc: BaseException) -> list[str]:
    """Names of the FX nodes an error was raised while running: the node of
    an interpreter's ``run_node`` frame in the traceback (Inductor's
    lowering is one), or the ``While executing %name`` note FX adds."""
    names: list[str] = []
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_name == "run_node" and isinstance(frame.f_locals.get("n"), torch.fx.Node):
                names.append(frame.f_locals["n"].name)
            tb = tb.tb_next
        names += _EXECUTING.findall(str(e))
        e = e.__cause__ or e.__context__
    return list(dict.fromkeys(names))


def _failed_nodes(exc: BaseException, decomposed: torch.fx.GraphModule | None) -> list[str]:
    """The planned graph's node(s) an Inductor error names; a node of the
    decomposed graph is mapped back to the node it was decomposed from."""
    names = _nodes_of_error(exc)
    if decomposed is None:
        return names
    by_name = {n.name: n for n in decomposed.graph.nodes}
    out: list[str] = []
    for name in names:
        node = by_name.get(name)
        out += (torch_compat.source_node_names(node) if node is not None else []) or [name]
    return list(dict.fromkeys(out))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _module_paths(gm: torch.fx.GraphModule, names: list[str]) -> list[str]:
    by_name = {n.name: n for n in gm.graph.nodes}
    out = []
    for name in names:
        node = by_name.get(name)
        where = module_path(node) if node is not None else ""
        out.append(f"{name} ({where})" if where else name)
    return out


def compile_graph(gm: torch.fx.GraphModule, graph: str, settings: dict[str, Any]) -> tuple[Callable, GraphCompile]:
    """(callable, record) for one of the step's graphs: Inductor's, or the
    graph itself with an :class:`InductorFallbackWarning` when it fails."""
    t0 = time.perf_counter()
    record = GraphCompile(graph, len(gm.graph.nodes), compiled=False, seconds=0.0)
    decomposed = None
    try:
        example_inputs = [ph.meta.get("val") for ph in gm.graph.find_nodes(op="placeholder")]
        missing = [ph.name for ph, v in zip(gm.graph.find_nodes(op="placeholder"), example_inputs) if v is None]
        if missing:
            raise ValueError(f"placeholders without a fake value (node.meta['val']): {missing}")
        decomposed = torch_compat.inductor_decompose(gm, example_inputs)
        compiled = torch_compat.inductor_compile(
            decomposed, example_inputs, is_backward=graph == "backward", settings=settings
        )
    except Exception as exc:  # noqa: BLE001 - any failure: run this graph eagerly, say why
        record.seconds = time.perf_counter() - t0
        record.reason = _first_line(exc)
        record.failed_nodes = _failed_nodes(exc, decomposed)
        record.data_dependent_nodes = _data_dependent(gm)
        parts = [
            f"Inductor could not compile the {graph} graph ({record.nodes} nodes); it runs eagerly: {record.reason}"
        ]
        if record.failed_nodes:
            parts.append("failed on node(s): " + ", ".join(_module_paths(gm, record.failed_nodes)))
        if record.data_dependent_nodes:
            shown = _module_paths(gm, record.data_dependent_nodes[:10])
            parts.append("nodes with data-dependent sizes: " + ", ".join(shown))
        message = "; ".join(parts)
        logger.warning("%s", message, exc_info=logger.isEnabledFor(logging.DEBUG))
        warnings.warn(message, InductorFallbackWarning, stacklevel=3)
        return gm, record
    record.compiled = True
    record.seconds = time.perf_counter() - t0
    record.source_code = compiled.source_code
    if compiled.source_code is not None:
        planned = collective_sequence(gm)
        generated = compiled_collective_sequence(compiled.source_code)
        record.collective_order_kept = planned == generated
        if not record.collective_order_kept:
            logger.warning(
                "Inductor changed the order of the %s graph's collectives and waits: %s",
                graph,
                _first_difference(planned, generated),
            )
    return compiled.run, record


def compile_step(graphs: StepGraphs) -> CompiledStep:
    """Compile ``graphs.fw`` and ``graphs.bw`` (see the module docstring)."""
    settings = torch_compat.inductor_settings()
    fw, fw_record = compile_graph(graphs.fw, "forward", settings)
    bw, bw_record = compile_graph(graphs.bw, "backward", settings)
    step = CompiledStep(fw, bw, (fw_record, bw_record), settings)
    logger.info("Inductor compiled the step in %.1fs:\n%s", step.seconds, step.describe())
    return step
