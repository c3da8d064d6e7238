"""DP attention (`--enable-dp-attention`, TP 2 = 2 attention-DP groups of attention
TP 1) on prefill and on decode, each rank its own process with its own NIXL (UCX)
agent and SGLang's real runtime context for that rank: SGLang derives the
attention ranks (attn_dp_rank = tp_rank // attn_tp_size), every prefill rank
registers under its DP group with the one bootstrap server, a prefill sender
registers its DP rank for the room (/register_dp_rank), and the decode side
resolves it the way SGLang's DecodePreallocQueue does without a routed rank
(/query_dp_ranks) before `init(prefill_dp_rank)` looks the rank up. A room may go
from any prefill DP rank to any decode DP rank: the two prefill DP ranks hold
different contents, so every field that lands is checked against the rank that
should have sent it. Every rank runs with a shared secret, as deployed: a decode
rank proves it to each prefill DP rank it reads a room from."""

from __future__ import annotations

import time

import pytest

from tests.sglang import pd_peer
from tests.sglang.pools import make_pools

pytestmark = pytest.mark.slow

SRC_PAGES = [5, 6, 7, 8, 20, 21, 9, 10, 11, 40]
DST_PAGES = [12, 13, 14, 15, 16, 17, 30, 31, 32, 2]
SRC_SLOT, DST_SLOT, SRC_AUX, DST_AUX = 3, 6, 2, 9
SUCCESS, WAITING_FOR_INPUT = 4, 2  # KVPoll values (ints travel between processes)
SEEDS = (7, 8)  # prefill DP rank -> the contents it holds
# 10 pages in 3 chunks: 5 runs on both sides x 4 K/V layer buffers, 12 Mamba tensors x 1 slot, 1 aux row.
ROWS_PER_ROOM = 5 * 4 + 12 + 1


@pytest.fixture(scope="module")
def ranks():
    rs = [pd_peer.Rank() for _ in range(4)]
    yield rs
    for r in rs:
        r.close()


def _setup(ranks):
    p0, p1, d0, d1 = ranks
    pd_peer.use_secret(ranks, True)
    port = pd_peer.free_port()
    # prefill TP rank 0 hosts the bootstrap server, as the prefill server's main process does
    info = {p0: p0.call("setup", ("prefill", 2, 0, port, SEEDS[0], True, 2, 2))}
    for r, args in ((p1, ("prefill", 2, 1, port, SEEDS[1], False, 2, 2)),
                    (d0, ("decode", 2, 0, pd_peer.free_port(), None, False, 2, 2)),
                    (d1, ("decode", 2, 1, pd_peer.free_port(), None, False, 2, 2))):
        r.start("setup", args)
    for r in (p1, d0, d1):
        info[r] = r.result("setup")
    return f"127.0.0.1:{port}", info


def _wait_for(rank, room, want, timeout=20.0):
    deadline = time.monotonic() + timeout
    while (st := rank.call("poll", room)) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return st


