"""SGLang's transfer buffers (`KVArgs`) adopted as a hybridkv `Layout`.

SGLang describes what may move as pointer lists: `kv_data_ptrs` (one buffer per
layer: K then V for MHA; item = one page of one layer), `state_data_ptrs` (per
state type, one buffer per (state tensor x layer); item = one slot) and
`aux_data_ptrs` (CPU metadata buffers; item = one request row). Each becomes a
`hybridkv.layout.Buffer` of one group (0 = KV pages, 1.. = one group per state
type, last = aux rows), keyed by what it holds (connectors/sglang/buffer_keys.py:
target or draft KV entry, state entry, aux role) so that the key names the same
buffer on both sides even where one side has a buffer the other has not (draft
KV, an optional aux buffer); `adopt_buffers` de-duplicates and merges
them into regions. Zero-size and null buffers (SGLang pads per-layer lists)
carry nothing and are left out on both sides by the same rule.

Each group is split into the *components* that the fencing scheduler tracks
separately (SGLang #39846: a request is complete only when all have landed):
the KV pages; for a Mamba state type its conv tensor(s) and its SSM (temporal)
tensor(s); the aux row. hybridkv's `ComponentKind` has KV / CONV / SSM, so a
non-Mamba state type and the aux row are each the single KV-kind component of
their own group.

Every buffer also records what slice of the model its items hold
(`shapes.BufferShape`) and the side its `shapes.Parallel` sharding: what the
field keys of connectors/sglang/pairing.py are built from, so that a decode
rank of another TP can be matched head by head. The `layout` here keeps the
buffers as opaque items: it is what NIXL registers, and what the peer gets
(`AdoptedLayout.peer_view`, rebuilt by `from_peer`) as hybridkv's own region list
and layout tables plus what SGLang says about the buffers in them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hybridkv.connectors.sglang import buffer_keys as keys_of
from hybridkv.connectors.sglang.messages import ComponentKeys, PeerLayout, ShapeOf
from hybridkv.connectors.sglang.shapes import BufferShape, Parallel, Slicing
from hybridkv.connectors.sglang.startup import state_type_name
from hybridkv.layout.alloc import MemKind
from hybridkv.fencing.fence import PoolLayout
from hybridkv.ids import GroupId, RequestId
from hybridkv.layout import Buffer, Layout, RegionId, adopt_buffers
from hybridkv.layout.fields import FieldKind
from hybridkv.transport.memory import MemoryMap, from_layout, rebuild_layout
from hybridkv.fencing.request_state import Component, ComponentKind

KV_GROUP = 0


@dataclass(frozen=True, kw_only=True)
class AdoptedLayout:
    """A side's Layout plus what the backend needs around it."""

    layout: Layout
    buffers: tuple[Buffer, ...]
    num_state_groups: int
    #: buffer keys of each component, in a stable order (KV, state groups, aux)
    components: tuple[tuple[Component, frozenset[int]], ...]
    #: per group, how many blocks (pages, slots, rows) every buffer of it holds
    group_blocks: tuple[int, ...]
    parallel: Parallel
    #: per buffer key: what its items hold
    shapes: dict[int, BufferShape]
    #: per buffer key: (region, byte offset of the item inside the region's page)
    placement: dict[int, tuple[RegionId, int]]
    #: the layout as the transport registers and sends it (regions, groups, field tables)
    memory: MemoryMap
    #: SGLang's StateType value of each state group, in order ("mamba", "swa", ...); empty for a peer's view
    state_types: tuple[str, ...] = ()

    def state_type_of(self, group: int) -> str:
        """The StateType value of a state group ("?" where not known)."""
        i = group - 1
        return self.state_types[i] if 0 <= i < len(self.state_types) else "?"

    @property
    def aux_group(self) -> int:
        return 1 + self.num_state_groups

    def state_group(self, state_index: int) -> int:
        if not 0 <= state_index < self.num_state_groups:
            raise ValueError(f"state component {state_index}; expected one of 0..{self.num_state_groups - 1}")
        return 1 + state_index

    def pool_layout(self) -> PoolLayout:
        """One pool per group, as SGLang keeps KV pages, Mamba slots and aux rows apart."""
        return PoolLayout.separate(num_blocks=tuple(max(1, n) for n in self.group_blocks))

    def components_of(self, group: int) -> tuple[Component, ...]:
        return tuple(c for c, _ in self.components if c.group == group)

    def buffer(self, key: int) -> Buffer:
        for b in self.buffers:
            if b.key == key:
                return b
        raise ValueError(f"buffer {key} is not in this layout")

    def peer_view(self) -> PeerLayout:
        """This layout as the peer gets it (a wire record: see connectors/sglang/messages.py)."""
        m = self.memory
        return PeerLayout(
            regions=m.regions, groups=m.groups, table=m.table, num_state_groups=self.num_state_groups,
            shapes=tuple(ShapeOf(key=k, shape=s) for k, s in sorted(self.shapes.items())),
            components=tuple(ComponentKeys(component=c, keys=tuple(sorted(keys))) for c, keys in self.components),
            parallel=self.parallel)


