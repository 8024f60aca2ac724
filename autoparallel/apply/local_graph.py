"""Apply stage 1: the plan's joint graph, rewritten to run on local shards.

``build_local_joint`` interprets the traced joint forward+backward graph once
under ``make_fx`` on fake local tensors. Every op runs on the shard its plan
option says; where a producer's layout differs from what the consumer's
option needs, the redistribution (functional collectives) is traced in
between; shape arguments of views and ``new_*`` factories are made local the
way DTensor's dispatcher does it; factories are computed and then split.
Nodes that are twins of an already traced one (repeated layers) are copied
from it instead (:mod:`.node_templates`).

The result is an ordinary joint graph (``primals_*``, ``tangents_*``
placeholders; forward outputs, then one gradient per parameter) that
PyTorch's partitioners split into forward and backward.

Graph inputs, in order: parameters (``param_fqns``), buffers
(``buffer_fqns``), user tensor inputs, ``coords`` (this rank's mesh
coordinates, int64 ``[mesh.ndim]``), then one tangent per differentiable
forward output.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor.placement_types import Shard, _StridedShard
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx
from torch.utils._pytree import tree_map

from ..capture import activation_checkpointing
from ..cost_model.devices import H100, DeviceSpec
from ..options.dtensor_query import propagator
from ..torch_compat import last_node, scalar_shape_adjusters, squeeze_dims_variants
from ..options.strategies import NodeStrategy, format_specs
from ..capture.tracing import TracedStep, module_path
from .context_parallel import lower_attention
from .sequence_layout import SequenceLayout, plan_sequence_layout
from . import local_map  # noqa: F401  (registers the local_map regions' lowerings)
from .moe_dispatch import LOCAL_LOWERINGS
from .node_templates import Template, has_mask_partial, nodes_after, template_key, tracer_of_proxy_mode
from .redistribute import (
    REDISTRIBUTE_KEY,
    SOURCE_KEY,
    ApplyError,
    redistribute,
    replicate_spec,
    same_placements,
    user_spec,
)

logger = logging.getLogger(__name__)


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
    # In-place updates the step makes, ("buffer", FQN) or ("input", tensor
    # index): forward outputs after the user's, each in its target's layout.
    mutations: list[tuple[str, str | int]] = field(default_factory=list)
    seconds: float = 0.0
    ac_stats: object = None
    extra: dict = field(default_factory=dict)

    @property
    def num_fwd_outputs(self) -> int:
        return len(self.output_specs) + len(self.mutations)

    @property
    def num_primals(self) -> int:
        return len(self.param_fqns) + len(self.buffer_fqns) + len(self.input_specs) + 1

    def primal_names(self) -> list[str]:
        """Names of the step's primal inputs (parameters, buffers, inputs,
        coords) as placeholders of the joint, forward and backward graphs;
        a layer-folded joint graph (``extra["folded"]``) has fewer, but the
        unfolded forward and backward graphs use these."""
        if self.extra.get("folded"):
            return [f"primals_{i + 1}" for i in range(self.num_primals)]
        return [ph.name for ph in self.gm.graph.find_nodes(op="placeholder")][: self.num_primals]


def local_shape(spec: DTensorSpec) -> tuple[int, ...]:
    """Shape of one rank's shard (even sharding only, as planned; a
    ``_StridedShard`` splits its dim like a ``Shard``)."""
    shape = list(spec.tensor_meta.shape)
    for mesh_dim, p in enumerate(spec.placements):
        if isinstance(p, (Shard, _StridedShard)):
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


def _localize_schema(op, args, kwargs, in_specs, out_specs) -> OpSchema:
    """Args with shape arguments rewritten for the local shards, as DTensor's
    sharding propagation does for the chosen option (tensor args are specs)."""
    prop = propagator()
    schema = OpSchema(op, args, kwargs)
    if (
        op in prop.op_to_shape_and_stride_idx
        and isinstance(out_specs, DTensorSpec)
        and any(p.is_shard() for p in out_specs.placements)
    ):
        schema = prop._adjust_shape_and_stride_args(out_specs.tensor_meta, schema, out_specs)
    adjusters = scalar_shape_adjusters(prop)
    if op in adjusters and any(p.is_shard() for s in in_specs for p in s.placements):
        schema = adjusters[op](list(in_specs), schema)
    if op in squeeze_dims_variants(prop):
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


# Ops that need their input's strides to be compatible with the result
# (aliasing views, and ``_unsafe_view``, which AOT autograd emits in place
# of views of fresh results).
_UNSAFE_VIEWS = {torch.ops.aten._unsafe_view.default}


def _needs_view_strides(op) -> bool:
    return isinstance(op, torch._ops.OpOverload) and (op.is_view or op in _UNSAFE_VIEWS)


def _viewable_args(op, args: tuple, kwargs: dict) -> tuple:
    """``args`` with the viewed tensor made contiguous where the local shard
    cannot be viewed as the op asks.

    A redistribution does not keep the strides the global trace had (an
    all-to-all returns a permuted-then-flattened tensor, a gathered transpose
    is contiguous in another order), so a ``view`` that was valid on the
    global tensor can be invalid on the local one. Only those ops get a
    copy; a view that works stays a view. Probed on the fake value outside
    the tracer, so a failed try leaves no node behind.
    """
    if not _needs_view_strides(op) or not args or not isinstance(args[0], torch.Tensor):
        return args
    x = args[0]
    if x.is_contiguous():
        return args
    with disable_proxy_modes_tracing():
        try:
            op(*args, **kwargs)
            return args
        except (RuntimeError, ValueError):
            pass
    return (x.contiguous(),) + tuple(args[1:])


class _Interpreter:
    """Runs the joint graph's nodes on local (fake) shards under make_fx."""

    def __init__(self, traced: TracedStep, strategies, choice, mesh: DeviceMesh, device: DeviceSpec = H100):
        self.traced = traced
        self.strategies = strategies
        self.choice = choice
        self.mesh = mesh
        self.device = device  # the planning device: redistributions run the plan costed for it
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
        self.templates: dict[tuple, Template] = {}
        self.template_hits = 0
        # which shards are in the balanced sequence layout (context parallelism)
        self.sequence_layout = SequenceLayout()

    # -- helpers ---------------------------------------------------------------
    def _tracer_graph(self) -> torch.fx.Graph | None:
        tracer = tracer_of_proxy_mode()
        return tracer.graph if tracer is not None else None

    def _redistribute(self, x, src: DTensorSpec, dst: DTensorSpec, what: str, producer=None, consumer=None):
        src_balanced = self.sequence_layout.dims_of(producer)
        dst_balanced = self.sequence_layout.dims_of(consumer)
        if same_placements(src.placements, dst.placements) and src_balanced == dst_balanced:
            return x
        graph = self._tracer_graph()
        last = last_node(graph)
        src_masks = self.masks.get(producer) if producer is not None else None
        dst_masks = self.masks.setdefault(consumer, {}) if consumer is not None else None
        try:
            out = redistribute(
                x,
                src,
                dst,
                self.coords,
                src_masks=src_masks,
                dst_masks=dst_masks,
                device=self.device,
                src_balanced=src_balanced,
                dst_balanced=dst_balanced,
            )
        except NotImplementedError as e:
            raise ApplyError(f"{what}: cannot redistribute {format_specs(src)} -> {format_specs(dst)}: {e}") from e
        if graph is not None:
            tag = (what, format_specs(src), format_specs(dst))
            for n in nodes_after(graph, last):
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

    def _node_error(self, node: torch.fx.Node, e: Exception) -> ApplyError:
        """``e`` raised while running ``node``, said with what it was doing:
        the node, its module path and the placements involved."""
        strat = self.strategies.get(node)
        idx = self.choice.get(node.name)
        where = f"node {node.name} ({node.target}) in module {module_path(node) or '<top level>'}"
        if strat is None or idx is None:
            return ApplyError(f"{where}: {type(e).__name__}: {e}")
        opt = strat.options[idx]
        have = ", ".join(f"{p.name} {format_specs(self.spec.get(p))}" for p in strat.inputs) or "-"
        return ApplyError(
            f"{where}: {type(e).__name__}: {e}\n  input layouts {have}; planned option: inputs "
            f"{format_specs(opt.input_specs)} -> output {format_specs(opt.output_specs)}"
        )

    # -- nodes -------------------------------------------------------------------
    def call_function(self, node: torch.fx.Node):
        strat, opt = _chosen(self.strategies, self.choice, node)
        self.spec[node] = opt.output_specs
        if strat.getitem_index is not None:
            parent = strat.inputs[0]
            return self.env[parent][strat.getitem_index]
        if node.target is operator.getitem:
            raise ApplyError(f"{node.name}: getitem without a parent option")
        tracer = tracer_of_proxy_mode()
        if tracer is None or not self.use_templates:
            return self._trace_node(node, strat, opt)
        inputs = [self.env[p] for p in strat.inputs]
        key = template_key(node, [self.spec[p] for p in strat.inputs], opt, inputs, self.env)
        if key is not None and self.sequence_layout.balanced:
            # the shards' layouts change what the node's redistributions emit
            dims = self.sequence_layout.dims_of
            key = (*key, dims(node), tuple(dims(p) for p in strat.inputs))
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
        self.templates[key] = Template.record(tracer, last, node, strat.inputs, inputs, out)
        return out

    def _trace_node(self, node: torch.fx.Node, strat, opt):
        in_specs = opt.input_specs
        locals_: list[torch.Tensor] = []
        for k, producer in enumerate(strat.inputs):
            locals_.append(
                self._redistribute(
                    self.env[producer],
                    self.spec[producer],
                    in_specs[k],
                    f"{producer.name}->{node.name}",
                    producer,
                    node,
                )
            )
            if has_mask_partial(opt.output_specs) and self.masks.get(producer):
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
        largs = _viewable_args(schema.op, largs, lkwargs)
        op_ = schema.op
        lower = LOCAL_LOWERINGS.get(op_)
        lowered = lower(opt, self.mesh, largs, lkwargs) if lower is not None else None
        if lowered is None:  # sequence-sharded attention gathers K/V itself
            balanced = bool(self.sequence_layout.dims_of(node))
            lowered = lower_attention(op_, opt, self.mesh, self.coords, largs, lkwargs, self.device, balanced=balanced)
        if lowered is not None:  # an op whose option runs its own collectives
            op_, largs, lkwargs = lowered
        out = op_(*largs, **lkwargs)
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
        return self._redistribute(out, replicate_spec(spec), spec, f"factory {node.name}", consumer=node)

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
            last = last_node(graph)
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
                    try:
                        self.env[node] = self.call_function(node)
                    except Exception as e:
                        raise self._node_error(node, e) from e
                else:
                    raise ApplyError(f"unsupported node kind {node.op} ({node.name})")
            _set_source(graph, last, node)

        outs: list = []
        for i, node in enumerate(traced.output_nodes):
            last = graph._root.prev if graph is not None else None
            with fx_traceback.set_current_meta(node):
                outs.append(
                    self._redistribute(self.env[node], self.spec[node], layout.output_specs[i], f"output {i}", node)
                )
            _set_source(graph, last, node)
        for m, spec in zip(traced.mutations, layout.mutation_specs):
            # the new value of a mutated buffer/input, laid out as its target
            last = graph._root.prev if graph is not None else None
            with fx_traceback.set_current_meta(m.node):
                outs.append(
                    self._redistribute(
                        self.env[m.node], self.spec[m.node], spec, f"update of {m.kind} {m.target}", m.node
                    )
                )
            _set_source(graph, last, m.node)
        for fqn, wants in zip(layout.param_fqns, layout.has_grad):
            grad = traced.grad_nodes.get(fqn)
            if not wants:
                outs.append(None)
                continue
            last = graph._root.prev if graph is not None else None
            with fx_traceback.set_current_meta(grad):
                outs.append(
                    self._redistribute(self.env[grad], self.spec[grad], layout.param_specs[fqn], f"grad of {fqn}", grad)
                )
            _set_source(graph, last, grad)
        return outs


