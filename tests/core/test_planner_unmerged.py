"""DescriptorPlanner(coalesce=False): the engine-style baseline posts the same bytes, piece by piece."""

import numpy as np

from hybridkv.descriptors.planning import DescriptorPlanner, Pairing
from hybridkv.layout import plan_layout
from hybridkv.layout.alloc import VirtualAllocator
from hybridkv.layout.presets import get_preset
from hybridkv.transport.memory import from_layout


def test_unmerged_field_plan_moves_the_same_bytes_in_more_descriptors():
    g = get_preset("qwen3.5-0.8b")
    alloc = VirtualAllocator()
    srcs = [from_layout(plan_layout(g, block_size=64, num_blocks=16, allocator=alloc, tp=2, rank=r)) for r in (0, 1)]
    dst = from_layout(plan_layout(g, block_size=64, num_blocks=16, allocator=alloc))
    blocks = {grp.group_id: np.array([0] if grp.block_tokens is None else [1, 2, 3, 7])
              for grp in dst.layout.groups}
    merged = DescriptorPlanner(pairing=Pairing.FIELDS).prepare(srcs, dst)
    unmerged = DescriptorPlanner(pairing=Pairing.FIELDS, coalesce=False).prepare(srcs, dst)
    for source in (0, 1):
        a, b = merged.plan(source, blocks, blocks), unmerged.plan(source, blocks, blocks)
        assert a.nbytes == b.nbytes > 0
        assert b.num_descriptors > a.num_descriptors  # blocks 1..3 touch: merged, they are one run
