"""Apply stage 4: the parallel ``nn.Module`` handed back to the user.

``make_parallel_module`` copies the original module's structure (on meta,
with its own class, so ``init_weights``/``reset_parameters`` and any other
method stay the model's own), replaces every parameter and buffer by a
DTensor with the plan's placements (meta until ``to_empty``), and swaps the
copy's class for a subclass whose ``forward`` runs the rank-local step.
FQNs, and so ``state_dict`` keys, are unchanged; tied parameters stay tied.

``init_weights``/``reset_parameters`` (where the model defines them) run the
model's own method under :func:`.init.full_tensor_rng`: every random init of
a DTensor parameter draws the full tensor and keeps this rank's shard, so a
seeded init equals the single-device init of the same seed and all ranks stay
in RNG lockstep, at the cost of one full parameter at a time (see
:mod:`.init`). ``state_dict()`` holds DTensors, so
``torch.distributed.checkpoint`` saves and loads (and reshards between plans)
as is; ``load_state_dict`` also takes full tensors.

The forward takes this rank's LOCAL shard of every input (what the input's
planned placement gives this rank) and returns local outputs (Partial mesh
dims reduced). Non-tensor arguments must equal the traced constants. The
step's in-place updates (buffers, e.g. BatchNorm's running statistics, and
tensor inputs) come back as extra forward outputs and are copied into this
rank's shard of the buffer / the caller's tensor after the step; a mutated
buffer or input is handed to the step as a copy, so the value the step
saved for backward is not the one overwritten.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.utils._pytree import TreeSpec, keystr, tree_flatten_with_path, tree_unflatten

from ..errors import ApplyError
from ..options.strategies import format_specs
from ..options.placements import on_mesh
from ..torch_compat import current_ranks
from .init import wrap_init
from .local_graph import LocalJoint, local_shape
from .runtime import ParallelStep

logger = logging.getLogger(__name__)

STATE_ATTR = "_parallel_state"


@dataclass
class InputSlot:
    """One leaf of the flattened ``(args, kwargs)`` the forward expects."""

    path: str  # e.g. "[0][0]" -> shown as args[0]
    spec: DTensorSpec | None  # planned layout of a used tensor input
    value: Any = None  # the traced value of a non-tensor leaf
    kind: str = "tensor"  # "tensor", "const" (baked into the graph) or "unused"


@dataclass
class ParallelState:
    """Everything the parallel module needs besides its parameters."""

    mesh: DeviceMesh
    step: ParallelStep
    in_spec: TreeSpec
    inputs: list[InputSlot]
    out_spec: TreeSpec | None
    # FQN -> every (module, attribute) slot holding that parameter (tied
    # parameters: all aliases under the canonical FQN).
    param_slots: dict[str, list[tuple[nn.Module, str]]] = field(default_factory=dict)
    buffer_slots: dict[str, list[tuple[nn.Module, str]]] = field(default_factory=dict)

    @property
    def local(self) -> LocalJoint:
        return self.step.local


class ParallelModuleMixin:
    """Put in front of the model's class by :func:`make_parallel_module`."""

    # -- graphs ----------------------------------------------------------------
    @property
    def parallel_state(self) -> ParallelState:
        return getattr(self, STATE_ATTR)

    @property
    def parallel_graph(self) -> torch.fx.GraphModule:
        """The rank-local joint forward+backward graph (with collectives)."""
        return self.parallel_state.local.gm

    @property
    def forward_graph(self) -> torch.fx.GraphModule:
        return self.parallel_state.step.graphs.fw

    # -- CUDA graphs (apply_placement(..., cudagraphs=True)) --------------------
    @property
    def cuda_graph_inputs(self):
        """Which inputs of the forward and backward graphs keep their addresses
        and what a step copies (:class:`~autoparallel.apply.cudagraphs.StaticInputs`),
        or None when the module runs without CUDA graphs."""
        session = self.parallel_state.step.cuda_graphs
        return session.inputs if session is not None else None

    def release_cuda_graphs(self) -> bool:
        """Release this module's captured CUDA graphs (call before
        ``destroy_process_group``); the next step captures again."""
        session = self.parallel_state.step.cuda_graphs
        return session.release() if session is not None else False

    @property
    def backward_graph(self) -> torch.fx.GraphModule:
        return self.parallel_state.step.graphs.bw

    # -- materialisation -------------------------------------------------------
    def to_empty(self, *, device, recurse: bool = True):
        """Allocate every parameter's and buffer's local shard on ``device``."""
        st = self.parallel_state
        with unset_fake_temporarily():
            for fqn, slots in st.param_slots.items():
                old = getattr(*slots[0])
                new = nn.Parameter(_empty_dtensor(old, device), requires_grad=old.requires_grad)
                for mod, name in slots:
                    mod._parameters[name] = new
            for fqn, slots in st.buffer_slots.items():
                old = getattr(*slots[0])
                spec = st.local.buffer_specs[fqn]
                new = _empty_dtensor(_as_dtensor(old, spec, f"buffer {fqn}"), device)
                for mod, name in slots:
                    mod._buffers[name] = new
        return self

    # -- forward -----------------------------------------------------------------
    def forward(self, *args, **kwargs):
        st = self.parallel_state
        self._check_world(st)
        callers: list[torch.Tensor] = []  # the caller's tensor inputs, for in-place updates
        primals = self._param_locals(st) + self._buffer_locals(st) + self._input_locals(st, args, kwargs, callers)
        primals.append(_coords(st.mesh, primals[0].device if primals else None))
        outs = st.step(primals)
        n_out = len(st.local.output_specs)
        if st.local.mutations:
            self._write_back(st, outs[n_out:], callers)
            outs = outs[:n_out]
        if st.out_spec is None:
            return outs[0] if len(outs) == 1 else outs
        return tree_unflatten(list(outs), st.out_spec)

    def _write_back(self, st: ParallelState, values, callers: list[torch.Tensor]) -> None:
        """The step's in-place updates of buffers and inputs, as eager makes them."""
        with torch.no_grad():
            for (kind, target), value in zip(st.local.mutations, values):
                if kind == "buffer":
                    dest = getattr(*st.buffer_slots[target][0])
                else:
                    dest = callers[target]
                if isinstance(dest, DTensor):
                    dest = dest._local_tensor
                dest.copy_(value)

    def _check_world(self, st: ParallelState) -> None:
        if not dist.is_initialized():
            raise ApplyError("the parallel module needs the mesh's process group: call init_process_group first")
        # The mesh may cover a subset of the ranks (other ranks run other
        # pipeline stages, say), but all of its ranks must exist and this
        # rank must be one of them.
        world = dist.get_world_size()
        # the mesh's rank tensor is a real CPU tensor: read it outside any
        # fake mode the step runs under (MemTracker's fake-tensor runs)
        with unset_fake_temporarily():
            ranks = st.mesh.mesh.flatten().tolist()
        if max(ranks) >= world:
            raise ApplyError(
                f"the plan is for a mesh of {st.mesh.size()} ranks {tuple(st.mesh.shape)} (ranks up to "
                f"{max(ranks)}) but the process group has {world}"
            )
        outside = [r for r in current_ranks() if r not in ranks]
        if outside:
            raise ApplyError(f"rank {outside[0]} is not in the plan's mesh {tuple(st.mesh.shape)} of ranks {ranks}")

    def _param_locals(self, st: ParallelState) -> list[torch.Tensor]:
        out = []
        for fqn in st.local.param_fqns:
            p = getattr(*st.param_slots[fqn][0])
            if not isinstance(p, DTensor):
                raise ApplyError(f"parameter {fqn} was replaced by a {type(p).__name__}; expected a DTensor")
            local = p.to_local()
            if local.is_meta:
                raise ApplyError(
                    f"parameter {fqn} is on the meta device: call to_empty(device=...) and then "
                    "init_weights() or load_state_dict() before running the parallel module"
                )
            out.append(local)
        return out

    def _buffer_locals(self, st: ParallelState) -> list[torch.Tensor]:
        out = []
        for fqn in st.local.buffer_fqns:
            slots = st.buffer_slots[fqn]
            b = getattr(*slots[0])
            spec = st.local.buffer_specs[fqn]
            if not isinstance(b, DTensor):
                # e.g. init_weights() recomputed a buffer as a plain (full) tensor
                b = _as_dtensor(b, spec, f"buffer {fqn}")
                for mod, name in slots:
                    mod._buffers[name] = b
            if b.is_meta:
                raise ApplyError(f"buffer {fqn} is on the meta device: call to_empty(device=...) first")
            local = b.to_local()
            # the step may save the value it read for backward; the update
            # written back after the forward must not change that copy
            out.append(local.clone() if ("buffer", fqn) in st.local.mutations else local)
        return out

    def _input_locals(self, st: ParallelState, args, kwargs, callers: list) -> list[torch.Tensor]:
        leaves, spec = tree_flatten_with_path((args, kwargs))
        if spec != st.in_spec:
            from ..validation import describe_call

            raise TypeError(
                f"the parallel module was traced with inputs structured as {describe_call(st.in_spec)}, "
                f"got {describe_call(spec)}: call it the way the example inputs were given"
            )
        out = []
        for (path, leaf), slot in zip(leaves, st.inputs):
            name = _input_name(path)
            if slot.kind == "unused":
                callers.append(leaf)
                continue
            if slot.kind == "const":
                if isinstance(leaf, torch.Tensor) or type(leaf) is not type(slot.value) or leaf != slot.value:
                    raise ValueError(
                        f"input {name}: the step was traced with {name}={slot.value!r} (a non-tensor argument is a "
                        f"constant of the traced step), got {leaf!r}; plan again with this value to use it"
                    )
                continue
            callers.append(leaf)
            if isinstance(leaf, DTensor):
                if on_mesh(tuple(leaf.placements), tuple(leaf.device_mesh.shape)) != tuple(slot.spec.placements):
                    raise ValueError(
                        f"input {name}: DTensor placements {leaf.placements} but the plan expects "
                        f"{slot.spec.placements}"
                    )
                leaf = leaf.to_local()
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"input {name}: expected a tensor, got {type(leaf).__name__}")
            want = local_shape(slot.spec)
            meta = slot.spec.tensor_meta
            if tuple(leaf.shape) != want:
                raise ValueError(
                    f"input {name}: local shape {tuple(leaf.shape)}, expected the local shard "
                    f"{want} of the global {tuple(meta.shape)} laid out as {format_specs(slot.spec)} "
                    f"on mesh {tuple(st.mesh.shape)}"
                )
            if leaf.dtype != meta.dtype:
                raise ValueError(f"input {name}: dtype {leaf.dtype}, expected {meta.dtype}")
            if leaf.device.type != st.mesh.device_type:
                raise ValueError(f"input {name}: on device {leaf.device}, expected a {st.mesh.device_type} tensor")
            local = leaf.contiguous()
            out.append(local.clone() if ("input", len(callers) - 1) in st.local.mutations and local is leaf else local)
        return out


