"""Apply stage 1: the plan's joint graph, rewritten to run on local shards.

``build_local_joint`` interprets the traced joint forward+backward graph once
under ``make_fx`` on fake local tensors. Every op runs on the shard its plan
option says; where a producer's layout differs from what the consumer's
option needs, the redistribution (functional collectives) is traced in
between; shape arguments of views and ``new_*`` factories are made local the
way DTensor's dispatcher does it; factories are computed and then split.

The result is an ordinary joint graph (``primals_*``, ``tangents_*``
placeholders; forward outputs, then one gradient per parameter) that
PyTorch's partitioners split into forward and backward.

Graph inputs, in order: parameters (``param_fqns``), buffers
(``buffer_fqns``), user tensor inputs, ``coords`` (this rank's mesh
coordinates, int64 ``[mesh.ndim]``), then one tangent per differentiable
forward output.
"""

from __future__ import annotations

import copy
import logging
import math
import operator
import time
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager, unset_fake_temporarily
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_impls import fast_detach
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor.placement_types import Shard, _MaskPartial
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .. import activation_checkpointing
from ..strategies import NodeStrategy, format_specs
from ..tracing import TracedStep
from .redistribute import redistribute, replicate_spec, same_placements, user_spec

logger = logging.getLogger(__name__)

# node.meta keys written by apply (the only ones; see DESIGN.md "Style").
SOURCE_KEY = "autoparallel_source"  # name of the joint-graph node a local node implements
REDISTRIBUTE_KEY = "autoparallel_redistribute"  # (producer, src placements, dst placements)


class ApplyError(RuntimeError):
    """The plan cannot be applied to the graph (names the node)."""


@dataclass
class LocalJoint:
    """The rank-local joint graph and what its inputs and outputs are."""

    gm: torch.fx.GraphModule
    mesh: DeviceMesh
    param_fqns: list[str]
    buffer_fqns: list[str]
    # Planned layout of each parameter/buffer (gradients match parameters).
    param_specs: dict[str, DTensorSpec]
    buffer_specs: dict[str, DTensorSpec]
    # Per user tensor input (flattened order): its planned layout.
    input_specs: list[DTensorSpec]
    # Per forward output: the layout handed to the user (Partial reduced).
    output_specs: list[DTensorSpec]
    # Forward outputs that have a tangent (in order of the tangent inputs).
    differentiable_outputs: list[int]
    # Parameters that receive a gradient output (the rest get None).
    has_grad: list[bool]
    seconds: float = 0.0
    ac_stats: object = None
    extra: dict = field(default_factory=dict)

    @property
    def num_fwd_outputs(self) -> int:
        return len(self.output_specs)

    @property
    def num_primals(self) -> int:
        return len(self.param_fqns) + len(self.buffer_fqns) + len(self.input_specs) + 1


def local_shape(spec: DTensorSpec) -> tuple[int, ...]:
    """Shape of one rank's shard (even sharding only, as planned)."""
    shape = list(spec.tensor_meta.shape)
    for mesh_dim, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            n = spec.mesh.size(mesh_dim)
            if shape[p.dim] % n:
                raise ApplyError(f"uneven shard: dim {p.dim} of {tuple(spec.tensor_meta.shape)} over {n} ranks")
            shape[p.dim] //= n
    return tuple(shape)


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _chosen(strategies: dict[torch.fx.Node, NodeStrategy], choice: dict[str, int], node: torch.fx.Node):
    strat = strategies.get(node)
    if strat is None:
        raise ApplyError(f"node {node.name} ({node.target}) has no placement options")
    if node.name not in choice:
        raise ApplyError(f"the plan has no entry for node {node.name}; was it made by this AutoParallel?")
    return strat, strat.options[choice[node.name]]


def _propagator():
    return DTensor._op_dispatcher.sharding_propagator


