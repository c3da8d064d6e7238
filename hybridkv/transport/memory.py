"""What one side exposes to transfers: its registered regions and group placements.

:class:`MemoryMap` is the transport's view of a :class:`hybridkv.layout.Layout`
(read through attributes only, so the transport does not depend on how the
layout was made): regions as :class:`~hybridkv.wire.RegionInfo` and, per
KV-cache group, the regions its block b lives in (page b of each). Page b of
region r is entry ``offsets[r] + b`` of the side's prepped list
(:meth:`MemoryMap.strided_rows`); which pages pair is a planner's business
(:mod:`hybridkv.transport.plan`), never this module's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hybridkv import wire
from hybridkv.errors import HandshakeRefused, Difference


@dataclass(frozen=True, kw_only=True)
class MemoryMap:
    regions: tuple[wire.RegionInfo, ...]
    groups: tuple[wire.GroupInfo, ...]
    #: what the other side must agree on beyond the page shapes (geometry, dtypes, tp, ...)
    compat: Mapping[str, str] = field(default_factory=dict)
    #: the layout's field tables, for a peer that pairs by fields (heterogeneous TP, block sizes)
    table: wire.LayoutTable | None = None
    #: the layout itself where this side has one (not sent: the peer rebuilds it from ``table``)
    layout: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        ids = [r.region_id for r in self.regions]
        if ids != list(range(len(ids))):
            raise ValueError(f"region ids {ids}; expected 0..{len(ids) - 1} in order")
        for g in self.groups:
            for rid in g.region_ids:
                if not 0 <= rid < len(ids):
                    raise ValueError(f"group {g.group_id} names region {rid}; expected one of {ids}")

    @property
    def offsets(self) -> np.ndarray:
        """Flat descriptor index of page 0 of each region."""
        n = np.array([r.num_pages for r in self.regions], dtype=np.int64)
        return np.concatenate(([0], np.cumsum(n)[:-1])).astype(np.int64)

    def group(self, group_id: int) -> wire.GroupInfo:
        for g in self.groups:
            if g.group_id == group_id:
                return g
        raise ValueError(f"group {group_id}; expected one of {[g.group_id for g in self.groups]}")

    def group_bounds(self) -> dict[int, int]:
        """Per group, the exclusive upper bound of its block ids."""
        return {g.group_id: min(self.regions[r].num_pages for r in g.region_ids) for g in self.groups}

    def strided_rows(self) -> np.ndarray:
        """One Nx5 row per region (addr, len, dev, stride, count): NIXL's compact prepped list."""
        return np.array([[r.base_addr, r.page_bytes, r.device_id, r.stride, r.num_pages] for r in self.regions],
                        dtype=np.uint64)

    @property
    def mem(self) -> wire.Mem:
        kinds = {r.mem for r in self.regions}
        if len(kinds) != 1:
            raise ValueError(f"regions mix memory kinds {sorted(k.name for k in kinds)}; expected one")
        return kinds.pop()

    def shape_fields(self) -> dict[str, str]:
        """Compatibility fields: the page format of every group (not addresses or page counts)."""
        per_group = [(g.group_id, tuple(self.regions[r].page_bytes for r in g.region_ids)) for g in self.groups]
        return {**self.compat, "pages": hashlib.sha256(repr(sorted(per_group)).encode()).hexdigest()[:16]}


def from_layout(layout) -> MemoryMap:
    """MemoryMap of a :class:`hybridkv.layout.Layout` (duck-typed)."""
    regions = tuple(
        wire.RegionInfo(region_id=int(r.region_id), base_addr=int(r.base_addr), stride=int(r.stride),
                        page_bytes=int(r.page_bytes), num_pages=int(r.num_pages),
                        mem=wire.Mem[r.mem.name], device_id=int(r.device_id))
        for r in layout.regions
    )
    groups = tuple(wire.GroupInfo(group_id=int(g.group_id), region_ids=tuple(int(p.region_id) for p in g.placements))
                   for g in layout.groups)
    geo = layout.geometry
    fields_repr = repr(tuple((g.group_id, g.kind, g.block_tokens, g.placements) for g in layout.groups))
    compat = {
        "geometry": hashlib.sha256(repr(geo).encode()).hexdigest()[:16],
        # An opaque layout (adopt_buffers) has no geometry: its buffers' sizes say it all.
        "dtypes": ",".join(sorted({_dtypes(spec) for spec in (geo.layers if geo is not None else ())})),
        "tp": str(layout.tp),
        "page_format": hashlib.sha256(fields_repr.encode()).hexdigest()[:16],
    }
    return MemoryMap(regions=regions, groups=groups, compat=compat, table=layout_table(layout), layout=layout)


