"""The partitioned forward saves nothing the backward does not read: a
value whose only backward reader was a dead collective (removed after the
partitioner ran) is dropped from the forward's outputs and the backward's
inputs (autoparallel/apply/partition.py, drop_unread_saved)."""

from __future__ import annotations

import torch
import torch.fx

from autoparallel.apply.partition import drop_unread_saved, output_nodes


def _graphs():
    fw = torch.fx.Graph()
    x = fw.placeholder("x")
    a = fw.call_function(torch.ops.aten.relu.default, (x,))
    a.name = "a"
    b = fw.call_function(torch.ops.aten.neg.default, (a,))
    b.name = "b"
    out = fw.call_function(torch.ops.aten.sin.default, (b,))
    out.name = "sin"
    fw.output((out, a, b))  # one forward output, then the saved a and b
    bw = torch.fx.Graph()
    pa = bw.placeholder("a")
    bw.placeholder("b")  # its reader was a dead collective, removed
    t = bw.placeholder("tangents_1")
    bw.output((bw.call_function(torch.ops.aten.mul.Tensor, (pa, t)),))
    return torch.fx.GraphModule(torch.nn.Module(), fw), torch.fx.GraphModule(torch.nn.Module(), bw)


def test_a_saved_value_the_backward_does_not_read_is_dropped():
    fw, bw = _graphs()
    drop_unread_saved(fw, bw, num_fwd_outputs=1)
    assert [n.name for n in output_nodes(fw)] == ["sin", "a"]
    assert [n.name for n in bw.graph.find_nodes(op="placeholder")] == ["a", "tangents_1"]
    x = torch.randn(4)
    fw_out = fw(x)
    assert torch.equal(fw_out[0], torch.sin(-torch.relu(x)))
    (grad,) = bw(fw_out[1], torch.ones(4))
    assert torch.equal(grad, torch.relu(x))


def test_a_forward_output_is_kept_even_when_the_backward_does_not_read_it():
    fw, bw = _graphs()
    # b is both the forward's output and saved: the output stays
    (out,) = fw.graph.find_nodes(op="output")
    b = next(n for n in fw.graph.nodes if n.name == "b")
    a = next(n for n in fw.graph.nodes if n.name == "a")
    out.args = ((b, a, b),)
    fw.recompile()
    drop_unread_saved(fw, bw, num_fwd_outputs=1)
    assert [n.name for n in output_nodes(fw)] == ["b", "a"]
