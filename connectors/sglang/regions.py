"""Adopt SGLang's transfer buffers (`KVArgs`) as a table of paged buffers.

SGLang describes what may move as pointer lists: `kv_data_ptrs` (one buffer per
layer: K then V for MHA), `state_data_ptrs` (per state component, one buffer
per (state tensor x layer); item = one slot) and `aux_data_ptrs` (CPU metadata
buffers; item = one request row). Every buffer is an array of equal items, item
`i` at `ptr + i * item_len`. This module turns those lists into one flat table,
checks it, and computes the few registration ranges that cover it: adjacent or
overlapping buffers (Mamba layers are slices of one tensor; a planned
block-major pool is one allocation) become one NIXL registration, which both
cuts registrations and lets a descriptor span neighbouring buffers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


class BufferKind(enum.Enum):
    KV = "kv"
    STATE = "state"
    AUX = "aux"


class MemKind(enum.Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True, kw_only=True)
class BufferTable:
    """Parallel int64 arrays, one row per buffer, in SGLang's list order.

    `component[i]` is the state component index for STATE rows (position in
    `KVArgs.state_types`) and -1 otherwise; `layer[i]` the global layer id or -1.
    """

    kind: tuple[BufferKind, ...]
    component: np.ndarray
    layer: np.ndarray
    ptr: np.ndarray
    data_len: np.ndarray
    item_len: np.ndarray
    mem: tuple[MemKind, ...]
    dev: np.ndarray

    @property
    def num_items(self) -> np.ndarray:
        return self.data_len // np.maximum(self.item_len, 1)

    def rows(self, kind: BufferKind, component: int = -1) -> np.ndarray:
        sel = [i for i, k in enumerate(self.kind) if k is kind]
        idx = np.asarray(sel, dtype=np.int64)
        if kind is BufferKind.STATE:
            idx = idx[self.component[idx] == component]
        return idx

    def describe(self) -> dict[str, Any]:
        """Plain, msgpack-able form sent to the peer at registration."""
        return {
            "kind": [k.value for k in self.kind],
            "component": self.component.tolist(),
            "layer": self.layer.tolist(),
            "ptr": self.ptr.tolist(),
            "data_len": self.data_len.tolist(),
            "item_len": self.item_len.tolist(),
            "mem": [m.value for m in self.mem],
            "dev": self.dev.tolist(),
        }

    @classmethod
    def from_description(cls, d: Any) -> BufferTable:
        """Inverse of :meth:`describe`, validating what a peer sent."""
        if not isinstance(d, dict):
            raise ValueError(f"buffer table is {type(d).__name__}; expected a map")
        keys = ("kind", "component", "layer", "ptr", "data_len", "item_len", "mem", "dev")
        for k in keys:
            if not isinstance(d.get(k), list):
                raise ValueError(f"buffer table field {k!r} is {d.get(k)!r}; expected a list")
        n = len(d["kind"])
        if any(len(d[k]) != n for k in keys):
            raise ValueError(f"buffer table fields have lengths {[len(d[k]) for k in keys]}; expected all {n}")
        try:
            kinds = tuple(BufferKind(v) for v in d["kind"])
            mems = tuple(MemKind(v) for v in d["mem"])
            arrays = {k: np.asarray(d[k], dtype=np.int64) for k in keys if k not in ("kind", "mem")}
        except (ValueError, TypeError, OverflowError) as e:
            raise ValueError(f"buffer table holds a bad value: {e}") from None
        table = cls(kind=kinds, mem=mems, **arrays)
        table.validate()
        return table

    def validate(self) -> None:
        if np.any(self.ptr < 0) or np.any(self.data_len < 0) or np.any(self.item_len < 0):
            raise ValueError("buffer table has a negative pointer, length or item length")
        bad = np.nonzero((self.item_len > 0) & (self.data_len % np.maximum(self.item_len, 1) != 0))[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"buffer {i} has data_len {int(self.data_len[i])} not a multiple of item_len {int(self.item_len[i])}"
            )


def _ints(values: Sequence[Any] | None, what: str) -> list[int]:
    out = []
    for v in values or ():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{what} holds {v!r}; expected ints")
        out.append(int(v))
    return out


def adopt_kv_args(kv_args: Any, *, device_mem: MemKind, gpu_id: int) -> BufferTable:
    """The buffer table of an SGLang `KVArgs` (no copy, no allocation)."""
    kinds: list[BufferKind] = []
    comp: list[int] = []
    layer: list[int] = []
    ptr: list[int] = []
    dlen: list[int] = []
    ilen: list[int] = []
    mem: list[MemKind] = []
    dev: list[int] = []

    def add(kind: BufferKind, c: int, ls: list[int], ps: list[int], ds: list[int], its: list[int], m: MemKind, d: int) -> None:
        if not len(ps) == len(ds) == len(its):
            raise ValueError(
                f"{kind.value} pointer lists disagree: {len(ps)} ptrs, {len(ds)} lens, {len(its)} item lens"
            )
        if ls and len(ls) != len(ps):
            raise ValueError(f"{kind.value} layer ids: {len(ls)} for {len(ps)} buffers")
        for i in range(len(ps)):
            kinds.append(kind)
            comp.append(c)
            layer.append(ls[i] if ls else -1)
            ptr.append(ps[i])
            dlen.append(ds[i])
            ilen.append(its[i])
            mem.append(m)
            dev.append(d)

    dev_id = gpu_id if device_mem is MemKind.VRAM else 0
    add(
        BufferKind.KV,
        -1,
        _ints(getattr(kv_args, "kv_layer_ids", None), "kv_layer_ids"),
        _ints(kv_args.kv_data_ptrs, "kv_data_ptrs"),
        _ints(kv_args.kv_data_lens, "kv_data_lens"),
        _ints(kv_args.kv_item_lens, "kv_item_lens"),
        device_mem,
        dev_id,
    )
    state_ptrs = getattr(kv_args, "state_data_ptrs", None) or []
    state_lens = getattr(kv_args, "state_data_lens", None) or []
    state_items = getattr(kv_args, "state_item_lens", None) or []
    state_layers = getattr(kv_args, "state_layer_ids", None) or []
    for c, ps in enumerate(state_ptrs):
        add(
            BufferKind.STATE,
            c,
            _ints(state_layers[c] if c < len(state_layers) else None, "state_layer_ids"),
            _ints(ps, "state_data_ptrs"),
            _ints(state_lens[c] if c < len(state_lens) else None, "state_data_lens"),
            _ints(state_items[c] if c < len(state_items) else None, "state_item_lens"),
            device_mem,
            dev_id,
        )
    add(
        BufferKind.AUX,
        -1,
        [],
        _ints(kv_args.aux_data_ptrs, "aux_data_ptrs"),
        _ints(kv_args.aux_data_lens, "aux_data_lens"),
        _ints(kv_args.aux_item_lens, "aux_item_lens"),
        MemKind.DRAM,
        0,
    )
    table = BufferTable(
        kind=tuple(kinds),
        component=np.asarray(comp, dtype=np.int64),
        layer=np.asarray(layer, dtype=np.int64),
        ptr=np.asarray(ptr, dtype=np.int64),
        data_len=np.asarray(dlen, dtype=np.int64),
        item_len=np.asarray(ilen, dtype=np.int64),
        mem=tuple(mem),
        dev=np.asarray(dev, dtype=np.int64),
    )
    table.validate()
    return table


def registration_ranges(table: BufferTable) -> dict[MemKind, np.ndarray]:
    """Per memory kind, the merged (addr, len, dev) ranges covering every buffer.

    Overlapping or touching buffers on one device become one range; empty and
    null buffers are left out (SGLang advertises zero-size ones for layers
    without a given state).
    """
    out: dict[MemKind, np.ndarray] = {}
    for m in MemKind:
        rows = [i for i, k in enumerate(table.mem) if k is m and table.data_len[i] > 0 and table.ptr[i] != 0]
        if not rows:
            continue
        r = np.asarray(rows, dtype=np.int64)
        order = np.lexsort((table.ptr[r], table.dev[r]))
        starts = table.ptr[r][order]
        ends = starts + table.data_len[r][order]
        devs = table.dev[r][order]
        merged: list[tuple[int, int, int]] = []
        cs, ce, cd = int(starts[0]), int(ends[0]), int(devs[0])
        for s, e, d in zip(starts[1:].tolist(), ends[1:].tolist(), devs[1:].tolist()):
            if d == cd and s <= ce:
                ce = max(ce, e)
            else:
                merged.append((cs, ce - cs, cd))
                cs, ce, cd = s, e, d
        merged.append((cs, ce - cs, cd))
        out[m] = np.asarray(merged, dtype=np.int64).reshape(-1, 3)
    return out
