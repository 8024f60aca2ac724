"""Fuse chained per-mesh-dim all-gathers into one all-gather over the mesh.

A tensor sharded on several mesh dims (``S(0)S(0)``, ``S(1)S(1)`` on dp x tp)
that a consumer needs replicated is gathered one mesh dim at a time::

    ag(x, T, tp) -> wait -> [layout ops that cancel] -> ag(., D, dp) -> wait

and, when the sharded tensor dim ``k`` is not 0, each step is followed by the
split/cat that moves the gathered chunks from dim 0 to dim ``k``. Such a chain
is one all-gather on the whole mesh::

    ag(x, D*T, G) -> wait [-> split(x.shape[0]) -> cat(dim=k)]

Data layout: the first step concatenates the chunks of its group A in A's
rank order, the next step concatenates those blocks in B's order, so chunk
``(a, b)`` lands at position ``b * |A| + a``: the mesh dim gathered first
runs fastest. ``G`` must list the mesh's ranks in that order: the row-major
flattened mesh when the chain goes from the last mesh dim to the first (what
DTensor's default shard order produces), a column-major group (first mesh
dim fastest) when it goes the other way (``shard_order``/``_StridedShard``
layouts). Groups are created once per (mesh, order) and cached.

The rewrite fires only when it is provably the same tensor: the gathered
mesh dims are distinct and their sizes multiply to the mesh size, every
step gathers along the same tensor dim, the ops between two steps are pure
views whose result has the shape, strides and offset of their input (they
compose to the identity), and no intermediate value has another user.

LocalTensorMode only simulates groups whose ranks are sorted: with it, pass
``column_major="reorder"`` (row-major group, then a local transpose of the
chunks) to :func:`fuse_all_gathers` for non-row-major chains, or set
``PassOptions.column_major_all_gather = "reorder"`` for apply; gloo and NCCL
take the column-major group.

>>> # stats = fuse_all_gathers(gm, ctx)   # gm: forward or backward graph
>>> # stats.fused, stats.by_order          # e.g. 8, {"row_major": 8}
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..torch_compat import new_group_in_order, new_group_keeps_order
from .base import ColumnMajorAllGather, PassContext, register_pass
from ..graph_vocab import ALL_GATHER as _AG, WAIT as _WAIT

__all__ = ["FuseAllGathersStats", "fuse_all_gathers", "mesh_group"]

_aten = torch.ops.aten
# Pure views: their output's (shape, stride, offset) fixes which input
# element every output element is, so equal metadata means identity.
_VIEWS = {
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.permute.default,
    _aten.t.default,
    _aten.transpose.int,
    _aten.alias.default,
    _aten.unsqueeze.default,
    _aten.squeeze.dim,
    _aten.squeeze.dims,
    _aten.detach.default,
    # DTensor's unpadding after a gather emits a full-range narrow whenever
    # the size is not a small cached int (``size is not logical_size``); a
    # slice that cuts cannot be undone by the views above, so the identity
    # check still rejects any real cut.
    _aten.slice.Tensor,
}


@dataclass
class FuseAllGathersStats:
    fused: int = 0  # chains replaced by one all-gather
    all_gathers_removed: int = 0  # collectives saved (chain length - 1 each)
    by_order: dict[str, int] = field(default_factory=dict)  # "row_major" / "column_major" / other order
    rejected: dict[str, int] = field(default_factory=dict)  # why a chain start did not fuse


# -- process groups ------------------------------------------------------------
# (mesh id, mesh-dim order fastest-first, method) -> group; validated against
# the live process groups since tests re-create the default group.
_GROUPS: dict[tuple, tuple[object, dist.ProcessGroup]] = {}


def _order_name(order: tuple[int, ...], ndim: int) -> str:
    if order == tuple(reversed(range(ndim))):
        return "row_major"
    if order == tuple(range(ndim)):
        return "column_major"
    return "order_" + "_".join(map(str, order))


def mesh_group(mesh, order: tuple[int, ...]) -> dist.ProcessGroup:
    """The process group over all of ``mesh`` whose rank order has mesh dim
    ``order[0]`` fastest, then ``order[1]``, ... (``order`` lists every mesh
    dim). Row-major (last dim fastest) is the flattened mesh. Created once per
    mesh and order; every rank must call this in the same order (as the pass
    does: it walks the same graph on every rank)."""
    key = (id(mesh), order)
    hit = _GROUPS.get(key)
    if hit is not None and hit[0] is mesh and hit[1] in dist.distributed_c10d._world.pg_map:
        return hit[1]
    # (apply runs inside AutoParallel's fake mode; the mesh is real)
    with unset_fake_temporarily():
        ranks = mesh.mesh.permute(tuple(reversed(order))).flatten().tolist()
        if ranks == sorted(ranks) and mesh.mesh_dim_names:
            group = mesh._flatten().get_group()
        else:
            group = new_group_in_order(ranks, "autoparallel_fused_all_gather")
    if dist.get_process_group_ranks(group) != ranks:
        raise RuntimeError(f"fused all-gather group has ranks {dist.get_process_group_ranks(group)}, wanted {ranks}")
    _GROUPS[key] = (mesh, group)
    return group


# -- chain matching --------------------------------------------------------------
@dataclass
class _Step:
    ag: torch.fx.Node
    wait: torch.fx.Node
    out: torch.fx.Node  # the gathered tensor (wait, or the cat of its chunks)
    dim: int  # tensor dim gathered along
    mesh_dim: int
    nodes: list[torch.fx.Node]  # everything of the step after ag (for erasing)


def _single_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _group_name(ag: torch.fx.Node):
    return ag.args[2] if len(ag.args) > 2 else ag.kwargs.get("group_name")


def _match_step(ag: torch.fx.Node, dims: dict[str, int]) -> _Step | str:
    mesh_dim = dims.get(str(_group_name(ag)))
    if mesh_dim is None:
        return "group is not a mesh dim"
    wait = _single_user(ag)
    if wait is None or wait.target is not _WAIT:
        return "all-gather without a single wait"
    nodes = [wait]
    # gather along dim k: split(chunk) on dim 0, every chunk in order into one cat(dim=k)
    split = _single_user(wait)
    if split is not None and split.target is _aten.split.Tensor and len(wait.users) == 1:
        n = ag.args[1]
        x = ag.args[0].meta.get("val")
        split_dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        getitems = sorted(split.users, key=lambda u: u.args[1] if u.target is operator.getitem else -1)
        cat = _single_user(getitems[0]) if getitems else None
        if (
            isinstance(x, torch.Tensor)
            and split_dim == 0
            and split.args[1] == x.shape[0]
            and len(getitems) == n
            and all(g.target is operator.getitem and g.args[1] == i for i, g in enumerate(getitems))
            and cat is not None
            and cat.target is _aten.cat.default
            and all(_single_user(g) is cat for g in getitems)
            and list(cat.args[0]) == getitems
        ):
            k = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
            k = k % x.dim()
            return _Step(ag, wait, cat, k, mesh_dim, nodes + [split, *getitems, cat])
        return "split after the wait is not a gather along one dim"
    return _Step(ag, wait, wait, 0, mesh_dim, nodes)


def _same_layout(a, b) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and tuple(a.shape) == tuple(b.shape)
        and tuple(a.stride()) == tuple(b.stride())
        and a.storage_offset() == b.storage_offset()
        and a.dtype == b.dtype
    )


def _feeds_all_gather(node: torch.fx.Node) -> bool:
    """Some user of ``node``, directly or through pure views, all-gathers it
    (a gathered tensor with several users that all compute is no chain)."""
    todo = list(node.users)
    while todo:
        user = todo.pop()
        if user.target is _AG:
            return True
        if user.target in _VIEWS:
            todo.extend(user.users)
    return False


def _next_all_gather(step: _Step) -> tuple[torch.fx.Node, list[torch.fx.Node]] | str:
    """The all-gather fed by ``step``'s result through identity views only."""
    cur, views = step.out, []
    while True:
        user = _single_user(cur)
        if user is None:
            # A branch only blocks a chain if one of its users gathers further.
            return "intermediate has other users" if _feeds_all_gather(cur) else "chain ends"
        if user.target is _AG and user.args[0] is cur:
            break
        if user.target in _VIEWS and user.args[0] is cur:
            views.append(user)
            cur = user
            continue
        return "chain ends"
    if views and not _same_layout(cur.meta.get("val"), step.out.meta.get("val")):
        return "layout ops between the all-gathers are not the identity"
    return user, views


