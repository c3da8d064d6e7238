"""The layout engine: where every byte of every block lives.

A `Layout` is a few registered memory **regions** (base, page stride, page bytes,
page count) and, for each KV-cache group, the **placements** of its block content
in those regions: logical block b of a group is page b of each region it is
placed in, and each placement lists the fields (what the bytes are) inside that
page. Two ways in:

- `plan_layout`: hybridkv's own layout. One region per layer kind, block-major
  across layers, and inside a block head-major (vLLM calls this BHLNC): one block
  of a kind is one contiguous span for all layers of that kind, and a TP shard's
  heads are one contiguous span too.
- `adopt_layout`: an engine's buffers, one per layer, with aliasing as vLLM's HMA
  makes it (layer i of every group on the same tensor). Buffers are de-duplicated
  by address and adjacent slices with the same page stride are merged, so a
  block-outermost engine layout (vLLM BLHNC) also becomes one span per block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hybridkv.layout.alloc import Allocation, Allocator, MemKind
from hybridkv.layout.fields import Field, FieldKind, PageContent
from hybridkv.layout.geometry import LayerKind, ModelGeometry
from hybridkv.ids import BlockId, GroupId, RegionId

#: Attention kernels take block sizes in multiples of this many tokens.
KERNEL_ALIGNMENT = 16


def check_block_size(block_size: int, alignment: int = KERNEL_ALIGNMENT) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0 \
            or block_size % alignment:
        raise ValueError(f"block size must be a positive multiple of {alignment}, got {block_size!r}")


@dataclass(frozen=True, kw_only=True)
class Region:
    """One registered range: page p is [base_addr + p*stride, +page_bytes)."""

    region_id: RegionId
    base_addr: int
    stride: int
    page_bytes: int
    num_pages: int
    mem: MemKind = MemKind.DRAM
    device_id: int = 0

    def __post_init__(self) -> None:
        if self.page_bytes <= 0 or self.num_pages <= 0 or self.stride < self.page_bytes and self.num_pages > 1:
            raise ValueError(
                f"region {self.region_id}: page_bytes {self.page_bytes}, num_pages {self.num_pages} and "
                f"stride {self.stride} must be positive with stride >= page_bytes"
            )

    @property
    def nbytes(self) -> int:
        return self.stride * (self.num_pages - 1) + self.page_bytes

    def page_addr(self, page: int) -> int:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is outside region {self.region_id} (0..{self.num_pages - 1})")
        return self.base_addr + page * self.stride


@dataclass(frozen=True, kw_only=True)
class Placement:
    region_id: RegionId
    fields: tuple[Field, ...]


@dataclass(frozen=True, kw_only=True)
class GroupLayout:
    group_id: GroupId
    kind: LayerKind | None  # None: opaque buffers (adopt_buffers)
    layer_indices: tuple[int, ...]
    block_tokens: int | None  # tokens per block; None for state groups (one block = one state)
    placements: tuple[Placement, ...]
    window: int | None = None


@dataclass(frozen=True, kw_only=True)
class Layout:
    geometry: ModelGeometry | None  # unsharded; tp/rank say which shard this side holds (None: opaque)
    tp: int
    rank: int
    regions: tuple[Region, ...]
    groups: tuple[GroupLayout, ...]
    allocations: tuple[Allocation, ...] = field(default=(), compare=False, repr=False)

    def region(self, region_id: int) -> Region:
        return self.regions[region_id]

    def group(self, group_id: int) -> GroupLayout:
        for g in self.groups:
            if g.group_id == group_id:
                return g
        raise ValueError(f"group {group_id} is not in this layout (groups: {[g.group_id for g in self.groups]})")

    @property
    def fingerprint(self) -> str:
        """Changes whenever anything a peer relies on changes, addresses included."""
        return _digest(repr((self.geometry, self.tp, self.rank, self.regions, self.groups)))

    @property
    def shape_fingerprint(self) -> str:
        """Like `fingerprint` without addresses: equal for equally shaped layouts."""
        shapes = tuple((r.stride, r.page_bytes, r.num_pages, r.mem) for r in self.regions)
        return _digest(repr((self.geometry, self.tp, self.rank, shapes, self.groups)))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- plan


def plan_layout(
    geometry: ModelGeometry,
    *,
    block_size: int,
    num_blocks: int | Mapping[LayerKind, int],
    allocator: Allocator,
    tp: int = 1,
    rank: int = 0,
) -> Layout:
    """hybridkv's own layout: one group and one region per layer kind, block-major, head-major."""
    check_block_size(block_size)
    regions: list[Region] = []
    groups: list[GroupLayout] = []
    allocations: list[Allocation] = []
    for kind in geometry.kinds():
        count = num_blocks[kind] if isinstance(num_blocks, Mapping) else num_blocks
        if not isinstance(count, int) or count <= 0:
            raise ValueError(f"num_blocks for {kind.value} must be a positive int, got {count!r}")
        layers = geometry.layer_indices(kind)
        spec = geometry.spec_of(kind)
        fields, page = spec.planned_fields(layers, tp=tp, rank=rank, block_size=block_size)
        alloc = allocator.allocate(page * count)
        allocations.append(alloc)
        rid = RegionId(len(regions))
        regions.append(Region(region_id=rid, base_addr=alloc.addr, stride=page, page_bytes=page, num_pages=count,
                              mem=alloc.mem, device_id=alloc.device_id))
        groups.append(GroupLayout(
            group_id=GroupId(len(groups)), kind=kind, layer_indices=layers,
            block_tokens=spec.block_tokens(block_size),
            placements=(Placement(region_id=rid, fields=fields),),
            window=spec.window,
        ))
    return Layout(geometry=geometry, tp=tp, rank=rank, regions=tuple(regions), groups=tuple(groups),
                  allocations=tuple(allocations))


