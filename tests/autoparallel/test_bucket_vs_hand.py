"""Bucketed collectives against the hand FSDP2 + TP plan: on the tiny
LLaMA-3 2x2 (dp x tp) plan our forward + backward issue at most as many
collectives per step as ``fully_shard`` + ``parallelize_module`` (counted
with CommDebugMode), and bucketing keeps the estimated peak within 5%."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from _hand_plan import count_graph_collectives, count_hand_step, hand_fsdp_tp
from autoparallel import AutoParallel
from autoparallel.passes import PassOptions
from test_apply import _llama, _tokens

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:DTensor random operators.*:UserWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def test_llama_2x2_collectives_at_most_the_hand_plans(fake_world):
    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tokens = _tokens()

    torch.manual_seed(0)
    hand = hand_fsdp_tp(_llama(), mesh)
    local = tokens.chunk(2)[0]  # this rank's dp shard, replicated over tp
    hand_counts = count_hand_step(hand, local, lambda o: o.float().logsumexp(-1).mean())
    assert hand_counts["all_gather"] > 0 and hand_counts["reduce_scatter"] > 0, hand_counts

    with torch.device("meta"):
        model = _llama()
    batch = (Shard(0), Replicate())  # the hand plan's input and output
    with AutoParallel(model, mesh, torch.empty_like(tokens, device="meta")) as autop:
        autop.add_input_constraints([batch])
        autop.add_output_constraints([batch])
        plan = autop.optimize_placement()
        options = PassOptions(column_major_all_gather="reorder")
        off = autop.apply_placement(plan, disable_passes=("bucket_collectives",), pass_options=options)
        on = autop.apply_placement(plan, pass_options=options)
        stats = plan.pass_stats["bucket_collectives"]
    ours_off = count_graph_collectives(off.forward_graph, off.backward_graph)
    ours = count_graph_collectives(on.forward_graph, on.backward_graph)
    merged = sum(s.collectives_merged - s.buckets for s in stats.values())
    assert merged > 0 and sum(ours.values()) == sum(ours_off.values()) - merged
    assert sum(ours.values()) <= sum(hand_counts.values()), (dict(ours), dict(hand_counts))
    for kind, s in stats.items():
        assert s.peak_memory_after <= 1.05 * s.peak_memory_before, (kind, s)
