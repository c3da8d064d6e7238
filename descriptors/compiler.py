"""The descriptor compiler: (src layout, src blocks) x (dst layout, dst blocks) -> (addr, len, dev) arrays.

Work is split the way a transfer engine wants it:
- once per peer (`TransferPlanner`): match the fields of every group key by key
  (this is where heterogeneous TP and different block sizes are resolved) into a
  small *piece table* per group, already merged wherever two pieces of one block
  pair are back to back on both sides;
- once per request (`TransferPlanner.compile`): a few numpy operations turn the
  block lists into addresses and merge consecutive blocks that are adjacent on
  both sides. No per-block Python loop.
A super-pair is lcm(src block, dst block) tokens: the smallest stretch after
which the pairing of src and dst blocks repeats.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv.layout.fields import Field, FieldKey
from hybridkv.layout import GroupLayout, Layout

_I64 = np.int64


@dataclass(frozen=True, kw_only=True, eq=False)
class TransferPlan:
    """Descriptor arrays, row i of `src` moves to row i of `dst`: columns (addr, len, device)."""

    src: np.ndarray
    dst: np.ndarray
    src_region: np.ndarray
    dst_region: np.ndarray

    @property
    def num_descriptors(self) -> int:
        return int(self.src.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.src[:, 1].sum())

    @staticmethod
    def concat(plans: Sequence[TransferPlan]) -> TransferPlan:
        if not plans:
            return _empty_plan()
        return TransferPlan(
            src=np.concatenate([p.src for p in plans]), dst=np.concatenate([p.dst for p in plans]),
            src_region=np.concatenate([p.src_region for p in plans]),
            dst_region=np.concatenate([p.dst_region for p in plans]),
        )


def _empty_plan() -> TransferPlan:
    z3 = np.zeros((0, 3), dtype=_I64)
    z = np.zeros(0, dtype=_I64)
    return TransferPlan(src=z3, dst=z3.copy(), src_region=z, dst_region=z.copy())


@dataclass(frozen=True, kw_only=True, eq=False)
class PieceTable:
    """Static pairing of one group's block content: one row per piece of a super-pair."""

    group_id: int
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

    @property
    def num_pieces(self) -> int:
        return int(self.length.shape[0])