def _localize_schema(op, args, kwargs, in_specs, out_specs) -> OpSchema:
    """Args with shape arguments rewritten for the local shards, as DTensor's
    sharding propagation does for the chosen option (tensor args are specs)."""
    prop = _propagator()
    schema = OpSchema(op, args, kwargs)
    if (
        op in prop.op_to_shape_and_stride_idx
        and isinstance(out_specs, DTensorSpec)
        and any(p.is_shard() for p in out_specs.placements)
    ):
        schema = prop._adjust_shape_and_stride_args(out_specs.tensor_meta, schema, out_specs)
    if op in prop.op_to_scalar_shape_adjuster and any(p.is_shard() for s in in_specs for p in s.placements):
        schema = prop.op_to_scalar_shape_adjuster[op](list(in_specs), schema)
    if op in prop.squeeze_op_to_dims_variant:
        adjusted = prop._adjust_squeeze_to_global_singletons(schema)
        if adjusted is not None:
            schema = adjusted
    return schema


# Factories whose values do not depend on the position: build the local
# shard directly instead of the global tensor.
_SIZE_FACTORIES = {
    torch.ops.aten.full.default,
    torch.ops.aten.zeros.default,
    torch.ops.aten.ones.default,
    torch.ops.aten.empty.memory_format,
}


