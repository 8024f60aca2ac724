"""Options stage: the lists the enumerator shares give exactly
what computing every distinct candidate set from scratch gives.

Two sharings (``StrategyEnumerator(share=True)``, the default): single-mesh-dim
ops keyed on their inputs' metas instead of their candidate sets, and
view-like ops converted once per (view, input candidate)
(:mod:`autoparallel.options.candidate_memo`). Compared with ``share=False`` on a
2-layer debug LLaMA-3 (layer 0 reads the embedding, layer 1 a layer: their
candidate sets differ) on 2x2x2, and on 4x2, where its 2 kv heads cannot
be unflattened from a dim sharded 4 ways (some view candidates raise).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.placement_types import Replicate, Shard

from autoparallel import AutoParallel, cost_model
from autoparallel.options import strategies
from autoparallel.models import LLAMA3_CONFIGS, Transformer, apply_ac


def _llama(n_layers: int = 2):
    config = dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=n_layers)
    with torch.device("meta"):
        model = Transformer(config)
    apply_ac(model, mode="selective")
    return model, torch.empty(4, 8, dtype=torch.long, device="meta")


def _spec_key(spec):
    if isinstance(spec, tuple):
        return tuple(_spec_key(s) for s in spec)
    # placements by repr: _MaskPartial compares its mask buffer by identity
    return None if spec is None else (repr(spec.placements), spec.tensor_meta)


def _enumerate(traced, mesh, share: bool):
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        enumerator = strategies.StrategyEnumerator(mesh, share=share)
        found = enumerator.enumerate(traced.gm, set(traced.param_nodes.values()))
    rows = {
        node.name: (
            s.source,
            s.getitem_index,
            [(_spec_key(o.output_specs), _spec_key(o.input_specs), o.in_op) for o in s.options],
        )
        for node, s in found.items()
    }
    return rows, enumerator


# 2x2x2 is slow: 4x2 compares the same shared and unshared lists (and checks
# views with both raising and propagating candidates)
@pytest.mark.parametrize("mesh_shape", [pytest.param((2, 2, 2), marks=pytest.mark.slow), (4, 2)])
def test_shared_options_equal_the_unshared(fake_world, mesh_shape):
    from autoparallel.capture.tracing import trace_training_step

    fake_world(8)
    mesh = init_device_mesh("cpu", mesh_shape)
    model, example = _llama()
    with contextlib.ExitStack() as stack:
        traced = trace_training_step(model, (example,), "cpu", stack=stack)
        shared, shared_enum = _enumerate(traced, mesh, share=True)
        plain, plain_enum = _enumerate(traced, mesh, share=False)
    assert list(shared) == list(plain)
    for name in plain:
        assert shared[name] == plain[name], name
    assert sum(len(rows) for _, _, rows in shared.values()) > 2_000
    # both sharings took effect: fewer lists computed, views converted per
    # candidate (on 4x2 some candidates raising, their views still offered)
    assert shared_enum.stats.computed < plain_enum.stats.computed
    memo = shared_enum._per_candidate._memo
    assert len(memo) > 1000
    if mesh_shape == (4, 2):
        raised = {key[0] for key, (_, exc, _) in memo.items() if exc is not None}
        offered = {key[0] for key, (converted, _, _) in memo.items() if converted is not None}
        assert raised & offered, "expected a view with both raising and propagating candidates"
    assert shared_enum.stats.fallback_ops == plain_enum.stats.fallback_ops


def _plan(share: bool, monkeypatch):
    original = strategies.StrategyEnumerator.__init__

    def init(self, mesh, *, share_=share, **kw):
        original(self, mesh, share=share_)

    model, example = _llama()
    with monkeypatch.context() as patch:
        patch.setattr(strategies.StrategyEnumerator, "__init__", init)
        cost_model.clear_caches()
        data = (Shard(0), Replicate())
        with AutoParallel(model, init_device_mesh("cpu", (4, 2)), example) as autop:
            autop.add_input_constraints([data])
            autop.add_output_constraints([data])
            plan = autop.optimize_placement()
    return plan, autop


# slow (plans the model twice): by default test_shared_options_equal_the_unshared
# shows the shared and unshared option lists (specs and in-op work) equal on
# 4x2, and the costs are priced from those
@pytest.mark.slow
def test_plan_with_shared_options_equals_the_unshared(fake_world, monkeypatch):
    fake_world(8)
    shared, shared_autop = _plan(True, monkeypatch)
    plain, plain_autop = _plan(False, monkeypatch)
    assert shared_autop.strategy_stats.computed < plain_autop.strategy_stats.computed
    assert shared.solution.optimal and plain.solution.optimal
    assert shared.solution.objective == plain.solution.objective
    assert shared.solution.choice == plain.solution.choice
