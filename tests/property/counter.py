"""Counts generated interleavings (hypothesis examples) across the property suite."""

from __future__ import annotations

_count = [0]


def add(n: int) -> None:
    _count[0] += n


def total() -> int:
    return _count[0]
