"""Attacks on a producer from the same host (issue 26), and the table of what each cost it.

A real producer process exports real requests; an attacker process (ucxx, NIXL and raw sockets,
loopback only) runs one or more attacks; then a legitimate consumer fetches every request and
must get it byte for byte while the producer frees every block. A monitor thread samples the
producer's RSS, open file descriptors and CPU time throughout.

    python -m tests.transport.attacks [--scale N] [--json]     # the table for the closing note

``tests/transport/test_attacks.py`` runs every attack at a small scale against one producer in CI.

Attacks (``ATTACKS``):
- ``relay``: a peer without the secret that a legitimate decode dials forwards the handshake to the
  producer (as is, then with the dialled address rewritten), keeps the decode's Hello and sends its own.
- ``no_secret``: a real consumer without the secret, then one with a wrong secret, asks to connect.
- ``forged_hello``: a valid Hello (real NIXL metadata) as the first frame, then after an Auth with a
  forged proof.
- ``big_frames``: connections that each announce and send a 16 MiB frame before any Hello.
- ``unknown_tags``: connections that never handshake and send messages under ucxx tags nobody receives.
- ``raw_tcp``: plain TCP connections sending garbage to the listener port, held open a while.
- ``close_wait``: plain TCP connections sending garbage and closing at once (150 at scale 1).
- ``half_open``: 80 connections that send a first Auth and then nothing, re-opened when closed, while six
  legitimate consumers (another process) connect.
- ``claim``: an authenticated peer asks for, renews and ends the legitimate consumer's request with
  a guessed token, and renews ids that do not exist.
- ``heartbeat_flood``: an authenticated peer sends Heartbeats of 1,024 guessed tickets as fast as it can.
- ``want_flood``: an authenticated peer sends Wants for random ids (65,536 at full scale).
- ``forged_notif``: an authenticated peer claims a request of its own (``VICTIM``) and does not read it yet;
  a NIXL agent that takes its agent name (seen in its plaintext Auth on the network) and loads the
  producer's metadata sends the completion notification of that request: does the producer end the claim?
- ``claim_first``: an insider (the secret, a session of its own) that saw a request's token claims it
  before the decode it was issued for (``BOUND``, exported bound to ``CLAIMANT``'s agent name); then that
  decode claims it.
- ``cut_off_backlog``: an authenticated peer sends its share of Wants and as many again at once, so that
  frames are still arriving when it is cut off: none of them may stay in the producer's tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import threading
import time
import traceback

from tests.transport import harness, peers

ATTACKS = ("relay", "no_secret", "forged_hello", "big_frames", "unknown_tags", "raw_tcp", "close_wait", "half_open", "claim", "heartbeat_flood",
           "want_flood", "cut_off_backlog", "forged_notif", "claim_first")
REQUESTS = [("r-legit", 200, False), ("r-legit2", 60, True)]
VICTIM = ("r-victim", 40, False)  # exported too when forged_notif runs: the insider's own request
BOUND = ("r-bound", 40, False)  # exported too when claim_first runs, its capability bound to CLAIMANT
CLAIMANT = "hybridkv-claim-first-decode"  # the NIXL agent name of the decode BOUND is issued for

#: per attack, at scale 1 (CI); the table multiplies the counts by --scale
SMALL = {"connections": 8, "tag_seconds": 1.5, "tag_bytes": 4096, "heartbeats": 40, "wants": 600, "hold_s": 3.0,
         "close_wait": 150, "half_open": 80, "half_open_s": 60.0}
#: the producer's Want bound per peer at scale 1 (its default, 4096, at larger scales)
SMALL_WANTS_PER_PEER = 256


# ============================================================== the attacker process
def attacker_main(opts: dict, out, inbox) -> None:
    peers._quiet()
    try:
        out.put(("report", asyncio.run(_attack_all(opts))))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


async def _attack_all(opts: dict) -> dict:
    reports = {}
    for name in opts["attacks"]:
        t0 = time.monotonic()
        reports[name] = await _ATTACKS[name](opts)
        reports[name]["seconds"] = round(time.monotonic() - t0, 2)
    for cons in [*_CONSUMERS.values(), *_INSIDERS]:
        await cons.close()
    return reports


_CONSUMERS: dict = {}
_INSIDERS: list = []


def _consumer(secret):
    """A consumer endpoint (layout, NIXL agent) per secret, made once: its Hello is what a real one sends."""
    if secret not in _CONSUMERS:
        _CONSUMERS[secret] = _new_consumer(secret)
    return _CONSUMERS[secret]


def _new_consumer(secret, seed: int = 3, **over):
    return _new_consumer_with_layout(secret, seed, **over)[0]


def _new_consumer_with_layout(secret, seed: int = 3, **over):
    from hybridkv.descriptors.planning import DescriptorPlanner
    from hybridkv.fencing.scheduler import TransferScheduler
    from hybridkv.transport.endpoint import Consumer, Pairing, TransportConfig

    layout, memory, pools = peers.build(seed)
    cfg = TransportConfig(secret=secret, insecure_no_auth=secret is None, insecure_host_memory=secret is not None, **{"handshake_timeout_s": 5.0, **over})
    cons = Consumer(memory, TransferScheduler(pools, lease_s=30.0), cfg, planner=DescriptorPlanner(pairing=Pairing.PAGES))
    return cons, layout


async def _no_secret(opts) -> dict:
    from hybridkv.errors import HybridKVError

    said = []
    for secret in (None, b"c6d834a5a00e70605b396ba2a563b1c952f84c348679bab1821aacd2e8f165fc"):  # none, a wrong one
        cons = _consumer(secret)
        try:
            await cons.connect(*opts["addr"])
            said.append("connected")
        except HybridKVError as exc:
            said.append(f"{type(exc).__name__}: {exc}")
        _CONSUMERS.pop(secret)
        await cons.close()  # connect() may have started its pump: not reused
    return {"said": said}


async def _dial():
    from hybridkv.transport import control

    return await control.dial(*_ADDR, timeout_s=5.0)


async def _reply(ch, timeout_s=3.0):
    from hybridkv.errors import PeerLost

    try:
        return await asyncio.wait_for(ch.recv(), timeout_s)
    except (asyncio.TimeoutError, PeerLost) as exc:
        return type(exc).__name__


def _describe(msg) -> str:
    from hybridkv import wire

    if isinstance(msg, wire.Refuse):
        return f"Refuse({msg.reason!r}, differences={len(msg.differences)})"
    if isinstance(msg, wire.Auth):
        return f"Auth(proof={len(msg.proof)})"
    return msg if isinstance(msg, str) else type(msg).__name__


async def _forged_hello(opts) -> dict:
    from hybridkv import wire

    cons = _consumer(None)
    hello = cons.hello()
    said = []
    ch = await _dial()
    await ch.send(hello)  # a Hello first, as protocol 1 had it
    said.append(_describe(await _reply(ch)))
    await ch.close()
    ch = await _dial()
    await ch.send(wire.Auth(nonce=secrets.token_bytes(32), address="%s:%d" % _ADDR, agent=hello.agent))
    said.append(_describe(await _reply(ch)))  # the producer's nonce, and no proof to guess the secret from
    await ch.send(wire.Auth(proof=secrets.token_bytes(32)))  # a guessed proof
    await ch.send(hello)
    said.append(_describe(await _reply(ch)))
    await ch.close()
    return {"said": said}


async def _big_frames(opts) -> dict:
    import numpy as np

    from hybridkv import wire

    n = opts["connections"]
    body = np.zeros(wire.MAX_MESSAGE_BYTES, dtype=np.uint8)

    async def one():
        ch = await _dial()
        await ch._ep.send(np.array([wire.MAX_MESSAGE_BYTES], dtype="<u8"))
        sent = asyncio.ensure_future(ch._ep.send(body))
        got = _describe(await _reply(ch))
        sent.cancel()
        await ch.close()
        return got

    said = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    return {"said": sorted({str(s) for s in said}), "connections": n}


async def _unknown_tags(opts) -> dict:
    import numpy as np

    n, size, seconds = opts["connections"], opts["tag_bytes"], opts["tag_seconds"]
    buf = np.ones(size, dtype=np.uint8)
    sent = [0]

    async def one():
        ch = await _dial()
        stop = time.monotonic() + seconds
        try:
            while time.monotonic() < stop:  # 64 sends in flight at a time: as fast as UCX takes them
                await asyncio.wait_for(asyncio.gather(*(ch._ep.send(buf, tag=secrets.randbits(63), force_tag=True)
                                                        for _ in range(64))), 2.0)
                sent[0] += 64 * size
        except Exception:
            pass
        await ch.close()

    await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    return {"sent_mb": round(sent[0] / 1e6, 1), "connections": n}


async def _raw_tcp(opts) -> dict:
    n, hold = opts["connections"] * 8, opts["hold_s"]
    socks = []
    for _ in range(n):
        try:
            s = socket.create_connection(_ADDR, timeout=2.0)
            s.sendall(secrets.token_bytes(256))
            socks.append(s)
        except OSError:
            break
    await asyncio.sleep(hold)
    ended = 0
    for s in socks:  # did the producer's side end the connection while we held it open?
        s.setblocking(False)
        try:
            ended += s.recv(1 << 16) == b""
        except BlockingIOError:
            pass
        except OSError:
            ended += 1
        s.close()
    return {"connections": len(socks), "ended_by_producer": ended}


async def _close_wait(opts) -> dict:
    """Raw TCP connections that send garbage and close at once (their producer side stays in CLOSE-WAIT
    until the producer closes it): as many as ``close_wait``, as fast as the listener accepts them."""
    n, opened = opts["close_wait"], 0
    fds = lambda: len(os.listdir(f"/proc/{opts['pid']}/fd"))  # noqa: E731 - the producer's
    before = peak = fds()
    for _ in range(n):
        try:
            s = socket.create_connection(_ADDR, timeout=2.0)
            s.sendall(secrets.token_bytes(4096))  # more than a UCX connection request holds (2 KiB)
            s.close()
            opened += 1
        except OSError:
            await asyncio.sleep(0.01)  # the listener's backlog is full: it is behind, not gone
    t0, back = time.monotonic(), None
    while time.monotonic() - t0 < 10.0:  # until the producer holds no more fds than before
        now = fds()
        peak = max(peak, now)
        if now <= before:
            back = round(time.monotonic() - t0, 2)
            break
        await asyncio.sleep(0.05)
    return {"connections": opened, "fds_before": before, "fds_peak": peak, "fds_back_after_s": back}


def _first_auth(agent: str):
    """A consumer's first Auth (of the protocol this checkout speaks: the table is also made on older ones)."""
    import dataclasses

    from hybridkv import wire

    names = {f.name for f in dataclasses.fields(wire.Auth)}
    extra = {"address": "%s:%d" % _ADDR, "agent": agent} if "address" in names else {}
    return wire.Auth(nonce=secrets.token_bytes(32), proof=b"", **extra)


