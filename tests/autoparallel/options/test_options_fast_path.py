"""The options stage's fast path (mesh expansion as a numpy table,
options converted per distinct entry, specs copied from templates) gives
exactly the options, in order, and the compute costs of the plain path
(DTensor's own expansion, every OpSpec converted, specs from the
constructor), on tiny LLaMA-3 on 2x2x2 and 2x2x2x2."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from autoparallel import cost_model
from autoparallel.options import conversion as option_conversion, strategies
from autoparallel.options.fast_expand import ExpandedStrategy, new_spec
from test_option_pruning_exact import _dtensor_expansion_keeps_mixed_partials, _mixed_partial_label


def _spec_key(spec):
    # placements by repr: _MaskPartial (embedding) compares its mask buffer by identity
    if isinstance(spec, DTensorSpec):
        return (repr(spec.placements), spec.tensor_meta, spec.shard_order, spec.use_strided_shard_as_shard_order)
    if isinstance(spec, tuple):
        return tuple(_spec_key(s) for s in spec)
    return spec


def _plain_spec(mesh, placements, meta):
    return DTensorSpec(mesh, placements, tensor_meta=meta)


def _llama(batch: int, seq: int):
    from autoparallel.models import LLAMA3_CONFIGS, Transformer, apply_ac

    config = dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=1)
    with torch.device("meta"):
        model = Transformer(config)
    apply_ac(model, mode="selective")
    return model, torch.empty(batch, seq, dtype=torch.long, device="meta")


def _ffn():
    from autoparallel.models import FFN

    with torch.device("meta"):
        model = FFN(16, 32, activation="gelu", bias=True)
    return model, torch.empty(4, 6, 16, device="meta")


def _options_and_costs(mesh, model, example, fast: bool, monkeypatch):
    """Per node: (source, [(label, input specs, output specs, in-op work,
    compute seconds)]), and the enumerator's stats."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from autoparallel.capture.tracing import trace_training_step

    with monkeypatch.context() as patch, contextlib.ExitStack() as stack:
        if not fast:
            patch.setattr(strategies, "fast_expansion", contextlib.nullcontext)
            patch.setattr(option_conversion, "_options_from_table", lambda *args: None)
            patch.setattr(option_conversion, "new_spec", _plain_spec)
        cost_model.clear_caches()
        traced = trace_training_step(model, (example,), "cpu", stack=stack)
        with unset_fake_temporarily():
            enumerator = strategies.StrategyEnumerator(mesh)
            found = enumerator.enumerate(traced.gm, set(traced.param_nodes.values()))
            result, by_list = {}, {}
            for node, strat in found.items():
                rows = by_list.get(id(strat.options))  # shared lists: computed once
                if rows is None:
                    rows = by_list[id(strat.options)] = [
                        (
                            o.label,
                            _spec_key(o.input_specs),
                            _spec_key(o.output_specs),
                            o.in_op,
                            cost_model.node_compute_time(node, o.input_specs, o.output_specs, cost_model.H100)
                            if node.op == "call_function" and strat.getitem_index is None
                            else 0.0,
                        )
                        for o in strat.options
                    ]
                result[node.name] = (strat.source, rows)
    return result, enumerator.stats


# tiny LLaMA-3 on 2x2x2x2: ~450K options, ~15 s fast and ~60 s plain
@pytest.mark.parametrize(
    "make, mesh_shape",
    [
        (lambda: _llama(2, 4), (2, 2, 2)),
        pytest.param(_ffn, (2, 2, 2, 2), marks=pytest.mark.smoke),
        pytest.param(lambda: _llama(4, 8), (2, 2, 2, 2), marks=pytest.mark.slow),
    ],
    ids=["llama-2x2x2", "ffn-2x2x2x2", "llama-2x2x2x2"],
)
def test_fast_path_gives_the_plain_options_and_costs(fake_world, monkeypatch, make, mesh_shape):
    fake_world(16)
    mesh = init_device_mesh("cpu", mesh_shape)
    model, example = make()
    fast, fast_stats = _options_and_costs(mesh, model, example, True, monkeypatch)
    plain, plain_stats = _options_and_costs(mesh, model, example, False, monkeypatch)
    if _dtensor_expansion_keeps_mixed_partials():
        # the fast expansion drops them everywhere, as newer DTensor does
        plain = {k: (src, [r for r in rows if not _mixed_partial_label(r[0])]) for k, (src, rows) in plain.items()}
    assert list(fast) == list(plain)
    for name in plain:
        assert fast[name] == plain[name], name
    # the model's ops have rules: nothing fell back to replicate-only
    assert not fast_stats.fallback_ops and not plain_stats.fallback_ops
    assert fast_stats.computed == plain_stats.computed
    assert sum(len(rows) for _, rows in fast.values()) > 10_000


