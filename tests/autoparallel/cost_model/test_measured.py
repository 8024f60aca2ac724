"""Correcting DeviceSpec efficiencies from a recorded rank measurement
(the JSON ``benchmarks/gpu_rank_check.py --json`` writes)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autoparallel.cost_model import H100, H200
from autoparallel.cost_model.measured import corrected_device_spec, estimated_by_kind, implied_efficiencies, op_kind

RECORD = Path(__file__).parent / "data" / "gpu_rank_check_record.json"


@pytest.fixture
def record():
    return json.loads(RECORD.read_text())


def test_corrected_spec_from_the_recorded_rank(record):
    spec = corrected_device_spec(H100, [record])
    # efficiency * estimated / measured per kind; the hand rank has no estimate and is not used
    assert spec.compute_efficiency == pytest.approx(0.7 * 200 / 250)
    assert spec.attention_efficiency == pytest.approx(0.3 * 40 / 48)
    assert spec.memory_efficiency == pytest.approx(0.8 * 60 / 50)
    assert implied_efficiencies([record]) == pytest.approx(record["implied"])
    # the rest of the preset is untouched
    assert dataclasses.replace(spec, compute_efficiency=0.7, attention_efficiency=0.3, memory_efficiency=0.8) == H100


def test_records_pool_and_efficiencies_cap_at_one(record):
    slow = json.loads(json.dumps(record))
    slow["ranks"]["autoparallel"]["measured_by_kind_ms"] = {"matmul": 150.0, "attention": 0.0, "memory": 10.0}
    spec = corrected_device_spec(H100, [record, slow])
    assert spec.compute_efficiency == pytest.approx(0.7 * 400 / 400)
    assert spec.attention_efficiency == pytest.approx(0.25)  # the second record has no attention time
    assert spec.memory_efficiency == 1.0  # 0.8 * 120 / 60 capped


def test_record_of_another_preset_is_refused(record):
    with pytest.raises(ValueError, match="preset 'H100'.*not 'H200'"):
        corrected_device_spec(H200, [record])


def test_nothing_to_learn_keeps_the_preset(record):
    record["ranks"]["autoparallel"]["estimated_by_kind_ms"] = None
    assert corrected_device_spec(H100, [record]) == H100


@pytest.mark.parametrize(
    "name, kind",
    [
        ("aten.mm.default", "matmul"),
        ("aten::addmm", "matmul"),
        ("aten._scaled_dot_product_flash_attention.default", "attention"),
        ("aten::_flash_attention_backward", "attention"),
        ("aten::_efficient_attention_forward", "attention"),
        ("aten.mul.Tensor", "memory"),
        ("aten::_foreach_add_", "memory"),
        ("_c10d_functional.all_gather_into_tensor.default", None),
        ("aten::linear", None),
    ],
)
def test_op_kind(name, kind):
    assert op_kind(name) == kind


def test_estimated_by_kind_counts_recomputed_nodes_twice():
    from types import SimpleNamespace as N

    plan = N(
        nodes={
            "mm": N(op="aten.mm.default", compute_cost=2.0, phase="forward", recompute="MUST_SAVE"),
            "silu": N(op="aten.silu.default", compute_cost=1.0, phase="forward", recompute="PREFER_RECOMPUTE"),
            "mm_bw": N(op="aten.mm.default", compute_cost=4.0, phase="backward", recompute=None),
            "ag": N(
                op="_c10d_functional.all_gather_into_tensor.default", compute_cost=0.5, phase="forward", recompute=None
            ),
        }
    )
    assert estimated_by_kind(plan) == {"matmul": 6.0, "attention": 0.0, "memory": 2.0}
