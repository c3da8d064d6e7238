"""The descriptor compiler: (src layout, src blocks) x (dst layout, dst blocks) -> (addr, len, dev) arrays.

Work is split the way a transfer engine wants it:
- once per peer (`TransferPlanner`): the piece tables of descriptors/pieces.py,
  matched by fields (heterogeneous TP, different block sizes) or, with
  `TransferPlanner.pages`, whole pages of two sides that cut pages alike;
- once per request (`TransferPlanner.compile`): a few numpy operations turn the
  block lists into addresses and merge consecutive blocks that are adjacent on
  both sides. No per-block Python loop. Page tables also yield NIXL prepped-list
  index pairs (the plan's index form): the pairs are ordered by dst index, so the
  rows merge exactly where NIXL's `make_prepped_xfer` merges the pairs, and
  `TransferPlan.num_descriptors` is NIXL's descriptor count.

Block lists of unequal length (the alignment rule; `src` is the producer):
- state groups (and pages of unknown content) pair one to one: the lengths must match;
- token groups of one block size: a dst list shorter than the src list pairs with the
  src list's *tail*. A decode side with a prefix-cache hit holds the first blocks
  already and loads only the missing suffix, which is the end of the producer's
  list (NixlConnector aligns the same way). A dst list longer than the src list is
  refused: it would wait for tokens the producer does not hold;
- token groups of different block sizes: both lists start at token 0 and must cover
  the same tokens up to each side's block rounding (some T with ceil(T/bs) src and
  ceil(T/bd) dst blocks); a prefix hit cannot be placed across block sizes, so any
  other pair of lengths is refused.
Refusals are ValueErrors naming the group and both lengths.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv.layout import Layout
from hybridkv.layout.fields import FieldKey
from hybridkv.transport.plan import TransferPlan

from . import pieces as pc
from .pieces import PieceTable

_I64 = np.int64
#: block pairs up to which a page plan is made in Python ints (_compile_few): past ~30 numpy is faster
_FEW = 24


class TransferPlanner:
    """Everything about moving blocks from `src` to `dst` that does not depend on the request."""

    def __init__(self, src: Layout, dst: Layout, *, keys: Collection[FieldKey] | None = None,
                 bridge_padding: bool = False) -> None:
        """Pair field by field. `keys`: only these fields (a share of a heterogeneous-TP read,
        see plan_sources). `bridge_padding`: also merge pieces separated by the same gap on
        both sides when the dst gap holds no field (engine page padding, e.g. vLLM's padded
        GDN state pages). Fewer, larger descriptors at the price of moving the padding bytes."""
        if (src.geometry is None) != (dst.geometry is None) or (
                src.geometry is not None and src.geometry.layers != dst.geometry.layers):
            raise ValueError(
                f"src model {getattr(src.geometry, 'name', None)!r} and dst model "
                f"{getattr(dst.geometry, 'name', None)!r} differ in their layers"
            )
        keys = None if keys is None else frozenset(keys)
        raw, tables = {}, {}
        for dg in dst.groups:
            sg = src.group(dg.group_id)
            if sg.kind is not dg.kind or sg.layer_indices != dg.layer_indices:
                raise ValueError(
                    f"group {dg.group_id}: src holds {sg.kind.value} layers {sg.layer_indices}, "
                    f"dst holds {dg.kind.value} layers {dg.layer_indices}"
                )
            raw[dg.group_id] = pc.field_table(src, sg, dst, dg, keys)
            tables[dg.group_id] = pc.merge_table(raw[dg.group_id], pc.field_starts(dg) if bridge_padding else None)
        self._setup(src, dst, raw, tables)

    @classmethod
    def pages(cls, src, dst, regions: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> TransferPlanner:
        """Pair whole pages of two :class:`~hybridkv.transport.memory.MemoryMap`s that cut pages
        alike (every dst group, region by region, equal page bytes; ValueError otherwise).
        `regions`: per group, which src region feeds which dst region (default: in order).
        Plans carry the index form: the pages' indices into each side's prepped list."""
        tokens = pc.group_tokens(dst, src)
        tables = {int(g.group_id): pc.page_table(src, dst, int(g.group_id), tokens.get(int(g.group_id)),
                                                 None if regions is None else regions[int(g.group_id)])
                  for g in dst.groups}
        self = cls.__new__(cls)
        self._setup(src, dst, tables, tables)
        return self

    def _setup(self, src, dst, raw: dict[int, PieceTable], tables: dict[int, PieceTable]) -> None:
        self.src, self.dst = src, dst
        self._raw, self.tables = raw, tables
        self.indexed = bool(tables) and all(t.s_first is not None for t in tables.values())
        self._affine = pc.affine_constants(tables)
        self._affine_index = {g: i for i, g in enumerate(tables)}
        #: the same rows as Python ints, for requests of few blocks (_compile_few)
        self._affine_ints = None if self._affine is None else [tuple(int(x) for x in r) for r in self._affine]

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
        for i, g in enumerate(gids):
            if sbs[i].shape[0] != dbs[i].shape[0]:
                sbs[i], dbs[i] = _align(self.tables[g], sbs[i], dbs[i])
            counts.append(dbs[i].shape[0])
        if 0 < sum(counts) <= _FEW:
            return self._compile_few(gids, order, sbs, dbs)
        sb = np.concatenate(sbs) if len(gids) > 1 else sbs[0]
        db = np.concatenate(dbs) if len(gids) > 1 else dbs[0]
        c = np.repeat(self._affine[order], counts, axis=0)
        # Bounds: every block id inside its region, checked on the whole batch at once.
        if ((sb < 0) | (sb >= c[:, pc.S_PAGES]) | (db < 0) | (db >= c[:, pc.D_PAGES])).any():
            for g, b_s, b_d in zip(gids, sbs, dbs):
                _check_pages(b_s, self.tables[g].s_pages, "src", g)
                _check_pages(b_d, self.tables[g].d_pages, "dst", g)
        s_addr = sb * c[:, pc.S_STRIDE] + c[:, pc.S_ADDR]
        d_addr = db * c[:, pc.D_STRIDE] + c[:, pc.D_ADDR]
        s_idx = d_idx = None
        if self.indexed:
            s_idx, d_idx = sb + c[:, pc.S_FIRST], db + c[:, pc.D_FIRST]
            if d_idx.shape[0] > 1 and (d_idx[1:] < d_idx[:-1]).any():
                # By dst index, as NIXL merges runs of pairs consecutive on both sides: every run is
                # found (dst indices are distinct), whatever order the allocators handed blocks out in.
                by = np.argsort(d_idx, kind="stable")
                s_idx, d_idx, s_addr, d_addr, c = s_idx[by], d_idx[by], s_addr[by], d_addr[by], c[by]
        length = c[:, pc.LEN]
        if length.shape[0] > 1:
            tag = c[:, pc.TAG]
            cont = ((s_addr[1:] == s_addr[:-1] + length[:-1]) & (d_addr[1:] == d_addr[:-1] + length[:-1])
                    & (tag[1:] == tag[:-1]))
            if cont.any():
                starts = np.flatnonzero(np.concatenate(([True], ~cont)))
                length = np.add.reduceat(length, starts)
                s_addr, d_addr, c = s_addr[starts], d_addr[starts], c[starts]
        src = np.empty((length.shape[0], 3), dtype=_I64)
        dst = np.empty_like(src)
        src[:, 0], src[:, 1], src[:, 2] = s_addr, length, c[:, pc.S_DEV]
        dst[:, 0], dst[:, 1], dst[:, 2] = d_addr, length, c[:, pc.D_DEV]
        return TransferPlan(src=src, dst=dst, src_region=c[:, pc.S_REG], dst_region=c[:, pc.D_REG],
                            src_index=_i32(s_idx), dst_index=_i32(d_idx))

    def _compile_few(self, gids: list, order: list, sbs: list[np.ndarray], dbs: list[np.ndarray]) -> TransferPlan:
        """:meth:`_compile_affine` for a request of few block pairs, in Python ints: the same plan, made
        with a handful of numpy calls instead of some forty (each several us on the cold core that
        plans an import between its Exports and its post)."""
        ints = self._affine_ints
        assert ints is not None  # only called where every group is affine
        rows = []  # per block pair: (dst index, src index, src addr, dst addr, its group's constants)
        for k, b_s, b_d in zip(order, sbs, dbs):
            cs = ints[k]
            s_stride, d_stride, s_addr, d_addr = cs[pc.S_STRIDE], cs[pc.D_STRIDE], cs[pc.S_ADDR], cs[pc.D_ADDR]
            s_first, d_first, s_pages, d_pages = cs[pc.S_FIRST], cs[pc.D_FIRST], cs[pc.S_PAGES], cs[pc.D_PAGES]
            sl, dl = b_s.tolist(), b_d.tolist()
            if sl and (min(sl) < 0 or max(sl) >= s_pages or min(dl) < 0 or max(dl) >= d_pages):
                for g, s2, d2 in zip(gids, sbs, dbs):  # the numpy path's error, group by group
                    _check_pages(s2, self.tables[g].s_pages, "src", g)
                    _check_pages(d2, self.tables[g].d_pages, "dst", g)
            rows += [(d + d_first, s + s_first, s * s_stride + s_addr, d * d_stride + d_addr, cs)
                     for s, d in zip(sl, dl)]
        if self.indexed and any(rows[i + 1][0] < rows[i][0] for i in range(len(rows) - 1)):
            rows.sort(key=lambda r: r[0])  # stable, by dst index: see _compile_affine
        src: list[list[int]] = []
        dst: list[list[int]] = []
        regions: list[tuple[int, int]] = []
        s_end = d_end = tag = None
        for _, _, s_addr, d_addr, cs in rows:
            n = cs[pc.LEN]
            if s_addr == s_end and d_addr == d_end and cs[pc.TAG] == tag:
                src[-1][1] += n  # continues the previous row on both sides, in the same regions
                dst[-1][1] += n
            else:
                src.append([s_addr, n, cs[pc.S_DEV]])
                dst.append([d_addr, n, cs[pc.D_DEV]])
                regions.append((cs[pc.S_REG], cs[pc.D_REG]))
                tag = cs[pc.TAG]
            s_end, d_end = s_addr + n, d_addr + n
        reg = np.array(regions, dtype=_I64)
        idx = np.array([(r[1], r[0]) for r in rows], dtype=np.int32).T.copy() if self.indexed else None
        return TransferPlan(src=np.array(src, dtype=_I64), dst=np.array(dst, dtype=_I64), src_region=reg[:, 0],
                            dst_region=reg[:, 1], src_index=None if idx is None else idx[0],
                            dst_index=None if idx is None else idx[1])

    def compile(
        self,
        src_blocks: Mapping[int, Sequence[int] | np.ndarray],
        dst_blocks: Mapping[int, Sequence[int] | np.ndarray],
        *,
        coalesce: bool = True,
    ) -> TransferPlan:
        """The plan for one request: every group's src blocks to its dst blocks (the
        alignment rule in the module docstring says how lists of unequal length pair)."""
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
        return _finish(cols, coalesce, self.indexed)


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
    s_idx: np.ndarray | None = None
    d_idx: np.ndarray | None = None


def _blocks(blocks, side: str, gid: int) -> np.ndarray:
    if type(blocks) is np.ndarray and blocks.dtype == _I64 and blocks.ndim == 1:
        return blocks
    arr = np.asarray(blocks)
    if arr.ndim != 1:
        raise ValueError(f"{side} blocks of group {gid} must be a 1-D list of ints, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{side} blocks of group {gid} must be ints, got dtype {arr.dtype}")
    return arr.astype(_I64, copy=False)


def _i32(a: np.ndarray | None) -> np.ndarray | None:
    return None if a is None else a.astype(np.int32)


def _align(t: PieceTable, sb: np.ndarray, db: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two block lists of one group as they pair (the alignment rule, module docstring)."""
    ns, nd = sb.shape[0], db.shape[0]
    g = t.group_id
    if t.is_state:
        if ns != nd:
            raise ValueError(f"group {g} holds state (or pages of unknown content): src has {ns} blocks, dst {nd}; "
                             "they pair one to one")
        return sb, db
    bs, bd = t.src_block_tokens, t.dst_block_tokens
    if bs == bd:
        if ns < nd:
            raise ValueError(f"group {g}: dst lists {nd} blocks but src only {ns}; a dst list pairs with the src "
                             "list's tail (a prefix-cache hit) and never holds more blocks than the src")
        return (sb[ns - nd:], db) if ns > nd else (sb, db)
    # Both from token 0: some T must give ceil(T/bs) == ns and ceil(T/bd) == nd (none when dst is empty).
    if nd and (ns == 0 or max((ns - 1) * bs, (nd - 1) * bd) >= min(ns * bs, nd * bd)):
        raise ValueError(f"group {g}: src lists {ns} blocks of {bs} tokens, dst {nd} blocks of {bd}; with different "
                         "block sizes both lists start at token 0 and must end in the same block-rounded token")
    return sb, db


