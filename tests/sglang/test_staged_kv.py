"""KV at different attention TP through staging slots (HYBRIDKV_SGLANG_STAGING, connectors/sglang/staged_kv.py),
between real processes (real SGLang managers and bootstrap server, a NIXL/UCX agent per rank, host memory):

* prefill TP 2 -> decode TP 1 (SLOT): each prefill rank packs its head of the chunk's pages, WRITEs it into the
  slot the decode took for it (one descriptor per chunk), the decode unpacks before it reports the room ready;
* prefill TP 1 -> decode TP 2 (DIRECT): the prefill packs each decode rank's head and WRITEs it straight into
  that rank's pages, a row per layer buffer and run of pages;
* a decode pool too small for a second room: the second room falls back to the sliced lists; and the fence of a
  decode slot: the first room's slot is not given back while its late WRITE may land (switched off with
  HYBRIDKV_STAGING_RULE_OFF, the late WRITE lands in the second room's slot and corrupts it).

Each decode rank's fields are compared with its slice of the prefill ranks' state (tests/sglang/pools.py)."""

from __future__ import annotations

import os
import time

import pytest

from tests.sglang import pd_peer
from tests.sglang.pools import ATTN_LAYERS, GDN_LAYERS, PAGE_SIZE, make_pools

pytestmark = pytest.mark.slow

SRC_PAGES = [5, 6, 7, 8, 20, 21, 9, 10, 11, 40]
SRC_SLOT, DST_SLOT, SRC_AUX, DST_AUX = 3, 6, 2, 9
SUCCESS, FAILED = 4, 0
KV_ROWS = len(SRC_PAGES) * PAGE_SIZE * 2 * len(ATTN_LAYERS)  # sliced: a row per token, K/V and layer
STATE_ROWS = (3 + 1) * len(GDN_LAYERS)
CHUNKS = 3
STAGING = {"HYBRIDKV_SGLANG_STAGING": "on", "HYBRIDKV_SGLANG_STAGING_POOL_MB": None, "HYBRIDKV_STAGING_RULE_OFF": None}


@pytest.fixture(scope="module")
def ranks():
    rs = [pd_peer.Rank() for _ in range(3)]
    yield rs
    for r in rs:
        for k in STAGING:
            r.call("setenv", {k: None})
        r.close()


def _setup(ranks, layout, env=None):
    """layout: per process (role, tp, rank); prefill rank 0 hosts the bootstrap server. `env`: per process."""
    pd_peer.use_secret(ranks, True)
    for i, r in enumerate(ranks):
        r.call("setenv", {**STAGING, **((env or {}).get(i, {}))})
    port = pd_peer.free_port()
    for i, (role, tp, rank) in enumerate(layout):
        ranks[i].start("setup", (role, tp, rank, port if role == "prefill" else pd_peer.free_port(),
                                 7 if role == "prefill" else None, i == 0))
        if i == 0:
            ranks[i].result("setup")  # the server is up before the other ranks register
    for r in ranks[1:]:
        r.result("setup")
    return f"127.0.0.1:{port}"


def _receive(room, addr, decode, dst_pages, slot=DST_SLOT, aux=DST_AUX):
    for r in decode:
        assert r.call("receive", (room, addr, dst_pages, aux, slot)) != FAILED, r.call("stats")["failures"]


def _send(room, prefill, src_pages, chunks=CHUNKS, slot=SRC_SLOT, aux=SRC_AUX):
    for r in prefill:
        assert r.call("sender", room) == 2  # WaitingForInput: every decode rank's metadata arrived
        r.call("send", (room, src_pages, slot, aux, chunks))


def _differ(decode, tp_d, src_pages, dst_pages, src=(SRC_SLOT, SRC_AUX), dst=(DST_SLOT, DST_AUX)) -> list:
    bad = []
    for d, r in enumerate(decode):
        got = r.call("named", (dst_pages, *dst))
        want = make_pools(7, tp=tp_d, rank=d).named(src_pages, *src)
        assert got.keys() == want.keys()
        bad += [k for k in want if got[k] != want[k]]
    return bad


def _pools_free(ranks, timeout=10.0) -> None:
    """Every staging slot of every rank went back (the pools are whole again)."""
    deadline = time.monotonic() + timeout
    while True:
        pools = [r.call("stats")["staging"] for r in ranks]
        if all(p["free"] == p["units"] and not p["held"] for p in pools) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(p["free"] == p["units"] for p in pools), pools


