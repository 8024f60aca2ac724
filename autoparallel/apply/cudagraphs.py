"""CUDA graphs for the parallel step: the forward graph and the backward
graph each run as one captured CUDA graph after a warm-up step.

A sharded step launches thousands of small kernels and collectives; replaying
a captured graph pays one launch instead. What this module keeps from the
graph-capture designs it learns from (torchtitan's compiler-toolkit pass):

* one private memory pool and one side stream, shared by the forward and the
  backward graph: warm-up and capture run on that stream and allocate from
  that pool, so the two graphs reuse each other's free blocks and the eager
  allocator keeps none of the warm-up's memory;
* static inputs: parameters, unmutated buffers and the saved activations the
  backward reads keep their addresses from step to step and are not copied;
  every other input (the batch, mutated buffers, tangents, mesh coordinates)
  is copied into a buffer the graph owns (:func:`static_inputs` says which,
  and how many bytes a step copies);
* an output that is a static input, or a view of one (a parameter the
  forward saves for the backward as it is), is handed out by each replay as
  a view of the tensor passed in that step, not as the object captured: the
  captured one is a ``DTensor.to_local()`` view of an earlier step, which
  AdamW's CUDA foreach kernels have since marked modified in place (they
  bump its version counter), and autograd refuses to unpack such a view
  from the backward's saved tensors (:class:`InputAlias`);
* a check before every replay (on by default, cheap) that each static input
  still has the address it had at capture: a parameter reallocated by
  ``to_empty`` or ``load_state_dict(assign=True)`` would otherwise be read
  from its old memory, a silent wrong answer;
* a check that the previous step's outputs were released: the graph writes
  its outputs to the same memory on every replay, so a forward whose
  backward has not run, or gradients kept across steps (accumulation
  without ``zero_grad(set_to_none=True)``), is an error, not garbage;
* the forward's user-visible outputs (the loss) are cloned out of the pool,
  so a loss kept for logging is not overwritten by the next step;
* ops that cannot be captured (data-dependent sizes such as the expert-
  parallel all-to-all's splits, ``.item()``, host syncs, host-side RNG state)
  are found before anything runs and named by node and module path
  (:func:`uncapturable_nodes`); the option is then refused;
* the graphs are released before the process group goes away (a captured
  NCCL collective alive at ``destroy_process_group`` hangs): call
  :func:`release_cuda_graphs` (or the parallel module's
  ``release_cuda_graphs()``) before ``destroy_process_group()``; scripts that
  never destroy it get the release at exit.

NCCL: with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` set
``NCCL_GRAPH_REGISTER=0`` (NCCL's graph registration and expandable segments
make illegal memory accesses); the first capture warns when it is missing.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.fx

from .redistribute import ApplyError

logger = logging.getLogger(__name__)


class CudaGraphError(ApplyError):
    """CUDA graphs were asked for where they cannot run, or a captured step
    was called in a way that would read or write the wrong memory."""


# -- which inputs keep their addresses -------------------------------------------


@dataclass(frozen=True)
class GraphInput:
    """One placeholder of the forward or backward graph, as the graph sees it."""

    position: int
    name: str  # the placeholder's name
    role: str  # parameter, buffer, mutated buffer, input, mesh coordinates, saved, tangent
    what: str  # FQN, input index or saved-value index, for messages
    static: bool  # keeps its address from step to step: not copied
    nbytes: int


@dataclass(frozen=True)
class StaticInputs:
    """Per graph, which inputs keep their addresses and what a step copies."""

    forward: tuple[GraphInput, ...]
    backward: tuple[GraphInput, ...]

    def of(self, graph: str) -> tuple[GraphInput, ...]:
        return {"forward": self.forward, "backward": self.backward}[graph]

    def static_mask(self, graph: str) -> list[bool]:
        return [i.static for i in self.of(graph)]

    def copied_bytes(self, graph: str) -> int:
        return sum(i.nbytes for i in self.of(graph) if not i.static)

    def describe(self) -> str:
        lines = []
        for graph in ("forward", "backward"):
            inputs = self.of(graph)
            copied = [i for i in inputs if not i.static]
            lines.append(
                f"{graph}: {len(inputs) - len(copied)} of {len(inputs)} inputs static, "
                f"{len(copied)} copied per step ({_bytes(self.copied_bytes(graph))}"
                + (": " + ", ".join(f"{i.role} {i.what}" for i in copied[:6]) if copied else "")
                + (", ..." if len(copied) > 6 else "")
                + ")"
            )
        return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    return 0


def static_inputs(local, graphs) -> StaticInputs:
    """Classify the placeholders of ``graphs.fw`` and ``graphs.bw``
    (:class:`~.partition.StepGraphs` of the rank-local joint ``local``).

    Forward inputs are the step's primals in order: parameters, buffers,
    user tensor inputs, this rank's mesh coordinates. Parameters keep their
    storage (the optimizer updates them in place); buffers too, except those
    the step mutates, which the module hands over as a fresh copy. Backward
    inputs are saved values, outputs of the captured forward (so they live at
    the forward graph's fixed output addresses, or alias a static forward
    input), and tangents, which autograd allocates each step.
    """
    fw_ph = list(graphs.fw.graph.find_nodes(op="placeholder"))
    n_p, n_b, n_i = len(local.param_fqns), len(local.buffer_fqns), len(local.input_specs)
    if len(fw_ph) != n_p + n_b + n_i + 1:
        raise CudaGraphError(
            f"the forward graph has {len(fw_ph)} inputs but the step passes {n_p + n_b + n_i + 1} "
            "(parameters, buffers, inputs, mesh coordinates): cannot tell which keep their addresses"
        )
    mutated = {target for kind, target in local.mutations if kind == "buffer"}
    forward = []
    for k, ph in enumerate(fw_ph):
        if k < n_p:
            role, what, static = "parameter", local.param_fqns[k], True
        elif k < n_p + n_b:
            fqn = local.buffer_fqns[k - n_p]
            role, what, static = ("mutated buffer", fqn, False) if fqn in mutated else ("buffer", fqn, True)
        elif k < n_p + n_b + n_i:
            role, what, static = "input", f"#{k - n_p - n_b}", False
        else:
            role, what, static = "mesh coordinates", "", False
        forward.append(GraphInput(k, ph.name, role, what, static, _nbytes(ph)))
    bw_ph = list(graphs.bw.graph.find_nodes(op="placeholder"))
    if len(bw_ph) != len(graphs.bw_inputs):
        raise CudaGraphError(f"the backward graph has {len(bw_ph)} inputs, the step records {len(graphs.bw_inputs)}")
    backward = []
    for k, (ph, (kind, j)) in enumerate(zip(bw_ph, graphs.bw_inputs)):
        if kind == "saved":
            backward.append(GraphInput(k, ph.name, "saved", f"#{j}", True, _nbytes(ph)))
        else:
            backward.append(GraphInput(k, ph.name, "tangent", f"#{j}", False, _nbytes(ph)))
    return StaticInputs(tuple(forward), tuple(backward))


# -- what cannot be captured ---------------------------------------------------------


@dataclass(frozen=True)
class Uncapturable:
    """A node a CUDA graph cannot hold, with why."""

    graph: str
    node: str
    op: str
    module_path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.graph} {self.node} ({self.op}) in {self.module_path}: {self.reason}"


_aten = torch.ops.aten
# Ops whose output size depends on tensor data, or that read a tensor on the host.
_HOST_SYNC = {
    "_local_scalar_dense": "reads a tensor value on the host (.item())",
    "item": "reads a tensor value on the host (.item())",
    "nonzero": "output size depends on the data",
    "masked_select": "output size depends on the data",
    "unique": "output size depends on the data",
    "_unique": "output size depends on the data",
    "_unique2": "output size depends on the data",
    "unique_consecutive": "output size depends on the data",
    "unique_dim": "output size depends on the data",
    "equal": "returns a host bool (syncs)",
    "is_nonzero": "returns a host bool (syncs)",
    "allclose": "returns a host bool (syncs)",
}
_RNG_ON_HOST = ("run_and_save_rng_state", "run_with_rng_state")
# The project's own custom ops (``torch.ops.autoparallel.*``) that route
# tokens with data-dependent sizes or read routing counts on the host.
_ROUTING = "routes tokens to experts with data-dependent sizes (per-expert token lists)"
_EXCHANGE = "all-to-all whose split sizes are token counts read on the host"
_PROJECT_OPS = {
    "moe_experts": _ROUTING,
    "moe_experts_backward": _ROUTING,
    "moe_experts_a2a": _EXCHANGE,
    "moe_experts_a2a_backward": _EXCHANGE,
    "moe_a2a_exchange": _EXCHANGE,
    "moe_a2a_expert_rows": _ROUTING,
    "moe_a2a_expert_rows_backward": _ROUTING,
}


def _op_name(target) -> str:
    name = getattr(target, "__name__", None) or str(target)
    return name


def _packet_name(target) -> str:
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", "") if packet is not None else getattr(target, "__name__", "")


def _has_unbacked_sizes(val) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    vals = val if isinstance(val, (list, tuple)) else [val]
    for v in vals:
        if isinstance(v, torch.Tensor) and free_unbacked_symbols(v):
            return True
        if isinstance(v, torch.SymInt) and free_unbacked_symbols(v):
            return True
    return False


def uncapturable_nodes(graphs) -> list[Uncapturable]:
    """Nodes of the forward and backward graphs that a CUDA graph cannot
    capture: data-dependent sizes (unbacked symbolic sizes, e.g. the
    expert-parallel all-to-all's token counts), host syncs, RNG state read
    or restored on the host."""
    from ..capture.tracing import module_path

    found = []
    for name, gm in (("forward", graphs.fw), ("backward", graphs.bw)):
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            reason = None
            packet = _packet_name(node.target)
            namespace = getattr(node.target, "namespace", None)
            if namespace == "autoparallel" and packet in _PROJECT_OPS:
                reason = _PROJECT_OPS[packet]
            elif namespace == "aten" and packet in _HOST_SYNC:
                reason = _HOST_SYNC[packet]
            elif _op_name(node.target) in _RNG_ON_HOST:
                reason = "saves or restores the RNG state on the host (a recomputed random op)"
            elif _has_unbacked_sizes(node.meta.get("val")):
                reason = "output size depends on the data (unbacked symbolic size)"
            if reason is not None:
                where = module_path(node) or "<top level>"
                found.append(Uncapturable(name, node.name, _op_name(node.target), where, reason))
    return found


def check_capturable(graphs, *, cuda_available: bool | None = None) -> None:
    """Raise :class:`CudaGraphError` where the step cannot run as CUDA graphs."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        raise CudaGraphError(
            "cudagraphs=True needs a CUDA device, and none is available here (CUDA graphs do not run on "
            "CPU): apply with cudagraphs=False"
        )
    bad = uncapturable_nodes(graphs)
    if bad:
        shown = "\n  ".join(str(b) for b in bad[:20])
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise CudaGraphError(
            f"cudagraphs=True: {len(bad)} node(s) of the step cannot be captured in a CUDA graph:\n  "
            f"{shown}{more}\napply with cudagraphs=False (the graphs are not split around such ops)"
        )


