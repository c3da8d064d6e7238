"""Registered memory as a peer sees it: regions, the block groups over them, and
lists of a group's blocks. Each type declares its own wire form (an array of its
fields, :mod:`hybridkv.wire.schema`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.wire.enums import Mem
from hybridkv.wire.fields import Choice, Int, Int32s, ListOf
from hybridkv.wire.limits import MAX_ADDR, MAX_BLOCKS_PER_GROUP, MAX_GROUPS, MAX_I32, MAX_REGIONS, WireError
from hybridkv.wire.schema import on_wire, record_of

REGION_ID = Int(lo=0, hi=MAX_REGIONS - 1)
GROUP_ID = Int(lo=0, hi=MAX_GROUPS - 1)
ADDRESS = Int(lo=1, hi=MAX_ADDR)


@dataclass(frozen=True, kw_only=True)
class RegionInfo:
    """A registered region as the peer sees it: page p at base_addr + p*stride."""

    region_id: int = on_wire("region_id", REGION_ID)
    base_addr: int = on_wire("base_addr", ADDRESS)
    stride: int = on_wire("stride", ADDRESS)
    page_bytes: int = on_wire("page_bytes", ADDRESS)
    num_pages: int = on_wire("num_pages", Int(lo=1, hi=MAX_I32))
    mem: Mem = on_wire("mem", Choice(enum=Mem))
    device_id: int = on_wire("device_id", Int(lo=0, hi=1 << 16))

    def _check(self, name: str) -> None:
        # A peer's pages are read and written by address: they must neither overlap nor wrap around.
        if self.num_pages > 1 and self.stride < self.page_bytes:
            raise WireError(f"{name}: stride {self.stride} < page_bytes {self.page_bytes}; "
                            f"expected pages not to overlap")
        if self.base_addr + self.stride * (self.num_pages - 1) + self.page_bytes - 1 > MAX_ADDR:
            raise WireError(f"{name} ends past the 64-bit address space")


@dataclass(frozen=True, kw_only=True)
class GroupInfo:
    """Logical block b of the group is page b of each of these regions."""

    group_id: int = on_wire("group", GROUP_ID)
    region_ids: tuple[int, ...] = on_wire("regions", ListOf(item=REGION_ID, limit=MAX_REGIONS))


@dataclass(frozen=True, kw_only=True)
class GroupBlocks:
    group_id: int = on_wire("group", GROUP_ID)
    ids: tuple[int, ...] = on_wire("ids", Int32s(limit=MAX_BLOCKS_PER_GROUP, what="id", distinct=True))


REGIONS = ListOf(item=record_of(RegionInfo), limit=MAX_REGIONS, distinct="region_id")
GROUPS = ListOf(item=record_of(GroupInfo), limit=MAX_GROUPS, distinct="group_id")
BLOCKS = ListOf(item=record_of(GroupBlocks), limit=MAX_GROUPS, distinct="group_id")

__all__ = ["BLOCKS", "GROUPS", "GroupBlocks", "GroupInfo", "REGIONS", "RegionInfo"]
