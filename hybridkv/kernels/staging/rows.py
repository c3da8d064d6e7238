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
    for c in copies:
        if c.word not in (1, 2, 4, 8) or c.length % c.word:
            raise ValueError(f"row copy word {c.word!r} for {c.length} bytes; expected 1, 2, 4 or 8 dividing it")
        if c.src_rows.shape != c.dst_rows.shape or c.src_rows.ndim != 1:
            raise ValueError(f"row copy of {c.src_rows.shape} source rows into {c.dst_rows.shape}; expected "
                             "two equal 1-D index arrays")
    copies = [c for c in copies if c.src_rows.size and c.length]
    addr: dict[int, int] = {}  # a few buffers behind many copies: each address looked up once

    def base(buf: Any) -> int:
        got = addr.get(id(buf))
        if got is None:
            got = addr[id(buf)] = address(buf)
        return got

    per = np.array([(base(c.src) + c.src_offset, c.src_stride, base(c.dst) + c.dst_offset, c.dst_stride, c.length,
                     c.word) for c in copies], dtype=np.int64).reshape(-1, 6)
    return table_of(per, [c.src_rows for c in copies], [c.dst_rows for c in copies])


def table_of(per: np.ndarray, src_rows: Sequence[np.ndarray], dst_rows: Sequence[np.ndarray]) -> RowTable:
    """:func:`row_table` of copies given as columns, for callers that hold thousands (an unpack into 16-token
    kernel blocks runs over a thousand copies of a dozen rows each; a per-copy loop cost ~20 us each on the
    request's path). ``per[i]`` = (address of copy i's src row 0, src stride, the same of dst, dst stride, length,
    word), every length a nonzero multiple of its word; ``src_rows[i]``/``dst_rows[i]``: its rows (non-empty,
    equal lengths)."""
    if not len(per):
        return RowTable(table=np.empty((0, 3), dtype=np.int64), launches=())
    src0, src_stride, dst0, dst_stride, length, word = per.T
    bits = src0 | src_stride | dst0 | dst_stride | length
    align = np.maximum(np.minimum(bits & -bits, MAX_ALIGN), word)  # alignment(), for every copy at once
    # classes in (word, align) order, copies in their given order inside one: rows of a launch lie together
    order = np.lexsort((np.arange(len(per)), align, word))
    n = np.array([r.size for r in src_rows], dtype=np.int64)[order]
    s_rows = np.concatenate([src_rows[i] for i in order]).astype(np.int64, copy=False)
    d_rows = np.concatenate([dst_rows[i] for i in order]).astype(np.int64, copy=False)
    table = np.empty((s_rows.size, 3), dtype=np.int64)
    table[:, 0] = np.repeat(src0[order], n) + s_rows * np.repeat(src_stride[order], n)
    table[:, 1] = np.repeat(dst0[order], n) + d_rows * np.repeat(dst_stride[order], n)
    table[:, 2] = np.repeat((length // word)[order], n)
    key = np.stack([word[order], align[order]], axis=1)
    cut = np.flatnonzero((key[1:] != key[:-1]).any(axis=1)) + 1  # where a class starts
    ends = np.cumsum(n)
    launches = []
    for first, stop in zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [len(order)])).tolist()):
        w = int(key[first, 0])
        launches.append(Launch(word=w, align=int(key[first, 1]), start=int(ends[first] - n[first]),
                               stop=int(ends[stop - 1]), max_words=int(length[order][first:stop].max()) // w))
    return RowTable(table=table, launches=tuple(launches))
