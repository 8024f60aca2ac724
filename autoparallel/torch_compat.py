"""Every use of a private torch API that differs between the supported
releases (torch 2.11 to 2.15), in one place.

Each helper detects the feature it needs (an attribute, a keyword in a
signature) rather than comparing version strings, so a release that
back-ports or renames something takes the right branch by itself.
``docs/torch_compat.md`` lists every private API the project uses and what
happens on each supported release.

Functions the planner swaps into torch while it enumerates options
(:func:`swapped`) are installed only when they accept exactly the
parameters of the running torch's original (:func:`accepts_like`); otherwise
the original stays (slower, same options) and one log line says so. Every
swap is undone on exit, exceptions included.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.fx

logger = logging.getLogger(__name__)

TORCH_VERSION = torch.__version__

# Exceptions that mean "this code does not match the torch it runs on" (a
# renamed keyword, a removed attribute or module) or a plain bug, never "this
# layout is not supported": a rule raising one of them is an error, not a
# replicate fallback. DTensor signals an unsupported case with
# NotImplementedError (no rule), AssertionError / RuntimeError / ValueError
# (the rule rejects the input layouts) or by returning None.
CODE_ERRORS: tuple[type[BaseException], ...] = (TypeError, AttributeError, ImportError, NameError)


class RuleError(RuntimeError):
    """A sharding rule (the project's or DTensor's) failed with one of
    :data:`CODE_ERRORS`: a bug or a torch API this version lacks."""


def rule_error(op, node_name: str, rule: str, exc: BaseException) -> RuleError:
    return RuleError(
        f"the sharding rule {rule} for {op} (node {node_name}) raised {type(exc).__name__}: {exc} "
        f"(torch {TORCH_VERSION}). This is a bug in the rule or a torch API it uses that this torch "
        "release lacks, not an unsupported layout: report it with this message."
    )


# ---------------------------------------------------------------------------
# Logging a missing name once


_SAID: set = set()


def say_once(key, message: str, *args) -> None:
    """Log ``message`` at INFO the first time ``key`` is seen in this process."""
    if key not in _SAID:
        _SAID.add(key)
        logger.info(message, *args)


# ---------------------------------------------------------------------------
# Signature-checked swaps


@dataclass(frozen=True)
class Swap:
    """Set ``owner.name = replacement`` while a :func:`swapped` block runs."""

    owner: Any
    name: str
    replacement: Any


def _parameters(fn) -> list[tuple[str, Any, Any]] | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


_ACCEPTS: dict[tuple, str | None] = {}


def accepts_like(replacement, original) -> str | None:
    """None if ``replacement`` takes exactly the parameters of ``original``
    (names, kinds and defaults), else why not (memoised: swaps are checked
    on every enumeration call)."""
    try:
        return _ACCEPTS[(replacement, original)]
    except (KeyError, TypeError):
        pass
    why = _compare_parameters(replacement, original)
    with contextlib.suppress(TypeError):
        _ACCEPTS[(replacement, original)] = why
    return why


def _compare_parameters(replacement, original) -> str | None:
    mine, theirs = _parameters(replacement), _parameters(original)
    if mine is None or theirs is None:
        return "no signature to compare"
    if mine == theirs:
        return None
    names_mine = {n: (k, d) for n, k, d in mine}
    names_theirs = {n: (k, d) for n, k, d in theirs}
    missing = [n for n in names_theirs if n not in names_mine]
    extra = [n for n in names_mine if n not in names_theirs]
    differ = [n for n in names_theirs if n in names_mine and names_mine[n] != names_theirs[n]]
    parts = []
    if missing:
        parts.append(f"torch's takes {missing}, ours does not")
    if extra:
        parts.append(f"ours takes {extra}, torch's does not")
    if differ:
        parts.append(f"{differ} differ in kind or default")
    return "; ".join(parts) or "parameter order differs"


@contextlib.contextmanager
def swapped(swaps: list[Swap], *, what: str) -> Iterator[list[Swap]]:
    """Install each swap whose replacement accepts what the attribute it
    replaces accepts (attributes that are not functions, such as a class's
    ``__post_init__``, are compared the same way); restore every installed
    one on exit, also on an exception. Yields the swaps installed."""
    installed: list[tuple[Swap, Any]] = []
    try:
        for swap in swaps:
            original = getattr(swap.owner, swap.name)
            why = accepts_like(swap.replacement, original)
            if why is not None:
                say_once(
                    ("swap", getattr(swap.owner, "__name__", id(swap.owner)), swap.name, why),
                    "%s: not replacing %s.%s on torch %s (%s); torch's own runs (slower, same options)",
                    what,
                    getattr(swap.owner, "__name__", type(swap.owner).__name__),
                    swap.name,
                    TORCH_VERSION,
                    why,
                )
                continue
            installed.append((swap, original))
            setattr(swap.owner, swap.name, swap.replacement)
        yield [s for s, _ in installed]
    finally:
        for swap, original in reversed(installed):
            setattr(swap.owner, swap.name, original)


def modules_binding(original, name: str, prefix: str = "torch.distributed.tensor") -> list:
    """Loaded modules under ``prefix`` whose attribute ``name`` is ``original``
    (DTensor's rule modules bind helpers such as
    ``expand_to_full_mesh_op_strategy`` by name at import)."""
    import sys

    return [
        module
        for module_name, module in list(sys.modules.items())
        if module_name.startswith(prefix) and getattr(module, name, None) is original
    ]


def keyword_of(fn, *names: str) -> str | None:
    """The first of ``names`` that ``fn`` takes as a parameter, else None."""
    params = _parameters(fn) or []
    taken = {n for n, _, _ in params}
    return next((n for n in names if n in taken), None)


# ---------------------------------------------------------------------------
# DTensor placements and sharding propagation


def is_shard_like(placement) -> bool:
    """``Shard`` or ``_StridedShard`` (``placement_types._is_shard_like`` where
    torch has it; the same test otherwise)."""
    from torch.distributed.tensor import placement_types

    fn = getattr(placement_types, "_is_shard_like", None)
    if fn is not None:
        return fn(placement)
    return isinstance(placement, (placement_types.Shard, placement_types._StridedShard))


def strategy_function(strategy) -> Callable | None:
    """The function behind an entry of the propagator's
    ``op_single_dim_strategy_funcs`` (a function, or a record holding it in
    ``func``) or ``op_strategy_funcs``."""
    if strategy is None:
        return None
    fn = getattr(strategy, "func", strategy)
    return fn if callable(fn) else None


def qualified_name(fn) -> str:
    fn = strategy_function(fn) or fn
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def decomposition_strategy(propagator):
    """The propagator's ``decomp_strategy`` (sharding an op through its
    decomposition), or None where torch's propagator has none (logged once)."""
    found = getattr(propagator, "decomp_strategy", None)
    if found is None:
        say_once(
            "no decomp_strategy",
            "DTensor in torch %s has no decomposition strategies: ops without a rule of their own run replicated",
            TORCH_VERSION,
        )
    return found