def from_peer(view: PeerLayout) -> AdoptedLayout:
    """A peer's layout from the view it sent (the wire checked every field);
    ValueError naming what does not fit together."""
    layout = rebuild_layout(MemoryMap(regions=view.regions, groups=view.groups, table=view.table), None)
    buffers = _buffers_of(layout)
    nsg = view.num_state_groups
    for b in buffers:
        if not 0 <= b.group_id <= 1 + nsg:
            raise ValueError(f"buffer {b.key} is in group {b.group_id}; expected 0..{1 + nsg}")
    shapes = {s.key: s.shape for s in view.shapes}
    keys = {b.key for b in buffers}
    if set(shapes) != keys:
        raise ValueError(f"the peer sends shapes of buffers {sorted(set(shapes) ^ keys)[:8]} that its layout tables "
                         "do not hold (or the reverse); expected one shape per buffer")
    components = [(c.component, frozenset(c.keys)) for c in view.components]
    adopted = _build(buffers, nsg, components, view.parallel, shapes)
    if adopted.layout != layout:
        raise ValueError("the peer's regions are not those its buffers make; expected the layout adopt_buffers "
                         "builds from them")
    return adopted


def _buffers_of(layout: Layout) -> list[Buffer]:
    """The buffers an opaque layout was adopted from: each field is one buffer's item."""
    out = []
    for g in layout.groups:
        for p in g.placements:
            r = layout.region(p.region_id)
            for f in p.fields:
                kind, key, index = f.key
                if kind is not FieldKind.OPAQUE or index != 0 or f.token_bytes:
                    raise ValueError(f"group {g.group_id} holds field {kind.value} {key}/{index}; expected the "
                                     "opaque buffer items of an adopted SGLang layout")
                if r.stride != f.nbytes and r.num_pages > 1:
                    raise ValueError(f"buffer {key} has items of {f.nbytes} bytes every {r.stride} bytes; expected "
                                     "packed items (SGLang's pools are)")
                out.append(Buffer(key=key, group_id=g.group_id, addr=r.base_addr + f.offset, item_bytes=f.nbytes,
                                  num_items=r.num_pages, mem=r.mem, device_id=r.device_id))
    return sorted(out, key=lambda b: b.key)


def _ints(values: Sequence[Any] | None, what: str) -> list[int]:
    out = []
    for v in values or ():
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise ValueError(f"{what} holds {v!r}; expected ints")
        out.append(int(v))
    return out


def _build(buffers: list[Buffer], num_state_groups: int, components: list[tuple[Component, frozenset[int]]],
           parallel: Parallel, shapes: dict[int, BufferShape], state_types: tuple[str, ...] = ()) -> AdoptedLayout:
    keys = {b.key for b in buffers}
    blocks = []
    for g in range(2 + num_state_groups):
        counts = [b.num_items for b in buffers if b.group_id == g]
        blocks.append(min(counts) if counts else 0)
    comps = []
    for c, ks in components:
        live = frozenset(k for k in ks if k in keys)
        if live:
            comps.append((c, live))
    layout = adopt_buffers(buffers)
    return AdoptedLayout(layout=layout, buffers=tuple(buffers), num_state_groups=num_state_groups,
                         components=tuple(comps), group_blocks=tuple(blocks), parallel=parallel,
                         shapes={k: shapes[k] for k in sorted(keys)}, placement=_placement(layout, buffers),
                         memory=from_layout(layout), state_types=state_types)


def _placement(layout: Layout, buffers: list[Buffer]) -> dict[int, tuple[RegionId, int]]:
    """Where item 0 of each buffer sits: the region adopt_buffers put it in, and the offset in its page."""
    out = {}
    for b in buffers:
        for r in layout.regions:
            if (r.mem is b.mem and r.device_id == b.device_id and r.stride == b.item_bytes
                    and r.num_pages == b.num_items and r.base_addr <= b.addr
                    and b.addr + b.item_bytes <= r.base_addr + r.page_bytes):
                out[b.key] = (r.region_id, b.addr - r.base_addr)
                break
        else:
            raise RuntimeError(f"buffer {b.key} at {hex(b.addr)} is in no region of its adopted layout")
    return out


