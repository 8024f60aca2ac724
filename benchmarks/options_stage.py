"""Time the options stage on its own: DTensor strategies expanded
over the mesh and converted to options, the per-option compute costs
(problem_builder's unary loop), and the exact Partial pruning; no pair
matrices (a 4-D 70B problem's would not fit). Prints CPU and wall seconds,
load average and peak RSS; asserts nothing::

    python benchmarks/options_stage.py --model 70B --layers 1 --mesh 4,4,8,8
    python benchmarks/options_stage.py --model 8B --layers 32 --mesh 4,4,8 --dump /tmp/a.txt

``--dump`` writes every option list (labels, compute costs) and the pruned
lists, to compare two versions of the planner byte for byte.

Measured (2-core machine shared with other jobs, load average 1-3 after,
2.5-5 before; CPU seconds, main a13b14c -> optspeed branch; same option
lists, costs and pruned lists, compared with --dump):

    LLaMA-3 70B 4x4x8x8, 1 layer   options 33.6-34.0 -> 11.1-14.5
                                   pruning  6.2-7.5  ->  3.7-4.6
    LLaMA-3 70B 4x4x8x8, 80 layers options 38.4-39.3 -> 12.7-16.6
                                   pruning  9.4-10.1 ->  4.6-5.0
    LLaMA-3 8B 4x4x8, 32 layers    options 3.4 -> 1.7, pruning 1.1 -> 0.8
    LLaMA-3 8B 16x8, 32 layers     options 0.6 -> 0.5-0.7, pruning 0.2 -> 0.2

Unary costs (70B 4-D): 3.0-3.8 -> 2.1 s (argument walk reordered, same answers).
Peak RSS unchanged (70B 4-D 80 layers: ~750 MiB).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MESH_NAMES = {2: ("dp", "tp"), 3: ("dp_replicate", "dp_shard", "tp"), 4: ("dp_replicate", "dp_shard", "cp", "tp")}


class _Clock:
    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        wall, cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        print(f"{self.what}: {cpu:.2f} s CPU ({wall:.2f} s wall, load {os.getloadavg()[0]:.2f})", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="70B")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--mesh", default="4,4,8,8", help="mesh shape, comma-separated (2 to 4 dims)")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dump", default=None, help="write the option lists and pruned lists to this file")
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autoparallel import cost_model
    from autoparallel.problem import builder as problem_builder
    from autoparallel.models.llama3 import LLAMA3_CONFIGS, Transformer, apply_ac
    from autoparallel.options.pruning import prune_partials
    from autoparallel.capture.repeated_layers import find_repeated_layers
    from autoparallel.options.strategies import StrategyEnumerator
    from autoparallel.capture.tracing import trace_training_step

    shape = tuple(int(x) for x in a.mesh.split(","))
    world = 1
    for n in shape:
        world *= n
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_NAMES[len(shape)])
    config = dataclasses.replace(LLAMA3_CONFIGS[a.model], n_layers=a.layers, max_seq_len=a.seq)
    with torch.device("meta"):
        model = Transformer(config)
    apply_ac(model, mode="selective")
    print(f"LLaMA-3 {a.model}, {a.layers} layers, mesh {shape}", flush=True)
    with contextlib.ExitStack() as stack:
        with _Clock("tracing"):
            tokens = torch.randint(0, config.vocab_size, (a.batch, a.seq), device="meta")
            traced = trace_training_step(model, (tokens,), "cpu", stack=stack)
        stack.enter_context(unset_fake_temporarily())
        enumerator = StrategyEnumerator(mesh)
        with _Clock("options"):
            strategies = enumerator.enumerate(traced.gm, set(traced.param_nodes.values()))
        st = enumerator.stats
        lists = {id(s.options): s for s in strategies.values()}
        print(f"  {st.nodes} nodes, {st.options:,} options, {len(lists)} distinct lists ({st.computed} computed)")
        device = cost_model.H100
        unary: dict[int, list[float]] = {}
        with _Clock("unary costs"):  # as problem_builder.build_problem computes them
            for node, strat in strategies.items():
                if id(strat.options) not in unary:
                    unary[id(strat.options)] = [
                        cost_model.node_compute_time(node, o.input_specs, o.output_specs, device)
                        + problem_builder._in_op_time(o.in_op, mesh, device)
                        if node.op == "call_function" and strat.getitem_index is None
                        else 0.0
                        for o in strat.options
                    ]
        with _Clock("pruning"):
            repeats = find_repeated_layers(traced)
            pruned, stats = prune_partials(strategies, unary, set(), mesh.ndim, list(repeats.reference.items()))
        print(f"  {stats.describe()}")
        if a.dump:
            with open(a.dump, "w") as f:
                for node, strat in strategies.items():
                    f.write(f"{node.name} {strat.source} {len(strat.options)}\n")
                    for o, c in zip(strat.options, unary[id(strat.options)]):
                        f.write(f"  {o.label} {c!r} {o.in_op}\n")
                for node, strat in pruned.items():
                    f.write(f"pruned {node.name}: {' '.join(o.label for o in strat.options)}\n")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