async def _half_open(opts) -> dict:
    """``half_open`` connections that each send a valid first Auth and then nothing, re-opened as soon as
    the producer closes one, until the test's six legitimate consumers (another process: the secret,
    default handshake timeout and retries) have connected or given up, or ``half_open_s`` passed."""
    n = opts["half_open"]
    ended = asyncio.Event()
    opened = [0]

    async def until_closed(ch):
        while True:
            await ch.recv()  # PeerLost once the producer (or we) closed it

    async def one():
        while not ended.is_set():
            try:
                ch = await _dial()
            except Exception:
                await asyncio.sleep(0.05)
                continue
            opened[0] += 1
            # Silence, whatever the producer answers, until it closes the connection or the attack ends. A
            # pending receive is ended by closing the endpoint, never cancelled: a cancelled ucxx receive
            # frees its buffer while UCX may still write into it.
            reading = asyncio.ensure_future(until_closed(ch))
            stopping = asyncio.ensure_future(ended.wait())
            try:
                await ch.send(_first_auth("half-open"))
                await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
            except Exception:
                pass
            stopping.cancel()
            await ch.close()
            await asyncio.gather(reading, return_exceptions=True)

    flood = [asyncio.ensure_future(one()) for _ in range(n)]
    await asyncio.sleep(1.0)  # every slot taken first
    _OUT.put(("flooding", None))
    stop = time.monotonic() + opts["half_open_s"]
    while time.monotonic() < stop:
        try:
            if _INBOX.get_nowait() == "legit-done":
                break
        except Exception:
            pass
        await asyncio.sleep(0.05)
    ended.set()
    await asyncio.gather(*flood, return_exceptions=True)
    return {"half_open": n, "opened": opened[0]}