# --------------------------------------------------------------------------- adopt


@dataclass(frozen=True, kw_only=True)
class LayerBuffer:
    """One layer's pages as an engine allocated them (a tensor or a pointer + sizes)."""

    layer: int
    group_id: GroupId
    addr: int
    block_stride: int
    page_bytes: int
    num_blocks: int
    content: PageContent | None = None  # None: its kind's one arrangement (LayerSpec.engine_content)
    mem: MemKind = MemKind.DRAM
    device_id: int = 0
    #: tokens of the attention kernel's blocks where the engine splits a block into smaller ones
    #: (each laid out like a page of that many tokens); None: not split
    kernel_tokens: int | None = None


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """An engine's KV-cache group: which layers, what kind, how many tokens a block holds."""

    group_id: GroupId
    kind: LayerKind
    layer_indices: tuple[int, ...]
    block_tokens: int | None


def adopt_layout(
    geometry: ModelGeometry,
    groups: Iterable[GroupSpec],
    buffers: Iterable[LayerBuffer],
    *,
    tp: int = 1,
    rank: int = 0,
) -> Layout:
    """Regions from an engine's per-layer buffers: de-duplicated, classified, merged."""
    groups = tuple(groups)
    by_id = {g.group_id: g for g in groups}
    if len(by_id) != len(groups):
        raise ValueError(f"group ids must be unique, got {[g.group_id for g in groups]}")
    slices: dict[tuple[int, int, int, MemKind, int], int] = {}  # (addr, stride, blocks, mem, dev) -> page bytes
    members: dict[tuple, dict[GroupId, list[Field]]] = {}
    seen_layers: set[int] = set()
    for buf in buffers:
        group = by_id.get(buf.group_id)
        if group is None:
            raise ValueError(f"buffer of layer {buf.layer} names group {buf.group_id}, not one of {sorted(by_id)}")
        if buf.layer not in group.layer_indices:
            raise ValueError(f"layer {buf.layer} is not in group {buf.group_id} {group.layer_indices}")
        if buf.layer in seen_layers:
            raise ValueError(f"layer {buf.layer} has more than one buffer")
        seen_layers.add(buf.layer)
        if buf.num_blocks <= 0 or buf.page_bytes <= 0 or buf.block_stride < buf.page_bytes:
            raise ValueError(f"layer {buf.layer}: block_stride {buf.block_stride} must be >= page_bytes "
                             f"{buf.page_bytes} > 0 and num_blocks {buf.num_blocks} > 0")
        spec = geometry.layers[buf.layer]
        if spec.kind is not group.kind:
            raise ValueError(f"layer {buf.layer} is {spec.kind.value} but group {group.group_id} is {group.kind.value}")
        if buf.kernel_tokens is None:
            fields = spec.page_fields(buf.layer, tp=tp, rank=rank, block_tokens=group.block_tokens,
                                      content=buf.content)
        else:
            fields = spec.kernel_page_fields(buf.layer, tp=tp, rank=rank, block_tokens=group.block_tokens,
                                             kernel_tokens=buf.kernel_tokens, content=buf.content)
        used = max(f.offset + f.nbytes for f in fields)
        if used > buf.page_bytes:
            raise ValueError(f"layer {buf.layer}: its {spec.kind.value} state needs {used} bytes per page, "
                             f"the buffer's page has {buf.page_bytes}")
        key = (buf.addr, buf.block_stride, buf.num_blocks, buf.mem, buf.device_id)
        slices[key] = max(slices.get(key, 0), buf.page_bytes)
        members.setdefault(key, {}).setdefault(group.group_id, []).extend(fields)
    missing = [i for g in groups for i in g.layer_indices if i not in seen_layers]
    if missing:
        raise ValueError(f"layers {missing} have no buffer")
    regions, placements = _merge_slices(slices, members)
    layouts = []
    for g in groups:
        spec = geometry.layers[g.layer_indices[0]]
        layouts.append(GroupLayout(
            group_id=g.group_id, kind=g.kind, layer_indices=g.layer_indices, block_tokens=g.block_tokens,
            placements=tuple(Placement(region_id=rid, fields=tuple(sorted(fs, key=lambda f: f.offset)))
                             for rid, fs in sorted(placements.get(g.group_id, {}).items())),
            window=spec.window,
        ))
    return Layout(geometry=geometry, tp=tp, rank=rank, regions=tuple(regions), groups=tuple(layouts))