def test_dp_attention_2_to_2_any_prefill_dp_rank_to_any_decode_dp_rank(ranks):
    p0, p1, d0, d1 = ranks
    prefill, decode = (p0, p1), (d0, d1)
    addr, info = _setup(ranks)
    for dp_rank, r in enumerate(prefill + decode):
        assert (info[r]["attn_tp"], info[r]["attn_tp_rank"], info[r]["attn_dp_rank"], info[r]["num_dp_ranks"]) == (
            1, 0, dp_rank % 2, 2)
        # Each rank its own sglang:hybridkv_* series, labelled with its TP rank as SGLang's scheduler series are
        # (every DP-attention group's attention rank is 0).
        labels = info[r]["metric_labels"]
        assert (labels["tp_rank"], labels["dp_rank"], labels["engine_type"]) == (
            str(dp_rank % 2), "", "prefill" if r in prefill else "decode"), labels
    # (room, prefill DP rank that computes it, decode DP rank that continues it): crossed, and one straight
    routes = [(4001, 1, 0), (4002, 0, 1), (4003, 0, 0)]
    for room, p, _ in routes:
        assert prefill[p].call("sender", (room, False)) == 1  # Bootstrapping: its DP rank is registered
    for room, p, d in routes:
        assert decode[d].call("query_dp_rank", (addr, room)) == p
        decode[d].call("receive", (room, addr, DST_PAGES if room != 4003 else [50, 51, 52, 53, 54, 55, 56, 57, 58, 59],
                                   DST_AUX + (room == 4003), DST_SLOT - (room == 4003), p))
    for room, p, _ in routes:
        assert _wait_for(prefill[p], room, WAITING_FOR_INPUT) == WAITING_FOR_INPUT
        prefill[p].start("send", (room, SRC_PAGES, SRC_SLOT, SRC_AUX, 3))
        prefill[p].result("send")
    for room, p, d in routes:
        assert prefill[p].call("wait", room) == (SUCCESS, None)
        assert decode[d].call("wait", room) == (SUCCESS, None)

    # Field by field: each decode DP rank holds what the prefill DP rank of the room sent.
    for room, p, d in routes:
        dst = (DST_PAGES, DST_SLOT, DST_AUX) if room != 4003 else (list(range(50, 60)), DST_SLOT - 1, DST_AUX + 1)
        got = decode[d].call("named", dst)
        want = make_pools(SEEDS[p], tp=1, rank=0).named(SRC_PAGES, SRC_SLOT, SRC_AUX)
        other = make_pools(SEEDS[1 - p], tp=1, rank=0).named(SRC_PAGES, SRC_SLOT, SRC_AUX)
        assert got.keys() == want.keys()
        bad = [k for k in want if got[k] != want[k]]
        assert not bad, f"room {room} on decode DP rank {d}: {len(bad)} of {len(want)} fields differ, first {bad[:3]}"
        assert all(got[k] != other[k] for k in want if k != ("aux",)), "the two prefill DP ranks' contents differ"

    # Each prefill DP rank wrote its rooms to the decode ranks that registered with it;
    # decode DP rank 0 registered with both prefill DP ranks (a room from each).
    st = [r.call("stats") for r in prefill]
    assert [s["peers"] for s in st] == [2, 1]
    assert [s["descriptors"] for s in st] == [2 * ROWS_PER_ROOM, ROWS_PER_ROOM]
    for r in prefill:
        s = r.call("stats")
        assert s["requests"] == 0 and s["transfers"] == 0 and not s["fenced"] and not s["inflight"]
    for r in decode:
        s = r.call("stats")
        assert s["requests"] == 0 and s["transfers"] == 0 and not s["fenced"] and not s["imports"]
    pd_peer.check_auth(prefill, decode, secret=True)


def test_dp_attention_prefill_to_tp2_decode(ranks):
    """DP attention on the prefill only (two DP groups of attention TP 1), plain TP 2 on
    the decode: both decode ranks read the one prefill DP rank of the room (SGLang's
    required_dst_info_num = 2), each its KV head and its half of the GDN heads."""
    p0, p1, d0, d1 = ranks
    pd_peer.use_secret(ranks, True)
    port = pd_peer.free_port()
    p0.call("setup", ("prefill", 2, 0, port, SEEDS[0], True, 2, 2))
    for r, args in ((p1, ("prefill", 2, 1, port, SEEDS[1], False, 2, 2)),
                    (d0, ("decode", 2, 0, pd_peer.free_port(), None, False, 2, 1)),
                    (d1, ("decode", 2, 1, pd_peer.free_port(), None, False, 2, 1))):
        r.start("setup", args)
    for r in (p1, d0, d1):
        r.result("setup")
    addr = f"127.0.0.1:{port}"
    room = 4004
    assert p1.call("sender", (room, False)) == 1
    for d in (d0, d1):
        assert d.call("query_dp_rank", (addr, room)) == 1
        d.call("receive", (room, addr, DST_PAGES, DST_AUX, DST_SLOT, 1))
    assert _wait_for(p1, room, WAITING_FOR_INPUT) == WAITING_FOR_INPUT  # both decode ranks' metadata arrived
    p1.call("send", (room, SRC_PAGES, SRC_SLOT, SRC_AUX, 3))
    assert p1.call("wait", room) == (SUCCESS, None)
    for rank, d in enumerate((d0, d1)):
        assert d.call("wait", room) == (SUCCESS, None)
        got = d.call("named", (DST_PAGES, DST_SLOT, DST_AUX))
        want = make_pools(SEEDS[1], tp=2, rank=rank).named(SRC_PAGES, SRC_SLOT, SRC_AUX)
        assert got.keys() == want.keys()
        bad = [k for k in want if got[k] != want[k]]
        assert not bad, f"decode rank {rank}/2: {len(bad)} of {len(want)} fields differ, first {bad[:3]}"
    assert [r.call("stats")["peers"] for r in (p0, p1)] == [0, 2]
    pd_peer.check_auth([p0, p1], [d0, d1], secret=True)
