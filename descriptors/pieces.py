"""The static half of the descriptor compiler: per group, a table of the pieces one block pair moves.

A *piece table* says, for one KV-cache group, which bytes of a super-pair of
blocks (lcm(src block, dst block) tokens: the smallest stretch after which the
pairing of src and dst blocks repeats) move where. It is built once per peer:

- by fields (:func:`field_table`): the fields of both layouts matched key by key,
  which is how heterogeneous TP and different block sizes are bridged;
- by pages (:func:`page_table`): whole pages of both sides' regions, for two sides
  that cut pages alike. These pieces also know their pages' place in each side's
  prepped list, so the compiler can emit NIXL index pairs.

:func:`merge_table` merges pieces of one block pair that are back to back on both
sides; :func:`affine_constants` packs tables of one piece per block into the
constants of the compiler's affine fast path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv.layout import GroupLayout, Layout
from hybridkv.layout.fields import Field, FieldKey

_I64 = np.int64


@dataclass(frozen=True, kw_only=True, eq=False)
class PieceTable:
    """Static pairing of one group's block content: one row per piece of a super-pair."""

    group_id: int
    #: state slots (or pages of unknown content): block lists pair one to one
    is_state: bool
    src_blocks_per_pair: int
    dst_blocks_per_pair: int
    pair_tokens: int
    src_block_tokens: int
    dst_block_tokens: int
    s_k: np.ndarray       # src block index inside the super-pair
    d_k: np.ndarray
    s_base: np.ndarray    # region base address of the piece's src region
    s_stride: np.ndarray
    s_off: np.ndarray     # offset inside the src page
    s_region: np.ndarray
    s_pages: np.ndarray
    s_dev: np.ndarray
    d_base: np.ndarray
    d_stride: np.ndarray
    d_off: np.ndarray
    d_region: np.ndarray
    d_pages: np.ndarray
    d_dev: np.ndarray
    length: np.ndarray
    #: page tables only: the prepped-list index of page 0 of the piece's region, per side
    s_first: np.ndarray | None = None
    d_first: np.ndarray | None = None

    @property
    def num_pieces(self) -> int:
        return int(self.length.shape[0])


# --------------------------------------------------------------------------- by fields


def _fields_by_key(group: GroupLayout) -> dict[FieldKey, tuple[int, Field]]:
    out: dict[FieldKey, tuple[int, Field]] = {}
    for p in group.placements:
        for f in p.fields:
            if f.key in out:
                raise ValueError(f"group {group.group_id} places field {f.key} twice")
            out[f.key] = (p.region_id, f)
    return out


