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
    if not copies:
        return RowTable(table=np.empty((0, 3), dtype=np.int64), launches=())
    addr: dict[int, int] = {}  # a few buffers behind many copies: each address looked up once

    def base(buf: Any) -> int:
        got = addr.get(id(buf))
        if got is None:
            got = addr[id(buf)] = address(buf)
        return got

    per = np.array([(base(c.src) + c.src_offset, c.src_stride, base(c.dst) + c.dst_offset, c.dst_stride, c.length,
                     c.word) for c in copies], dtype=np.int64)
    n = np.array([c.src_rows.size for c in copies], dtype=np.int64)
    return table_of(per, np.repeat(np.arange(len(copies), dtype=np.int64), n),
                    np.concatenate([c.src_rows for c in copies]).astype(np.int64, copy=False),
                    np.concatenate([c.dst_rows for c in copies]).astype(np.int64, copy=False))


def table_of(per: np.ndarray, copy: np.ndarray, src_rows: np.ndarray, dst_rows: np.ndarray) -> RowTable:
    """:func:`row_table` of copies given as columns, in a few numpy passes: no object or loop per copy (an unpack
    into 16-token kernel blocks is over a thousand copies of a dozen rows each, and a per-copy loop cost ~20 us
    each on the request's path). ``per[i]`` = (address of copy i's row 0 on the src side, src stride, the same of
    dst, dst stride, length, word), every word 1, 2, 4 or 8 dividing its length; row j: copy ``copy[j]`` (a copy's
    rows together and in order, copies in order), rows ``src_rows[j]`` -> ``dst_rows[j]``. A copy of length 0 or
    without rows adds nothing."""
    keep = per[copy, 4] > 0
    if not keep.all():
        copy, src_rows, dst_rows = copy[keep], src_rows[keep], dst_rows[keep]
    if not copy.size:
        return RowTable(table=np.empty((0, 3), dtype=np.int64), launches=())
    src0, src_stride, dst0, dst_stride, length, word = per.T
    bits = src0 | src_stride | dst0 | dst_stride | length
    align = np.maximum(np.minimum(bits & -bits, MAX_ALIGN), word)  # alignment(), for every copy at once
    # classes in (word, align) order, copies in their given order inside one, rows in theirs: a stable sort
    cls = word * (MAX_ALIGN + 1) + align
    order = np.argsort(cls[copy], kind="stable")
    copy, src_rows, dst_rows = copy[order], src_rows[order], dst_rows[order]
    table = np.empty((copy.size, 3), dtype=np.int64)
    table[:, 0] = src0[copy] + src_rows * src_stride[copy]
    table[:, 1] = dst0[copy] + dst_rows * dst_stride[copy]
    table[:, 2] = (length // word)[copy]
    row_cls = cls[copy]
    starts = np.flatnonzero(np.concatenate(([True], row_cls[1:] != row_cls[:-1])))
    stops = np.concatenate((starts[1:], [copy.size]))
    launches = []
    for a, b in zip(starts.tolist(), stops.tolist()):
        w = int(word[copy[a]])
        launches.append(Launch(word=w, align=int(align[copy[a]]), start=a, stop=b,
                               max_words=int(table[a:b, 2].max())))
    return RowTable(table=table, launches=tuple(launches))