# -- capture and replay ---------------------------------------------------------------

_SESSIONS: "weakref.WeakSet[CudaGraphSession]" = weakref.WeakSet()


def release_cuda_graphs() -> int:
    """Release every captured CUDA graph of this process (their memory pool,
    static buffers and outputs). Call it before
    ``torch.distributed.destroy_process_group()``: a captured NCCL
    collective still alive then hangs. Returns how many sessions held graphs.
    A released module captures again on its next step."""
    released = 0
    for session in list(_SESSIONS):
        if session.release():
            released += 1
    return released


atexit.register(release_cuda_graphs)


def _uses(t: torch.Tensor) -> tuple[int, int]:
    """References to the tensor and to its memory: one more of either than
    right after capture means something outside the graph still holds it (a
    ``save_for_backward``, a gradient, a view). Private torch counters (torch's
    own CUDA-graph trees read the storage one the same way)."""
    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@contextlib.contextmanager
def _allocate_in_pool(device: torch.device, pool, stream: torch.cuda.Stream):
    """Allocations on ``stream`` come from ``pool`` (the warm-up's memory
    then belongs to the graphs' pool, not the eager allocator)."""
    try:
        from torch._inductor.cudagraph_trees import _use_cuda_memory_pool_manager
    except ImportError:  # an older or newer torch without it: warm up in the eager pool
        logger.info("CUDA graphs: warm-up allocates from the eager pool (no pool manager in this torch)")
        with torch.cuda.stream(stream):
            yield
        return
    with _use_cuda_memory_pool_manager(device.index or 0, pool, stream):
        yield


