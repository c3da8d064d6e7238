"""Heterogeneous attention TP between real processes: every prefill and decode
rank is its own process with its own NIXL (UCX) agent, real SGLang ServerArgs
for its TP size and rank, and the real bootstrap server (hosted by prefill rank
0). Each decode rank's fields are compared with its slice of the model state
the prefill ranks hold (tests/sglang/pools.py draws one global state and cuts
it as SGLang shards it); every side reaches KVPoll.Success.

The three processes are set up again for each topology (one SGLang import for
all of them: they fork from a preloaded forkserver). Every topology runs with a
shared secret on every rank, as deployed (each decode rank proves it to each
prefill rank it reads, and a prefill rank writes one room to several proven
decode ranks); decode TP above prefill TP also runs in lab mode (no secret)."""

from __future__ import annotations

import pytest

from tests.sglang import pd_peer
from tests.sglang.pools import ATTN_LAYERS, GDN_LAYERS, PAGE_SIZE, make_pools

pytestmark = pytest.mark.slow

SRC_PAGES = [5, 6, 7, 8, 20, 21, 9, 10, 11, 40]
DST_PAGES = [12, 13, 14, 15, 16, 17, 30, 31, 32, 2]
SRC_SLOT, DST_SLOT, SRC_AUX, DST_AUX = 3, 6, 2, 9
SUCCESS, FAILED = 4, 0  # KVPoll values (the plugin replaces enums; ints travel between processes)

# Rows one prefill rank posts for one decode rank whose heads it holds a part of:
# a head slice of an NHD page is one run per token, per K/V layer buffer; a GDN
# conv slot is one run per q/k/v sub-block, an SSM slot one run (SGLang's NIXL
# backend posts the same ranges: test_hetero_plan.py checks them against its code).
KV_ROWS = len(SRC_PAGES) * PAGE_SIZE * 2 * len(ATTN_LAYERS)
STATE_ROWS = (3 + 1) * len(GDN_LAYERS)


@pytest.fixture(scope="module")
def ranks():
    rs = [pd_peer.Rank() for _ in range(3)]
    yield rs
    for r in rs:
        r.close()


def _setup(ranks, layout, secret: bool = True):
    """layout: per process (role, tp, rank, kv_heads); prefill rank 0 hosts the bootstrap server."""
    pd_peer.use_secret(ranks, secret)
    port = pd_peer.free_port()
    host = next(i for i, (role, _, rank, _) in enumerate(layout) if role == "prefill" and rank == 0)
    order = [host] + [i for i in range(len(layout)) if i != host]
    for i in order:
        role, tp, rank, heads = layout[i]
        ranks[i].start("setup", (role, tp, rank, port if role == "prefill" else pd_peer.free_port(),
                                 7 if role == "prefill" else None, i == host, heads))
        if i == host:
            ranks[i].result("setup")  # the server is up before the other ranks register
    for i in order[1:]:
        ranks[i].result("setup")
    return f"127.0.0.1:{port}"


def _transfer(room, addr, prefill, decode):
    for r in decode:
        r.start("receive", (room, addr, DST_PAGES, DST_AUX, DST_SLOT))
    for r in decode:
        r.result("receive")
    for r in prefill:
        assert r.call("sender", room) == 2  # WaitingForInput: every decode rank's metadata arrived
        r.start("send", (room, SRC_PAGES, SRC_SLOT, SRC_AUX, 3))
    for r in prefill:
        r.result("send")
    return [r.call("wait", room) for r in prefill], [r.call("wait", room) for r in decode]


def _check_fields(decode, tp_d):
    for d, r in enumerate(decode):
        got = r.call("named", (DST_PAGES, DST_SLOT, DST_AUX))
        want = make_pools(7, tp=tp_d, rank=d).named(SRC_PAGES, SRC_SLOT, SRC_AUX)
        assert got.keys() == want.keys()
        bad = [k for k in want if got[k] != want[k]]
        assert not bad, f"decode rank {d}/{tp_d}: {len(bad)} of {len(want)} fields differ, first {bad[:3]}"


def _check_clean(room, prefill, decode):
    for r in prefill:
        st = r.call("stats", room)
        assert st["exporting"] is False and st["requests"] == 0 and st["transfers"] == 0 and not st["fenced"]
        assert room not in st["inflight"] and room not in st["rooms"]
    for r in decode:
        st = r.call("stats")
        assert st["requests"] == 0 and st["transfers"] == 0 and not st["fenced"] and not st["imports"]


