"""benchmarks/gpu_rank_check.py in its CPU dry mode: tiny LLaMA-3 shapes on a
2 x 2 fake mesh, every rank it has, the record it writes holding what the
fixture that autoparallel.cost_model.measured's tests correct a DeviceSpec
from holds."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "tests" / "autoparallel" / "cost_model" / "data" / "gpu_rank_check_record.json"
TINY = ["--device", "cpu", "--layers", "2", "--dim", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "256"]
TINY += ["--seq", "16", "--mesh", "2", "2", "--batch", "2", "--steps", "1", "--warmup", "0"]

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_rank_check", ROOT / "benchmarks" / "gpu_rank_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, capsys, *extra):
    if dist.is_initialized():
        dist.destroy_process_group()
    out = tmp_path / "record.json"
    rc = _script().main([*TINY, *extra, "--json", str(out)])
    assert not dist.is_initialized()
    return rc, json.loads(out.read_text()), capsys.readouterr().out


def _has_fixture_fields(record, fixture, path="record"):
    """Every field of the fixture (what ``corrected_device_spec`` and its
    tests read) is in the record, nested dicts included."""
    missing = set(fixture) - set(record)
    assert not missing, f"{path} lacks {sorted(missing)}"
    for key, value in fixture.items():
        if isinstance(value, dict) and isinstance(record[key], dict) and key not in ("ranks", "errors", "implied"):
            _has_fixture_fields(record[key], value, f"{path}.{key}")


def test_dry_mode_runs_every_rank(tmp_path, capsys):
    """The plan's rank (plan, apply, steps, profile, estimates), the hand
    layout's rank, and the CUDA-graphs rank, which the library refuses on
    CPU: reported as refused with its reason, not as a failure."""
    from autoparallel.cost_model import DeviceSpec
    from autoparallel.cost_model.measured import corrected_device_spec

    rc, record, out = _run(tmp_path, capsys, "--ranks", "autoparallel", "hand", "cudagraphs")
    assert rc == 0, record["errors"]
    assert record["errors"] == {}
    fixture = json.loads(FIXTURE.read_text())
    _has_fixture_fields(record, fixture)
    ours, hand = record["ranks"]["autoparallel"], record["ranks"]["hand"]
    _has_fixture_fields(ours, fixture["ranks"]["autoparallel"], "autoparallel")
    _has_fixture_fields(hand, fixture["ranks"]["hand"], "hand")
    assert ours["estimate"]["compute_ms"] > 0 and ours["estimate"]["peak_bytes"] > 0
    assert ours["estimated_by_kind_ms"]["matmul"] > 0 and ours["measured_by_kind_ms"]["matmul"] > 0
    assert len(hand["fwd_bwd_ms"]) == 1 and hand["fwd_bwd_ms"][0] > 0
    assert hand["estimate"] is None and hand["peak_bytes"] is None  # no plan; no CUDA allocator on CPU
    assert hand["measured_by_kind_ms"]["matmul"] > 0
    assert set(record["ranks"]) == {"autoparallel", "hand"}
    assert "needs a CUDA device" in record["refused"]["cudagraphs"]
    assert "cudagraphs: refused on cpu" in out and "FAILED" not in out
    assert "hand" in out and "fwd+bwd ms" in out and "CPU dry mode" in out
    # the record is what corrected_device_spec reads
    assert set(record["implied"]) == {"compute_efficiency", "attention_efficiency", "memory_efficiency"}
    corrected = corrected_device_spec(DeviceSpec.get(record["preset"]), [record])
    assert corrected.compute_efficiency == round(min(record["implied"]["compute_efficiency"], 1.0), 3)


def test_bad_shapes_are_named():
    with pytest.raises(SystemExit):
        _script().parse_args(["--device", "cpu", "--heads", "6", "--mesh", "2", "4"])
