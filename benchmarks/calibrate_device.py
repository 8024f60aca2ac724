"""Calibrate the cost model's DeviceSpec against the GPU this runs on.

The planner prices every op with a roofline (``autoparallel.cost_model.
op_compute_time``: the slower of FLOPs at ``peak * compute_efficiency`` and
bytes at ``hbm_bw * memory_efficiency``, at least ``launch_floor``). This
script runs the kernels that dominate a LLaMA-3 8B training step at the local
shapes typical plans give a rank (full width and 1/8 tensor-parallel shards,
8192 tokens), times each on the device, and prints the model's estimate next
to the measurement. It ends with the efficiencies the measurements imply, as
a ``dataclasses.replace(<preset>, ...)`` line to plan with.

    python benchmarks/calibrate_device.py              # on a CUDA GPU
    python benchmarks/calibrate_device.py --preset H100 --tokens 4096

On a machine without CUDA it runs the same probes on the CPU at reduced size
(``--tokens 256`` by default there); the comparison with a GPU preset is then
only a smoke test of the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import importlib
import pathlib
import sys
import types

import torch


def _load_cost_model():
    """The cost model's compute and device modules.

    Imported without the rest of the package when that fails: a GPU image may
    carry another torch than the pinned one (the planner needs torch 2.13's
    private DTensor API; the roofline only needs shapes and dtypes).
    """
    try:
        from autoparallel.cost_model import compute, devices

        return compute, devices
    except ImportError as e:
        print(f"note: importing autoparallel failed ({e}); loading only its cost model")
    from torch.distributed.tensor import placement_types

    if not hasattr(placement_types, "_is_shard_like"):  # torch < 2.13 (no _StridedShard subclassing)
        placement_types._is_shard_like = lambda p: isinstance(p, placement_types.Shard)
    root = pathlib.Path(__file__).resolve().parents[1] / "autoparallel"
    for name, path in (("autoparallel", root), ("autoparallel.cost_model", root / "cost_model")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    return (
        importlib.import_module("autoparallel.cost_model.compute"),
        importlib.import_module("autoparallel.cost_model.devices"),
    )


compute, devices = _load_cost_model()
DeviceSpec, op_compute_time = devices.DeviceSpec, compute.op_compute_time

aten = torch.ops.aten

# LLaMA-3 8B: width 4096, 32 query heads / 8 KV heads of 128, FFN 14336.
DIM, FFN, KV_DIM, HEAD_DIM, N_HEADS = 4096, 14336, 1024, 128, 32


@dataclasses.dataclass
class Probe:
    name: str
    kind: str  # "compute" (GEMM), "attention" (fused SDPA), "memory" (byte-bound) or "launch"
    op: object
    make_args: object  # () -> tuple of args

    def run(self, args) -> object:
        return self.op(*args)


def _probes(tokens: int, tp: int, dtype: torch.dtype, device: torch.device) -> list[Probe]:
    def t(*shape, dt=dtype):
        return lambda: torch.randn(*shape, device=device, dtype=dt)

    def mm(m, k, n):
        return lambda: (torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))

    probes = []
    for shard, label in ((1, "full"), (tp, f"1/{tp} TP")):
        probes += [
            Probe(
                f"wq   [{tokens}x{DIM}]@[{DIM}x{DIM // shard}] {label}",
                "compute",
                aten.mm.default,
                mm(tokens, DIM, DIM // shard),
            ),
            Probe(
                f"wkv  [{tokens}x{DIM}]@[{DIM}x{KV_DIM // shard}] {label}",
                "compute",
                aten.mm.default,
                mm(tokens, DIM, KV_DIM // shard),
            ),
            Probe(
                f"w13  [{tokens}x{DIM}]@[{DIM}x{FFN // shard}] {label}",
                "compute",
                aten.mm.default,
                mm(tokens, DIM, FFN // shard),
            ),
            Probe(
                f"w2   [{tokens}x{FFN // shard}]@[{FFN // shard}x{DIM}] {label}",
                "compute",
                aten.mm.default,
                mm(tokens, FFN // shard, DIM),
            ),
        ]
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        for heads in (N_HEADS, N_HEADS // tp):
            probes.append(
                Probe(
                    f"flash attention causal [1,{heads},{tokens},{HEAD_DIM}]",
                    "attention",
                    aten._scaled_dot_product_flash_attention.default,
                    lambda heads=heads: (
                        *(torch.randn(1, heads, tokens, HEAD_DIM, device=device, dtype=dtype) for _ in range(3)),
                        0.0,
                        True,
                    ),
                )
            )
    big = tokens * FFN // tp
    probes += [
        Probe(
            f"add [{tokens}x{FFN // tp}] (SwiGLU-sized elementwise)",
            "memory",
            aten.add.Tensor,
            lambda: (t(big)(), t(big)()),
        ),
        Probe(
            f"mul [{tokens}x{DIM}] (residual-sized elementwise)",
            "memory",
            aten.mul.Tensor,
            lambda: (t(tokens * DIM)(), t(tokens * DIM)()),
        ),
        Probe(f"clone [{tokens}x{FFN // tp}] (copy)", "memory", aten.clone.default, lambda: (t(big)(),)),
        Probe("add [1] (launch floor)", "launch", aten.add.Tensor, lambda: (t(1)(), t(1)())),
    ]
    return probes


def _time(fn, device: torch.device, iters: int) -> float:
    """Median seconds of one call (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(3):
        fn()
    samples = []
    if device.type == "cuda":
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _launch_time(probe: Probe, args, device: torch.device, iters: int) -> float:
    """Per-kernel time of back-to-back tiny kernels: what a launch costs in a stream."""
    n = 200

    def burst():
        for _ in range(n):
            probe.run(args)

    return _time(burst, device, max(3, iters // 4)) / n


def _implied(spec: DeviceSpec, probe: Probe, args, out, measured: float, dtype: torch.dtype) -> float | None:
    """The efficiency that makes the roofline equal the measurement."""
    a = compute._sig_tree(tuple(args), None, [0])
    o = compute._sig_tree(out, None, [0])
    flops, nbytes = compute._flops_and_bytes_cached(probe.op, a, (), o)
    if probe.kind in ("compute", "attention") and flops > 0:
        return flops / measured / spec.peak_flops(dtype)
    if probe.kind == "memory" and nbytes > 0:
        return nbytes / measured / spec.hbm_bw
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="DeviceSpec preset to compare with (default: from the GPU's name)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 8192 on GPU, 256 on CPU)")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel degree of the sharded probes")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32", "tf32"])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    tokens = args.tokens or (8192 if device.type == "cuda" else 256)
    gpu_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    preset_name = args.preset
    if preset_name is None:
        preset_name = next((p for p in ("H200", "H100", "B200", "A100") if p in gpu_name.upper()), "H100")
    spec = DeviceSpec.get(preset_name)
    print(
        f"device: {gpu_name} (torch {torch.__version__}); comparing with preset {spec.name}; "
        f"{tokens} tokens per rank, TP {args.tp}"
    )

    implied: dict[str, list[float]] = {"compute": [], "attention": [], "memory": []}
    launch = None
    for dname in args.dtypes:
        dtype = torch.bfloat16 if dname == "bf16" else torch.float32
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = dname == "tf32"
        run_spec = dataclasses.replace(spec, fp32_uses_tf32=dname == "tf32")
        print(f"\n== {dname} ==")
        print(f"{'probe':58s} {'model us':>10s} {'measured us':>12s} {'ratio':>6s} {'implied eff':>11s}")
        for probe in _probes(tokens, args.tp, dtype, device):
            if probe.kind == "launch" and dname != args.dtypes[0]:
                continue
            inputs = probe.make_args()
            out = probe.run(inputs)
            estimate = op_compute_time(probe.op, inputs, {}, out, None, None, run_spec)
            if probe.kind == "launch":
                measured = _launch_time(probe, inputs, device, args.iters)
                launch = measured
            else:
                measured = _time(lambda: probe.run(inputs), device, args.iters)  # noqa: F821 - `del inputs` below
            eff = _implied(run_spec, probe, inputs, out, measured, dtype)
            if eff is not None and (dname == "bf16" or probe.kind == "memory"):
                implied[probe.kind].append(eff)
            print(
                f"{probe.name:58s} {estimate * 1e6:10.1f} {measured * 1e6:12.1f} "
                f"{measured / estimate:6.2f} {'' if eff is None else f'{eff:11.2f}'}"
            )
            del inputs, out
            if device.type == "cuda":
                torch.cuda.empty_cache()

    def med(xs):
        return round(statistics.median(xs), 2) if xs else None

    fields = {
        "compute_efficiency": med(implied["compute"]),
        "attention_efficiency": med(implied["attention"]),
        "memory_efficiency": med(implied["memory"]),
    }
    if launch is not None:
        fields["launch_floor"] = float(f"{launch:.2g}")
    fields = {k: v for k, v in fields.items() if v is not None}
    print(
        f"\npreset {spec.name}: compute_efficiency {spec.compute_efficiency}, attention_efficiency "
        f"{spec.attention_efficiency}, memory_efficiency {spec.memory_efficiency}, "
        f"launch_floor {spec.launch_floor:g}"
    )
    print(
        "implied (median over probes; compute from bf16 GEMMs; launch floor from back-to-back eager "
        "launches, so it includes Python dispatch):"
    )
    print(
        f"  dataclasses.replace(DeviceSpec.get({spec.name!r}), "
        + ", ".join(f"{k}={v!r}" for k, v in fields.items())
        + ")"
    )


if __name__ == "__main__":
    main()
