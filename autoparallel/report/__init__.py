"""Readable views of a plan: words (:mod:`.words`), numbers (:mod:`.numbers`)."""

from .words import LEGEND, describe, matmul_role

__all__ = ["LEGEND", "describe", "matmul_role"]
