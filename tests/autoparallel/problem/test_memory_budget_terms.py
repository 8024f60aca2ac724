"""The step-memory model's terms are never negative, for any plan.

A saved value that the partitioner recomputes (LLaMA-3's residual adds) but
whose backward reader takes it through a collective is kept redistributed,
less what recomputing it would have kept; before the fix that was one term
``+bytes / shard(reader's input)`` on the reader and one ``-bytes /
shard(output)`` on the producer, negative whenever the reader took the value
more sharded than it was produced (a local slice): -7.3 GB of activations
on one 70B plan on a 4x4x8x8 mesh. Checked here on tiny LLaMA-3 on a
2x2x2 fake mesh: every term at every option, the pair's charge at every
pair of options, random plans and the smallest plan the row allows.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoparallel import AutoParallel
from autoparallel.problem.memory import shard_factor
from autoparallel.problem.memory_budget import (
    CATEGORIES,
    _labels,
    budget_constraint,
    saved_activation_nodes,
    step_memory_model,
)
from autoparallel.models import LLAMA3_CONFIGS, Transformer
from autoparallel.problem.builder import forward_param_chain
from autoparallel.capture.saved_activations import VIEW_OPS

MESH = [2, 2, 2]
# LLaMA-3 "debug": batch 8, sequence 64, dim 64, fp32: one residual stream
RESIDUAL_BYTES = 8 * 64 * 64 * 4


@pytest.fixture(scope="module")
def llama_terms():
    """(memory model, strategies) of tiny LLaMA-3 on a 2x2x2 fake mesh."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = init_device_mesh("cpu", MESH)
        with torch.device("meta"):
            model = Transformer(LLAMA3_CONFIGS["debug"])
        with AutoParallel(model, mesh, torch.empty(8, 64, dtype=torch.long, device="meta")) as autop:
            saved = saved_activation_nodes(autop.traced.gm, forward_param_chain(autop.traced))
            yield step_memory_model(autop.traced, autop.strategies), autop.strategies, set(saved)
    finally:
        dist.destroy_process_group()


def _recomputed_pairs(model, strategies, saved):
    """(producer, reader, input index) of each value recomputed for the
    backward but read by a matmul or a recomputed op (a reader-input term
    whose producer is not saved): the residual adds, read by the next
    RMSNorm."""
    by_name = {n.name: n for n in strategies}
    out = []
    for key in model.terms:
        c, k = model.site(key)
        if k is None or key in model.reduced_inputs:  # a reduced copy: its own test
            continue
        p = strategies[by_name[c]].inputs[k]
        while p.target in VIEW_OPS:  # the term is the viewed value's
            p = p.args[0]
        if p not in saved:
            out.append((p, by_name[c], k))
    return out


def test_every_term_is_non_negative_at_every_option(llama_terms):
    model, strategies, _ = llama_terms
    by_name = {n.name: n for n in strategies}
    cache: dict = {}
    negative = []
    for key in model.terms:
        name, k = model.site(key)
        for label in set(_labels(strategies, by_name[name], cache, k)):
            for cat, b in model.per_rank(key, label, MESH).items():
                if b < 0:
                    negative.append((key, label, cat, b))
    assert not negative, negative[:5]


