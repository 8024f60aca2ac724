"""Plan a DeepSeek-style MoE on a fake mesh and show what it chose for the experts.

    PYTHONPATH=. python examples/example_moe.py                       # debug, 2 x 2
    PYTHONPATH=. python examples/example_moe.py --model 16B --layers 4 --mesh 8 8 --seq 4096
    PYTHONPATH=. python examples/example_moe.py --pin-ep              # EP on the last mesh dim

Nothing to annotate: the routed experts are one op (``moe_experts``) with a
sharding rule (autoparallel/options/rules/moe.py) offering replicate, token-parallel,
expert-parallel (weights ``Shard(0)``) and hidden-dim TP per mesh dim; the
solver picks by cost. ``--pin-ep`` shows how to force a layout: pin the
expert weights' placeholders with ``add_node_constraint``.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoparallel import AutoParallel
from autoparallel.cli import HelpFormatter, setup_logging, user_errors
from autoparallel.passes.chunk_options import check_chunk_modules, parse_chunk_args
from autoparallel.models import MOE_CONFIGS, MoETransformer


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="example_moe.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", default="debug", choices=sorted(MOE_CONFIGS), help="MoE config")
    p.add_argument("--layers", type=int, default=None, help="override the config's layer count")
    p.add_argument("--mesh", type=int, nargs="+", default=[2, 2], help="mesh shape")
    p.add_argument("--seq", type=int, default=16, help="sequence length")
    p.add_argument("--batch", type=int, default=None, help="default: one sequence per rank")
    p.add_argument("--pin-ep", action="store_true", help="experts Shard(0) on the last mesh dim")
    p.add_argument(
        "--chunk",
        nargs="*",
        default=None,
        metavar="PATTERN=MODE",
        help="also apply with chunk_regions (no value: layers.*.moe=batch) and print what it did",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log the planner's detail; tracebacks of errors")
    a = p.parse_args(argv)
    setup_logging(verbose=a.verbose)
    with user_errors("example_moe.py", verbose=a.verbose):
        plan_moe(a)


def plan_moe(a: argparse.Namespace) -> None:
    world = 1
    for n in a.mesh:
        world *= n
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", tuple(a.mesh))
        base = MOE_CONFIGS[a.model]
        args = dataclasses.replace(base, n_layers=a.layers or base.n_layers, max_seq_len=max(a.seq, 16))
        with torch.device("meta"):
            model = MoETransformer(args)
        if a.chunk is not None:  # before the trace: patterns that name no module are typos
            check_chunk_modules(_chunk_modules(a.chunk), (name for name, _ in model.named_modules()))
        x = torch.empty(a.batch or world, a.seq, dtype=torch.long, device="meta")
        with AutoParallel(model, mesh, x, input_constraints=[(Shard(0),) * mesh.ndim]) as autop:
            autop.add_output_constraints([(Shard(0),) * mesh.ndim])
            if a.pin_ep:
                pin = (Replicate(),) * (mesh.ndim - 1) + (Shard(0),)
                for fqn, node in autop.traced.param_nodes.items():
                    if fqn.endswith(("moe.w1", "moe.w2", "moe.w3")):
                        autop.add_node_constraint(node, pin)
                autop.add_parameter_memory_constraint(high=1.0)
            plan = autop.optimize_placement()
            if a.chunk is not None:
                _apply_chunked(autop, plan, a.chunk)
        print(plan.summary())
        print("routed experts:")
        for n in plan.nodes.values():
            if "moe_experts" in n.op:
                print(f"  {n.name:28s} {n.phase:8s} {', '.join(n.input_placements)} -> {n.output_placements}")
    finally:
        dist.destroy_process_group()


def _chunk_modules(values) -> dict[str, str]:
    return parse_chunk_args(values or ["layers.*.moe=batch"])


def _apply_chunked(autop, plan, values) -> None:
    """Apply with ``chunk_modules`` from ``--chunk`` and print the pass stats."""
    from autoparallel.passes import PassOptions

    autop.apply_placement(plan, pass_options=PassOptions(chunk_modules=_chunk_modules(values)))
    st = plan.pass_stats.get("chunk_regions")
    print(
        f"chunk_regions: {st.regions_chunked} regions chunked, {st.regions_refused} refused, "
        f"{st.nodes_added} nodes added; estimated exposed communication of the chunked regions "
        f"{st.exposed_comm_before_s * 1e3:.3f} -> {st.exposed_comm_after_s * 1e3:.3f} ms"
    )
    for line in st.refusal_lines():
        print(line)


if __name__ == "__main__":
    main()