class TransferPlanner:
    """Everything about moving blocks from `src` to `dst` that does not depend on the request."""

    def __init__(self, src: Layout, dst: Layout, *, keys: Collection[FieldKey] | None = None,
                 bridge_padding: bool = False) -> None:
        """`bridge_padding`: also merge pieces separated by the same gap on both sides when the dst
        gap holds no field (engine page padding, e.g. vLLM's padded GDN state pages). Fewer, larger
        descriptors at the price of moving the padding bytes."""
        if (src.geometry is None) != (dst.geometry is None) or (
                src.geometry is not None and src.geometry.layers != dst.geometry.layers):
            raise ValueError(
                f"src model {getattr(src.geometry, 'name', None)!r} and dst model "
                f"{getattr(dst.geometry, 'name', None)!r} differ in their layers"
            )
        self.src, self.dst = src, dst
        self._keys = None if keys is None else frozenset(keys)
        self.tables: dict[int, PieceTable] = {}
        self._raw: dict[int, PieceTable] = {}
        for dg in dst.groups:
            sg = src.group(dg.group_id)
            if sg.kind is not dg.kind or sg.layer_indices != dg.layer_indices:
                raise ValueError(
                    f"group {dg.group_id}: src holds {sg.kind.value} layers {sg.layer_indices}, "
                    f"dst holds {dg.kind.value} layers {dg.layer_indices}"
                )
            self._raw[dg.group_id] = _piece_table(src, sg, dst, dg, self._keys)
            free_gaps = _field_starts(dg) if bridge_padding else None
            self.tables[dg.group_id] = _merge_table(self._raw[dg.group_id], free_gaps)
        self._affine = _affine_constants(self.tables)
        self._affine_index = {g: i for i, g in enumerate(self.tables)}

    def _compile_affine(self, src_blocks, dst_blocks) -> TransferPlan:
        """Every group moves one span per block pair: one pass over all groups' blocks."""
        gids = list(src_blocks)
        order = [self._affine_index.get(g) for g in gids]
        if None in order:
            missing = gids[order.index(None)]
            raise ValueError(f"group {missing} is not in the dst layout (groups: {sorted(self.tables)})")
        sbs = [_blocks(src_blocks[g], "src", g) for g in gids]
        dbs = [_blocks(dst_blocks[g], "dst", g) for g in gids]
        counts = []
        for g, sb, db in zip(gids, sbs, dbs):
            ns, nd = sb.shape[0], db.shape[0]
            if ns != nd and self.tables[g].is_state:
                raise ValueError(f"group {g} holds state: src has {ns} blocks, dst {nd}; they pair one to one")
            counts.append(ns if ns <= nd else nd)
        sb = np.concatenate([b[:n] for b, n in zip(sbs, counts)]) if len(gids) > 1 else sbs[0][: counts[0]]
        db = np.concatenate([b[:n] for b, n in zip(dbs, counts)]) if len(gids) > 1 else dbs[0][: counts[0]]
        c = np.repeat(self._affine[order], counts, axis=0)
        # Bounds: every block id inside its region, checked on the whole batch at once.
        if ((sb < 0) | (sb >= c[:, 10]) | (db < 0) | (db >= c[:, 11])).any():
            for g, b_s, b_d, n in zip(gids, sbs, dbs, counts):
                _check_pages(b_s[:n], self.tables[g].s_pages, "src", g)
                _check_pages(b_d[:n], self.tables[g].d_pages, "dst", g)
        s_addr = sb * c[:, 0] + c[:, 1]
        d_addr = db * c[:, 2] + c[:, 3]
        length = c[:, 4]
        if length.shape[0] > 1:
            # Column 5 tags (src region, dst region): rows of different regions never merge.
            cont = ((s_addr[1:] == s_addr[:-1] + length[:-1]) & (d_addr[1:] == d_addr[:-1] + length[:-1])
                    & (c[1:, 5] == c[:-1, 5]))
            if cont.any():
                starts = np.flatnonzero(np.concatenate(([True], ~cont)))
                length = np.add.reduceat(length, starts)
                s_addr, d_addr, c = s_addr[starts], d_addr[starts], c[starts]
        src = np.empty((length.shape[0], 3), dtype=_I64)
        dst = np.empty_like(src)
        src[:, 0], src[:, 1], src[:, 2] = s_addr, length, c[:, 6]
        dst[:, 0], dst[:, 1], dst[:, 2] = d_addr, length, c[:, 7]
        return TransferPlan(src=src, dst=dst, src_region=c[:, 8], dst_region=c[:, 9])

    def compile(
        self,
        src_blocks: Mapping[int, Sequence[int] | np.ndarray],
        dst_blocks: Mapping[int, Sequence[int] | np.ndarray],
        *,
        coalesce: bool = True,
    ) -> TransferPlan:
        if set(src_blocks) != set(dst_blocks):
            raise ValueError(f"src groups {sorted(src_blocks)} and dst groups {sorted(dst_blocks)} differ")
        if coalesce and self._affine is not None:
            return self._compile_affine(src_blocks, dst_blocks)
        cols = []
        for gid in src_blocks:
            table = (self.tables if coalesce else self._raw).get(gid)
            if table is None:
                raise ValueError(f"group {gid} is not in the dst layout (groups: {sorted(self.tables)})")
            c = _compile_group(table, _blocks(src_blocks[gid], "src", gid), _blocks(dst_blocks[gid], "dst", gid))
            if c is not None:
                cols.append(c)
        return _finish(cols, coalesce)


def compile_transfer(
    src: Layout,
    src_blocks: Mapping[int, Sequence[int] | np.ndarray],
    dst: Layout,
    dst_blocks: Mapping[int, Sequence[int] | np.ndarray],
    *,
    coalesce: bool = True,
) -> TransferPlan:
    """One-shot form of `TransferPlanner(src, dst).compile(...)`; keep a planner per peer instead."""
    return TransferPlanner(src, dst).compile(src_blocks, dst_blocks, coalesce=coalesce)


