"""A prefill manager (child process) and a decode manager (this process) with
the real SGLang bootstrap server on 127.0.0.1, real CPU ServerArgs, our
backend, and NIXL/UCX moving the bytes."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.sglang import pd_peer

pytestmark = pytest.mark.slow



def _receiver(mgr, addr: str, room: int):
    from sglang.srt.disaggregation.base.conn import KVPoll

    r = pd_peer.receiver(mgr, addr, room)
    assert r.poll() == KVPoll.WaitingForInput
    return r


def _assert_clean_decode(mgr, room):
    from hybridkv.connectors.sglang.adopt import request_id

    assert room not in mgr.request_status
    assert room not in mgr.imports.rooms()
    assert room not in mgr.failure_records
    with mgr.sched_lock:
        assert not mgr.sched.has_request(request_id(room))
        assert mgr.sched.transfers_in_flight() == 0
        assert not mgr.fenced  # every block handed back is reusable again


def _assert_clean_prefill(prefill, room):
    st = prefill.call("stats", room)
    assert room not in st["inflight"] and room not in st["rooms"] and room not in st["transfer_infos"]
    assert room not in st["waiters"]
    # The fencing scheduler let go of the room: no export, no read in flight, nothing fenced.
    assert st["exporting"] is False and st["requests"] == 0 and st["transfers"] == 0 and st["fenced"] == []
    return st


SRC_PAGES = [5, 6, 7, 8, 20, 21, 9, 10, 11, 40]
DST_PAGES = [12, 13, 14, 15, 16, 17, 30, 31, 32, 2]
SRC_SLOT, DST_SLOT = 3, 6
SRC_AUX, DST_AUX = 2, 9


def test_hybrid_request_completes_and_bytes_match(decode, prefill):
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, pools = decode
    room = 1001
    r = _receiver(mgr, prefill.addr, room)
    r.send_metadata(np.asarray(DST_PAGES, dtype=np.int32), DST_AUX, [[DST_SLOT]])
    # One import per component is open in the scheduler: KV, Mamba conv, Mamba SSM, aux.
    assert sorted((c.group, c.kind.value) for c in mgr.missing_components(room)) == [
        (0, "kv"), (1, "conv"), (1, "ssm"), (2, "kv")]
    assert prefill.call("sender", room) == KVPoll.WaitingForInput
    prefill.call("send", (room, SRC_PAGES, SRC_SLOT, SRC_AUX, 3, False))
    status, reason = prefill.call("wait", (room, 30))
    assert status == KVPoll.Success, reason
    assert pd_peer.wait_poll(r, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    kv, slot, aux = prefill.call("bytes", (SRC_PAGES, SRC_SLOT, SRC_AUX))
    assert pools.page_bytes(DST_PAGES) == kv
    assert pools.slot_bytes(DST_SLOT) == slot
    assert pools.aux_bytes(DST_AUX) == aux
    # Pages and slots nobody sent to stay untouched.
    untouched = [p for p in range(pd_peer.NUM_PAGES) if p not in DST_PAGES]
    assert all(not any(b) for b in pools.page_bytes(untouched))
    assert not any(any(b) for b in pools.slot_bytes(DST_SLOT - 1))
    r.clear()
    _assert_clean_decode(mgr, room)
    st = _assert_clean_prefill(prefill, room)
    # 10 pages in 3 chunks ([5,6,7,8] [20,21,9] [10,11,40]) -> runs on both sides:
    # [5-8|12-15] [20-21|16-17] [9|30] [10-11|31-32] [40|2] = 5 runs x 4 KV buffers,
    # + 12 state tensors x 1 slot + 1 aux row.
    assert st["descriptors"] == 5 * 4 + 12 + 1
    assert st["pages"] == len(SRC_PAGES)


def test_abort_mid_transfer_keeps_pages_fenced_until_the_write_is_terminal_fake_cuda_event(decode, prefill):
    """The first chunk waits on the device (a hand-opened stand-in for SGLang's
    CUDA event) when decode aborts (SGLang #24527). The scheduler is the witness:
    the aborted request's pages, slot and aux row stay out of reuse while its
    imports are in flight, a new request handed one of those pages is refused
    before its destinations are published, neither side reports Failed while
    the chunk can still read or write, and once it drains nothing was written
    and every block is reusable."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, pools = decode
    room, reuser = 1002, 1005
    dst, slot, aux = [50, 51, 52, 53], DST_SLOT - 2, DST_AUX + 1
    r = _receiver(mgr, prefill.addr, room)
    r.send_metadata(np.asarray(dst, dtype=np.int32), aux, [[slot]])
    assert prefill.call("sender", room) == KVPoll.WaitingForInput
    prefill.call("send", (room, [1, 2, 3, 4], SRC_SLOT, SRC_AUX, 2, True))
    r.abort()  # the scheduler's AbortReq path
    held = {(0, p) for p in dst} | {(1, slot), (2, aux)}
    with mgr.sched_lock:
        assert mgr.fenced == held  # handed back by the engine, not reusable
        assert mgr.sched.transfers_in_flight() == 4  # KV, conv, SSM, aux imports still open
        assert not any(p in dst for _, p in mgr.sched.take_reusable())
    # SGLang reuses one of those pages for another request: refused, unpublished.
    r2 = _receiver(mgr, prefill.addr, reuser)
    r2.send_metadata(np.asarray([60, dst[1]], dtype=np.int32), aux + 1, [[slot + 1]])
    assert r2.poll() == KVPoll.Failed
    with pytest.raises(Exception, match="still fenced"):
        r2.failure_exception()
    t_end = time.monotonic() + 1.5
    while time.monotonic() < t_end:
        assert r.poll() == KVPoll.Transferring  # pages still reachable by a write
        assert prefill.call("poll", room) == KVPoll.Transferring  # source still being read
        assert prefill.call("stats", room)["exporting"] is True
        time.sleep(0.1)
    assert mgr.fenced == held
    # The ABORT travels to the prefill over a socket: only once the prefill has
    # it (it waits to tell decode DRAINED) does the gated chunk find its room
    # Failed and write nothing; opening the gate before would let it write.
    deadline = time.monotonic() + 20
    while room not in prefill.call("stats", room)["waiters"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert room in prefill.call("stats", room)["waiters"], "the prefill never got decode's ABORT"
    prefill.call("open_gate", room)
    assert pd_peer.wait_poll(r, {KVPoll.Failed, KVPoll.Success}) == KVPoll.Failed
    status, reason = prefill.call("wait", (room, 30))
    assert status == KVPoll.Failed and "Abort" in reason
    with pytest.raises(Exception, match="Aborted"):
        r.failure_exception()
    assert all(not any(b) for b in pools.page_bytes(dst))
    assert not any(any(b) for b in pools.slot_bytes(slot))
    _assert_clean_decode(mgr, room)
    _assert_clean_decode(mgr, reuser)
    _assert_clean_prefill(prefill, room)


def test_prefill_that_drops_the_state_fails_the_decode_request(decode, prefill):
    """Prefill writes KV and aux but no Mamba state (SGLang #23773) and reports
    Success: decode expected conv and SSM too, so it reports Failed, naming
    them, instead of running on a stale state (#39846)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, pools = decode
    room = 1006
    r = _receiver(mgr, prefill.addr, room)
    r.send_metadata(np.asarray([20, 21], dtype=np.int32), DST_AUX + 2, [[1]])
    assert prefill.call("sender", room) == KVPoll.WaitingForInput
    prefill.call("send", (room, [30, 31], None, SRC_AUX, 1, False))
    status, reason = prefill.call("wait", (room, 30))
    assert status == KVPoll.Success, reason
    assert pd_peer.wait_poll(r, {KVPoll.Failed, KVPoll.Success}) == KVPoll.Failed
    with pytest.raises(Exception, match=r"components \[conv@group1, ssm@group1\] never landed"):
        r.failure_exception()
    kv, _, aux = prefill.call("bytes", ([30, 31], SRC_SLOT, SRC_AUX))
    assert pools.page_bytes([20, 21]) == kv and pools.aux_bytes(DST_AUX + 2) == aux  # these did land
    _assert_clean_decode(mgr, room)
    _assert_clean_prefill(prefill, room)
    pools.zero()


def test_failed_transfer_fails_both_sides_with_the_reason(decode, prefill):
    """Prefill is asked to send a source page beyond its pool: its scheduler
    refuses the chunk before anything is posted; both sides end Failed, with
    the reason. Decode refuses a destination beyond its pool before publishing
    it, and the prefill side of that room fails through the ABORT."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, pools = decode
    room = 1003
    r = _receiver(mgr, prefill.addr, room)
    r.send_metadata(np.asarray([3, 4], dtype=np.int32), DST_AUX, [[DST_SLOT]])
    assert prefill.call("sender", room) == KVPoll.WaitingForInput
    before = prefill.call("stats")["handles"]
    prefill.call("send", (room, [1, pd_peer.NUM_PAGES + 5], SRC_SLOT, SRC_AUX, 1, False))
    status, reason = prefill.call("wait", (room, 30))
    assert status == KVPoll.Failed and "outside" in reason
    assert pd_peer.wait_poll(r, {KVPoll.Failed, KVPoll.Success}) == KVPoll.Failed
    with pytest.raises(Exception, match="outside"):
        r.failure_exception()
    assert prefill.call("stats")["handles"] == before  # nothing was posted
    assert not any(pools.page_bytes([3])[0])
    _assert_clean_decode(mgr, room)
    _assert_clean_prefill(prefill, room)

    room = 1007
    assert prefill.call("sender", (room, False)) == KVPoll.Bootstrapping
    r = _receiver(mgr, prefill.addr, room)
    r.send_metadata(np.asarray([3, pd_peer.NUM_PAGES + 5], dtype=np.int32), DST_AUX, [[DST_SLOT]])
    assert r.poll() == KVPoll.Failed
    with pytest.raises(Exception, match="expected a block id"):
        r.failure_exception()
    status, reason = prefill.call("wait", (room, 30))
    assert status == KVPoll.Failed and "Abort" in reason
    _assert_clean_decode(mgr, room)
    _assert_clean_prefill(prefill, room)


def test_lapsed_export_lease_fails_the_room_and_releases_its_pages(decode, prefill):
    """The prefill engine sends the first chunk and never the last: nothing renews
    the room's export lease. When it lapses, the control thread's
    `TransferScheduler.poll()` releases the source pages and the room fails on
    both sides, naming the lease, instead of waiting for SGLang's 300 s timeout."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, _ = decode
    room = 1008
    prefill.call("patch", ("sched.leases.duration_s", 1.0))
    try:
        r = _receiver(mgr, prefill.addr, room)
        r.send_metadata(np.asarray([40, 41, 42, 43], dtype=np.int32), DST_AUX, [[2]])
        assert prefill.call("sender", room) == KVPoll.WaitingForInput
        prefill.call("send", (room, [1, 2, 3, 4], SRC_SLOT, SRC_AUX, 2, False, False))  # no last chunk
        t0 = time.monotonic()
        status, reason = prefill.call("wait", (room, 15))
        assert status == KVPoll.Failed and "export lease of room 1008 lapsed" in reason, reason
        assert time.monotonic() - t0 < 10
        assert pd_peer.wait_poll(r, {KVPoll.Failed, KVPoll.Success}) == KVPoll.Failed
        with pytest.raises(Exception, match="lease"):
            r.failure_exception()
    finally:
        prefill.call("patch", ("sched.leases.duration_s", 300.0))
    _assert_clean_decode(mgr, room)
    _assert_clean_prefill(prefill, room)


def test_stuck_write_is_aborted_at_its_deadline_fake_nixl_handle(decode, prefill):
    """A WRITE that never completes (the NIXL handle is faked to stay in progress)
    is aborted when the transfer timeout passes; NIXL accepts the abort, so no byte
    can move after it: the room fails on both sides and every page is reusable."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, _ = decode
    room = 1009
    prefill.call("patch", ("exports.transfer_timeout_s", 1.0))
    prefill.call("fake_stuck", True)
    try:
        r = _receiver(mgr, prefill.addr, room)
        r.send_metadata(np.asarray([44, 45], dtype=np.int32), DST_AUX, [[3]])
        assert prefill.call("sender", room) == KVPoll.WaitingForInput
        prefill.call("send", (room, [1, 2], SRC_SLOT, SRC_AUX, 1, False))
        status, reason = prefill.call("wait", (room, 15))
        assert status == KVPoll.Failed and "still running after 1 s" in reason and "aborted" in reason, reason
        assert pd_peer.wait_poll(r, {KVPoll.Failed, KVPoll.Success}) == KVPoll.Failed
        with pytest.raises(Exception, match="aborted"):
            r.failure_exception()
    finally:
        aborts = prefill.call("unstick")
        prefill.call("patch", ("exports.transfer_timeout_s", 30.0))
    assert aborts and all(aborts)
    _assert_clean_decode(mgr, room)
    _assert_clean_prefill(prefill, room)


def test_stuck_write_nixl_will_not_abort_keeps_pages_quarantined_fake_nixl_handle(decode, prefill):
    """Same hung WRITE, but NIXL refuses the abort (the handle may still write):
    the room fails at once instead of hanging; the prefill keeps the read in
    flight (its source blocks fenced) and tells decode STUCK before the Failed
    status, so decode keeps the room's pages published and out of reuse. When
    the WRITE ends, the prefill sends DRAINED and both sides come clean."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, _ = decode
    room = 1010
    prefill.call("patch", ("exports.transfer_timeout_s", 1.0))
    prefill.call("fake_stuck", False)
    try:
        r = _receiver(mgr, prefill.addr, room)
        r.send_metadata(np.asarray([46, 47], dtype=np.int32), DST_AUX + 3, [[4]])
        assert prefill.call("sender", room) == KVPoll.WaitingForInput
        prefill.call("send", (room, [1, 2], SRC_SLOT, SRC_AUX, 1, False))
        status, reason = prefill.call("wait", (room, 15))
        assert status == KVPoll.Failed and "refused to abort" in reason, reason
        st = prefill.call("stats", room)
        assert st["stuck"] == 1 and st["transfers"] == 1 and (0, 1) in {tuple(b) for b in st["fenced"]}
        # The prefill's Failed is local; decode learns it (after STUCK, on the
        # same socket) a moment later and until then still waits for input.
        want = {KVPoll.Transferring, KVPoll.Failed, KVPoll.Success}
        assert pd_peer.wait_poll(r, want) == KVPoll.Transferring
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            assert r.poll() == KVPoll.Transferring  # a write may still land in these pages
            time.sleep(0.1)
        assert mgr.imports_in_flight(room) == 4
    finally:
        aborts = prefill.call("unstick")
    try:
        assert aborts and not any(aborts)
        assert pd_peer.wait_poll(r, {KVPoll.Failed, KVPoll.Success}) == KVPoll.Failed
        with pytest.raises(Exception, match="refused to abort"):
            r.failure_exception()
    finally:
        prefill.call("patch", ("exports.transfer_timeout_s", 30.0))
    _assert_clean_decode(mgr, room)
    _assert_clean_prefill(prefill, room)


MARK = 0x3C  # what a request the allocator handed the pages to writes into them


def _reuse_when_released_and_check_after_the_late_write(mgr, pools, r, prefill, dst, slot, hold_s=2.0):
    """SGLang's allocator, as a witness: the moment the decode side fails the room (its pages go back), a new
    request writes MARK into them. Then the held WRITE is let go (a late write) and the pages are compared
    with what the new request wrote. Returns the reason the room failed with and whether it failed while the
    write was still held."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    def reuse():
        reason = pd_peer.failure_of(r)  # SGLang's failure path (clears the receiver; the pages go back)
        pools.fill(dst, slot, MARK)
        return reason, pools.page_bytes(dst), pools.slot_bytes(slot)

    t_end = time.monotonic() + hold_s
    early = None
    while time.monotonic() < t_end:
        st = r.poll()
        if st == KVPoll.Failed:
            early = reuse()
            break
        assert st == KVPoll.Transferring, st
        assert mgr.imports_in_flight(r.bootstrap_room) == 4  # the pages stay published, out of reuse
        time.sleep(0.05)
    assert prefill.call("release_held") == 1  # the held WRITE is posted for real and lands
    if early is None:
        assert pd_peer.wait_poll(r, {KVPoll.Failed, KVPoll.Success}, timeout=20) == KVPoll.Failed
        reason, want_kv, want_slot = reuse()
    else:
        reason, want_kv, want_slot = early
    time.sleep(0.3)  # anything still to land from the old room has landed by now
    assert pools.page_bytes(dst) == want_kv and pools.slot_bytes(slot) == want_slot, (
        "the old room's late write landed in pages handed to another request")
    return reason, early is not None


def test_last_chunk_refused_while_chunk_one_is_held_keeps_the_pages_until_it_drains_fake_nixl_handle(
        decode, prefill):
    """Chunk 1's WRITE is held (faked: a NIXL handle that hangs cannot be caused on one machine) when the
    prefill refuses the last chunk (a state slot outside its pool) and reports Failed at once. Failed is not
    drained: decode keeps the room's pages until the prefill says DRAINED, after the held write landed; a
    request the pages then go to keeps its bytes."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, pools = decode
    room, src = 1011, [1, 2, 3, 4]
    dst, slot, aux = [24, 25, 26, 27], 5, DST_AUX + 4
    prefill.call("hold_writes")
    r = _receiver(mgr, prefill.addr, room)
    r.send_metadata(np.asarray(dst, dtype=np.int32), aux, [[slot]])
    assert prefill.call("sender", room) == KVPoll.WaitingForInput
    prefill.call("send", (room, src, SRC_SLOT, SRC_AUX, 2, False, False))  # chunk 1 only
    deadline = time.monotonic() + 20
    while prefill.call("held") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefill.call("held") == 1, "chunk 1's WRITE was never posted"
    prefill.call("send_tail", (room, src, pd_peer.MAMBA_SLOTS + 5, 2))  # refused: nothing posted
    deadline = time.monotonic() + 10
    while mgr.request_status.get(room) != KVPoll.Failed and time.monotonic() < deadline:
        time.sleep(0.01)  # the prefill's Failed reached decode
    reason, early = _reuse_when_released_and_check_after_the_late_write(mgr, pools, r, prefill, dst, slot)
    assert not early, "decode released the pages while chunk 1's write was held"
    assert "refused the chunk" in reason and "outside its pool" in reason, reason
    pools.zero()
    _assert_clean_decode(mgr, room)
    status, _ = prefill.call("wait", (room, 10))
    assert status == KVPoll.Failed
    _assert_clean_prefill(prefill, room)


def test_bootstrap_server_stopped_while_a_write_is_held_keeps_the_pages_until_it_drains_fake_nixl_handle(decode):
    """The prefill's bootstrap server stops (SGLang runs it in the tokenizer-manager process) while its
    scheduler rank's WRITE is held (faked NIXL handle): decode's heartbeat declares the prefill lost and
    fails the room, but the writer lives on. Decode keeps the pages until that rank answers its ABORT with
    DRAINED, after the held write landed. Its own prefill process: the stopped server ends it for later tests."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, pools = decode
    p, port = pd_peer.prefill_rank()
    try:
        addr = f"127.0.0.1:{port}"
        room, src = 1012, [1, 2, 3, 4]
        dst, slot, aux = [33, 34, 35, 36], 6, DST_AUX + 5
        p.call("hold_writes")
        r = _receiver(mgr, addr, room)
        r.send_metadata(np.asarray(dst, dtype=np.int32), aux, [[slot]])
        assert p.call("sender", room) == KVPoll.WaitingForInput
        p.call("send", (room, src, SRC_SLOT, SRC_AUX, 1))
        deadline = time.monotonic() + 20
        while p.call("held") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.call("held") == 1, "the WRITE was never posted"
        p.call("stop_server")
        deadline = time.monotonic() + 30
        while mgr.request_status.get(room) != KVPoll.Failed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mgr.request_status.get(room) == KVPoll.Failed, "the heartbeat never declared the prefill lost"
        reason, early = _reuse_when_released_and_check_after_the_late_write(mgr, pools, r, p, dst, slot)
        assert not early, "decode released the pages while the prefill rank's write was held"
        assert reason is not None  # SGLang keeps the last reason: its ABORT's echo, or the lost connection
        pools.zero()
        _assert_clean_decode(mgr, room)
    finally:
        p.close()


def test_an_abort_of_an_earlier_request_never_fails_a_later_request_of_the_same_room(decode, prefill):
    """Room ids are SGLang's to choose, and a later request may use one again. The decode's ABORT of an earlier
    request of the room reaches the prefill late, after a later request of the same room claimed it (sent here
    by hand, as the earlier receiver sent it: the earlier import's generation): the later request is not failed
    and arrives byte for byte."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import AbortNotification

    mgr, pools = decode
    room, src, dst, slot, aux = 1013, [1, 2], [56, 57], 7, 14
    r1 = _receiver(mgr, prefill.addr, room)
    r1.send_metadata(np.asarray(dst, dtype=np.int32), aux, [[slot]])
    earlier = mgr.imports.generation(room)
    assert prefill.call("sender", room) == KVPoll.WaitingForInput
    prefill.call("send", (room, src, SRC_SLOT, SRC_AUX, 1))
    assert prefill.call("wait", (room, 30))[0] == KVPoll.Success
    assert pd_peer.wait_poll(r1, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    r1.clear()
    pools.zero()

    r2 = _receiver(mgr, prefill.addr, room)
    r2.send_metadata(np.asarray(dst, dtype=np.int32), aux, [[slot]])
    assert mgr.imports.generation(room) != earlier
    assert prefill.call("sender", room) == KVPoll.WaitingForInput
    sock, lock = r2._connect_to_bootstrap_server(r2.bootstrap_infos[0])  # the socket the earlier ABORT took
    with lock:
        sock.send_multipart(AbortNotification(room=room, decode_ip=mgr.local_ip, decode_port=int(mgr.rank_port),
                                              generation=earlier).to_zmq())
    t_end = time.monotonic() + 1.0
    while time.monotonic() < t_end:
        assert prefill.call("poll", room) == KVPoll.WaitingForInput, "the earlier request's ABORT failed the room"
        time.sleep(0.05)
    prefill.call("send", (room, src, SRC_SLOT, SRC_AUX, 1))
    assert prefill.call("wait", (room, 30)) == (KVPoll.Success, None)
    assert pd_peer.wait_poll(r2, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success, pd_peer.failure_of(r2)
    assert (pools.page_bytes(dst), pools.slot_bytes(slot), pools.aux_bytes(aux)) == prefill.call(
        "bytes", (src, SRC_SLOT, SRC_AUX))
    r2.clear()
    pools.zero()
    _assert_clean_decode(mgr, room)
    _assert_clean_prefill(prefill, room)


def test_a_stalled_decode_delays_no_room_of_another_decode_fake_nixl_handle(decode, prefill):
    """Head of line: every WRITE to decode B's agent hangs (faked: a decode that stalls cannot be caused on one
    machine). Rooms of decode A (this process) on the same prefill rank, of either room parity (the prefill used
    to shard its workers by room % 2), are written and succeed while B's write still hangs; B's room succeeds
    once its write is let go. Bytes compared on both decodes."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, pools = decode
    b = pd_peer.Rank()
    stalled, rooms = 3000, [3002, 3001, 3004, 3003]
    src = [5, 6]
    prefill.call("patch", ("exports.transfer_timeout_s", 120.0))  # the hung write is not given up meanwhile
    try:
        info = b.call("setup", ("decode", 1, 0, pd_peer.free_port(), None, False))
        prefill.call("hold_writes", info["agent"])
        assert b.call("receive", (stalled, prefill.addr, [1, 2], 3, 2)) == KVPoll.WaitingForInput  # aux 3, slot 2
        assert prefill.call("sender", stalled) == KVPoll.WaitingForInput
        prefill.call("send", (stalled, src, SRC_SLOT, SRC_AUX, 1))
        deadline = time.monotonic() + 20
        while prefill.call("held") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prefill.call("held") == 1, "decode B's WRITE was never posted"
        dst = {room: ([48 + 2 * i, 49 + 2 * i], 1 + i, 10 + i) for i, room in enumerate(rooms)}
        receivers = {}
        for room, (pages, slot, aux) in dst.items():
            receivers[room] = _receiver(mgr, prefill.addr, room)
            receivers[room].send_metadata(np.asarray(pages, dtype=np.int32), aux, [[slot]])
            assert prefill.call("sender", room) == KVPoll.WaitingForInput
        t0 = time.monotonic()
        for room in rooms:
            prefill.call("send", (room, src, SRC_SLOT, SRC_AUX, 1))
        done = {}
        for room in rooms:
            status, reason = prefill.call("wait", (room, 15))
            assert status == KVPoll.Success, f"room {room} of decode A waited behind decode B's write: {reason}"
            assert pd_peer.wait_poll(receivers[room], {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
            done[room] = time.monotonic() - t0
        assert prefill.call("held") == 1  # B's write still hangs
        assert b.call("poll", stalled) in (KVPoll.WaitingForInput, KVPoll.Transferring)
        print(f"decode A's rooms done while decode B hangs, seconds after their sends: {done}")
        want = prefill.call("bytes", (src, SRC_SLOT, SRC_AUX))
        for room, (pages, slot, aux) in dst.items():
            assert (pools.page_bytes(pages), pools.slot_bytes(slot), pools.aux_bytes(aux)) == want
            receivers[room].clear()
            _assert_clean_decode(mgr, room)
        assert prefill.call("release_held") == 1
        status, reason = b.call("wait", (stalled, 30))
        assert status == KVPoll.Success, reason
        assert b.call("bytes", ([1, 2], 2, 3)) == want  # pages, slot, aux row
        assert prefill.call("wait", (stalled, 30))[0] == KVPoll.Success
        for room in [stalled, *rooms]:
            _assert_clean_prefill(prefill, room)
    finally:
        try:
            prefill.call("release_held")  # a failed assertion left the fake in place
        except RuntimeError:
            pass
        prefill.call("patch", ("exports.transfer_timeout_s", 30.0))
        pools.zero()
        b.close()


def test_killed_prefill_fails_the_decode_request_and_its_pages_wait_for_the_drain_deadline(decode, prefill):
    """The prefill process dies after decode published its destinations: the heartbeat
    declares it dead, which fails the room, but is no proof that no write is coming (the
    bootstrap server and the writers are different processes in a deployment): the imports
    stay open, the pages fenced, until the drain deadline (shortened here), then the room
    fails and the pages become reusable. Runs last: it kills the module's prefill (a fresh
    process would cost another SGLang start-up)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, _ = decode
    p = prefill
    room = 1004
    r = _receiver(mgr, p.addr, room)
    r.send_metadata(np.asarray([60, 61], dtype=np.int32), DST_AUX, [[1]])
    assert p.call("sender", room) == KVPoll.WaitingForInput
    assert mgr.imports_in_flight(room) == 4
    saved = mgr.imports.drain_timeout_s
    mgr.imports.drain_timeout_s = 3.0
    try:
        p.proc.kill()
        p.proc.join(10)
        t0 = time.monotonic()
        deadline = t0 + 30
        while mgr.request_status.get(room) != KVPoll.Failed and time.monotonic() < deadline:
            assert r.poll() in (KVPoll.WaitingForInput, KVPoll.Transferring)
            time.sleep(0.05)
        t_failed = time.monotonic()
        assert mgr.request_status.get(room) == KVPoll.Failed, "the heartbeat never declared the prefill dead"
        while time.monotonic() < t_failed + 2.0:
            assert r.poll() == KVPoll.Transferring  # failed, but a write may still come: pages held
            assert mgr.imports_in_flight(room) == 4
            time.sleep(0.1)
        assert pd_peer.wait_poll(r, {KVPoll.Failed, KVPoll.Success}, timeout=10) == KVPoll.Failed
        assert time.monotonic() - t_failed < 8
    finally:
        mgr.imports.drain_timeout_s = saved
    with pytest.raises(Exception, match="Lost connection"):
        r.failure_exception()
    _assert_clean_decode(mgr, room)
