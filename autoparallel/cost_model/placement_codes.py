"""One encoding of DTensor placements, shared by every cost computation.

A placement is read three ways, each derived from its **kind letter**:

* :func:`kind`: ``"R"`` Replicate, ``"P"`` any Partial (masked and norm
  Partials included), ``"S"`` a plain Shard, ``"X"`` a strided shard,
  ``"?"`` anything else. The redistribution planner and the step table
  (:data:`autoparallel.cost_model.steps.STEP_KINDS`) read only this.
  :func:`shard_dim` (a plain shard's tensor dim) and :func:`partial_mask`
  (which mesh dims hold a Partial) are read from it too.
* :func:`key`: a small hashable tuple led by the kind letter: ``("R",)``,
  ``("S", dim)``, ``("P", reduce_op, type)``, ``("X", placement)``. Two
  plain placements (exact Replicate, Shard, Partial) are equal exactly when
  their keys are; Partial subclasses compare by reduce op and type only
  (their masks are not read). Hashing a key runs no Python ``__hash__``
  for the plain kinds, so per-pair caches key on tuples of keys.
* :func:`state_codes`: the plain placements of a tensor with ``ndim`` dims
  as small ints per mesh dim, :data:`R`, :data:`P`, ``S0 + d`` for
  ``Shard(d)``: the layout states of the min-cost search
  (:mod:`autoparallel.cost_model.redistribute_plan`) and the vectorised
  grids.

Example::

    >>> from torch.distributed.tensor.placement_types import Partial, Shard
    >>> kind(Shard(1)), key(Shard(1)), state_codes((Shard(1), Partial()), 2)
    ('S', ('S', 1), (3, 1))
"""

from __future__ import annotations

from typing import Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

from ..torch_compat import is_shard_like
from .caches import register

REPLICATE, PARTIAL, SHARD, STRIDED, OTHER = "R", "P", "S", "X", "?"
PLAIN_TYPES = (Replicate, Shard, Partial)  # placements whose keys are exact

# state codes per mesh dim; Shard(d) is S0 + d
R, P, S0 = 0, 1, 2

REPLICATE_KEY = (REPLICATE,)


def kind(p: Placement) -> str:
    """The kind letter of ``p``. Exact type checks first: isinstance on the
    C++-backed placements is slow."""
    t = type(p)
    if t is Replicate:
        return REPLICATE
    if t is Shard:
        return SHARD
    if t is Partial:
        return PARTIAL
    if t is _StridedShard:
        return STRIDED
    if p.is_partial():
        return PARTIAL
    if p.is_replicate():
        return REPLICATE
    if is_shard_like(p):
        return SHARD if p.is_shard() else STRIDED
    return OTHER


def shard_dim(p: Placement) -> int | None:
    """The tensor dim of a shard of kind ``"S"`` (a plain shard), else None
    (strided shards included: they are not one tensor dim's chunks)."""
    return p.dim if kind(p) == SHARD else None


def partial_mask(placements: Sequence[Placement]) -> int:
    """Bit ``m`` set where mesh dim ``m`` holds a Partial (of any kind):
    ``partial_mask(a) & ~partial_mask(b)`` is non-zero exactly when going
    from ``a`` to ``b`` reduces some Partial."""
    return sum(1 << m for m, p in enumerate(placements) if kind(p) == PARTIAL)


def key(p: Placement) -> tuple:
    """``p`` as a small hashable tuple led by its kind letter (see the
    module docstring for what equal keys mean); None (a slot without a
    layout) stays None."""
    if p is None:
        return None
    letter = kind(p)
    if letter == REPLICATE:
        return REPLICATE_KEY
    if letter == SHARD and type(p) is Shard:
        return (SHARD, p.dim)
    if letter == PARTIAL:
        return (PARTIAL, getattr(p, "reduce_op", None), type(p))
    return (letter, p)  # strided and other shards: the placement's own equality


def key_shard_dim(k: tuple) -> int | None:
    """The tensor dim of a plain-Shard key, else None."""
    return k[1] if k[0] == SHARD and type(k[1]) is int else None


_STATE_CODES: dict[tuple, tuple[int, ...] | None] = register({})


def state_codes(placements: Sequence[Placement], ndim: int) -> tuple[int, ...] | None:
    """State codes of plain placements (exact Replicate, Shard, Partial types:
    Partial subclasses compare asymmetrically and carry masks), else None."""
    cache_key = (placements, ndim)
    try:
        return _STATE_CODES[cache_key]
    except KeyError:
        pass
    codes = []
    for p in placements:
        t = type(p)
        if t is Replicate:
            codes.append(R)
        elif t is Partial:
            codes.append(P)
        elif t is Shard and -ndim <= p.dim < ndim:
            codes.append(S0 + p.dim % ndim)
        else:
            codes = None
            break
    result = _STATE_CODES[cache_key] = tuple(codes) if codes is not None else None
    return result


def code_kind(code: int) -> str:
    """The kind letter of a state code."""
    return REPLICATE if code == R else PARTIAL if code == P else SHARD
