"""State types other than Mamba, as SGLang 0.5.23's NIXL backend moves them
(nixl/conn.py maybe_send_extra), without processes: real (CPU) buffers added to a
rank's KVArgs with SGLang's own `append_state_component`, adopted, paired, the
plan rows executed with memmove and each decode rank's fields compared with what
the prefill ranks hold.

* SWA pages of an MHA model: head-sliced when TP differs, the byte ranges of
  SGLang's `_send_swa_state_slice` (`_get_mha_head_slice_blocks`);
* DSA index-K pages, and on an MLA model SWA, SWA ring, c128 state, block scales
  (...): the same on every rank, moved between any TP sizes, each written once;
* a type SGLang moves at equal TP only (MiniMax index K): moved whole at equal TP,
  refused at different TP with the type and the TP pair named."""

from __future__ import annotations

import ctypes
import functools
import types

import numpy as np
import pytest

from hybridkv.connectors.sglang.adopt import KV_GROUP, adopt_kv_args, parallel_of
from hybridkv.connectors.sglang.pairing import plan_peer, prefill_sources
from hybridkv.connectors.sglang.shapes import Slicing
from hybridkv.layout.alloc import MemKind
from tests.sglang import pools as model

SRC_PAGES = np.array([5, 6, 7, 20, 21, 9])
DST_PAGES = np.array([12, 13, 14, 15, 30, 2])
SRC_SLOT, DST_SLOT, SRC_AUX, DST_AUX = 3, 6, 2, 9
SWA_LAYERS = (1, 5)
INDEX_BYTES = 24  # DSA / MiniMax index K per token


def _side(seed, tp, rank, extra, mla=False):
    """A rank's pools plus one state component per name in `extra`, drawn from one global
    state (head-sharded for SWA on MHA, replicated for DSA and for any type on MLA, this
    rank's own for MiniMax). `mla`: an MLA-shaped model (one latent KV "head", the same on
    every rank)."""
    import torch
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import append_state_component

    pools = model.make_pools(seed, tp=tp, rank=rank, kv_heads=1 if mla else model.KV_HEADS)
    args = pools.kv_args()
    args.swa_kv_cache_layout = "nhd"
    g = torch.Generator().manual_seed((seed or 0) + 1)
    tokens = (model.NUM_PAGES + 1) * model.PAGE_SIZE
    keep = {}
    for name in extra:
        def draw(*shape):
            t = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
            return t if seed is not None else torch.zeros_like(t)

        if name == "swa" and not mla:
            heads = model.kv_heads_of(model.KV_HEADS, tp, rank)
            bufs = [draw(tokens, model.KV_HEADS, 2 * model.HEAD_DIM)[:, heads.start:heads.stop].contiguous()
                    for _ in range(2 * len(SWA_LAYERS))]  # K of each SWA layer, then V
            items = [b[0].nbytes * model.PAGE_SIZE for b in bufs]
        elif name == "dsa" or mla:
            bufs = [draw(tokens, INDEX_BYTES) for _ in model.ATTN_LAYERS]
            items = [b[0].nbytes * model.PAGE_SIZE for b in bufs]
        else:
            bufs = [draw(tokens, INDEX_BYTES + rank) for _ in model.ATTN_LAYERS]
            items = [b[0].nbytes * model.PAGE_SIZE for b in bufs]
        append_state_component(args, StateType(name), [b.data_ptr() for b in bufs], [b.nbytes for b in bufs], items)
        keep[name] = bufs
    adopted = adopt_kv_args(args, device_mem=MemKind.DRAM, gpu_id=0,
                            parallel=parallel_of(args, attn_tp=tp, attn_rank=rank, mla=mla))
    return types.SimpleNamespace(pools=pools, args=args, adopted=adopted, bufs=keep, extra=tuple(extra))


def _blocks(side, pages, slot, aux):
    a = side.adopted
    out = {KV_GROUP: np.asarray(pages), a.state_group(0): np.array([slot]), a.aux_group: np.array([aux])}
    for i, _ in enumerate(side.extra):
        out[a.state_group(1 + i)] = np.asarray(pages)  # SWA / index pages are paged like KV
    return out


def _run(tp_p, tp_d, extra, mla=False):
    prefill = [_side(7, tp_p, r, extra, mla) for r in range(tp_p)]
    decode = [_side(None, tp_d, r, extra, mla) for r in range(tp_d)]
    rows = {}
    for d, dst in enumerate(decode):
        for p in prefill_sources(tp_p, tp_d, d)[0]:
            plan = plan_peer(prefill[p].adopted, dst.adopted)
            sb, db = _blocks(prefill[p], SRC_PAGES, SRC_SLOT, SRC_AUX), _blocks(dst, DST_PAGES, DST_SLOT, DST_AUX)
            for comp, planner in plan.planners.items():
                if planner is None:
                    continue
                compiled = planner.compile({comp.group: sb[comp.group]}, {comp.group: db[comp.group]})
                rows[(p, d, comp.group)] = compiled
                for (s, n, _), (t, _, _) in zip(compiled.src.tolist(), compiled.dst.tolist()):
                    ctypes.memmove(t, s, n)
    return prefill, decode, rows


