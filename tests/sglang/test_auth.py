"""The SGLang backend with a shared secret: real prefill and decode managers in real processes, real
NIXL/UCX, and attackers that are real too (decode ranks with another secret or none, a proven decode
rank that is not the room's, and a hand-rolled ZMQ socket sending raw frames)."""

from __future__ import annotations

import os
import secrets
import time

import numpy as np
import pytest
import zmq

from tests.sglang import pd_peer

pytestmark = pytest.mark.slow

ENV = pd_peer.SECRET_ENV
PAGES_A, PAGES_B = [5, 6, 7, 8], [20, 21, 9, 10]
DST_A, DST_B = [12, 13, 14, 15], [30, 31, 32, 2]


@pytest.fixture(scope="module")
def prefill():
    r = pd_peer.Rank()
    r.call("setenv", ENV)
    port = pd_peer.free_port()
    info = r.call("setup", ("prefill", 1, 0, port, 7, True))
    r.addr, r.rank_port = f"127.0.0.1:{port}", info["rank_port"]
    yield r
    r.close()


@pytest.fixture(scope="module")
def decode():
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    try:
        sa = pd_peer.configure("decode", port=pd_peer.free_port(), bootstrap_port=pd_peer.free_port())
        pools = pd_peer.make_pools(None)
        mgr = pd_peer.make_manager("decode", pools, sa)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    yield mgr, pools
    mgr.close()


@pytest.fixture(scope="module")
def lab():
    """A rank without a secret (lab mode): a decode in the attack test."""
    r = _other_decode({"HYBRIDKV_SGLANG_SECRET_ENV": None})
    yield r
    r.close()


def _other_decode(env: dict) -> pd_peer.Rank:
    r = pd_peer.Rank()
    r.call("setenv", env)
    r.call("setup", ("decode", 1, 0, pd_peer.free_port(), None, False))
    return r