async def _authenticated(name: str | None = None):
    """A raw channel that passed the handshake with the shared secret (an insider)."""
    from hybridkv import wire
    from hybridkv.transport import auth
    from hybridkv.transport.dataplane import DataPlaneConfig

    # its own agent name (a name already connected is refused), or ``name``
    cons = _new_consumer(peers.SECRET, dataplane=DataPlaneConfig(name=name))
    _INSIDERS.append(cons)
    ch = await _dial()
    nonce, dialled = auth.new_nonce(), auth.address(*_ADDR)
    await ch.send(wire.Auth(nonce=nonce, address=dialled, agent=cons.dp.name))
    r = await ch.recv()
    t = auth.Transcript(consumer_nonce=nonce, producer_nonce=r.nonce, dialled=dialled, producer=r.address,
                        consumer_agent=cons.dp.name, producer_agent=r.agent)
    await ch.send(wire.Auth(proof=auth.proof(peers.SECRET, wire.Role.CONSUMER, t)))
    r = await ch.recv()
    if not isinstance(r, wire.Auth):
        raise RuntimeError(f"the insider's handshake failed: {r}")
    ch.seal(auth.Sealer(auth.session_key(peers.SECRET, t), wire.Role.CONSUMER))
    await ch.send(cons.hello())
    hello = await ch.recv()
    if not isinstance(hello, wire.Hello):
        raise RuntimeError(f"the insider's handshake failed: {hello}")
    cons.producer_hello = hello  # its NIXL metadata, for attacks on the data plane
    return cons, ch