def _merge_slices(slices, members):
    """Merge slices that sit back to back inside one page stride into one region."""
    order = sorted(slices, key=lambda k: (k[3].value, k[4], k[1], k[2], k[0]))
    runs: list[list[tuple]] = []
    for key in order:
        if runs:
            prev = runs[-1][-1]
            same_shape = prev[1:] == key[1:]
            prev_end = prev[0] + slices[prev]
            start = runs[-1][0][0]
            if same_shape and key[0] == prev_end and key[0] + slices[key] - start <= key[1]:
                runs[-1].append(key)
                continue
            if same_shape and key[0] < prev_end:
                raise ValueError(f"buffers at {hex(prev[0])} and {hex(key[0])} overlap without aliasing")
        runs.append([key])
    regions: list[Region] = []
    placements: dict[GroupId, dict[RegionId, list[Field]]] = {}
    for run in runs:
        base, stride, blocks, mem, dev = run[0]
        rid = RegionId(len(regions))
        page = run[-1][0] + slices[run[-1]] - base
        regions.append(Region(region_id=rid, base_addr=base, stride=stride, page_bytes=page, num_pages=blocks,
                              mem=mem, device_id=dev))
        for key in run:
            for gid, fields in members[key].items():
                delta = key[0] - base
                placements.setdefault(gid, {}).setdefault(rid, []).extend(f.shifted(delta) for f in fields)
    return regions, placements


# --------------------------------------------------------------------------- opaque buffers


@dataclass(frozen=True, kw_only=True)
class Buffer:
    """An engine buffer of equal items (pages or state slots), moved as opaque bytes.

    For engines that describe transferable memory as pointer lists without a model
    geometry (SGLang's `kv_data_ptrs` / `state_data_ptrs` / `aux_data_ptrs`). `key`
    says which buffer this is and must name the same buffer on both sides; item i
    of the buffer is block i of `group_id`.
    """

    key: int
    group_id: GroupId
    addr: int
    item_bytes: int
    num_items: int
    item_stride: int | None = None  # default: item_bytes (items back to back)
    mem: MemKind = MemKind.DRAM
    device_id: int = 0


def adopt_buffers(buffers: Iterable[Buffer], *, name: str = "opaque") -> Layout:
    """A layout of opaque buffers: one group per `group_id`, items paired one to one.

    Buffers at the same address and stride are one region; buffers that sit back to
    back inside one item stride merge into one region, as in `adopt_layout`.
    """
    slices: dict[tuple[int, int, int, MemKind, int], int] = {}
    members: dict[tuple, dict[GroupId, list[Field]]] = {}
    keys: set[int] = set()
    groups: set[GroupId] = set()
    for b in buffers:
        stride = b.item_bytes if b.item_stride is None else b.item_stride
        if b.item_bytes <= 0 or b.num_items <= 0 or stride < b.item_bytes:
            raise ValueError(f"buffer {b.key}: item_bytes {b.item_bytes} and num_items {b.num_items} must be "
                             f"positive and item_stride {stride} >= item_bytes")
        if b.key in keys:
            raise ValueError(f"buffer key {b.key} appears twice; expected one buffer per key")
        keys.add(b.key)
        groups.add(b.group_id)
        slot = (b.addr, stride, b.num_items, b.mem, b.device_id)
        if slot in slices and slices[slot] != b.item_bytes:
            raise ValueError(f"buffers at {hex(b.addr)} alias with different item sizes")
        slices[slot] = b.item_bytes
        members.setdefault(slot, {}).setdefault(b.group_id, []).append(
            Field(key=(FieldKind.OPAQUE, b.key, 0), offset=0, nbytes=b.item_bytes))
    if not keys:
        raise ValueError("no buffers given; expected at least one")
    regions, placements = _merge_slices(slices, members)
    layouts = tuple(
        GroupLayout(group_id=gid, kind=None, layer_indices=(), block_tokens=None,
                    placements=tuple(Placement(region_id=rid, fields=tuple(sorted(fs, key=lambda f: f.offset)))
                                     for rid, fs in sorted(placements[gid].items())))
        for gid in sorted(groups))
    del name
    return Layout(geometry=None, tp=1, rank=0, regions=tuple(regions), groups=layouts)