def _chain(ag: torch.fx.Node, dims: dict[str, int], ndim: int) -> tuple[list[_Step], list] | str:
    steps: list[_Step] = []
    between: list[torch.fx.Node] = []
    nxt = ag
    while True:
        step = _match_step(nxt, dims)
        if isinstance(step, str):
            return step if not steps else (steps, between)
        if steps and (step.dim != steps[0].dim or step.mesh_dim in {s.mesh_dim for s in steps}):
            return "steps gather different tensor dims or repeat a mesh dim" if len(steps) == 1 else (steps, between)
        steps.append(step)
        if len(steps) == ndim:
            return steps, between
        found = _next_all_gather(step)
        if isinstance(found, str):
            return found if len(steps) == 1 else (steps, between)
        nxt, views = found
        between.extend(views)


def _is_chain_start(ag: torch.fx.Node) -> bool:
    """``ag``'s input is not (a view of) another all-gather's result."""
    cur = ag.args[0]
    while isinstance(cur, torch.fx.Node) and cur.target in _VIEWS:
        cur = cur.args[0]
    if isinstance(cur, torch.fx.Node) and cur.target is _aten.cat.default and cur.args[0]:
        first = cur.args[0][0]
        if isinstance(first, torch.fx.Node) and first.target is operator.getitem:
            cur = first.args[0].args[0] if first.args[0].target is _aten.split.Tensor else cur
    return not (isinstance(cur, torch.fx.Node) and cur.target is _WAIT)