async def _collect(ch, seconds: float) -> list:
    got = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        msg = await _reply(ch, max(0.05, stop - time.monotonic()))
        if isinstance(msg, str):
            if msg != "TimeoutError":
                got.append(msg)
                break
            continue
        got.append(msg)
    return got


async def _claim(opts) -> dict:
    from hybridkv import wire

    cons, ch = await _authenticated()
    rid = REQUESTS[0][0]
    guess = secrets.token_bytes(16)
    await ch.send(wire.Want(request_id=rid, token=guess))
    await asyncio.sleep(1.0)  # the export starts meanwhile (the producer saw a peer)
    await ch.send(wire.Want(request_id=REQUESTS[1][0], token=guess))
    await ch.send(wire.Heartbeat(seq=1, tickets=(wire.Ticket(request_id=rid, token=guess),
                                                 wire.Ticket(request_id="never-existed", token=guess))))
    await ch.send(wire.Done(request_id=rid, ok=False, token=guess))
    await ch.send(wire.Failure(request_id=rid, code=wire.FailureCode.ABORTED, detail="x", token=guess))
    got = await _collect(ch, 1.0)
    await ch.close()
    leases = {m.request_id: m.lease_s for m in got if isinstance(m, wire.Lease)}
    return {"replies": sorted(_describe(m) for m in got), "leases": leases}


async def _heartbeat_flood(opts) -> dict:
    from hybridkv import wire

    cons, ch = await _authenticated()
    tickets = tuple(wire.Ticket(request_id=f"guess-{i}", token=secrets.token_bytes(16))
                    for i in range(wire.MAX_REQUESTS_PER_HEARTBEAT))
    sent = 0
    for i in range(opts["heartbeats"]):
        try:
            await asyncio.wait_for(ch.send(wire.Heartbeat(seq=i, tickets=tickets)), 2.0)
            sent += 1
        except Exception:
            break
    await asyncio.sleep(0.5)
    await ch.close()
    return {"heartbeats": sent, "ids": sent * len(tickets)}


async def _want_flood(opts) -> dict:
    from hybridkv import wire

    cons, ch = await _authenticated()
    token = secrets.token_bytes(16)
    sent = 0
    reader = asyncio.ensure_future(_collect(ch, 30.0))
    for i in range(opts["wants"]):
        if reader.done():
            break  # the producer closed the channel
        try:
            await asyncio.wait_for(ch.send(wire.Want(request_id=f"flood-{i}", token=token)), 2.0)
            sent += 1
        except Exception:
            break
    got = await asyncio.wait_for(reader, 35.0)
    await ch.close()
    return {"wants_sent": sent, "ended_with": _describe(got[-1]) if got else None}


async def _cut_off_backlog(opts) -> dict:
    from hybridkv import wire

    cons, ch = await _authenticated()
    token = secrets.token_bytes(16)
    n = 2 * opts["wants_per_peer"] + 64
    reader = asyncio.ensure_future(_collect(ch, 10.0))
    sends = [asyncio.ensure_future(ch.send(wire.Want(request_id=f"backlog-{i}", token=token))) for i in range(n)]
    done = await asyncio.gather(*sends, return_exceptions=True)
    got = await asyncio.wait_for(reader, 15.0)
    await ch.close()
    return {"wants_sent": sum(d is None for d in done), "ended_with": _describe(got[-1]) if got else None}


