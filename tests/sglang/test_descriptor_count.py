"""Descriptor count of one request: what this backend posts, compiled by
hybridkv's `TransferPlanner` over the adopted layouts, against what SGLang's own
NIXL backend (0.5.23) builds for the same request, computed with its real index
helpers (`num_kv_slots`, `repeat_indices_over_layers`) and its state/aux rules
(`_send_mamba_state`: one per state tensor x layer; `send_aux`: one per aux
buffer)."""

from __future__ import annotations

import numpy as np

from hybridkv.connectors.sglang.adopt import KV_GROUP, adopt_kv_args
from hybridkv.connectors.sglang.pairing import plan_peer
from hybridkv.layout.alloc import MemKind
from sglang.srt.disaggregation.nixl.conn import num_kv_slots, repeat_indices_over_layers
from tests.sglang import pools as pd_peer


def _sides():
    src_pools, dst_pools = pd_peer.make_pools(1), pd_peer.make_pools(None)
    src_args = src_pools.kv_args()
    src = adopt_kv_args(src_args, device_mem=MemKind.DRAM, gpu_id=0)
    dst = adopt_kv_args(dst_pools.kv_args(), device_mem=MemKind.DRAM, gpu_id=0)
    # The pools own the memory the layouts point at: keep them alive with the planner.
    return src_args, src, dst, (src_pools, dst_pools)


def _plan(planners, blocks_src, blocks_dst, coalesce=True):
    """What the prefill worker posts for one chunk: one plan per component."""
    plans = [p.compile({c.group: blocks_src[c.group]}, {c.group: blocks_dst[c.group]}, coalesce=coalesce)
             for c, p in planners.items() if c.group in blocks_src]
    return sum(p.num_descriptors for p in plans), sum(p.nbytes for p in plans)


def _planners(src, dst):
    return plan_peer(src, dst).planners


def _sglang_nixl_count(args, chunks_src: list[np.ndarray]) -> int:
    slots = num_kv_slots(args.kv_data_lens, args.kv_item_lens)
    kv = sum(len(repeat_indices_over_layers(c.astype(np.int32), len(args.kv_item_lens), slots)) for c in chunks_src)
    state = sum(1 for p, n in zip(args.state_data_ptrs[0], args.state_item_lens[0]) if p and n)
    return kv + state + len(args.aux_data_ptrs)


def test_coalesced_count_beats_sglang_nixl_on_the_same_request():
    args, src, dst, _keep = _sides()
    planners = _planners(src, dst)
    pages_src = np.arange(10, 42)  # a 128-token prompt in 32 pages, allocated contiguously
    pages_dst = np.arange(3, 35)
    chunks = [(pages_src[:16], pages_dst[:16]), (pages_src[16:], pages_dst[16:])]
    ours = 0
    for i, (s, d) in enumerate(chunks):
        bs, bd = {KV_GROUP: s}, {KV_GROUP: d}
        if i == len(chunks) - 1:
            bs |= {src.state_group(0): [2], src.aux_group: [1]}
            bd |= {src.state_group(0): [5], src.aux_group: [4]}
        ours += _plan(planners, bs, bd)[0]
    theirs = _sglang_nixl_count(args, [c[0] for c in chunks])
    kv_buffers = len(args.kv_data_ptrs)
    state_buffers = len(args.state_data_ptrs[0])
    # Two chunks, each one run per KV buffer; one descriptor per state tensor x layer; one aux row.
    assert ours == 2 * kv_buffers + state_buffers + 1
    assert theirs == len(pages_src) * kv_buffers + state_buffers + 1
    assert ours < theirs


def test_fragmented_pages_cost_one_descriptor_per_run():
    args, src, dst, _keep = _sides()
    planners = _planners(src, dst)
    s = np.array([1, 2, 3, 9, 10, 30])
    d = np.array([4, 5, 6, 7, 8, 9])  # breaks where the source breaks: runs 3, 2, 1
    n, nbytes = _plan(planners, {KV_GROUP: s}, {KV_GROUP: d})
    kv_buffers = len(args.kv_data_ptrs)
    assert n == 3 * kv_buffers
    n_raw, nbytes_raw = _plan(planners, {KV_GROUP: s}, {KV_GROUP: d}, coalesce=False)
    assert n_raw == len(s) * kv_buffers == _sglang_nixl_count(args, [s]) - len(args.state_data_ptrs[0]) - 1
    assert nbytes == nbytes_raw == len(s) * sum(args.kv_item_lens)


