"""Validators for values from an untrusted peer.

Each takes a decoded msgpack value and the field's name, and returns it typed or
raises :class:`~hybridkv.wire.WireError` naming the field and what was expected
(type, range, length, distinct ids, pages inside the address space). The message
decoder (:mod:`hybridkv.wire.codec`) is built from them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from hybridkv.wire.messages import (
    FIELD_COLUMNS,
    MAX_ADDR,
    MAX_BLOCKS_PER_GROUP,
    MAX_FIELDS,
    MAX_GROUPS,
    MAX_I32,
    MAX_NAME,
    MAX_REGIONS,
    GroupBlocks,
    GroupTable,
    LayoutTable,
    Mem,
    PlacementTable,
    RegionInfo,
    WireError,
)


def _fail(what: str) -> WireError:
    return WireError(what)


def _map(v: Any, name: str, keys: frozenset[str]) -> dict:
    if not isinstance(v, dict):
        raise _fail(f"{name} is {type(v).__name__}; expected a map")
    got = frozenset(v)
    if got != keys:
        raise _fail(f"{name} has keys {sorted(map(str, got))}; expected {sorted(keys)}")
    return v


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if type(v) is not int:
        raise _fail(f"{name} is {type(v).__name__}; expected an int")
    if not lo <= v <= hi:
        raise _fail(f"{name} = {v}; expected {lo}..{hi}")
    return v


def _float(v: Any, name: str, lo: float, hi: float) -> float:
    if type(v) not in (int, float):
        raise _fail(f"{name} is {type(v).__name__}; expected a number")
    f = float(v)
    if not math.isfinite(f) or not lo <= f <= hi:
        raise _fail(f"{name} = {v!r}; expected a finite number in {lo}..{hi}")
    return f


def _str(v: Any, name: str, limit: int, *, empty: bool = False) -> str:
    if type(v) is not str:
        raise _fail(f"{name} is {type(v).__name__}; expected a string")
    if len(v) > limit or (not empty and not v):
        raise _fail(f"{name} has length {len(v)}; expected {0 if empty else 1}..{limit}")
    return v


def _bytes(v: Any, name: str, limit: int) -> bytes:
    if type(v) is not bytes:
        raise _fail(f"{name} is {type(v).__name__}; expected bytes")
    if len(v) > limit:
        raise _fail(f"{name} has {len(v)} bytes; expected at most {limit}")
    return v


def _list(v: Any, name: str, limit: int) -> list:
    if type(v) is not list:
        raise _fail(f"{name} is {type(v).__name__}; expected an array")
    if len(v) > limit:
        raise _fail(f"{name} has {len(v)} entries; expected at most {limit}")
    return v


def _enum(v: Any, name: str, cls: type[enum.IntEnum]):
    i = _int(v, name, 0, MAX_I32)
    try:
        return cls(i)
    except ValueError:
        raise _fail(f"{name} = {i}; expected one of {[int(m) for m in cls]}") from None


def _blocks_in(v: Any, name: str) -> tuple[GroupBlocks, ...]:
    out = []
    seen: set[int] = set()
    for i, entry in enumerate(_list(v, name, MAX_GROUPS)):
        e = _list(entry, f"{name}[{i}]", 2)
        if len(e) != 2:
            raise _fail(f"{name}[{i}] has {len(e)} entries; expected [group, ids]")
        group = _int(e[0], f"{name}[{i}].group", 0, MAX_GROUPS - 1)
        if group in seen:
            raise _fail(f"{name} lists group {group} twice; expected each group once")
        seen.add(group)
        raw = _bytes(e[1], f"{name}[{i}].ids", 4 * MAX_BLOCKS_PER_GROUP)
        if len(raw) % 4:
            raise _fail(f"{name}[{i}].ids has {len(raw)} bytes; expected a multiple of 4 (int32)")
        ids = np.frombuffer(raw, dtype="<i4")
        if ids.size and int(ids.min()) < 0:
            raise _fail(f"{name}[{i}].ids has negative id {int(ids.min())}; expected ids >= 0")
        if np.unique(ids).size != ids.size:
            raise _fail(f"{name}[{i}].ids repeats a block id; expected distinct ids")
        out.append(GroupBlocks(group_id=group, ids=tuple(ids.tolist())))
    return tuple(out)


def _region(v: Any, name: str) -> RegionInfo:
    e = _list(v, name, 7)
    if len(e) != 7:
        raise _fail(f"{name} has {len(e)} entries; expected 7")
    r = RegionInfo(
        region_id=_int(e[0], f"{name}.region_id", 0, MAX_REGIONS - 1),
        base_addr=_int(e[1], f"{name}.base_addr", 1, MAX_ADDR),
        stride=_int(e[2], f"{name}.stride", 1, MAX_ADDR),
        page_bytes=_int(e[3], f"{name}.page_bytes", 1, MAX_ADDR),
        num_pages=_int(e[4], f"{name}.num_pages", 1, MAX_I32),
        mem=_enum(e[5], f"{name}.mem", Mem),
        device_id=_int(e[6], f"{name}.device_id", 0, 1 << 16),
    )
    if r.num_pages > 1 and r.stride < r.page_bytes:
        raise _fail(f"{name}: stride {r.stride} < page_bytes {r.page_bytes}; expected pages not to overlap")
    if r.base_addr + r.stride * (r.num_pages - 1) + r.page_bytes - 1 > MAX_ADDR:
        raise _fail(f"{name} ends past the 64-bit address space")
    return r


def _layout_in(v: Any, regions: Mapping[int, RegionInfo], group_ids: set[int]) -> LayoutTable:
    e = _list(v, "hello.layout", 3)
    if len(e) != 3:
        raise _fail(f"hello.layout has {len(e)} entries; expected [tp, rank, groups]")
    tp = _int(e[0], "hello.layout.tp", 1, 1 << 16)
    rank = _int(e[1], "hello.layout.rank", 0, tp - 1)
    groups, seen = [], set()
    total = 0
    for i, g in enumerate(_list(e[2], "hello.layout.groups", MAX_GROUPS)):
        name = f"hello.layout.groups[{i}]"
        ge = _list(g, name, 6)
        if len(ge) != 6:
            raise _fail(f"{name} has {len(ge)} entries; expected [group, kind, block_tokens, window, layers, placements]")
        gid = _int(ge[0], f"{name}.group", 0, MAX_GROUPS - 1)
        if gid in seen or gid not in group_ids:
            raise _fail(f"{name}.group = {gid}; expected a distinct group the hello lists ({sorted(group_ids)})")
        seen.add(gid)
        raw = _bytes(ge[4], f"{name}.layers", 4 * 65536)
        if len(raw) % 4:
            raise _fail(f"{name}.layers has {len(raw)} bytes; expected int32s")
        layers = np.frombuffer(raw, dtype="<i4")
        if layers.size and int(layers.min()) < 0:
            raise _fail(f"{name}.layers has a negative layer; expected layer indices >= 0")
        placements = []
        for j, p in enumerate(_list(ge[5], f"{name}.placements", MAX_REGIONS)):
            pe = _list(p, f"{name}.placements[{j}]", 2)
            if len(pe) != 2:
                raise _fail(f"{name}.placements[{j}] has {len(pe)} entries; expected [region, fields]")
            rid = _int(pe[0], f"{name}.placements[{j}].region", 0, MAX_REGIONS - 1)
            if rid not in regions:
                raise _fail(f"{name}.placements[{j}] names region {rid} that the hello does not list")
            rows = _bytes(pe[1], f"{name}.placements[{j}].fields", 8 * FIELD_COLUMNS * MAX_FIELDS)
            if len(rows) % (8 * FIELD_COLUMNS):
                raise _fail(f"{name}.placements[{j}].fields has {len(rows)} bytes; expected rows of "
                            f"{FIELD_COLUMNS} int64")
            total += len(rows) // (8 * FIELD_COLUMNS)
            if total > MAX_FIELDS:
                raise _fail(f"hello.layout has more than {MAX_FIELDS} fields")
            a = np.frombuffer(rows, dtype="<i8").reshape(-1, FIELD_COLUMNS)
            if a.size:
                if int(a.min()) < 0:
                    raise _fail(f"{name}.placements[{j}].fields has a negative entry; expected all >= 0")
                if int(a[:, 4].min()) <= 0:
                    raise _fail(f"{name}.placements[{j}].fields has an empty field; expected nbytes > 0")
                end = int((a[:, 3] + a[:, 4]).max())
                if end > regions[rid].page_bytes:
                    raise _fail(f"{name}.placements[{j}].fields end at byte {end}, past the page "
                                f"({regions[rid].page_bytes} bytes) of region {rid}")
                tb = a[:, 5]
                if ((tb > 0) & (a[:, 4] % np.maximum(tb, 1) != 0)).any():
                    raise _fail(f"{name}.placements[{j}].fields: nbytes not a multiple of token_bytes")
            placements.append(PlacementTable(region_id=rid, rows=rows))
        groups.append(GroupTable(
            group_id=gid, kind=_int(ge[1], f"{name}.kind", 0, 255),
            block_tokens=_int(ge[2], f"{name}.block_tokens", 0, MAX_I32),
            window=_int(ge[3], f"{name}.window", 0, MAX_I32),
            layers=tuple(layers.tolist()), placements=tuple(placements)))
    return LayoutTable(tp=tp, rank=rank, groups=tuple(groups))


def _hash_bytes(v: Any) -> bytes:
    h = _bytes(v, "hello.hash", 32)
    if len(h) != 32:
        raise _fail(f"hello.hash has {len(h)} bytes; expected 32 (sha256)")
    return h


def _opt_str(v: Any, name: str) -> str | None:
    return None if v is None else _str(v, name, MAX_NAME, empty=True)


__all__: list[str] = []