def plan_sources(src_ranks: Sequence[Layout], dst: Layout) -> dict[int, frozenset[FieldKey]]:
    """Which src rank feeds which fields of `dst` (heterogeneous TP).

    Each field the dst rank holds is read from the first src rank that holds it,
    so heads that GQA replicates on several src ranks are read once.
    """
    assigned: dict[int, set[FieldKey]] = {}
    for dg in dst.groups:
        holders = []
        for src in src_ranks:
            sg = src.group(dg.group_id)
            holders.append({f.key for p in sg.placements for f in p.fields})
        for p in dg.placements:
            for f in p.fields:
                for i, keys in enumerate(holders):
                    if f.key in keys:
                        assigned.setdefault(i, set()).add(f.key)
                        break
                else:
                    raise ValueError(f"no src rank holds field {f.key} of group {dg.group_id}")
    return {i: frozenset(k) for i, k in assigned.items()}


# --------------------------------------------------------------------------- static part


def _fields_by_key(layout: Layout, group: GroupLayout) -> dict[FieldKey, tuple[int, Field]]:
    out: dict[FieldKey, tuple[int, Field]] = {}
    for p in group.placements:
        for f in p.fields:
            if f.key in out:
                raise ValueError(f"group {group.group_id} places field {f.key} twice")
            out[f.key] = (p.region_id, f)
    return out


def _piece_table(src: Layout, sg: GroupLayout, dst: Layout, dg: GroupLayout, keys) -> PieceTable:
    sf, df = _fields_by_key(src, sg), _fields_by_key(dst, dg)
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


def _field_starts(group: GroupLayout) -> dict[int, np.ndarray]:
    """Sorted field start offsets per region of a group's placements."""
    return {p.region_id: np.sort(np.array([f.offset for f in p.fields], dtype=_I64)) for p in group.placements}


def _merge_table(t: PieceTable, dst_field_starts: dict[int, np.ndarray] | None = None) -> PieceTable:
    """Merge pieces of one block pair that are back to back on both sides (or, with
    `dst_field_starts`, separated by equal gaps that hold no dst field: padding)."""
    n = t.num_pieces
    if n <= 1:
        return t
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


def _affine_constants(tables: Mapping[int, PieceTable]) -> np.ndarray | None:
    """Per group [s_stride, s_base+off, d_stride, d_base+off, len, region tag, s_dev, d_dev, s_reg, d_reg,
    s_pages, d_pages]."""
    rows = []
    for t in tables.values():
        if t.num_pieces != 1 or t.src_blocks_per_pair != 1 or t.dst_blocks_per_pair != 1:
            return None
        tag = (int(t.s_region[0]) << 32) | int(t.d_region[0])
        rows.append([t.s_stride[0], t.s_base[0] + t.s_off[0], t.d_stride[0], t.d_base[0] + t.d_off[0],
                     t.length[0], tag, t.s_dev[0], t.d_dev[0], t.s_region[0], t.d_region[0],
                     t.s_pages[0], t.d_pages[0]])
    return np.array(rows, dtype=_I64) if rows else None


# --------------------------------------------------------------------------- per request


@dataclass(frozen=True, kw_only=True, eq=False)
class _Columns:
    s_addr: np.ndarray
    d_addr: np.ndarray
    length: np.ndarray
    s_dev: np.ndarray
    d_dev: np.ndarray
    s_reg: np.ndarray
    d_reg: np.ndarray


def _blocks(blocks, side: str, gid: int) -> np.ndarray:
    if type(blocks) is np.ndarray and blocks.dtype == _I64 and blocks.ndim == 1:
        return blocks
    arr = np.asarray(blocks)
    if arr.ndim != 1:
        raise ValueError(f"{side} blocks of group {gid} must be a 1-D list of ints, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{side} blocks of group {gid} must be ints, got dtype {arr.dtype}")
    return arr.astype(_I64, copy=False)