def field_table(src: Layout, sg: GroupLayout, dst: Layout, dg: GroupLayout, keys) -> PieceTable:
    """Pieces of one group matched field by field (`keys`: only these fields; None: every dst field)."""
    sf, df = _fields_by_key(sg), _fields_by_key(dg)
    is_state = dg.block_tokens is None
    if (sg.block_tokens is None) != is_state:
        raise ValueError(f"group {dg.group_id}: one side is token-indexed, the other holds state")
    bs = sg.block_tokens or 1
    bd = dg.block_tokens or 1
    g = math.gcd(bs, bd)
    pair = bs * bd // g
    rows: list[tuple[int, int, int, int, int, int, int]] = []  # s_k, s_reg, s_off, d_k, d_reg, d_off, len
    for key, (d_reg, d) in df.items():
        if keys is not None and key not in keys:
            continue
        hit = sf.get(key)
        if hit is None:
            if keys is None:
                raise ValueError(f"group {dg.group_id}: src rank {src.rank}/{src.tp} does not hold field {key}; "
                                 "use plan_sources() to split the read across src ranks")
            raise ValueError(f"group {dg.group_id}: field {key} was assigned to a src rank that lacks it")
        s_reg, s = hit
        if is_state or not d.token_bytes:
            if s.nbytes != d.nbytes or s.token_bytes != d.token_bytes:
                raise ValueError(f"field {key}: src has {s.nbytes} bytes, dst {d.nbytes}")
            if not is_state and (bs != bd):
                raise ValueError(f"field {key} cannot be split by tokens but block sizes differ ({bs} vs {bd})")
            rows.append((0, s_reg, s.offset, 0, d_reg, d.offset, d.nbytes))
            continue
        if s.token_bytes != d.token_bytes:
            raise ValueError(f"field {key}: src holds {s.token_bytes} bytes per token, dst {d.token_bytes}")
        tb = d.token_bytes
        for u in range(pair // g):
            t = u * g
            rows.append((t // bs, s_reg, s.offset + (t % bs) * tb, t // bd, d_reg, d.offset + (t % bd) * tb, g * tb))
    # Sort so pieces that are back to back on the src side are neighbours.
    rows.sort(key=lambda r: (r[0], r[3], r[1], r[4], r[2]))
    arr = np.array(rows, dtype=_I64).reshape(-1, 7)
    s_reg, d_reg = arr[:, 1], arr[:, 4]
    sr, dr = src.regions, dst.regions
    pick = lambda regions, idx, attr: np.array([getattr(regions[i], attr) for i in idx], dtype=_I64)  # noqa: E731
    return PieceTable(
        group_id=dg.group_id, is_state=is_state,
        src_blocks_per_pair=pair // bs, dst_blocks_per_pair=pair // bd, pair_tokens=pair,
        src_block_tokens=bs, dst_block_tokens=bd,
        s_k=arr[:, 0], d_k=arr[:, 3], s_off=arr[:, 2], d_off=arr[:, 5], length=arr[:, 6],
        s_region=s_reg, d_region=d_reg,
        s_base=pick(sr, s_reg, "base_addr"), s_stride=pick(sr, s_reg, "stride"),
        s_pages=pick(sr, s_reg, "num_pages"), s_dev=pick(sr, s_reg, "device_id"),
        d_base=pick(dr, d_reg, "base_addr"), d_stride=pick(dr, d_reg, "stride"),
        d_pages=pick(dr, d_reg, "num_pages"), d_dev=pick(dr, d_reg, "device_id"),
    )


def field_starts(group: GroupLayout) -> dict[int, np.ndarray]:
    """Sorted field start offsets per region of a group's placements."""
    return {p.region_id: np.sort(np.array([f.offset for f in p.fields], dtype=_I64)) for p in group.placements}


# --------------------------------------------------------------------------- by pages


def page_table(src, dst, group_id: int, block_tokens: int | None,
               regions: Sequence[tuple[int, int]] | None = None) -> PieceTable:
    """Whole pages of one group: page b of a src region moves to page b' of its dst region.
    `src`/`dst` are :class:`~hybridkv.transport.memory.MemoryMap`s; `regions`: (src region,
    dst region) pairs, by default the group's regions in order. `block_tokens` None: state
    slots, or content this side cannot tell (pair one to one)."""
    sg, dg = src.group(group_id), dst.group(group_id)
    if regions is None:
        if len(sg.region_ids) != len(dg.region_ids):
            raise ValueError(f"group {group_id}: src pages span {len(sg.region_ids)} regions, dst "
                             f"{len(dg.region_ids)}; expected pages cut alike")
        regions = tuple(zip(sg.region_ids, dg.region_ids))
    s_first, d_first = src.offsets, dst.offsets
    cols = []
    for sr, dr in regions:
        s, d = src.regions[sr], dst.regions[dr]
        if s.page_bytes != d.page_bytes:
            raise ValueError(f"group {group_id}: src region {sr} has {s.page_bytes}-byte pages, dst region {dr} "
                             f"{d.page_bytes}; expected pages cut alike (else pair by fields)")
        cols.append((sr, s.base_addr, s.stride, s.num_pages, s.device_id, int(s_first[sr]),
                     dr, d.base_addr, d.stride, d.num_pages, d.device_id, int(d_first[dr]), s.page_bytes))
    a = np.array(cols, dtype=_I64).reshape(-1, 13)
    zero = np.zeros(a.shape[0], dtype=_I64)
    bt = block_tokens or 1
    return PieceTable(
        group_id=group_id, is_state=block_tokens is None, src_blocks_per_pair=1, dst_blocks_per_pair=1,
        pair_tokens=bt, src_block_tokens=bt, dst_block_tokens=bt, s_k=zero, d_k=zero.copy(),
        s_region=a[:, 0], s_base=a[:, 1], s_stride=a[:, 2], s_pages=a[:, 3], s_dev=a[:, 4], s_first=a[:, 5],
        d_region=a[:, 6], d_base=a[:, 7], d_stride=a[:, 8], d_pages=a[:, 9], d_dev=a[:, 10], d_first=a[:, 11],
        s_off=zero.copy(), d_off=zero.copy(), length=a[:, 12],
    )


def group_tokens(*maps) -> dict[int, int | None]:
    """Block tokens per group (None: state) from the first memory map that knows its layout."""
    for m in maps:
        if m.layout is not None:
            return {int(g.group_id): g.block_tokens for g in m.layout.groups}
        if m.table is not None:
            return {int(g.group_id): (g.block_tokens or None) for g in m.table.groups}
    return {}


# --------------------------------------------------------------------------- merging


def merge_table(t: PieceTable, dst_field_starts: dict[int, np.ndarray] | None = None) -> PieceTable:
    """Merge pieces of one block pair that are back to back on both sides (or, with
    `dst_field_starts`, separated by equal gaps that hold no dst field: padding)."""
    n = t.num_pieces
    if n <= 1 or t.s_first is not None:
        return t  # a page piece is one page of one region: it stays one index pair
    s_end = t.s_off[:-1] + t.length[:-1]
    d_end = t.d_off[:-1] + t.length[:-1]
    same = ((t.s_k[1:] == t.s_k[:-1]) & (t.d_k[1:] == t.d_k[:-1])
            & (t.s_region[1:] == t.s_region[:-1]) & (t.d_region[1:] == t.d_region[:-1]))
    gap_s, gap_d = t.s_off[1:] - s_end, t.d_off[1:] - d_end
    cont = same & (gap_s == 0) & (gap_d == 0)
    if dst_field_starts is not None:
        bridge = same & (gap_s == gap_d) & (gap_d > 0)
        for i in np.flatnonzero(bridge):
            starts_in_region = dst_field_starts[int(t.d_region[i])]
            lo = np.searchsorted(starts_in_region, d_end[i])
            hi = np.searchsorted(starts_in_region, t.d_off[i + 1])
            bridge[i] = lo == hi
        cont |= bridge
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    ends = np.concatenate((starts[1:], [n])) - 1
    length = t.s_off[ends] + t.length[ends] - t.s_off[starts]
    pick = lambda a: a[starts]  # noqa: E731
    return PieceTable(
        group_id=t.group_id, is_state=t.is_state, src_blocks_per_pair=t.src_blocks_per_pair,
        dst_blocks_per_pair=t.dst_blocks_per_pair, pair_tokens=t.pair_tokens,
        src_block_tokens=t.src_block_tokens, dst_block_tokens=t.dst_block_tokens,
        s_k=pick(t.s_k), d_k=pick(t.d_k), s_base=pick(t.s_base), s_stride=pick(t.s_stride), s_off=pick(t.s_off),
        s_region=pick(t.s_region), s_pages=pick(t.s_pages), s_dev=pick(t.s_dev),
        d_base=pick(t.d_base), d_stride=pick(t.d_stride), d_off=pick(t.d_off), d_region=pick(t.d_region),
        d_pages=pick(t.d_pages), d_dev=pick(t.d_dev), length=length,
    )


#: columns of affine_constants' rows
S_STRIDE, S_ADDR, D_STRIDE, D_ADDR, LEN, TAG, S_DEV, D_DEV, S_REG, D_REG, S_PAGES, D_PAGES, S_FIRST, D_FIRST = range(14)


def affine_constants(tables: Mapping[int, PieceTable]) -> np.ndarray | None:
    """Per group one row (columns named above), when every group moves one span per block pair;
    else None. TAG packs (src region, dst region): rows of different regions never merge."""
    rows = []
    for t in tables.values():
        if t.num_pieces != 1 or t.src_blocks_per_pair != 1 or t.dst_blocks_per_pair != 1:
            return None
        tag = (int(t.s_region[0]) << 32) | int(t.d_region[0])
        rows.append([t.s_stride[0], t.s_base[0] + t.s_off[0], t.d_stride[0], t.d_base[0] + t.d_off[0],
                     t.length[0], tag, t.s_dev[0], t.d_dev[0], t.s_region[0], t.d_region[0],
                     t.s_pages[0], t.d_pages[0], 0 if t.s_first is None else t.s_first[0],
                     0 if t.d_first is None else t.d_first[0]])
    return np.array(rows, dtype=_I64) if rows else None
