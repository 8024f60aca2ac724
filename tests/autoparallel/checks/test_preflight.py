"""Mistakes the arguments already show fail before the trace, in one line:
input shapes against the mesh and constraints, plan files, --chunk
patterns; the example exits 2 with the message (traceback only with -v);
nested entry of one AutoParallel object is refused."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

import solver
from autoparallel import AutoParallel, ConstraintError, PlanMismatch
from autoparallel.checks import preflight
from autoparallel.models import FFN
from autoparallel.passes.chunk_options import ChunkOptionError, check_chunk_modules, parse_chunk_args
from autoparallel.plan import NodePlan, Plan

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "example_llama3.py"


@pytest.fixture
def no_trace(monkeypatch):
    """Tracing fails the test: every check here must come before it."""
    import autoparallel.api as api

    def traced(*args, **kwargs):
        pytest.fail("the check ran after tracing started")

    monkeypatch.setattr(api, "trace_training_step", traced)


def _example():
    spec = importlib.util.spec_from_file_location("example_llama3_preflight", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _plan(mesh_shape, names, input_shape) -> Plan:
    node = NodePlan(
        name="tokens",
        op="tokens",
        module_path=None,
        phase="forward",
        shape=list(input_shape),
        dtype="int64",
        input_placements=[],
        output_placements="S(0)R",
        num_options=1,
        compute_cost=0.0,
        comm_cost=0.0,
        transition_cost=0.0,
    )
    sol = solver.Solution(choice={}, objective=1e-3, unary_cost=0.0, edge_cost=0.0, status="optimal", optimal=True)
    return Plan(
        mesh_shape=list(mesh_shape),
        mesh_dim_names=list(names),
        nodes={"tokens": node},
        solution=sol,
        provenance={"input_shapes": [[list(input_shape), "int64"]], "graph_fingerprint": "0" * 40},
    )


# -- input shapes against the mesh ------------------------------------------------------


def test_batch_that_does_not_split_fails_before_the_trace(fake_world, no_trace):
    fake_world(15)
    mesh = init_device_mesh("cpu", (3, 5), mesh_dim_names=("dp", "tp"))
    autop = AutoParallel(FFN(16, 32), mesh, torch.randn(32, 16), input_constraints=[(Shard(0), Replicate())])
    with pytest.raises(ConstraintError) as err:
        autop.__enter__()
    assert str(err.value).startswith(
        "input constraint 0: input 0 has size 32 on dim 0, which Shard(0) cannot split over 'dp' (3 ranks)"
    )


@pytest.mark.parametrize(
    "constraints, message",
    [
        ([(Shard(0),)], r"1 placements given for a 2-D mesh \(2, 2\)"),
        ([(Shard(2), Replicate())], r"Shard\(2\) is out of range for input 0, a 2-D tensor"),
        ([(Partial(), Replicate())], r"cannot be Partial\(\) on 'dp'"),
        ([None, None], r"2 input constraints given for 1 inputs"),
        ([(Shard(0), Shard(0))], r"size 6 on dim 0, which Shard\(0\) cannot split over 'dp' x 'tp' \(4 ranks\)"),
    ],
)
def test_input_constraint_mistakes_before_the_trace(fake_world, no_trace, constraints, message):
    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ConstraintError, match=message):
        with AutoParallel(FFN(16, 32), mesh, lambda: torch.randn(6, 16), input_constraints=constraints):
            pass


def test_input_constraints_given_early_are_pinned(fake_world):
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    with AutoParallel(FFN(16, 32), mesh, torch.randn(4, 16), input_constraints=[(Shard(0),)]) as autop:
        node = autop.traced.input_nodes[0]
        assert autop._constraints.pins[node.name] == ("input constraint 0", (Shard(0),))


# -- nested entry -------------------------------------------------------------------------


def test_nested_entry_is_an_error(fake_world):
    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    autop = AutoParallel(FFN(16, 32), mesh, torch.randn(4, 16))
    with autop:
        with pytest.raises(RuntimeError, match="already entered"):
            with autop:
                pass
        assert autop.traced is not None  # the outer block still works
    with autop:  # entered again after the block: allowed
        pass


# -- plan files ---------------------------------------------------------------------------


def test_plan_file_checks(tmp_path, fake_world):
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    with pytest.raises(preflight.PlanFileError, match=r"plan file .*nonexist.json: no such file"):
        preflight.load_plan_for(str(tmp_path / "nonexist.json"), mesh)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(preflight.PlanFileError, match="not valid JSON"):
        preflight.read_plan(str(tmp_path / "bad.json"))
    (tmp_path / "other.json").write_text('{"schema": "something else"}')
    with pytest.raises(preflight.PlanFileError, match="not a plan written by Plan.dump_json"):
        preflight.read_plan(str(tmp_path / "other.json"))
    path = str(tmp_path / "plan.json.gz")
    _plan((8, 16), ("dp", "tp"), (32, 64)).dump_json(path)
    with pytest.raises(PlanMismatch, match=r"was made for mesh dp 8 x tp 16, but the mesh is dp 2 x tp 4"):
        preflight.load_plan_for(path, mesh, torch.zeros(32, 64, dtype=torch.long))
    _plan((2, 4), ("dp", "tp"), (32, 64)).dump_json(path)
    with pytest.raises(PlanMismatch, match=r"input 0 of shape \[32, 64\], but input 0 has shape \[16, 64\]"):
        preflight.load_plan_for(path, mesh, lambda: torch.zeros(16, 64, dtype=torch.long))
    assert preflight.load_plan_for(path, mesh, torch.zeros(32, 64, dtype=torch.long)).mesh_shape == [2, 4]


def test_plan_and_report_files_follow_the_umask(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        _plan((2,), ("dp",), (4, 8)).dump_json(str(tmp_path / "p.json"))
        _plan((2,), ("dp",), (4, 8)).to_html(str(tmp_path / "r.html"))
    finally:
        os.umask(old)
    assert (tmp_path / "p.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "r.html").stat().st_mode & 0o777 == 0o644


# -- chunk options ------------------------------------------------------------------------


def test_chunk_patterns_against_the_model():
    from autoparallel.models import LLAMA3_CONFIGS, Transformer

    with torch.device("meta"):
        model = Transformer(LLAMA3_CONFIGS["debug"])
    paths = [name for name, _ in model.named_modules()]
    check_chunk_modules({"layers.*.attention": "batch", "layers.1.feed_forward": "seq"}, paths)
    with pytest.raises(ChunkOptionError, match=r"chunk layers.\*.attn=batch: the pattern names no module.*attention"):
        check_chunk_modules({"layers.*.attn": "batch"}, paths)
    with pytest.raises(ChunkOptionError, match="the mode must be one of batch, seq"):
        check_chunk_modules({"layers.*.attention": "diagonal"}, paths)
    assert parse_chunk_args(["layers.*.attention"]) == {"layers.*.attention": "batch"}


# -- the example: one line, exit 2, before the trace -----------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mesh", "3", "5"], "input 0 has size 32 on dim 0, which Shard(0) cannot split over 'dp' (3 ranks)"),
        (["--plan-file", "/nonexist/plan.json"], "plan file /nonexist/plan.json: no such file"),
        (["--chunk", "layers.*.attn=batch"], "chunk layers.*.attn=batch: the pattern names no module"),
        (["--chunk", "layers.*.attention=diagonal"], "the mode must be one of batch, seq"),
    ],
)
def test_example_prints_one_line_and_exits_2(argv, message, no_trace, capsys):
    if dist.is_initialized():
        dist.destroy_process_group()
    example = _example()
    with pytest.raises(SystemExit) as exit_:
        example.main(["--model", "debug", "--seq", "64", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("example_llama3.py: error: ") and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not dist.is_initialized()


def test_example_plan_file_for_another_mesh(tmp_path, no_trace, capsys):
    if dist.is_initialized():
        dist.destroy_process_group()
    path = str(tmp_path / "plan.json.gz")
    _plan((2, 4), ("dp", "tp"), (8, 64)).dump_json(path)
    example = _example()
    with pytest.raises(SystemExit) as exit_:
        example.main(["--model", "debug", "--seq", "64", "--batch", "8", "--mesh", "8", "16", "--plan-file", path])
    assert exit_.value.code == 2
    assert "was made for mesh dp 2 x tp 4, but the mesh is dp 8 x tp 16" in capsys.readouterr().err


def test_example_verbose_keeps_the_traceback(no_trace):
    if dist.is_initialized():
        dist.destroy_process_group()
    example = _example()
    with pytest.raises(ConstraintError, match="cannot split over 'dp' \\(3 ranks\\)"):
        example.main(["--model", "debug", "--seq", "64", "--mesh", "3", "5", "-v"])


def test_example_flag_mistakes(capsys):
    example = _example()
    for argv, message in (
        (["--chunk", "--no-apply"], "--chunk chunks the applied graphs"),
        (["--device", "X100"], "--device: unknown device 'X100'"),
        (["--batch", "0"], "--batch must be positive"),
    ):
        with pytest.raises(SystemExit) as exit_:
            example.parse_args(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_example_help_shows_the_real_defaults(capsys):
    example = _example()
    with pytest.raises(SystemExit):
        example.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "256 with --real" in out and "64 with --real" not in out
    assert "(default: 3)" in out  # --steps
    args = example.parse_args(["--real"])
    assert (args.seq, args.batch, args.dim, args.model) == (256, 8, 256, "debug")


# -- the example's reports ----------------------------------------------------------------


def test_plan_file_run_reports_its_own_stage_times(capsys):
    example = _example()
    plan = _plan((2, 4), ("dp", "tp"), (8, 64))
    plan.timings = {"tracing": 50.0, "problem_build": 99.0, "solver.solve": 77.0}  # the run that made the file
    example.print_report(plan, 3.5, None, plan_file="p.json", timings={"tracing": 1.25, "options": 0.5})
    out = capsys.readouterr().out
    timing = out.split("== planning time ==")[1].split("==")[0]
    assert "1.25 s" in timing and "50.00" not in timing and "99.00" not in timing and "77.00" not in timing
    assert "problem_build" not in timing and "plan from p.json" in timing


def test_real_run_step_line():
    from autoparallel.models import LLAMA3_CONFIGS, Transformer

    example = _example()
    args = example.parse_args(["--real", "--mp", "bf16"])
    config = LLAMA3_CONFIGS["debug"]
    with torch.device("meta"):
        model = Transformer(config)
    cpu = example.StepMeter(model, config, args, 4, torch.device("cpu"))
    line = cpu.line(3, 5.4321, 0.5)
    assert line.startswith(f"step 3: loss 5.4321  tokens/s {2 * args.batch * args.seq:,}  peak RSS ")
    assert "mfu" not in line
    gpu = example.StepMeter(model, config, args, 4, torch.device("cpu"))
    gpu.peak_flops = 4 * 989e12  # what a CUDA run takes from the --device preset
    assert re.search(r"  mfu \d+\.\d\d%", gpu.line(0, 1.0, 1.0))


def test_apply_placement_checks_chunk_patterns_first(fake_world):
    from autoparallel.passes import PassOptions

    fake_world(2)
    mesh = init_device_mesh("cpu", (2,))
    with AutoParallel(FFN(16, 32), mesh, torch.randn(4, 16)) as autop:
        plan = _plan((2,), ("dp",), (4, 16))  # not even looked at: the options are wrong first
        with pytest.raises(ChunkOptionError, match="chunk w9=batch: the pattern names no module of the model"):
            autop.apply_placement(plan, pass_options=PassOptions(chunk_modules={"w9": "batch"}))
