"""autoparallel_backend: torch.compile of a parallel module keeps the first
partition's decisions (same forward all-gathers, same saved values) and
computes what eager computes. The fake process group runs the collectives
deterministically (all-gather copies, reduce-scatter keeps the local chunk),
so compiled vs eager on it is a valid numerics comparison (LocalTensorMode
graph-breaks under dynamo)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from autoparallel import AutoParallel, autoparallel_backend
from autoparallel.apply.partition import SAVE_TAG
from autoparallel.compile import LAST_PARTITION

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

AG = torch.ops._c10d_functional.all_gather_into_tensor.default


def _ffn():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.target is target)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_compile_keeps_first_partition(fake_world, mesh_shape):
    fake_world(4)
    mesh = init_device_mesh("cpu", mesh_shape)
    with torch.device("meta"):
        model = _ffn()
    batch = (Shard(0),) * mesh.ndim
    with AutoParallel(model, mesh, torch.empty(16, 64, device="meta")) as autop:
        autop.add_input_constraints([batch])
        autop.add_output_constraints([batch])
        autop.add_parameter_memory_constraint(high=None)
        parallel = autop.apply_placement(autop.optimize_placement())
    torch.manual_seed(0)
    ref = _ffn()
    parallel.to_empty(device="cpu")
    parallel.load_state_dict(ref.state_dict())
    x = torch.randn(4, 64)

    out = parallel(x)
    out.pow(2).sum().backward()
    eager_grads = {n: p.grad.to_local().clone() for n, p in parallel.named_parameters()}
    for p in parallel.parameters():
        p.grad = None

    compiled = torch.compile(parallel, backend=autoparallel_backend())
    out2 = compiled(x)
    out2.pow(2).sum().backward()
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    for name, p in parallel.named_parameters():
        torch.testing.assert_close(p.grad.to_local(), eager_grads[name], rtol=0, atol=0, msg=name)

    fw1 = parallel.forward_graph
    fw2 = LAST_PARTITION.fw
    assert _count(fw1, AG) > 0 and _count(fw2, AG) == _count(fw1, AG)
    # the computed values saved: exactly the first partition's (tagged) ones
    n_out = parallel.parallel_state.step.graphs.num_fwd_outputs
    first = [n for n in fw1.graph.find_nodes(op="output")[0].args[0][n_out:] if n.op != "placeholder"]
    assert first and all(n.meta["custom"][SAVE_TAG] for n in first)
    second = [n for n in LAST_PARTITION.saved if n.meta.get("custom", {}).get(SAVE_TAG)]
    assert LAST_PARTITION.untagged_saved == []
    shape = lambda ns: sorted((tuple(n.meta["val"].shape), str(n.meta["val"].dtype)) for n in ns)
    assert shape(second) == shape(first)
