"""The moments a training step allocates beyond what it holds throughout
(autoparallel/problem/memory_peaks.py): the backward's largest live set,
read off hand-made joint graphs; the peak formula; which moment the
budget's linear row sums."""

from __future__ import annotations

import torch
import torch.fx

from autoparallel.problem.memory_budget import StepMemoryModel
from autoparallel.problem.memory_peaks import (
    ADAMW_FOREACH_INTERMEDIATES,
    backward_transients,
    optimizer_step_bytes,
)

aten = torch.ops.aten


class _Joint:
    """A joint graph written by hand: ``fw``/``bw`` add a node of ``numel``
    bf16 elements tagged as AOT autograd tags forward and backward nodes."""

    def __init__(self):
        self.g = torch.fx.Graph()

    def _node(self, op, args, numel: int, tag: str, name: str):
        n = self.g.call_function(op, tuple(args))
        n.name = name
        n.meta["val"] = torch.empty(numel, dtype=torch.bfloat16, device="meta")
        n.meta["partitioner_tag"] = tag
        return n

    def placeholder(self, name: str, numel: int, tag: str = "is_forward"):
        n = self.g.placeholder(name)
        n.meta["val"] = torch.empty(numel, dtype=torch.bfloat16, device="meta")
        n.meta["partitioner_tag"] = tag
        return n

    def fw(self, name, *args, numel=100, op=aten.relu.default):
        return self._node(op, args, numel, "is_forward", name)

    def bw(self, name, *args, numel=100, op=aten.mul.Tensor):
        return self._node(op, args, numel, "is_backward", name)

    def done(self, *outs) -> torch.fx.GraphModule:
        self.g.output(tuple(outs))
        return torch.fx.GraphModule(torch.nn.Module(), self.g)


def _names(nodes) -> list[str]:
    return [n.name for n in nodes]


def test_the_largest_live_set_of_the_backward():
    j = _Joint()
    x = j.placeholder("x", 100)
    a = j.fw("a", x)  # saved: held, not a transient
    t = j.placeholder("tangent", 100, "is_backward")
    g1 = j.bw("g1", t, a, numel=500)  # lives until g3 reads it
    g2 = j.bw("g2", g1, numel=50)
    g3 = j.bw("g3", g1, g2, numel=50)
    g4 = j.bw("g4", g3, numel=400)  # with its input g3: g1 and g2 are dead by now
    gm = j.done(a, g4)
    # at g3: g1 + g2 + g3 = 600 against g3 + g4 = 450
    assert _names(backward_transients(gm, {a}, set(), set())) == ["g1", "g2", "g3"]
    g4.meta["val"] = torch.empty(700, dtype=torch.bfloat16, device="meta")
    assert _names(backward_transients(gm, {a}, set(), set())) == ["g3", "g4"]


def test_recomputed_values_are_made_before_their_first_reader_after_what_they_read():
    j = _Joint()
    x = j.placeholder("x", 100)
    saved = j.fw("saved", x)
    r1 = j.fw("r1", saved, numel=200)  # recomputed, read only to recompute r2
    r2 = j.fw("r2", r1, numel=200)  # recomputed, read by the backward
    t = j.placeholder("tangent", 100, "is_backward")
    b1 = j.bw("b1", t, numel=10)
    b2 = j.bw("b2", b1, r2, numel=10)
    b3 = j.bw("b3", b2, numel=10)
    gm = j.done(r2, b3)
    # r1 lives until r2 is made, r2 until b2 reads it: at r2's making r1,
    # r2 and b1 are live (410 bytes of values of 2 bytes each)
    got = backward_transients(gm, {saved}, {r1, r2}, set())
    assert _names(got) == ["b1", "r1", "r2"]
    # not recomputed (saved instead): r1 and r2 are held, not transients
    assert _names(backward_transients(gm, {saved, r2}, set(), set())) in (["b1", "b2"], ["b2", "b3"])


def test_a_gradient_lives_only_at_its_node_and_views_take_no_memory():
    j = _Joint()
    x = j.placeholder("x", 100)
    t = j.placeholder("tangent", 100, "is_backward")
    wgrad = j.bw("wgrad", t, numel=1000)  # a parameter's gradient: reduced at once
    view = j.bw("view", t, numel=5000, op=aten.view.default)
    act = j.bw("act", view, numel=300)
    act2 = j.bw("act2", act, numel=300)
    gm = j.done(x, wgrad, act2)
    assert _names(backward_transients(gm, set(), set(), {wgrad})) == ["wgrad"]
    wgrad.meta["val"] = torch.empty(200, dtype=torch.bfloat16, device="meta")
    # act (300) and act2 (300) together beat the gradient alone; the view is free
    assert _names(backward_transients(gm, set(), set(), {wgrad})) == ["act", "act2"]


def test_the_peak_counts_the_largest_moment():
    m = StepMemoryModel({})
    parts = {
        "parameters": 10.0,
        "gradients": 10.0,
        "optimizer": 20.0,
        "inputs": 1.0,
        "activations": 100.0,
        "outputs": 15.0,
        "output_grads": 5.0,
        "transients": 30.0,
        "loss": 50.0,
        "optimizer_step": 10.0,
    }
    # the state and outputs, saved + the outputs' gradients, and the larger
    # of the backward's and the loss's
    assert m.peak(parts) == 56.0 + 105.0 + 50.0
    parts["transients"] = 70.0
    assert m.peak(parts) == 56.0 + 105.0 + 70.0
    # the optimizer step against everything the backward holds beyond the
    # outputs (the caller keeps those to the step's end)
    parts["optimizer_step"] = 500.0
    assert m.peak(parts) == 56.0 + 500.0
    assert optimizer_step_bytes(1000) == 4 * ADAMW_FOREACH_INTERMEDIATES * 1000


def test_the_row_sums_the_state_and_one_moment():
    m = StepMemoryModel({}, row_categories=["parameters", "activations", "loss"])
    assert m.row_bytes({"parameters": 1.0, "activations": 2.0, "loss": 4.0, "transients": 8.0}) == 7.0
    # older plans (no row categories in their JSON) sum what they always did
    old = StepMemoryModel.from_json({"terms": {}, "optimizer": "AdamW", "optimizer_bytes_per_element": 8})
    assert "transients" not in old.row_categories and "activations" in old.row_categories
