"""Layout field tables: what a peer needs to rebuild the sender's layout field by field
(heterogeneous TP, different block sizes). Sent in the hello; each type declares its
own wire form (an array of its fields, :mod:`hybridkv.wire.schema`).
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridkv.wire.fields import Blob, Int, Int32s, ListOf
from hybridkv.wire.limits import MAX_FIELDS, MAX_GROUPS, MAX_I32, MAX_LAYERS, MAX_REGIONS, MAX_TP, WireError
from hybridkv.wire.regions import GROUP_ID, REGION_ID, RegionInfo
from hybridkv.wire.schema import on_wire, record_of

FIELD_COLUMNS = 6  # component code, layer, head, offset, nbytes, token_bytes
_ROW_BYTES = 8 * FIELD_COLUMNS
_ROWS_BLOB = Blob(limit=_ROW_BYTES * MAX_FIELDS)


@dataclass(frozen=True, kw_only=True)
class FieldRows:
    """A field table: int64 rows of FIELD_COLUMNS, each field non-empty and whole tokens."""

    def encode(self, value: Any) -> bytes:
        return bytes(value)

    def decode(self, raw: Any, name: str) -> bytes:
        rows = _ROWS_BLOB.decode(raw, name)
        if len(rows) % _ROW_BYTES:
            raise WireError(f"{name} has {len(rows)} bytes; expected rows of {FIELD_COLUMNS} int64")
        a = np.frombuffer(rows, dtype="<i8").reshape(-1, FIELD_COLUMNS)
        if a.size:
            if int(a.min()) < 0:
                raise WireError(f"{name} has a negative entry; expected all >= 0")
            if int(a[:, 4].min()) <= 0:
                raise WireError(f"{name} has an empty field; expected nbytes > 0")
            tb = a[:, 5]
            if ((tb > 0) & (a[:, 4] % np.maximum(tb, 1) != 0)).any():
                raise WireError(f"{name}: nbytes not a multiple of token_bytes")
        return rows


@dataclass(frozen=True, kw_only=True)
class PlacementTable:
    """The fields inside page b of one region for one group: int64 rows of
    (component code, layer, global head, offset, nbytes, token_bytes), little-endian."""

    region_id: int = on_wire("region", REGION_ID)
    rows: bytes = on_wire("fields", FieldRows())

    def array(self) -> np.ndarray:
        return np.frombuffer(self.rows, dtype="<i8").reshape(-1, FIELD_COLUMNS)


@dataclass(frozen=True, kw_only=True)
class GroupTable:
    group_id: int = on_wire("group", GROUP_ID)
    # layer-kind code (0: opaque); the codes are the transport's (memory.py)
    kind: int = on_wire("kind", Int(lo=0, hi=255))
    block_tokens: int = on_wire("block_tokens", Int(lo=0, hi=MAX_I32))  # 0: a state group (one block holds one state)
    window: int = on_wire("window", Int(lo=0, hi=MAX_I32))  # 0: no sliding window
    layers: tuple[int, ...] = on_wire("layers", Int32s(limit=MAX_LAYERS, what="layer", distinct=False))
    placements: tuple[PlacementTable, ...] = on_wire(
        "placements", ListOf(item=record_of(PlacementTable), limit=MAX_REGIONS))


@dataclass(frozen=True, kw_only=True)
class LayoutTable:
    """What a peer needs to rebuild the sender's layout field by field (heterogeneous TP,
    different block sizes): its TP shard and every group's field tables."""

    tp: int = on_wire("tp", Int(lo=1, hi=MAX_TP))
    rank: int = on_wire("rank", Int(lo=0, hi=MAX_TP - 1))
    groups: tuple[GroupTable, ...] = on_wire(
        "groups", ListOf(item=record_of(GroupTable), limit=MAX_GROUPS, distinct="group_id"))

    def _check(self, name: str) -> None:
        if self.rank >= self.tp:
            raise WireError(f"{name}.rank = {self.rank}; expected 0..{self.tp - 1}")
        if sum(len(p.rows) // _ROW_BYTES for g in self.groups for p in g.placements) > MAX_FIELDS:
            raise WireError(f"{name} has more than {MAX_FIELDS} fields")

    def check_refs(self, regions: Mapping[int, RegionInfo], group_ids: Set[int], name: str) -> None:
        """The tables name only groups and regions the hello lists, and stay inside each region's page."""
        for i, g in enumerate(self.groups):
            gname = f"{name}.groups[{i}]"
            if g.group_id not in group_ids:
                raise WireError(f"{gname}.group = {g.group_id}; expected a group the hello lists "
                                f"({sorted(group_ids)})")
            for j, p in enumerate(g.placements):
                region = regions.get(p.region_id)
                if region is None:
                    raise WireError(f"{gname}.placements[{j}] names region {p.region_id} that the hello does not list")
                a = p.array()
                # Both columns are >= 0 and below 2**63 (FieldRows), so their uint64 sum cannot wrap;
                # an int64 sum could, and a field at offset 2**63-1 would then pass as ending early.
                end = int((a[:, 3].astype(np.uint64) + a[:, 4].astype(np.uint64)).max()) if a.size else 0
                if end > region.page_bytes:
                    raise WireError(f"{gname}.placements[{j}].fields end at byte {end}, past the page "
                                    f"({region.page_bytes} bytes) of region {p.region_id}")


__all__ = ["FIELD_COLUMNS", "FieldRows", "GroupTable", "LayoutTable", "PlacementTable"]
