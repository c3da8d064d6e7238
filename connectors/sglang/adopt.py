"""SGLang's transfer buffers (`KVArgs`) adopted as a hybridkv `Layout`.

SGLang describes what may move as pointer lists: `kv_data_ptrs` (one buffer per
layer: K then V for MHA; item = one page of one layer), `state_data_ptrs` (per
state type, one buffer per (state tensor x layer); item = one slot) and
`aux_data_ptrs` (CPU metadata buffers; item = one request row). Each becomes a
`hybridkv.layout.Buffer` of one group (0 = KV pages, 1.. = one group per state
type, last = aux rows), keyed by its position in SGLang's lists so that the key
names the same buffer on both sides; `adopt_buffers` de-duplicates and merges
them into regions. Zero-size and null buffers (SGLang pads per-layer lists)
carry nothing and are left out on both sides by the same rule.

Each group is split into the *components* that the fencing scheduler tracks
separately (SGLang #39846: a request is complete only when all have landed):
the KV pages; for a Mamba state type its conv tensor(s) and its SSM (temporal)
tensor(s); the aux row. hybridkv's `ComponentKind` has KV / CONV / SSM, so a
non-Mamba state type and the aux row are each the single KV-kind component of
their own group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hybridkv.alloc import MemKind
from hybridkv.fence import PoolLayout, RequestId
from hybridkv.fields import Component as FieldComponent
from hybridkv.fields import FieldKey
from hybridkv.hma import GroupId
from hybridkv.layout import Buffer, Layout, adopt_buffers
from hybridkv.request_state import Component, ComponentKind

KV_GROUP = 0
_BUFFER_FIELDS = ("key", "group_id", "addr", "item_bytes", "num_items", "mem", "device_id")


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

    def field_keys(self, component: Component) -> frozenset[FieldKey]:
        for c, keys in self.components:
            if c == component:
                return frozenset((FieldComponent.OPAQUE, k, 0) for k in keys)
        raise ValueError(f"component {component} is not in this layout")

    def describe(self) -> dict[str, Any]:
        """Plain, msgpack-able form sent to the peer at registration."""
        out: dict[str, Any] = {f: [] for f in _BUFFER_FIELDS}
        for b in self.buffers:
            for f in _BUFFER_FIELDS:
                v = getattr(b, f)
                out[f].append(v.value if isinstance(v, MemKind) else int(v))
        out["num_state_groups"] = self.num_state_groups
        out["components"] = [[c.group, c.kind.value, sorted(keys)] for c, keys in self.components]
        return out


def from_description(d: Any) -> AdoptedLayout:
    """Rebuild a peer's layout from :meth:`AdoptedLayout.describe`, validating every field."""
    if not isinstance(d, dict):
        raise ValueError(f"layout description is {type(d).__name__}; expected a map")
    cols = {}
    for f in _BUFFER_FIELDS:
        v = d.get(f)
        if not isinstance(v, list):
            raise ValueError(f"layout field {f!r} is {type(v).__name__}; expected a list")
        cols[f] = v
    n = len(cols["key"])
    if any(len(v) != n for v in cols.values()):
        raise ValueError(f"layout fields have lengths {[len(v) for v in cols.values()]}; expected all {n}")
    nsg = d.get("num_state_groups")
    if not _is_int(nsg) or nsg < 0:
        raise ValueError(f"num_state_groups is {nsg!r}; expected an int >= 0")
    buffers = []
    for i in range(n):
        row = {f: cols[f][i] for f in _BUFFER_FIELDS}
        if not all(_is_int(row[f]) for f in _BUFFER_FIELDS if f != "mem"):
            raise ValueError(f"buffer {i} of the layout holds a non-int: {row}")
        try:
            mem = MemKind(row["mem"])
        except ValueError:
            raise ValueError(f"buffer {i} has memory kind {row['mem']!r}; expected DRAM or VRAM") from None
        if not 0 <= row["group_id"] <= 1 + nsg:
            raise ValueError(f"buffer {i} names group {row['group_id']}; expected 0..{1 + nsg}")
        buffers.append(Buffer(key=row["key"], group_id=GroupId(row["group_id"]), addr=row["addr"],
                              item_bytes=row["item_bytes"], num_items=row["num_items"], mem=mem,
                              device_id=row["device_id"]))
    comps = d.get("components")
    if not isinstance(comps, list):
        raise ValueError(f"layout components are {type(comps).__name__}; expected a list")
    components = []
    for entry in comps:
        if (not isinstance(entry, list) or len(entry) != 3 or not _is_int(entry[0])
                or not isinstance(entry[2], list) or not all(_is_int(k) for k in entry[2])):
            raise ValueError(f"layout component {entry!r}; expected [group, kind, [keys]]")
        try:
            kind = ComponentKind(entry[1])
        except ValueError:
            raise ValueError(f"component kind {entry[1]!r}; expected one of {[k.value for k in ComponentKind]}") from None
        components.append((Component(group=GroupId(entry[0]), kind=kind), frozenset(entry[2])))
    return _build(buffers, nsg, components)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(values: Sequence[Any] | None, what: str) -> list[int]:
    out = []
    for v in values or ():
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise ValueError(f"{what} holds {v!r}; expected ints")
        out.append(int(v))
    return out