def parallel_of(kv_args: Any, *, attn_tp: int = 1, attn_rank: int = 0, state_tp: int | None = None,
                mla: bool = False) -> Parallel:
    """The side's sharding, from KVArgs and the attention-TP group (SGLang's ParallelContext)."""
    local = int(getattr(kv_args, "kv_head_num", 0) or 0)
    total = int(getattr(kv_args, "total_kv_head_num", 0) or 0) or local * attn_tp
    return Parallel(attn_tp=attn_tp, attn_rank=attn_rank, state_tp=state_tp or attn_tp,
                    page_size=int(getattr(kv_args, "page_size", 1) or 1), kv_heads=1 if mla else max(1, total),
                    mla=bool(mla), kv_layout=getattr(kv_args, "kv_layout", None),
                    draft_entries=int(getattr(kv_args, "num_draft_entries", 0) or 0))


def _per_entry(values: Any, c: int, n: int) -> list[Any] | None:
    """Entry c of a per-state-type list, if it has one value per buffer."""
    if not values or c >= len(values) or values[c] is None or len(values[c]) != n:
        return None
    return list(values[c])


def adopt_kv_args(kv_args: Any, *, device_mem: MemKind, gpu_id: int, parallel: Parallel | None = None,
                  aux_roles: tuple[str, ...] | None = None) -> AdoptedLayout:
    """The layout of an SGLang `KVArgs` (no copy, no allocation). Buffers are keyed by what they
    hold (buffer_keys.py): `aux_roles` names each aux buffer (None: keyed by position)."""
    parallel = parallel or parallel_of(kv_args)
    buffers: list[Buffer] = []
    shapes: dict[int, BufferShape] = {}
    components: list[tuple[Component, frozenset[int]]] = []
    dev = gpu_id if device_mem is MemKind.VRAM else 0

    def add(group: int, ptrs: list[int], lens: list[int], items: list[int], mem: MemKind, d: int, what: str,
            shape_of, key_of) -> list[int]:
        if not len(ptrs) == len(lens) == len(items):
            raise ValueError(f"{what} pointer lists disagree: {len(ptrs)} ptrs, {len(lens)} lens, "
                             f"{len(items)} item lens")
        keys = []
        for i, (p, n, it) in enumerate(zip(ptrs, lens, items)):
            key = key_of(i)
            if p < 0 or n < 0 or it < 0:
                raise ValueError(f"{what} buffer {key}: pointer {p}, length {n}, item length {it}; expected >= 0")
            if p == 0 or n == 0 or it == 0:
                continue  # padding entry: nothing to move
            if n % it:
                raise ValueError(f"{what} buffer {key}: data_len {n} is not a multiple of item_len {it}")
            buffers.append(Buffer(key=key, group_id=GroupId(group), addr=p, item_bytes=it, num_items=n // it,
                                  mem=mem, device_id=d))
            shapes[key] = shape_of(i, key)
            keys.append(key)
        return keys

    kv_shape = BufferShape(slicing=Slicing.WHOLE if parallel.mla else Slicing.HEADS)
    kv_ptrs = _ints(kv_args.kv_data_ptrs, "kv_data_ptrs")
    if parallel.draft_entries > len(kv_ptrs):
        raise ValueError(f"num_draft_entries = {parallel.draft_entries} but the KV lists hold {len(kv_ptrs)} entries")
    kv_keys = add(KV_GROUP, kv_ptrs, _ints(kv_args.kv_data_lens, "kv_data_lens"),
                  _ints(kv_args.kv_item_lens, "kv_item_lens"), device_mem, dev, "kv", lambda i, k: kv_shape,
                  lambda i: keys_of.kv_key(i, num_entries=len(kv_ptrs), num_draft=parallel.draft_entries))
    components.append((Component(group=GroupId(KV_GROUP), kind=ComponentKind.KV), frozenset(kv_keys)))
    state_ptrs = getattr(kv_args, "state_data_ptrs", None) or []
    state_lens = getattr(kv_args, "state_data_lens", None) or []
    state_items = getattr(kv_args, "state_item_lens", None) or []
    state_layers = getattr(kv_args, "state_layer_ids", None) or []
    state_types = getattr(kv_args, "state_types", None) or []
    type_names = tuple(state_type_name(st) for st in state_types)
    swa_nhd = getattr(kv_args, "swa_kv_cache_layout", None) == "nhd"
    for c, ps in enumerate(state_ptrs):
        group = 1 + c
        ptrs = _ints(ps, "state_data_ptrs")
        first = keys_of.state_key(c, 0)
        layers = _ints(state_layers[c] if c < len(state_layers) else None, "state_layer_ids")
        kind = getattr(state_types[c], "name", str(state_types[c])) if c < len(state_types) else ""
        other = _other_state_shape(type_names[c] if c < len(type_names) else "", mla=parallel.mla, swa_nhd=swa_nhd)
        per_tensor = len(set(layers)) if layers and len(layers) == len(ptrs) else 0
        mamba = kind == "MAMBA" and per_tensor and len(ptrs) % per_tensor == 0 and len(ptrs) > per_tensor
        dims = _per_entry(getattr(kv_args, "state_dim_per_tensor", None), c, len(ptrs)) if mamba else None
        outers = _per_entry(getattr(kv_args, "state_slice_outer_counts", None), c, len(ptrs)) or [1] * len(ptrs)
        subs = _per_entry(getattr(kv_args, "state_conv_shard_groups", None), c, len(ptrs)) or [None] * len(ptrs)

        def state_shape(i: int, key: int) -> BufferShape:
            if dims is None:
                return other
            if int(dims[i]) == 0:
                return BufferShape(slicing=Slicing.WHOLE)  # replicated across attention TP
            return BufferShape(slicing=Slicing.DIMS, dim=int(dims[i]), outer=int(outers[i] or 1),
                               sub=tuple(int(x) for x in subs[i] or ()), conv=i < per_tensor)

        add(group, ptrs, _ints(state_lens[c] if c < len(state_lens) else None, "state_data_lens"),
            _ints(state_items[c] if c < len(state_items) else None, "state_item_lens"), device_mem, dev, "state",
            state_shape, lambda i, c=c: keys_of.state_key(c, i))
        live = {b.key for b in buffers if b.group_id == group}
        if mamba:
            # SGLang's MambaPool lists its entries tensor-major x layer, conv first,
            # then temporal (SSM) and any extra per-slot tensors.
            conv = frozenset(k for k in range(first, first + per_tensor) if k in live)
            components.append((Component(group=GroupId(group), kind=ComponentKind.CONV), conv))
            components.append((Component(group=GroupId(group), kind=ComponentKind.SSM), frozenset(live) - conv))
        else:
            components.append((Component(group=GroupId(group), kind=ComponentKind.KV), frozenset(live)))
    aux_group = 1 + len(state_ptrs)
    aux_ptrs = _ints(kv_args.aux_data_ptrs, "aux_data_ptrs")
    if aux_roles is not None and len(aux_roles) != len(aux_ptrs):
        raise ValueError(f"{len(aux_ptrs)} aux buffers but {len(aux_roles)} roles {list(aux_roles)}")
    aux_keys = add(aux_group, aux_ptrs,
                   _ints(kv_args.aux_data_lens, "aux_data_lens"), _ints(kv_args.aux_item_lens, "aux_item_lens"),
                   MemKind.DRAM, 0, "aux", lambda i, k: BufferShape(slicing=Slicing.WHOLE),
                   lambda i: keys_of.aux_key(i, aux_roles))
    components.append((Component(group=GroupId(aux_group), kind=ComponentKind.KV), frozenset(aux_keys)))
    if not buffers:
        raise ValueError("KVArgs lists no non-empty buffer; expected KV pages at least")
    return _build(buffers, len(state_ptrs), components, parallel, shapes, type_names)


