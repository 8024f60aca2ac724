"""Copying the local nodes of structurally identical joint-graph nodes.

The repeated layers of a model make the same local nodes over and over:
same op, constant arguments, input tensors (shape, strides, dtype, which
inputs alias) and layout changes. :func:`template_key` says when two joint
nodes are such twins; a :class:`Template` records the local nodes the first
one emitted under ``make_fx`` and replays them for the others as node copies
with fresh fake values: no dispatch, no sharding propagation. Used by
:mod:`.local_graph`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_impls import fast_detach
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _MaskPartial
from torch.utils._pytree import tree_flatten, tree_unflatten

from .redistribute import REDISTRIBUTE_KEY, SOURCE_KEY, ApplyError


def tracer_of_proxy_mode():
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return mode.tracer if mode is not None else None


def has_mask_partial(spec) -> bool:
    if isinstance(spec, DTensorSpec):
        return any(isinstance(p, _MaskPartial) for p in spec.placements)
    if isinstance(spec, (tuple, list)):
        return any(has_mask_partial(s) for s in spec)
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
class Template:
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
    def record(tracer, last, node, producers, inputs, out) -> "Template | None":
        from torch.fx.experimental.proxy_tensor import get_proxy_slot

        nodes = list(nodes_after(tracer.graph, last))
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
        return Template(
            nodes, input_of, input_storages, storages, out_spec, refs, requires_grad, redistributed, tags, factory_tag
        )

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
    copy (the caller sets it); see :func:`insert_like`."""
    args = torch.fx.node.map_arg(tn.args, lambda a: arg_map.get(a, a))
    kwargs = torch.fx.node.map_arg(tn.kwargs, lambda a: arg_map.get(a, a))
    return insert_like(graph, tn, args, kwargs, tn.name)


def insert_like(graph: torch.fx.Graph, like: torch.fx.Node, args, kwargs, name: str) -> torch.fx.Node:
    """A node doing what ``like`` does on ``args``/``kwargs``, named ``name``
    (or a fresh variant), at the graph's insert point; no meta.

    ``Graph.create_node`` minus its scan of the arguments for raw symbolic
    values: ``like`` passed that scan when it was made, and its copies only
    swap node arguments for other nodes (``_const_sig`` rejects SymInts for
    templates), so they have none either. The scan is a pytree walk per
    node, most of the time of copying a large graph."""
    if not args:
        args = ()
    if not kwargs:
        kwargs = torch.fx.immutable_collections.immutable_dict()
    namespace = graph._graph_namespace
    name = namespace.create_name(name, None)
    n = torch.fx.Node(graph, name, like.op, like.target, args, kwargs, like.type)
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


def nodes_after(graph: torch.fx.Graph, last: torch.fx.Node | None):
    """Nodes appended to ``graph`` after ``last`` (None: all of them)."""
    root = graph._root
    n = (last if last is not None else root).next
    while n is not root:
        yield n
        n = n.next


def template_key(node: torch.fx.Node, specs: list, opt, inputs: list, env: dict) -> tuple | None:
    """What the local nodes emitted for ``node`` depend on: the op, its
    constant arguments, each input's local tensor and layout change (from
    ``specs``, the producers' layouts, to ``opt``'s), the output layout.
    None: not cacheable."""
    for v in inputs:
        if not isinstance(v, torch.Tensor):
            return None
    if (
        has_mask_partial(opt.output_specs)
        or any(map(has_mask_partial, specs))
        or any(map(has_mask_partial, opt.input_specs))
    ):
        return None
    try:
        consts = _const_sig((node.args, node.kwargs), env)
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