async def _forged_notif(opts) -> dict:
    """The insider claims VICTIM with its token; another NIXL agent, named as the insider's, sends the
    producer VICTIM's completion notification (as a peer that watched the insider's handshake could).
    Then the insider renews VICTIM: a lease of 0 says the forged notification ended its claim (in PULL
    mode the producer then frees the pages the reader was about to READ)."""
    from hybridkv import wire
    from hybridkv.transport.dataplane import DataPlane, DataPlaneConfig
    from hybridkv.transport.memory import MemoryMap

    cons, ch = await _authenticated()
    rid, tok = VICTIM[0], peers.token(VICTIM[0])
    await ch.send(wire.Want(request_id=rid, token=tok))
    export = await asyncio.wait_for(ch.recv(), 10.0)
    if not isinstance(export, wire.Export):
        return {"claimed": _describe(export)}
    hello = cons.producer_hello
    forger = DataPlane(cons.memory, DataPlaneConfig(name=cons.dp.name))
    try:
        forger.add_peer(hello.metadata, MemoryMap(regions=hello.regions, groups=hello.groups, table=hello.layout))
        for msg in (b"hkv:" + rid.encode(), b"hkv:" + rid.encode() + b"\0" + bytes(16)):  # old form, a guessed tag
            forger.notify(hello.agent, msg)
        for _ in range(100):
            forger.pump()
            await asyncio.sleep(0.005)
        await ch.send(wire.Heartbeat(seq=1, tickets=(wire.Ticket(request_id=rid, token=tok),)))
        got = [m for m in await _collect(ch, 1.0) if isinstance(m, wire.Lease)]
        lease = got[0].lease_s if got else None
    finally:
        await ch.send(wire.Done(request_id=rid, ok=True, token=tok))  # ends it, where the forger did not
        await asyncio.sleep(0.2)
        forger.close()
    return {"claimed": "Export", "lease_after_forged_notif": lease, "claim_ended_by_forger": lease == 0.0}


async def _claim_first(opts) -> dict:
    """An insider that saw BOUND's token (on the router's path, in a log) asks for it first; then the decode
    it was issued for asks. Before capabilities were bound, the insider got the Export and the decode was
    refused (CLAIMED)."""
    from hybridkv import wire

    rid, tok = BOUND[0], peers.token(BOUND[0])
    insider, ich = await _authenticated()
    decode, dch = await _authenticated(name=CLAIMANT)
    await ich.send(wire.Want(request_id=rid, token=tok))
    insider_got = await _collect(ich, 0.5)  # the producer has its Want before the decode's
    await dch.send(wire.Want(request_id=rid, token=tok))
    decode_got = [await _reply(dch, 5.0)]
    for ch, got in ((ich, insider_got), (dch, decode_got)):  # whoever holds the claim ends it
        if any(isinstance(m, wire.Export) for m in got):
            await ch.send(wire.Done(request_id=rid, ok=True, token=tok))
    await asyncio.sleep(0.2)
    for ch in (ich, dch):
        await ch.close()
    return {"insider_got": sorted(_describe(m) for m in insider_got),
            "decode_got": sorted(_describe(m) for m in decode_got)}


_KEEP: list = []  # receive buffers of cancelled raw receives: UCX may still write into them


async def _raw_recv(ch) -> bytes:
    """One frame as it travels (sealed or not), unparsed: what a relay forwards."""
    import numpy as np

    header = np.zeros(1, dtype="<u8")
    _KEEP.append(header)
    await ch._ep.recv(header)
    body = np.empty(max(1, min(int(header[0]), 1 << 25)), dtype=np.uint8)
    _KEEP.append(body)
    await ch._ep.recv(body)
    return body.tobytes()


async def _raw_send(ch, data: bytes) -> None:
    import numpy as np

    await ch._ep.send(np.array([len(data)], dtype="<u8"))
    await ch._ep.send(np.frombuffer(data, dtype=np.uint8).copy())


async def _settle(dp, xfer, others, timeout_s: float = 5.0) -> str:
    """A transfer's end, pumping this agent and the others (the target must be progressed)."""
    stop = time.monotonic() + timeout_s
    while time.monotonic() < stop:
        state = dp.state(xfer)
        if state.name != "IN_PROGRESS":
            return state.name
        for other in others:
            other.pump()
        await asyncio.sleep(0.002)
    return "IN_PROGRESS"


async def _relay(opts) -> dict:
    """A peer without the secret that a legitimate decode dials (vLLM lets a client's request name the
    producer): it forwards the handshake both ways, keeps the decode's Hello and sends the producer its
    own instead. Once with the frames as they are, once rewriting the address the decode dialled to the
    producer's. What it got: the producer's NIXL metadata (then it READs a page, compared with the
    producer's known contents) and the decode's (then it WRITEs a page of the decode's, checked there)."""
    return {mode: await _relay_once(rewrite) for mode, rewrite in (("forwarded", False), ("rewritten", True))}