def _input_name(path) -> str:
    # path of the (args, kwargs) pair: first key picks args or kwargs
    rest = keystr(path[1:])
    return ("args" if getattr(path[0], "idx", 0) == 0 else "kwargs") + rest


def _coords(mesh: DeviceMesh, device) -> torch.Tensor:
    """This rank's mesh coordinates (per simulated rank under LocalTensorMode)."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    lm = enabled_local_tensor_mode()
    if lm is not None:
        ranks = mesh.mesh

        def coords_of(r: int) -> torch.Tensor:
            return (ranks == r).nonzero()[0].to(torch.int64).to(device or "cpu")

        return lm.rank_map(coords_of)
    coord = mesh.get_coordinate()
    if coord is None:
        raise ApplyError(f"rank {dist.get_rank()} is not part of the mesh {mesh}")
    return torch.tensor(coord, dtype=torch.int64, device=device)


def _empty_dtensor(old: DTensor, device) -> DTensor:
    spec = old._spec
    local = torch.empty(local_shape(spec), dtype=old.dtype, device=device)
    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=old.shape, stride=old.stride())


def _meta_dtensor(spec: DTensorSpec, requires_grad: bool = False) -> DTensor:
    meta = spec.tensor_meta
    local = torch.empty(local_shape(spec), dtype=meta.dtype, device="meta")
    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=meta.shape, stride=meta.stride)


def _as_dtensor(t: torch.Tensor, spec: DTensorSpec, name: str = "tensor") -> DTensor:
    if isinstance(t, DTensor):
        return t
    if t.is_meta:
        return _meta_dtensor(spec)
    if tuple(t.shape) != tuple(spec.tensor_meta.shape):
        raise ValueError(
            f"{name}: expected a full tensor of shape {tuple(spec.tensor_meta.shape)} (or a DTensor laid out "
            f"as the plan says), got shape {tuple(t.shape)}"
        )
    # every rank holds the full value: split locally, no communication
    return distribute_tensor(t, spec.mesh, spec.placements, src_data_rank=None)


def _slots(model: nn.Module, named) -> dict[str, list[tuple[nn.Module, str]]]:
    out: dict[str, list[tuple[nn.Module, str]]] = {}
    for fqn, _ in named:
        mod_path, _, name = fqn.rpartition(".")
        mod = model.get_submodule(mod_path) if mod_path else model
        out.setdefault(fqn, []).append((mod, name))
    return out


_class_cache: dict[type, type] = {}


_INIT_METHODS = ("init_weights", "reset_parameters")


def _parallel_class(cls: type) -> type:
    if cls not in _class_cache:
        # the model's own init methods, run so that random inits of DTensor
        # parameters equal the single-device init (see .init)
        ns = {name: wrap_init(getattr(cls, name)) for name in _INIT_METHODS if callable(getattr(cls, name, None))}
        _class_cache[cls] = type(f"Parallel{cls.__name__}", (ParallelModuleMixin, cls), ns)
    return _class_cache[cls]


def _full_state_dict_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
    """load_state_dict with full (unsharded) tensors: split them per the plan."""
    st: ParallelState = getattr(module, STATE_ATTR)
    specs = {**st.local.param_specs, **st.local.buffer_specs}
    tied = {alias: fqn for fqn, slots in st.param_slots.items() for alias in _aliases(module, slots)}
    for key, value in list(state_dict.items()):
        if not key.startswith(prefix) or isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
            continue
        fqn = key[len(prefix) :]
        spec = specs.get(tied.get(fqn, fqn))
        if spec is not None:
            state_dict[key] = _as_dtensor(value, spec, f"load_state_dict key {key!r}")


def _aliases(root: nn.Module, slots) -> list[str]:
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    return [f"{names[id(m)]}.{a}" if names[id(m)] else a for m, a in slots]


def make_parallel_module(
    model: nn.Module,
    step: ParallelStep,
    in_spec: TreeSpec,
    inputs: list[InputSlot],
    out_spec: TreeSpec | None,
    tied_params: dict[str, str],
) -> nn.Module:
    """The user-facing parallel module for ``model`` running ``step``."""
    local = step.local
    mesh = local.mesh
    with unset_fake_temporarily():
        # Copy the structure without copying parameter data.
        memo: dict[int, Any] = {}
        for t in list(model.parameters()) + list(model.buffers()):
            memo[id(t)] = torch.empty(0, device="meta")
        copy_ = copy.deepcopy(model, memo)

        param_slots: dict[str, list[tuple[nn.Module, str]]] = {}
        for fqn, slots in _slots(copy_, model.named_parameters(remove_duplicate=False)).items():
            param_slots.setdefault(tied_params.get(fqn, fqn), []).extend(slots)
        # a buffer shared by several modules: all its names under the first
        first: dict[int, str] = {}
        buffer_slots: dict[str, list[tuple[nn.Module, str]]] = {}
        for fqn, b in model.named_buffers(remove_duplicate=False):
            canonical = first.setdefault(id(b), fqn)
            buffer_slots.setdefault(canonical, []).extend(_slots(copy_, [(fqn, b)])[fqn])
        missing = set(param_slots) - set(local.param_specs)
        if missing:
            raise ApplyError(f"parameters not in the traced graph: {sorted(missing)}")
        for fqn, slots in param_slots.items():
            requires_grad = getattr(model.get_parameter(fqn), "requires_grad", True)
            p = nn.Parameter(_meta_dtensor(local.param_specs[fqn]), requires_grad=requires_grad)
            for mod, name in slots:
                mod._parameters[name] = p
        for fqn, slots in list(buffer_slots.items()):
            spec = local.buffer_specs.get(fqn)
            if spec is None:  # not used by the step: keep a plain meta copy
                buffer_slots.pop(fqn)
                continue
            b = _meta_dtensor(spec)
            for mod, name in slots:
                mod._buffers[name] = b

    copy_.__class__ = _parallel_class(type(model))
    setattr(
        copy_,
        STATE_ATTR,
        ParallelState(mesh, step, in_spec, inputs, out_spec, param_slots, buffer_slots),
    )
    copy_._register_load_state_dict_pre_hook(_full_state_dict_hook, with_module=True)
    return copy_