class _Interpreter:
    """Runs the joint graph's nodes on local (fake) shards under make_fx."""

    def __init__(self, traced: TracedStep, strategies, choice, mesh: DeviceMesh):
        self.traced = traced
        self.strategies = strategies
        self.choice = choice
        self.mesh = mesh
        self.spec: dict[torch.fx.Node, object] = {}
        self.env: dict[torch.fx.Node, object] = {}
        self.coords: torch.Tensor | None = None
        # Row-sharded embeddings: node -> {mesh dim: mask of the indices
        # looked up on other ranks}, from the indices' redistribution to the
        # reduction of the (_MaskPartial) output.
        self.masks: dict[torch.fx.Node, dict[int, torch.Tensor]] = {}
        # Structurally identical nodes (the repeated layers) emit the same
        # local nodes: trace the first, copy it for the rest.
        self.use_templates = True
        self.templates: dict[tuple, _Template] = {}
        self.template_hits = 0

    # -- helpers ---------------------------------------------------------------
    def _tracer_graph(self) -> torch.fx.Graph | None:
        tracer = _tracer()
        return tracer.graph if tracer is not None else None

    def _redistribute(self, x, src: DTensorSpec, dst: DTensorSpec, what: str, producer=None, consumer=None):
        if same_placements(src.placements, dst.placements):
            return x
        graph = self._tracer_graph()
        last = next(reversed(graph.nodes)) if graph is not None else None
        src_masks = self.masks.get(producer) if producer is not None else None
        dst_masks = self.masks.setdefault(consumer, {}) if consumer is not None else None
        try:
            out = redistribute(x, src, dst, self.coords, src_masks=src_masks, dst_masks=dst_masks)
        except NotImplementedError as e:
            raise ApplyError(f"{what}: cannot redistribute {format_specs(src)} -> {format_specs(dst)}: {e}") from e
        if graph is not None:
            tag = (what, format_specs(src), format_specs(dst))
            for n in _nodes_after(graph, last):
                n.meta[REDISTRIBUTE_KEY] = tag
        return out

    def _check(self, node: torch.fx.Node, value, specs) -> None:
        if isinstance(value, torch.Tensor):
            if not isinstance(specs, DTensorSpec):
                raise ApplyError(f"{node.name}: tensor output but plan specs {specs!r}")
            want = local_shape(specs)
            if tuple(value.shape) != want:
                raise ApplyError(
                    f"{node.name} ({node.target}) with option {format_specs(specs)}: local result has "
                    f"shape {tuple(value.shape)}, expected {want} (global {tuple(specs.tensor_meta.shape)})"
                )
        elif isinstance(value, (tuple, list)):
            for v, s in zip(value, specs):
                if isinstance(v, torch.Tensor):
                    self._check(node, v, s)

    # -- nodes -------------------------------------------------------------------
    def call_function(self, node: torch.fx.Node):
        strat, opt = _chosen(self.strategies, self.choice, node)
        self.spec[node] = opt.output_specs
        if strat.getitem_index is not None:
            parent = strat.inputs[0]
            return self.env[parent][strat.getitem_index]
        if node.target is operator.getitem:
            raise ApplyError(f"{node.name}: getitem without a parent option")
        tracer = _tracer()
        if tracer is None or not self.use_templates:
            return self._trace_node(node, strat, opt)
        inputs = [self.env[p] for p in strat.inputs]
        key = self._template_key(node, strat, opt, inputs)
        if key is None:
            return self._trace_node(node, strat, opt)
        template = self.templates.get(key)
        if template is not None:
            self.template_hits += 1
            return template.replay(tracer, node, strat.inputs, inputs)
        if key in self.templates:  # known not to be copyable
            return self._trace_node(node, strat, opt)
        last = tracer.graph._root.prev
        out = self._trace_node(node, strat, opt)
        self.templates[key] = _Template.record(tracer, last, node, strat.inputs, inputs, out)
        return out

    def _template_key(self, node: torch.fx.Node, strat, opt, inputs) -> tuple | None:
        """What the local nodes emitted for ``node`` depend on: the op, its
        constant arguments, each input's local tensor and layout change, the
        output layout. None: not cacheable."""
        for v in inputs:
            if not isinstance(v, torch.Tensor):
                return None
        specs = [self.spec[p] for p in strat.inputs]
        if _has_mask_partial(opt.output_specs) or any(map(_has_mask_partial, specs)) or any(
            map(_has_mask_partial, opt.input_specs)
        ):
            return None
        try:
            consts = _const_sig((node.args, node.kwargs), self.env)
            hash(consts)
        except TypeError:
            return None
        storages = [v.untyped_storage()._cdata for v in inputs]
        return (
            node.target,
            consts,
            tuple(_spec_sig(s) for s in specs),
            tuple(_spec_sig(s) for s in opt.input_specs),
            _spec_sig(opt.output_specs),
            tuple(_tensor_sig(v) for v in inputs),
            # which inputs alias each other
            tuple(storages.index(s) for s in storages),
        )

    def _trace_node(self, node: torch.fx.Node, strat, opt):
        in_specs = opt.input_specs
        locals_: list[torch.Tensor] = []
        for k, producer in enumerate(strat.inputs):
            locals_.append(
                self._redistribute(
                    self.env[producer], self.spec[producer], in_specs[k], f"{producer.name}->{node.name}",
                    producer, node,
                )
            )
            if _has_mask_partial(opt.output_specs) and self.masks.get(producer):
                # an op that keeps the embedding's pending reduction keeps its mask
                for d, m in self.masks[producer].items():
                    self.masks.setdefault(node, {}).setdefault(d, m)
        op = node.target
        if not strat.inputs:
            return self._factory(node, opt.output_specs)
        # tensor args -> their required specs (DTensor's schema form), in the
        # same flattened order as strategies.tensor_inputs
        it = iter(in_specs)

        def to_spec(a):
            if isinstance(a, torch.fx.Node):
                if isinstance(a.meta.get("val"), torch.Tensor):
                    return next(it)
                return self.env[a]
            return a

        args = tree_map(to_spec, node.args)
        kwargs = tree_map(to_spec, node.kwargs)
        schema = _localize_schema(op, args, kwargs, in_specs, opt.output_specs)
        lit = iter(locals_)

        def to_local(a):
            return next(lit) if isinstance(a, DTensorSpec) else a

        largs = tree_map(to_local, tuple(schema.args_schema))
        lkwargs = tree_map(to_local, dict(schema.kwargs_schema))
        out = schema.op(*largs, **lkwargs)
        self._check(node, out, opt.output_specs)
        return out

    def _factory(self, node: torch.fx.Node, spec):
        if not isinstance(spec, DTensorSpec):
            raise ApplyError(f"{node.name}: multi-output factory {node.target} is not supported")
        if any(p.is_partial() for p in spec.placements):
            raise ApplyError(f"{node.name}: factory {node.target} planned as {format_specs(spec)}")
        if node.target in _SIZE_FACTORIES:
            args = (list(local_shape(spec)),) + tuple(node.args[1:])
            return node.target(*args, **node.kwargs)
        out = node.target(*node.args, **node.kwargs)
        return self._redistribute(out, replicate_spec(spec), spec, f"factory {node.name}")

    # -- whole graph -------------------------------------------------------------
    def run(self, primals: list[torch.Tensor], tangents: list[torch.Tensor], layout: "_Layout"):
        traced = self.traced
        self.coords = primals[-1]
        inputs: dict[torch.fx.Node, torch.Tensor] = {}
        for i, fqn in enumerate(layout.param_fqns):
            inputs[traced.param_nodes[fqn]] = primals[i]
        off = len(layout.param_fqns)
        for i, fqn in enumerate(layout.buffer_fqns):
            inputs[traced.buffer_nodes[fqn]] = primals[off + i]
        off += len(layout.buffer_fqns)
        for i, node in enumerate(layout.input_nodes):
            inputs[node] = primals[off + i]
        tangent_of = {traced.tangent_nodes[o]: k for k, o in enumerate(layout.differentiable_outputs)}

        graph = self._tracer_graph()
        for node in traced.gm.graph.nodes:
            if node.op == "output":
                break
            last = next(reversed(graph.nodes)) if graph is not None and len(graph.nodes) else None
            with fx_traceback.set_current_meta(node):
                if node.op == "placeholder":
                    _, opt = _chosen(self.strategies, self.choice, node)
                    self.spec[node] = opt.output_specs
                    if node in tangent_of:
                        k = tangent_of[node]
                        out_idx = layout.differentiable_outputs[k]
                        self.env[node] = self._redistribute(
                            tangents[k], layout.output_specs[out_idx], opt.output_specs, f"tangent {node.name}"
                        )
                    elif node in inputs:
                        self.env[node] = inputs[node]
                    else:
                        raise ApplyError(f"graph input {node.name} is not a parameter, buffer, input or tangent")
                elif node.op == "call_function":
                    self.env[node] = self.call_function(node)
                else:
                    raise ApplyError(f"unsupported node kind {node.op} ({node.name})")
            if graph is not None:
                for n in _nodes_after(graph, last):
                    n.meta.setdefault(SOURCE_KEY, node.name)

        outs: list = []
        for i, node in enumerate(traced.output_nodes):
            with fx_traceback.set_current_meta(node):
                outs.append(
                    self._redistribute(self.env[node], self.spec[node], layout.output_specs[i], f"output {i}", node)
                )
        for fqn, wants in zip(layout.param_fqns, layout.has_grad):
            grad = traced.grad_nodes.get(fqn)
            if not wants:
                outs.append(None)
                continue
            with fx_traceback.set_current_meta(grad):
                outs.append(
                    self._redistribute(self.env[grad], self.spec[grad], layout.param_specs[fqn], f"grad of {fqn}", grad)
                )
        return outs