#: compatibility fields that only say how pages are cut; a side that pairs by fields tolerates them differing
PAGE_SHAPE_FIELDS = ("tp", "page_format", "pages")


def _codes(enum_cls) -> dict:
    return {m: i + 1 for i, m in enumerate(enum_cls)}


def layout_table(layout) -> wire.LayoutTable:
    """The compact field tables of a :class:`hybridkv.layout.Layout` for the handshake."""
    from hybridkv.layout.fields import FieldKind
    from hybridkv.layout.geometry import LayerKind

    comp, kinds = _codes(FieldKind), _codes(LayerKind)
    groups = []
    for g in layout.groups:
        placements = []
        for p in g.placements:
            rows = np.array([[comp[f.key[0]], f.key[1], f.key[2], f.offset, f.nbytes, f.token_bytes]
                             for f in p.fields], dtype="<i8").reshape(-1, wire.FIELD_COLUMNS)
            placements.append(wire.PlacementTable(region_id=int(p.region_id), rows=rows.tobytes()))
        groups.append(wire.GroupTable(
            group_id=int(g.group_id), kind=0 if g.kind is None else kinds[g.kind],
            block_tokens=int(g.block_tokens or 0), window=int(g.window or 0),
            layers=tuple(int(i) for i in g.layer_indices), placements=tuple(placements)))
    return wire.LayoutTable(tp=int(layout.tp), rank=int(layout.rank), groups=tuple(groups))


def rebuild_layout(remote: MemoryMap, geometry):
    """The peer's :class:`hybridkv.layout.Layout` from its handshake (regions + field tables).

    ``geometry`` is this side's: the compatibility hash already proved both sides run
    the same model. Raises ValueError if the peer sent no field tables or codes we do not know.
    """
    from hybridkv.layout.alloc import MemKind
    from hybridkv.layout.fields import FieldKind, Field
    from hybridkv.layout.geometry import LayerKind
    from hybridkv.layout import GroupLayout, Layout, Placement, Region

    t = remote.table
    if t is None:
        raise ValueError("the peer's handshake carries no layout field tables; expected them for field pairing")
    comps, kinds = list(FieldKind), list(LayerKind)
    regions = tuple(Region(region_id=r.region_id, base_addr=r.base_addr, stride=r.stride, page_bytes=r.page_bytes,
                           num_pages=r.num_pages, mem=MemKind[r.mem.name], device_id=r.device_id)
                    for r in remote.regions)
    groups = []
    for g in t.groups:
        if g.kind > len(kinds):
            raise ValueError(f"peer group {g.group_id} has layer-kind code {g.kind}; expected 0..{len(kinds)}")
        placements = []
        for p in g.placements:
            a = p.array()
            if a.size and int(a[:, 0].max()) > len(comps) or a.size and int(a[:, 0].min()) < 1:
                raise ValueError(f"peer group {g.group_id} has component codes outside 1..{len(comps)}")
            placements.append(Placement(region_id=p.region_id, fields=tuple(
                Field(key=(comps[int(c) - 1], int(layer), int(head)), offset=int(off), nbytes=int(n),
                      token_bytes=int(tb)) for c, layer, head, off, n, tb in a.tolist())))
        groups.append(GroupLayout(group_id=g.group_id, kind=None if g.kind == 0 else kinds[g.kind - 1],
                                  layer_indices=g.layers, block_tokens=g.block_tokens or None,
                                  placements=tuple(placements), window=g.window or None))
    return Layout(geometry=geometry, tp=t.tp, rank=t.rank, regions=regions, groups=tuple(groups))


def _dtypes(spec) -> str:
    names = [getattr(spec, a) for a in ("dtype", "conv_dtype", "ssm_dtype") if hasattr(spec, a)]
    return "/".join(getattr(n, "name", str(n)) for n in names)


def check_peer_shapes(local: MemoryMap, remote: Sequence[wire.RegionInfo], remote_groups: Sequence[wire.GroupInfo]) -> None:
    """Groups must pair up region by region with equal page bytes (else a transfer would tear pages)."""
    diffs = []
    rg = {g.group_id: g for g in remote_groups}
    for g in local.groups:
        other = rg.get(g.group_id)
        mine = tuple(local.regions[r].page_bytes for r in g.region_ids)
        theirs = None if other is None else tuple(remote[r].page_bytes for r in other.region_ids)
        if mine != theirs:
            diffs.append(Difference(field=f"group{g.group_id}.page_bytes", local=str(mine), remote=str(theirs)))
    if set(rg) - {g.group_id for g in local.groups}:
        diffs.append(Difference(field="groups", local=str(sorted(g.group_id for g in local.groups)),
                                remote=str(sorted(rg))))
    if diffs:
        raise HandshakeRefused("page shapes differ", diffs)