def _until(what, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        if time.monotonic() > deadline:
            raise TimeoutError("condition never held")
        time.sleep(0.02)
    return got


def _transfer(prefill, mgr, pools, room: int, src, dst, slot: int, aux: int, *, meanwhile=None) -> None:
    """The legitimate decode gets the room byte for byte (`meanwhile` runs once its METADATA is in)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    r = pd_peer.receiver(mgr, prefill.addr, room)
    r.send_metadata(np.asarray(dst, dtype=np.int32), aux, [[slot]])
    assert prefill.call("sender", room) == KVPoll.WaitingForInput
    if meanwhile is not None:
        meanwhile()
    prefill.call("send", (room, src, 3, 1, 2, False))
    status, reason = prefill.call("wait", (room, 30))
    assert status == KVPoll.Success, reason
    assert pd_peer.wait_poll(r, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success, pd_peer.failure_of(r)
    kv, state, aux_row = prefill.call("bytes", (src, 3, 1))
    assert pools.page_bytes(dst) == kv and pools.slot_bytes(slot) == state and pools.aux_bytes(aux) == aux_row
    r.clear()


def test_same_secret_transfers_and_every_attack_is_dropped(prefill, decode, lab):
    """Wrong secret, no secret, raw frames, oversize frames, a proven peer reaching for another's room:
    each is refused or dropped, writes nothing, and the legitimate decode still gets its bytes."""
    from hybridkv.connectors.sglang import messages as msgs
    from hybridkv.connectors.sglang.sessions import SEAL_TAG
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, pools = decode
    before = prefill.call("stats")["auth"]

    # A decode rank with another secret: the prefill's proof fails there, so it sends no REGISTER.
    # A strong secret, but not the prefill's (weak ones are refused at start-up).
    wrong = _other_decode({**ENV, "HKV_TEST_SECRET": secrets.token_hex(32)})
    # A decode rank without a secret (lab mode): its REGISTER (and METADATA, if it sends it) for room 2001 go out
    # unsealed; its probe Hello is answered like any other, so it fails the room at once, naming the cause.
    try:
        wrong.call("receive", (2001, prefill.addr, DST_A, 1, 3))  # its handshake runs off the scheduler thread
        assert "did not prove the shared secret" in wrong.call("wait", (2001, 5))[1]
        t0 = time.monotonic()
        lab.call("receive", (2001, prefill.addr, DST_A, 1, 3))
        status, reason = lab.call("wait", (2001, 10))
        assert status == KVPoll.Failed and time.monotonic() - t0 < 3, (status, reason)
        assert f"prefill rank 127.0.0.1:{prefill.rank_port} requires authentication; set HYBRIDKV_SGLANG_SECRET_FILE " \
               "or HYBRIDKV_SGLANG_SECRET_ENV" in reason
        st = _until(lambda: (s := prefill.call("stats"))["auth"]["unproven"] >= before["unproven"] + 1 and s)
        assert st["peers"] == 0 and 2001 not in st["transfer_infos"]  # no NIXL agent added, no room claimed
        # the probe only: the wrong secret's decode fails at its MACed route lookup, before any Hello (routes.py)
        assert st["auth"]["challenges"] == before["challenges"] + 1
        before_raw = st["auth"]

        # A raw ZMQ socket: a Hello of its own is answered (so the harness reaches the prefill) ...
        ctx = zmq.Context.instance()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVTIMEO, 3000)
        back = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{prefill.rank_port}")
        push.send_multipart(msgs.Hello(nonce=b"n" * 32, endpoint="127.0.0.1", port=back).to_frames())
        challenge = msgs.decode_auth(pull.recv_multipart())
        assert isinstance(challenge, msgs.Challenge)
        # ... a made-up proof is told "refused" and nothing else,
        push.send_multipart(msgs.Proof(decode_nonce=b"n" * 32, prefill_nonce=challenge.prefill_nonce,
                                       endpoint="127.0.0.1", port=back, proof=b"p" * 32).to_frames())
        assert pull.recv_multipart() == msgs.Refused(reason="refused").to_frames()
        # ... an oversize handshake frame is dropped unread (no answer), a sealed message of a made-up
        # session and SGLang's own unsealed ABORT for a room are dropped.
        push.send_multipart([msgs.AUTH_TAG, b"\x93" + b"x" * 8192])
        push.send_multipart([SEAL_TAG, b"s" * 72, b"m" * 32, *msgs.Drained(room=2001, prefill_rank=0, generation=0).to_frames()])
        push.send_multipart([b"ABORT", b"2001", b"127.0.0.1", str(back).encode()])
        st = _until(lambda: (s := prefill.call("stats"))["auth"]["oversize"] > before["oversize"]
                    and s["auth"]["unproven"] >= before_raw["unproven"] + 2 and s)
        pull.setsockopt(zmq.RCVTIMEO, 300)  # the oversize Hello had its chance to be answered by now
        with pytest.raises(zmq.Again):
            pull.recv_multipart()
        assert st["auth"]["refused"] == before["refused"] + 1

        # The legitimate decode claims room 2001 after all that and gets it byte for byte; a forged
        # unsealed KV_STATUS Failed pushed at the decode's own port meanwhile is dropped there.
        def forge_status():
            to_decode = ctx.socket(zmq.PUSH)
            to_decode.setsockopt(zmq.LINGER, 0)
            to_decode.connect(f"tcp://127.0.0.1:{mgr.rank_port}")
            to_decode.send_multipart([b"KV_STATUS", b"2001", str(int(KVPoll.Failed)).encode(), b"0", b"forged"])
            _until(lambda: mgr.auth_stats.unproven >= 1)
            to_decode.close()

        _transfer(prefill, mgr, pools, 2001, PAGES_A, DST_A, 6, 9, meanwhile=forge_status)
        push.close()
        pull.close()
        assert wrong.call("all_zero") and lab.call("all_zero")
    finally:
        wrong.close()

    # A decode rank with the right secret (proven) cannot claim or abort a room another decode claimed.
    intruder = _other_decode(ENV)
    try:
        def intrude():
            foreign = prefill.call("stats")["auth"]["foreign"]
            intruder.call("receive", (2002, prefill.addr, DST_B, 2, 4))
            intruder.call("abort", 2002)
            _until(lambda: prefill.call("stats")["auth"]["foreign"] >= foreign + 2)

        _transfer(prefill, mgr, pools, 2002, PAGES_B, DST_B, 5, 8, meanwhile=intrude)
        assert intruder.call("all_zero")
        st = prefill.call("stats")
        assert st["peers"] == 2 and st["auth"]["sessions"] == before["sessions"] + 2  # both proven, both registered
    finally:
        intruder.close()
    assert mgr.auth_stats.sessions == 1 and mgr.auth_stats.foreign == 0


def test_a_prefill_rank_that_never_answers_the_handshake_does_not_stall_the_decode_scheduler(prefill, decode,
                                                                                             monkeypatch):
    """The handshake runs off SGLang's scheduler thread (prefill_links.py). A prefill rank whose route is
    registered as it should be (MACed, on a bootstrap server with the secret) but whose port never answers (a
    socket bound there that reads nothing: a rank stuck or gone): the decode scheduler's loop (the silent rank's
    room made and init()ed, i.e. registered, its destinations published, every room polled) waits for it at no
    step, while a room of a healthy prefill rank moves on and lands; the silent rank's room fails once the
    handshake times out, naming it, and its pages go back at once (nothing of the room went out, so no write
    can come)."""
    import requests
    from sglang.srt.disaggregation.base.conn import KVPoll

    from hybridkv.connectors.sglang import routes

    mgr, pools = decode
    dst_silent = [56, 57, 58, 59]  # no other test's pages: nothing may land in them
    sink = zmq.Context.instance().socket(zmq.PULL)
    silent_rank = sink.bind_to_random_port("tcp://127.0.0.1")
    rank = dict(attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0,
                pp_size=1, pp_rank=0, system_dp_size=1, system_dp_rank=0, rank_ip="127.0.0.1",
                page_size=pd_peer.PAGE_SIZE, kv_cache_dtype=mgr.kv_cache_dtype_str, rank_port=silent_rank)
    mgr.auth.links.timeout_s = 1.0  # the production default is 5 s
    try:
        with pd_peer.bootstrap_server(ENV) as silent:
            url = f"http://{silent}/route"
            signed = routes.sign_route(pd_peer.SECRET.encode(), rank, routes.fetch_nonce(url))
            assert requests.put(url, json=signed, timeout=5).status_code == 200
            healthy = pd_peer.receiver(mgr, prefill.addr, 2501)
            healthy.send_metadata(np.asarray(DST_A, dtype=np.int32), 9, [[6]])
            assert prefill.call("sender", 2501) == KVPoll.WaitingForInput
            _until(lambda: mgr.try_ensure_parallel_info(silent))  # SGLang's HTTP look-up, before the scheduler's step
            # init() asks the (healthy) bootstrap server for the rank's route, two HTTP round trips on the scheduler
            # thread as SGLang's own look-up is one: not a wait for the silent rank, and 0.6-1.2 s on CI's loaded
            # 2 cores, so the first step is timed without it (and the time printed)
            looked_up = []
            real_lookup = routes.lookup_route

            def timed_lookup(*args, **kwargs):
                t = time.monotonic()
                try:
                    return real_lookup(*args, **kwargs)
                finally:
                    looked_up.append(time.monotonic() - t)

            monkeypatch.setattr(routes, "lookup_route", timed_lookup)
            steps = []
            t0 = time.monotonic()
            r = pd_peer.kv_class("RECEIVER")(mgr, silent, 2502)
            r.init(0)
            r.send_metadata(np.asarray(dst_silent, dtype=np.int32), 8, [[5]])
            steps.append(time.monotonic() - t0 - sum(looked_up))
            assert looked_up, "the silent rank's route was not looked up: the first step timed something else"
            prefill.call("send", (2501, PAGES_A, 3, 1, 2, False))
            status = {}
            while len(status) < 2 and time.monotonic() - t0 < 20:
                t = time.monotonic()
                polls = {"healthy": healthy.poll(), "silent": r.poll()}
                steps.append(time.monotonic() - t)
                status.update({k: (v, time.monotonic() - t0) for k, v in polls.items()
                               if v in (KVPoll.Success, KVPoll.Failed) and k not in status})
                time.sleep(0.01)
        print(f"scheduler steps: {len(steps)}, longest {max(steps) * 1e3:.1f} ms (route look-up "
              f"{sum(looked_up) * 1e3:.1f} ms apart)")
        assert max(steps) < 0.5, f"a scheduler step took {max(steps):.2f} s"
        assert status["healthy"][0] == KVPoll.Success, pd_peer.failure_of(healthy)
        assert status["healthy"][1] < 5
        kv, state, aux_row = prefill.call("bytes", (PAGES_A, 3, 1))
        assert pools.page_bytes(DST_A) == kv and pools.slot_bytes(6) == state and pools.aux_bytes(9) == aux_row
        assert status["silent"][0] == KVPoll.Failed and status["silent"][1] < 4, pd_peer.failure_of(r)
        assert f"prefill rank 127.0.0.1:{silent_rank} did not answer the authentication handshake within 1 s" \
            in pd_peer.failure_of(r)
        with mgr.sched_lock:
            assert 2502 not in mgr.imports.rooms() and not mgr.fenced
        assert not any(any(b) for b in pools.page_bytes(dst_silent))
        healthy.clear()
        r.clear()
    finally:
        mgr.auth.links.timeout_s = mgr.config.handshake_timeout_s
        sink.close(linger=0)


def test_prefill_side_aborts_leave_the_session_and_never_lock_the_decode_rank_out(prefill, decode):
    """SGLang's prefill-side abort paths (AbortReq, chunked prefill's _retire_aborted_prefill_result) abort
    the sender and never clear it. 5,000 rooms of one proven decode rank (more than MAX_ROOMS_PER_SESSION)
    are claimed by its sealed METADATA and then aborted on the prefill; each leaves SGLang's claims and the
    session once nothing of it is in flight, and the decode rank's next request still arrives byte for byte.
    The METADATA are the decode's own, sealed with its session and sent on SGLang's socket to the prefill rank
    (real receivers would cost a page allocation each; the prefill processes them as any)."""
    from hybridkv.connectors.sglang import messages as msgs
    from hybridkv.connectors.sglang.sessions import MAX_ROOMS_PER_SESSION
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    mgr, pools = decode
    prefill_ep = ("127.0.0.1", prefill.rank_port)
    _transfer(prefill, mgr, pools, 2301, PAGES_A, DST_A, 6, 9)  # a proven, registered session
    session = mgr.keys.session(prefill_ep)
    sock, lock = CommonKVReceiver._connect(f"tcp://{prefill_ep[0]}:{prefill_ep[1]}")
    n, base = 5000, 10_000_000
    assert n > MAX_ROOMS_PER_SESSION
    t0 = time.monotonic()
    for start in range(base, base + n, 500):
        batch = list(range(start, min(start + 500, base + n)))
        for room in batch:
            mgr.auth.expect_writers(room, frozenset([prefill_ep]))  # as its receiver would
            md = msgs.Metadata(room=room, endpoint=mgr.local_ip, port=int(mgr.rank_port), agent_name=mgr.dp.name,
                               kv_indices=np.asarray([60], dtype=np.int32), aux_index=15,
                               state_indices=(np.asarray([7], dtype=np.int32),), required_dst_info_num=1,
                               decode_prefix_len=0, is_dummy=False, generation=0)
            with lock:
                sock.send_multipart(session.seal(md.to_frames()))
        st = prefill.call("abort_rooms", (batch,))
        assert st["never_claimed"] == 0, st  # no METADATA dropped as one room too many
    elapsed = time.monotonic() - t0
    assert st["claimed"] <= 1 and st["session_rooms"] <= 1, st
    _transfer(prefill, mgr, pools, 2302, PAGES_B, [48, 49, 50, 51], 7, 12)
    assert mgr.auth_stats.foreign == 0
    print(f"{n} prefill-side aborts in {elapsed:.1f} s")


def _route(bootstrap_addr: str) -> int:
    """The rank port SGLang's bootstrap server hands a decode for prefill rank (DP 0, CP 0, TP 0, PP 0), asked
    and answered MACed as a decode with the secret asks (routes.py)."""
    from hybridkv.connectors.sglang import routes

    got = routes.lookup_route(bootstrap_addr, pd_peer.SECRET.encode(), 0, 0, 0, 0)
    assert got is not None
    return int(got["rank_port"])


def test_a_route_put_without_the_secret_is_refused_and_a_decode_still_reaches_the_real_rank(prefill, monkeypatch):
    """SGLang's bootstrap server takes PUT /route from anyone (HTTP, no authentication of its own). A process
    without the secret puts a dead address in the real prefill rank's place: refused (403), the route unchanged.
    A registration MACed under the secret (as the rank sends it) but recorded and replayed after the rank
    registered again is refused too. A decode that looks the rank up afterwards reaches it and gets its room
    byte for byte (before: it dialled the dead address and failed the room at the handshake timeout)."""
    import requests

    from hybridkv.connectors.sglang import routes
    from hybridkv.transport.auth import load_secret
    from sglang.srt.disaggregation.base.conn import KVPoll

    url = f"http://{prefill.addr}/route"
    dead = pd_peer.free_port()
    rank = dict(attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0,
                pp_size=1, pp_rank=0, system_dp_size=1, system_dp_rank=0, rank_ip="127.0.0.1",
                page_size=pd_peer.PAGE_SIZE, kv_cache_dtype="auto")
    forged = requests.put(url, json={**rank, "rank_port": dead}, timeout=5)
    assert forged.status_code == 403 and "not MACed under the shared secret" in forged.text, forged.text
    assert _route(prefill.addr) == prefill.rank_port

    monkeypatch.setenv("HKV_TEST_SECRET", pd_peer.SECRET)
    secret = load_secret(env="HKV_TEST_SECRET")
    recorded = routes.sign_route(secret, {**rank, "rank_port": dead}, routes.fetch_nonce(url))
    assert requests.put(url, json=recorded, timeout=5).status_code == 200  # the rank, before it restarted
    again = routes.sign_route(secret, {**rank, "rank_port": prefill.rank_port}, routes.fetch_nonce(url))
    assert requests.put(url, json=again, timeout=5).status_code == 200  # the rank registers again
    assert requests.put(url, json=again, timeout=5).status_code == 200  # SGLang's retry of the same PUT
    replayed = requests.put(url, json=recorded, timeout=5)
    assert replayed.status_code == 403 and "nonce" in replayed.text, replayed.text
    tampered = requests.put(url, json={**again, "rank_port": dead}, timeout=5)
    assert tampered.status_code == 403 and "MAC" in tampered.text, tampered.text
    assert _route(prefill.addr) == prefill.rank_port

    fresh = _other_decode({**ENV, "HYBRIDKV_SGLANG_HANDSHAKE_TIMEOUT_S": "2"})  # looks the route up anew
    try:
        assert fresh.call("receive", (2401, prefill.addr, DST_A, 1, 3)) == KVPoll.WaitingForInput
        assert prefill.call("sender", 2401) == KVPoll.WaitingForInput
        prefill.call("send", (2401, PAGES_A, 3, 1, 2, False))
        assert prefill.call("wait", (2401, 30)) == (KVPoll.Success, None)
        assert fresh.call("wait", (2401, 30)) == (KVPoll.Success, None)
        assert fresh.call("bytes", (DST_A, 3, 1)) == prefill.call("bytes", (PAGES_A, 3, 1))
    finally:
        fresh.close()


def test_a_hello_naming_another_host_is_not_answered_there(prefill):
    """An SGLang prefill rank answers a Hello at the address it names, 64 a second: anyone reaching its port
    could make it dial any host. A Hello from 127.0.0.1 naming 127.0.0.2 (a listener there) gets no answer
    there and is counted; one naming the address it came from is answered."""
    from hybridkv.connectors.sglang import messages as msgs

    ctx = zmq.Context.instance()
    push, elsewhere, own = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    try:
        for sock in (push, elsewhere, own):
            sock.setsockopt(zmq.LINGER, 0)
        elsewhere.setsockopt(zmq.RCVTIMEO, 1500)
        own.setsockopt(zmq.RCVTIMEO, 5000)
        third = elsewhere.bind_to_random_port("tcp://127.0.0.2")
        back = own.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{prefill.rank_port}")
        before = prefill.call("stats")["auth"]
        push.send_multipart(msgs.Hello(nonce=b"h" * 32, endpoint="127.0.0.2", port=third).to_frames())
        with pytest.raises(zmq.Again):
            elsewhere.recv_multipart()  # not dialled
        push.send_multipart(msgs.Hello(nonce=b"i" * 32, endpoint="127.0.0.1", port=back).to_frames())
        assert isinstance(msgs.decode_auth(own.recv_multipart()), msgs.Challenge)
        after = prefill.call("stats")["auth"]
        assert after["disallowed"] == before["disallowed"] + 1
        assert after["challenges"] == before["challenges"] + 1
    finally:
        for sock in (push, elsewhere, own):
            sock.close()


def test_sealed_message_is_accepted_once_and_not_altered():
    """A recorded sealed message replayed, or altered, or sealed for the other direction, is dropped."""
    from hybridkv.connectors.sglang.sessions import AuthStats, Session

    sid, key = b"d" * 32 + b"p" * 32, b"k" * 32
    decode = Session(sid=sid, key=key, peer=("127.0.0.1", 1), prefill_side=False)
    prefill = Session(sid=sid, key=key, peer=("127.0.0.1", 2), prefill_side=True)
    stats = AuthStats()
    first, second = decode.seal([b"HYBRIDKV", b"one"]), decode.seal([b"HYBRIDKV", b"two"])
    assert prefill.open(second, stats) == [b"HYBRIDKV", b"two"]
    assert prefill.open(first, stats) == [b"HYBRIDKV", b"one"]  # out of order, within the window
    assert prefill.open(first, stats) is None and stats.replayed == 1
    altered = decode.seal([b"HYBRIDKV", b"three"])
    altered[-1] = b"thre3"
    assert prefill.open(altered, stats) is None and stats.unproven == 1
    assert decode.open(decode.seal([b"HYBRIDKV", b"four"]), stats) is None  # its own direction's label


def test_an_ended_session_takes_its_nixl_agent_along_and_fails_its_rooms_fake_cuda_event(prefill, decode):
    """A prefill rank with HYBRIDKV_SGLANG_MAX_SESSIONS=1. The decode's new handshake (as after a re-registration)
    replaces its session, which takes its agent and rooms over: nothing fails, the agent stays. Another decode
    rank's handshake then evicts it: the room whose sender waits fails on both sides at once; the room whose chunk
    is in flight (held on its device event: a CUDA event on CPU is faked) fails once that chunk is over, and only
    then does the evicted agent leave NIXL; no block stays held on either side, nothing is written into the
    evicted decode's pages, and the other decode's room arrives byte for byte. The evicted decode rank was told its
    session ended: its next room there starts a new handshake (evicting the other in turn) and arrives too."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, pools = decode
    agent = mgr.dp.name
    prefill.call("setenv", {"HYBRIDKV_SGLANG_MAX_SESSIONS": "1"})
    try:
        port = pd_peer.free_port()
        rank_port = prefill.call("setup", ("prefill", 1, 0, port, 7, True))["rank_port"]
    finally:
        prefill.call("setenv", {"HYBRIDKV_SGLANG_MAX_SESSIONS": None})
    addr = prefill.addr = f"127.0.0.1:{port}"
    dst_waiting, dst_moving = [40, 41, 42, 43], [44, 45, 46, 47]
    waiting = pd_peer.receiver(mgr, addr, 2101)
    waiting.send_metadata(np.asarray(dst_waiting, dtype=np.int32), 10, [[1]])
    moving = pd_peer.receiver(mgr, addr, 2102)
    moving.send_metadata(np.asarray(dst_moving, dtype=np.int32), 11, [[2]])
    assert prefill.call("sender", 2101) == KVPoll.WaitingForInput
    assert prefill.call("sender", 2102) == KVPoll.WaitingForInput
    prefill.call("send", (2102, PAGES_B, 3, 1, 2, True))  # returns once a worker waits on the chunk's event

    mgr.keys.handshake(("127.0.0.1", rank_port), mgr.config.handshake_timeout_s)
    _until(lambda: prefill.call("stats")["auth"]["sessions"] == 2)
    st = prefill.call("stats")
    assert st["peers"] == 1 and not st["retiring"] and prefill.call("knows_agent", agent)
    assert prefill.call("poll", 2101) == KVPoll.WaitingForInput

    other = _other_decode(ENV)
    try:
        other.call("receive", (2103, addr, DST_A, 1, 3))
        assert pd_peer.wait_poll(waiting, {KVPoll.Success, KVPoll.Failed}, timeout=10) == KVPoll.Failed
        assert "session of decode rank" in pd_peer.failure_of(waiting)
        status, reason = prefill.call("wait", (2101, 10))
        assert status == KVPoll.Failed and "session of decode rank" in reason and "ended" in reason
        # The chunk of room 2102 is still in flight: the agent it writes to stays, the decode still waits.
        assert prefill.call("stats")["retiring"] == [agent] and prefill.call("knows_agent", agent)
        assert moving.poll() not in (KVPoll.Success, KVPoll.Failed) and mgr.imports_in_flight(2102)

        prefill.call("open_gate", 2102)
        assert pd_peer.wait_poll(moving, {KVPoll.Success, KVPoll.Failed}, timeout=10) == KVPoll.Failed
        assert "session of decode rank" in pd_peer.failure_of(moving)
        assert prefill.call("wait", (2102, 10))[0] == KVPoll.Failed
        _until(lambda: not prefill.call("knows_agent", agent))
        st = prefill.call("stats")
        assert st["peers"] == 1 and not st["retiring"] and st["requests"] == 0 and st["transfers"] == 0
        assert not st["fenced"] and not st["inflight"]
        with mgr.sched_lock:
            assert mgr.sched.requests_in_flight() == 0 and not mgr.fenced and not mgr.imports.rooms()
        assert not any(any(b) for b in pools.page_bytes(dst_waiting + dst_moving))

        assert prefill.call("sender", 2103) == KVPoll.WaitingForInput
        prefill.call("send", (2103, PAGES_A, 3, 1, 2, False))
        assert prefill.call("wait", (2103, 30)) == (KVPoll.Success, None)
        assert other.call("wait", (2103, 30)) == (KVPoll.Success, None)
        assert other.call("bytes", (DST_A, 3, 1)) == prefill.call("bytes", (PAGES_A, 3, 1))

        assert mgr.keys.session(("127.0.0.1", rank_port)) is None  # told: nothing is sealed with the ended session
        _transfer(prefill, mgr, pools, 2104, PAGES_B, [48, 49, 50, 51], 7, 12)
        assert mgr.auth_stats.sessions == 4 and prefill.call("stats")["peers"] == 1
    finally:
        other.close()
    a = prefill.call("stats")["auth"]
    assert a["sessions"] == 4 and a["unproven"] == a["foreign"] == a["refused"] == 0, a