def _build(buffers: list[Buffer], num_state_groups: int,
           components: list[tuple[Component, frozenset[int]]]) -> AdoptedLayout:
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
    return AdoptedLayout(layout=adopt_buffers(buffers), buffers=tuple(buffers), num_state_groups=num_state_groups,
                         components=tuple(comps), group_blocks=tuple(blocks))


def adopt_kv_args(kv_args: Any, *, device_mem: MemKind, gpu_id: int) -> AdoptedLayout:
    """The layout of an SGLang `KVArgs` (no copy, no allocation)."""
    buffers: list[Buffer] = []
    components: list[tuple[Component, frozenset[int]]] = []
    dev = gpu_id if device_mem is MemKind.VRAM else 0
    next_key = 0

    def add(group: int, ptrs: list[int], lens: list[int], items: list[int], mem: MemKind, d: int, what: str) -> list[int]:
        nonlocal next_key
        if not len(ptrs) == len(lens) == len(items):
            raise ValueError(f"{what} pointer lists disagree: {len(ptrs)} ptrs, {len(lens)} lens, "
                             f"{len(items)} item lens")
        keys = []
        for p, n, it in zip(ptrs, lens, items):
            key = next_key
            next_key += 1
            if p < 0 or n < 0 or it < 0:
                raise ValueError(f"{what} buffer {key}: pointer {p}, length {n}, item length {it}; expected >= 0")
            if p == 0 or n == 0 or it == 0:
                continue  # padding entry: nothing to move
            if n % it:
                raise ValueError(f"{what} buffer {key}: data_len {n} is not a multiple of item_len {it}")
            buffers.append(Buffer(key=key, group_id=GroupId(group), addr=p, item_bytes=it, num_items=n // it,
                                  mem=mem, device_id=d))
            keys.append(key)
        return keys

    kv_keys = add(KV_GROUP, _ints(kv_args.kv_data_ptrs, "kv_data_ptrs"), _ints(kv_args.kv_data_lens, "kv_data_lens"),
                  _ints(kv_args.kv_item_lens, "kv_item_lens"), device_mem, dev, "kv")
    components.append((Component(group=GroupId(KV_GROUP), kind=ComponentKind.KV), frozenset(kv_keys)))
    state_ptrs = getattr(kv_args, "state_data_ptrs", None) or []
    state_lens = getattr(kv_args, "state_data_lens", None) or []
    state_items = getattr(kv_args, "state_item_lens", None) or []
    state_layers = getattr(kv_args, "state_layer_ids", None) or []
    state_types = getattr(kv_args, "state_types", None) or []
    for c, ps in enumerate(state_ptrs):
        group = 1 + c
        ptrs = _ints(ps, "state_data_ptrs")
        first = next_key
        add(group, ptrs, _ints(state_lens[c] if c < len(state_lens) else None, "state_data_lens"),
            _ints(state_items[c] if c < len(state_items) else None, "state_item_lens"), device_mem, dev, "state")
        live = {b.key for b in buffers if b.group_id == group}
        layers = _ints(state_layers[c] if c < len(state_layers) else None, "state_layer_ids")
        kind = getattr(state_types[c], "name", str(state_types[c])) if c < len(state_types) else ""
        per_tensor = len(set(layers)) if layers and len(layers) == len(ptrs) else 0
        if kind == "MAMBA" and per_tensor and len(ptrs) % per_tensor == 0 and len(ptrs) > per_tensor:
            # SGLang's MambaPool lists its entries tensor-major x layer, conv first,
            # then temporal (SSM) and any extra per-slot tensors.
            conv = frozenset(k for k in range(first, first + per_tensor) if k in live)
            components.append((Component(group=GroupId(group), kind=ComponentKind.CONV), conv))
            components.append((Component(group=GroupId(group), kind=ComponentKind.SSM), frozenset(live) - conv))
        else:
            components.append((Component(group=GroupId(group), kind=ComponentKind.KV), frozenset(live)))
    aux_group = 1 + len(state_ptrs)
    aux_keys = add(aux_group, _ints(kv_args.aux_data_ptrs, "aux_data_ptrs"),
                   _ints(kv_args.aux_data_lens, "aux_data_lens"), _ints(kv_args.aux_item_lens, "aux_item_lens"),
                   MemKind.DRAM, 0, "aux")
    components.append((Component(group=GroupId(aux_group), kind=ComponentKind.KV), frozenset(aux_keys)))
    if not buffers:
        raise ValueError("KVArgs lists no non-empty buffer; expected KV pages at least")
    return _build(buffers, len(state_ptrs), components)


def check_peer(local: AdoptedLayout, peer: AdoptedLayout) -> None:
    """Equal attention TP: the same buffers (keys, groups, item sizes) and components on both sides."""
    mine = {b.key: (b.group_id, b.item_bytes) for b in local.buffers}
    theirs = {b.key: (b.group_id, b.item_bytes) for b in peer.buffers}
    if mine != theirs:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        k = diff[0]
        raise ValueError(
            f"buffer {k} is (group, item bytes) {mine.get(k)} here and {theirs.get(k)} on the peer "
            f"({len(diff)} buffers differ); heterogeneous TP or a different model is not supported by the "
            "hybridkv SGLang backend"
        )
    if dict(local.components) != dict(peer.components):
        raise ValueError("the peers split their buffers into different components")


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