def test_prefill_tp2_to_decode_tp1(ranks):
    """Decode rank 0 reads KV head h and GDN heads of shard h from prefill rank h;
    the aux row, the same on both, from rank 0 only."""
    p0, p1, d0 = ranks
    addr = _setup(ranks, [("prefill", 2, 0, 2), ("prefill", 2, 1, 2), ("decode", 1, 0, 2)])
    senders, receivers = _transfer(2001, addr, [p0, p1], [d0])
    assert all(s == (SUCCESS, None) for s in senders + receivers), (senders, receivers)
    _check_fields([d0], 1)
    st = [r.call("stats") for r in (p0, p1)]
    assert [s["descriptors"] for s in st] == [KV_ROWS + STATE_ROWS + 1, KV_ROWS + STATE_ROWS]
    # The KV slices go as indices into lists prepped once per decode agent (sliced_lists.py): no KV row is
    # built per chunk (before: KV_ROWS rows per request, rebuilt by initialize_xfer chunk by chunk).
    assert [s["prepped_descriptors"] for s in st] == [KV_ROWS, KV_ROWS]
    assert [s["row_descriptors"] for s in st] == [STATE_ROWS + 1, STATE_ROWS]
    _check_clean(2001, [p0, p1], [d0])
    pd_peer.check_auth([p0, p1], [d0], secret=True)


@pytest.mark.parametrize("secret", [True, False], ids=["secret", "lab"])
def test_prefill_tp1_to_decode_tp2(ranks, secret):
    """One prefill rank is read by two decode ranks (SGLang's required_dst_info_num):
    each gets its KV head and its half of the GDN heads, and its own aux row. With a
    secret, the room is claimed by two proven sessions, each its own destination."""
    p0, d0, d1 = ranks
    addr = _setup(ranks, [("prefill", 1, 0, 2), ("decode", 2, 0, 2), ("decode", 2, 1, 2)], secret)
    senders, receivers = _transfer(2002, addr, [p0], [d0, d1])
    assert all(s == (SUCCESS, None) for s in senders + receivers), (senders, receivers)
    _check_fields([d0, d1], 2)
    st = p0.call("stats")
    assert st["descriptors"] == 2 * (KV_ROWS + STATE_ROWS + 1)
    assert (st["prepped_descriptors"], st["row_descriptors"]) == (2 * KV_ROWS, 2 * (STATE_ROWS + 1))
    _check_clean(2002, [p0], [d0, d1])
    pd_peer.check_auth([p0], [d0, d1], secret)


@pytest.mark.parametrize("order", ["sender_first", "metadata_first"])
def test_incompatible_head_counts_are_refused_naming_them(ranks, order):
    """Decode ranks built for 4 KV heads against a 2-head prefill: the prefill
    refuses them at registration; both sides end Failed with the reason, and
    nothing was posted. In either order: a router sends the request to both
    servers at once, so the decode's METADATA often comes before SGLang made the
    prefill's sender, for which SGLang says nothing; both sides still fail within
    2 s (not after SGLang's 300 s timeouts)."""
    import time

    p0, d0, d1 = ranks
    addr = _setup(ranks, [("prefill", 1, 0, 2), ("decode", 2, 0, 4), ("decode", 2, 1, 4)])
    room = 2003 if order == "sender_first" else 2004
    if order == "sender_first":
        p0.call("sender", (room, False))
    t0 = time.monotonic()
    for r in (d0, d1):
        r.call("receive", (room, addr, DST_PAGES, DST_AUX, DST_SLOT))
    for r in (d0, d1):
        status, reason = r.call("wait", (room, 10))
        assert status == FAILED
        assert "2 KV heads in total on the prefill, 4 on the decode" in reason, reason
        assert "prefill rank 0/1" in reason and "decode rank" in reason
    assert time.monotonic() - t0 < 2.0
    if order == "metadata_first":
        t0 = time.monotonic()
        assert p0.call("sender", (room, False)) == FAILED  # made after the refusal: failed at once
    status, reason = p0.call("wait", (room, 10))
    assert status == FAILED and "4 on the decode" in reason
    assert time.monotonic() - t0 < 2.0
    assert p0.call("stats")["handles"] == 0
    for r in (d0, d1):
        st = r.call("stats")
        assert st["requests"] == 0 and st["transfers"] == 0 and not st["fenced"] and not st["imports"]
    pd_peer.check_auth([p0], [d0, d1], secret=True)  # the refusal reached proven decode ranks, sealed