def pointwise_ops_are_single_dim(propagator) -> bool:
    """Whether DTensor's pointwise ops are single-mesh-dim strategies (with
    the Partial placements each op preserves) rather than the older
    whole-mesh rule that follows the first input (see
    :mod:`autoparallel.options.pointwise`)."""
    return torch.ops.aten.mul.Tensor in propagator.op_single_dim_strategy_funcs


_POINTWISE_MODULE = "torch.distributed.tensor._ops._pointwise_ops"


def dtensor_pointwise_rule(propagator, op) -> Callable | None:
    """DTensor's whole-mesh pointwise strategy function for ``op``, or None
    where ``op``'s rule is another (or a list op: ``_foreach_*``,
    ``_fused_*``, whose lists the single-dim rules here do not handle)."""
    fn = strategy_function(propagator.op_strategy_funcs.get(op))
    if fn is None or getattr(fn, "__module__", None) != _POINTWISE_MODULE:
        return None
    if op.name().startswith(("aten::_foreach_", "aten::_amp_foreach_", "aten::_fused_")):
        return None
    return fn


def reduction_linearity_leaks() -> bool:
    """Whether DTensor's ``common_reduction_strategy`` lets one candidate
    whose Partial differs from the reduction (a ``P(avg)`` input of ``sum``)
    turn off the linear case for every later candidate; where it does, the
    planner calls the linear reduction rule once per candidate (see
    :func:`autoparallel.options.dtensor_query.per_candidate_reduction`)."""
    from torch.distributed.tensor._ops import _math_ops

    fn = getattr(_math_ops, "common_reduction_strategy", None)
    return fn is not None and "is_reduction_linear" not in fn.__code__.co_varnames


