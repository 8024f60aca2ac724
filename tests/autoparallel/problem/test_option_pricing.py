"""Lazy edge matrices and option pricing: lazy blocks equal the
dense matrices entry for entry; a plan by option pricing has the dense
solve's optimal objective, over far fewer options; a problem too big even
for lazy matrices is refused with its size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autoparallel import AutoParallel, ProblemTooLarge
from autoparallel.models import FFN, LLAMA3_CONFIGS, Transformer
from autoparallel.options.placements import SpecLabels
from autoparallel.problem.builder import build_problem

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]


def _tiny_llama():
    args = LLAMA3_CONFIGS["debug"]
    with torch.device("meta"):
        return Transformer(args), torch.empty(4, 16, dtype=torch.long, device="meta")


def test_lazy_blocks_equal_dense_matrices(fake_world):
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2))
    with torch.device("meta"):
        model = FFN(16, 64, bias=True)
    with AutoParallel(model, mesh, torch.empty(8, 16, 16, device="meta")) as autop:
        args = (autop.traced, autop.strategies, autop.mesh)
        kw = dict(device=autop.device, overlap=autop.overlap, repeats=autop.repeats)
        dense = build_problem(*args, autop._constraints.__class__(option_pricing=False), **kw)
        lazy = build_problem(*args, autop._constraints.__class__(option_pricing=True), **kw)
    assert lazy.lazy and not dense.lazy
    # the problem's labels (memoised per pooled spec) are the options' own
    label = SpecLabels().option
    assert all(label(o) == o.label for s in autop.strategies.values() for o in s.options)
    assert [d.costs for d in lazy.problem.decisions] == [d.costs for d in dense.problem.decisions]
    rng = np.random.default_rng(0)
    kinds = set()
    for de, le in zip(dense.problem.edges, lazy.problem.edges, strict=True):
        assert (de.producer, de.consumer, de.arg_index) == (le.producer, le.consumer, le.arg_index)
        full = np.asarray(de.costs, dtype=np.float64)
        assert le.costs.shape == full.shape and le.costs.floor <= full.min()
        kinds.add(type(le.costs).__name__)
        # a few rows against every column, every row against a few columns
        # (the two ways the grid fills), then the whole matrix
        rows = np.sort(rng.choice(full.shape[0], size=min(3, full.shape[0]), replace=False))
        cols = np.sort(rng.choice(full.shape[1], size=min(3, full.shape[1]), replace=False))
        np.testing.assert_array_equal(le.costs.block(rows, np.arange(full.shape[1])), full[rows])
        np.testing.assert_array_equal(le.costs.block(np.arange(full.shape[0]), cols), full[:, cols])
        np.testing.assert_array_equal(le.costs.block(np.arange(full.shape[0]), np.arange(full.shape[1])), full)
    assert {"LazyClassMatrix", "LazyKeyMatch"} <= kinds


@pytest.mark.parametrize(
    "case, shape, coarse_seeds", [("ffn", (2, 2, 2), False), ("ffn", (2, 2, 2), True), ("llama", (2, 2), False)]
)
def test_pricing_plan_has_the_dense_optimum(fake_world, monkeypatch, case, shape, coarse_seeds):
    """Option pricing proves the same optimum as the dense solve, with and
    without coarse-mesh plans in its seed; the plan is an ordinary one over
    the options it kept."""
    from autoparallel.problem import coarse_seed, pricing as option_pricing

    monkeypatch.setattr(option_pricing, "COARSE_SEEDS", coarse_seeds)
    lifted = []  # the coarse plans the seed got
    real = coarse_seed.lifted_plans
    monkeypatch.setattr(coarse_seed, "lifted_plans", lambda *a, **k: lifted.extend(real(*a, **k)) or lifted)
    fake_world(8)
    mesh = init_device_mesh("cpu", shape)
    if case == "ffn":
        with torch.device("meta"):
            model = FFN(16, 64, bias=True)
        example = torch.empty(8, 16, 16, device="meta")
    else:
        model, example = _tiny_llama()
    plans = {}
    for pricing in (False, True):
        with AutoParallel(model, mesh, example, time_limit=None, option_pricing=pricing) as autop:
            batch = [(Shard(0),) + (Replicate(),) * (mesh.ndim - 1)]
            autop.add_input_constraints(batch)
            autop.add_output_constraints(batch)
            plans[pricing] = (autop.optimize_placement(), autop.built, autop.strategies)
    (dense, _, _), (priced, priced_built, full) = plans[False], plans[True]
    assert dense.solution.status == priced.solution.status == "optimal"
    assert priced.solution.objective == pytest.approx(dense.solution.objective, rel=1e-9)
    assert priced.solution.bound == pytest.approx(priced.solution.objective, rel=1e-9)
    assert not priced_built.lazy  # rebuilt dense over the kept options
    assert bool(lifted) == (coarse_seeds and len(shape) >= 3)
    kept = sum(len(s.options) for s in priced_built.strategies.values())
    assert kept <= sum(len(s.options) for s in full.values())
    # every node's plan is one of its own options
    for node, strat in priced_built.strategies.items():
        assert all(any(o is f for f in full[node].options) for o in strat.options), node.name


def test_lazy_size_guard(fake_world):
    """Over the limit even with lazy matrices: refused, naming options and
    what to change, before any matrix exists."""
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2))
    model, example = _tiny_llama()
    with AutoParallel(model, mesh, example, max_problem_bytes=2**20) as autop:
        with pytest.raises(ProblemTooLarge) as err:
            autop.optimize_placement()
    msg, size = str(err.value), err.value.size
    assert size.lazy_bytes > 2**20 and size.estimated_bytes > size.lazy_bytes
    assert "even with lazy edge matrices" in msg and f"{size.options:,} options" in msg
    assert "3-D mesh (2, 2, 2)" in msg and "fewer mesh dims" in msg and "max_problem_bytes" in msg


def test_pricing_cut_short_reports_its_bound(fake_world, monkeypatch):
    """With too few options allowed to prove optimality, pricing returns its
    best plan as "feasible", with a bound no higher than the true optimum."""
    from autoparallel.problem import pricing as option_pricing

    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2))
    model, example = _tiny_llama()
    with AutoParallel(model, mesh, example, time_limit=None, option_pricing=False) as autop:
        autop.add_input_constraints([(Shard(0), Replicate())])
        autop.add_parameter_memory_constraint()  # fully sharded: a problem pricing cannot prove at once
        best = autop.optimize_placement().solution.objective
        seeds = option_pricing.seed_options(autop.built.problem, autop.built.strategies)
        # the seed holds a plan: the greedy one, closed over structural edges
        greedy = option_pricing.greedy_plan(autop.built.problem)
        assert all(greedy[name] in seeds[name] for name in greedy)
        assert option_pricing.compute_bound(autop.built.problem) <= best
    monkeypatch.setattr(option_pricing, "MAX_KEPT_OPTIONS", sum(len(v) for v in seeds.values()) + 20)
    # without the dual ascent, which proves this small problem before any LP round
    monkeypatch.setattr("solver.pricing_proof.ASCENT", False)
    with AutoParallel(model, mesh, example, time_limit=None, option_pricing=True) as autop:
        autop.add_input_constraints([(Shard(0), Replicate())])
        autop.add_parameter_memory_constraint()
        plan = autop.optimize_placement()
    s = plan.solution
    assert s.status == "feasible" and not s.optimal
    assert s.bound is not None and s.bound <= best * (1 + 1e-9) <= s.objective * (1 + 1e-9)
    assert s.gap == pytest.approx((s.objective - s.bound) / s.objective)


def test_coarse_mesh_plans_lift_to_the_full_mesh(fake_world):
    """Each adjacent pair of mesh dims merged gives a dense plan; lifted,
    every node takes an option placing its tensors alike on the pair, but
    for parameters whose coarse layout is a strided (tp-outer) shard of the
    merged dim, which has no such counterpart; a complete lifted plan that
    keeps every constraint costs no less than the full mesh's optimum."""
    from autoparallel.problem import coarse_seed
    from autoparallel.options.placements import placements_of
    from solver import evaluate, violations

    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2))
    with torch.device("meta"):
        model = FFN(16, 64, bias=True)
    with AutoParallel(model, mesh, torch.empty(8, 16, 16, device="meta"), time_limit=None) as autop:
        autop.add_input_constraints([(Shard(0), Shard(0), Replicate())])
        best = autop.optimize_placement().solution.objective
        built = autop.built
        plans = coarse_seed.lifted_plans(
            autop.traced,
            built.strategies,
            mesh,
            autop._constraints,
            device=autop.device,
            overlap=autop.overlap,
            repeats=autop.repeats,
        )
    # dims 1 and 2 are skipped: the input pin (S(0), S(0), R) places them differently
    assert len(plans) == 1
    names = {n.name for n in built.strategies}
    for i, plan in enumerate(plans):
        # a node is left out only when its lifted option is not in its list
        # (a tp-outer parameter's strided shard on the merged dim)
        weights = {n.name for n in autop.traced.param_nodes.values()}
        weights |= {n.name for n in autop.traced.grad_nodes.values() if n is not None}
        assert set(plan) <= names and names - set(plan) <= weights
        for node, strat in built.strategies.items():
            if node.name not in plan:
                continue
            out = placements_of(strat.options[plan[node.name]].output_specs)
            for p in out if isinstance(out[0], tuple) else (out,):
                assert p[i] == p[i + 1], (node.name, i, p)
        if set(plan) == names and not violations(built.problem, plan):
            assert sum(evaluate(built.problem, plan)) >= best * (1 - 1e-9)