def test_analyzer_sglang_nixl_model_matches_sglang_code_on_a_qwen35_request():
    """`hybridkv analyze`'s `sglang-nixl` count (a closed-form model) equals what
    SGLang's own helpers give for the same request: every page of every K and V
    layer buffer, plus one per (conv | temporal) x GDN layer state buffer."""
    from hybridkv.descriptors.schemes import Scheme, Workload, count_descriptors
    from hybridkv.layout.geometry import LayerKind
    from hybridkv.layout.presets import get_preset

    geom = get_preset("qwen3.5-0.8b")
    w = Workload(geometry=geom, tokens=1000)
    fa = len(geom.layer_indices(LayerKind.FULL_ATTENTION))
    gdn = len(geom.layer_indices(LayerKind.GDN))
    pages = -(-w.tokens // w.effective_block_size)
    item = 4096  # sizes do not change the count; SGLang's helpers only read the list shapes
    kv_lens, kv_items = [item * (pages + 8)] * (2 * fa), [item] * (2 * fa)
    slots = num_kv_slots(kv_lens, kv_items)
    theirs = len(repeat_indices_over_layers(np.arange(3, 3 + pages, dtype=np.int32), 2 * fa, slots))
    theirs += 2 * gdn  # state_data_ptrs: conv list, then temporal, one entry per mamba layer
    assert count_descriptors(Scheme.SGLANG_NIXL, w).descriptors == theirs


def test_analyzer_sglang_nixl_model_matches_sglang_slice_path_at_different_tp():
    """Prefill TP 1 -> decode TP 2: per (prefill rank, decode rank) pair SGLang's NIXL
    backend posts its prepped slice path (one index per token of every page per K/V layer
    buffer) plus one per q/k/v conv sub-block and one per SSM state per GDN layer."""
    from sglang.srt.disaggregation.nixl.conn import expand_page_indices_for_slice

    from hybridkv.descriptors.schemes import Scheme, Workload, count_descriptors
    from hybridkv.layout.geometry import LayerKind
    from hybridkv.layout.presets import get_preset

    geom = get_preset("qwen3.5-0.8b")
    w = Workload(geometry=geom, tokens=1000, tp_prefill=1, tp_decode=2)
    fa = len(geom.layer_indices(LayerKind.FULL_ATTENTION))
    gdn = len(geom.layer_indices(LayerKind.GDN))
    page = w.effective_block_size
    pages = -(-w.tokens // page)
    item = 4096
    slots = num_kv_slots([item * (pages + 8)] * (2 * fa), [item] * (2 * fa))
    per_pair = len(expand_page_indices_for_slice(np.arange(3, 3 + pages, dtype=np.int32), 2 * fa, slots, page))
    per_pair += (3 + 1) * gdn
    assert count_descriptors(Scheme.SGLANG_NIXL, w).descriptors == per_pair * w.reads_per_request


def test_different_tp_kv_goes_through_lists_prepped_once():
    """Prefill TP 2 -> decode TP 1 (2 KV heads: each prefill rank holds one, a decode page both): a chunk's
    KV slices are one make_prepped_xfer of index arrays into two lists prepped once per decode agent
    (sliced_lists.py), as SGLang's NIXL backend does; before, every chunk built one row per token per page
    per K/V layer buffer for initialize_xfer. Real NIXL (UCX) agents: the slices land where the rows put them."""
    import time

    from hybridkv.connectors.sglang.adopt import parallel_of
    from hybridkv.connectors.sglang.sliced_lists import sliced_kv
    from hybridkv.transport.dataplane import DataPlane, Op, XferState

    def side(seed, tp):
        pools = pd_peer.make_pools(seed, tp=tp, rank=0)
        args = pools.kv_args()
        return pools, adopt_kv_args(args, device_mem=MemKind.DRAM, gpu_id=0,
                                    parallel=parallel_of(args, attn_tp=tp, attn_rank=0))

    (src_pools, src), (dst_pools, dst) = side(7, 2), side(None, 1)
    kv = next(p for c, p in plan_peer(src, dst).planners.items() if c.group == KV_GROUP)
    s_pages, d_pages = np.array([5, 6, 7, 20]), np.array([12, 13, 30, 2])
    rows_per_chunk = kv.compile({KV_GROUP: s_pages}, {KV_GROUP: d_pages}).num_descriptors
    assert rows_per_chunk == len(s_pages) * pd_peer.PAGE_SIZE * 2 * len(pd_peer.ATTN_LAYERS)
    prefill, decode = DataPlane(src.memory), DataPlane(dst.memory)
    try:
        lists = sliced_kv(dp=prefill, agent_name=prefill.add_peer(decode.metadata(), dst.memory), planner=kv,
                          group=KV_GROUP)
        li, ri = lists.indices(s_pages, d_pages)
        assert len(li) == len(ri) == rows_per_chunk  # the same descriptors, as indices: no row built per chunk
        assert lists.listed == lists.pieces * (pd_peer.NUM_PAGES + 1) * 2  # built once, at registration
        xfer = lists.post(Op.WRITE, s_pages, d_pages)
        deadline = time.monotonic() + 30
        while (state := prefill.state(xfer)) is XferState.IN_PROGRESS and time.monotonic() < deadline:
            decode.pump()
            time.sleep(0.001)
        assert state is XferState.DONE
        prefill.release(xfer)
        lists.release()
    finally:
        prefill.close()
        decode.close()
    want = pd_peer.make_pools(7, tp=1).named(s_pages, 0, 0)
    got = dst_pools.named(d_pages, 0, 0)
    mine = [k for k in want if k[0] in ("K", "V") and k[3] == 0]  # head 0: prefill rank 0's
    assert mine and [k for k in mine if got[k] != want[k]] == []
    assert not any(any(got[k]) for k in want if k[0] in ("K", "V") and k[3] == 1)  # rank 1 writes head 1