def scalar_shape_adjusters(propagator) -> dict:
    """``ShardingPropagator.op_to_scalar_shape_adjuster`` (ops whose scalar
    shape arguments are rewritten for the local shard); empty where torch
    has none."""
    return getattr(propagator, "op_to_scalar_shape_adjuster", None) or {}


def squeeze_dims_variants(propagator) -> dict:
    """``ShardingPropagator.squeeze_op_to_dims_variant``; empty where torch has none."""
    return getattr(propagator, "squeeze_op_to_dims_variant", None) or {}


# ---------------------------------------------------------------------------
# AOT partitioning


def is_opaque_node(node: torch.fx.Node) -> bool:
    """``partitioners.is_opaque_node`` (script objects such as a DeviceMesh
    saved for the backward); False where torch has no such notion."""
    from torch._functorch import partitioners

    fn = getattr(partitioners, "is_opaque_node", None)
    return bool(fn(node)) if fn is not None else False


def extract_fwd_bwd_modules(joint, saved: list, sym: list, opaque: list, *, num_fwd_outputs: int):
    """``partitioners._extract_fwd_bwd_modules``, passing the opaque saved
    nodes where torch takes them."""
    from torch._functorch.partitioners import _extract_fwd_bwd_modules

    kwargs: dict = {"num_fwd_outputs": num_fwd_outputs}
    if keyword_of(_extract_fwd_bwd_modules, "saved_opaque_nodes"):
        kwargs["saved_opaque_nodes"] = opaque
    elif opaque:
        raise RuntimeError(
            f"torch {TORCH_VERSION}'s partitioner cannot save opaque values for the backward "
            f"({[n.name for n in opaque]})"
        )
    return _extract_fwd_bwd_modules(joint, saved, sym, **kwargs)


def forward_backward_graphs(joint: Callable, primals: list, tangents: list, num_fwd_outputs: int):
    """``joint(primals, tangents)`` (returning the forward's
    ``num_fwd_outputs`` outputs, then the gradients of ``primals``) traced
    with ``make_fx`` on fake tensors and split by torch's default
    partitioner, as AOT autograd splits a joint graph: (forward graph:
    primals -> outputs + saved values, backward graph: saved values +
    tangents -> gradients). The forward is every node the outputs need
    (``partitioner_tag``, how AOT marks its forward nodes); the backward
    saves what autograd saved. Checked on 2.13."""
    from torch._functorch.partitioners import default_partition
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(joint, tracing_mode="fake")(primals, tangents)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    todo = [n for n in output.args[0][:num_fwd_outputs] if isinstance(n, torch.fx.Node)]
    forward: set[torch.fx.Node] = set()
    while todo:
        node = todo.pop()
        if node not in forward:
            forward.add(node)
            node.meta["partitioner_tag"] = "is_forward"
            todo.extend(node.all_input_nodes)
    return default_partition(gm, None, num_fwd_outputs=num_fwd_outputs)