# -- rewrite ----------------------------------------------------------------------
def _copy_meta(new: torch.fx.Node, old: torch.fx.Node, val) -> None:
    new.meta.update({k: v for k, v in old.meta.items() if k != "val"})
    new.meta["val"] = val


def _rewrite(gm: torch.fx.GraphModule, steps: list[_Step], between, group, reorder: tuple[int, ...] | None) -> None:
    g = gm.graph
    first, last = steps[0], steps[-1]
    x = first.ag.args[0]
    xval = x.meta["val"]
    n = math.prod(s.ag.args[1] for s in steps)
    fake = xval.fake_mode if hasattr(xval, "fake_mode") else None

    def run(fn):
        if fake is None:
            return None
        with fake:
            return fn()

    with g.inserting_before(last.ag):
        ag = g.call_function(_AG, (x, n, group.group_name))
        ag_val = run(lambda: xval.new_empty((xval.shape[0] * n, *xval.shape[1:])))
        _copy_meta(ag, last.ag, ag_val)
        wait = g.call_function(_WAIT, (ag,))
        _copy_meta(wait, last.wait, ag_val)
        out, out_val = wait, ag_val
        if reorder is not None:
            # row-major group: put the gathered chunks in the chain's order
            shape_blocks, perm = _reorder_plan(steps, xval)
            v = g.call_function(_aten.view.default, (out, [*shape_blocks, *xval.shape]))
            p = g.call_function(
                _aten.permute.default, (v, list(perm) + list(range(len(shape_blocks), len(shape_blocks) + xval.dim())))
            )
            c = g.call_function(_aten.clone.default, (p,), {"memory_format": torch.contiguous_format})
            f = g.call_function(
                _aten.view.default, (c, list(ag_val.shape) if ag_val is not None else [-1, *xval.shape[1:]])
            )
            for node in (v, p, c, f):
                _copy_meta(node, last.wait, None)
            vv = run(lambda: ag_val.view(*shape_blocks, *xval.shape))
            _set(v, vv)
            pv = run(lambda: vv.permute(*perm, *range(len(shape_blocks), len(shape_blocks) + xval.dim())))
            _set(p, pv)
            cv = run(lambda: pv.clone(memory_format=torch.contiguous_format))
            _set(c, cv)
            _set(f, run(lambda: cv.view(ag_val.shape)))
            out, out_val = f, f.meta["val"]
        if first.dim != 0:
            # the n gathered chunks, stacked on dim 0, side by side along
            # ``dim``: what cat(split(out, rows), dim) does, in four nodes
            # whatever n is (a whole-mesh gather has n = mesh size chunks)
            d = first.dim
            shape = list(xval.shape)
            dims = list(range(1, len(shape) + 1))
            perm = dims[:d] + [0] + dims[d:]
            full = shape[:d] + [shape[d] * n] + shape[d + 1 :]
            v = g.call_function(_aten.view.default, (out, [n, *shape]))
            p = g.call_function(_aten.permute.default, (v, perm))
            c = g.call_function(_aten.clone.default, (p,), {"memory_format": torch.contiguous_format})
            f = g.call_function(_aten.view.default, (c, full))
            for node in (v, p, c):
                _copy_meta(node, last.out, None)
            _copy_meta(f, last.out, last.out.meta.get("val"))
            vv = run(lambda: out_val.view(n, *shape))
            _set(v, vv)
            pv = run(lambda: vv.permute(*perm))
            _set(p, pv)
            _set(c, run(lambda: pv.clone(memory_format=torch.contiguous_format)))
            out = f
    last.out.replace_all_uses_with(out)
    # erase the old chain, consumers first
    dead = [n for s in steps for n in (s.ag, *s.nodes)] + list(between)
    _erase_users_first(g, dead)


