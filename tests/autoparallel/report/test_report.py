"""Readable plans: the summary names the parallelism (FSDP, DDP, TP,
sequence parallel, vocab-parallel) from the placements alone, has a legend
and labelled numbers; the memory breakdown adds up."""

from __future__ import annotations

import re

import pytest

import solver
from autoparallel.problem import memory
from autoparallel.plan import NodePlan, Plan
from autoparallel.report import describe


def _node(name, *, path, op="aten.mm.default", inputs=(), out="R", shape=(64, 64), param=False, phase="forward"):
    return NodePlan(
        name=name,
        op="" if param else op,
        module_path=path,
        phase=phase,
        shape=list(shape),
        dtype="float32",
        input_placements=list(inputs),
        output_placements=out,
        num_options=3,
        compute_cost=1e-3,
        comm_cost=0.0,
        transition_cost=0.0,
        is_parameter=param,
    )


def _plan(mesh, names, weight, matmuls, norm=None, logits=None):
    """A hand-made plan: two layers' wq/w1/w2 weights stored as ``weight``,
    their forward matmuls placed as ``matmuls[module] = (inputs, output)``."""
    nodes = []
    for layer in (0, 1):
        for mod in ("attention.wq", "feed_forward.w1", "feed_forward.w2"):
            path = f"layers.{layer}.{mod}"
            nodes.append(_node(f"p_{layer}_{mod}", path=path + ".weight", out=weight, param=True))
            ins, out = matmuls[mod]
            nodes.append(_node(f"mm_{layer}_{mod}", path=path, inputs=ins, out=out, shape=(128, 64)))
        if norm:
            nodes.append(
                _node(
                    f"norm_{layer}",
                    path=f"layers.{layer}.ffn_norm",
                    op="aten.mul.Tensor",
                    inputs=[norm, norm],
                    out=norm,
                    shape=(2, 64, 64),
                )
            )
    if logits:
        nodes.append(_node("p_out", path="output.weight", out=weight, param=True, shape=(1000, 64)))
        nodes.append(_node("mm_out", path="output", inputs=logits[0], out=logits[1], shape=(128, 1000)))
    sol = solver.Solution(choice={}, objective=0.0, unary_cost=0.0, edge_cost=0.0, status="optimal", optimal=True)
    return Plan(mesh_shape=list(mesh), mesh_dim_names=list(names), nodes={n.name: n for n in nodes}, solution=sol)


DATA = {m: (["S(0)", "R"], "S(0)") for m in ("attention.wq", "feed_forward.w1", "feed_forward.w2")}
TP = {
    "attention.wq": (["R", "S(1)"], "S(1)"),
    "feed_forward.w1": (["R", "S(1)"], "S(1)"),
    "feed_forward.w2": (["S(1)", "S(0)"], "P"),
}
MIXED = {
    "attention.wq": (["S(0)R", "RS(1)"], "S(0)S(1)"),
    "feed_forward.w1": (["S(0)R", "RS(1)"], "S(0)S(1)"),
    "feed_forward.w2": (["S(0)S(1)", "RS(0)"], "S(0)P"),
}


@pytest.mark.parametrize(
    "plan, expected, absent",
    [
        (
            _plan([8], ["dp"], "S(0)", DATA),
            ["dp (8): FSDP", "sharded over dp", "data parallel over dp"],
            ["DDP", "tensor parallel"],
        ),
        (
            _plan([8], ["dp"], "R", DATA),
            ["dp (8): DDP", "replicated", "data parallel over dp"],
            ["FSDP", "tensor parallel"],
        ),
        (
            _plan([8], ["tp"], "S(0)", TP),
            ["tp (8): tensor parallel (TP)", "tensor parallel over tp (column then row-parallel)"],
            ["FSDP", "DDP"],
        ),
        (
            _plan(
                [4, 2], ["dp", "tp"], "_S(0, 2)S(0)", MIXED, norm="S(0)S(1)", logits=(["S(0)R", "RS(1)"], "S(0)S(1)")
            ),
            [
                "dp (4): FSDP",
                "tp (2): tensor parallel (TP) with sequence parallel norms",
                "sharded over dp*tp (tp-outer layout)",
                "vocab-parallel over tp",
                "sequence split over tp",
            ],
            ["DDP"],
        ),
    ],
    ids=["fsdp", "ddp", "tp", "mixed"],
)
def test_summary_names_the_parallelism(plan, expected, absent):
    text = "\n".join(describe(plan))
    for phrase in expected:
        assert phrase in text, (phrase, text)
    for phrase in absent:
        assert phrase not in text, (phrase, text)
    summary = plan.summary()
    assert "notation:" in summary and "_S(d, k)" in summary
    assert "memory per rank" in summary and "HBM" in summary