@pytest.fixture(scope="module")
def two_to_one(ranks):
    """Prefill TP 2 -> decode TP 1, the decode's pool sized for one room (two writers of 5 KB: two 4 KiB units
    each); the decode's slot fence off where the test process says so (HYBRIDKV_STAGING_RULE_OFF)."""
    one_room = 2 * 2 * 4096 / (1 << 20)
    env = {2: {"HYBRIDKV_SGLANG_STAGING_POOL_MB": str(one_room),
               "HYBRIDKV_STAGING_RULE_OFF": os.environ.get("HYBRIDKV_STAGING_RULE_OFF")}}
    return _setup(ranks, [("prefill", 2, 0), ("prefill", 2, 1), ("decode", 1, 0)], env)


def test_prefill_tp2_to_decode_tp1_through_decode_slots(ranks, two_to_one):
    """P > D: a decode page interleaves both prefill ranks' heads token by token; each prefill rank WRITEs one
    descriptor per chunk into its decode slot (the sliced lists post KV_ROWS per rank: 53x as many)."""
    p0, p1, d0 = ranks
    addr = two_to_one
    dst = [12, 13, 14, 15, 16, 17, 30, 31, 32, 2]
    _receive(3001, addr, [d0], dst)
    _send(3001, [p0, p1], SRC_PAGES)
    assert [r.call("wait", 3001) for r in (p0, p1, d0)] == [(SUCCESS, None)] * 3
    assert not _differ([d0], 1, SRC_PAGES, dst)
    st = [r.call("stats") for r in (p0, p1)]
    assert [s["staged"] for s in st] == [dict(descriptors=CHUNKS, direct=0, slot=CHUNKS)] * 2
    assert [s["prepped_descriptors"] for s in st] == [0, 0]
    assert [s["descriptors"] for s in st] == [CHUNKS + STATE_ROWS + 1, CHUNKS + STATE_ROWS]
    assert KV_ROWS >= 10 * CHUNKS
    _pools_free(ranks)
    for r in (p0, p1):
        s = r.call("stats", 3001)
        assert s["exporting"] is False and s["requests"] == 0 and s["transfers"] == 0 and not s["fenced"]
    s = d0.call("stats")
    assert s["requests"] == 0 and s["transfers"] == 0 and not s["fenced"] and not s["imports"]


def test_chunks_written_apart_are_all_unpacked(ranks, two_to_one):
    """Forward passes space a room's chunks apart, so between two of them nothing of the room is in flight on
    the prefill. Each staged chunk must still reach the room's LANDED: before the fix the prefill dropped the
    pages staged so far when it retired the room's export between chunks, and the decode unpacked only the
    last chunk's (the rest of its pages kept their old bytes; `python -m tests.sglang.backend_table --cases
    2->1-staged` showed 3 chunks of 4 wrong)."""
    p0, p1, d0 = ranks
    addr = two_to_one
    dst = [22, 23, 24, 25, 26, 27, 33, 34, 35, 36]
    before = [r.call("stats")["staged"]["slot"] for r in (p0, p1)]
    _receive(3201, addr, [d0], dst)
    for r in (p0, p1):
        assert r.call("sender", 3201) == 2
        r.call("send", (3201, SRC_PAGES, SRC_SLOT, SRC_AUX, CHUNKS, False, False))  # all but the last chunk
    deadline = time.monotonic() + 10
    for r, b in zip((p0, p1), before):  # both chunks staged and settled: nothing of the room in flight
        while (r.call("stats")["staged"]["slot"] < b + CHUNKS - 1 or r.call("stats")["transfers"]) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.call("stats")["staged"]["slot"] == b + CHUNKS - 1 and not r.call("stats")["transfers"]
    for r in (p0, p1):
        r.call("send_tail", (3201, SRC_PAGES, SRC_SLOT, CHUNKS))
    assert [r.call("wait", 3201) for r in (p0, p1, d0)] == [(SUCCESS, None)] * 3
    bad = _differ([d0], 1, SRC_PAGES, dst)
    assert not bad, f"{len(bad)} fields differ, first {bad[:3]}"
    _pools_free(ranks)