def storage_key(t: torch.Tensor) -> Any:
    """A hashable key equal for tensors sharing storage (fake tensors too):
    ``torch.multiprocessing.reductions.StorageWeakRef``, as AOT autograd
    tells aliases apart. Checked on 2.13."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


# ---------------------------------------------------------------------------
# Process groups and simulated ranks


def current_ranks() -> list[int]:
    """The ranks this process runs: ``[dist.get_rank()]``, or under
    ``LocalTensorMode`` (where ``get_rank`` returns a per-rank int) every
    simulated rank."""
    rank = dist.get_rank()
    if isinstance(rank, int):
        return [rank]
    node = getattr(rank, "node", rank)
    local = getattr(node, "_local_ints", None)
    if isinstance(local, dict):
        return sorted(int(r) for r in local.values())
    constant = getattr(node, "maybe_as_int", None)
    value = constant() if callable(constant) else None
    return [int(value if value is not None else rank)]


def new_group_keeps_order() -> bool:
    """Whether ``dist.new_group`` can keep the ranks in the given order
    (``sort_ranks=False``)."""
    return keyword_of(dist.new_group, "sort_ranks") is not None


def new_group_in_order(ranks: list[int], group_desc: str):
    """A process group whose ranks are ``ranks`` in that order; raises where
    torch sorts them and they are not sorted (:func:`new_group_keeps_order`)."""
    if new_group_keeps_order():
        return dist.new_group(ranks, sort_ranks=False, group_desc=group_desc)
    if list(ranks) != sorted(ranks):
        raise RuntimeError(f"torch {TORCH_VERSION}'s new_group sorts its ranks; cannot make a group in order {ranks}")
    return dist.new_group(ranks, group_desc=group_desc)


def groups_of(group_name: str) -> list[list[int]]:
    """Every group of global ranks that the process group named
    ``group_name`` is one of (the group and its translations over the
    world: the groups LocalTensorMode runs side by side)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    ranks = sorted(dist.get_process_group_ranks(_resolve_process_group(group_name)))
    relative = [r - ranks[0] for r in ranks]
    world = dist.get_world_size()
    covered: set[int] = set()
    groups = []
    for start in range(world):
        if start in covered:
            continue
        members = [start + r for r in relative]
        if any(m >= world or m in covered for m in members):
            raise RuntimeError(f"process group {group_name} (ranks {ranks}) does not tile the {world} ranks")
        covered.update(members)
        groups.append(members)
    return groups


# ---------------------------------------------------------------------------
# FX graphs


def last_node(graph: torch.fx.Graph | None) -> torch.fx.Node | None:
    """The graph's last node (``reversed(graph.nodes)`` is an iterable, not an
    iterator, on some releases)."""
    if graph is None:
        return None
    return next(iter(reversed(graph.nodes)), None)


# Names the trampolines below read in _func_map's globals (their code runs as
# _local_map_wrapped's, whose globals are that module's).
_LOCAL_MAP_HANDLER = "_autoparallel_local_map_handler"
_LOCAL_MAP_REFUSAL = "_autoparallel_local_map_refusal"


def _local_map_trampoline(
    func, out_placements, in_placements, in_grad_placements, device_mesh, redistribute_inputs, *args, **kwargs
):
    return _autoparallel_local_map_handler(  # noqa: F821 (a global of _func_map while intercepted)
        func, out_placements, in_placements, in_grad_placements, device_mesh, redistribute_inputs, args, kwargs
    )


def _local_map_refusal_trampoline(*args, **kwargs):
    return _autoparallel_local_map_refusal(args)  # noqa: F821 (a global of _func_map while refusing)


def local_map_wrapper_problem(wrapped) -> str | None:
    """Why ``wrapped`` (torch's ``_func_map._local_map_wrapped``) cannot
    take the trampoline, or None when it can: the trampoline replaces its
    code, so it must have no closure and take (func, out_placements,
    in_placements, in_grad_placements, device_mesh, redistribute_inputs)."""
    if wrapped is None or not hasattr(wrapped, "__code__"):
        return "has no _func_map._local_map_wrapped function"
    code = wrapped.__code__
    if code.co_freevars:
        return "_local_map_wrapped is a closure"
    if code.co_argcount != 6:
        return f"_local_map_wrapped takes {code.co_argcount} positional parameters, not 6"
    return None


def _first_callable(args) -> Any:
    return next((a for a in args if callable(a)), None)


@contextlib.contextmanager
def _swapped_code(module, wrapped, code, global_name: str, value) -> Iterator[None]:
    original = wrapped.__code__
    previous = module.__dict__.get(global_name)
    module.__dict__[global_name] = value
    wrapped.__code__ = code
    try:
        yield
    finally:
        wrapped.__code__ = original
        if previous is None:
            module.__dict__.pop(global_name, None)
        else:
            module.__dict__[global_name] = previous


