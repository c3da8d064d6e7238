"""The handshake's field tables rebuild the peer's layout exactly (through the wire)."""

from __future__ import annotations

import pytest

from hybridkv import wire
from hybridkv.layout.alloc import NumpyAllocator
from hybridkv.layout.geometry import LayerKind
from hybridkv.layout import plan_layout
from hybridkv.transport.memory import MemoryMap, from_layout, rebuild_layout
from tests.transport.peers import geometry


@pytest.mark.parametrize("tp,rank,block", [(1, 0, 16), (2, 1, 32)])
def test_layout_round_trips_through_hello(tp, rank, block):
    geo = geometry()
    layout = plan_layout(geo, block_size=block, num_blocks={LayerKind.FULL_ATTENTION: 8, LayerKind.GDN: 4},
                         allocator=NumpyAllocator(), tp=tp, rank=rank)
    mm = from_layout(layout)
    fields = {"protocol": "1"}
    hello = wire.Hello(agent="a", metadata=b"m", role=wire.Role.PRODUCER, mode=wire.Mode.PULL, compat=fields,
                       compat_hash=wire.compat_hash(fields), regions=mm.regions, groups=mm.groups, lease_s=1.0,
                       layout=mm.table)
    got = wire.decode(wire.encode(hello))
    rebuilt = rebuild_layout(MemoryMap(regions=got.regions, groups=got.groups, table=got.layout), geo)
    assert rebuilt == layout  # regions, groups, placements, every field, tp and rank


def test_rebuild_needs_tables():
    mm = from_layout(plan_layout(geometry(), block_size=16, num_blocks=4, allocator=NumpyAllocator()))
    with pytest.raises(ValueError, match="no layout field tables"):
        rebuild_layout(MemoryMap(regions=mm.regions, groups=mm.groups), None)