async def _relay_once(rewrite: bool) -> dict:
    import dataclasses

    import numpy as np

    from hybridkv import wire
    from hybridkv.errors import HybridKVError
    from hybridkv.transport import control
    from hybridkv.transport.dataplane import Op
    from hybridkv.transport.memory import MemoryMap

    decode, dlayout = _new_consumer_with_layout(peers.SECRET, seed=5, handshake_timeout_s=3.0, handshake_retries=0)
    relay, rlayout = _new_consumer_with_layout(None, seed=4)
    _INSIDERS.extend([decode, relay])
    got: dict = {"frames": []}
    tasks: list = []
    channels: list = []

    async def pump(src, dst, to_producer: bool):
        while True:
            frame = await _raw_recv(src)
            try:
                msg = wire.decode(frame)
            except Exception:
                msg = None  # sealed, or not ours to read
            if to_producer and isinstance(msg, wire.Hello):
                got["decode_hello"] = msg  # the decode's metadata: kept, and ours sent in its place
                await dst.send(relay.hello())
                got["injected"] = True
                continue
            if not to_producer and isinstance(msg, wire.Hello) and got.get("injected"):
                got["producer_hello"] = msg
                continue
            if rewrite and to_producer and isinstance(msg, wire.Auth) and getattr(msg, "address", ""):
                frame = wire.encode(dataclasses.replace(msg, address="%s:%d" % _ADDR))
            got["frames"].append(("to producer: " if to_producer else "to decode: ") + _describe(msg or "sealed"))
            await _raw_send(dst, frame)

    async def on_connect(ch_d):
        ch_p = await _dial()
        channels.extend([ch_d, ch_p])
        tasks.extend([asyncio.ensure_future(pump(ch_d, ch_p, True)), asyncio.ensure_future(pump(ch_p, ch_d, False))])

    listener = control.listen(on_connect, port=0)
    try:
        await decode.connect("127.0.0.1", int(listener.port))
        said = "connected"
    except HybridKVError as exc:
        said = f"{type(exc).__name__}: {exc}"
    await asyncio.sleep(0.5)
    report = {"decode_said": said, "frames": got["frames"], "producer_metadata": "producer_hello" in got,
              "decode_metadata": "decode_hello" in got, "read_byte_exact": None, "write_landed": None}
    if "producer_hello" in got:
        ph = got["producer_hello"]
        agent = relay.dp.add_peer(ph.metadata, MemoryMap(regions=ph.regions, groups=ph.groups, table=ph.layout))
        r0, l0 = ph.regions[0], relay.memory.regions[0]
        x = relay.dp.post_rows(Op.READ, agent, np.array([[l0.base_addr, r0.page_bytes, l0.device_id]]),
                               np.array([[r0.base_addr, r0.page_bytes, r0.device_id]]))
        state = await _settle(relay.dp, x, [])
        reference = peers.build(1)[0]  # the producer's memory is filled from seed 1
        want = reference.allocations[0].owner[:r0.page_bytes].tobytes()
        report["read_byte_exact"] = state == "DONE" and rlayout.allocations[0].owner[:r0.page_bytes].tobytes() == want
    if "decode_hello" in got:
        dh = got["decode_hello"]
        agent = relay.dp.add_peer(dh.metadata, MemoryMap(regions=dh.regions, groups=dh.groups, table=dh.layout))
        d0, l0 = dh.regions[0], relay.memory.regions[0]
        before = dlayout.allocations[0].owner[:d0.page_bytes].tobytes()
        x = relay.dp.post_rows(Op.WRITE, agent, np.array([[l0.base_addr + l0.stride, d0.page_bytes, l0.device_id]]),
                               np.array([[d0.base_addr, d0.page_bytes, d0.device_id]]))
        state = await _settle(relay.dp, x, [decode.dp])  # a decode's loop pumps its agent as it serves others
        after = dlayout.allocations[0].owner[:d0.page_bytes].tobytes()
        ours = rlayout.allocations[0].owner[l0.stride:l0.stride + d0.page_bytes].tobytes()
        report["write_landed"] = state == "DONE" and after == ours != before
    for ch in channels:
        await ch.close()
    for t in tasks:
        t.cancel()
    listener.close()
    return report


_ATTACKS = {"relay": _relay, "no_secret": _no_secret, "forged_hello": _forged_hello, "big_frames": _big_frames,
            "unknown_tags": _unknown_tags, "raw_tcp": _raw_tcp, "close_wait": _close_wait, "half_open": _half_open, "claim": _claim,
            "heartbeat_flood": _heartbeat_flood, "want_flood": _want_flood,
            "cut_off_backlog": _cut_off_backlog, "forged_notif": _forged_notif, "claim_first": _claim_first}
_ADDR: tuple[str, int] = ("127.0.0.1", 0)


