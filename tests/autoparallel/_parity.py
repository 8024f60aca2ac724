"""Plan a model on a mesh (default 2x2 ("dp", "tp")), apply it, and check one training
step on its simulated ranks (LocalTensorMode) against the single-device model:
the loss, every gradient and every buffer after the step.

Models return a scalar loss (wrap a model and its loss in one module), so
every rank's loss is the global loss. Tensor inputs are batch-split over
"dp" when their first dim divides, replicated otherwise; ``local_inputs``
gives each simulated rank its shard.

``slow_compute_device()`` is a DeviceSpec whose compute is so slow that the
plan shards compute (batch over both mesh dims, heads over tp), which the
default H100 cost model does not do for tiny models;
``sharded_matmul_fraction(plan)`` measures how much it does.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_flatten, tree_map

from autoparallel import AutoParallel
from autoparallel.cost_model import DeviceSpec
from autoparallel.passes import PassOptions

MESH_SHAPE = (2, 2)
# LocalTensorMode simulates sorted process groups only (see test_apply.py).
LOCAL_TENSOR_PASSES = PassOptions(column_major_all_gather="reorder")

MATMUL_OPS = {
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten.convolution.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
}


def slow_compute_device() -> DeviceSpec:
    """H100 with ~1e6x slower compute and memory: communication is free by
    comparison, so the plan splits every op it can."""
    h100 = DeviceSpec.get("H100")
    return dataclasses.replace(h100, name="slow-compute", peak_bf16=1e9, peak_fp32=1e9, peak_tf32=1e9, hbm_bw=1e9)


def sharded_matmul_fraction(plan) -> float:
    """Fraction of the forward matmul-like nodes whose output is split (or
    partial) over some mesh dim, i.e. whose compute is divided."""
    mms = [n for n in plan.nodes.values() if n.phase == "forward" and n.op in MATMUL_OPS]
    assert mms, "no forward matmuls in the plan"
    split = [n for n in mms if set(n.output_placements.replace("(", "").replace(")", "")) - set("R, ")]
    return len(split) / len(mms)


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def batch_placement(t: torch.Tensor, mesh) -> tuple:
    """Batch split over the first mesh dim when it divides, else replicated."""
    rest = (Replicate(),) * (mesh.ndim - 1)
    if t.dim() and t.shape[0] % mesh.size(0) == 0:
        return (Shard(0),) + rest
    return (Replicate(),) + rest


def _batch_chunk(t: torch.Tensor, mesh, rank: int) -> torch.Tensor:
    """Rank ``rank``'s chunk of ``t`` under :func:`batch_placement`."""
    if batch_placement(t, mesh)[0] == Replicate():
        return t.clone()
    per = t.shape[0] // mesh.size(0)
    coord = rank // (mesh.size() // mesh.size(0))  # row-major: dim 0 is outermost
    return t[coord * per : (coord + 1) * per].clone()


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs)


def plan_and_apply(
    build: Callable[[], nn.Module],
    inputs,
    *,
    device=None,
    time_limit: float | None = None,
    rel_gap: float | None = None,
    mesh_shape: tuple[int, ...] = MESH_SHAPE,
    mesh_dim_names: tuple[str, ...] = ("dp", "tp"),
    pins: dict | None = None,
):
    """Plan ``build()`` (on meta) for the mesh (default 2x2) with ``inputs``
    (a tuple of positional args or a dict of kwargs, real tensors: their
    meta copies are traced) and apply the plan. ``pins``: joint-graph node
    name -> output placements. Returns (parallel module, plan, mesh)."""
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_dim_names)
    with torch.device("meta"):
        model = build()
    meta_inputs = tree_map(lambda t: t.to("meta") if _is_tensor(t) else t, inputs)
    kwargs = {}
    if device is not None:
        kwargs["device"] = device
    with AutoParallel(model, mesh, meta_inputs, time_limit=time_limit, rel_gap=rel_gap, **kwargs) as autop:
        leaves = [t for t in tree_flatten(inputs)[0] if _is_tensor(t)]
        autop.add_input_constraints([batch_placement(t, mesh) for t in leaves])
        for node in autop.traced.gm.graph.nodes:
            if pins and node.name in pins:
                autop.add_node_constraint(node, pins[node.name])
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan, pass_options=LOCAL_TENSOR_PASSES)
    return parallel, plan, mesh


def local_inputs(lm: LocalTensorMode, inputs, mesh):
    """Each simulated rank's shard of ``inputs`` (batch chunk on its
    coordinate on the first mesh dim)."""

    def shard(t):
        if not _is_tensor(t):
            return t
        return lm.rank_map(lambda r: _batch_chunk(t, mesh, r))

    return tree_map(shard, inputs)