def _set_source(graph: torch.fx.Graph | None, last: torch.fx.Node | None, node: torch.fx.Node) -> None:
    """Record ``node`` as the joint node that the local nodes after ``last`` came from."""
    if graph is not None:
        for n in nodes_after(graph, last):
            n.meta.setdefault(SOURCE_KEY, node.name)


@dataclass
class _Layout:
    param_fqns: list[str]
    buffer_fqns: list[str]
    input_nodes: list[torch.fx.Node]
    param_specs: dict[str, DTensorSpec]
    output_specs: list[DTensorSpec]
    differentiable_outputs: list[int]
    has_grad: list[bool]
    mutation_specs: list[DTensorSpec] = field(default_factory=list)


def build_local_joint(
    traced: TracedStep,
    strategies: dict[torch.fx.Node, NodeStrategy],
    choice: dict[str, int],
    mesh: DeviceMesh,
    *,
    copy_repeated: bool = True,
    device: DeviceSpec = H100,
    balance_sequence: bool = True,
) -> LocalJoint:
    """Trace the rank-local joint graph of ``traced`` under the plan ``choice``
    (node name -> option index into ``strategies[node].options``).

    ``copy_repeated``: trace each structurally identical node once and copy
    its local nodes for the others (same graph, much faster on repeated
    layers); False traces every node. ``device``: the one the plan was
    costed for (redistributions run the plan costed for it).
    ``balance_sequence``: causal attention split along the sequence runs on
    the balanced layout where the plan allows it (:mod:`.sequence_layout`);
    False keeps DTensor's contiguous shards everywhere."""
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
    mutation_specs = [
        buffer_specs[m.target] if m.kind == "buffer" else spec_of(traced.input_nodes[m.target])
        for m in traced.mutations
    ]
    layout = _Layout(
        param_fqns, buffer_fqns, input_nodes, param_specs, output_specs, differentiable, has_grad, mutation_specs
    )

    def fake_local(spec: DTensorSpec):
        shape = local_shape(spec)
        return torch.empty_strided(
            shape, _contiguous_stride(shape), dtype=spec.tensor_meta.dtype, device=mesh.device_type
        )

    interp = _Interpreter(traced, strategies, choice, mesh, device)
    interp.use_templates = copy_repeated
    if balance_sequence:
        interp.sequence_layout = plan_sequence_layout(traced.gm.graph, strategies, choice, mesh)

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
        mutations=[(m.kind, m.target) for m in traced.mutations],
        seconds=seconds,
        ac_stats=ac_stats,
    )


def full_local_joint(
    short: LocalJoint, traced: TracedStep, strategies: dict[torch.fx.Node, NodeStrategy], choice: dict[str, int]
) -> LocalJoint:
    """The full model's :class:`LocalJoint` for a layer-folded apply
    (:mod:`.fold`): every parameter's name and layout, with the folded joint
    graph ``short.gm`` (the full one was never built)."""
    param_fqns = list(traced.param_nodes)
    param_specs = {fqn: _chosen(strategies, choice, traced.param_nodes[fqn])[1].output_specs for fqn in param_fqns}
    has_grad = [traced.grad_nodes.get(fqn) is not None for fqn in param_fqns]
    return dataclasses.replace(
        short, param_fqns=param_fqns, param_specs=param_specs, has_grad=has_grad, extra={**short.extra, "folded": True}
    )
