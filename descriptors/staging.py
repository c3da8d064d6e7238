"""Staged heterogeneous-TP reads: what a producer packs for one consumer rank, and how it is read.

A :class:`StagePlan` is made once per (producer rank, consumer rank) from both layouts and the
fields the consumer reads from that producer (``keys``). It defines the *compact page* of each
group: the producer page's bytes of those fields, back to back in the producer's order (a
layout of its own, :attr:`StagePlan.compact`, one region per group). A request's slot holds, group
by group in group-id order, one compact page per producer block in the Export's order. Both sides
build the same plan (the consumer from the producer's handshake tables, the producer from the Want's
field mask over :func:`shared_order`, :func:`field_mask`), so the slot needs no description on the wire
beyond where it is and how long.

The three moves are piece tables of descriptors/pieces.py, run by the transport
(:mod:`hybridkv.transport.staging`):
- pack: producer pages -> compact pages (local copies, one per piece over all blocks);
- read: compact pages in the producer's slot -> consumer pages, as transfer rows (the
  descriptor compiler, so rows merge wherever consecutive blocks continue on both sides);
- unpack: compact pages in the consumer's own slot -> its pages (local copies), for reads
  whose rows would not merge (P > D: the consumer's pages interleave several producers' heads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from hybridkv.layout import GroupLayout, Layout, Placement, Region
from hybridkv.ids import RegionId
from hybridkv.layout.fields import Field, FieldKey
from hybridkv.transport.plan import TransferPlan
from hybridkv.transport.copies import SLOT, CopySteps
from hybridkv.transport.staging import BadFieldMask

from . import pieces as pc
from .compiler import TransferPlanner, paired_blocks, piece_rows

#: page count of a compact region: a bound for the compiler's checks, not memory
_COMPACT_PAGES = 1 << 24
#: block pairs of a group whose offsets StagePlan.read_rows_least counts in Python before it takes numpy
_FEW_PAIRS = 64


def compact_layout(src: Layout, dst: Layout, keys: Collection[FieldKey], *, dst_order: bool = False) -> Layout:
    """The producer's pages cut down to ``keys``: per group of ``dst`` that holds one of them, a
    region (base 0) whose page is those fields of the producer's page, in its order (``dst_order``: in the
    consumer's, so that a consumer that knows only its own layout and ``keys`` can unpack it)."""
    keys = frozenset(keys)
    regions: list[Region] = []
    groups: list[GroupLayout] = []
    for dg in dst.groups:
        if not any(f.key in keys for p in dg.placements for f in p.fields):
            continue
        sg = src.group(dg.group_id)
        mine = sorted(((p.region_id, f) for p in sg.placements for f in p.fields if f.key in keys),
                      key=lambda rf: (rf[0], rf[1].offset))
        if dst_order:
            where = {f.key: (p.region_id, f.offset) for p in dg.placements for f in p.fields}
            mine.sort(key=lambda rf: where[rf[1].key])
        fields, at = [], 0
        for _, f in mine:
            fields.append(Field(key=f.key, offset=at, nbytes=f.nbytes, token_bytes=f.token_bytes))
            at += f.nbytes
        rid = RegionId(len(regions))
        first = src.regions[sg.placements[0].region_id]
        regions.append(Region(region_id=rid, base_addr=0, stride=at, page_bytes=at, num_pages=_COMPACT_PAGES,
                              mem=first.mem, device_id=first.device_id))
        groups.append(GroupLayout(group_id=dg.group_id, kind=sg.kind, layer_indices=sg.layer_indices,
                                  block_tokens=sg.block_tokens, window=sg.window,
                                  placements=(Placement(region_id=rid, fields=tuple(fields)),)))
    return Layout(geometry=src.geometry, tp=src.tp, rank=src.rank, regions=tuple(regions), groups=tuple(groups))


