"""Remove alias round-trips: consumers of an ``aten.alias`` that want the
alias's producer's layout read the producer directly.

When the plan lays an alias out differently from its producer (``S(0)S(1)``
-> alias as ``S(0)R``), a consumer wanting ``S(0)S(1)`` gets the alias
redistributed back: a collective for nothing, and the producer's tensor kept
alive until then. An alias is the same value as its producer, so such a
consumer is rewired to the producer (its option is unchanged and stays
valid: the input spec it wants is the producer's output spec). The alias
keeps its other consumers and is erased when none is left.

Mutates in place what apply reads: ``ctx.traced.gm`` (the joint graph, shared
with the ``AutoParallel`` object), the rewired consumers' entries of
``ctx.strategies`` (fresh ``NodeStrategy`` objects with the new inputs),
``ctx.choice`` and ``ctx.plan.nodes`` (erased aliases dropped, the freed
transitions removed from the consumers' ``incoming``). Rewiring is
value-preserving whatever plan is applied later, so a second
``apply_placement`` with this or another plan stays correct.

>>> # stats = remove_alias_round_trips(ctx)
>>> # stats.rewired, stats.aliases_erased
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .base import PassContext, register_pass

__all__ = ["AliasRoundTripStats", "remove_alias_round_trips"]

_ALIAS = torch.ops.aten.alias.default


@dataclass
class AliasRoundTripStats:
    aliases: int = 0  # alias nodes in the graph
    round_trips: int = 0  # aliases laid out unlike their producer with a consumer wanting the producer's layout
    rewired: int = 0  # consumer edges moved to the producer
    aliases_erased: list[str] = field(default_factory=list)


def _spec(ctx: PassContext, node: torch.fx.Node):
    strat = ctx.strategies[node]
    return strat.options[ctx.choice[node.name]]


def _consumer_wants_producer(ctx: PassContext, user: torch.fx.Node, alias: torch.fx.Node, want: DTensorSpec) -> bool:
    """Every input slot of ``user`` fed by ``alias`` wants ``want``'s placements."""
    strat = ctx.strategies.get(user)
    if strat is None or user.name not in ctx.choice or strat.getitem_index is not None:
        return False
    opt = strat.options[ctx.choice[user.name]]
    slots = [k for k, producer in enumerate(strat.inputs) if producer is alias]
    return bool(slots) and all(
        k < len(opt.input_specs) and opt.input_specs[k].placements == want.placements for k in slots
    )


@register_pass("remove_alias_round_trips", "plan")
def remove_alias_round_trips(ctx: PassContext) -> AliasRoundTripStats:
    """Rewire consumers of planned alias round-trips (see the module docstring)."""
    stats = AliasRoundTripStats()
    gm = ctx.traced.gm
    plan_nodes = ctx.plan.nodes if ctx.plan is not None else {}
    for alias in list(gm.graph.find_nodes(op="call_function", target=_ALIAS)):
        stats.aliases += 1
        producer = alias.args[0]
        if not isinstance(producer, torch.fx.Node) or alias not in ctx.strategies or producer not in ctx.strategies:
            continue
        produced = _spec(ctx, producer).output_specs
        aliased = _spec(ctx, alias).output_specs
        if not isinstance(produced, DTensorSpec) or not isinstance(aliased, DTensorSpec):
            continue
        if produced.placements == aliased.placements:
            continue
        movers = [u for u in alias.users if _consumer_wants_producer(ctx, u, alias, produced)]
        if not movers:
            continue
        stats.round_trips += 1
        for user in movers:
            user.replace_input_with(alias, producer)
            strat = ctx.strategies[user]
            ctx.strategies[user] = dataclasses.replace(
                strat, inputs=[producer if p is alias else p for p in strat.inputs]
            )
            node_plan = plan_nodes.get(user.name)
            if node_plan is not None:
                freed = [t for t in node_plan.incoming if t[0] == alias.name]
                node_plan.incoming = [t for t in node_plan.incoming if t[0] != alias.name]
                node_plan.comm_cost -= sum(t[2] for t in freed)
            stats.rewired += 1
        if not alias.users:
            gm.graph.erase_node(alias)
            ctx.choice.pop(alias.name, None)
            plan_nodes.pop(alias.name, None)
            stats.aliases_erased.append(alias.name)
    if stats.rewired:
        gm.graph.lint()
        gm.recompile()
    return stats
