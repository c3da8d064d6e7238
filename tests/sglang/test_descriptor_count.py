"""Descriptor count of one request: this backend's plan against what SGLang's
own NIXL backend (0.5.23) builds for the same request, computed with its real
index helpers (`num_kv_slots`, `repeat_indices_over_layers`) and its state/aux
rules (`_send_mamba_state`: one per state tensor x layer; `send_aux`: one per
aux buffer)."""

from __future__ import annotations

import numpy as np

from connectors.sglang.plan import build_plan
from connectors.sglang.regions import BufferKind, MemKind, adopt_kv_args
from sglang.srt.disaggregation.nixl.conn import num_kv_slots, repeat_indices_over_layers
from tests.sglang import pd_peer


def _tables():
    src_args = pd_peer.make_pools(1).kv_args()
    dst_args = pd_peer.make_pools(None).kv_args()
    return (src_args, adopt_kv_args(src_args, device_mem=MemKind.DRAM, gpu_id=0),
            adopt_kv_args(dst_args, device_mem=MemKind.DRAM, gpu_id=0))


def _sglang_nixl_count(args, chunks_src: list[np.ndarray]) -> int:
    slots = num_kv_slots(args.kv_data_lens, args.kv_item_lens)
    kv = sum(len(repeat_indices_over_layers(c.astype(np.int32), len(args.kv_item_lens), slots)) for c in chunks_src)
    state = sum(1 for p, n in zip(args.state_data_ptrs[0], args.state_item_lens[0]) if p and n)
    return kv + state + len(args.aux_data_ptrs)


def test_coalesced_count_beats_sglang_nixl_on_the_same_request():
    args, src, dst = _tables()
    pages_src = np.arange(10, 42)  # a 128-token prompt in 32 pages, allocated contiguously
    pages_dst = np.arange(3, 35)
    chunks = [(pages_src[:16], pages_dst[:16]), (pages_src[16:], pages_dst[16:])]
    ours = 0
    for i, (s, d) in enumerate(chunks):
        last = i == len(chunks) - 1
        plan = build_plan(src, dst, kv=(s, d), states=[(0, np.array([2]), np.array([5]))] if last else [],
                          aux=(1, 4) if last else None)
        ours += plan.num_descriptors
    theirs = _sglang_nixl_count(args, [c[0] for c in chunks])
    kv_buffers = len(src.rows(BufferKind.KV))
    state_buffers = len(src.rows(BufferKind.STATE, 0))
    # Two chunks, each one run per KV buffer; one descriptor per state tensor x layer; one aux row.
    assert ours == 2 * kv_buffers + state_buffers + 1
    assert theirs == len(pages_src) * kv_buffers + state_buffers + 1
    assert ours < theirs


def test_fragmented_pages_cost_one_descriptor_per_run():
    _, src, dst = _tables()
    s = np.array([1, 2, 3, 9, 10, 30])
    d = np.array([4, 5, 6, 7, 8, 9])  # breaks where the source breaks: runs 3, 2, 1
    plan = build_plan(src, dst, kv=(s, d))
    assert plan.num_descriptors == 3 * len(src.rows(BufferKind.KV))
    uncoalesced = build_plan(src, dst, kv=(s, d), coalesce=False)
    assert uncoalesced.num_descriptors == len(s) * len(src.rows(BufferKind.KV))
    assert plan.num_bytes == uncoalesced.num_bytes
