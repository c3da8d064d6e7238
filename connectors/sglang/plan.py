"""Descriptor plans for one SGLang transfer chunk.

SGLang's NIXL backend asks for one descriptor per page per layer buffer (its
prepared lists index `layer * num_slots + page`). Here a chunk becomes, per
pair of buffers, one descriptor per *run* of pages that are consecutive on
both sides, and then neighbouring descriptors that are back-to-back on both
sides (adjacent buffers, e.g. the layers of one allocation) are merged again.
Everything is vectorised: the cost is a few numpy passes, not a Python loop
per page.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from connectors.sglang.regions import BufferKind, BufferTable, MemKind


@dataclass(frozen=True, kw_only=True)
class Plan:
    """(addr, len, dev) rows for both sides, grouped by (src mem, dst mem)."""

    groups: dict[tuple[MemKind, MemKind], tuple[np.ndarray, np.ndarray]]

    @property
    def num_descriptors(self) -> int:
        return sum(len(s) for s, _ in self.groups.values())

    @property
    def num_bytes(self) -> int:
        return int(sum(int(s[:, 1].sum()) for s, _ in self.groups.values()))


def pair_buffers(src: BufferTable, dst: BufferTable, kind: BufferKind, component: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of src and dst buffers that hold the same data, in order.

    Equal attention TP: the same buffers in the same order with equal item
    sizes. Anything else is a layout mismatch (ValueError naming it).
    """
    s = src.rows(kind, component)
    d = dst.rows(kind, component)
    if kind is BufferKind.AUX:
        # SGLang pairs aux buffers positionally and stops at the shorter list.
        n = min(len(s), len(d))
        s, d = s[:n], d[:n]
    if len(s) != len(d):
        raise ValueError(f"{kind.value} component {component}: {len(s)} buffers here, {len(d)} on the peer")
    if not np.array_equal(src.item_len[s], dst.item_len[d]):
        raise ValueError(
            f"{kind.value} component {component}: item sizes differ "
            f"({src.item_len[s][:4].tolist()}... here, {dst.item_len[d][:4].tolist()}... on the peer); "
            "heterogeneous TP is not supported by this backend yet"
        )
    sl, dl = src.layer[s], dst.layer[d]
    known = (sl >= 0) & (dl >= 0)
    if np.any(sl[known] != dl[known]):
        raise ValueError(f"{kind.value} component {component}: layer ids differ between the peers")
    return s, d


def runs(src_idx: np.ndarray, dst_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src start, dst start, length) of maximal runs consecutive on both sides."""
    src_idx = np.asarray(src_idx, dtype=np.int64)
    dst_idx = np.asarray(dst_idx, dtype=np.int64)
    if src_idx.shape != dst_idx.shape or src_idx.ndim != 1:
        raise ValueError(f"index arrays of shapes {src_idx.shape} and {dst_idx.shape}; expected equal 1-D")
    n = len(src_idx)
    if n == 0:
        e = np.empty(0, dtype=np.int64)
        return e, e, e
    brk = np.nonzero((np.diff(src_idx) != 1) | (np.diff(dst_idx) != 1))[0] + 1
    starts = np.concatenate(([0], brk))
    lengths = np.diff(np.concatenate((starts, [n])))
    return src_idx[starts], dst_idx[starts], lengths


def _check_bounds(table: BufferTable, rows: np.ndarray, idx: np.ndarray, side: str) -> None:
    if len(idx) == 0 or len(rows) == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    cap = int(table.num_items[rows].min())
    if lo < 0 or hi >= cap:
        raise ValueError(f"{side} index range [{lo}, {hi}] outside the buffers' {cap} items")


def _emit(src: BufferTable, dst: BufferTable, s_rows: np.ndarray, d_rows: np.ndarray,
          s_idx: np.ndarray, d_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Buffer-major (addr, len, dev) rows for both sides, plus each row's buffer."""
    _check_bounds(src, s_rows, np.asarray(s_idx), "source")
    _check_bounds(dst, d_rows, np.asarray(d_idx), "destination")
    rs, rd, rl = runs(s_idx, d_idx)
    nb, nr = len(s_rows), len(rs)
    item = src.item_len[s_rows][:, None]
    s_out = np.empty((nb * nr, 3), dtype=np.int64)
    d_out = np.empty((nb * nr, 3), dtype=np.int64)
    s_out[:, 0] = (src.ptr[s_rows][:, None] + rs[None, :] * item).ravel()
    d_out[:, 0] = (dst.ptr[d_rows][:, None] + rd[None, :] * item).ravel()
    s_out[:, 1] = d_out[:, 1] = (rl[None, :] * item).ravel()
    s_out[:, 2] = np.repeat(src.dev[s_rows], nr)
    d_out[:, 2] = np.repeat(dst.dev[d_rows], nr)
    return s_out, d_out, np.repeat(np.arange(nb), nr)


