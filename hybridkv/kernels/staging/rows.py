"""What one gather is, and the table of rows the Triton kernel reads (numpy only: no torch, no Triton)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: the widest alignment a launch is told of (bytes): a 16-byte vector is the widest load a GPU thread issues
MAX_ALIGN = 16


@dataclass(frozen=True, kw_only=True, eq=False)
class RowCopy:
    """``length`` bytes of row ``src_rows[i]`` of ``src`` to row ``dst_rows[i]`` of ``dst``, for every i;
    row r of a buffer lies ``offset + r * stride`` bytes from its start. ``src``/``dst``: flat uint8 buffers
    (numpy arrays or torch tensors, both of one kind). ``word``: the element moved per index (1, 2, 4 or 8
    bytes), which divides ``length``, the offsets, the strides and both buffers' addresses. Nothing here
    checks bounds: the caller (the staging copier) did, before any byte moves."""

    src: Any
    src_offset: int
    src_stride: int
    src_rows: np.ndarray
    dst: Any
    dst_offset: int
    dst_stride: int
    dst_rows: np.ndarray
    length: int
    word: int = 1


def address(buf: Any) -> int:
    """The address of a flat buffer's first byte (torch or numpy)."""
    return int(buf.data_ptr()) if hasattr(buf, "data_ptr") else int(buf.ctypes.data)


def alignment(copy: RowCopy) -> int:
    """The widest power of two, at most :data:`MAX_ALIGN`, dividing every row's address on both sides and
    the length (what a launch may assume of its rows, in bytes)."""
    parts = (address(copy.src) + copy.src_offset, copy.src_stride, address(copy.dst) + copy.dst_offset,
             copy.dst_stride, copy.length)
    return next(a for a in (16, 8, 4, 2, 1) if a <= MAX_ALIGN and all(p % a == 0 for p in parts))


@dataclass(frozen=True, kw_only=True)
class Launch:
    """Rows ``[start, stop)`` of a :class:`RowTable`, all moved in elements of ``word`` bytes, every
    address and length a multiple of ``align`` bytes; the longest row is ``max_words`` elements."""

    word: int
    align: int
    start: int
    stop: int
    max_words: int


@dataclass(frozen=True, kw_only=True, eq=False)
class RowTable:
    """``table[r] = (src address, dst address, length in elements)`` of every row, grouped into launches."""

    table: np.ndarray
    launches: tuple[Launch, ...]


def row_table(copies: Sequence[RowCopy]) -> RowTable:
    """Every row of every copy, one launch per (word, alignment) class: usually one launch for a whole pack."""
    classes: dict[tuple[int, int], list[RowCopy]] = {}
    for c in copies:
        if c.word not in (1, 2, 4, 8) or c.length % c.word:
            raise ValueError(f"row copy word {c.word!r} for {c.length} bytes; expected 1, 2, 4 or 8 dividing it")
        if c.src_rows.shape != c.dst_rows.shape or c.src_rows.ndim != 1:
            raise ValueError(f"row copy of {c.src_rows.shape} source rows into {c.dst_rows.shape}; expected "
                             "two equal 1-D index arrays")
        if c.src_rows.size and c.length:
            classes.setdefault((c.word, max(c.word, alignment(c))), []).append(c)
    parts: list[np.ndarray] = []
    launches = []
    at = 0
    for (word, align), group in sorted(classes.items()):
        start = at
        for c in group:
            n = c.src_rows.size
            part = np.empty((n, 3), dtype=np.int64)
            part[:, 0] = address(c.src) + c.src_offset + c.src_rows.astype(np.int64) * c.src_stride
            part[:, 1] = address(c.dst) + c.dst_offset + c.dst_rows.astype(np.int64) * c.dst_stride
            part[:, 2] = c.length // word
            parts.append(part)
            at += n
        launches.append(Launch(word=word, align=align, start=start, stop=at,
                               max_words=max(c.length for c in group) // word))
    table = np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.int64)
    return RowTable(table=table, launches=tuple(launches))
