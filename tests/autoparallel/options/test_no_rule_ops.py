"""Ops without a sharding rule, or whose DTensor rule raises, run replicated
and give the single-device numbers; one warning names them with their module
paths. ``torch.linalg.qr`` (DTensor's rule gives one spec for its two outputs)
and ``torch.linalg.inv`` (its error check is an effectful op) plan and apply."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn as nn
from _parity import check_step, plan_and_apply, slow_compute_device
from torch.distributed.tensor import DTensor

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]


@torch.library.custom_op("autoparallel_test::row_scale", mutates_args=())
def row_scale(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + sum_j |x_j|) along the last dim: an op DTensor knows nothing of."""
    return x / (1 + x.abs().sum(-1, keepdim=True))


@row_scale.register_fake
def _(x):
    return torch.empty_like(x)


def _row_scale_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    s = 1 + x.abs().sum(-1, keepdim=True)
    return grad / s - (grad * x).sum(-1, keepdim=True) * torch.sign(x) / s**2


row_scale.register_autograd(
    _row_scale_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0])
)


class Scaler(nn.Module):
    def forward(self, x):
        return row_scale(x)


class LinalgNet(nn.Module):
    def __init__(self, n: int = 8):
        super().__init__()
        self.proj = nn.Linear(n, n)
        self.scaler = Scaler()
        self.out = nn.Linear(n, n)

    def forward(self, x):
        h = self.proj(x)  # [B, n, n]: a batch of matrices
        q, r = torch.linalg.qr(h)
        inv = torch.linalg.inv(h @ h.transpose(-1, -2) + 4 * torch.eye(h.shape[-1]))
        y = self.out(self.scaler(q) + r + inv)
        return y.pow(2).mean()


def _inputs():
    return (torch.randn(8, 8, 8, generator=torch.Generator().manual_seed(1)),)


@pytest.mark.parametrize("device", ["default", "slow"])
def test_linalg_and_custom_op_fall_back_correctly(fake_world, caplog, device):
    fake_world(4)
    inputs = _inputs()
    with caplog.at_level(logging.WARNING, logger="autoparallel.options.strategies"):
        parallel, plan, mesh = plan_and_apply(
            LinalgNet, inputs, device=slow_compute_device() if device == "slow" else None
        )
    warnings = [r.getMessage() for r in caplog.records if "no usable sharding rule" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "autoparallel_test.row_scale.default x1 (no rule) in scaler" in warnings[0], warnings[0]
    # the fallback runs the op replicated
    scale = next(n for n in plan.nodes.values() if "row_scale" in n.op)
    assert scale.output_placements == "RR" and scale.input_placements == ["RR"]
    check_step(parallel, mesh, LinalgNet, inputs)


@pytest.mark.smoke
def test_raising_dtensor_rule_falls_back(fake_world, caplog, monkeypatch):
    """A DTensor strategy that raises is a missing rule, said with its error."""
    prop = DTensor._op_dispatcher.sharding_propagator
    aten = torch.ops.aten

    def broken(schema):
        raise IndexError("broken rule")

    def broken_single_dim(op, args_schema, kwargs_schema):
        raise IndexError("broken rule")

    op = aten.linalg_qr.default
    if op in prop.op_single_dim_strategy_funcs:  # the rule's form depends on the torch release
        record = prop.op_single_dim_strategy_funcs[op]
        monkeypatch.setitem(prop.op_single_dim_strategy_funcs, op, dataclasses.replace(record, func=broken_single_dim))
    else:
        monkeypatch.setitem(prop.op_strategy_funcs, op, broken)
    fake_world(4)
    inputs = _inputs()
    with caplog.at_level(logging.WARNING, logger="autoparallel.options.strategies"):
        parallel, plan, mesh = plan_and_apply(LinalgNet, inputs)
    (warning,) = [r.getMessage() for r in caplog.records if "no usable sharding rule" in r.getMessage()]
    assert "aten.linalg_qr.default x1 (DTensor's rule raised IndexError: broken rule) in <top level>" in warning
    check_step(parallel, mesh, LinalgNet, inputs)
