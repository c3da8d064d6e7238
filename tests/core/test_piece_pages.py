"""``piece_rows`` (descriptors/compiler.py) gathers every piece's pages at once below a size and piece by piece
above it: both must give the staging pack and unpack the same steps, block lists of any length and order
(a consumer's prefix hit reads fewer blocks than the producer exports)."""

from __future__ import annotations

import numpy as np
import pytest

import hybridkv.descriptors.compiler as compiler
from hybridkv.descriptors.planning import DescriptorPlanner, source_ranks
from hybridkv.layout.alloc import VirtualAllocator
from hybridkv.transport.endpoint import Pairing
from hybridkv.transport.memory import from_layout
from tests.transport.hetero_peers import _model_pools, _shard_layout
from tests.transport.peers import model_geometry


def _steps(stager, sb, db, at_once: int, monkeypatch):
    monkeypatch.setattr(compiler, "_PIECE_PAGES_AT_ONCE", at_once)
    return stager.pack(sb).steps() + stager.unpack(sb, db).steps()


@pytest.mark.parametrize("p_tp,d_tp,kernel,d_scale", [(2, 1, None, 1), (2, 1, None, 2), (1, 2, None, 2),
                                                      (2, 1, 16, 1), (1, 2, 16, 1)])
def test_pieces_at_once_give_the_steps_piece_by_piece_does(p_tp, d_tp, kernel, d_scale, monkeypatch):
    """``d_scale``: the consumer's blocks hold that many of the producer's (super-pairs, the last one cut short
    where the producer's count is odd: the pieces' keep masks)."""
    rng = np.random.default_rng(p_tp * 10 + d_tp)
    g = model_geometry("qwen3.5-0.8b")
    block, pools = _model_pools(g, p_tp, d_tp, 1024, 4, kernel)
    alloc = VirtualAllocator()
    ranks, _ = source_ranks(d_tp, 0, p_tp)
    srcs = [_shard_layout(g, p_tp, r, block, alloc, **pools) for r in ranks]
    dst = _shard_layout(g, d_tp, 0, block * d_scale, alloc, **pools)
    prepared = DescriptorPlanner(pairing=Pairing.FIELDS).prepare([from_layout(x) for x in srcs], from_layout(dst))
    steps = 0
    for i in range(len(ranks)):
        stager = prepared.stager(i)
        if stager is None:
            continue
        for _ in range(4):
            sb, db = {}, {}
            for grp in dst.groups:
                pages = min(lay.regions[pl.region_id].num_pages for lay in (dst, srcs[i]) for gg in lay.groups
                            if gg.group_id == grp.group_id for pl in gg.placements)
                tokens = int(rng.integers(1, 1024))
                n_src = 1 if grp.block_tokens is None else min(pages, -(-tokens // (grp.block_tokens // d_scale)))
                n_dst = 1 if grp.block_tokens is None else min(pages, -(-tokens // grp.block_tokens))
                sb[grp.group_id] = rng.choice(pages, n_src, replace=False).astype(np.int64)
                db[grp.group_id] = rng.choice(pages, n_dst, replace=False).astype(np.int64)
            at_once = _steps(stager, sb, db, 1 << 20, monkeypatch)
            one_by_one = _steps(stager, sb, db, 0, monkeypatch)
            assert len(at_once) == len(one_by_one)
            for a, b in zip(at_once, one_by_one):
                assert (a.src, a.dst, a.length) == (b.src, b.dst, b.length)
                assert np.array_equal(a.src_pages, b.src_pages) and np.array_equal(a.dst_pages, b.dst_pages)
            steps += len(at_once)
    assert steps  # something was compared
