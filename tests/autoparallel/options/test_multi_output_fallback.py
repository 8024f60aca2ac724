"""A multi-output op with an output its strategy leaves without a spec, and
a consumer with no usable rule: the consumer runs replicated, the problem
builds and the plan applies.

The case seen on a GPU: DTensor's strategy for the efficient (or cuDNN)
attention forward gives no spec to its philox seed and offset outputs; the
getitems of those outputs then offered None, so the backward's strategy
raised ("function output_spec expects a single DTensorSpec but got:
None"), fell back to replicated, and building the problem crashed pricing
the edge from None ("multi-output option has no single output spec").
Here the attention ops are planned with DTensor's own strategies (the
project's rules for them are taken out)."""

from __future__ import annotations

import logging

import pytest
import torch
from _parity import plan_and_apply, slow_compute_device
from test_fused_attention import Attention, _inputs, _node, _strategies
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate

from autoparallel.capture.attention_kernels import traced_attention_kernel
from autoparallel.options.strategies import RULES

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_efficient_attention.default
BACKWARD = aten._scaled_dot_product_efficient_attention_backward.default


@pytest.fixture
def dtensor_attention_strategies(monkeypatch):
    """Plan the efficient attention ops with DTensor's strategies."""
    monkeypatch.delitem(RULES, FORWARD)
    monkeypatch.delitem(RULES, BACKWARD)


def test_outputs_without_spec_are_replicated(fake_world, dtensor_attention_strategies):
    """The forward's philox outputs get a replicated spec, so DTensor's
    backward strategy plans (no fallback)."""
    fake_world(4)
    strategies, fallback = _strategies(Attention, "efficient")
    assert not fallback, fallback
    node, strat = _node(strategies, FORWARD)
    assert strat.source == "dtensor"
    seeds = [i for i, v in enumerate(node.meta["val"]) if isinstance(v, torch.Tensor) and v.dim() == 0]
    assert seeds
    for option in strat.options:
        for i in seeds:
            assert tuple(option.output_specs[i].placements) == (Replicate(), Replicate())
    assert _node(strategies, BACKWARD)[1].source == "dtensor"


def test_consumer_without_rule_falls_back_and_builds(fake_world, caplog, monkeypatch, dtensor_attention_strategies):
    """The backward's strategy raising: it runs replicated, named in the
    warning, and the plan builds and applies."""
    prop = DTensor._op_dispatcher.sharding_propagator

    def broken(schema):
        raise ValueError("broken rule")

    monkeypatch.setitem(prop.op_strategy_funcs, BACKWARD, broken)
    fake_world(4)
    with caplog.at_level(logging.WARNING, logger="autoparallel.options.strategies"):
        with traced_attention_kernel("efficient"):
            _, plan, _ = plan_and_apply(Attention, _inputs(), device=slow_compute_device())
    (warning,) = [r.getMessage() for r in caplog.records if "no usable sharding rule" in r.getMessage()]
    assert f"{BACKWARD} x1 (DTensor's rule raised ValueError: broken rule)" in warning
    (backward,) = [n for n in plan.nodes.values() if n.op == str(BACKWARD)]
    assert backward.input_placements == ["RR"] * len(backward.input_placements)
    (forward,) = [n for n in plan.nodes.values() if n.op == str(FORWARD)]
    assert "S(" in forward.output_placements  # the forward keeps DTensor's sharded options
