"""Per-GPU performance figures (DeviceSpec) and presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceSpec:
    """Per-GPU performance figures. Dense (no 2:4 sparsity) datasheet peaks.

    ``peak_fp32`` is the plain FP32 (CUDA core) rate, which is what PyTorch's
    float32 matmuls get by default (``torch.backends.cuda.matmul.allow_tf32``
    is False by default). Set ``fp32_uses_tf32=True`` when training with
    ``torch.set_float32_matmul_precision("high")`` to cost fp32 at the TF32
    tensor-core rate instead.

    Bandwidths are per GPU, per direction. ``inter_node_bw`` is the GPU's own
    NIC (one NIC per GPU, rail-optimised fabric); a group spanning nodes with
    ``g`` members per node gets ``min(intra_node_bw, g * inter_node_bw)``
    (NCCL runs one ring per NIC).

    Efficiencies turn peaks into achievable rates and are fields so that
    users can calibrate them against measurements:

    * ``compute_efficiency`` 0.7: large bf16 GEMMs reach ~600-750 of H100's
      989 TFLOP/s; smaller or oddly shaped ones less.
    * ``memory_efficiency`` 0.8: copy/elementwise kernels reach ~80-85% of
      HBM peak.
    * ``attention_efficiency`` 0.3: fused attention kernels (the FLOPs of
      PyTorch's SDPA flash/efficient/cuDNN ops) run far below GEMM rates:
      ``benchmarks/calibrate_device.py`` measured 0.32 of peak for causal
      flash attention at 32 heads x 8192 tokens on an H100 (torch 2.11) and
      0.17 at 4 heads, against 0.77-0.81 for 8B-sized GEMMs.
    * ``comm_efficiency`` 0.8: nccl-tests all-gather/reduce-scatter busbw
      on 8x H100 NVLink is ~360 of 450 GB/s; IB gets ~45 of 50 GB/s, so
      0.8 is slightly pessimistic there.
    """

    name: str
    peak_bf16: float  # FLOP/s, also used for fp16
    peak_fp32: float  # FLOP/s, CUDA-core FP32 (no TF32)
    peak_tf32: float  # FLOP/s, TF32 tensor cores
    peak_fp8: float | None  # FLOP/s, None when the GPU has no fp8 tensor cores
    hbm_bw: float  # bytes/s
    intra_node_bw: float  # bytes/s per GPU per direction (NVLink)
    inter_node_bw: float  # bytes/s per GPU per direction (IB/RoCE NIC)
    # Per ring step (hop + synchronisation), NCCL-tuning-table order of size.
    intra_node_latency: float = 1e-6
    inter_node_latency: float = 3e-6
    # Smallest time of any kernel (launch + tail), also the fixed part of a
    # collective.
    launch_floor: float = 5e-6
    gpus_per_node: int = 8
    fp32_uses_tf32: bool = False
    compute_efficiency: float = 0.7
    attention_efficiency: float = 0.3
    memory_efficiency: float = 0.8
    comm_efficiency: float = 0.8
    # The share of a collective's time counted, within a node and across
    # nodes: 1.0 on a physical device; the overlap policy's counted
    # fractions for collectives that hide under compute
    # (:func:`autoparallel.cost_model.overlap.counted_device`).
    intra_node_counted: float = 1.0
    inter_node_counted: float = 1.0
    # The share of a redistribution's local copies counted: 1.0 on a
    # physical device; an edge of the planning problem counts its share of
    # copies that the applied graph makes once for several readers
    # (:func:`autoparallel.cost_model.steps.copies_device`).
    copies_counted: float = 1.0

    def __hash__(self) -> int:
        # Part of every cache key: hash the fields once, not per lookup.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(dataclasses.astuple(self))
            object.__setattr__(self, "_hash", h)
        return h

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Datasheet peak for matmul-like work in ``dtype`` (before efficiency)."""
        if dtype in (torch.bfloat16, torch.float16):
            return self.peak_bf16
        if dtype.is_floating_point and dtype.itemsize == 1:  # float8 variants
            # Without fp8 tensor cores the work runs upcast at bf16 speed.
            return self.peak_fp8 if self.peak_fp8 is not None else self.peak_bf16
        if dtype == torch.float32 and self.fp32_uses_tf32:
            return self.peak_tf32
        # float32, float64 and integer work: CUDA-core rate.
        return self.peak_fp32

    @staticmethod
    def get(name: str) -> "DeviceSpec":
        """A preset by (case-insensitive) name, e.g. ``DeviceSpec.get("h100")``."""
        try:
            return _PRESETS[name.upper()]
        except KeyError:
            raise ValueError(
                f"unknown device {name!r}; presets: {', '.join(sorted(_PRESETS))}. "
                "Build a DeviceSpec (or dataclasses.replace a preset) for others."
            ) from None


# H100 SXM5 80GB: 989 TF bf16, 67 TF fp32, 495 TF tf32, 1979 TF fp8 (dense),
# HBM3 3.35 TB/s, NVLink4 900 GB/s bidirectional, ConnectX-7 400 Gb/s per GPU.
H100 = DeviceSpec(
    name="H100",
    peak_bf16=989e12,
    peak_fp32=67e12,
    peak_tf32=495e12,
    peak_fp8=1979e12,
    hbm_bw=3.35e12,
    intra_node_bw=450e9,
    inter_node_bw=50e9,
)
# A100 SXM4 80GB: 312 TF bf16, 19.5 TF fp32, 156 TF tf32, no fp8,
# HBM2e 2.04 TB/s, NVLink3 600 GB/s bidirectional, HDR 200 Gb/s per GPU.
A100 = DeviceSpec(
    name="A100",
    peak_bf16=312e12,
    peak_fp32=19.5e12,
    peak_tf32=156e12,
    peak_fp8=None,
    hbm_bw=2.039e12,
    intra_node_bw=300e9,
    inter_node_bw=25e9,
)
# H200 SXM 141GB: H100 compute, HBM3e 4.8 TB/s, same NVLink and NIC.
H200 = dataclasses.replace(H100, name="H200", hbm_bw=4.8e12)
# B200 (HGX/DGX B200, per GPU): 2.25 PF bf16, 75 TF fp32, 1.1 PF tf32, 4.5 PF
# fp8 (dense), HBM3e 8 TB/s, NVLink5 1.8 TB/s bidirectional. DGX B200 ships
# 8x ConnectX-7 at 400 Gb/s, i.e. 50 GB/s per GPU; use
# ``dataclasses.replace(B200, inter_node_bw=100e9)`` for 800 Gb/s
# (ConnectX-8) fabrics.
B200 = DeviceSpec(
    name="B200",
    peak_bf16=2250e12,
    peak_fp32=75e12,
    peak_tf32=1100e12,
    peak_fp8=4500e12,
    hbm_bw=8e12,
    intra_node_bw=900e9,
    inter_node_bw=50e9,
)
_PRESETS = {d.name: d for d in (H100, A100, H200, B200)}