def _tracer():
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return mode.tracer if mode is not None else None


def _has_mask_partial(spec) -> bool:
    if isinstance(spec, DTensorSpec):
        return any(isinstance(p, _MaskPartial) for p in spec.placements)
    if isinstance(spec, (tuple, list)):
        return any(_has_mask_partial(s) for s in spec)
    return False


def _spec_sig(spec):
    if isinstance(spec, DTensorSpec):
        return (spec.placements, spec.tensor_meta)
    if isinstance(spec, (tuple, list)):
        return tuple(_spec_sig(s) for s in spec)
    return spec


def _tensor_sig(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)


def _const_sig(a, env):
    """Hashable form of a node's non-tensor arguments (tensors: a marker)."""
    if isinstance(a, torch.fx.Node):
        if isinstance(a.meta.get("val"), torch.Tensor):
            return "<T>"
        return ("<v>", _const_sig(env[a], env))
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_const_sig(x, env) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _const_sig(v, env)) for k, v in a.items()))
    if isinstance(a, (bool, int, float, complex)):
        return (type(a).__name__, a)  # 1 == 1.0 == True, but they trace differently
    if isinstance(a, (str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return a
    if isinstance(a, (torch.fx.immutable_collections.immutable_list, torch.SymInt)):
        raise TypeError("not a constant")
    raise TypeError(f"unhashable argument {type(a).__name__}")


# node.meta keys the tracer fills from the node being interpreted (see
# torch.fx.proxy.TracerBase.create_node); a copied node takes them from its
# own source node, everything else from the template.
_CONTEXT_KEYS = ("stack_trace", "is_gradient_acc", "autograd_backward", "seq_nr", SOURCE_KEY, REDISTRIBUTE_KEY)


def _context_meta() -> tuple[dict, set]:
    from torch.fx.proxy import _COPY_META_FIELDS

    current = fx_traceback.get_current_meta() if fx_traceback.has_preserved_node_meta() else {}
    # original_aten is the op being dispatched when a node is made: the template's
    ctx = {f: current[f] for f in _COPY_META_FIELDS if f in current and f != "original_aten"}
    stack = current.get("stack_trace")
    if stack:
        ctx["stack_trace"] = stack
        if fx_traceback.GRADIENT_ACC_SPECIAL_STACK in stack:
            ctx["is_gradient_acc"] = True
            ctx["autograd_backward"] = True
    if current.get("autograd_backward", False):
        ctx["autograd_backward"] = True
    keys = set(_CONTEXT_KEYS) | {f for f in _COPY_META_FIELDS if f != "original_aten"}
    return ctx, keys


@dataclass
class _Template:
    """The local nodes traced for one joint-graph node, to be copied for
    structurally identical nodes (same op, constants, input tensors and
    layouts): no dispatch, no sharding propagation, only node copies with
    fresh fake values."""

    nodes: list[torch.fx.Node]
    input_of: dict[torch.fx.Node, int]  # node outside the template -> input index
    input_storages: dict[int, int]  # storage of an input -> input index
    outside_storages: dict[int, torch.Tensor]  # storage of another outside node -> its value
    out_spec: object  # pytree spec of the output
    out_refs: list[tuple]  # per leaf: ("node", i) | ("in", k) | ("const", value)
    out_requires_grad: list[bool]
    redistributed: list[int | None]  # per node: input whose redistribution emitted it
    tags: dict[int, tuple[str, str]]  # input -> (src, dst) placements of its redistribution
    factory_tag: tuple | None

    @staticmethod
    def record(tracer, last, node, producers, inputs, out) -> "_Template | None":
        from torch.fx.experimental.proxy_tensor import get_proxy_slot

        nodes = list(_nodes_after(tracer.graph, last))
        index = {n: i for i, n in enumerate(nodes)}
        try:
            in_nodes = [get_proxy_slot(v, tracer).proxy.node for v in inputs]
        except (KeyError, RuntimeError):
            return None
        first_input = {}
        for k, n in enumerate(in_nodes):
            first_input.setdefault(n, k)
        input_of = {}
        # storages of other outside nodes (the coords input): copies share them
        storages: dict[int, torch.Tensor] = {}
        for n in nodes:
            for a in n.all_input_nodes:
                if a in index:
                    continue
                if a in first_input:
                    input_of[a] = first_input[a]
                elif isinstance(a.meta.get("val"), torch.Tensor):
                    storages[a.meta["val"].untyped_storage()._cdata] = a.meta["val"]
        leaves, out_spec = tree_flatten(out)
        refs, requires_grad = [], []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                try:
                    n = get_proxy_slot(leaf, tracer).proxy.node
                except (KeyError, RuntimeError):
                    return None
                if n in index:
                    refs.append(("node", index[n]))
                elif n in first_input:
                    refs.append(("in", first_input[n]))
                else:
                    return None
                requires_grad.append(leaf.requires_grad)
            else:
                refs.append(("const", leaf))
                requires_grad.append(False)
        producer_k = {}
        for k, p in enumerate(producers):
            producer_k.setdefault(f"{p.name}->{node.name}", k)
        redistributed, tags, factory_tag = [], {}, None
        for n in nodes:
            tag = n.meta.get(REDISTRIBUTE_KEY)
            k = None
            if tag is not None:
                if tag[0] == f"factory {node.name}":
                    factory_tag = tag[1:]
                    k = -1
                elif tag[0] in producer_k:
                    k = producer_k[tag[0]]
                    tags[k] = tag[1:]
                else:
                    return None
            redistributed.append(k)
        input_storages = {}
        for k, v in enumerate(inputs):
            input_storages.setdefault(v.untyped_storage()._cdata, k)
        return _Template(nodes, input_of, input_storages, storages, out_spec, refs, requires_grad, redistributed, tags, factory_tag)

    def replay(self, tracer, node, producers, inputs):
        from torch.fx.experimental.proxy_tensor import (
            disable_proxy_modes_tracing,
            extract_val,
            get_proxy_slot,
            track_tensor,
        )

        graph = tracer.graph
        in_nodes = [get_proxy_slot(v, tracer).proxy.node for v in inputs]
        arg_map = {ext: in_nodes[k] for ext, k in self.input_of.items()}
        ctx, context_keys = _context_meta()
        seq_nr = torch.autograd._get_sequence_nr() - 1
        storages = dict(self.outside_storages)
        storages.update({s: inputs[k] for s, k in self.input_storages.items()})
        new_nodes = []
        with disable_proxy_modes_tracing(), torch.no_grad():
            for tn, k in zip(self.nodes, self.redistributed):
                n = _insert_copy(graph, tn, arg_map)
                arg_map[tn] = n
                meta = {key: v for key, v in tn.meta.items() if key not in context_keys}
                for key, v in ctx.items():
                    meta[key] = copy.copy(v)
                meta["seq_nr"] = seq_nr
                if k is not None:
                    if k < 0:
                        meta[REDISTRIBUTE_KEY] = (f"factory {node.name}",) + self.factory_tag
                    else:
                        meta[REDISTRIBUTE_KEY] = (f"{producers[k].name}->{node.name}",) + self.tags[k]
                val = tn.meta.get("val")
                if val is not None:
                    meta["val"] = new_val = _fresh(val, storages)
                    if "tensor_meta" in tn.meta and isinstance(new_val, torch.Tensor):
                        # metadata of an equal-metadata tensor: the template's
                        meta["tensor_meta"] = _same_tensor_meta(tn.meta["tensor_meta"], new_val)
                if "eager_input_vals" in meta:
                    meta["eager_input_vals"] = torch.fx.node.map_aggregate((n.args, n.kwargs), _eager_val)
                n.meta = meta
                new_nodes.append(n)
            leaves = []
            for ref, rg in zip(self.out_refs, self.out_requires_grad):
                if ref[0] == "node":
                    n = new_nodes[ref[1]]
                    t = n.meta["val"]  # becomes the value; meta["val"] its snapshot
                    if not isinstance(t, torch.Tensor):
                        raise ApplyError(f"{node.name}: template output {n.name} is not a tensor")
                    if rg:
                        t.requires_grad_(True)
                    proxy = torch.fx.Proxy(n, tracer)
                    track_tensor(t, proxy, tracer=tracer, constant=None)
                    # what set_meta does, with the template's metadata
                    n.meta["val"] = fast_detach(t.fake_mode, t) if isinstance(t, FakeTensor) else extract_val(t)
                    n.meta["tensor_meta"] = _same_tensor_meta(self.nodes[ref[1]].meta.get("tensor_meta"), t)
                    leaves.append(t)
                elif ref[0] == "in":
                    leaves.append(inputs[ref[1]])
                else:
                    leaves.append(ref[1])
        return tree_unflatten(leaves, self.out_spec)


def _insert_copy(graph: torch.fx.Graph, tn: torch.fx.Node, arg_map: dict) -> torch.fx.Node:
    """``graph.node_copy(tn, lambda a: arg_map.get(a, a))`` without the meta
    copy (the caller sets it) and without ``Graph.create_node``'s scan of the
    arguments for raw symbolic values: a template node's arguments are nodes
    and constants that passed that scan when the template was traced (and
    ``_const_sig`` rejects SymInts), so the copies have none either."""
    args = torch.fx.node.map_arg(tn.args, lambda a: arg_map.get(a, a))
    kwargs = torch.fx.node.map_arg(tn.kwargs, lambda a: arg_map.get(a, a))
    if not args:
        args = ()
    if not kwargs:
        kwargs = torch.fx.immutable_collections.immutable_dict()
    # Graph.create_node, minus the scan
    namespace = graph._graph_namespace
    name = namespace.create_name(tn.name, None)
    n = torch.fx.Node(graph, name, tn.op, tn.target, args, kwargs, tn.type)
    owner = graph.owning_module
    if owner is not None and getattr(owner, "_create_node_hooks", None) is not None:
        for f in owner._create_node_hooks:
            f(n)
    namespace.associate_name_with_obj(name, n)
    graph._insert(n)
    graph._find_nodes_lookup_table.insert(n)
    graph._len += 1
    return n


def _same_tensor_meta(template_meta, t: torch.Tensor):
    """``_extract_tensor_metadata(t)`` for ``t`` with the metadata of the
    template node's value (only requires_grad may differ)."""
    from torch.fx.passes.shape_prop import TensorMetadata, _extract_tensor_metadata

    if not isinstance(template_meta, TensorMetadata):
        return _extract_tensor_metadata(t)
    if template_meta.requires_grad != t.requires_grad:
        return template_meta._replace(requires_grad=t.requires_grad)
    return template_meta


def _eager_val(a):
    from torch.fx.experimental.proxy_tensor import extract_val

    if not isinstance(a, torch.fx.Node) or "val" not in a.meta:
        return None
    return extract_val(a.meta["val"])


def _fresh(val, storages: dict[int, torch.Tensor]):
    """A new fake value like ``val``; tensors sharing a storage in the
    template share one in the copy (``storages``: template storage -> a
    tensor of the copy on that storage's counterpart).

    Built the way the fake mode wraps a meta kernel's output (a meta tensor
    made inside ``in_kernel_invocation_manager``, wrapped in a FakeTensor),
    without a trip through fake-tensor dispatch."""
    if isinstance(val, (tuple, list)):
        return type(val)(_fresh(v, storages) for v in val)
    if not isinstance(val, FakeTensor):
        if isinstance(val, torch.Tensor):
            return _fresh_dispatch(val, storages)
        return val
    mode = val.fake_mode
    key = val.untyped_storage()._cdata
    base = storages.get(key)
    with no_python_dispatcher(), in_kernel_invocation_manager(mode):
        if base is not None and base.dtype == val.dtype:
            elem = torch.ops.aten.as_strided.default(base, val.shape, val.stride(), val.storage_offset())
        else:
            n = val.untyped_storage().nbytes() // val.element_size()
            if val.storage_offset() == 0 and val.numel() == n and val.is_contiguous():
                elem = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
                new_base = None
            else:
                new_base = torch.empty((n,), dtype=val.dtype, device="meta")
                elem = torch.ops.aten.as_strided.default(new_base, val.shape, val.stride(), val.storage_offset())
    new = FakeTensor(mode, elem, val.device)
    if base is None or base.dtype != val.dtype:
        storages[key] = new if new_base is None else FakeTensor(mode, new_base, val.device)
    return new


def _fresh_dispatch(val: torch.Tensor, storages: dict[int, torch.Tensor]):
    """:func:`_fresh` for a tensor that is not fake (through dispatch)."""
    key = val.untyped_storage()._cdata
    base = storages.get(key)
    if base is not None and base.dtype == val.dtype:
        return base.as_strided(val.shape, val.stride(), val.storage_offset())
    n = val.untyped_storage().nbytes() // val.element_size()
    if val.storage_offset() == 0 and val.numel() == n and val.is_contiguous():
        new = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
        storages[key] = new
        return new
    base = torch.empty((n,), dtype=val.dtype, device=val.device)
    storages[key] = base
    return base.as_strided(val.shape, val.stride(), val.storage_offset())


@dataclass
class _Layout:
    param_fqns: list[str]
    buffer_fqns: list[str]
    input_nodes: list[torch.fx.Node]
    param_specs: dict[str, DTensorSpec]
    output_specs: list[DTensorSpec]
    differentiable_outputs: list[int]
    has_grad: list[bool]


def _nodes_after(graph: torch.fx.Graph, last: torch.fx.Node | None):
    """Nodes appended to ``graph`` after ``last`` (None: all of them)."""
    root = graph._root
    n = (last if last is not None else root).next
    while n is not root:
        yield n
        n = n.next


def build_local_joint(
    traced: TracedStep,
    strategies: dict[torch.fx.Node, NodeStrategy],
    choice: dict[str, int],
    mesh: DeviceMesh,
    *,
    copy_repeated: bool = True,
) -> LocalJoint:
    """Trace the rank-local joint graph of ``traced`` under the plan ``choice``
    (node name -> option index into ``strategies[node].options``).

    ``copy_repeated``: trace each structurally identical node once and copy
    its local nodes for the others (same graph, much faster on repeated
    layers); False traces every node."""
    t0 = time.perf_counter()

    def spec_of(node):
        return _chosen(strategies, choice, node)[1].output_specs

    param_fqns = list(traced.param_nodes)
    buffer_fqns = list(traced.buffer_nodes)
    input_nodes = [n for n in traced.input_nodes if n is not None]
    param_specs = {fqn: spec_of(traced.param_nodes[fqn]) for fqn in param_fqns}
    buffer_specs = {fqn: spec_of(traced.buffer_nodes[fqn]) for fqn in buffer_fqns}
    input_specs = [spec_of(n) for n in input_nodes]
    output_specs = []
    for i, node in enumerate(traced.output_nodes):
        spec = spec_of(node)
        if not isinstance(spec, DTensorSpec):
            raise ApplyError(f"forward output {i} ({node.name}) is not a single tensor")
        output_specs.append(user_spec(spec))
    differentiable = sorted(traced.tangent_nodes)
    has_grad = [traced.grad_nodes.get(fqn) is not None for fqn in param_fqns]
    layout = _Layout(param_fqns, buffer_fqns, input_nodes, param_specs, output_specs, differentiable, has_grad)

    def fake_local(spec: DTensorSpec):
        shape = local_shape(spec)
        return torch.empty_strided(shape, _contiguous_stride(shape), dtype=spec.tensor_meta.dtype, device=mesh.device_type)

    interp = _Interpreter(traced, strategies, choice, mesh)
    interp.use_templates = copy_repeated

    def joint(primals, tangents):
        return interp.run(list(primals), list(tangents), layout)

    with unset_fake_temporarily():
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode:
            primals = [fake_local(param_specs[f]) for f in param_fqns]
            primals += [fake_local(buffer_specs[f]) for f in buffer_fqns]
            primals += [fake_local(s) for s in input_specs]
            primals.append(torch.zeros(mesh.ndim, dtype=torch.int64, device=mesh.device_type))
            tangents = [fake_local(output_specs[i]) for i in differentiable]
        for p, fqn in zip(primals, param_fqns):
            p.requires_grad_(traced.param_nodes[fqn].meta["val"].requires_grad)
        # a lazy graph module: its Python code is generated on first use
        with fake_mode, fx_traceback.preserve_node_meta(), _use_lazy_graph_module(True):
            gm = make_fx(joint, pre_dispatch=False)(primals, tangents)
    gm.graph.eliminate_dead_code()
    ac_stats = activation_checkpointing.tag_recompute(gm)
    gm.recompile()
    seconds = time.perf_counter() - t0
    logger.info(
        "local joint graph: %d nodes in %.2fs (%d joint nodes copied from %d traced templates)",
        len(gm.graph.nodes),
        seconds,
        interp.template_hits,
        len(interp.templates),
    )
    return LocalJoint(
        gm=gm,
        mesh=mesh,
        param_fqns=param_fqns,
        buffer_fqns=buffer_fqns,
        param_specs=param_specs,
        buffer_specs=buffer_specs,
        input_specs=input_specs,
        output_specs=output_specs,
        differentiable_outputs=differentiable,
        has_grad=has_grad,
        seconds=seconds,
        ac_stats=ac_stats,
    )
