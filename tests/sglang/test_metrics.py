"""The hybridkv backend's metrics in SGLang's conventions, with the real sglang==0.5.23 on CPU.

A prefill manager (child process) and a decode manager (this process), real bootstrap
server, NIXL/UCX moving the bytes. Read back two ways: SGLang's own path (the sender's
``get_transfer_metric()`` through ``SchedulerReqTimeStats.compute_and_observe_kv_transfer_metrics``,
what the prefill scheduler feeds ``sglang:kv_transfer_*``), and the ``sglang:hybridkv_*``
series in each process's Prometheus registry.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.sglang import pd_peer

pytestmark = pytest.mark.slow



def value(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = [f"{k}={v}" for k, v in labels.items()]
    total = 0.0
    for key, v in samples.items():
        head, _, rest = key.partition("{")
        if head == name and all(w in rest.rstrip("}").split(",") for w in want):
            total += v
    return total


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def decode_samples(mgr) -> dict:
    mgr.publish_metrics()
    return pd_peer.hybridkv_samples()


def test_bytes_descriptors_and_latency_of_a_room(decode, prefill):
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, _ = decode
    room = 2001
    before, st0 = prefill.call("metrics"), prefill.call("stats")
    r = pd_peer.receiver(mgr, prefill.addr, room)
    r.send_metadata(np.asarray([12, 13, 14, 15, 16, 17], dtype=np.int32), 9, [[6]])
    assert prefill.call("sender", room) == KVPoll.WaitingForInput
    prefill.call("send", (room, [5, 6, 7, 8, 20, 21], 3, 2, 3, False))
    status, reason = prefill.call("wait", (room, 30))  # Success, then clear(): SGLang's order
    assert status == KVPoll.Success, reason
    assert pd_peer.wait_poll(r, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    r.clear()
    after, st = prefill.call("metrics"), prefill.call("stats")
    sent = st["bytes"] - st0["bytes"]
    chunks = st["chunks"] - st0["chunks"]
    assert sent > 0 and chunks == 3

    # SGLang's path: the bytes the WRITEs moved (not pages x item sizes), and a latency.
    tm = prefill.call("transfer_metric", room)
    assert tm["bytes"] == sent and tm["latency_s"] > 0
    assert tm["computed"]["total_mb"] == pytest.approx(sent / 2**20)
    assert tm["computed"]["latency_ms"] == pytest.approx(tm["latency_s"] * 1e3)

    # The sglang:hybridkv_* series: one observation per chunk.
    engine = {"engine_type": "prefill"}
    assert delta(before, after, "sglang:hybridkv_num_descriptors_count", **engine) == chunks
    descriptors = st["descriptors"] - st0["descriptors"]
    assert delta(before, after, "sglang:hybridkv_num_descriptors_sum", **engine) == descriptors
    assert delta(before, after, "sglang:hybridkv_transfer_mb_sum", **engine) == pytest.approx(sent / 2**20)
    assert delta(before, after, "sglang:hybridkv_transfer_latency_ms_count", **engine) == chunks
    assert delta(before, after, "sglang:hybridkv_transfer_latency_ms_sum", **engine) > 0
    assert delta(before, after, "sglang:hybridkv_transfer_failed_total") == 0


def test_a_state_that_never_landed_counts_as_incomplete(decode, prefill):
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, pools = decode
    room = 2002
    before = decode_samples(mgr)
    r = pd_peer.receiver(mgr, prefill.addr, room)
    r.send_metadata(np.asarray([20, 21], dtype=np.int32), 11, [[1]])
    assert prefill.call("sender", room) == KVPoll.WaitingForInput
    prefill.call("send", (room, [30, 31], None, 2, 1, False))  # no Mamba state sent
    status, reason = prefill.call("wait", (room, 30))
    assert status == KVPoll.Success, reason
    assert pd_peer.wait_poll(r, {KVPoll.Failed, KVPoll.Success}) == KVPoll.Failed
    after = decode_samples(mgr)
    assert delta(before, after, "sglang:hybridkv_transfer_failed_total", engine_type="decode", kind="incomplete") == 1
    assert delta(before, after, "sglang:hybridkv_transfer_failed_total") == 1
    r.clear()
    pools.zero()


def test_stuck_write_counts_a_timeout_and_quarantined_pages_fake_nixl_handle(decode, prefill):
    """A WRITE NIXL will not abort (faked: the handle stays in progress and the abort is
    refused): a timeout failure on the prefill; the room's source blocks (prefill) and
    destination pages (decode, told STUCK) counted quarantined, then released when it ends."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, _ = decode
    room = 2003
    pbefore, dbefore = prefill.call("metrics"), decode_samples(mgr)
    prefill.call("patch", ("exports.transfer_timeout_s", 1.0))
    prefill.call("fake_stuck", False)
    try:
        r = pd_peer.receiver(mgr, prefill.addr, room)
        r.send_metadata(np.asarray([46, 47], dtype=np.int32), 12, [[4]])
        assert prefill.call("sender", room) == KVPoll.WaitingForInput
        prefill.call("send", (room, [1, 2], 3, 2, 1, False))
        status, reason = prefill.call("wait", (room, 15))
        assert status == KVPoll.Failed and "refused to abort" in reason, reason
        assert pd_peer.wait_poll(r, {KVPoll.Transferring, KVPoll.Failed, KVPoll.Success}) == KVPoll.Transferring
        pmid, dmid = prefill.call("metrics"), decode_samples(mgr)
        held_p = delta(pbefore, pmid, "sglang:hybridkv_quarantined_pages_total")
        held_d = delta(dbefore, dmid, "sglang:hybridkv_quarantined_pages_total", engine_type="decode")
        assert held_p > 0 and delta(pbefore, pmid, "sglang:hybridkv_quarantined_pages_current") == held_p
        # Decode: 2 KV pages, the Mamba slot in each of its state groups, the aux row.
        assert held_d == mgr.adopted.num_state_groups + 3
        assert delta(pbefore, pmid, "sglang:hybridkv_transfer_failed_total", kind="timeout") == 1
    finally:
        prefill.call("unstick")
    try:
        assert pd_peer.wait_poll(r, {KVPoll.Failed, KVPoll.Success}) == KVPoll.Failed
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pafter, dafter = prefill.call("metrics"), decode_samples(mgr)
            if (delta(pbefore, pafter, "sglang:hybridkv_quarantine_released_pages_total") == held_p
                    and delta(dbefore, dafter, "sglang:hybridkv_quarantine_released_pages_total") == held_d):
                break
            time.sleep(0.1)
        assert delta(pbefore, pafter, "sglang:hybridkv_quarantine_released_pages_total") == held_p
        assert delta(dbefore, dafter, "sglang:hybridkv_quarantine_released_pages_total") == held_d
        assert delta(pbefore, pafter, "sglang:hybridkv_quarantined_pages_current") == 0
        assert delta(dbefore, dafter, "sglang:hybridkv_quarantined_pages_current") == 0
        r.clear()
    finally:
        prefill.call("patch", ("exports.transfer_timeout_s", 30.0))