_OUT = _INBOX = None  # the attacker process's queues to the test (half_open hands over mid-attack)


def _attacker_entry(opts: dict, out, inbox) -> None:
    global _ADDR, _OUT, _INBOX
    _ADDR = tuple(opts["addr"])
    _OUT, _INBOX = out, inbox
    attacker_main(opts, out, inbox)


# ============================================================== the producer, watched
def _sample(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return {"rss": rss, "fds": fds, "cpu": cpu, "t": time.monotonic()}


class Monitor(threading.Thread):
    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.every_s = pid, every_s
        self.samples: list[dict] = [_sample(pid)]
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            try:
                self.samples.append(_sample(self.pid))
            except (OSError, StopIteration):
                return

    def mark(self) -> int:
        self.samples.append(_sample(self.pid))
        return len(self.samples) - 1

    def stop(self) -> None:
        self._halt.set()
        self.join(2)


def _legit_during_half_open(att, cons) -> list[str]:
    """Six legitimate consumers, side by side in one process started beforehand (the secret, default
    handshake timeout and retries), while the half-open flood runs."""
    try:
        att.expect("flooding", 60.0)
        cons.send("go")
        return cons.expect("said", 90.0)
    finally:
        att.send("legit-done")
        cons.stop()


def _legit_main(opts: dict, out, inbox) -> None:
    peers._quiet()
    try:
        out.put(("said", asyncio.run(_legit_connect(opts, inbox))))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


async def _legit_connect(opts: dict, inbox) -> list[str]:
    from hybridkv.errors import HybridKVError

    async def one(cons) -> str:
        try:
            await cons.connect(*opts["addr"])
            return "connected"
        except HybridKVError as exc:
            return f"{type(exc).__name__}: {exc}"

    consumers = [_new_consumer(peers.SECRET, handshake_timeout_s=5.0) for _ in range(opts["consumers"])]
    await peers._await_inbox(inbox, "go", None, timeout_s=120.0)  # made while other attacks run
    try:
        return list(await asyncio.gather(*(one(c) for c in consumers)))
    finally:
        for c in consumers:
            await c.close()


def run(attacks, *, scale: int = 1, settle_s: float = 1.0, handshake_timeout_s: float = 2.0,
        idle_connection_s: float = 1.5, **over) -> dict:
    """Producer, attacks, then the legitimate consumer; what the producer paid and what the
    consumer got. Raises AssertionError (with the processes' words) where a process failed."""
    knobs = {k: (v * scale if k in ("connections", "heartbeats", "wants", "close_wait") else v) for k, v in SMALL.items()}
    if scale > 1:
        knobs["wants"] = max(knobs["wants"], 65536)
    knobs.update(over)
    knobs["wants_per_peer"] = SMALL_WANTS_PER_PEER if scale == 1 else 4096
    bound = "claim_first" in attacks
    extra = ([VICTIM] if "forged_notif" in attacks else []) + ([BOUND] if bound else [])
    prod = harness.producer(requests=REQUESTS + extra,
                            claimants={BOUND[0]: [CLAIMANT]} if bound else {},
                            handshake_timeout_s=handshake_timeout_s, peer_timeout_s=120.0,
                            linger_s=0.5, max_wants_per_peer=knobs["wants_per_peer"],
                            idle_connection_s=idle_connection_s)
    try:
        host, port, pid = prod.expect("addr")
        mon = Monitor(pid)
        mon.start()
        time.sleep(0.3)
        before = mon.mark()
        cpu0 = mon.samples[before]
        att = harness.Proc(_attacker_entry, {"attacks": list(attacks), "addr": (host, port), "pid": pid, **knobs})
        legit = harness.Proc(_legit_main, {"addr": (host, port), "consumers": 6}) if "half_open" in attacks else None
        try:
            legit_during = _legit_during_half_open(att, legit) if legit is not None else None
            reports = att.expect("report", 120.0)
            if legit_during is not None:
                reports["half_open"].update(consumers=legit_during,
                                            connected=sum(s == "connected" for s in legit_during))
        finally:
            att.p.join(20)
            if att.p.is_alive():
                att.p.kill()
        attacked = mon.mark()
        time.sleep(settle_s)
        settled = mon.mark()
        cons = harness.consumer((host, port), requests=REQUESTS)
        sent = prod.expect("digests")
        results = cons.expect("results")
        got = cons.expect("digests")
        cstate = cons.expect("state")
        presults = prod.expect("results")
        pstate = prod.expect("state")
        cons.expect("finished")
        # The consumer's own connection closes after the producer's linger (0.5 s) and UCX's
        # teardown, so "after" waits for the count to come back; a leaked fd never does.
        deadline = time.monotonic() + 5.0
        after = mon.mark()
        while mon.samples[after]["fds"] > mon.samples[before]["fds"] and time.monotonic() < deadline:
            time.sleep(0.1)
            after = mon.mark()
        mon.stop()
        window = mon.samples[before:attacked + 1]
        s = mon.samples
        return {
            "attacks": reports,
            "rss_mb": {"before": s[before]["rss"] / 1e6, "peak": max(x["rss"] for x in s[before:]) / 1e6,
                       "after_attack": s[settled]["rss"] / 1e6, "after": s[after]["rss"] / 1e6},
            "fds": {"before": s[before]["fds"], "peak": max(x["fds"] for x in s[before:]),
                    "after_attack": s[settled]["fds"], "after": s[after]["fds"]},
            "cpu_pct_during_attack": 100 * (window[-1]["cpu"] - cpu0["cpu"]) / max(1e-6, window[-1]["t"] - cpu0["t"]),
            # after the attacker is gone, until the legitimate consumer comes (a leak keeps burning)
            "cpu_pct_after_attack": 100 * (s[settled]["cpu"] - s[attacked]["cpu"]) / max(1e-6, s[settled]["t"] - s[attacked]["t"]),
            "legit": {rid: outcome for rid, outcome, *_ in results},
            "byte_exact": got == {rid: sent[rid] for rid, _, _ in REQUESTS},
            "producer": {rid: outcome for rid, outcome, _ in presults},
            "consumer_in_flight": cstate["in_flight"],
            "producer_free": pstate["free"] == pstate["total"], "producer_in_flight": pstate["in_flight"],
            "producer_requests": pstate["requests"], "stats": pstate["stats"],
            # Wants still waiting for an export in the producer's tables once every peer is gone
            "producer_wants_ahead": pstate.get("wants_ahead"),
        }
    finally:
        prod.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=8, help="multiplies connections, heartbeats and wants (default 8)")
    ap.add_argument("--attack", action="append", choices=ATTACKS, help="run only these (default: every one)")
    ap.add_argument("--tag-bytes", type=int, default=SMALL["tag_bytes"], help="unknown_tags: bytes per message")
    ap.add_argument("--tag-seconds", type=float, default=SMALL["tag_seconds"], help="unknown_tags: how long each sends")
    ap.add_argument("--tag-connections", type=int, help="unknown_tags: connections (default: 8 x scale)")
    ap.add_argument("--close-wait", type=int, help="close_wait: connections (default: 150 x scale)")
    ap.add_argument("--settle-s", type=float, default=2.0, help="how long after the attack the producer is sampled")
    ap.add_argument("--hold-s", type=float, default=SMALL["hold_s"], help="raw_tcp: how long the connections stay open")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for name in args.attack or ATTACKS:
        t0 = time.monotonic()
        over = {"tag_bytes": args.tag_bytes, "tag_seconds": args.tag_seconds, "hold_s": args.hold_s}
        if name == "unknown_tags" and args.tag_connections:
            over["connections"] = args.tag_connections
        if args.close_wait:
            over["close_wait"] = args.close_wait
        r = run([name], scale=args.scale, settle_s=args.settle_s, handshake_timeout_s=max(2.0, args.tag_seconds + 1),
                **over)
        r["wall_s"] = time.monotonic() - t0
        rows.append((name, r))
        if args.json:
            print(json.dumps({"attack": name, **r}, default=str), flush=True)
    if not args.json:
        print(f"{'attack':16} {'what the attacker did / was told':58} {'RSS MB before/peak/after':>25} "
              f"{'fds before/peak/after':>22} {'CPU% during/after':>9}  legit")
        for name, r in rows:
            a = r["attacks"][name]
            what = {k: v for k, v in a.items() if k != "seconds"}
            rss, fds = r["rss_mb"], r["fds"]
            legit = "byte-exact" if r["byte_exact"] and set(r["legit"].values()) == {"READY"} else f"FAILED {r['legit']}"
            print(f"{name:16} {json.dumps(what, default=str)[:58]:58} "
                  f"{rss['before']:7.0f}/{rss['peak']:5.0f}/{rss['after_attack']:5.0f}  "
                  f"{fds['before']:8d}/{fds['peak']:4d}/{fds['after_attack']:4d}  {r['cpu_pct_during_attack']:5.0f}"
                  f"/{r['cpu_pct_after_attack']:3.0f}  "
                  f"{legit}; producer freed all: {r['producer_free']}")
            print(f"{'':16} stats {r['stats']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