@pytest.mark.parametrize(
    "x, w1, expected",
    [
        ("S(0)R", "RS(0)", "token parallel (data) over dp, expert parallel (tokens gathered) over ep"),
        ("S(0)S(0)", "RS(0)", "token parallel (data) over dp, expert parallel (tokens by all-to-all) over ep"),
        ("S(0)R", "RS(2)", "token parallel (data) over dp, hidden split (TP) over ep"),
        ("RR", "RR", "replicated over dp, replicated over ep"),
    ],
)
def test_summary_names_the_expert_layout(x, w1, expected):
    plan = _plan([2, 4], ["dp", "ep"], "S(0)", {m: (["S(0)R", "RR"], "S(0)R") for m in DATA})
    for layer in (0, 1):
        node = _node(
            f"moe_{layer}",
            path=f"layers.{layer}.moe.experts",
            op="autoparallel.moe_experts.default",
            inputs=[x, x, x, w1, w1, w1, w1],
            out=x,
        )
        plan.nodes[node.name] = node
    text = "\n".join(describe(plan))
    assert f"routed experts (layers.*.moe.experts): {expected}" in text, text


def test_memory_breakdown_adds_up_and_warns():
    plan = _plan([4, 2], ["dp", "tp"], "_S(0, 2)S(0)", MIXED)
    b = memory.breakdown(plan)
    n_params, numel = 6, 64 * 64
    assert b.parameters == pytest.approx(n_params * numel * 4 / 8)
    assert b.gradients == pytest.approx(b.parameters)
    assert b.optimizer == pytest.approx(2 * b.parameters)  # AdamW: two fp32 moments
    assert b.total == pytest.approx(b.parameters + b.gradients + b.optimizer + b.activations)
    assert b.fits and not any("WARNING" in line for line in b.lines())
    small = memory.breakdown(plan, hbm_bytes=1000.0)
    assert not small.fits and any("WARNING: does not fit" in line for line in small.lines())
    sgd = memory.breakdown(plan, optimizer=memory.OptimizerSpec("SGD", 0))
    assert sgd.optimizer == 0


def test_backward_matmuls_are_labelled():
    plan = _plan([8], ["dp"], "S(0)", DATA)
    w = plan.nodes["p_0_attention.wq"]
    plan.nodes["dw"] = _node("dw", path="layers.0.attention.wq", inputs=["S(1)", "S(0)"], out="P", phase="backward")
    plan.nodes["dx"] = _node(
        "dx", path="layers.0.attention.wq", inputs=["S(0)", "R"], out="S(0)", shape=(128, 64), phase="backward"
    )
    assert w.shape == [64, 64]
    text = "\n".join(str(k) for k in plan.placements_by_kind() if k.role == "backward")
    assert "weight grad S(1),S(0) -> P" in text and "input grad S(0),R -> S(0)" in text


def test_html_has_every_section_and_no_url(tmp_path):
    import re

    plan = _plan([4, 2], ["dp", "tp"], "_S(0, 2)S(0)", MIXED, norm="S(0)S(1)")
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
    plan.timeline = {
        phase: {
            "end": 1e-3,
            "compute": [[0.0, 4e-4], [5e-4, 1e-3]],
            "comm": [[0.0, 5e-4, "all_gather"]],
            "exposed": [[4e-4, 5e-4]],
            "memory": [[0.0, 1e6], [1e-3, 2e6]],
            "peak_bytes": 2e6,
        }
        for phase in ("forward", "backward")
    }
    plan.pass_stats = {
        "schedule_overlap": {
            "forward": {"exposed_comm_before_s": 2e-4, "exposed_comm_after_s": 1e-4, "peak_memory_after": 2_000_000}
        }
    }
    path = tmp_path / "r.html"
    plan.to_html(str(path))
    html = path.read_text()
    for section in (
        'id="summary"',
        'id="memory"',
        'id="timeline"',
        'id="collectives"',
        'id="placements"',
        'id="passes"',
        "<details>",
        "HBM 80.00 GB",
        "exposed",
        "FSDP",
        "tp-outer layout",
        "layers.*.attention",
    ):
        assert section in html, section
    assert "<svg" in html and "<polyline" in html and "traffic / rank" in html
    assert not re.search(r"https?://", html)
    assert "<script src" not in html and "<link" not in html


