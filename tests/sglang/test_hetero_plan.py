"""Heterogeneous TP without processes: every rank's real (CPU) pools adopted as
SGLang's KVArgs describe them, the planners of connectors/sglang/pairing.py
compiled for a request, their rows executed with memmove, and each decode
rank's fields compared with its slice of what the prefill ranks hold. The rows
are also checked against SGLang 0.5.23's own head-slice and Mamba-slice code
(`_get_mha_head_slice_blocks`, `compute_mamba_state_slice_byte_blocks`): the
same (src, dst, len) byte ranges, so the same descriptor count."""

from __future__ import annotations

import ctypes
import functools
import types

import numpy as np
import pytest

from hybridkv.connectors.sglang.adopt import KV_GROUP, adopt_kv_args, parallel_of
from hybridkv.connectors.sglang.pairing import plan_peer, prefill_sources
from hybridkv.layout.alloc import MemKind
from hybridkv.fencing.request_state import ComponentKind
from tests.sglang import pools as model

SRC_PAGES = np.array([5, 6, 7, 20, 21, 9])
DST_PAGES = np.array([12, 13, 14, 15, 30, 2])
SRC_SLOT, DST_SLOT, SRC_AUX, DST_AUX = 3, 6, 2, 9


def _side(seed, tp, rank, kv_heads=model.KV_HEADS, draft=0):
    """`draft`: the last `draft` of SGLang's KV buffers are speculative (MTP) draft KV, as SGLang appends them."""
    pools = model.make_pools(seed, tp=tp, rank=rank, kv_heads=kv_heads)
    args = pools.kv_args()
    args.num_draft_entries = draft
    adopted = adopt_kv_args(args, device_mem=MemKind.DRAM, gpu_id=0,
                            parallel=parallel_of(args, attn_tp=tp, attn_rank=rank))
    return pools, args, adopted


def _blocks(adopted, pages, slot, aux):
    return {KV_GROUP: np.asarray(pages), adopted.state_group(0): np.array([slot]), adopted.aux_group: np.array([aux])}


def _rows(plan, src, dst):
    """Every row this prefill rank posts to this decode rank for the request, per component."""
    out = {}
    sb, db = _blocks(src, SRC_PAGES, SRC_SLOT, SRC_AUX), _blocks(dst, DST_PAGES, DST_SLOT, DST_AUX)
    for comp, planner in plan.planners.items():
        if planner is not None:
            p = planner.compile({comp.group: sb[comp.group]}, {comp.group: db[comp.group]})
            out[comp] = (p.src, p.dst)
    return out


def _run(tp_p, tp_d, kv_heads=model.KV_HEADS, draft=0):
    prefill = [_side(7, tp_p, r, kv_heads, draft) for r in range(tp_p)]
    decode = [_side(None, tp_d, r, kv_heads, draft) for r in range(tp_d)]
    written = {}
    for d, (_, _, dst) in enumerate(decode):
        for p in prefill_sources(tp_p, tp_d, d)[0]:
            plan = plan_peer(prefill[p][2], dst)
            rows = _rows(plan, prefill[p][2], dst)
            written[(p, d)] = (plan, rows)
            for src_rows, dst_rows in rows.values():
                assert (src_rows[:, 1] == dst_rows[:, 1]).all()
                for (s, n, _), (t, _, _) in zip(src_rows.tolist(), dst_rows.tolist()):
                    ctypes.memmove(t, s, n)
    return prefill, decode, written


@pytest.mark.parametrize("tp_p, tp_d", [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (2, 2)])
def test_each_decode_rank_gets_its_slice_field_by_field(tp_p, tp_d):
    """KV heads (2 in total, so TP 4 shares each head between two ranks) and GDN
    heads (4 key, 8 value) land where the decode rank keeps them; nothing else
    of its memory is touched; every field is written by exactly one prefill rank."""
    prefill, decode, written = _run(tp_p, tp_d)
    for d, (pools, _, _) in enumerate(decode):
        want = model.make_pools(7, tp=tp_d, rank=d).named(SRC_PAGES, SRC_SLOT, SRC_AUX)
        got = pools.named(DST_PAGES, DST_SLOT, DST_AUX)
        assert got.keys() == want.keys()
        bad = [k for k in want if got[k] != want[k]]
        assert not bad, f"decode rank {d}/{tp_d}: {len(bad)} fields differ, first {bad[:3]}"
        # Bytes moved into this rank equal its share of the request: no field twice.
        moved = sum(int(r[0][:, 1].sum()) for (p, dd), (_, rows) in written.items() if dd == d for r in rows.values())
        assert moved == sum(len(b) for b in want.values())
        others = [p for p in range(model.NUM_PAGES) if p not in DST_PAGES]
        assert not any(any(b) for b in pools.page_bytes(others))
        assert not any(any(b) for b in pools.slot_bytes(DST_SLOT - 1))


