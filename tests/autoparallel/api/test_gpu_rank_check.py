"""benchmarks/gpu_rank_check.py in its CPU dry mode: tiny LLaMA-3 shapes on a
2 x 2 fake mesh, the record it writes shaped like the fixture that
autoparallel.cost_model.measured's tests correct a DeviceSpec from."""

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


def _same_shape(record, fixture, path="record"):
    assert set(record) == set(fixture), path
    for key, value in fixture.items():
        if isinstance(value, dict) and isinstance(record[key], dict) and key not in ("ranks", "errors", "implied"):
            _same_shape(record[key], value, f"{path}.{key}")


def test_dry_mode_hand_rank_and_record_shape(tmp_path, capsys):
    rc, record, out = _run(tmp_path, capsys, "--ranks", "hand")
    assert rc == 0, record["errors"]
    fixture = json.loads(FIXTURE.read_text())
    _same_shape(record, fixture)
    _same_shape(record["ranks"]["hand"], fixture["ranks"]["hand"], "hand")
    hand = record["ranks"]["hand"]
    assert len(hand["fwd_bwd_ms"]) == 1 and hand["fwd_bwd_ms"][0] > 0
    assert hand["estimate"] is None and hand["peak_bytes"] is None  # no plan; no CUDA allocator on CPU
    assert hand["measured_by_kind_ms"]["matmul"] > 0
    assert "hand" in out and "fwd+bwd ms" in out


@pytest.mark.slow  # plans and applies (~20 s of CPU)
def test_dry_mode_both_ranks(tmp_path, capsys):
    rc, record, out = _run(tmp_path, capsys)
    assert rc == 0, record["errors"]
    fixture = json.loads(FIXTURE.read_text())
    ours = record["ranks"]["autoparallel"]
    _same_shape(ours, fixture["ranks"]["autoparallel"], "autoparallel")
    assert ours["estimate"]["compute_ms"] > 0 and ours["estimate"]["peak_bytes"] > 0
    assert ours["estimated_by_kind_ms"]["matmul"] > 0
    assert set(record["implied"]) == {"compute_efficiency", "attention_efficiency", "memory_efficiency"}
    assert "CPU dry mode" in out


def test_bad_shapes_are_named():
    with pytest.raises(SystemExit):
        _script().parse_args(["--device", "cpu", "--heads", "6", "--mesh", "2", "4"])
