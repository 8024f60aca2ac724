"""``local_map(..., redistribute_inputs=False)``: inputs that must arrive as declared.

A ``local_map`` region has one option, its declared layouts
(:mod:`autoparallel.options.rules.local_map`), so the plan always hands it
its inputs as ``in_placements``: whatever layout a producer has, a
redistribution in front of the region makes it so. That is
``redistribute_inputs=True``. With ``redistribute_inputs=False`` (local_map's
default) torch refuses a DTensor input whose placements differ from the
declared ones instead of redistributing it; for a planned step the
equivalent is that the producer itself takes the declared layout, so no
redistribution is planned in front of the region. :func:`no_redistribution_pins`
gives one pin per such input on its producer; where the producer offers no
such layout, or another constraint pins it to another one, planning refuses
naming the region, the input, both layouts.
"""

from __future__ import annotations

import torch.fx

from ..graph_vocab import module_path
from ..ops.local_map import LOCAL_MAP_REGION, region_of
from ..validation import describe_placements


def no_redistribution_pins(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, tuple, str, str]]:
    """``(producer node, declared placements, constraint name, subject)`` for
    every tensor input of a region traced with ``redistribute_inputs=False``
    (the forward region nodes; the backward takes the same producers' values
    and the output gradients, which torch's local_map redistributes too)."""
    pins = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not LOCAL_MAP_REGION:
            continue
        region = region_of(node)
        if region.redistribute_inputs:
            continue
        for k, producer, placements in zip(region.tensor_positions(), node.args[0], region.in_placements, strict=True):
            if not isinstance(producer, torch.fx.Node):
                continue
            cname = (
                f"local_map region {region.name}: input {k} declared {describe_placements(placements)} with "
                "redistribute_inputs=False (its producer must already be laid out so; redistribute_inputs=True "
                "lets the plan redistribute it)"
            )
            path = module_path(producer)
            subject = f"input {k}" + (f" (made in {path})" if path else "")
            pins.append((producer, tuple(placements), cname, subject))
    return pins