@contextlib.contextmanager
def _calls_into(filename: str, refuse: Callable[[Any], None]) -> Iterator[None]:
    """While open, a call of any Python function defined in ``filename``
    runs ``refuse(that call's func argument or None)`` first (which raises).
    A profile hook: slow, only for a wrapper whose code cannot be swapped."""
    import sys

    previous = sys.getprofile()

    def profile(frame, event, arg):
        if callable(previous):
            previous(frame, event, arg)
        if event == "call" and frame.f_code.co_filename == filename:
            refuse(frame.f_locals.get("func"))

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)


@contextlib.contextmanager
def intercept_local_map(handler: Callable, refuse: Callable[[Any, str], None]) -> Iterator[bool]:
    """While open, every call of a function wrapped by
    ``torch.distributed.tensor.experimental.local_map`` goes to
    ``handler(func, out_placements, in_placements, in_grad_placements,
    device_mesh, redistribute_inputs, args, kwargs)``; yields True.

    ``local_map`` returns ``functools.partial(_local_map_wrapped, func,
    ...)``, created whenever the user's module was imported, so the partial
    cannot be swapped: the wrapped function's code is, for the duration
    (torch 2.4-2.15 keep that signature). On plain (fake) tensors the
    wrapper would call ``func`` on global tensors, which silently computes
    something else than a body written for local shards; so where this
    torch's wrapper has another shape (:func:`local_map_wrapper_problem`),
    yields False and every local_map call while open runs ``refuse(func,
    why)`` instead (``func``: the user's function where it can be told,
    else None), which must raise. Without local_map calls nothing changes."""
    try:
        from torch.distributed.tensor.experimental import _func_map
    except ImportError:  # no local_map in this torch: nothing can call it
        yield False
        return
    wrapped = getattr(_func_map, "_local_map_wrapped", None)
    problem = local_map_wrapper_problem(wrapped)
    if problem is None:
        with _swapped_code(_func_map, wrapped, _local_map_trampoline.__code__, _LOCAL_MAP_HANDLER, handler):
            yield True
        return
    why = f"torch {TORCH_VERSION}'s local_map wrapper {problem}"
    logger.warning("%s: local_map regions are refused", why)
    if wrapped is not None and hasattr(wrapped, "__code__") and not wrapped.__code__.co_freevars:
        code = _local_map_refusal_trampoline.__code__
        with _swapped_code(
            _func_map, wrapped, code, _LOCAL_MAP_REFUSAL, lambda args: refuse(_first_callable(args), why)
        ):
            yield False
        return
    with _calls_into(_func_map.__file__, lambda func: refuse(func, why)):
        yield False


@contextlib.contextmanager
def outside_tracing() -> Iterator[None]:
    """Run code on fake tensors without it entering the graph being traced
    (no proxy, no functionalization), e.g. to learn a body's output shapes."""
    from torch._dispatch.python import suspend_functionalization
    from torch._subclasses.functional_tensor import disable_functional_mode
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with suspend_functionalization(), disable_functional_mode(), disable_proxy_modes_tracing():
        yield


