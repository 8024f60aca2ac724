"""Stage 2: placement options for every node of the joint graph.

An :class:`Option` of a node is one DTensor sharding of the op: the specs its
tensor inputs must have and the spec(s) of its output. Options come from
PyTorch's own DTensor sharding propagation (strategy functions, single-mesh-dim
strategies expanded over the mesh, decomposition-based strategies), called
with every candidate placement of every input at once. Rules DTensor lacks,
or that a user wants to override, go in :data:`RULES` via
:func:`register_rule`. Ops without any rule, or whose DTensor rule rejects
the case (NotImplementedError, or an assertion / RuntimeError / ValueError
on the input layouts), fall back to replicate-only (every input gathered, the op run in full on
every rank: correct for any deterministic op), with one warning listing
them, why, and their module paths. A rule raising one of
:data:`~autoparallel.torch_compat.CODE_ERRORS` (TypeError, AttributeError,
ImportError, NameError: a bug, or a torch API this release lacks) is a
:class:`~autoparallel.torch_compat.RuleError` naming the op, the rule and
the torch version.

Options that shard a tensor dim unevenly, or use ``_StridedShard``, are
dropped at planning time so that planning and apply always agree
(``_StridedShard(d, split_factor=1)`` is read as the ``Shard(d)`` it is;
:data:`EXTRA_RULES` add options to DTensor's where it lacks a plain
layout, such as the flatten views of :mod:`.rules.flat_views`). One
exception: a parameter on a 2-D mesh may also be sharded on one tensor dim
over both mesh dims tp-outer (``_StridedShard(d, tp), Shard(d)``, FSDP2 +
TP's layout, :func:`~autoparallel.cost_model.tp_outer_placements`), where
gathering it over dp is one all-gather that leaves the tp shard. Only the
placeholder offers it; every consumer takes a plain layout, reached through
a redistribution on the edge.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Replicate

from ..graph_vocab import module_path
from ..torch_compat import CODE_ERRORS, qualified_name, rule_error
from .dtensor_query import (
    node_out_meta,
    propagator,
    dtensor_rule_name,
    dtensor_strategy_for,
    single_dim_rule,
)
from .cache_keys import arg_key, val_key
from .candidate_memo import PerCandidateOptions
from .fast_expand import fast_expansion
from .conversion import (  # noqa: F401 - SpecPool: imported from here by rules
    OpSpecConverter,
    SpecPool,
    for_each_output,
    options_from_op_strategy,
    out_placements_ok,
    pooled_output,
)

from .rule_registry import (  # noqa: F401 - imported from here by rules and users
    EXTRA_RULES,
    RULES,
    RuleFn,
    register_extra_rule,
    register_rule,
)

# the placement helpers moved to .placements; imported from here by rules and users
from .placements import (  # noqa: F401
    InOpWork,
    Option,
    Specs,
    all_placements,
    format_specs,
    is_evenly_sharded,
    option_label,
    placements_of,
    tensor_meta_of,
    tp_outer_placements,
)

logger = logging.getLogger(__name__)


@dataclass
class NodeStrategy:
    node: torch.fx.Node
    inputs: list[torch.fx.Node]
    options: list[Option]
    # How the options were obtained: "dtensor", "rule", "placeholder",
    # "factory", "getitem", "fallback".
    source: str = "dtensor"
    # For getitem nodes: which element of the parent's output tuple. The
    # parent is then ``inputs[0]`` and options carry no input specs.
    getitem_index: int | None = None


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The node's tensor-valued inputs, flattened in argument order (dups kept)."""
    nodes: list[torch.fx.Node] = []
    _collect_nodes(node.args, nodes)
    _collect_nodes(node.kwargs, nodes)
    return [a for a in nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _collect_nodes(a, out: list) -> None:
    """The fx Nodes in FX arguments, in pytree leaf order (tuples, lists
    and dicts in insertion order: all FX arguments hold); ~4x faster than
    ``tree_leaves`` (tens of thousands of nodes on an 80-layer graph)."""
    if isinstance(a, torch.fx.Node):
        out.append(a)
    elif isinstance(a, (tuple, list)):
        for x in a:
            _collect_nodes(x, out)
    elif isinstance(a, dict):
        for x in a.values():
            _collect_nodes(x, out)


def _spec(mesh: DeviceMesh, placements, meta: TensorMeta) -> DTensorSpec:
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


def placeholder_options(val: torch.Tensor, mesh: DeviceMesh, *, parameter: bool = False) -> list[Option]:
    """Every even layout of a graph input; a ``parameter`` also gets the
    tp-outer layouts of :func:`tp_outer_placements` (after the others)."""
    meta = tensor_meta_of(val)
    placements = all_placements(val.shape, mesh)
    if parameter:
        placements += tp_outer_placements(val.shape, mesh)
    return [Option(_spec(mesh, p, meta), ()) for p in placements]


def replicate_options(node: torch.fx.Node, inputs: list[torch.fx.Node], mesh: DeviceMesh) -> list[Option]:
    rep = tuple(Replicate() for _ in range(mesh.ndim))
    out_meta = node_out_meta(node)

    def out(meta):
        if isinstance(meta, TensorMeta):
            return DTensorSpec(mesh, rep, tensor_meta=meta)
        if isinstance(meta, tuple):
            return tuple(out(m) for m in meta)
        return None

    ins = tuple(_spec(mesh, rep, tensor_meta_of(n.meta["val"])) for n in inputs)
    return [Option(out(out_meta), ins)]


# --------------------------------------------------------------------------
# Rules DTensor does not have (or that the graph needs differently).


# --------------------------------------------------------------------------


@dataclass
class StrategyStats:
    nodes: int = 0
    options: int = 0
    # Option lists actually computed (DTensor, rules, fallback); every other
    # node reuses one of them.
    computed: int = 0
    cache_hits: int = 0
    # Nodes run replicate-only for want of a usable rule: op -> count, and
    # op -> (why, module paths of its nodes).
    fallback_ops: dict[str, int] = field(default_factory=dict)
    fallback_nodes: dict[str, tuple[str, list[str]]] = field(default_factory=dict)

    def fallback_warning(self) -> str:
        """One message naming every replicate-only op, why, and where."""
        parts = []
        for op, count in sorted(self.fallback_ops.items()):
            why, paths = self.fallback_nodes[op]
            where = sorted(set(paths))
            shown = ", ".join(where[:6]) + (f" and {len(where) - 6} more" if len(where) > 6 else "")
            parts.append(f"{op} x{count} ({why}) in {shown}")
        return (
            f"{len(self.fallback_ops)} op(s) have no usable sharding rule and run replicated (correct, "
            f"but every rank computes them in full): "
            + "; ".join(parts)
            + ". Register a rule with autoparallel.options.strategies.register_rule."
        )


class StrategyEnumerator:
    """Computes :class:`NodeStrategy` for all nodes, caching by structure.

    Nodes of repeated layers have the same op, shapes and input candidate
    sets, so their options are computed once (the cache key is built from
    those, not from node identity).
    """

    def __init__(self, mesh: DeviceMesh, *, share: bool = True):
        """``share``: key single-mesh-dim ops on their inputs' metas (not
        their candidate sets) and convert each candidate of a view-like op
        once (:mod:`.candidate_memo`); False computes every distinct
        candidate set from scratch (the reference the tests compare with)."""
        self.mesh = mesh
        self.share = share
        self._cache: dict[Any, tuple[list[Option], str]] = {}
        self._pool = SpecPool(mesh)
        self._per_candidate = PerCandidateOptions(self._pool) if share else None
        self._interned: dict[Any, int] = {}
        # id(option list) -> (distinct output specs, their interned id, the
        # list): what a node offers its consumers, computed once per list.
        self._produced: dict[int, tuple[tuple, int, list[Option]]] = {}
        # Options of multi-output nodes, for their getitem users.
        self._multi_output_options: dict[torch.fx.Node, list[Option]] = {}
        # op -> why it fell back to replicate-only (for the warning)
        self._fallback_why: dict[str, str] = {}
        self.stats = StrategyStats()

    def _placeholder_options(self, val: torch.Tensor, parameter: bool) -> list[Option]:
        # One list per shape: the same parameter in every layer then shares
        # one option list, which is what downstream caches key on.
        key = ("placeholder", val_key(val), parameter)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = (placeholder_options(val, self.mesh, parameter=parameter), "placeholder")
        return hit[0]

    def _offered(self, options: list[Option]) -> tuple[tuple, int]:
        """Distinct output specs of ``options`` and an id equal for equal sets."""
        hit = self._produced.get(id(options))
        if hit is None:
            specs = _dedup(o.output_specs for o in options)
            hit = (specs, self._interned.setdefault(specs, len(self._interned)), options)
            self._produced[id(options)] = hit
        return hit[0], hit[1]

    def enumerate(
        self, gm: torch.fx.GraphModule, parameters: frozenset[torch.fx.Node] | set = frozenset()
    ) -> dict[torch.fx.Node, NodeStrategy]:
        """Options of every tensor node of ``gm``; the placeholders in
        ``parameters`` also get the tp-outer layouts."""
        result: dict[torch.fx.Node, NodeStrategy] = {}
        # Distinct output specs each tensor node can produce, and their id.
        produced: dict[torch.fx.Node, tuple[tuple[DTensorSpec, ...], int]] = {}
        total, t0 = len(gm.graph.nodes), time.perf_counter()
        last = t0
        with fast_expansion():
            self._enumerate_nodes(gm, parameters, result, produced, total, t0, last)
        if self.stats.fallback_ops:
            logger.warning("%s", self.stats.fallback_warning())
        return result

    def _enumerate_nodes(self, gm, parameters, result, produced, total, t0, last) -> None:
        for node in gm.graph.nodes:
            if node.op == "output":
                continue
            if time.perf_counter() - last >= 5.0:  # progress on big meshes
                last = time.perf_counter()
                logger.info(
                    "options: %d/%d nodes, %d options, %d lists computed after %.0fs",
                    self.stats.nodes,
                    total,
                    self.stats.options,
                    self.stats.computed,
                    last - t0,
                )
            val = node.meta.get("val")
            if node.op == "placeholder":
                if not isinstance(val, torch.Tensor):
                    continue
                options = self._placeholder_options(val, node in parameters)
                result[node] = NodeStrategy(node, [], options, "placeholder")
            elif node.op == "call_function":
                if not _produces_tensors(val):
                    continue
                result[node] = self._node_strategy(node, produced)
            else:
                raise NotImplementedError(f"unsupported node kind {node.op} ({node.name})")
            self.stats.nodes += 1
            self.stats.options += len(result[node].options)
            if isinstance(val, torch.Tensor):
                produced[node] = self._offered(result[node].options)

    def _node_strategy(self, node, produced) -> NodeStrategy:
        inputs = tensor_inputs(node)
        if node.target is operator.getitem:
            # Options are the distinct specs the parent's options give this
            # element; the edge from the parent forbids mismatched pairs.
            parent, idx = node.args
            parent_options = self._multi_output_options[parent]
            key = ("getitem", id(parent_options), idx)
            hit = self._cache.get(key)
            if hit is None:
                specs = _dedup(o.output_specs[idx] for o in parent_options)
                hit = self._cache[key] = ([Option(s, ()) for s in specs], "getitem")
            return NodeStrategy(node, [parent], hit[0], "getitem", getitem_index=idx)
        candidates = [produced[n][0] for n in inputs]
        if self.share and _candidate_free(node.target):
            # DTensor sees one representative spec per input (its meta): the
            # options depend on the inputs' metas, not their candidate sets
            # (which differ between layers fed by different producers).
            inputs_key = ("metas", tuple(val_key(n.meta["val"]) for n in inputs), tuple(map(inputs.index, inputs)))
        else:
            inputs_key = tuple(produced[n][1] for n in inputs)
        key = (
            node.target,
            arg_key(node.args),
            arg_key(node.kwargs),
            val_key(node.meta.get("val")),
            inputs_key,
        )
        hit = self._cache.get(key)
        if hit is not None:
            self.stats.cache_hits += 1
            opts, source = hit
        else:
            opts, source = self._compute(node, inputs, candidates)
            if not isinstance(node.meta.get("val"), torch.Tensor):
                opts = self._every_output_specified(node, opts)
            self._cache[key] = (opts, source)
            self.stats.computed += 1
        if source == "fallback":
            name = str(node.target)
            self.stats.fallback_ops[name] = self.stats.fallback_ops.get(name, 0) + 1
            why, paths = self.stats.fallback_nodes.setdefault(name, (self._fallback_why.get(name, "no rule"), []))
            paths.append(_module_path(node))
        strat = NodeStrategy(node, inputs, opts, source)
        if not isinstance(node.meta.get("val"), torch.Tensor):
            self._multi_output_options[node] = opts
        return strat

    def _compute(self, node, inputs, candidates) -> tuple[list[Option], str]:
        op = node.target
        if op in RULES:
            try:
                return RULES[op](node, candidates, self.mesh), "rule"
            except CODE_ERRORS as e:
                raise rule_error(op, node.name, qualified_name(RULES[op]), e) from e
        if not inputs:
            # Factories (zeros, full, arange, ...) may produce any layout.
            return placeholder_options(node.meta["val"], self.mesh), "factory"
        failures: list[Exception] = []
        if self._per_candidate is not None and self._per_candidate.handles(node, inputs):
            options = self._per_candidate.options(node, inputs, candidates, failures)
        else:
            options = dtensor_options(node, inputs, candidates, self._pool, failures)
        if not options and len(inputs) == 1 and isinstance(inputs[0].meta.get("val"), torch.Tensor):
            options = self._every_input_layout(node, inputs, failures)
        extra = EXTRA_RULES.get(op)
        if extra is not None:
            try:
                options = _joined(options, extra(node, candidates, self._pool))
            except CODE_ERRORS as e:
                raise rule_error(op, node.name, qualified_name(extra), e) from e
        if options:
            return options, "dtensor"
        if failures:
            why = f"DTensor's rule raised {type(failures[0]).__name__}: {failures[0]}"
        elif _has_dtensor_rule(op):
            why = "every option of DTensor's rule shards unevenly or uses _StridedShard"
        else:
            why = "no rule"
        self._fallback_why.setdefault(str(op), why)
        return replicate_options(node, inputs, self.mesh), "fallback"

    def _every_output_specified(self, node, options: list[Option]) -> list[Option]:
        """``options`` of a multi-output node with a replicated spec for
        every tensor output a strategy left without one.

        DTensor's strategies give no spec (None) to outputs DTensor hands
        back as plain tensors: the random-number state of the fused CUDA
        attention kernels (efficient and cuDNN attention's philox seed and
        offset, flash attention's offset). DTensor reads such a tensor as
        replicated where an op takes it (a scalar tensor is replicated
        implicitly), and so does the plan: the getitem of that output then
        offers a spec its consumers can be priced against, rather than None,
        on which a consumer's DTensor rule raised and a consumer that fell
        back to replicated had no producer spec to redistribute from.
        """
        metas = node_out_meta(node)
        if not isinstance(metas, tuple) or not any(
            spec is None and meta is not None
            for o in options
            if isinstance(o.output_specs, tuple)
            for spec, meta in zip(o.output_specs, metas)
        ):
            return options
        rep = (Replicate(),) * self.mesh.ndim

        def filled(specs):
            if not isinstance(specs, tuple):
                return specs
            return tuple(
                self._pool.get(rep, meta) if spec is None and meta is not None else spec
                for spec, meta in zip(specs, metas)
            )

        return [dataclasses.replace(o, output_specs=filled(o.output_specs)) for o in options]

    def _every_input_layout(self, node, inputs, failures: list) -> list[Option]:
        """Options of a one-input op from every even layout of its input,
        not only those its producer offers (the edge redistributes). A
        view that merges dims can follow none of a producer that offers
        only a layout sharded on an inner merged dim (DTensor gives a
        ``_StridedShard``, which plans do not use), yet it has batch-sharded
        and other options."""
        val = inputs[0].meta["val"]
        meta = tensor_meta_of(val)
        every = [[self._pool.get(p, meta) for p in all_placements(val.shape, self.mesh)]]
        if self._per_candidate is not None and self._per_candidate.handles(node, inputs):
            return self._per_candidate.options(node, inputs, every, failures)
        return dtensor_options(node, inputs, every, self._pool, failures)


def _propagate(node, inputs, candidates, pool: SpecPool) -> list[Option]:
    """Options from DTensor for the given candidate specs per input; raises
    whatever DTensor's strategy function raises."""
    strategy = dtensor_strategy_for(node, inputs, candidates, pool.mesh)
    if strategy is None:
        return []
    return options_from_op_strategy(node, strategy, inputs, pool)


def dtensor_options(node, inputs, candidates, pool: SpecPool, failures: list | None = None) -> list[Option]:
    """DTensor's options for ``node`` given every candidate of every input.

    Strategy functions that follow their input's layout (all view ops) go
    through the candidates one by one and raise as soon as one of them cannot
    be propagated: unflattening a dim sharded 16 ways into 8 heads raises
    "Cannot unflatten unevenly sharded tensor", which used to throw away the
    options of every other candidate and leave the view replicate-only. On
    such a failure, propagate one candidate of the first input at a time
    (the other inputs keep all of theirs) and keep what succeeds: for
    single-input ops that is exactly the set the all-at-once call would give
    if it skipped the bad candidates; the consumer can still get any layout
    through a redistribution on the incoming edge.
    """
    op = node.target
    failures = failures if failures is not None else []
    try:
        return _propagate(node, inputs, candidates, pool)
    except NotImplementedError as e:
        logger.debug("no DTensor strategy for %s: %s", op, e)
        return []
    except CODE_ERRORS as e:
        raise rule_error(op, node.name, dtensor_rule_name(op), e) from e
    except Exception as e:  # noqa: BLE001 - DTensor rules assert on odd inputs
        failures.append(e)
        if len(candidates[0]) < 2:
            logger.debug("DTensor strategy for %s (%s) failed: %r", op, node.name, e, exc_info=True)
            return []
        logger.debug(
            "DTensor strategy for %s (%s) failed on all candidates (%r); retrying one by one", op, node.name, e
        )
    options: list[Option] = []
    seen: set = set()
    first = inputs[0]
    for spec in candidates[0]:
        # Restrict every occurrence of the first input, not just position 0.
        restricted = [(spec,) if n is first else c for n, c in zip(inputs, candidates)]
        try:
            found = _propagate(node, inputs, restricted, pool)
        except CODE_ERRORS as e:
            raise rule_error(op, node.name, dtensor_rule_name(op), e) from e
        except Exception as e:  # noqa: BLE001 - this candidate has no option
            logger.debug("%s (%s): no option for input layout %s: %r", op, node.name, format_specs(spec), e)
            continue
        for o in found:
            key = (placements_of(o.output_specs), tuple(s.placements for s in o.input_specs))
            if key not in seen:
                seen.add(key)
                options.append(o)
    return options


def _has_dtensor_rule(op) -> bool:
    prop = propagator()
    return op in prop.op_strategy_funcs or op in prop.op_single_dim_strategy_funcs


def _candidate_free(op) -> bool:
    """Whether ``op``'s options do not depend on its inputs' candidate
    specs: DTensor's single-mesh-dim strategies expand over the mesh
    whatever the inputs hold (:func:`dtensor_strategy` hands them one
    representative spec per input); a registered rule, or extra rule, sees
    the candidates."""
    return op not in RULES and op not in EXTRA_RULES and single_dim_rule(op) is not None


def _joined(options: list[Option], extra: list[Option]) -> list[Option]:
    """``options`` followed by the ``extra`` options that differ from every
    one of them (and each other); specs are pooled, so equal specs are one
    object."""
    if not extra:
        return options

    def key(o: Option) -> tuple:
        out = id(o.output_specs) if isinstance(o.output_specs, DTensorSpec) else placements_of(o.output_specs)
        return (out, *map(id, o.input_specs))

    seen = {key(o) for o in options}
    joined = list(options)
    for o in extra:
        k = key(o)
        if k not in seen:
            seen.add(k)
            joined.append(o)
    return joined


def _module_path(node: torch.fx.Node) -> str:
    return module_path(node) or "<top level>"


def _produces_tensors(val) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    if isinstance(val, (tuple, list)):
        return any(isinstance(v, torch.Tensor) for v in val)
    return False


def _dedup(items) -> tuple:
    out: dict = {}
    for it in items:
        out.setdefault(it, None)
    return tuple(out)
