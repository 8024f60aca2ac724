"""Apply stage 3: run the forward/backward graphs as one autograd op.

``ParallelStep`` holds the two graphs; ``ParallelStep.apply(primals)`` runs
the forward graph inside an ``autograd.Function`` whose backward runs the
backward graph, so gradients reach the local tensors of the parameters (and
from there, through ``DTensor.to_local``, the DTensor parameters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .cudagraphs import CudaGraphSession
from .local_graph import LocalJoint, local_shape
from .partition import StepGraphs


@dataclass
class ParallelStep:
    local: LocalJoint
    graphs: StepGraphs
    # Set when the module runs its graphs as captured CUDA graphs.
    cuda_graphs: CudaGraphSession | None = None
    # per differentiable output, the factor its incoming gradient is scaled
    # by (grad_reduction="mean": 1 / the number of shards of that output)
    grad_scales: list[float] = field(default_factory=list)
    # Set when the graphs run compiled by Inductor (apply_placement(compile=True)):
    # an .inductor.CompiledStep whose forward/backward callables stand in for
    # graphs.fw / graphs.bw (and are what CUDA graphs capture).
    compiled: Any = None

    def __call__(self, primals: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return _StepFunction.apply(self, *primals)

    def run_forward(self, primals) -> tuple:
        g = self.graphs
        fw = g.fw if self.compiled is None else self.compiled.forward
        if self.cuda_graphs is None:
            return tuple(fw(*primals))
        outs = self.cuda_graphs.forward(fw, primals)
        # The user's outputs (the loss) leave the graph's memory, which the
        # next step overwrites; saved values stay for the backward graph.
        n = g.num_fwd_outputs
        return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in outs[:n]) + tuple(outs[n:])

    def run_backward(self, args) -> list:
        bw = self.graphs.bw if self.compiled is None else self.compiled.backward
        if self.cuda_graphs is None:
            return list(bw(*args))
        return list(self.cuda_graphs.backward(bw, args))


class _StepFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: ParallelStep, *primals):
        g = step.graphs
        outs = step.run_forward(list(primals))
        fwd, saved = outs[: g.num_fwd_outputs], outs[g.num_fwd_outputs :]
        ctx.step = step
        ctx.save_for_backward(*saved)
        diff = set(step.local.differentiable_outputs)
        ctx.mark_non_differentiable(*[o for i, o in enumerate(fwd) if i not in diff])
        return tuple(fwd)

    @staticmethod
    def backward(ctx, *grad_outputs):
        step: ParallelStep = ctx.step
        local, g = step.local, step.graphs
        saved = ctx.saved_tensors
        tangents = []
        scales = step.grad_scales or [1.0] * len(local.differentiable_outputs)
        for i, scale in zip(local.differentiable_outputs, scales):
            t = grad_outputs[i]
            if t is None:
                spec = local.output_specs[i]
                t = torch.zeros(
                    local_shape(spec), dtype=spec.tensor_meta.dtype, device=saved[0].device if saved else None
                )
            tangents.append(t.contiguous() if scale == 1.0 else t.contiguous() * scale)
        args = [saved[j] if kind == "saved" else tangents[j] for kind, j in g.bw_inputs]
        grads = step.run_backward(args)
        n_params = len(local.param_fqns)
        if len(grads) != n_params:
            raise RuntimeError(f"backward graph returned {len(grads)} gradients for {n_params} parameters")
        rest = [None] * (len(ctx.needs_input_grad) - 1 - n_params)
        return (None, *grads, *rest)