def test_new_spec_equals_the_constructor(fake_world):
    fake_world(16)
    mesh = init_device_mesh("cpu", (2, 2, 2, 2))
    t = torch.empty(8, 4, 6, device="meta")
    meta = TensorMeta(t.shape, t.stride(), t.dtype)
    other = TensorMeta(torch.Size([4, 4]), (4, 1), torch.bfloat16)
    for placements in [
        (Replicate(),) * 4,
        (Shard(0), Shard(1), Partial(), Replicate()),
        (Shard(0), Shard(0), Partial("max"), Shard(2)),
        (_StridedShard(0, split_factor=2), Shard(0), Replicate(), Replicate()),
    ]:
        for m in (meta, other, None, meta):  # the second time from the template
            made, plain = new_spec(mesh, placements, m), DTensorSpec(mesh, placements, tensor_meta=m)
            assert made.__dict__ == plain.__dict__ and type(made) is DTensorSpec
            assert made == plain and hash(made) == hash(plain)


def test_expanded_strategy_reads_as_dtensors_own(fake_world):
    """Whoever reads ``strategies`` of the table gets DTensor's OpSpecs:
    the same specs (placements, metas, shard order) and costs, in order."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy

    from autoparallel.options import fast_expand

    fake_world(16)
    mesh = init_device_mesh("cpu", (2, 2, 2, 2))
    prop = DTensor._op_dispatcher.sharding_propagator
    aten = torch.ops.aten

    def strategy_of(shape, placements_list):
        t = torch.empty(shape, device="meta")
        meta = TensorMeta(t.shape, t.stride(), t.dtype)
        return OpStrategy([OpSpec(DTensorSpec(mesh, p, tensor_meta=meta)) for p in placements_list])

    from torch.distributed.tensor._ops.single_dim_strategy import _expand_single_dim_strategy_to_mesh

    r, s0 = Replicate(), Shard(0)
    a = strategy_of((8, 16), [(s0, r, r, r)])
    b = strategy_of((16, 4), [(r, r, r, r)])
    out = torch.empty(8, 4, device="meta")
    out_meta = TensorMeta(out.shape, out.stride(), out.dtype)
    for op in (aten.mm.default, aten.mul.Tensor):
        if op not in prop.op_single_dim_strategy_funcs:
            continue  # a full-mesh rule on this torch release (pointwise ops before 2.12): not expanded
        args = (a, b) if op is aten.mm.default else (a, a)
        schema = OpSchema(op, args, {})
        info, meta = prop.op_single_dim_strategy_funcs[op], out_meta if op is aten.mm.default else a.tensor_meta
        # (the expansion binds expand_to_full_mesh_op_strategy when made)
        plain = _expand_single_dim_strategy_to_mesh(mesh, schema, info, meta)(op, schema.args_meta, schema.kwargs_meta)
        with fast_expand.fast_expansion():
            fast = _expand_single_dim_strategy_to_mesh(mesh, schema, info, meta)(
                op, schema.args_meta, schema.kwargs_meta
            )
        assert isinstance(fast, ExpandedStrategy) and not isinstance(plain, ExpandedStrategy)
        assert len(fast.strategies) == len(plain.strategies) > 100
        for f, p in zip(fast.strategies, plain.strategies):
            assert _spec_key(f.output_specs) == _spec_key(p.output_specs)
            assert [_spec_key(s) for s in f.input_specs] == [_spec_key(s) for s in p.input_specs]
            assert f.redistribute_cost == p.redistribute_cost