def _compile_group(t: PieceTable, sb: np.ndarray, db: np.ndarray) -> _Columns | None:
    ns, nd = sb.shape[0], db.shape[0]
    if t.is_state:
        if ns != nd:
            raise ValueError(f"group {t.group_id} holds state: src has {ns} blocks, dst {nd}; they pair one to one")
        pairs = ns
    else:
        covered = min(ns * t.src_block_tokens, nd * t.dst_block_tokens)
        pairs = -(-covered // t.pair_tokens)
    if pairs == 0 or t.num_pieces == 0:
        return None
    _check_pages(sb, t.s_pages, "src", t.group_id)
    _check_pages(db, t.d_pages, "dst", t.group_id)
    if t.num_pieces == 1 and t.src_blocks_per_pair == 1 and t.dst_blocks_per_pair == 1:
        # The common case (equal block sizes, one span per block): plain affine maps.
        return _Columns(
            s_addr=sb[:pairs] * t.s_stride[0] + (t.s_base[0] + t.s_off[0]),
            d_addr=db[:pairs] * t.d_stride[0] + (t.d_base[0] + t.d_off[0]),
            length=np.full(pairs, t.length[0], dtype=_I64), s_dev=np.full(pairs, t.s_dev[0], dtype=_I64),
            d_dev=np.full(pairs, t.d_dev[0], dtype=_I64), s_reg=np.full(pairs, t.s_region[0], dtype=_I64),
            d_reg=np.full(pairs, t.d_region[0], dtype=_I64),
        )
    s = np.arange(pairs, dtype=_I64)
    # Piece-major order: the same piece of consecutive blocks are neighbours, so
    # blocks that are adjacent in memory on both sides merge in _finish.
    i_s = (t.s_k[:, None] + s[None, :] * t.src_blocks_per_pair).ravel()
    i_d = (t.d_k[:, None] + s[None, :] * t.dst_blocks_per_pair).ravel()
    p = np.repeat(np.arange(t.num_pieces), pairs)
    if pairs * t.src_blocks_per_pair > ns or pairs * t.dst_blocks_per_pair > nd:
        keep = (i_s < ns) & (i_d < nd)
        i_s, i_d, p = i_s[keep], i_d[keep], p[keep]
    return _Columns(
        s_addr=t.s_base[p] + t.s_off[p] + sb[i_s] * t.s_stride[p],
        d_addr=t.d_base[p] + t.d_off[p] + db[i_d] * t.d_stride[p],
        length=t.length[p], s_dev=t.s_dev[p], d_dev=t.d_dev[p], s_reg=t.s_region[p], d_reg=t.d_region[p],
    )


def _check_pages(pages: np.ndarray, limits: np.ndarray, side: str, gid: int) -> None:
    if pages.size == 0:
        return
    limit = int(limits.min())
    lo, hi = int(pages.min()), int(pages.max())
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{side} block {bad} of group {gid} is outside its region (valid 0..{limit - 1})")


def _finish(cols: list[_Columns], coalesce: bool) -> TransferPlan:
    """Concatenate the groups and merge rows that continue each other on both sides, in one region each."""
    if not cols:
        return _empty_plan()
    if len(cols) == 1:
        c = cols[0]
        s_addr, d_addr, length, s_dev, d_dev, s_reg, d_reg = (
            c.s_addr, c.d_addr, c.length, c.s_dev, c.d_dev, c.s_reg, c.d_reg)
    else:
        s_addr, d_addr, length, s_dev, d_dev, s_reg, d_reg = (
            np.concatenate([getattr(c, n) for c in cols])
            for n in ("s_addr", "d_addr", "length", "s_dev", "d_dev", "s_reg", "d_reg"))
    if coalesce and length.shape[0] > 1:
        cont = (
            (s_addr[1:] == s_addr[:-1] + length[:-1]) & (d_addr[1:] == d_addr[:-1] + length[:-1])
            & (s_reg[1:] == s_reg[:-1]) & (d_reg[1:] == d_reg[:-1])
        )
        if cont.any():
            starts = np.flatnonzero(np.concatenate(([True], ~cont)))
            length = np.add.reduceat(length, starts)
            s_addr, d_addr, s_dev, d_dev = s_addr[starts], d_addr[starts], s_dev[starts], d_dev[starts]
            s_reg, d_reg = s_reg[starts], d_reg[starts]
    return TransferPlan(
        src=np.stack([s_addr, length, s_dev], axis=1), dst=np.stack([d_addr, length, d_dev], axis=1),
        src_region=s_reg, dst_region=d_reg,
    )