def shared_order(src: Layout, dst: Layout) -> tuple[FieldKey, ...]:
    """Every field of ``dst`` that ``src`` holds (what a producer can stage for a consumer), in ``dst``'s order
    (groups, placements, fields as it lists them): the list a Want's field mask numbers (:func:`field_mask`),
    which both sides derive alike from the two layouts."""
    theirs = {f.key for g in src.groups for p in g.placements for f in p.fields}
    return tuple(f.key for g in dst.groups for p in g.placements for f in p.fields if f.key in theirs)


def field_mask(order: Sequence[FieldKey], keys: Collection[FieldKey]) -> bytes:
    """The Want's ``fields`` for packing ``keys`` of ``order``: bit i (byte i // 8, least significant bit
    first) set where field i is packed; empty where every field is (what a Want without a mask means)."""
    keys = frozenset(keys)
    if not keys <= set(order):
        raise ValueError(f"{len(keys - set(order))} field(s) to pack that the pair does not share; expected a "
                         f"subset of its {len(order)} fields")
    if keys == set(order):
        return b""
    mask = bytearray(-(-len(order) // 8))
    for i, k in enumerate(order):
        if k in keys:
            mask[i // 8] |= 1 << (i % 8)
    return bytes(mask)


def masked_keys(order: Sequence[FieldKey], mask: bytes) -> frozenset[FieldKey]:
    """The fields a Want's mask names (:func:`field_mask`; empty: every field of ``order``). Refused
    (:class:`~hybridkv.transport.staging.BadFieldMask`, naming the value) where its length is not what
    ``order`` needs, or it names a field past ``order``, or none."""
    if not mask:
        return frozenset(order)
    n = len(order)
    if len(mask) != -(-n // 8):
        raise BadFieldMask(f"stage field mask of {len(mask)} bytes; expected {-(-n // 8)} for the {n} fields "
                           "this pair stages")
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    past = np.flatnonzero(bits[n:])
    if past.size:
        raise BadFieldMask(f"stage field mask names field {n + int(past[0])}; expected fields 0..{n - 1} "
                           f"(this pair stages {n})")
    keys = frozenset(k for k, b in zip(order, bits[:n]) if b)
    if not keys:
        raise BadFieldMask("stage field mask names no field; expected at least one (or an empty mask: every field)")
    return keys


class StagePlan:
    """Producer ``src`` staging ``keys`` for consumer ``dst`` (module docstring); implements the
    transport's :class:`~hybridkv.transport.staging.Stager`."""

    def __init__(self, src: Layout, dst: Layout, keys: Collection[FieldKey],
                 reads: Collection[FieldKey] | None = None, *, dst_order: bool = False) -> None:
        """``keys``: what the producer packs (:func:`masked_keys` of :func:`shared_order`, both sides compute it alike);
        ``reads``: what the consumer takes from it (default all; fewer where GQA has it read a
        replicated head from another producer rank); ``dst_order``: compact pages in the consumer's
        order (:func:`compact_layout`)."""
        self.keys = frozenset(keys)
        self.reads = self.keys if reads is None else frozenset(reads)
        if not self.reads or not self.reads <= self.keys:
            raise ValueError(f"staging {len(self.keys)} fields of which {len(self.reads)} are read; expected a "
                             "non-empty read set inside what the producer packs")
        self.src, self.dst = src, dst
        self.compact = v = compact_layout(src, dst, self.keys, dst_order=dst_order)
        self.page_bytes: dict[int, int] = {int(g.group_id): v.regions[g.placements[0].region_id].page_bytes
                                           for g in v.groups}
        self._pack: dict[int, pc.PieceTable] = {
            int(g.group_id): pc.merge_table(pc.field_table(src, src.group(g.group_id), v, g, self.keys))
            for g in v.groups}
        self._unpack: dict[int, pc.PieceTable] = {
            int(g.group_id): pc.merge_table(pc.field_table(v, g, dst, dst.group(g.group_id), self.reads))
            for g in v.groups}
        self._fixed = {("pack", g): _fixed_side(t, src, pages_from_slot=False) for g, t in self._pack.items()}
        self._fixed.update({("unpack", g): _fixed_side(t, dst, pages_from_slot=True) for g, t in self._unpack.items()})
        # dst's groups that the slot holds (one whose fields this producer packs none of has no compact page)
        held = dataclasses.replace(dst, groups=tuple(g for g in dst.groups if int(g.group_id) in self._pack))
        self._read = TransferPlanner(v, held, keys=self.reads)
        self.groups = tuple(sorted(self.page_bytes))
        #: per group the read's pieces in classes of one block mapping and strides: (s_k, d_k, src blocks per
        #: pair, dst blocks per pair, src stride, dst stride) -> distinct (dst - src) offsets inside one pair
        self._offsets: dict[int, list[tuple[tuple[int, ...], int]]] = {
            g: _offset_classes(t) for g, t in self._read.tables.items()}
        self.same_blocks = all(src.group(g.group_id).block_tokens == dst.group(g.group_id).block_tokens
                               for g in v.groups)
        self._fields: bytes | None = None

    @property
    def fields(self) -> bytes:
        """What a Want asks this producer to pack (:func:`field_mask` of :attr:`keys` over the fields the pair
        shares): empty where it packs every one."""
        if self._fields is None:
            self._fields = field_mask(shared_order(self.src, self.dst), self.keys)
        return self._fields

    def areas(self, src_blocks: Mapping[int, np.ndarray]) -> dict[int, tuple[int, int]]:
        """Per group: (byte offset in the slot, block count)."""
        out: dict[int, tuple[int, int]] = {}
        at = 0
        for g in self.groups:
            n = len(src_blocks.get(g, ()))
            out[g] = (at, n)
            at += n * self.page_bytes[g]
        return out

    def nbytes(self, src_blocks: Mapping[int, np.ndarray]) -> int:
        return sum(len(src_blocks.get(g, ())) * self.page_bytes[g] for g in self.groups)

    def pack(self, src_blocks: Mapping[int, np.ndarray], *, base: int = 0) -> CopySteps:
        """``base``: the slot's offset in the staging buffer."""
        steps = []
        for g, (at, n) in self.areas(src_blocks).items():
            if n == 0:
                continue
            sb = np.asarray(src_blocks[g], dtype=np.int64)
            steps.append(self._steps(self._pack[g], self._fixed["pack", g], sb, np.arange(n, dtype=np.int64),
                                     src_slot=None, dst_slot=base + at, stride=self.page_bytes[g]))
        return CopySteps.concat(steps)

    def unpack(self, src_blocks: Mapping[int, np.ndarray], dst_blocks: Mapping[int, np.ndarray], *,
               base: int = 0) -> CopySteps:
        """``base``: the offset in the consumer's staging buffer its slot starts at."""
        steps = []
        for g, (at, n) in self.areas(src_blocks).items():
            if self._unpack[g].num_pieces == 0:
                continue
            db = np.asarray(dst_blocks.get(g, ()), dtype=np.int64)
            steps.append(self._steps(self._unpack[g], self._fixed["unpack", g], np.arange(n, dtype=np.int64), db,
                                     src_slot=base + at, dst_slot=None, stride=self.page_bytes[g]))
        return CopySteps.concat(steps)

    @staticmethod
    def _steps(t: pc.PieceTable, fixed: tuple[np.ndarray, np.ndarray, np.ndarray], sb: np.ndarray, db: np.ndarray,
               *, src_slot: int | None, dst_slot: int | None, stride: int) -> CopySteps:
        """One step per piece of ``t``, as columns: the slot's side at ``src_slot``/``dst_slot`` (pages ``stride``
        apart), the other in this side's regions as ``fixed`` (:func:`_fixed_side`) says."""
        piece, s_pages, d_pages = piece_rows(t, sb, db)
        regions, strides = np.full(t.num_pieces, SLOT, dtype=np.int64), np.full(t.num_pieces, stride, dtype=np.int64)
        if src_slot is not None:
            (sr, so, ss), (dr, do, ds) = (regions, src_slot + t.s_off, strides), fixed
        else:
            (sr, so, ss), (dr, do, ds) = fixed, (regions, dst_slot + t.d_off, strides)
        return CopySteps(src_region=sr, src_offset=so, src_stride=ss, dst_region=dr, dst_offset=do, dst_stride=ds,
                         length=t.length.astype(np.int64, copy=False), step=piece, src_pages=s_pages,
                         dst_pages=d_pages)

    def read(self, slot_addr: int, slot_dev: int, src_blocks: Mapping[int, np.ndarray],
             dst_blocks: Mapping[int, np.ndarray]) -> TransferPlan:
        plans = []
        for g, (at, n) in self.areas(src_blocks).items():
            if g not in dst_blocks or self._unpack[g].num_pieces == 0:
                continue
            plan = self._read.compile({g: np.arange(n, dtype=np.int64)}, {g: dst_blocks[g]})
            if plan.num_descriptors:
                plan.src[:, 0] += slot_addr + at
                plan.src[:, 2] = slot_dev
                plans.append(plan)
        return _merged(TransferPlan.concat(plans))

    def read_rows_least(self, src_blocks: Mapping[int, np.ndarray], dst_blocks: Mapping[int, np.ndarray], *,
                        cap: int | None = None) -> int:
        """A lower bound on ``read(..., src_blocks, dst_blocks).num_descriptors`` from the block lists alone (no row
        planned), counted no further than ``cap``: for weighing a staged read where only whether it takes more
        than a few rows matters (a few us where the first group's pieces or blocks already pass ``cap``).

        Why it is one: a row of the read is contiguous on both sides with one length, so every byte of it moves
        by the same ``dst - src`` offset; merging (the compiler's, and :func:`_merged` across groups) joins only
        rows that continue each other on both sides, i.e. of one offset. So the rows are at least the distinct
        offsets of the bytes read, which are at least those of any one group's rows. In one group, the pieces
        of a class (the same block mapping and strides) move block pair ``s`` by ``c_p + v_s``, with ``c_p`` the
        piece's (dst - src) offset inside the pair and ``v_s = dst_page * dst_stride - src_page * src_stride``
        (the slot's address and the group's place in it shift every row of the group alike). A sum of two sets
        of integers C + V takes at least ``|C| + |V| - 1`` values (sorted: c1+v1 < ... < c1+vb < c2+vb < ... <
        ca+vb). The bound is the largest over groups and classes. Block lists whose counts do not pair raise
        the ValueError :meth:`read` raises."""
        top = _COMPACT_PAGES * 1024 if cap is None else cap
        least = 0
        for g in self.groups:
            n = len(src_blocks.get(g, ()))
            if n == 0 or g not in dst_blocks or self._unpack[g].num_pieces == 0:
                continue
            t = self._read.tables[g]
            db = np.asarray(dst_blocks[g], dtype=np.int64)
            nd = db.shape[0]
            if n == nd and t.src_block_tokens == t.dst_block_tokens:
                sb, pairs = None, n  # src pages 0..n-1 pair ours in order (the common case, without numpy)
            else:
                sb, db, pairs = paired_blocks(t, np.arange(n, dtype=np.int64), db)
            if pairs == 0:
                continue
            for (s_k, d_k, s_per, d_per, s_stride, d_stride), n_c in self._offsets[g]:
                if sb is None and (s_k, d_k, s_per, d_per) == (0, 0, 1, 1):
                    # every pair has this class's rows: its own pieces' offsets first, then ours in Python
                    # until the cap (few blocks, or distinct offsets soon), else all at once
                    if n_c >= top:
                        return top
                    seen: set[int] = set()
                    head = db[:_FEW_PAIRS].tolist()
                    for i, b in enumerate(head):
                        seen.add(b * d_stride - i * s_stride)
                        if n_c + len(seen) - 1 >= top:
                            return top
                    n_v = len(seen) if len(head) == pairs else int(np.unique(
                        db[:pairs] * d_stride - np.arange(pairs, dtype=np.int64) * s_stride).shape[0])
                else:
                    src = np.arange(n, dtype=np.int64) if sb is None else sb
                    s = np.arange(pairs, dtype=np.int64)
                    i_s, i_d = s_k + s * s_per, d_k + s * d_per
                    keep = (i_s < src.shape[0]) & (i_d < db.shape[0])
                    if not keep.any():
                        continue
                    n_v = int(np.unique(db[i_d[keep]] * d_stride - src[i_s[keep]] * s_stride).shape[0])
                least = max(least, n_c + n_v - 1)
                if least >= top:
                    return top
        return least

    def rebase(self, plan: TransferPlan, *, was: int, slot_addr: int, slot_dev: int) -> TransferPlan:
        """``plan``, a :meth:`read` of a slot at ``was``, as the same read of a slot at ``slot_addr`` on ``slot_dev``
        (equal to reading it anew): the slot moves every source row alike, so the same rows merge."""
        src = plan.src.copy()
        src[:, 0] += slot_addr - was
        src[:, 2] = slot_dev
        return dataclasses.replace(plan, src=src)


def _fixed_side(t: pc.PieceTable, local: Layout, *, pages_from_slot: bool) -> tuple[np.ndarray, np.ndarray,
                                                                                      np.ndarray]:
    """Per piece of ``t``: the (region, offset, stride) of its side in ``local``'s regions (dst where the slot is
    the src, else src), made once per plan."""
    region, offset = (t.d_region, t.d_off) if pages_from_slot else (t.s_region, t.s_off)
    strides = np.array([r.stride for r in local.regions], dtype=np.int64)
    region = region.astype(np.int64, copy=False)
    return region, offset.astype(np.int64, copy=False), strides[region]


def _offset_classes(t: pc.PieceTable) -> list[tuple[tuple[int, ...], int]]:
    """``t``'s pieces of positive length by (s_k, d_k, src and dst blocks per pair, src and dst stride), each
    class with how many distinct (dst - src) offsets its pieces take inside one block pair
    (:meth:`StagePlan.read_rows_least`)."""
    classes: dict[tuple[int, ...], set[int]] = {}
    for p in range(t.num_pieces):
        if t.length[p] <= 0:
            continue
        key = (int(t.s_k[p]), int(t.d_k[p]), t.src_blocks_per_pair, t.dst_blocks_per_pair, int(t.s_stride[p]),
               int(t.d_stride[p]))
        classes.setdefault(key, set()).add(int(t.d_base[p] + t.d_off[p] - t.s_base[p] - t.s_off[p]))
    return [(k, len(c)) for k, c in classes.items()]


def _merged(plan: TransferPlan) -> TransferPlan:
    """Rows of consecutive groups that continue each other on both sides, merged."""
    s, d = plan.src, plan.dst
    if s.shape[0] < 2:
        return plan
    cont = (s[1:, 0] == s[:-1, 0] + s[:-1, 1]) & (d[1:, 0] == d[:-1, 0] + d[:-1, 1]) \
        & (s[1:, 2] == s[:-1, 2]) & (d[1:, 2] == d[:-1, 2])
    if not cont.any():
        return plan
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    length = np.add.reduceat(s[:, 1], starts)
    src, dst = s[starts].copy(), d[starts].copy()
    src[:, 1] = dst[:, 1] = length
    return TransferPlan(src=src, dst=dst, src_region=plan.src_region[starts], dst_region=plan.dst_region[starts])


__all__ = ["StagePlan", "compact_layout", "field_mask", "masked_keys", "shared_order"]
