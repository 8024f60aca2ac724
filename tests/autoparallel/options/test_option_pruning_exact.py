"""What makes 3-D and 4-D meshes cheap must not change the plan.

* options dropped before pair matrices exist keep the optimal objective
  (compared with the unpruned solve on tiny LLaMA-3 on 2x2x2 and 2x2x2x2);
* the options stage's shortcuts (fast expansion, DTensor's costs skipped,
  conversion once per spec object) give DTensor's options, in order.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh


def _dtensor_expansion_keeps_mixed_partials() -> bool:
    from torch.distributed.tensor._ops import utils as ops_utils

    return "has_mixed_partial" not in ops_utils.expand_to_full_mesh_op_strategy.__code__.co_varnames


def _mixed_partial_label(label: str) -> bool:
    """Whether a spec of an option label (``P(max)P(min)R->...``) mixes
    Partial kinds other than sum with avg."""
    import re

    for spec in re.split(r"->|,", label):
        kinds = {kind or "sum" for kind in re.findall(r"P(?:\((\w+)\))?", spec)}
        if len(kinds) > 1 and kinds != {"sum", "avg"}:
            return True
    return False


def test_fast_expansion_gives_dtensors_options(fake_world, monkeypatch):
    """Options enumerated with autoparallel.options.fast_expand equal DTensor's own
    expansion, option for option and in order (FFN with bias on 2x2x2:
    addmm, mm, pointwise ops with uneven sharding allowed)."""
    import contextlib

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from autoparallel.options import strategies
    from autoparallel.models import FFN
    from autoparallel.capture.tracing import trace_training_step

    from autoparallel.options import fast_expand

    calls = []
    fast_fn = fast_expand._expand  # what every signature's adapter runs

    def counting(*args, **kwargs):
        calls.append(args[1].op)
        return fast_fn(*args, **kwargs)

    monkeypatch.setattr(fast_expand, "_expand", counting)
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2))
    with torch.device("meta"):
        model = FFN(16, 64, bias=True)
    labels = []
    with contextlib.ExitStack() as stack:
        traced = trace_training_step(model, (torch.empty(8, 6, 16, device="meta"),), "cpu", stack=stack)
        with unset_fake_temporarily():
            for fast in (True, False):
                if not fast:
                    monkeypatch.setattr(strategies, "fast_expansion", contextlib.nullcontext)
                st = strategies.StrategyEnumerator(mesh).enumerate(traced.gm, set(traced.param_nodes.values()))
                labels.append({n.name: [o.label for o in s.options] for n, s in st.items()})
    if _dtensor_expansion_keeps_mixed_partials():
        # the fast expansion drops them everywhere, as newer DTensor does
        labels[1] = {k: [x for x in v if not _mixed_partial_label(x)] for k, v in labels[1].items()}
    assert labels[0] == labels[1]
    assert sum(len(v) for v in labels[0].values()) > 1000
    # the fast expansion ran (for the matmuls and pointwise ops)
    assert {str(op) for op in calls} >= {"aten.addmm.default", "aten.mm.default"}


def _reference_options(node, strategy, inputs, pool):
    """DTensor's strategy as options, the plain way: every OpSpec's
    placements, deduplicated in order, uneven layouts dropped."""
    from autoparallel.options import strategies as st
    from autoparallel.options.dtensor_query import node_out_meta

    out_meta = node_out_meta(node)
    in_metas = [st.tensor_meta_of(n.meta["val"]) for n in inputs]
    options, seen = [], set()
    for op_spec in strategy.strategies:
        out = st.for_each_output(op_spec.output_specs, out_meta)
        if op_spec.input_specs is None:
            in_placements = tuple(op_spec.output_spec.placements for _ in in_metas)
        elif len(op_spec.input_specs) != len(inputs):
            continue
        else:
            in_placements = tuple(s.placements for s in op_spec.input_specs)
        key = (st.placements_of(out), in_placements)
        if key in seen:
            continue
        seen.add(key)
        if st.out_placements_ok(out, out_meta, pool.mesh) and all(
            st.is_evenly_sharded(m.shape, p, pool.mesh) for p, m in zip(in_placements, in_metas)
        ):
            ins = tuple(pool.get(p, m) for p, m in zip(in_placements, in_metas))
            options.append(st.Option(st.pooled_output(out, out_meta, pool), ins))
    return options


def _enumerate_both_ways(monkeypatch, model, example, mesh, module=None, **reference):
    """Option labels per node: as the planner enumerates them, and with
    ``reference`` (attribute of ``module``, default the strategies module ->
    replacement) patched in."""
    import contextlib

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from autoparallel.options import strategies
    from autoparallel.capture.tracing import trace_training_step

    labels = []
    with contextlib.ExitStack() as stack:
        traced = trace_training_step(model, (example,), "cpu", stack=stack)
        with unset_fake_temporarily():
            for patched in (False, True):
                if patched:
                    for name, value in reference.items():
                        monkeypatch.setattr(module or strategies, name, value)
                # patched: every op through the patched functions (views
                # too: the shared enumerator converts them per candidate)
                enumerator = strategies.StrategyEnumerator(mesh, share=not patched)
                st = enumerator.enumerate(traced.gm, set(traced.param_nodes.values()))
                labels.append({n.name: [o.label for o in s.options] for n, s in st.items()})
    return labels


# 2x2x2: ~25 s on a loaded machine (two enumerations of tiny LLaMA-3)
@pytest.mark.parametrize("mesh_shape", [pytest.param((2, 2, 2), marks=pytest.mark.slow), (2, 4)])
def test_options_converted_once_per_spec_object(fake_world, monkeypatch, mesh_shape):
    """DTensor's strategies filtered and pooled once per spec object give the
    options of the plain conversion, in order (tiny LLaMA-3: matmuls, views,
    pointwise ops, multi-output ops)."""
    from autoparallel.models import LLAMA3_CONFIGS, Transformer

    fake_world(8)
    with torch.device("meta"):
        model = Transformer(LLAMA3_CONFIGS["debug"])
    example = torch.empty(4, 8, dtype=torch.long, device="meta")
    ours, plain = _enumerate_both_ways(
        monkeypatch, model, example, init_device_mesh("cpu", mesh_shape), options_from_op_strategy=_reference_options
    )
    assert ours == plain
    assert sum(len(v) for v in ours.values()) > 5000


def test_options_without_dtensors_costs(fake_world, monkeypatch):
    """Skipping DTensor's redistribution costs (both the per-pair function
    and the per-row one the rule modules import) leaves the options as
    they are with the costs computed (FFN with bias on 2x4)."""
    import contextlib

    from autoparallel.models import FFN
    from autoparallel.options import dtensor_query

    fake_world(8)
    with torch.device("meta"):
        model = FFN(16, 64, bias=True)
    ours, costed = _enumerate_both_ways(
        monkeypatch,
        model,
        torch.empty(8, 6, 16, device="meta"),
        init_device_mesh("cpu", (2, 4)),
        module=dtensor_query,
        without_dtensor_redistribute_costs=contextlib.nullcontext,
    )
    assert ours == costed
    assert sum(len(v) for v in ours.values()) > 500
