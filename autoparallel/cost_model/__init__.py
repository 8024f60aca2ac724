"""Cost model: seconds for running an op under a placement and for moving a
tensor from one placement to another.

Everything here is a pure function of explicit, hashable inputs, so results
are cached: planning LLaMA-3 on a 16x8 mesh asks for tens of thousands of
(node, option) costs, and repeated layers make most of them repeats.

Three parts:

* **Compute** (roofline): ``max(flops / peak, bytes / hbm_bw, launch floor)``
  on the *local* (per-rank) shapes. FLOPs come from the per-op formulas of
  ``torch.utils.flop_counter`` called on shapes, so nothing is allocated.
* **Communication** (:mod:`.comm`, the reference): the steps of a
  redistribution (DTensor's own plan, or a min-cost plan where strictly
  cheaper), each costed with a ring model per mesh dim (:mod:`.steps`); a
  mesh dim is intra-node when every group along it sits in one node.
  :func:`.comm.edge_time` is what the planning problem counts for a move
  (overlap discount, bucket copies, tiebreak).
  Placements are read through one encoding (:mod:`.placement_codes`);
  :mod:`.class_costs` computes whole grids of the same figures with numpy.
* **Overlap**: a policy saying how much of an FSDP-style parameter
  all-gather / gradient reduce-scatter stays exposed.

Example::

    >>> import torch
    >>> dev = DeviceSpec.get("H100")
    >>> t = compute_time(2 * 4096**3, 3 * 4096 * 4096 * 2, torch.bfloat16, dev)
    >>> round(t * 1e6)  # a 4096^3 bf16 matmul: ~199 us at 70% of 989 TFLOP/s
    199
    >>> t = collective_time("all_gather", 64 * 2**20, 8, True, dev)
    >>> round(t * 1e6)  # gather 8 x 64 MiB shards over NVLink at 360 GB/s
    1317

All times are seconds (float); all sizes bytes. Every cache is registered
with :mod:`.caches`; :func:`clear_caches` clears them all.
"""

from .caches import clear_caches
from .comm import (
    TRANSITION_TIEBREAK,
    CommStep,
    MeshDimTopology,
    collective_time,
    edge_time,
    is_tp_outer,
    mesh_dim_topology,
    redistribute_steps,
    redistribute_time,
    tp_outer_placements,
)
from .compute import (
    TensorSig,
    compute_time,
    is_free_op,
    local_shape,
    node_compute_time,
    op_compute_time,
    op_cost_from_shapes,
    op_flops_and_bytes,
)
from .devices import A100, B200, H100, H200, DeviceSpec
from .steps import copies_device
from .overlap import (
    BACKWARD_ACTIVATION,
    GRAD_REDUCE_SCATTER,
    PARAM_ALL_GATHER,
    PARAM_BACKWARD_GATHER,
    CommOverlapPolicy,
    ComputeWindows,
    HiddenComm,
    apply_discount,
    counted_device,
    per_link,
)

__all__ = [
    "DeviceSpec",
    "H100",
    "A100",
    "H200",
    "B200",
    "TRANSITION_TIEBREAK",
    "TensorSig",
    "is_free_op",
    "compute_time",
    "op_flops_and_bytes",
    "op_cost_from_shapes",
    "op_compute_time",
    "node_compute_time",
    "local_shape",
    "MeshDimTopology",
    "mesh_dim_topology",
    "collective_time",
    "CommStep",
    "redistribute_steps",
    "redistribute_time",
    "edge_time",
    "is_tp_outer",
    "tp_outer_placements",
    "CommOverlapPolicy",
    "ComputeWindows",
    "HiddenComm",
    "PARAM_ALL_GATHER",
    "PARAM_BACKWARD_GATHER",
    "BACKWARD_ACTIVATION",
    "GRAD_REDUCE_SCATTER",
    "apply_discount",
    "counted_device",
    "per_link",
    "copies_device",
    "clear_caches",
]
