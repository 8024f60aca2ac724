"""The overlap scheduler's picture of a graph: when compute and collectives
run, where compute waits for communication (exposed), and live bytes.

Replays :meth:`autoparallel.passes.overlap_model.Info.estimate` on the
graph's final order with its :class:`~autoparallel.passes.overlap_model.Clock`,
recording intervals instead of only totals: compute runs on one stream,
collectives on their link's (a collective starts when both its issue point
and the link's previous collective are done); a wait whose collective has
not finished is exposed time. Kept small for the plan:
consecutive compute is merged into one span and the memory curve is
sampled to at most ``max_points`` points.
"""

from __future__ import annotations

import torch.fx as fx

from ..passes.overlap_model import Clock, Costs, Info, live_curve


class _Ctx:
    def __init__(self, mesh, device):
        self.mesh, self.device = mesh, device


def simulate(gm: fx.GraphModule, mesh, device, *, max_points: int = 400) -> dict:
    nodes = list(gm.graph.nodes)
    info = Info(nodes, Costs(_Ctx(mesh, device)))
    clock = Clock(info)
    compute: list[list] = []  # [start, end]
    comm: list[list] = []  # [start, end, label]
    exposed: list[list] = []  # [start, end]
    at: list[float] = []  # time after each node
    for n in nodes:
        span = clock.run(n)
        k = info.kind[n]
        if span is None:
            pass
        elif k == 1:
            comm.append([*span, str(n.target).split("::")[-1].split(".")[0]])
        elif k == 2:
            exposed.append(list(span))
        elif k == 3 and span[1] > span[0]:
            if compute and abs(compute[-1][1] - span[0]) < 1e-12:
                compute[-1][1] = span[1]
            else:
                compute.append(list(span))
        at.append(clock.now)
    live = live_curve(info, nodes)
    step = max(1, len(nodes) // max_points)
    curve = [[at[i], live[i]] for i in range(0, len(nodes), step)]
    if nodes:
        peak_i = max(range(len(live)), key=live.__getitem__)
        curve.append([at[peak_i], live[peak_i]])
        curve.sort()
    return {
        "end": clock.end(),
        "compute": _merge(compute, max_points),
        "comm": comm[: 4 * max_points],
        "exposed": exposed,
        "memory": curve,
        "peak_bytes": max(live) if live else 0,
    }


def _merge(spans: list[list], limit: int) -> list[list]:
    """Join spans whose gap is below 1/limit of the total until few remain."""
    if len(spans) <= limit:
        return spans
    total = spans[-1][1] - spans[0][0]
    gap = total / limit
    out = [list(spans[0])]
    for s, e in spans[1:]:
        if s - out[-1][1] < gap:
            out[-1][1] = e
        else:
            out.append([s, e])
    return out