def _swa_fields(side, tp, rank, pages):
    """(K|V, SWA layer, global head, page#, token) -> bytes."""
    heads = model.kv_heads_of(model.KV_HEADS, tp, rank)
    out = {}
    for j, buf in enumerate(side.bufs["swa"]):
        for i, p in enumerate(pages):
            page = buf[p * model.PAGE_SIZE:(p + 1) * model.PAGE_SIZE]
            for k, h in enumerate(heads):
                out[("KV"[j // len(SWA_LAYERS)], SWA_LAYERS[j % len(SWA_LAYERS)], h, i)] = page[:, k].numpy().tobytes()
    return out


@pytest.mark.parametrize("tp_p, tp_d", [(2, 1), (1, 2), (2, 2)])
def test_swa_pages_are_head_sliced_like_kv_field_by_field(tp_p, tp_d):
    prefill, decode, rows = _run(tp_p, tp_d, ["swa"])
    assert prefill[0].adopted.shapes[min(prefill[0].adopted.components[-2][1])].slicing is Slicing.HEADS
    want = {}
    for p, side in enumerate(prefill):
        want.update(_swa_fields(side, tp_p, p, SRC_PAGES))
    for d, side in enumerate(decode):
        got = _swa_fields(side, tp_d, d, DST_PAGES)
        assert got == {k: want[k] for k in got}, f"decode rank {d}/{tp_d}: SWA fields differ"
        others = [p for p in range(model.NUM_PAGES) if p not in DST_PAGES]
        assert not any(b[p * model.PAGE_SIZE:(p + 1) * model.PAGE_SIZE].any() for b in side.bufs["swa"] for p in others)
    if tp_p != tp_d:
        for (p, d, group), plan in rows.items():
            if group != prefill[p].adopted.state_group(1):
                continue
            ours = {(a, b, n) for (a, n, _), (b, _, _) in zip(plan.src.tolist(), plan.dst.tolist())}
            assert ours == _sglang_swa_rows(prefill[p], decode[d], tp_p, tp_d, d)


def _sglang_swa_rows(src, dst, tp_p, tp_d, d):
    """The byte ranges SGLang's NIXL backend writes for SWA at different TP (`_send_swa_state_slice`)."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    me = types.SimpleNamespace(pp_size=1, kv_args=src.args, attn_tp_size=tp_p)
    me.get_mha_kv_ptrs_with_pp = functools.partial(CommonKVManager.get_mha_kv_ptrs_with_pp, me)
    out = set()
    for s, t, n in CommonKVManager._get_mha_head_slice_blocks(
            me, src.args.state_data_ptrs[1], src.args.state_item_lens[1], dst.args.state_data_ptrs[1],
            dst.args.state_item_lens[1], SRC_PAGES.astype(np.int32), DST_PAGES.astype(np.int32), tp_d, d):
        out |= {(int(a), int(b), int(n)) for a, b in zip(s, t)}
    return out


@pytest.mark.parametrize("name, mla", [("dsa", False), ("swa", True), ("swa_ring", True), ("block_scale", True),
                                       ("c128_state", True)])
@pytest.mark.parametrize("tp_p, tp_d", [(2, 1), (1, 2)])
def test_replicated_state_moves_between_any_tp_written_once(tp_p, tp_d, name, mla):
    """DSA index K (any model) and, on an MLA model, the types SGLang's NIXL backend moves
    between any TP sizes there: the same on every rank, written by one prefill rank."""
    prefill, decode, rows = _run(tp_p, tp_d, [name], mla)
    group = prefill[0].adopted.state_group(1)
    assert all(prefill[0].adopted.shapes[k].slicing is Slicing.WHOLE for k in prefill[0].adopted.components[-2][1])
    for d, side in enumerate(decode):
        for src_buf, dst_buf in zip(prefill[0].bufs[name], side.bufs[name]):
            for sp, dp in zip(SRC_PAGES, DST_PAGES):
                assert dst_buf[dp * model.PAGE_SIZE:(dp + 1) * model.PAGE_SIZE].equal(
                    src_buf[sp * model.PAGE_SIZE:(sp + 1) * model.PAGE_SIZE])
        writers = [p for (p, dd, g) in rows if dd == d and g == group]
        assert writers == [prefill_sources(tp_p, tp_d, d)[0][0]]  # one prefill rank writes it


def test_equal_tp_only_state_moves_whole_at_equal_tp_and_is_refused_naming_type_and_tp_pair():
    prefill, decode, rows = _run(2, 2, ["minimax_index_k"])
    for d, side in enumerate(decode):
        for src_buf, dst_buf in zip(prefill[d].bufs["minimax_index_k"], side.bufs["minimax_index_k"]):
            for sp, dp in zip(SRC_PAGES, DST_PAGES):
                assert dst_buf[dp * model.PAGE_SIZE:(dp + 1) * model.PAGE_SIZE].equal(
                    src_buf[sp * model.PAGE_SIZE:(sp + 1) * model.PAGE_SIZE])
    src = _side(7, 2, 0, ["minimax_index_k"]).adopted
    for tp_d in (1, 4):
        dst = _side(None, tp_d, 0, ["minimax_index_k"]).adopted
        with pytest.raises(ValueError, match=rf"prefill attention TP 2 -> decode TP {tp_d}: state type "
                                             r"'minimax_index_k' \(group 2, buffer \d+\) is moved at equal attention "
                                             r"TP only"):
            plan_peer(src, dst)