def test_decode_slot_is_kept_while_a_write_may_land(ranks, two_to_one):
    """Room A's WRITE from prefill rank 0 into its decode slot hangs (held: NIXL will not abort it) and the decode
    gives A up. Room B comes with the decode pool sized for one room: A's slots stay A's until its writer
    drained, so B falls back to the sliced lists (a full pool never waits) and A's late WRITE lands in A's slot:
    B's bytes are right, and every slot goes back once A's writer drained.

    Run with ``HYBRIDKV_STAGING_RULE_OFF=1`` (passed to the decode rank) this fails: A's slots go back when A
    fails, B takes them, and A's late WRITE lands in B's slot between B's WRITEs and its unpack."""
    p0, p1, d0 = ranks
    addr = two_to_one
    p0.call("patch", ("exports.transfer_timeout_s", 1.0))
    staged_before = p0.call("stats")["staged"]["slot"]
    dst_a, dst_b = [12, 13, 14, 15, 16, 17, 30, 31, 32, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    src_b = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
    p0.call("hold_writes", (None, 1))  # room A's staged WRITE (its first) hangs
    _receive(3101, addr, [d0], dst_a)
    assert d0.call("stats")["staging"]["free"] == 0  # A holds the whole decode pool
    _send(3101, [p0, p1], SRC_PAGES, chunks=1)
    deadline = time.monotonic() + 10
    while p0.call("held") < 1 and time.monotonic() < deadline:  # a worker posts it
        time.sleep(0.01)
    assert p0.call("held") == 1
    d0.call("abort", 3101)  # the decode gives room A up while the WRITE may still land
    _receive(3102, addr, [d0], dst_b, slot=7, aux=10)  # A's pages, slot and row stay fenced
    _send(3102, [p0, p1], src_b, chunks=1, slot=4, aux=3)
    assert [r.call("wait", 3102) for r in (p0, p1)] == [(SUCCESS, None)] * 2
    assert p0.call("wait", 3101)[0] == FAILED
    assert p0.call("release_held") == 1  # A's late WRITE lands now, before the decode polls B
    assert d0.call("wait", 3102) == (SUCCESS, None)
    bad = _differ([d0], 1, src_b, dst_b, src=(4, 3), dst=(7, 10))
    assert not bad, f"{len(bad)} fields of room B differ (A's late WRITE landed in them), first {bad[:3]}"
    assert p0.call("stats")["staged"]["slot"] == staged_before + 1  # A's: B fell back (the pool was full)
    _pools_free(ranks)


def test_prefill_tp1_to_decode_tp2_direct_or_through_slots(ranks):
    """P < D: a decode rank's head of a prefill page is its whole page. A chunk whose packed pages land in its
    pages in at most `direct_rows` (8) rows goes straight there (DIRECT: a row per layer buffer and page: the
    compact pages are page-major, so rows merge inside a page, not across pages); a longer chunk goes through
    the decode's slot in one row (SLOT), as at P > D."""
    p0, d0, d1 = ranks
    addr = _setup(ranks, [("prefill", 1, 0), ("decode", 2, 0), ("decode", 2, 1)])
    dst = list(range(12, 22))
    _receive(3002, addr, [d0, d1], dst)
    _send(3002, [p0], SRC_PAGES)  # 3 chunks of 3-4 pages: 12-16 direct rows each
    assert [r.call("wait", 3002) for r in (p0, d0, d1)] == [(SUCCESS, None)] * 3
    assert not _differ([d0, d1], 2, SRC_PAGES, dst)
    st = p0.call("stats")
    assert st["staged"] == dict(descriptors=2 * CHUNKS, direct=0, slot=2 * CHUNKS)
    assert st["prepped_descriptors"] == 0 and KV_ROWS >= 10 * CHUNKS
    _pools_free(ranks)
    dst = [30, 31, 2, 3, 50, 51, 52, 53, 20, 21]
    _receive(3003, addr, [d0, d1], dst, slot=7, aux=10)
    _send(3003, [p0], SRC_PAGES, chunks=5)  # 5 chunks of 2 pages: 8 direct rows each
    assert [r.call("wait", 3003) for r in (p0, d0, d1)] == [(SUCCESS, None)] * 3
    assert not _differ([d0, d1], 2, SRC_PAGES, dst, dst=(7, 10))
    direct = p0.call("stats")["staged"]
    rows = 2 * 2 * len(ATTN_LAYERS) * 5  # per decode rank: K and V of each layer, 2 pages, 5 chunks
    assert direct == dict(descriptors=2 * CHUNKS + 2 * rows, direct=2 * 5, slot=2 * CHUNKS)
    assert KV_ROWS == 4 * rows  # a page's 4 tokens in one row
    _pools_free(ranks)