def _full(t, what: str) -> torch.Tensor:
    """The global value of a DTensor of LocalTensors; every simulated rank
    must see the same one (a replicated value that differs between ranks is
    a wrong plan, not noise)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    if isinstance(t, LocalTensor):
        per_rank = [t._local_tensors[r] for r in sorted(t._local_tensors)]
        for r, x in enumerate(per_rank[1:], 1):
            torch.testing.assert_close(x, per_rank[0], rtol=0, atol=0, msg=lambda m: f"{what}: rank {r} != rank 0: {m}")
        t = per_rank[0]
    return t


def reference_step(build, inputs, seed: int = 0):
    """Single-device step: (initial state dict, loss, grads, buffers after)."""
    torch.manual_seed(seed)
    ref = build()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    # non-persistent buffers (RoPE tables) are computed in __init__, which the
    # meta-built parallel model never ran with real numbers
    state.update({k: v.clone() for k, v in ref.named_buffers() if k not in state})
    loss = _call(ref, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    buffers = {n: b.clone() for n, b in ref.named_buffers()}
    return state, loss.detach(), grads, buffers


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    """Relative ``rel`` on entries, with an absolute floor of ``rel`` times the
    tensor's largest entry (entries of a gradient whose reference is ~0 are
    rounding noise of the others)."""
    actual = actual.detach().to(expected.dtype)
    floor = rel * float(expected.abs().max()) if expected.numel() and expected.is_floating_point() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rel, atol=max(floor, 1e-7), msg=lambda m: f"{what}: {m}")


def _load(parallel, state: dict) -> None:
    """Load ``state`` (full tensors, non-persistent buffers included) into the
    parallel module's shards."""
    persistent = parallel.state_dict().keys()
    parallel.load_state_dict({k: v for k, v in state.items() if k in persistent})
    for name, full in state.items():
        if name not in persistent:
            mod_name, _, attr = name.rpartition(".")
            buf = getattr(parallel.get_submodule(mod_name), attr)
            buf.copy_(distribute_tensor(full, buf.device_mesh, buf.placements))


def _compare(losses, grads, buffers, reference, rel: float) -> dict:
    _, ref_loss, ref_grads, ref_buffers = reference
    errors = {}
    for r, lo in enumerate(losses):
        assert_close_rel(lo, ref_loss, rel, f"loss on rank {r}")
    assert grads.keys() == ref_grads.keys(), (sorted(grads), sorted(ref_grads))
    for name, g in ref_grads.items():
        assert_close_rel(grads[name], g, rel, f"gradient of {name}")
        if g.abs().max() > 1e-8:  # mathematically-zero gradients (a bias before a norm) are noise
            errors[name] = float((grads[name] - g).abs().max() / g.abs().max())
    assert buffers.keys() == ref_buffers.keys(), (sorted(buffers), sorted(ref_buffers))
    for name, b in ref_buffers.items():
        assert_close_rel(buffers[name], b, rel, f"buffer {name}")
    return errors


def check_step(parallel, mesh, build, inputs, *, rel: float = 1e-4) -> dict:
    """One step of ``parallel`` on the mesh's simulated ranks equals the
    single-device step of ``build()``: loss, every gradient, every buffer.
    Returns the largest relative error per gradient that is not ~0 (for
    reports)."""
    reference = reference_step(build, inputs)
    world = mesh.size()
    with LocalTensorMode(world) as lm:
        parallel.to_empty(device="cpu")
        _load(parallel, reference[0])
        loss = _call(parallel, local_inputs(lm, inputs, mesh))
        loss.backward()
        losses = [loss._local_tensors[r] for r in range(world)] if isinstance(loss, LocalTensor) else [loss] * world
        grads = {n: _full(p.grad, f"gradient of {n}") for n, p in parallel.named_parameters() if p.grad is not None}
        buffers = {n: _full(b, f"buffer {n}") for n, b in parallel.named_buffers()}
    return _compare(losses, grads, buffers, reference, rel)


def check_step_on_rank(parallel, mesh, build, inputs, rank: int, *, rel: float = 1e-4) -> dict:
    """:func:`check_step` for one real process (gloo) of the mesh."""
    reference = reference_step(build, inputs)
    parallel.to_empty(device="cpu")
    _load(parallel, reference[0])
    loss = _call(parallel, tree_map(lambda t: _batch_chunk(t, mesh, rank) if _is_tensor(t) else t, inputs))
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in parallel.named_parameters() if p.grad is not None}
    buffers = {n: b.full_tensor() if isinstance(b, DTensor) else b for n, b in parallel.named_buffers()}
    return _compare([loss], grads, buffers, reference, rel)


def check_steps_on_rank(
    parallel, mesh, build, inputs, rank: int, *, steps: int = 3, lr: float = 1e-3, rel: float = 1e-4
):
    """``steps`` AdamW steps of ``parallel`` on one real process (gloo) of the
    mesh equal those of ``build()`` on a single device: the loss and every
    gradient of each step, and every parameter after the last step. Returns
    the largest relative error per gradient (that is not ~0) over the steps."""
    torch.manual_seed(0)
    ref = build()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    state.update({k: v.clone() for k, v in ref.named_buffers() if k not in state})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    parallel.to_empty(device="cpu")
    _load(parallel, state)
    opt = torch.optim.AdamW(parallel.parameters(), lr=lr)
    local = tree_map(lambda t: _batch_chunk(t, mesh, rank) if _is_tensor(t) else t, inputs)
    errors: dict[str, float] = {}
    for step in range(steps):
        ref_opt.zero_grad()
        ref_loss = _call(ref, inputs)
        ref_loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
        ref_buffers = {n: b.clone() for n, b in ref.named_buffers()}
        opt.zero_grad()
        loss = _call(parallel, local)
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in parallel.named_parameters() if p.grad is not None}
        buffers = {n: b.full_tensor() if isinstance(b, DTensor) else b for n, b in parallel.named_buffers()}
        reference = (None, ref_loss.detach(), ref_grads, ref_buffers)
        try:
            for name, err in _compare([loss], grads, buffers, reference, rel).items():
                errors[name] = max(err, errors.get(name, 0.0))
        except AssertionError as exc:
            raise AssertionError(f"step {step}: {exc}") from exc
        ref_opt.step()
        opt.step()
    params = dict(ref.named_parameters())
    for name, p in parallel.named_parameters():
        assert_close_rel(p.full_tensor(), params[name].detach(), rel, f"parameter {name} after {steps} AdamW steps")
    return errors