def test_html_names_what_it_shows(tmp_path):
    """Title: model, parameter count, mesh, device, batch x sequence, dtypes;
    the timeline has a time axis and a legend of colour swatches; the
    memory chart has ticks on both axes."""
    import re
    from html.parser import HTMLParser

    plan = _plan([4, 2], ["dp", "tp"], "_S(0, 2)S(0)", MIXED)
    plan.provenance = {
        "model": "Transformer",
        "parameters": 8_030_261_248,
        "input_shapes": [[[32, 8192], "int64"]],
        "device": {"name": "H100"},
        "mp_policy": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
    }
    plan.timeline = {
        phase: {
            "end": 4e-3,
            "compute": [[0.0, 3e-3]],
            "comm": [[0.0, 2e-3, "all_gather"]],
            "exposed": [[3e-3, 3.5e-3]],
            "memory": [[0.0, 1e9], [4e-3, 3e9]],
            "peak_bytes": 3e9,
        }
        for phase in ("forward", "backward")
    }

    class Parse(HTMLParser):
        def __init__(self):
            super().__init__()
            self.stack, self.text, self.elements = [], {}, []

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            self.elements.append((tag, attrs, [e.get("id") for _, e in self.stack if e.get("id")]))
            if tag not in ("line", "rect", "polyline", "meta"):
                self.stack.append((tag, attrs))

        def handle_endtag(self, tag):
            if self.stack and self.stack[-1][0] == tag:
                self.stack.pop()

        def handle_data(self, data):
            key = self.stack[-1][1].get("id") or self.stack[-1][0] if self.stack else ""
            self.text[key] = self.text.get(key, "") + data

    path = tmp_path / "r.html"
    plan.to_html(str(path), model="LLaMA-3 8B")
    parser = Parse()
    parser.feed(path.read_text())
    html = path.read_text()
    assert re.search(r"<title>(.*?)</title>", html).group(1) == "autoparallel plan: LLaMA-3 8B, 8.03B parameters"
    assert parser.text["h1"] == "autoparallel plan: LLaMA-3 8B, 8.03B parameters"
    setup = parser.text["setup"]
    for item in ("mesh dp 4 x tp 2 (8 ranks)", "device H100", "batch 32 x sequence 8192", "bfloat16 compute"):
        assert item in setup, setup
    assert "{" not in setup  # not a Python dict
    for chart in ("timeline-chart", "memory-chart"):
        ticks = [a for tag, a, ids in parser.elements if tag == "line" and a.get("class") == "tick" and chart in ids]
        assert len(ticks) >= 3, chart
    assert re.search(r'class="tick-label"[^>]*>2 ms<', html)  # time axis in ms
    assert re.search(r'class="tick-label"[^>]*>1 GB<', html)  # memory axis in GB
    swatches = [a for tag, a, _ in parser.elements if tag == "span" and a.get("class") == "swatch"]
    assert len(swatches) == 3 and all("background" in a.get("style", "") for a in swatches)
    assert "time in the step" in html


def test_cli_diff_and_report(tmp_path, capsys):
    from autoparallel.__main__ import main

    a = _plan([8], ["dp"], "S(0)", DATA)
    b = _plan([8], ["dp"], "R", DATA)
    a.dump_json(str(tmp_path / "a.json"))
    b.dump_json(str(tmp_path / "b.json.gz"))
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json.gz")]) == 1
    out = capsys.readouterr().out
    assert "p_0_attention.wq: ->S(0)  vs  ->R" in out and "6 of" in out
    assert main(["report", str(tmp_path / "a.json"), "-o", str(tmp_path / "r.html")]) == 0
    assert "FSDP" in (tmp_path / "r.html").read_text()
    (tmp_path / "bad.json").write_text("{")
    assert main(["summary", str(tmp_path / "bad.json")]) == 2


def test_mixed_family_names_each_projection():
    mm = dict(MIXED)
    mm["feed_forward.w2"] = (["S(0)S(0)", "RR"], "S(0)S(0)")  # w2 data parallel over tp, w1 column
    text = "\n".join(describe(_plan([4, 2], ["dp", "tp"], "_S(0, 2)S(0)", mm)))
    assert "w1 column-parallel, w2 data parallel over tp" in text, text


def test_cli_diff_warns_when_the_models_differ(tmp_path, capsys):
    from autoparallel.__main__ import main

    a = _plan([8], ["dp"], "S(0)", DATA)
    b = _plan([8], ["dp"], "S(0)", DATA)
    a.provenance = {"graph_fingerprint": "a" * 40, "input_shapes": [[[8, 64], "int64"]]}
    b.provenance = {"graph_fingerprint": "b" * 40, "input_shapes": [[[8, 128], "int64"]]}
    a.dump_json(str(tmp_path / "a.json"))
    b.dump_json(str(tmp_path / "b.json"))
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    captured = capsys.readouterr()
    assert "warning: the plans were made for different model graphs (fingerprint aaaaaaaaaaaa vs bbbbbbbbbbbb" in (
        captured.err
    )
    assert "[8, 64]" in captured.err and "[8, 128]" in captured.err
    # the objective with its unit, as the summary shows it
    assert re.search(r"estimated step \(objective\) [\d.]+ (s|ms|us) vs [\d.]+ (s|ms|us)", captured.out), captured.out


def test_cli_help_has_no_markup(capsys):
    from autoparallel.__main__ import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "::" not in out and "``" not in out
    assert "python -m autoparallel diff a.json b.json" in out


def test_collectives_table_keeps_its_columns_with_long_group_names():
    from autoparallel.report import numbers

    plan = _plan([8], ["dp"], "S(0)", DATA)
    row = {"phase": "forward", "kind": "all_gather", "count": 3, "traffic_bytes": 3e6, "seconds": 2e-5}
    plan.collectives = [
        {**row, "group": "dp", "group_size": 2},
        {**row, "phase": "backward", "group": "dp_replicate*dp_shard*cp col-major", "group_size": 64},
    ]
    header, *rows = numbers.collective_lines(plan)[:-1]
    # every figure column ends where its header does
    for title in ("count", "traffic/rank", "est. time"):
        end = header.index(title) + len(title)
        assert all(r[end - 1] != " " and (len(r) == end or r[end] == " ") for r in rows), (title, rows)
