"""Decode TP 2 with one rank's write held: SGLang's own DecodeTransferQueue
(decode.py) runs on each decode rank process over a real gloo group, so the
poll results of the two ranks are combined by SGLang's MIN all-reduce
(utils.poll_and_all_reduce), a combined Failed goes through SGLang's failure
handling, its hold flags through its MAX all-reduce, and held requests through
resolve_deferred_releases (MIN all-reduce of "ready"). What the queue hands
back to the allocator is recorded (release_kv_cache replaced, pd_peer.py);
metadata rows (the aux row) go back to SGLang's own allocator.

Prefill TP 2 -> decode TP 2, each prefill rank writes its decode rank. Prefill
rank 0 refuses its chunk (a source page outside its pool: nothing is posted),
so decode rank 0 reports Failed; prefill rank 1's WRITE is held (faked: a NIXL
handle that hangs, then refuses to abort, cannot be caused on one machine), so
a write into decode rank 1's pages may still land.

The first test runs with a shared secret on every rank, as deployed (the ABORT,
STUCK, DRAINED and statuses travel sealed); the second in lab mode (no secret)."""

from __future__ import annotations

import time

import pytest

from tests.sglang import pd_peer
from tests.sglang.pools import NUM_PAGES, make_pools

pytestmark = pytest.mark.slow

SRC_PAGES = [5, 6, 7, 8, 20, 21]
DST_PAGES = [12, 13, 14, 30, 31, 2]
SRC_SLOT, DST_SLOT, SRC_AUX = 3, 6, 2
WAITING_FOR_INPUT = 2


@pytest.fixture(scope="module")
def ranks():
    rs = [pd_peer.Rank() for _ in range(4)]
    yield rs
    for r in rs:
        r.close()


def _setup(ranks, secret: bool):
    p0, p1, d0, d1 = ranks
    pd_peer.use_secret(ranks, secret)
    port = pd_peer.free_port()
    p0.call("setup", ("prefill", 2, 0, port, 7, True, 2))  # hosts the bootstrap server
    for r, args in ((p1, ("prefill", 2, 1, port, 7, False, 2)),
                    (d0, ("decode", 2, 0, pd_peer.free_port(), None, False, 2)),
                    (d1, ("decode", 2, 1, pd_peer.free_port(), None, False, 2))):
        r.start("setup", args)
    for r in (p1, d0, d1):
        r.result("setup")
    gloo = pd_peer.free_port()
    for i, d in enumerate((d0, d1)):
        d.start("join_tp_group", (gloo, i, 2))
    for d in (d0, d1):
        d.result("join_tp_group", timeout=240)  # imports SGLang's decode.py
    return f"127.0.0.1:{port}"


def _step(decode):
    for d in decode:
        d.start("step")
    return [d.result("step") for d in decode]


def _reached(aux, st):
    """This request's blocks that the decode queue handed back to the allocator."""
    back = [b for b in st["free"] if b in {("page", p) for p in DST_PAGES} | {("slot", DST_SLOT)}]
    return back + ([("aux", aux)] if aux in st["free_aux"] else [])