# State types whose items are the same on every attention-TP rank of an MLA model
# (SGLang's NIXL backend moves them between any TP sizes there, and at equal TP
# otherwise: maybe_send_extra).
_WHOLE_ON_MLA = frozenset({"swa", "swa_ring", "c128_state", "request_row", "block_scale", "block_scale_swa",
                           "qsa_pending", "qsa_compressed"})


def _other_state_shape(name: str, *, mla: bool, swa_nhd: bool) -> BufferShape:
    """What an item of a non-Mamba state type holds, as SGLang 0.5.23's NIXL backend
    moves it (nixl/conn.py maybe_send_extra): DSA index-K pages are the same on every
    rank (moved between any TP sizes); SWA pages of an MHA model are NHD KV pages
    (head-sliced like KV when TP differs, SGLang's `_send_swa_state_slice`, NHD only);
    on MLA models the types above are replicated; everything else is this rank's
    bytes, moved at equal TP only."""
    if name == "dsa" or (mla and name in _WHOLE_ON_MLA):
        return BufferShape(slicing=Slicing.WHOLE)
    if name == "swa" and not mla and swa_nhd:
        return BufferShape(slicing=Slicing.HEADS)
    return BufferShape(slicing=Slicing.RANK)


def state_blocks(state_indices) -> list[tuple[int, np.ndarray]]:
    """(state type, int64 slot ids) for each state type with indices; SGLang passes
    per type None, a list, or a list holding one numpy array (Mamba)."""
    out = []
    for c, idx in enumerate(state_indices or ()):
        if idx is None:
            continue
        arr = np.concatenate([np.asarray(x).ravel() for x in idx]) if isinstance(idx, (list, tuple)) and idx \
            else np.asarray(idx).ravel()
        if arr.size:
            out.append((c, arr.astype(np.int64)))
    return out


def request_id(room: int) -> RequestId:
    return RequestId(f"room-{int(room)}")


def room_of(rid: RequestId) -> int:
    return int(str(rid).removeprefix("room-"))
