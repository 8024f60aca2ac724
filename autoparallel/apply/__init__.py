"""Apply a placement plan: a parallel ``nn.Module`` that trains with it.

The stages, one module each:

* :mod:`.redistribute`: rank-generic layout changes of local shards
  (functional collectives on the mesh dim's group);
* :mod:`.local_graph`: the joint graph re-traced on local shards with the
  plan's redistributions in between (:class:`LocalJoint`), with
  :mod:`.node_templates` copying the repeated layers' local nodes;
* :mod:`.partition`: forward/backward split by PyTorch's partitioner,
  honouring activation-checkpointing tags (:class:`StepGraphs`);
* :mod:`.runtime`: the two graphs as one autograd op (:class:`ParallelStep`);
* :mod:`.module`: the user's module structure with DTensor parameters and a
  forward that runs the step on local inputs;
* :mod:`.collectives`: what a local graph communicates, per kind and mesh dim.

:func:`autoparallel.apply_plan.apply_placement` runs these stages with the
rewrite passes of :mod:`autoparallel.passes` between them.

Usage, inside the ``AutoParallel`` context::

    plan = autop.optimize_placement()
    model = autop.apply_placement(plan)
    model.to_empty(device="cuda"); model.init_weights()
    loss = model(local_inputs).sum(); loss.backward()
"""

from __future__ import annotations

from .collectives import Collective, collectives, summarize
from .inductor import CompiledStep
from .cudagraphs import CudaGraphError, release_cuda_graphs
from .local_graph import ApplyError, LocalJoint, build_local_joint, local_shape
from .module import InputSlot, ParallelModuleMixin, ParallelState
from .partition import Partitioner, StepGraphs, split_joint
from .redistribute import UnsupportedRedistribution, redistribute
from .runtime import ParallelStep
from .state import ApplyState, GradReduction

__all__ = [
    "ApplyError",
    "ApplyState",
    "GradReduction",
    "Partitioner",
    "Collective",
    "CompiledStep",
    "CudaGraphError",
    "InputSlot",
    "LocalJoint",
    "ParallelModuleMixin",
    "ParallelState",
    "ParallelStep",
    "StepGraphs",
    "UnsupportedRedistribution",
    "build_local_joint",
    "collectives",
    "local_shape",
    "redistribute",
    "release_cuda_graphs",
    "split_joint",
    "summarize",
]
