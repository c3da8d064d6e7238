"""Staging AUTO asks a producer to pack only where staging can win (transport/import_staging.py ``flags``).

Before its Export the consumer weighs each producer's part from its own blocks (``staging.may_stage``): where
``route`` would read it sliced even with the sliced plan at its longest (every block its own run), the producer
is not asked, so it neither packs nor holds a slot for a read that goes sliced. In one process: the weighing
never skips a part route would stage, over random block lists (prefix hits included), and equals route's
choice where both sides' blocks are scattered. Between processes (real NIXL, DRAM): AUTO at costs where
staging loses never packs and the bytes still arrive; where it wins, and under ON, the producer packs.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from hybridkv import wire
from hybridkv.transport.staging import Route, StagePool, StagingConfig, StagingMode, may_stage, route
from tests.transport.hetero_peers import _counts
from tests.transport.peers import build, build_vllm

DRAM, VRAM = wire.Mem.DRAM, wire.Mem.VRAM


def test_may_stage_weighs_the_corners():
    auto = StagingConfig(mode=StagingMode.AUTO)
    args = {"own_pool": True, "mem": DRAM}
    # 7 descriptors saved are worth less than 64 KB of copying on a CPU: never asked
    assert not may_stage(auto, sliced_most=8, direct=1, direct_most=1, nbytes_least=64 << 10, **args)
    assert may_stage(auto, sliced_most=100, direct=3, direct_most=3, nbytes_least=64 << 10, **args)
    # the direct read loses at its fewest rows, but past direct_rows a read through our slot (one
    # descriptor, two copies) wins: route is not monotone across its ways, so both corners count
    cfg = StagingConfig(mode=StagingMode.AUTO, direct_rows=8)
    lose_direct = {"sliced": 12, "own_pool": True, "nbytes": 8_000, "mem": DRAM}
    assert route(cfg, direct=8, **lose_direct) is Route.SLICED and route(cfg, direct=9, **lose_direct) is Route.SLOT
    assert may_stage(cfg, sliced_most=12, direct=8, direct_most=9, nbytes_least=8_000, own_pool=True, mem=DRAM)
    assert not may_stage(cfg, sliced_most=12, direct=8, direct_most=8, nbytes_least=8_000, own_pool=True, mem=DRAM)
    assert not may_stage(None, sliced_most=100, direct=1, direct_most=1, nbytes_least=0, own_pool=True)


@functools.lru_cache(maxsize=None)
def _pair(p_tp: int, d_tp: int, kernel: int | None):
    """(consumer layout, planner for its producers, the producers' memories with a staging region)."""
    from hybridkv.descriptors.planning import DescriptorPlanner, source_ranks

    def side(seed, tp, rank):
        if kernel is None:
            return build(seed, tp=tp, rank=rank, block=48)[:2]
        return build_vllm(seed, tp=tp, rank=rank, block=48, kernel=kernel, pages=64)[:2]

    layout, memory = side(50, d_tp, 0)
    ranks, _ = source_ranks(d_tp, 0, p_tp)
    prods = [side(10 + r, p_tp, r) for r in ranks]
    planned = DescriptorPlanner().prepare(tuple(m for _, m in prods), memory)
    cfg = StagingConfig(capacity_bytes=1 << 16, slot_bytes=1 << 12)
    peers = [StagePool(m, cfg).memory for _, m in prods]
    return layout, planned, peers


def _blocks(rng, layout, tokens, *, scattered: bool, extra: int = 0) -> dict[int, np.ndarray]:
    """Per group: distinct pages of the group's pool, every other one (no neighbours) or drawn at random (some
    runs); ``extra`` more blocks in token groups (a producer's list where the consumer had a prefix hit)."""
    out = {}
    for g in layout.groups:
        n = _counts(layout, tokens)[g.group_id] + (extra if g.block_tokens else 0)
        pages = layout.regions[g.placements[0].region_id].num_pages
        b = 2 * rng.choice(pages // 2, n, replace=False) if scattered else rng.choice(pages, n, replace=False)
        out[g.group_id] = np.asarray(b, dtype=np.int64)
    return out


COSTS = [(us, gbps) for us in (0.01, 0.5, 2.0, 20.0, 500.0) for gbps in (0.01, 0.2, 1.0, 50.0)]


@pytest.mark.parametrize("p_tp,d_tp,kernel", [(2, 1, None), (2, 1, 16), (1, 2, None)])
def test_weighing_never_skips_a_part_route_would_stage(p_tp, d_tp, kernel):
    """For random block lists on both sides (the producer's longer where the consumer hit its prefix cache),
    at costs either side of staging's break-even: a producer not asked is one whose part route reads sliced
    once its Export is in; with every block its own run on both sides the weighing is route's choice."""
    from hybridkv.transport.import_staging import ImportStaging

    layout, planned, peers = _pair(p_tp, d_tp, kernel)
    rng = np.random.default_rng(p_tp * 100 + (kernel or 0))
    asked = skipped = 0
    for trial in range(12):
        tokens = int(rng.integers(1, 700))
        scattered = trial % 3 == 0
        mine = _blocks(rng, layout, tokens, scattered=scattered)
        for i, peer in enumerate(peers):
            stager = planned.stager(i)
            if stager is None:
                continue
            assert stager.same_blocks
            theirs = _blocks(rng, layout, tokens, scattered=scattered, extra=0 if scattered else int(rng.integers(3)))
            slot = peer.regions[-1]
            sliced = planned.plan(i, theirs, mine).num_descriptors
            direct = stager.read(slot.base_addr, slot.device_id, theirs, mine).num_descriptors
            for us, gbps in COSTS:
                cfg = StagingConfig(descriptor_us=us, copy_gbps=gbps)
                ask, _ = ImportStaging._weigh(cfg, own_pool=True, planned=planned, source=i, stager=stager, peer=peer,
                                              mine=mine)
                way = route(cfg, sliced=sliced, direct=direct, own_pool=True, nbytes=stager.nbytes(theirs),
                            mem=slot.mem)
                assert ask or way is Route.SLICED, (trial, i, us, gbps, sliced, direct)
                if scattered:
                    assert ask == (way is not Route.SLICED), (trial, i, us, gbps, sliced, direct)
                asked += ask
                skipped += not ask
    assert asked and skipped  # the costs fall either side


# Blocks handed out one at a time across requests (scatter): no run of neighbours, so producer rank 0's sliced
# part takes a descriptor per block, and a read of its slot through a slot of the decode rank's (direct_rows 1)
# one. At free copies and dear descriptors AUTO stages that part; at copies slower than anything it never does.
# Rank 1 feeds the decode rank its GDN state only: one descriptor, which no staged read shortens, so AUTO
# never asks it, whatever the costs (ON does).
REQUESTS = [("a1", 300), ("a2", 150)]
LOSES = {"mode": "auto", "copy_gbps": 1e-6, "direct_rows": 1}
WINS = {"mode": "auto", "copy_gbps": 1e6, "descriptor_us": 1e3, "direct_rows": 1}


@pytest.mark.slow
@pytest.mark.parametrize("staging,taken", [(LOSES, [0, 0]), (WINS, [2, 0]), ({**LOSES, "mode": "on"}, [2, 2])],
                         ids=["auto-loses", "auto-wins", "on"])
def test_a_producer_packs_only_where_staging_can_win(staging, taken):
    """P2-D1, real NIXL between processes: the decode rank's fields equal the producer ranks' (run_pair checks
    them, and every block and slot back on both sides), and a producer rank took a slot (packed) for a request
    only where AUTO can stage its part, or under ON."""
    from tests.transport import hetero_peers

    measured = hetero_peers.run_pair(2, 1, 48, 48, REQUESTS, staging=staging, scatter=True, sequential=True)
    assert [s["taken"] for s in measured["prefill_staging"]] == taken, measured["prefill_staging"]
    if staging is WINS:  # rank 0's part read from its slot in one descriptor, rank 1's sliced in one
        assert [measured[rid]["total"] for rid, _ in REQUESTS] == [2, 2], measured
