"""The analyzer's hybridkv-vllm figure for a slot read straight into a decode rank's vLLM pages (D >= P)
is what the transport's own stager posts on those pages: vLLM 0.33's hybrid-allocator tensors,
block-outermost (BLHNC, the vLLM connector's) or, with attention kernel blocks smaller than the block,
layer-compact (LBHNC: vLLM refuses to split BLHNC pages into kernel blocks). Virtual memory, no transfer."""

from __future__ import annotations

import pytest

from hybridkv.benchmarks.staging import _vllm_layout
from hybridkv.descriptors.hma import plan_hma
from hybridkv.descriptors.planning import DescriptorPlanner
from hybridkv.descriptors.schemes import _SLOT_BASE, Scheme, Workload, count_descriptors, fragmented_blocks
from hybridkv.layout.alloc import VirtualAllocator
from hybridkv.layout.presets import get_preset
from hybridkv.transport.memory import from_layout
from hybridkv.transport.staging import StagingConfig, StagingMode
from tests.transport.peers import vllm_layout


def _stager_rows(geo, p: int, d: int, tokens: int, block: int, kernel: int | None, frag: float) -> int:
    groups = plan_hma(geo.shard(d), block).groups
    pages = 2 * sum(g.blocks_for_tokens(tokens) for g in groups) + 8
    alloc = VirtualAllocator()

    def pages_of(tp: int):
        if kernel is None:
            return _vllm_layout(geo, tp=tp, rank=0, block_size=block, pages=pages, alloc=alloc)
        return vllm_layout(geo, tp=tp, rank=0, block=block, kernel=kernel, pages=pages, allocator=alloc)

    stager = DescriptorPlanner().prepare([from_layout(pages_of(p))], from_layout(pages_of(d))).stager(0)
    blocks, at = {}, 0
    for g in groups:  # one pool for every group, as vLLM's
        blocks[g.group_id] = fragmented_blocks(g.blocks_for_tokens(tokens), frag, start=at)
        at = int(blocks[g.group_id][-1]) + 2
    return stager.read(_SLOT_BASE, 0, blocks, blocks).num_descriptors


@pytest.mark.parametrize("kernel", [None, 16])
@pytest.mark.parametrize("frag", [0.0, 1.0])
def test_direct_rows_into_vllm_pages_match_the_stager(kernel, frag):
    # qwen3.5-9b: several tensor slots per page (layer i of every group), GDN states padded to the page
    geo, tokens, p, d = get_preset("qwen3.5-9b"), 3000, 1, 2
    block = max(plan_hma(geo.shard(tp)).block_size for tp in (p, d))
    # direct_rows high: the read goes straight into the pages whatever it costs, so the count is its rows
    w = Workload(geometry=geo, tokens=tokens, block_size=block, tp_prefill=p, tp_decode=d, fragmentation=frag,
                 kernel_block_size=kernel, staging=StagingConfig(mode=StagingMode.ON, direct_rows=1 << 20))
    assert count_descriptors(Scheme.HYBRIDKV_VLLM, w).per_decode_rank == _stager_rows(geo, p, d, tokens, block,
                                                                                        kernel, frag)