# slow (six coarse solves of the tiny LLaMA): by default lifted_plans and its
# worker threads run in test_pricing_plan_has_the_dense_optimum[ffn-shape1-True]
# and test_coarse_mesh_plans_lift_to_the_full_mesh
@pytest.mark.slow
def test_coarse_plans_solved_side_by_side_equal_one_after_the_other(fake_world, monkeypatch):
    """lifted_plans builds each coarse problem while the previous ones solve
    in worker threads; its plans are lifted_plan's for each pair of dims in
    turn, with one worker or two."""
    from autoparallel.problem import coarse_seed

    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2))
    model, _ = _tiny_llama()
    with AutoParallel(model, mesh, torch.empty(8, 16, dtype=torch.long, device="meta"), time_limit=None) as autop:
        autop.add_input_constraints([(Shard(0),) * 3])  # no pair of dims placed differently
        built = autop.build_problem()
        kw = dict(device=autop.device, overlap=autop.overlap, repeats=autop.repeats)
        one_by_one = [
            coarse_seed.lifted_plan(autop.traced, built.strategies, mesh, autop._constraints, merge=i, **kw)
            for i in coarse_seed.merge_candidates(mesh)
        ]
        side_by_side = {}
        for workers in (1, 2):
            monkeypatch.setattr(coarse_seed, "SOLVER_THREADS", workers)
            side_by_side[workers] = coarse_seed.lifted_plans(
                autop.traced, built.strategies, mesh, autop._constraints, **kw
            )
    assert len(one_by_one) == 2 and all(one_by_one)
    assert side_by_side[1] == side_by_side[2] == one_by_one


# ~2-3 min (pricing on 2x2x2, then a LocalTensorMode step of 8 ranks)
@pytest.mark.slow
def test_priced_plan_applies_and_trains_like_one_device(fake_world):
    """A plan made by option pricing is an ordinary plan: applied on 8
    LocalTensorMode ranks, loss and gradients equal the single-device model."""
    from test_apply import LOCAL_TENSOR_PASSES, _train_and_compare  # same directory

    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    model, _ = _tiny_llama()
    example = torch.empty(8, 16, dtype=torch.long, device="meta")
    with AutoParallel(model, mesh, example, option_pricing=True) as autop:
        batch = (Shard(0),) * 3
        autop.add_input_constraints([batch])
        autop.add_output_constraints([batch])
        plan = autop.optimize_placement()
        parallel = autop.apply_placement(plan, pass_options=LOCAL_TENSOR_PASSES)
    assert plan.solution.backend.startswith("pricing")
    _train_and_compare("llama", parallel, mesh, steps=1)