def test_residual_read_more_sharded_than_produced(llama_terms):
    """The residual add (recomputed) read by RMSNorm's ``x * rsqrt``: at
    every pair of options the plan's estimate holds the redistributed copy
    less the producer's own bytes, never below zero; the ILP row's
    per-option weight is never below that, and equal to it when the
    producer is as sharded as it can be."""
    model, strategies, saved = llama_terms
    pairs = _recomputed_pairs(model, strategies, saved)
    assert [(p.target, c.target, k) for p, c, k in pairs] == [
        (torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor, 0)
    ] * 4, pairs
    cache: dict = {}
    for p, c, k in pairs:
        key = f"{c.name}:in:{k}"
        outs = set(_labels(strategies, p, cache))
        ins = set(_labels(strategies, c, cache, k))
        most = max(shard_factor(o, MESH) for o in outs)
        assert most == 8
        for o in outs:
            # the producer has no term of its own: recomputed, not saved
            own = model.per_rank(p.name, o, MESH).get("activations", 0.0) if p.name in model.terms else 0.0
            for i in ins:
                value = max(0.0, RESIDUAL_BYTES / shard_factor(i, MESH) - RESIDUAL_BYTES / shard_factor(o, MESH))
                held = own + model.held(key, i, o, MESH)["activations"]
                row = own + model.per_rank(key, i, MESH)["activations"]
                assert held == pytest.approx(value), (p.name, o, c.name, i, held, value)
                assert row >= held - 1e-6, (p.name, o, c.name, i, row, held)
                if shard_factor(o, MESH) == most:
                    assert row == pytest.approx(held), (p.name, o, c.name, i)
        # produced replicated, read as one eighth of it (a local slice): the
        # rank keeps nothing more (not -7/8 of the residual)
        i = next(i for i in ins if shard_factor(i, MESH) == 8)
        assert model.held(key, i, "RRR", MESH)["activations"] == 0.0
        assert model.per_rank(key, i, MESH)["activations"] == 0.0
        # produced 8 ways, gathered for the reader: the gathered copy less
        # the shard that recomputing would have kept
        assert model.held(key, "RRR", "S(0)S(0)S(0)", MESH)["activations"] == RESIDUAL_BYTES * 7 / 8


def _row_and_estimate(model, strategies, choice, row, cache):
    """The budget row's value, the row's and the report's estimate (by
    category) of one option per decision; asserts that no term is
    negative there."""
    by_name = {n.name: i for n, i in choice.items()}
    used = sum(w[by_name[n]] for n, w in row.terms.items())
    nodes = {}
    for n, i in choice.items():
        ins = [_labels(strategies, n, cache, k)[i] for k in range(len(strategies[n].options[i].input_specs or ()))]
        nodes[n.name] = SimpleNamespace(output_placements=_labels(strategies, n, cache)[i], input_placements=ins)
    for key in model.terms:
        name, k = model.site(key)
        n = nodes[name]
        at = n.output_placements if k is None else n.input_placements[k]
        parts = model.per_rank(key, at, MESH)
        if key in model.recomputed_inputs:
            producer = nodes[model.recomputed_inputs[key][0]].output_placements
            held = model.held(key, at, producer, MESH)
            assert 0 <= held["activations"] <= parts["activations"] + 1e-6, (key, at, producer, held, parts)
        assert min(parts.values()) >= 0, (key, at, parts)
    return used, model.estimate(nodes, MESH, row=True), model.estimate(nodes, MESH)


def test_no_plan_has_a_negative_term(llama_terms):
    """A few hundred random plans (one option per node), and the plan at
    every decision's smallest activations: no term and no category below
    zero; the ILP's row is the model's row value and bounds the report."""
    model, strategies, _ = llama_terms
    by_name = {n.name: n for n in strategies}
    row = budget_constraint(model, strategies, MESH, 1e12)
    cache: dict = {}
    rng = random.Random(0)
    for _ in range(300):
        choice = {n: rng.randrange(len(s.options)) for n, s in strategies.items()}
        used, bound, est = _row_and_estimate(model, strategies, choice, row, cache)
        assert min(est.values()) >= 0, est
        assert used + model.row_bytes(model.fixed) == pytest.approx(model.row_bytes(bound), rel=1e-9)
        assert all(est[c] <= bound[c] + 1e-6 for c in CATEGORIES), (est, bound)
    # the row is separable: its smallest activations pick each decision's
    # smallest activations weight
    acts = {key: cats for key, cats in model.terms.items() if "activations" in cats}
    act_only = dataclasses.replace(model, terms={k: {"activations": v["activations"]} for k, v in acts.items()})
    act_row = budget_constraint(act_only, strategies, MESH, 1e12)
    lowest = {n: 0 for n in strategies}
    lowest.update({by_name[n]: min(range(len(w)), key=w.__getitem__) for n, w in act_row.terms.items()})
    used, bound, est = _row_and_estimate(act_only, strategies, lowest, act_row, cache)
    assert 0 <= est["activations"] <= bound["activations"] == pytest.approx(used)
