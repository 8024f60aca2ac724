"""One unit system in every text a plan prints (summary, explain, diff, the
HTML report, memory lines, the hand-layout table, pass stats) and in
``python -m solver``: each figure with its unit, formatted as
:mod:`autoparallel.report.units` formats it (``80.00 GB``, never ``80 GB``
beside it; ``7.1 ms``, never ``7.100 ms``)."""

from __future__ import annotations

import re

import pytest
from test_report import DATA, MIXED, _plan

from autoparallel.problem.memory import MemoryBreakdown
from autoparallel.report import units

_SIZE_UNITS = {"TB": 1e12, "GB": 1e9, "MB": 1e6, "kB": 1e3, "B": 1.0}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_FIGURE = re.compile(r"(?<![\w.])([-+]?\d+(?:\.\d+)?) (TB|GB|MB|kB|B|ms|us|s)(?!\w)|(?<![\w.])(\d+(?:\.\d+)?)%")


def figures(text: str) -> list[str]:
    """Every figure with a unit in ``text``."""
    return [m.group(0) for m in _FIGURE.finditer(text)]


def assert_one_unit_system(text: str) -> None:
    """Each size, duration and percentage in ``text`` reads exactly as
    report/units.py writes its value."""
    found = figures(text)
    assert found, "no figures with units in the text"
    for m in _FIGURE.finditer(text):
        if m.group(3) is not None:
            expected = units.percent(float(m.group(3)) / 100)
        elif m.group(2) in _SIZE_UNITS:
            expected = units.size(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
        else:
            expected = units.seconds(float(m.group(1)) * _TIME_UNITS[m.group(2)])
        assert m.group(0).lstrip("+") == expected, (m.group(0), expected, text[max(0, m.start() - 60) : m.end() + 20])


def test_the_checker_tells_mixed_precision_apart():
    assert_one_unit_system("peak 2.04 MB per rank of 80.00 GB HBM (2.5%), step 7.1 ms, gap 0%")
    for bad in ("of 80 GB HBM", "step 7.100 ms", "(0.0%)", "12.5 GB", "3 ms"):
        with pytest.raises(AssertionError):
            assert_one_unit_system(bad)


def _full_plan():
    """A plan with everything a report shows: timeline, memory curve,
    collectives, pass stats, hand layouts, device, inputs."""
    plan = _plan([4, 2], ["dp", "tp"], "_S(0, 2)S(0)", MIXED, norm="S(0)S(1)")
    plan.solution.objective = 0.0123
    plan.provenance = {
        "model": "Transformer",
        "parameters": 8_030_261_248,
        "input_shapes": [[[32, 8192], "int64"]],
        "device": {"name": "H100"},
    }
    plan.timeline = {
        phase: {
            "end": 4e-3,
            "compute": [[0.0, 3e-3]],
            "comm": [[0.0, 2e-3, "all_gather"]],
            "exposed": [[3e-3, 3.5e-3]],
            "memory": [[0.0, 1e9], [4e-3, 70e9]],
            "peak_bytes": 70e9,
        }
        for phase in ("forward", "backward")
    }
    plan.collectives = [
        {
            "phase": "forward",
            "kind": "all_gather",
            "group": "dp",
            "group_size": 4,
            "count": 3,
            "output_bytes": 4000,
            "traffic_bytes": 3000.0,
            "seconds": 2e-5,
        }
    ]
    plan.pass_stats = {
        "schedule_overlap": {
            "forward": {"exposed_comm_before_s": 2e-4, "exposed_comm_after_s": 1e-4, "peak_memory_after": 2_000_000}
        },
        "bucket_collectives": {"buckets": 1_250_000, "bucket_bytes_used": 64 << 20, "nbytes": 12345},
    }
    plan.baselines = [
        {"name": "FSDP", "step_s": 9.5e-3, "solver_s": 0.02, "memory_bytes": 3.5e9, "note": ""},
        {"name": "DDP", "step_s": 6.0e-3, "solver_s": 0.01, "memory_bytes": 40e9, "note": ""},
    ]
    return plan


def test_summary_has_one_unit_system():
    text = _full_plan().summary()
    assert_one_unit_system(text)
    assert "of 80.00 GB HBM" in text
    assert "(100% of parameters)" in text  # percentages as the gap's, not 100.0%


def test_html_report_has_one_unit_system():
    from autoparallel.report.html import render

    html = render(_full_plan())
    # axis tick labels are round values on a scale, not figures
    text = re.sub(r'<text class="tick-label".*?</text>', "", html)
    text = re.sub(r"<[^>]+>", " ", text)
    assert_one_unit_system(text)
    # the HBM size reads the same in the memory table and on the chart
    assert "per rank of 80.00 GB HBM" in text and "HBM 80.00 GB" in text
    assert not re.search(r"\b80 GB\b", text)


def test_hand_layouts_and_margins_in_the_unit_system():
    from autoparallel.report.baseline_table import table_lines

    lines = table_lines(_full_plan())
    text = "\n".join(lines)
    assert_one_unit_system(text)
    (fsdp,) = [line for line in lines if line.strip().startswith("FSDP")]
    (ddp,) = [line for line in lines if line.strip().startswith("DDP")]
    # the plan's step: compute 2 x (4 ms - 0.5 ms exposed) + 0.1 ms exposed communication
    assert re.search(r"this plan +7.1 ms", text)
    assert "-2.4 ms, -25.3% vs FSDP" in fsdp and "3.50 GB" in fsdp
    assert "+1.1 ms, +18.3% vs DDP" in ddp and "40.00 GB" in ddp


def test_pass_stats_tell_bytes_from_counts():
    from autoparallel.report.numbers import pass_stat_lines

    lines = pass_stat_lines(_full_plan())
    text = "\n".join(lines)
    assert_one_unit_system(text)
    assert "peak_memory_after 2.00 MB" in text and "exposed_comm_after_s 100.0 us" in text
    # a large count is a count, not bytes
    assert "buckets 1250000" in text and "bucket_bytes_used 67.11 MB" in text and "nbytes 12.35 kB" in text


def test_memory_lines_in_the_unit_system():
    b = MemoryBreakdown(
        parameters=2e9,
        gradients=2e9,
        optimizer=8e9,
        activations=70e9,
        hbm=80e9,
        budget=72e9,
        budget_source="80.00 GB HBM less 10%",
        scheduler_activations=71e9,
    )
    text = "\n".join(b.lines())
    assert_one_unit_system(text)
    assert "83.00 GB per rank of 80.00 GB HBM (104%)" in text
    assert "the device has 80.00 GB" in text
    assert "the peak is 115% of it" in text


def test_memory_budget_source_in_the_unit_system():
    from autoparallel.problem.memory_budget import MemoryBudget

    assert MemoryBudget(fraction=0.5).resolve({"name": "H100"}) == (40e9, "0.5 of 80.00 GB HBM")
    _, source = MemoryBudget().resolve({"name": "H100"})
    assert_one_unit_system(source)


def test_explain_and_diff_in_the_unit_system(tmp_path, capsys):
    from autoparallel.__main__ import main

    plan = _full_plan()
    assert_one_unit_system(plan.explain("layers.0.feed_forward.w1"))
    a = _plan([8], ["dp"], "S(0)", DATA)
    b = _plan([8], ["dp"], "R", DATA)
    a.solution.objective, b.solution.objective = 0.0123, 0.0456
    a.dump_json(str(tmp_path / "a.json"))
    b.dump_json(str(tmp_path / "b.json"))
    main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    out = capsys.readouterr().out
    assert "estimated step (objective) 12.3 ms vs 45.6 ms" in out
    assert_one_unit_system(out)