def _erase_users_first(g: torch.fx.Graph, dead: list[torch.fx.Node]) -> None:
    """Erase ``dead`` (a few nodes), each after its users among them
    (without indexing the whole graph)."""
    left = list(dead)
    while left:
        keep = []
        for n in reversed(left):
            if n.users:
                keep.append(n)
            else:
                g.erase_node(n)
        if len(keep) == len(left):  # users outside ``dead``: erase_node raises
            g.erase_node(keep[0])
        left = keep[::-1]


def _set(node: torch.fx.Node, val) -> None:
    node.meta["val"] = val


def _reorder_plan(steps: list[_Step], xval) -> tuple[list[int], list[int]]:
    """Row-major gathered chunks -> the chain's order: view the chunk dim as
    the mesh dims (row-major), permute to (last step ... first step)."""
    ndim_chain = [s.mesh_dim for s in steps]
    row = sorted(ndim_chain)  # mesh dims in row-major block order, outermost first
    sizes = [next(s.ag.args[1] for s in steps if s.mesh_dim == d) for d in row]
    want = list(reversed(ndim_chain))  # outermost first: the last step gathered is outermost
    perm = [row.index(d) for d in want]
    return sizes, perm


@register_pass("fuse_all_gathers", "graphs")
def fuse_all_gathers(
    gm: torch.fx.GraphModule, ctx: PassContext, *, column_major: ColumnMajorAllGather | None = None
) -> FuseAllGathersStats:
    """Replace chains of per-mesh-dim all-gathers in ``gm`` by one all-gather
    over the whole mesh (see the module docstring). ``column_major``:
    "group" (a permuted process group) or "reorder" (row-major group and a
    local reorder) for chains that are not row-major; None takes
    ``ctx.options.column_major_all_gather``."""
    if column_major is None:
        column_major = ctx.options.column_major_all_gather
    if column_major not in ("group", "reorder"):
        raise ValueError(f"column_major must be 'group' or 'reorder', got {column_major!r}")
    stats = FuseAllGathersStats()
    mesh = ctx.mesh
    if mesh is None or mesh.ndim < 2:
        return stats
    dims = {str(mesh.get_group(d).group_name): d for d in range(mesh.ndim)}
    active = [d for d in range(mesh.ndim) if mesh.size(d) > 1]
    for ag in list(gm.graph.find_nodes(op="call_function", target=_AG)):
        if ag.graph is not gm.graph or ag._erased:
            continue
        found = _chain(ag, dims, len(active))
        if isinstance(found, str):
            if found not in ("chain ends", "group is not a mesh dim") and _is_chain_start(ag):
                stats.rejected[found] = stats.rejected.get(found, 0) + 1
            continue
        steps, between = found
        if len(steps) < 2:
            continue
        if math.prod(s.ag.args[1] for s in steps) != mesh.size():
            stats.rejected["group sizes do not multiply to the mesh size"] = (
                stats.rejected.get("group sizes do not multiply to the mesh size", 0) + 1
            )
            continue
        if any(s.ag.args[1] != mesh.size(s.mesh_dim) for s in steps):
            stats.rejected["group size differs from its mesh dim"] = (
                stats.rejected.get("group size differs from its mesh dim", 0) + 1
            )
            continue
        order = tuple(s.mesh_dim for s in steps) + tuple(d for d in range(mesh.ndim) if d not in active)
        name = _order_name(order, mesh.ndim)
        reorder = None
        if name != "row_major" and (column_major == "reorder" or not new_group_keeps_order()):
            # (a torch whose new_group sorts its ranks makes no permuted group)
            group = mesh_group(mesh, tuple(reversed(range(mesh.ndim))))
            reorder = order
        else:
            group = mesh_group(mesh, order)
        _rewrite(gm, steps, between, group, reorder)
        stats.fused += 1
        stats.all_gathers_removed += len(steps) - 1
        stats.by_order[name] = stats.by_order.get(name, 0) + 1
    if stats.fused:
        # (no graph.lint(): each rewrite inserts its nodes right before the
        # chain's last all-gather, which comes after the chain's input)
        gm.recompile()
    return stats
