"""One unit system for every figure the planner and the solver print: SI
units with a space (``382.6 ms``, ``12.5 us``, ``1.23 GB``), decimal sizes
(HBM is sold in decimal GB), counts as ``8.03B`` / ``15.2M``. Here, in the
torch-free solver package, so that ``python -m solver`` and the planner's
reports (:mod:`autoparallel.report.units`) share one copy.

>>> seconds(0.382625), seconds(1.25e-5), seconds(3.5), size(1.5e9), count(8_030_261_248), count(15_204_352)
('382.6 ms', '12.5 us', '3.50 s', '1.50 GB', '8.03B', '15.2M')
"""

from __future__ import annotations

import math


def seconds(s: float | None) -> str:
    """A duration in s, ms or us, three or four significant figures."""
    if s is None:
        return "n/a"
    if math.isinf(s):
        return "inf"
    a = abs(s)
    if a >= 1:
        return f"{s:.2f} s"
    if a >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    if a == 0:
        return "0 us"
    return f"{s * 1e6:.1f} us" if a >= 1e-7 else f"{s * 1e6:.2g} us"


def size(b: float | None) -> str:
    """Bytes in GB, MB, kB or B (decimal)."""
    if b is None:
        return "n/a"
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= f:
            return f"{b / f:.2f} {unit}"
    return f"{int(b)} B"


def count(n: float) -> str:
    """A count such as a parameter count: ``8.03B``, ``15.2M``, ``512K``, ``96``."""
    for unit, f in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= f:
            v = n / f
            return f"{v:.3g}{unit}" if v < 100 else f"{v:.0f}{unit}"
    return f"{int(n)}"


def percent(fraction: float | None) -> str:
    """``0.0123`` -> ``1.23%``; None -> ``n/a``."""
    return "n/a" if fraction is None else f"{100 * fraction:.3g}%"
