"""The analyzer's STAGED figure at 4:1 and 8:2, where GQA replicates a KV head over prefill ranks, is what the
transport posts: per producer rank decode rank 0 reads, the producer packs what the Want's field mask names
(``DescriptorPlanner.stager(source, dest, fields)``, exports' side), decode rank 0 reads its slot as
``staging.route`` decides (import_staging's inputs: the sliced plan, the direct read, its own pool, the bytes).
Virtual memory, no transfer, no process.

It also pins why ``python -m tests.transport.hetero_peers --model qwen3.5-0.8b --pairs 4:1,8:2 --tokens 2048``
measured 4 staged descriptors where the analyzer said 12 and 8: the analyzer counts at the engine's block, which
vLLM raises until a page holds a GDN state (544 tokens: 4 blocks, a direct read of 5 rows, within
``direct_rows``); the harness runs hybridkv's own layout at 48-token blocks (43 blocks: 44 rows, read through a
slot in 1). The same planner and rule give each figure on its own block."""

from __future__ import annotations

import pytest

from hybridkv.descriptors.hma import PageOrder, vllm_layout
from hybridkv.descriptors.planning import DescriptorPlanner, source_ranks
from hybridkv.descriptors.schemes import STAGING_MEM, Scheme, Workload, count_descriptors, fragmented_blocks
from hybridkv.layout import plan_layout
from hybridkv.layout.alloc import VirtualAllocator
from hybridkv.layout.presets import get_preset
from hybridkv.transport.memory import from_layout
from hybridkv.transport.staging import Route, StagingConfig, StagingMode, route

MODEL, TOKENS = "qwen3.5-0.8b", 2048  # 2 KV heads: replicated over 4 and 8 prefill ranks


def _posted(geo, p: int, d: int, block: int, cfg: StagingConfig, *, vllm: bool) -> list[int]:
    """Descriptors each decode rank posts, staged as the transport stages: layouts at ``block``, every block
    of a request apart from the next (fragmentation 1), groups one after another where they share vLLM's pool."""
    alloc = VirtualAllocator()
    shard = geo.shard(d)
    need = {k: shard.spec_of(k).blocks_for_tokens(TOKENS, block) for k in shard.kinds()}
    pages = 2 * sum(need.values()) + 8

    def layout(tp: int, rank: int):
        if vllm:
            return vllm_layout(geo, tp=tp, rank=rank, block=block, pages=pages, allocator=alloc,
                               order=PageOrder.BLOCK_OUTERMOST)
        return plan_layout(geo, block_size=block, num_blocks=pages, allocator=alloc, tp=tp, rank=rank)

    srcs = [from_layout(layout(p, r)) for r in range(p)]
    out = []
    for rank in range(d):
        mine = layout(d, rank)
        dst = from_layout(mine)
        blocks, at = {}, 0
        for g in mine.groups:
            blocks[g.group_id] = fragmented_blocks(need[g.kind], 1.0, start=at)
            at = int(blocks[g.group_id][-1]) + 2 if vllm else 0
        ranks, _ = source_ranks(d, rank, p)
        planned = DescriptorPlanner().prepare([srcs[r] for r in ranks], dst)
        total = 0
        for i in range(len(ranks)):
            sliced = planned.plan(i, blocks, blocks).num_descriptors
            asked = planned.stager(i)  # what decode rank reads from producer i: its Want's mask
            if asked is None:
                total += sliced
                continue
            packed = DescriptorPlanner().stager(srcs[ranks[i]], dst, asked.fields)  # the producer, from the mask
            nbytes = packed.nbytes({g: b for g, b in blocks.items() if g in packed.groups})
            direct = asked.read(1 << 46, 0, blocks, blocks).num_descriptors
            way = route(cfg, sliced=sliced, direct=direct, own_pool=True, nbytes=nbytes, mem=STAGING_MEM)
            total += {Route.SLICED: sliced, Route.DIRECT: min(direct, sliced), Route.SLOT: 1}[way]
        out.append(total)
    return out


@pytest.mark.parametrize("mode", [StagingMode.ON, StagingMode.AUTO])
@pytest.mark.parametrize("p,d", [(4, 1), (8, 2)])
@pytest.mark.parametrize("scheme", [Scheme.HYBRIDKV, Scheme.HYBRIDKV_VLLM])
def test_staged_count_is_the_transports_at_the_analyzers_block(scheme, p, d, mode):
    geo, cfg = get_preset(MODEL), StagingConfig(mode=mode)
    w = Workload(geometry=geo, tokens=TOKENS, block_size=48, tp_prefill=p, tp_decode=d, fragmentation=1.0,
                 staging=cfg)
    block = w.effective_block_size
    assert block == 544  # vLLM's hybrid allocator raises 48 until a page holds a GDN state
    posted = _posted(geo, p, d, block, cfg, vllm=scheme is Scheme.HYBRIDKV_VLLM)
    got = count_descriptors(scheme, w)
    assert (got.per_decode_rank, got.descriptors) == (max(posted), sum(posted))


def test_the_harness_block_reads_through_a_slot():
    # hetero_peers' own layout at block 48 (what it runs): every read of many rows goes through a slot (1); the
    # analyzer at 544 reads the two head-holding ranks' slots directly (5 rows each). Both the transport's rule.
    geo, on = get_preset(MODEL), StagingConfig(mode=StagingMode.ON)
    assert [sum(_posted(geo, p, d, 48, on, vllm=False)) // d for p, d in [(4, 1), (8, 2)]] == [4, 4]
    assert [max(_posted(geo, p, d, 544, on, vllm=False)) for p, d in [(4, 1), (8, 2)]] == [12, 8]
    for p, d in [(4, 1), (8, 2)]:
        w = Workload(geometry=geo, tokens=TOKENS, block_size=48, tp_prefill=p, tp_decode=d, fragmentation=1.0,
                     staging=on)
        assert count_descriptors(Scheme.HYBRIDKV, w).per_decode_rank == {(4, 1): 12, (8, 2): 8}[(p, d)]