def test_a_lab_probe_takes_only_the_challenge_that_answers_it():
    """A decode without a secret acts on a Challenge only if it answers one of its own probes, once."""
    from hybridkv.connectors.sglang import messages as msgs
    from hybridkv.connectors.sglang.decode_keys import AuthProbe
    from hybridkv.connectors.sglang.prefill_gate import PrefillGate
    from hybridkv.connectors.sglang.sessions import AuthStats

    sent = []
    stats = AuthStats()
    probe = AuthProbe(local=("127.0.0.1", 1), send=lambda ip, port, frames: sent.append((ip, port, frames)),
                      stats=stats)
    probe.probe(("127.0.0.1", 2))
    nonce = msgs.decode_auth(sent[0][2]).nonce
    answer = msgs.Challenge(decode_nonce=nonce, prefill_nonce=b"p" * 32, proof=b"x" * 32).to_frames()
    stranger = msgs.Challenge(decode_nonce=b"n" * 32, prefill_nonce=b"p" * 32, proof=b"x" * 32).to_frames()
    assert probe.on_handshake(stranger) is None and stats.unproven == 1
    assert probe.on_handshake(msgs.Refused(reason="refused").to_frames()) is None and stats.unproven == 2
    assert probe.on_handshake(answer) == ("127.0.0.1", 2)
    assert probe.on_handshake(answer) is None and stats.unproven == 3  # once
    with pytest.raises(ValueError, match=r"max_sessions = 0; expected an int >= 1"):
        PrefillGate(secret=b"s" * 16, local=("127.0.0.1", 2), send=None, tcp_of=None, stats=stats, max_sessions=0)