def _warn_nccl_settings() -> None:
    alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in alloc and os.environ.get("NCCL_GRAPH_REGISTER") != "0":
        logger.warning(
            "CUDA graphs with expandable segments: set NCCL_GRAPH_REGISTER=0 (NCCL's graph memory registration "
            "and expandable segments make illegal memory accesses)"
        )


class CudaGraphSession:
    """The pool, stream and the two graphs of one parallel module.

    The device work is in four methods (:meth:`check_device`,
    :meth:`ensure_pool`, :meth:`warm_up`, :meth:`capture`); everything else
    (which buffers are copied, what the replay returns, the address and
    release checks) is tensor bookkeeping that :class:`GraphedCall` does the
    same way whatever captures the graph. A stand-in that overrides the four
    to run the step eagerly drives that bookkeeping on CPU."""

    device_type = "cuda"

    def __init__(self, inputs: StaticInputs, *, check_addresses: bool = True):
        self.inputs = inputs
        self.check_addresses = check_addresses
        self.forward = GraphedCall("forward", inputs.static_mask("forward"), self, inputs.forward)
        self.backward = GraphedCall("backward", inputs.static_mask("backward"), self, inputs.backward)
        self.pool = None
        self.stream: torch.cuda.Stream | None = None
        self._pool_anchor: torch.cuda.CUDAGraph | None = None
        _SESSIONS.add(self)

    def check_device(self, device: torch.device | None, graph: str) -> None:
        if device is None or device.type != self.device_type:
            raise CudaGraphError(
                f"cudagraphs=True: the {graph} step's tensors are on {device}, not a CUDA device: move the "
                "module there first (model.to_empty(device='cuda'))"
            )

    def ensure_pool(self, device: torch.device) -> None:
        if self.pool is not None:
            return
        _warn_nccl_settings()
        self.stream = torch.cuda.Stream(device=device)
        self.pool = torch.cuda.graph_pool_handle()
        # The pool exists once a capture used it: an empty capture creates it,
        # so the warm-up can allocate from it before the first real capture.
        self._pool_anchor = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._pool_anchor, pool=self.pool, stream=self.stream):
            pass

    @contextlib.contextmanager
    def warm_up(self, device: torch.device):
        """The eager warm-up step: on the graphs' stream, from their pool."""
        torch.cuda.synchronize(device)
        with _allocate_in_pool(device, self.pool, self.stream):
            yield
        torch.cuda.synchronize(device)

    def capture(self, fn: Callable, buffers: Sequence[torch.Tensor], device: torch.device):
        """Capture ``fn(*buffers)``: the graph (``replay()``, ``reset()``)
        and its outputs, which every replay overwrites in place."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(device)
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            outs = tuple(fn(*buffers))
        torch.cuda.synchronize(device)
        return graph, outs

    def release(self) -> bool:
        held = self.forward.release() | self.backward.release() | (self.pool is not None)
        self._pool_anchor = None
        self.pool = None
        self.stream = None
        return held


@dataclass(frozen=True)
class InputAlias:
    """A captured output whose memory is a static input's: a parameter (or a
    view of one) that the forward hands to the backward as a saved value.

    The replay returns it as a view of the tensor the caller passes this
    step, never as the tensor object captured a step earlier: that object is
    a view (``DTensor.to_local``) whose base the optimizer has since updated
    in place, and autograd refuses to unpack such a view from a backward's
    saved tensors. Same memory, a view made this step."""

    input: int  # the static input's position
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    whole: bool  # the output is the input itself

    def of(self, args: Sequence[torch.Tensor]) -> torch.Tensor:
        arg = args[self.input]
        if self.whole:
            return arg
        return arg.as_strided(self.size, self.stride, self.storage_offset)


def _input_aliases(outs: Sequence, buffers: Sequence, static: Sequence[bool]) -> list[InputAlias | None]:
    storage_of = {}
    for k, (b, s) in enumerate(zip(buffers, static)):
        ptr = b.untyped_storage().data_ptr()
        if s and ptr:  # an empty tensor's null pointer aliases nothing
            storage_of.setdefault(ptr, k)
    aliases = []
    for o in outs:
        k = storage_of.get(o.untyped_storage().data_ptr()) if isinstance(o, torch.Tensor) else None
        if k is None:
            aliases.append(None)
        else:
            whole = o is buffers[k]
            aliases.append(InputAlias(k, tuple(o.shape), tuple(o.stride()), o.storage_offset(), whole))
    return aliases


class GraphedCall:
    """One of the step's graphs: eager warm-up on the first call, capture on
    the second, replay after that."""

    def __init__(self, name: str, static: Sequence[bool], session: CudaGraphSession, described=()):
        self.name = name
        self.static = list(static)
        self.session = session
        self.described = list(described)
        self.graph = None  # the captured graph (torch.cuda.CUDAGraph): replay(), reset()
        self.warmed_up = False
        self.args: list | None = None  # the graph's input buffers (static ones: the caller's tensors at capture)
        self.outputs: tuple | None = None
        self.aliases: list[InputAlias | None] = []  # per output: the static input whose memory it is
        self.addresses: list[int | None] = []
        self.output_uses: list[tuple[int, int] | None] = []  # (tensor, memory) uses right after capture
        self.copied_bytes = 0

    def release(self) -> bool:
        held = self.graph is not None
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.args, self.outputs, self.warmed_up = None, None, None, False
        self.aliases = []
        return held

    def __call__(self, fn: Callable, args: Sequence) -> tuple:
        if len(args) != len(self.static):
            raise CudaGraphError(f"{self.name} graph called with {len(args)} inputs, captured for {len(self.static)}")
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        session = self.session
        session.check_device(device, self.name)
        session.ensure_pool(device)
        if not self.warmed_up:
            with session.warm_up(device):
                outs = fn(*args)
            self.warmed_up = True
            return tuple(outs)
        if self.graph is None:
            return self._capture(fn, args, device)
        return self._replay(args)

    def _capture(self, fn: Callable, args: Sequence, device) -> tuple:
        buffers = []
        for k, (a, static) in enumerate(zip(args, self.static)):
            if not isinstance(a, torch.Tensor):
                raise CudaGraphError(
                    f"{self.name} graph input {self._label(k)} is a {type(a).__name__}, not a tensor: "
                    "it cannot be captured"
                )
            buffers.append(a if static else a.detach().clone())
        self.copied_bytes = sum(b.numel() * b.element_size() for b, s in zip(buffers, self.static) if not s)
        graph, outs = self.session.capture(fn, buffers, device)
        self.graph, self.args, self.outputs = graph, buffers, outs
        self.addresses = [b.data_ptr() if s else None for b, s in zip(buffers, self.static)]
        # An output that is (a view of) a static input (a parameter saved for
        # backward) lives outside the pool: nothing overwrites it, nothing to
        # check; each replay hands out a view of that step's input instead.
        self.aliases = _input_aliases(outs, buffers, self.static)
        self.output_uses = [
            _uses(o) if isinstance(o, torch.Tensor) and alias is None else None for o, alias in zip(outs, self.aliases)
        ]
        logger.info(
            "CUDA graph captured (%s): %d inputs static, %d copied per step (%s), %d outputs alias static inputs",
            self.name,
            sum(self.static),
            len(self.static) - sum(self.static),
            _bytes(self.copied_bytes),
            sum(a is not None for a in self.aliases),
        )
        graph.replay()
        return outs

    def _replay(self, args: Sequence) -> tuple:
        if self.session.check_addresses:
            for k, (a, addr) in enumerate(zip(args, self.addresses)):
                if addr is not None and a.data_ptr() != addr:
                    raise CudaGraphError(
                        f"{self.name} graph: static input {self._label(k)} moved since capture (it was at "
                        f"{addr:#x}, now {a.data_ptr():#x}; reallocated by to_empty or load_state_dict(assign=True)?): "
                        "call model.release_cuda_graphs() after changing parameters' storage"
                    )
        for k, (o, uses) in enumerate(zip(self.outputs, self.output_uses)):
            if uses is not None and any(now > then for now, then in zip(_uses(o), uses)):
                raise CudaGraphError(
                    f"{self.name} graph: output {k} of the previous step is still referenced and would be "
                    "overwritten"
                    + (
                        " (gradients kept across steps: call optimizer.zero_grad(set_to_none=True) every step; "
                        "gradient accumulation needs cudagraphs=False)"
                        if self.name == "backward"
                        else " (a forward whose backward has not run: run backward before the next forward)"
                    )
                )
        with torch.no_grad():
            for buf, a, static in zip(self.args, args, self.static):
                if not static:
                    buf.copy_(a)
        self.graph.replay()
        return tuple(
            o if alias is None else alias.of(args) for o, alias in zip(self.outputs, self.aliases, strict=True)
        )

    def _label(self, k: int) -> str:
        if k < len(self.described):
            d = self.described[k]
            return f"{d.role} {d.what}".strip()
        return f"#{k}"