def merge_adjacent(s: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge each descriptor into its predecessor when both sides continue it."""
    if len(s) < 2:
        return s, d
    cont = (
        (s[1:, 0] == s[:-1, 0] + s[:-1, 1])
        & (d[1:, 0] == d[:-1, 0] + d[:-1, 1])
        & (s[1:, 2] == s[:-1, 2])
        & (d[1:, 2] == d[:-1, 2])
    )
    if not cont.any():
        return s, d
    head = np.concatenate(([True], ~cont))
    group = np.cumsum(head) - 1
    lens = np.bincount(group, weights=s[:, 1]).astype(np.int64)
    s2, d2 = s[head].copy(), d[head].copy()
    s2[:, 1] = d2[:, 1] = lens
    return s2, d2


def build_plan(
    src: BufferTable,
    dst: BufferTable,
    *,
    kv: tuple[np.ndarray, np.ndarray] | None,
    states: list[tuple[int, np.ndarray, np.ndarray]] = (),
    aux: tuple[int, int] | None = None,
    coalesce: bool = True,
) -> Plan:
    """The plan of one chunk.

    `kv` is (src pages, dst pages); `states` holds (component, src indices,
    dst indices) per state component that moves with this chunk; `aux` is
    (src row, dst row) of the metadata buffers. With `coalesce=False` every
    page of every buffer is its own descriptor (SGLang-NIXL's count).
    """
    parts: dict[tuple[MemKind, MemKind], list[tuple[np.ndarray, np.ndarray]]] = {}

    def add(kind: BufferKind, component: int, s_idx: np.ndarray, d_idx: np.ndarray) -> None:
        s_rows, d_rows = pair_buffers(src, dst, kind, component)
        s_idx = np.asarray(s_idx, dtype=np.int64).ravel()
        d_idx = np.asarray(d_idx, dtype=np.int64).ravel()
        if len(s_idx) != len(d_idx):
            raise ValueError(
                f"{kind.value} component {component}: {len(s_idx)} source indices, {len(d_idx)} destination indices"
            )
        # Zero-size or null buffers (SGLang pads per-layer lists) carry nothing.
        live = (src.item_len[s_rows] > 0) & (src.ptr[s_rows] != 0) & (dst.ptr[d_rows] != 0)
        s_rows, d_rows = s_rows[live], d_rows[live]
        if len(s_rows) == 0 or len(s_idx) == 0:
            return
        if coalesce:
            s_out, d_out, buf = _emit(src, dst, s_rows, d_rows, s_idx, d_idx)
        else:
            pieces = [_emit(src, dst, s_rows, d_rows, s_idx[i : i + 1], d_idx[i : i + 1]) for i in range(len(s_idx))]
            s_out = np.concatenate([p[0] for p in pieces])
            d_out = np.concatenate([p[1] for p in pieces])
            buf = np.concatenate([p[2] for p in pieces])
        for b in np.unique(buf):
            sel = buf == b
            key = (src.mem[int(s_rows[b])], dst.mem[int(d_rows[b])])
            parts.setdefault(key, []).append((s_out[sel], d_out[sel]))

    if kv is not None:
        add(BufferKind.KV, -1, kv[0], kv[1])
    for component, s_idx, d_idx in states:
        add(BufferKind.STATE, component, s_idx, d_idx)
    if aux is not None:
        add(BufferKind.AUX, -1, np.asarray([aux[0]]), np.asarray([aux[1]]))

    groups = {}
    for key, pieces in parts.items():
        s = np.concatenate([p[0] for p in pieces])
        d = np.concatenate([p[1] for p in pieces])
        if coalesce:
            s, d = merge_adjacent(s, d)
        groups[key] = (s, d)
    return Plan(groups=groups)
