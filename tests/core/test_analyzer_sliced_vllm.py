"""The analyzer's hybridkv-vllm figure for a SLICED read at different TP is what the planner posts on vLLM's
pages: with attention kernel blocks smaller than the block, vLLM's layer-outermost fallback (LBHNC, pages
split into kernel blocks, as ``tests/vllm/test_hetero_tp.py`` reads them through the real connector: 88 at
TP 2 -> 1 for its 137-token request); without, the block-outermost pages the connector asks for (BLHNC).
Every (prefill rank, decode rank) read planned on virtual memory, no transfer, no process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.descriptors.hma import plan_hma
from hybridkv.descriptors.planning import DescriptorPlanner, source_ranks
from hybridkv.descriptors.schemes import Scheme, Workload, count_descriptors, fragmented_blocks
from hybridkv.layout.alloc import VirtualAllocator
from hybridkv.layout.hf_config import geometry_from_config
from hybridkv.transport.memory import from_layout
from hybridkv.transport.staging import StagingConfig, StagingMode
from tests.transport.peers import vllm_layout

ROOT = Path(__file__).resolve().parents[2]


def _geometry(model: str):
    hf = json.loads((ROOT / "tests/vllm" / model / "config.json").read_text())
    return geometry_from_config(hf, name=model)


def _planned(geo, p: int, d: int, tokens: int, block: int, kernel: int, frag: float) -> list[int]:
    """Descriptors each decode rank posts, by the tests' own LBHNC builder (tests/transport/peers.py) and the
    planner."""
    groups = plan_hma(geo.shard(d), block).groups
    pages = 2 * sum(g.blocks_for_tokens(tokens) for g in groups) + 8
    alloc = VirtualAllocator()

    def pages_of(tp: int, rank: int):
        return from_layout(vllm_layout(geo, tp=tp, rank=rank, block=block, kernel=kernel, pages=pages,
                                       allocator=alloc))

    blocks, at = {}, 0
    for g in groups:  # one pool for every group, as vLLM's
        blocks[g.group_id] = fragmented_blocks(g.blocks_for_tokens(tokens), frag, start=at)
        at = int(blocks[g.group_id][-1]) + 2
    srcs = [pages_of(p, r) for r in range(p)]
    out = []
    for rank in range(d):
        ranks, _ = source_ranks(d, rank, p)
        prepared = DescriptorPlanner().prepare([srcs[r] for r in ranks], pages_of(d, rank))
        out.append(sum(prepared.plan(i, blocks, blocks).num_descriptors for i in range(len(ranks))))
    return out


@pytest.mark.parametrize("staging", [None, StagingConfig(mode=StagingMode.OFF)], ids=["none", "off"])
@pytest.mark.parametrize("p,d,model", [(2, 1, "qwen3_next_tiny"), (1, 2, "qwen3_next_tiny"),
                                       (4, 1, "qwen3_next_tiny_kv8"), (8, 2, "qwen3_next_tiny_kv8")])
def test_sliced_read_into_lbhnc_kernel_blocks_matches_the_planner(p, d, model, staging):
    geo, tokens, kernel, frag = _geometry(model), 137, 16, 0.0
    block = max(plan_hma(geo.shard(tp)).block_size for tp in (p, d))
    assert block == 32  # the hybrid allocator's, over 16-token kernel blocks: two per block
    planned = _planned(geo, p, d, tokens, block, kernel, frag)
    w = Workload(geometry=geo, tokens=tokens, block_size=block, tp_prefill=p, tp_decode=d, fragmentation=frag,
                 kernel_block_size=kernel, staging=staging)
    got = count_descriptors(Scheme.HYBRIDKV_VLLM, w)
    assert got.descriptors == sum(planned)
    assert got.per_decode_rank == max(planned)
    # What the real connector posted for this request (tests/vllm/test_hetero_tp.py, docs/analyzer.md)
    assert got.descriptors == {(2, 1): 88, (1, 2): 88, (4, 1): 176, (8, 2): 352}[(p, d)]