def test_decode_tp2_held_write_on_one_rank_keeps_pages_out_of_the_free_list_fake_nixl_handle(ranks):
    p0, p1, d0, d1 = ranks
    decode = (d0, d1)
    addr = _setup(ranks, secret=True)
    room = 3001
    p1.call("patch", ("exports.transfer_timeout_s", 1.0))
    p1.call("hold_writes")
    aux = [d.call("enqueue", (room, addr, DST_PAGES, DST_SLOT)) for d in decode]
    assert aux[0] == aux[1]
    aux = aux[0]
    assert p0.call("sender", room) == WAITING_FOR_INPUT
    assert p1.call("sender", room) == WAITING_FOR_INPUT
    p0.call("send", (room, [1, NUM_PAGES + 5], SRC_SLOT, SRC_AUX, 1))  # refused: nothing posted
    p1.call("send", (room, SRC_PAGES, SRC_SLOT, SRC_AUX, 1))
    deadline = time.monotonic() + 20
    while p1.call("held") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p1.call("held") == 1, "prefill rank 1 never posted its WRITE"

    # Scheduler iterations while the write is held, past prefill rank 1's transfer
    # timeout (its abort refused: STUCK, then Failed) and then some.
    t_end = time.monotonic() + 4.0
    while time.monotonic() < t_end:
        steps = _step(decode)
        back = {rank: _reached(aux, st) for rank, st in enumerate(steps) if _reached(aux, st)}
        assert not back, (f"decode ranks handed {back} back to the allocator while prefill rank 1's "
                          "write into decode rank 1's pages may still land")
        time.sleep(0.05)
    assert [st["queued"] for st in steps] == [0, 0]  # SGLang failed the request on both ranks ...
    assert [st["held"] for st in steps] == [1, 1]  # ... and holds its blocks on both
    assert p1.call("stats", room)["stuck"] == 1

    # The held WRITE is posted for real now (the late write) and lands; prefill
    # rank 1 then says DRAINED and both ranks release, together.
    assert p1.call("release_held") == 1
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        steps = _step(decode)
        if any(st["held"] == 0 for st in steps):
            break
        time.sleep(0.05)
    assert [st["held"] for st in steps] == [0, 0]
    for st in steps:
        assert sorted(_reached(aux, st)) == sorted([("page", p) for p in DST_PAGES] + [("slot", DST_SLOT)]
                                                   + [("aux", aux)])

    # Nothing corrupted, field by field: decode rank 1's blocks hold exactly what
    # prefill rank 1 sent (the late write landed while they were held); decode
    # rank 0's, which nothing was posted to, are untouched.
    got = d1.call("named", (DST_PAGES, DST_SLOT, aux))
    want = make_pools(7, tp=2, rank=1).named(SRC_PAGES, SRC_SLOT, SRC_AUX)
    assert got.keys() == want.keys()
    bad = [k for k in want if got[k] != want[k]]
    assert not bad, f"{len(bad)} of {len(want)} fields differ, first {bad[:3]}"
    assert all(not any(b) for b in d0.call("named", (DST_PAGES, DST_SLOT, aux)).values())
    # The allocator hands the blocks to a running request, which writes them: no
    # write of the failed room comes after.
    d1.call("fill", (DST_PAGES, DST_SLOT, 3))
    before = d1.call("named", (DST_PAGES, DST_SLOT, aux))
    time.sleep(0.5)
    assert d1.call("named", (DST_PAGES, DST_SLOT, aux)) == before
    for d in decode:
        st = d.call("stats")
        assert st["requests"] == 0 and st["transfers"] == 0 and not st["fenced"] and not st["imports"]
    st = p1.call("stats", room)
    assert st["stuck"] == 0 and st["exporting"] is False and st["transfers"] == 0 and not st["fenced"]
    pd_peer.check_auth([p0, p1], decode, secret=True)


def test_decode_tp2_write_held_past_sglang_release_timeout_ends_in_hybridkv_first_fake_nixl_handle(ranks):
    """The same held write, never released: SGLang's deferred release gives up after
    SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT (3 s here) whatever the
    backend says. hybridkv's drain timeout follows it (startup.py), and its hold clock
    starts when SGLang arms the ABORT, before SGLang's own: when SGLang releases the
    blocks, hybridkv has already ended the import (nothing in flight, nothing fenced),
    so the allocator and the fence agree. With the old 300 s drain timeout SGLang
    released with the import still in flight."""
    p0, p1, d0, d1 = ranks
    decode = (d0, d1)
    timeout = 3.0
    for d in decode:
        d.call("setenv", {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(timeout)})
    try:
        addr = _setup(ranks, secret=False)
        room = 3002
        p1.call("patch", ("exports.transfer_timeout_s", 1.0))
        p1.call("hold_writes")
        aux = [d.call("enqueue", (room, addr, DST_PAGES, DST_SLOT)) for d in decode][0]
        assert p0.call("sender", room) == WAITING_FOR_INPUT and p1.call("sender", room) == WAITING_FOR_INPUT
        p0.call("send", (room, [1, NUM_PAGES + 5], SRC_SLOT, SRC_AUX, 1))  # refused: decode rank 0 fails
        p1.call("send", (room, SRC_PAGES, SRC_SLOT, SRC_AUX, 1))  # held: decode rank 1 waits for it
        deadline = time.monotonic() + 20
        while p1.call("held") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        t_held = None
        deadline = time.monotonic() + timeout + 20
        while time.monotonic() < deadline:
            steps = _step(decode)
            if t_held is None and all(st["held"] == 1 for st in steps):
                t_held = time.monotonic()
            if t_held is not None and any(st["held"] == 0 for st in steps):
                break
            time.sleep(0.05)
        assert t_held is not None, "SGLang never held the failed request"
        assert [st["held"] for st in steps] == [0, 0]
        assert time.monotonic() - t_held >= timeout - 0.5  # released at the timeout, not before
        for st in steps:
            assert sorted(_reached(aux, st)) == sorted([("page", p) for p in DST_PAGES] + [("slot", DST_SLOT)]
                                                       + [("aux", aux)])
        for d in decode:
            st = d.call("stats")  # when SGLang released: no import in flight, nothing fenced
            assert st["requests"] == 0 and st["transfers"] == 0 and not st["fenced"] and not st["imports"], st
    finally:
        for d in decode:
            d.call("setenv", {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": None})
        p1.call("release_held")  # let the prefill side end; its write lands in released pages (a timeout's risk)
    deadline = time.monotonic() + 20
    while p1.call("stats", room)["stuck"] and time.monotonic() < deadline:
        time.sleep(0.05)
    st = p1.call("stats", room)
    assert st["stuck"] == 0 and st["exporting"] is False and st["transfers"] == 0 and not st["fenced"]