@contextlib.contextmanager
def autograd_below_custom_op() -> Iterator[None]:
    """Record autograd again inside a custom op's implementation (which runs
    with the autograd dispatch keys excluded), e.g. to differentiate a body
    there. ``torch.func.vjp`` would do it too, but not on tensor subclasses
    without storage (LocalTensor)."""
    from torch._C import DispatchKey

    exclude = torch._C._dispatch_tls_local_exclude_set()
    exclude = exclude.remove(DispatchKey.AutogradFunctionality).remove(DispatchKey.ADInplaceOrView)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def memory_tracker():
    """torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, a
    private module): counts every tensor storage of a step by category, under
    ``FakeTensorMode`` too (benchmarks/memory_tracker.py). Checked on 2.13."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()


def tracker_peak(tracker, device: torch.device) -> tuple[int, dict[str, int]]:
    """(peak bytes, {category: bytes at that peak}) of ``tracker`` on
    ``device``; the categories are MemTracker's reference types by their
    names ("Parameter", "Gradient", "Optstate", "Activation", "Temp", ...)."""
    snap = tracker.get_tracker_snapshot("peak")
    mine = next((v for d, v in snap.items() if torch.device(d).type == device.type), {})
    total_key = "Total"
    return int(mine.get(total_key, 0)), {k: int(v) for k, v in mine.items() if k != total_key}


# ---------------------------------------------------------------------------
# Inductor (apply_placement(compile=True))

# Inductor settings that would change what the plan decided: its own
# reordering of collectives (compute/communication overlap, peak-memory and
# locality reordering, the aten-level overlap scheduler), its own bucketing
# of collectives, its fusion of TP matmuls with their collectives, and CUDA
# graph trees (the project's CUDA graphs capture the compiled step instead).
# Names per release differ: a key this torch lacks is skipped (logged once).
INDUCTOR_KEEP_PLAN: dict[str, Any] = {
    "reorder_for_compute_comm_overlap": False,
    "reorder_for_peak_memory": False,
    "reorder_for_locality": False,
    "bucket_all_gathers_fx": "none",
    "bucket_reduce_scatters_fx": "none",
    "bucket_all_reduces_fx": "none",
    "_micro_pipeline_tp": False,
    "_fuse_ddp_communication": False,
    "aten_distributed_optimizations.enable_overlap_scheduling": False,
    "triton.cudagraphs": False,
}


def inductor_settings(wanted: dict[str, Any] | None = None) -> dict[str, Any]:
    """``wanted`` (default :data:`INDUCTOR_KEEP_PLAN`) restricted to the
    keys ``torch._inductor.config`` of this torch has."""
    import torch._inductor.config as inductor_config

    out = {}
    for key, value in (INDUCTOR_KEEP_PLAN if wanted is None else wanted).items():
        obj = inductor_config
        *parents, last = key.split(".")
        for p in parents:
            obj = getattr(obj, p, None)
        if obj is not None and hasattr(obj, last):
            out[key] = value
        else:
            say_once(("inductor", key), "torch %s's Inductor has no setting %s: not set", TORCH_VERSION, key)
    return out


def inductor_decompose(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
    """``gm`` re-traced with Inductor's decompositions (what AOT autograd does
    before it hands a graph to Inductor), on the fake ``example_inputs``.
    Node meta (``custom``, stack traces, module stacks) is carried over."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        raise ValueError("the graph's example inputs are not fake tensors (no node.meta['val'] on its placeholders?)")
    with fake_mode, enable_python_dispatcher(), fx_traceback.preserve_node_meta():
        return make_fx(torch.fx.Interpreter(gm).run, decomposition_table=select_decomp_table())(*example_inputs)


@dataclass
class InductorGraph:
    """One graph compiled by Inductor: ``run(*args)`` returns its outputs."""

    run: Callable[..., Any]
    source_code: str | None  # the generated Python wrapper (None where torch does not keep it)


def inductor_compile(
    gm: torch.fx.GraphModule, example_inputs: list, *, is_backward: bool, settings: dict[str, Any]
) -> InductorGraph:
    """``compile_fx_inner`` on an already decomposed ATen graph (the call
    AOT autograd makes per partitioned graph), under ``settings`` (see
    :func:`inductor_settings`). Keyword arguments only: the positional ones
    after ``example_inputs`` changed between releases."""
    import torch._inductor.config as inductor_config
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor.compile_fx import compile_fx_inner

    fake_mode = detect_fake_mode(example_inputs)
    with tracing(TracingContext(fake_mode)), inductor_config.patch(settings):
        compiled = compile_fx_inner(gm, example_inputs, is_backward=is_backward, is_inference=False)

    def run(*args):
        # the compiled graph takes its inputs boxed, and empties the list to
        # free each input after its last use
        return compiled(list(args))

    return InductorGraph(run, getattr(compiled, "source_code", None))


def source_node_names(node: torch.fx.Node) -> list[str]:
    """Names of the nodes of the graph ``node`` was re-traced from
    (``meta["from_node"]`` where torch records it), else ``[]``."""
    sources = node.meta.get("from_node") or []
    names = []
    for src in sources:
        name = getattr(src, "name", None)
        if isinstance(name, str) and name not in names:
            names.append(name)
    return names


def clear_sharding_caches() -> None:
    """Forget DTensor's sharding-propagation caches (Python and C++ fast path)."""
    from torch.distributed.tensor.debug import _clear_fast_path_sharding_prop_cache, _clear_python_sharding_prop_cache

    _clear_python_sharding_prop_cache()
    _clear_fast_path_sharding_prop_cache()
