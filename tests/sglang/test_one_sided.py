"""Buffers one side has and the other has not, as SGLang's NIXL backend tolerates them: draft KV on the
decode only (MTP on decode, none on prefill) and optional metadata (aux) buffers enabled on one engine only
(SGLANG_ENABLE_DISAGG_SAMPLING_MASK, --disaggregation-enable-kv-checksum). The aux buffers are SGLang's own
`MetadataBuffers`; every rank's real (CPU) pools are adopted, the planners compiled for a request, their rows
executed with memmove, and what landed compared: every buffer both sides have lands in its own row (keyed by
role, not list position: SGLang's positional pairing would misalign the rows after the sampling mask), the
one-sided ones are left alone and named."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from hybridkv.connectors.sglang import buffer_keys
from hybridkv.connectors.sglang.adopt import KV_GROUP, adopt_kv_args, parallel_of
from hybridkv.connectors.sglang.pairing import plan_peer, prefill_sources
from hybridkv.layout.alloc import MemKind
from tests.sglang import pools as model

SRC_PAGES, DST_PAGES = np.array([5, 6, 7, 20]), np.array([12, 13, 30, 2])
SRC_SLOT, DST_SLOT, SRC_AUX, DST_AUX = 3, 6, 2, 9


def _metadata(monkeypatch, *, mask: bool, checksum: bool, seed):
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "1" if mask else "0")
    m = MetadataBuffers(model.AUX_ROWS, hidden_size=8, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4,
                        kv_checksum_enabled=checksum)
    ptrs, lens, items = m.get_buf_infos()
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for p, n in zip(ptrs, lens):
            ctypes.memmove(p, torch.randint(0, 255, (n,), generator=g, dtype=torch.uint8).data_ptr(), n)
    roles = buffer_keys.aux_roles(len(ptrs), sampling_mask=mask, kv_checksum=checksum)
    assert roles is not None and len(roles) == len(ptrs)
    return m, (ptrs, lens, items), roles


def _side(monkeypatch, seed, tp, rank, *, draft: bool, mask: bool, checksum: bool):
    import torch

    pools = model.make_pools(seed, tp=tp, rank=rank)
    args = pools.kv_args()
    extra = []
    if draft:  # the draft model's K and V (one layer), appended to SGLang's KV lists
        extra = [torch.zeros_like(pools.k[0]), torch.zeros_like(pools.v[0])]
        args.kv_data_ptrs += [t.data_ptr() for t in extra]
        args.kv_data_lens += [t.nbytes for t in extra]
        args.kv_item_lens += [t[0].nbytes * model.PAGE_SIZE for t in extra]
        args.num_draft_entries = 2
    meta, (args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens), roles = _metadata(
        monkeypatch, mask=mask, checksum=checksum, seed=seed)
    adopted = adopt_kv_args(args, device_mem=MemKind.DRAM, gpu_id=0, aux_roles=roles,
                            parallel=parallel_of(args, attn_tp=tp, attn_rank=rank))
    return dict(pools=pools, draft=extra, meta=meta, args=args, roles=roles, adopted=adopted)


def _blocks(adopted, pages, slot, aux):
    return {KV_GROUP: np.asarray(pages), adopted.state_group(0): np.array([slot]), adopted.aux_group: np.array([aux])}


@pytest.mark.parametrize("tp_p, tp_d", [(1, 1), (2, 1)])
def test_decode_only_draft_and_one_sided_aux_buffers_land_by_role(monkeypatch, tp_p, tp_d):
    """Prefill (TP 1, or TP 2 -> DP-attention decode: MTP's usual layout): no draft model, sampling mask on;
    decode: draft KV, KV checksum on. Today's code refused the pair at REGISTER."""
    prefill = [_side(monkeypatch, 7, tp_p, r, draft=False, mask=True, checksum=False) for r in range(tp_p)]
    decode = [_side(monkeypatch, None, tp_d, r, draft=True, mask=False, checksum=True) for r in range(tp_d)]
    for d, dst in enumerate(decode):
        for p in prefill_sources(tp_p, tp_d, d)[0]:
            src = prefill[p]
            plan = plan_peer(src["adopted"], dst["adopted"])
            said = "; ".join(plan.one_sided)
            for what in ("draft KV buffer 0 only on the decode", "draft KV buffer 1 only on the decode",
                         "'sampling_mask_len' only on the prefill", "'kv_checksum' only on the decode"):
                assert what in said
            sb = _blocks(src["adopted"], SRC_PAGES, SRC_SLOT, SRC_AUX)
            db = _blocks(dst["adopted"], DST_PAGES, DST_SLOT, DST_AUX)
            for comp, planner in plan.planners.items():
                if planner is not None:
                    rows = planner.compile({comp.group: sb[comp.group]}, {comp.group: db[comp.group]})
                    for (s, n, _), (t, _, _) in zip(rows.src.tolist(), rows.dst.tolist()):
                        ctypes.memmove(t, s, n)
    for d, dst in enumerate(decode):
        want = model.make_pools(7, tp=tp_d, rank=d).named(SRC_PAGES, SRC_SLOT, SRC_AUX)
        got = dst["pools"].named(DST_PAGES, DST_SLOT, DST_AUX)
        bad = [k for k in want if k != ("aux",) and got[k] != want[k]]
        assert bad == [], f"decode rank {d}: {len(bad)} KV/state fields differ, first {bad[:3]}"
        assert not any(t.any() for t in dst["draft"])  # nothing of the prefill lands in the draft KV
        src_rows = _aux_rows(prefill[0], SRC_AUX)
        dst_rows = _aux_rows(dst, DST_AUX)
        common = set(src_rows) & set(dst_rows)
        assert "bootstrap_room" in common and "output_hidden_states" in common
        assert {r: dst_rows[r] for r in common} == {r: src_rows[r] for r in common}
        assert not any(dst_rows["kv_checksum"])  # decode-only: zero, which SGLang's decode skips silently


def _aux_rows(side, row):
    ptrs, items = side["args"].aux_data_ptrs, side["args"].aux_item_lens
    return {role: ctypes.string_at(p + row * n, n) for role, p, n in zip(side["roles"], ptrs, items)}


def test_aux_roles_and_refusals(monkeypatch):
    """The roles follow SGLang's MetadataBuffers for every switch (DSA top-k inferred from the count); a count
    the catalogue does not explain pairs by position; a pair with an aux buffer one side lacks that is not
    optional is refused naming it."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    for mask in (False, True):
        for checksum in (False, True):
            for dsa in (0, 3):
                monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "1" if mask else "0")
                m = MetadataBuffers(2, hidden_size=4, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=2,
                                    output_dsa_topk_indices_dim=dsa, kv_checksum_enabled=checksum)
                bufs = dict(output_ids=m.output_ids, bootstrap_room=m.bootstrap_room, kv_checksum=m.kv_checksum,
                            sampling_mask_idx=m.output_token_sampling_mask_idx,
                            dsa_topk_indices=m.output_dsa_topk_indices, output_hidden_states=m.output_hidden_states)
                ptrs = m.get_buf_infos()[0]
                roles = buffer_keys.aux_roles(len(ptrs), sampling_mask=mask, kv_checksum=checksum)
                for role, t in bufs.items():
                    assert (role in roles) == (t is not None)
                    if t is not None:
                        assert ptrs[roles.index(role)] == t.data_ptr()
    assert buffer_keys.aux_roles(1, sampling_mask=False, kv_checksum=False) is None
    src = _side(monkeypatch, 7, 1, 0, draft=False, mask=False, checksum=False)["adopted"]
    pos = model.make_pools(None).kv_args()  # one aux buffer: keyed by position, not by role
    with pytest.raises(ValueError, match="aux buffer 'output_ids' is .* on the prefill and None on the decode"):
        plan_peer(src, adopt_kv_args(pos, device_mem=MemKind.DRAM, gpu_id=0))