def test_gqa_replicas_are_read_once_and_shared_prefill_ranks_are_counted():
    """P TP4 -> D TP1 with 2 KV heads: ranks 0 and 1 hold head 0, ranks 2 and 3
    head 1. Ranks 1 and 3 write no KV (their copy is a replica), only their GDN
    heads; P TP1 -> D TP4: one prefill rank is read by four decode ranks."""
    _, _, written = _run(4, 1)
    kv = {p: plan.planners[comp] is not None for (p, _), (plan, _) in written.items()
          for comp in plan.planners if comp.group == KV_GROUP}
    assert kv == {0: True, 1: False, 2: True, 3: False}
    aux_writers = [p for (p, _), (plan, _) in written.items()
                   for comp, pl in plan.planners.items() if comp.kind is ComponentKind.KV and comp.group == 2 and pl]
    assert aux_writers == [0]  # the aux row (same on every rank) is written once
    assert prefill_sources(1, 4, 3) == ((0,), 4)
    assert prefill_sources(4, 1, 0) == ((0, 1, 2, 3), 1)
    assert prefill_sources(2, 4, 3) == ((1,), 2)


def _sglang_rows(src_args, dst_args, tp_p, tp_d, d, state=True):
    """(src, dst, len) ranges SGLang's NIXL backend writes for the same request."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.utils import compute_mamba_state_slice_byte_blocks

    src_args.swa_kv_cache_layout = "nhd"  # its head-slice helper asserts NHD pages, which ours are
    me = types.SimpleNamespace(pp_size=1, kv_args=src_args, attn_tp_size=tp_p)
    me.get_mha_kv_ptrs_with_pp = functools.partial(CommonKVManager.get_mha_kv_ptrs_with_pp, me)
    out = set()
    for s, t, n in CommonKVManager._get_mha_head_slice_blocks(
            me, src_args.kv_data_ptrs, src_args.kv_item_lens, dst_args.kv_data_ptrs, dst_args.kv_item_lens,
            SRC_PAGES.astype(np.int32), DST_PAGES.astype(np.int32), tp_d, d):
        out |= {(int(a), int(b), int(n)) for a, b in zip(s, t)}
    if state:
        i_src, i_dst = src_args.state_item_lens[0], dst_args.state_item_lens[0]
        for i, (ps, pd) in enumerate(zip(src_args.state_data_ptrs[0], dst_args.state_data_ptrs[0])):
            for so, do, n in compute_mamba_state_slice_byte_blocks(
                    src_item_len=i_src[i], dst_item_len=i_dst[i], src_dim=src_args.state_dim_per_tensor[0][i],
                    dst_dim=dst_args.state_dim_per_tensor[0][i], outer_count=1, src_attn_tp_size=tp_p,
                    dst_attn_tp_size=tp_d, dst_tp_rank_in_group=d, local_tp_rank_in_group=src_args.engine_rank,
                    conv_shard_groups=src_args.state_conv_shard_groups[0][i]):
                out.add((ps + i_src[i] * SRC_SLOT + so, pd + i_dst[i] * DST_SLOT + do, n))
    return out


@pytest.mark.parametrize("tp_p, tp_d", [(1, 2), (2, 1)])
def test_rows_equal_sglang_nixl_head_and_mamba_slices(tp_p, tp_d):
    """Per (prefill rank, decode rank): our KV and Mamba rows are exactly the byte
    ranges SGLang's code computes, one per token per page per K/V layer buffer
    (a head slice of an NHD page is strided) and one per GDN sub-block (q, k, v)
    per conv layer plus one per SSM layer; SGLang adds one per aux buffer."""
    from sglang.srt.disaggregation.nixl.conn import expand_page_indices_for_slice, num_kv_slots

    prefill, decode, written = _run(tp_p, tp_d)
    for (p, d), (plan, rows) in written.items():
        ours = set()
        count = 0
        for comp, (s, t) in rows.items():
            if comp.group == 2:
                continue  # aux: both write one row per aux buffer (SGLang: send_aux)
            ours |= {(a, b, n) for (a, n, _), (b, _, _) in zip(s.tolist(), t.tolist())}
            count += len(s)
        theirs = _sglang_rows(prefill[p][1], decode[d][1], tp_p, tp_d, d)
        assert ours == theirs and count == len(theirs)
        # The NIXL backend's prepped slice path indexes the same per-token descriptors.
        kv_rows = sum(len(s) for c, (s, _) in rows.items() if c.group == KV_GROUP)
        args = prefill[p][1]
        assert kv_rows == len(expand_page_indices_for_slice(
            SRC_PAGES.astype(np.int32), len(args.kv_data_ptrs), num_kv_slots(args.kv_data_lens, args.kv_item_lens),
            model.PAGE_SIZE))
        tokens = len(SRC_PAGES) * model.PAGE_SIZE
        assert count == tokens * 2 * len(model.ATTN_LAYERS) + (3 + 1) * len(model.GDN_LAYERS)


def test_equal_tp_still_moves_whole_items():
    """Same TP on both sides: one piece per buffer item, runs of pages merged."""
    _, _, written = _run(2, 2)
    for (p, d), (plan, rows) in written.items():
        assert p == d
        kv = [r for c, r in rows.items() if c.group == KV_GROUP][0]
        # pages [5,6,7|12,13,14] [20,21|15,30]->[20|15] [21|30] [9|2]: 4 runs x 4 K/V buffers
        assert len(kv[0]) == 4 * 2 * len(model.ATTN_LAYERS)
        assert sum(len(r[0]) for c, r in rows.items() if c.group == 1) == 2 * len(model.GDN_LAYERS)


@pytest.mark.parametrize("mutate, match", [
    (dict(kv_heads=4), r"2 KV heads in total on the prefill, 4 on the decode"),
    (dict(tp=3), r"prefill attention TP 2 and decode attention TP 3: expected one to divide the other"),
])
def test_incompatible_pairs_are_refused_naming_the_values(mutate, match):
    _, _, src = _side(7, 2, 0)
    tp = mutate.get("tp", 1)
    if tp == 3:
        pools = model.make_pools(None, tp=1)  # TP 3 does not divide the test model: fake its parallel info
        args = pools.kv_args()
        dst = adopt_kv_args(args, device_mem=MemKind.DRAM, gpu_id=0, parallel=parallel_of(args, attn_tp=3))
    else:
        _, _, dst = _side(None, 1, 0, kv_heads=mutate["kv_heads"])
    with pytest.raises(ValueError, match=match):
        plan_peer(src, dst)


@pytest.mark.parametrize("tp_p, tp_d", [(2, 1), (1, 2), (4, 2)])
def test_draft_kv_at_different_tp_is_sliced_like_kv(tp_p, tp_d):
    """MTP in the usual layout (prefill TP 2 -> decode DP attention, i.e. attention TP 1): the draft model's KV
    buffers SGLang appends to its KV lists (here the last layer's K and V, num_draft_entries = 2) are head-sliced
    like the target's and land field by field; the rows are SGLang's own head slices over every KV entry. A pair
    whose draft models differ is refused naming the counts (draft KV on one side only: test_one_sided.py)."""
    prefill, decode, written = _run(tp_p, tp_d, draft=2)
    for d, (pools, _, _) in enumerate(decode):
        want = model.make_pools(7, tp=tp_d, rank=d).named(SRC_PAGES, SRC_SLOT, SRC_AUX)
        got = pools.named(DST_PAGES, DST_SLOT, DST_AUX)
        assert [k for k in want if got[k] != want[k]] == []
    for (p, d), (plan, rows) in written.items():
        if tp_p == 4:
            continue  # one head per rank on both sides: whole pages, where SGLang writes one row per token
        kv = {(a, b, n) for c, (s, t) in rows.items() if c.group == KV_GROUP
              for (a, n, _), (b, _, _) in zip(s.tolist(), t.tolist())}
        assert kv == _sglang_rows(prefill[p][1], decode[d][1], tp_p, tp_d, d, state=False)
    _, _, src = _side(7, 2, 0, draft=2)
    _, _, dst = _side(None, 1, 0, draft=4)
    with pytest.raises(ValueError, match="2 speculative draft KV buffers on the prefill, 4 on the decode"):
        plan_peer(src, dst)