def paired_blocks(t: PieceTable, sb: np.ndarray, db: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The block lists aligned (block sizes differ, or the counts do) and how many pairs of blocks they make."""
    if sb.shape[0] != db.shape[0] or t.src_block_tokens != t.dst_block_tokens:
        sb, db = _align(t, sb, db)
    ns, nd = sb.shape[0], db.shape[0]
    if t.is_state:
        return sb, db, ns
    return sb, db, -(-min(ns * t.src_block_tokens, nd * t.dst_block_tokens) // t.pair_tokens)


def _compile_group(t: PieceTable, sb: np.ndarray, db: np.ndarray) -> _Columns | None:
    sb, db, pairs = paired_blocks(t, sb, db)
    ns, nd = sb.shape[0], db.shape[0]
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
            s_idx=None if t.s_first is None else sb[:pairs] + t.s_first[0],
            d_idx=None if t.d_first is None else db[:pairs] + t.d_first[0],
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
        s_idx=None if t.s_first is None else t.s_first[p] + sb[i_s],
        d_idx=None if t.d_first is None else t.d_first[p] + db[i_d],
    )


def piece_rows(t: PieceTable, sb: np.ndarray, db: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The page pairs of ``t``'s local copies (the staging pack/unpack), block lists aligned as
    :meth:`TransferPlanner.compile` aligns them, as three columns with one entry per (piece, page pair), pieces in
    order: the piece, its src page, its dst page (for :class:`~hybridkv.transport.copies.CopySteps`: no Python
    step per piece, where a staged read into kernel-block pages has hundreds)."""
    sb, db, pairs = paired_blocks(t, _blocks(sb, "src", t.group_id), _blocks(db, "dst", t.group_id))
    ns, nd = sb.shape[0], db.shape[0]
    if pairs == 0 or t.num_pieces == 0:
        return np.empty(0, dtype=_I64), np.empty(0, dtype=_I64), np.empty(0, dtype=_I64)
    _check_pages(sb, t.s_pages, "src", t.group_id)
    _check_pages(db, t.d_pages, "dst", t.group_id)
    s = np.arange(pairs, dtype=_I64)
    if t.num_pieces * pairs > _PIECE_PAGES_AT_ONCE:  # too many to hold at once: piece by piece
        pieces, s_pages, d_pages = [], [], []
        for p in range(t.num_pieces):
            i_s = t.s_k[p] + s * t.src_blocks_per_pair
            i_d = t.d_k[p] + s * t.dst_blocks_per_pair
            keep = (i_s < ns) & (i_d < nd)
            pieces.append(np.full(int(keep.sum()), p, dtype=_I64))
            s_pages.append(sb[i_s[keep]])
            d_pages.append(db[i_d[keep]])
        return np.concatenate(pieces), np.concatenate(s_pages), np.concatenate(d_pages)
    i_s = t.s_k[:, None] + s[None, :] * t.src_blocks_per_pair
    i_d = t.d_k[:, None] + s[None, :] * t.dst_blocks_per_pair
    keep = (i_s < ns) & (i_d < nd)
    piece = np.broadcast_to(np.arange(t.num_pieces, dtype=_I64)[:, None], keep.shape)
    return piece[keep], sb[i_s[keep]], db[i_d[keep]]


#: piece_rows gathers every piece's pages at once up to this many (piece, pair) entries (8 MB per side)
_PIECE_PAGES_AT_ONCE = 1 << 20


def _check_pages(pages: np.ndarray, limits: np.ndarray, side: str, gid: int) -> None:
    if pages.size == 0:
        return
    limit = int(limits.min())
    lo, hi = int(pages.min()), int(pages.max())
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{side} block {bad} of group {gid} is outside its region (valid 0..{limit - 1})")


_NAMES = ("s_addr", "d_addr", "length", "s_dev", "d_dev", "s_reg", "d_reg")


def _finish(cols: list[_Columns], coalesce: bool, indexed: bool) -> TransferPlan:
    """Concatenate the groups and merge rows that continue each other on both sides, in one region each."""
    if not cols:
        return TransferPlan.empty(indexed=indexed)
    names = _NAMES + (("s_idx", "d_idx") if indexed else ())
    if len(cols) == 1:
        arrs = [getattr(cols[0], n) for n in names]
    else:
        arrs = [np.concatenate([getattr(c, n) for c in cols]) for n in names]
    if indexed and arrs[8].shape[0] > 1 and (arrs[8][1:] < arrs[8][:-1]).any():
        by = np.argsort(arrs[8], kind="stable")  # by dst index: see _compile_affine
        arrs = [a[by] for a in arrs]
    s_addr, d_addr, length, s_dev, d_dev, s_reg, d_reg = arrs[:7]
    s_idx, d_idx = (arrs[7], arrs[8]) if indexed else (None, None)
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
        src_region=s_reg, dst_region=d_reg, src_index=_i32(s_idx), dst_index=_i32(d_idx),
    )


__all__ = ["PieceTable", "TransferPlan", "TransferPlanner", "compile_transfer", "paired_blocks", "plan_sources"]
