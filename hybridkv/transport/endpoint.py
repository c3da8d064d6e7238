"""Producer and consumer endpoints: handshake, exports, pulls/pushes, leases, failures.

A :class:`Producer` (prefill) listens; a :class:`Consumer` (decode) dials it.
Both drive their transfers through a :class:`~hybridkv.scheduler.TransferScheduler`:
a transfer is posted only when the fence allows it (``post_export`` /
``post_import``) and its end is reported back (``transfer_landed`` /
``transfer_failed``), so the fence table stays consistent on every path.

Completion travels as a NIXL notification (``hkv:<request id>``), which
reaches the target after the data: in pull mode the consumer's READ tells the
producer it may free the blocks; in push mode the producer's WRITE tells the
consumer its blocks are filled. The control channel carries the rest
(:mod:`hybridkv.wire`). A push transfer is terminal for the consumer only on
the notification, on the producer's word that it will not write (``Done``/
``Failure``) or on losing the producer, never on a timer alone: bytes may still
land in the blocks otherwise (rule 5).

Everything runs on one asyncio loop, which also pumps the NIXL agent (the
progress thread is off by default; anchors/nixl.md §1.3).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from hybridkv import wire
from hybridkv.errors import HandshakeRefused, HandshakeTimeout, PeerLost, ProtocolViolation
from hybridkv.transport import control
from hybridkv.transport.dataplane import DataPlane, DataPlaneConfig, Op, Transfer, XferState
from hybridkv.transport.memory import MemoryMap, check_peer_shapes, pair_indices

NOTIF_PREFIX = b"hkv:"


class FailurePolicy(enum.Enum):
    """What a failed import turns into (vLLM's ``kv_load_failure_policy``)."""

    FAIL = "fail"  # the request is aborted
    RECOMPUTE = "recompute"  # the request computes its prompt locally


class Outcome(enum.Enum):
    READY = "ready"  # consumer: every component arrived
    RECOMPUTE = "recompute"  # consumer: import failed, request recomputes locally
    DONE = "done"  # producer: consumer finished with the blocks
    FAILED = "failed"  # request failed (aborted)
    EXPIRED = "expired"  # producer: the lease lapsed first


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    host: str = "127.0.0.1"  # interface the producer advertises / the consumer dials
    port: int = 0
    mode: wire.Mode = wire.Mode.PULL
    handshake_timeout_s: float = 5.0
    export_timeout_s: float = 30.0  # consumer: how long to wait for the producer's Export
    heartbeat_s: float | None = None  # default: lease / 6 (vLLM's choice)
    lease_margin: float = 0.1  # fraction of a granted lease the consumer does not rely on
    failure_policy: FailurePolicy = FailurePolicy.FAIL
    pump_busy_s: float = 0.0002
    pump_idle_s: float = 0.005
    dataplane: DataPlaneConfig = DataPlaneConfig()


@dataclass(frozen=True, kw_only=True)
class Result:
    request_id: str
    outcome: Outcome
    error: str | None = None
    descriptors: int | None = None  # what NIXL posted (telemetry)
    indices: int | None = None  # index pairs handed to NIXL
    nbytes: int = 0
    seconds: float = 0.0  # post -> done


@dataclass(kw_only=True)
class Stats:
    duplicates: int = 0  # completions for a transfer already terminal
    unknown: int = 0  # completions for nothing we know
    refused: int = 0  # handshakes refused
    rejected: int = 0  # messages refused (malformed, unexported blocks)


@dataclass(eq=False, kw_only=True)
class _Peer:
    agent: str
    channel: control.Channel
    memory: MemoryMap
    lease_s: float
    alive: bool = True


def _rid_of(notif: bytes) -> str | None:
    if not notif.startswith(NOTIF_PREFIX):
        return None
    try:
        return notif[len(NOTIF_PREFIX):].decode()
    except UnicodeDecodeError:
        return None


class _Side:
    role: wire.Role

    def __init__(self, memory: MemoryMap, scheduler, config: TransportConfig = TransportConfig()) -> None:
        self.memory = memory
        self.scheduler = scheduler
        self.config = config
        self.dp = DataPlane(memory, config.dataplane)
        self.compat = {**memory.shape_fields(), "protocol": str(wire.PROTOCOL_VERSION), "mode": config.mode.name}
        self.stats = Stats()
        self._pump_task: asyncio.Task | None = None
        self._busy = 0
        self._closing = False

    def hello(self) -> wire.Hello:
        return wire.Hello(
            agent=self.dp.name, metadata=self.dp.metadata(), role=self.role, mode=self.config.mode,
            compat=self.compat, compat_hash=wire.compat_hash(self.compat), regions=self.memory.regions,
            groups=self.memory.groups, lease_s=float(self.scheduler.leases.duration_s),
        )

    def check_hello(self, h: wire.Hello) -> MemoryMap:
        """Refuse an incompatible peer, saying what differs; returns its memory map."""
        if h.role is self.role:
            raise HandshakeRefused("both peers have one role", [
                wire.Difference(field="role", local=self.role.name, remote=h.role.name)])
        if wire.compat_hash(h.compat) != h.compat_hash:
            raise HandshakeRefused("the peer's compatibility hash does not match its own fields")
        diffs = wire.compat_differences(self.compat, h.compat)
        if diffs:
            raise HandshakeRefused("incompatible peer", diffs)
        remote = MemoryMap(regions=h.regions, groups=h.groups)
        check_peer_shapes(self.memory, h.regions, h.groups)
        return remote

    def _start_pump(self) -> None:
        if self._pump_task is None:
            self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        cfg = self.config
        while not self._closing:
            for agent, msgs in self.dp.pump().items():
                for m in msgs:
                    self._on_notif(agent, m)
            self._tick()
            await asyncio.sleep(cfg.pump_busy_s if self._busy else cfg.pump_idle_s)

    def _on_notif(self, agent: str, msg: bytes) -> None:  # pragma: no cover - overridden
        pass

    def _tick(self) -> None:
        pass

    async def _wait_xfer(self, xfer: Transfer) -> XferState:
        self._busy += 1
        try:
            while (s := self.dp.state(xfer)) is XferState.IN_PROGRESS:
                await asyncio.sleep(0)
            return s
        finally:
            self._busy -= 1

    async def close(self) -> None:
        self._closing = True
        if self._pump_task is not None:
            self._pump_task.cancel()
            try:
                await self._pump_task
            except (asyncio.CancelledError, Exception):
                pass
        self.dp.close()


# ====================================================================== producer
@dataclass(eq=False, kw_only=True)
class _Export:
    rid: str
    tid: int
    peer: _Peer
    blocks: dict[int, np.ndarray]
    done: asyncio.Future
    xfer: Transfer | None = None
    abort_asked: bool = False


class Producer(_Side):
    """Prefill side: exports finished requests to connected consumers."""

    role = wire.Role.PRODUCER

    def __init__(self, memory: MemoryMap, scheduler, config: TransportConfig = TransportConfig()) -> None:
        super().__init__(memory, scheduler, config)
        self.peers: dict[str, _Peer] = {}
        self._exports: dict[str, _Export] = {}
        self._connected = asyncio.Event()
        self._listener = None
        # Recently terminal requests and completion notifications seen, so a repeated
        # or crossing completion is told apart from a stray one (bounded).
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._notified: OrderedDict[str, None] = OrderedDict()

    async def start(self) -> tuple[str, int]:
        self._listener = control.listen(self._accept, self.config.port)
        self._start_pump()
        return self.config.host, int(self._listener.port)

    async def wait_peer(self, timeout_s: float) -> None:
        await asyncio.wait_for(self._connected.wait(), timeout_s)

    async def _accept(self, ch: control.Channel) -> None:
        try:
            msg = await asyncio.wait_for(ch.recv(), self.config.handshake_timeout_s)
            if not isinstance(msg, wire.Hello):
                raise ProtocolViolation(f"first message is {type(msg).__name__}; expected Hello")
            remote = self.check_hello(msg)
        except HandshakeRefused as exc:
            self.stats.refused += 1
            await _send_quietly(ch, wire.Refuse(reason=str(exc)[: wire.MAX_TEXT], differences=exc.differences))
            await ch.close()
            return
        except (asyncio.TimeoutError, PeerLost, ProtocolViolation, wire.WireError) as exc:
            self.stats.refused += 1
            await _send_quietly(ch, wire.Refuse(reason=f"handshake failed: {exc}"[: wire.MAX_TEXT], differences=()))
            await ch.close()
            return
        agent = self.dp.add_peer(msg.metadata, remote)
        peer = _Peer(agent=agent, channel=ch, memory=remote, lease_s=msg.lease_s)
        self.peers[agent] = peer
        try:
            await ch.send(self.hello())
        except PeerLost:
            self._peer_lost(peer)
            return
        self._connected.set()
        await self._serve(peer)

    async def _serve(self, peer: _Peer) -> None:
        while not self._closing:
            try:
                msg = await peer.channel.recv()
            except wire.WireError:
                self.stats.rejected += 1
                continue
            except PeerLost:
                self._peer_lost(peer)
                return
            self._on_message(peer, msg)

    def _on_message(self, peer: _Peer, msg: wire.Message) -> None:
        if isinstance(msg, wire.Heartbeat):
            leases = []
            for rid in msg.request_ids:
                lease = self.scheduler.heartbeat(rid) if rid in self._exports else None
                left = 0.0 if lease is None else max(0.0, lease.deadline - self.scheduler.leases.now())
                leases.append(wire.Lease(request_id=rid, lease_s=left))
            for lease in leases:
                asyncio.ensure_future(_send_quietly(peer.channel, lease))
        elif isinstance(msg, wire.Import):
            self._on_import(peer, msg)
        elif isinstance(msg, (wire.Done, wire.Failure)):
            rec = self._exports.get(msg.request_id)
            if rec is None or rec.peer is not peer:
                if msg.request_id not in self._finished:
                    self.stats.unknown += 1
                return
            if isinstance(msg, wire.Done) and msg.ok:
                if self.config.mode is wire.Mode.PULL:
                    # The consumer's READ completed on its side: the blocks are no longer
                    # needed. Its NIXL notification says the same and may come later.
                    self._finish(rec, ok=True, outcome=Outcome.DONE)
                return
            if rec.xfer is not None:
                rec.abort_asked = True  # finish the write first; the blocks are read until then
                return
            detail = msg.detail if isinstance(msg, wire.Failure) else "consumer failed the transfer"
            self._finish(rec, ok=False, outcome=Outcome.FAILED, error=detail, tell=wire.Done(
                request_id=rec.rid, ok=False))
        elif isinstance(msg, wire.Bye):
            self._peer_lost(peer)
        else:
            self.stats.rejected += 1

    def _on_import(self, peer: _Peer, msg: wire.Import) -> None:
        rec = self._exports.get(msg.request_id)
        if rec is None or rec.peer is not peer or self.config.mode is not wire.Mode.PUSH or rec.xfer is not None:
            self.stats.rejected += 1
            return
        try:
            wire.check_blocks(msg.blocks, peer.memory.group_bounds(), what=f"import of {msg.request_id}")
            dst = {g.group_id: np.asarray(g.ids, dtype=np.int64) for g in msg.blocks}
            li, ri = pair_indices(self.memory, rec.blocks, peer.memory, dst)
            rec.xfer = self.dp.post(Op.WRITE, peer.agent, li, ri, NOTIF_PREFIX + rec.rid.encode())
        except Exception as exc:  # bad block lists, NIXL refusal
            self.stats.rejected += 1
            self._finish(rec, ok=False, outcome=Outcome.FAILED, error=str(exc),
                         tell=wire.Failure(request_id=rec.rid, code=wire.FailureCode.TRANSFER_ERROR,
                                           detail=str(exc)[: wire.MAX_TEXT]))
            return
        self._busy += 1
        asyncio.ensure_future(self._watch_write(rec))

    async def _watch_write(self, rec: _Export) -> None:
        try:
            state = await self._wait_xfer(rec.xfer)
        finally:
            self._busy -= 1
        if state is XferState.DONE and not rec.abort_asked:
            self._finish(rec, ok=True, outcome=Outcome.DONE)
        elif state is XferState.DONE:
            # The consumer gave up but the bytes landed; its notification tells it so.
            self._finish(rec, ok=True, outcome=Outcome.FAILED, error="consumer aborted")
        else:
            self._finish(rec, ok=False, outcome=Outcome.FAILED, error="WRITE failed",
                         tell=wire.Failure(request_id=rec.rid, code=wire.FailureCode.TRANSFER_ERROR,
                                           detail="WRITE failed"))

    async def export(self, request_id: str, *, peer: str | None = None) -> Result:
        """Offer a finished request (``request_finished(export=True)`` done) to a consumer
        and wait until it is done with the blocks, failed, or the lease lapsed."""
        sched = self.scheduler
        if peer is None:
            if len(self.peers) != 1:
                raise ValueError(f"{len(self.peers)} peers connected; expected exactly one or a peer name")
            target = next(iter(self.peers.values()))
        else:
            target = self.peers.get(peer)
            if target is None:
                raise ValueError(f"peer {peer!r}; expected one of {sorted(self.peers)}")
        while True:
            if not sched.has_request(request_id):  # the lease lapsed (poll) before we got here
                return Result(request_id=request_id, outcome=Outcome.EXPIRED, error="lease expired before export")
            if sched.export_ready(request_id):
                break
            await asyncio.sleep(self.config.pump_idle_s)  # the engine advances the watermark
        tid = sched.post_export(request_id)
        if not tid and not isinstance(tid, int):
            return Result(request_id=request_id, outcome=Outcome.EXPIRED, error=tid.reason.value)
        blocks = {g.group_id: np.asarray(sched.blocks(request_id, g.group_id), dtype=np.int64)
                  for g in self.memory.groups}
        rec = _Export(rid=request_id, tid=tid, peer=target, blocks=blocks,
                      done=asyncio.get_running_loop().create_future())
        self._exports[request_id] = rec
        deadline = sched.leases.deadline(request_id)
        left = max(0.0, deadline - sched.leases.now()) if deadline is not None else 0.0
        try:
            await target.channel.send(wire.Export(
                request_id=request_id, lease_s=left,
                blocks=tuple(wire.GroupBlocks(group_id=g, ids=tuple(b.tolist())) for g, b in blocks.items())))
        except PeerLost:
            self._peer_lost(target)
        return await rec.done

    def _on_notif(self, agent: str, msg: bytes) -> None:
        rid = _rid_of(msg)
        if rid is not None and rid in self._notified:
            self.stats.duplicates += 1  # a completion repeated: already terminal, ignored
            return
        if rid is not None:
            _remember(self._notified, rid)
        rec = self._exports.get(rid) if rid is not None else None
        if rec is None or rec.peer.agent != agent or self.config.mode is not wire.Mode.PULL:
            if rid not in self._finished:
                self.stats.unknown += 1  # never ours (or not from that peer): ignored
            return
        self._finish(rec, ok=True, outcome=Outcome.DONE)

    def _tick(self) -> None:
        for rid in self.scheduler.poll():  # lapsed leases: the scheduler dropped the request
            rec = self._exports.get(rid)
            if rec is None or rec.xfer is not None:
                continue  # a WRITE in flight ends through _watch_write
            self._finish(rec, ok=False, outcome=Outcome.EXPIRED, error="lease expired", tell=wire.Failure(
                request_id=rid, code=wire.FailureCode.LEASE_EXPIRED, detail="lease expired"))

    def _finish(self, rec: _Export, *, ok: bool, outcome: Outcome, error: str | None = None,
                tell: wire.Message | None = None) -> None:
        if self._exports.get(rec.rid) is not rec:
            return
        del self._exports[rec.rid]
        _remember(self._finished, rec.rid)
        sched = self.scheduler
        (sched.transfer_landed if ok else sched.transfer_failed)(rec.tid)
        if sched.has_request(rec.rid):
            if outcome is Outcome.DONE or outcome is Outcome.FAILED and rec.peer.alive:
                sched.export_done(rec.rid)
            else:
                sched.abort(rec.rid)  # peer gone: held until the lease lapses (it may have been reading)
        if rec.xfer is not None:
            self.dp.release(rec.xfer)
        if tell is not None and rec.peer.alive:
            asyncio.ensure_future(_send_quietly(rec.peer.channel, tell))
        if not rec.done.done():
            rec.done.set_result(Result(request_id=rec.rid, outcome=outcome, error=error))

    def _peer_lost(self, peer: _Peer) -> None:
        if not peer.alive:
            return
        peer.alive = False
        self.peers.pop(peer.agent, None)
        for rec in [r for r in self._exports.values() if r.peer is peer]:
            if rec.xfer is None:
                self._finish(rec, ok=False, outcome=Outcome.FAILED, error="consumer lost")
            else:
                rec.abort_asked = True
        try:
            self.dp.remove_peer(peer.agent)
        except Exception:
            pass

    async def close(self) -> None:
        self._closing = True
        for peer in list(self.peers.values()):
            await _send_quietly(peer.channel, wire.Bye(reason="closing"))
            await peer.channel.close()
        if self._listener is not None:
            self._listener.close()
        await super().close()


# ====================================================================== consumer
@dataclass(eq=False, kw_only=True)
class _Import:
    rid: str
    export: asyncio.Future  # -> (wire.Export, receipt time)
    deadline: float = float("inf")
    landed: asyncio.Event = field(default_factory=asyncio.Event)
    failed: str | None = None  # the producer will not write / the blocks are gone
    lease_lost: bool = False
    notified: bool = False


class Consumer(_Side):
    """Decode side: dials a producer and imports requests from it."""

    role = wire.Role.CONSUMER

    def __init__(self, memory: MemoryMap, scheduler, config: TransportConfig = TransportConfig()) -> None:
        super().__init__(memory, scheduler, config)
        self.peer: _Peer | None = None
        self._imports: dict[str, _Import] = {}
        self._tasks: list[asyncio.Task] = []
        self._hb_sent: dict[int, float] = {}
        self._seq = 0

    async def connect(self, host: str, port: int) -> None:
        """Handshake; raises HandshakeRefused (saying what differs), HandshakeTimeout or PeerLost."""
        timeout = self.config.handshake_timeout_s
        try:
            async with asyncio.timeout(timeout):
                ch = await control.dial(host, port, timeout)
                await ch.send(self.hello())
                reply = await ch.recv()
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise HandshakeTimeout(f"no handshake from {host}:{port} within {timeout} s") from exc
        if isinstance(reply, wire.Refuse):
            await ch.close()
            raise HandshakeRefused(f"refused by {host}:{port}: {reply.reason}", reply.differences)
        if not isinstance(reply, wire.Hello):
            await ch.close()
            raise ProtocolViolation(f"handshake reply is {type(reply).__name__}; expected Hello or Refuse")
        try:
            remote = self.check_hello(reply)
        except HandshakeRefused:
            await _send_quietly(ch, wire.Bye(reason="incompatible"))
            await ch.close()
            raise
        agent = self.dp.add_peer(reply.metadata, remote)
        self.dp.connect(agent)
        self.peer = _Peer(agent=agent, channel=ch, memory=remote, lease_s=reply.lease_s)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._serve()), loop.create_task(self._heartbeats())]
        self._start_pump()

    def _imp(self, rid: str) -> _Import:
        imp = self._imports.get(rid)
        if imp is None:
            imp = _Import(rid=rid, export=asyncio.get_running_loop().create_future())
            self._imports[rid] = imp
        return imp

    async def _serve(self) -> None:
        peer = self.peer
        while not self._closing:
            try:
                msg = await peer.channel.recv()
            except wire.WireError:
                self.stats.rejected += 1
                continue
            except PeerLost:
                self._lost()
                return
            if isinstance(msg, wire.Export):
                imp = self._imp(msg.request_id)
                if not imp.export.done():
                    imp.export.set_result((msg, time.monotonic()))
            elif isinstance(msg, wire.Lease):
                self._on_lease(msg)
            elif isinstance(msg, (wire.Failure, wire.Done)):
                imp = self._imports.get(msg.request_id)
                if imp is None:
                    self.stats.unknown += 1
                elif not (isinstance(msg, wire.Done) and msg.ok):
                    imp.failed = msg.detail if isinstance(msg, wire.Failure) else "producer failed"
                    imp.landed.set()
            elif isinstance(msg, wire.Bye):
                self._lost()
                return
            else:
                self.stats.rejected += 1

    def _lost(self) -> None:
        if self.peer is not None and self.peer.alive:
            self.peer.alive = False
            for imp in self._imports.values():
                imp.failed = imp.failed or "producer lost"
                if not imp.export.done():
                    imp.export.set_exception(PeerLost("producer lost"))
                imp.landed.set()

    def _on_lease(self, msg: wire.Lease) -> None:
        imp = self._imports.get(msg.request_id)
        if imp is None:
            return
        if msg.lease_s <= 0:
            imp.lease_lost = True
            return
        # Conservative: from when our renewal left, not when the answer came (lease.py).
        sent = min(self._hb_sent.values(), default=time.monotonic())
        deadline = sent + msg.lease_s * (1 - self.config.lease_margin)
        if deadline > imp.deadline or imp.deadline == float("inf"):
            imp.deadline = deadline
            if self.scheduler.has_request(msg.request_id):
                self.scheduler.lease_renewed(msg.request_id, deadline)

    async def _heartbeats(self) -> None:
        period = self.config.heartbeat_s or max(0.05, self.peer.lease_s / 6)
        while not self._closing and self.peer.alive:
            await asyncio.sleep(period)
            rids = tuple(r for r, i in self._imports.items() if i.export.done())
            self._seq += 1
            self._hb_sent = {self._seq: time.monotonic()}
            try:
                await self.peer.channel.send(wire.Heartbeat(seq=self._seq, request_ids=rids))
            except PeerLost:
                self._lost()
                return

    def _on_notif(self, agent: str, msg: bytes) -> None:
        rid = _rid_of(msg)
        imp = self._imports.get(rid) if rid is not None else None
        if imp is None or self.peer is None or agent != self.peer.agent or self.config.mode is not wire.Mode.PUSH:
            self.stats.unknown += 1
            return
        if imp.notified:
            self.stats.duplicates += 1
            return
        imp.notified = True
        imp.landed.set()

    async def fetch(self, request_id: str, components: Iterable) -> Result:
        """Import a request whose blocks the engine allocated (scheduler.add_request(expect=...)).

        Waits for the producer's Export, posts the transfer when the fence allows,
        and ends in a defined state: READY, or per the failure policy RECOMPUTE or FAILED.
        """
        comps = tuple(components)
        imp = self._imp(request_id)
        try:
            try:
                export, received = await asyncio.wait_for(asyncio.shield(imp.export), self.config.export_timeout_s)
            except asyncio.TimeoutError:
                return self._give_up(request_id, comps, "no export from the producer in time")
            except PeerLost as exc:
                return self._give_up(request_id, comps, str(exc))
            return await self._import(imp, export, received, comps)
        finally:
            self._imports.pop(request_id, None)

    async def _import(self, imp: _Import, export: wire.Export, received: float, comps) -> Result:
        sched, rid, peer = self.scheduler, imp.rid, self.peer
        if imp.deadline == float("inf"):
            imp.deadline = received + export.lease_s * (1 - self.config.lease_margin)
        mine = {g.group_id: np.asarray(sched.blocks(rid, g.group_id), dtype=np.int64) for g in self.memory.groups}
        try:
            wire.check_blocks(export.blocks, peer.memory.group_bounds(), what=f"export of {rid}")
            theirs = {g.group_id: np.asarray(g.ids, dtype=np.int64) for g in export.blocks}
            mine = {g: b for g, b in mine.items() if b.size or g in theirs}
            li, ri = pair_indices(self.memory, mine, peer.memory, theirs)
        except ValueError as exc:
            self.stats.rejected += 1
            await _send_quietly(peer.channel, wire.Failure(request_id=rid, code=wire.FailureCode.PROTOCOL,
                                                           detail=str(exc)[: wire.MAX_TEXT]))
            return self._give_up(rid, comps, f"export does not match the request: {exc}")
        while True:
            if imp.lease_lost or imp.failed:
                return self._give_up(rid, comps, imp.failed or "lease lost before the transfer started")
            tid = sched.post_import(rid, components=comps, lease_deadline=imp.deadline)
            if tid or isinstance(tid, int):
                break
            if tid.reason.name == "LEASE_TOO_SHORT":
                return self._give_up(rid, comps, "lease expired before the transfer could start")
            await asyncio.sleep(self.config.pump_idle_s)
        if self.config.mode is wire.Mode.PULL:
            return await self._pull(imp, tid, li, ri)
        return await self._push(imp, tid)

    async def _pull(self, imp: _Import, tid: int, li: np.ndarray, ri: np.ndarray) -> Result:
        rid, peer = imp.rid, self.peer
        t0 = time.perf_counter()
        try:
            xfer = self.dp.post(Op.READ, peer.agent, li, ri, NOTIF_PREFIX + rid.encode())
        except Exception as exc:
            self.scheduler.transfer_failed(tid)
            await _send_quietly(peer.channel, wire.Done(request_id=rid, ok=False))
            return self._policy(rid, str(exc))
        state = await self._wait_xfer(xfer)
        seconds = time.perf_counter() - t0
        tel = self.dp.telemetry(xfer) if self.config.dataplane.telemetry and state is XferState.DONE else None
        self.dp.release(xfer)
        if state is not XferState.DONE:
            self.scheduler.transfer_failed(tid)
            await _send_quietly(peer.channel, wire.Done(request_id=rid, ok=False))
            return self._policy(rid, "READ failed")
        if imp.lease_lost:
            self.scheduler.transfer_failed(tid)
            return self._policy(rid, "lease lapsed during the READ: bytes not trusted")
        outcome = self.scheduler.transfer_landed(tid)
        await _send_quietly(peer.channel, wire.Done(request_id=rid, ok=True))
        if outcome.name != "ACCEPTED":
            return self._policy(rid, f"transfer {outcome.value}")
        return Result(request_id=rid, outcome=Outcome.READY, descriptors=None if tel is None else tel.descriptors,
                      indices=int(li.size), nbytes=xfer.nbytes, seconds=seconds)

    async def _push(self, imp: _Import, tid: int) -> Result:
        rid, peer, sched = imp.rid, self.peer, self.scheduler
        blocks = tuple(wire.GroupBlocks(group_id=g.group_id, ids=tuple(int(b) for b in sched.blocks(rid, g.group_id)))
                       for g in self.memory.groups)
        t0 = time.perf_counter()
        try:
            await peer.channel.send(wire.Import(request_id=rid, blocks=blocks))
        except PeerLost:
            self._lost()
        told = False
        while not imp.landed.is_set():
            left = imp.deadline - time.monotonic()
            if left <= 0 and not told:
                # Past the lease: ask the producer to stop, but keep the blocks quarantined
                # until it confirms or the write lands (it may be in flight).
                told = True
                await _send_quietly(peer.channel, wire.Failure(request_id=rid, code=wire.FailureCode.LEASE_EXPIRED,
                                                               detail="consumer lease deadline passed"))
            try:
                await asyncio.wait_for(imp.landed.wait(), max(left, 0.05) if not told else None)
            except asyncio.TimeoutError:
                pass
        seconds = time.perf_counter() - t0
        if imp.notified and not imp.lease_lost:
            outcome = sched.transfer_landed(tid)  # LATE if past the deadline
            if outcome.name == "ACCEPTED":
                return Result(request_id=rid, outcome=Outcome.READY, seconds=seconds)
            return self._policy(rid, f"transfer {outcome.value}")
        sched.transfer_failed(tid)
        return self._policy(rid, imp.failed or "lease lapsed")

    def _policy(self, rid: str, error: str) -> Result:
        """The import failed after a transfer was posted: apply the failure policy."""
        if self.config.failure_policy is FailurePolicy.RECOMPUTE and self.scheduler.has_request(rid):
            self.scheduler.recompute(rid)
            return Result(request_id=rid, outcome=Outcome.RECOMPUTE, error=error)
        self.scheduler.abort(rid)
        return Result(request_id=rid, outcome=Outcome.FAILED, error=error)

    def _give_up(self, rid: str, comps, error: str) -> Result:
        """Failed before any transfer was posted: nothing is in flight."""
        sched = self.scheduler
        if self.config.failure_policy is FailurePolicy.RECOMPUTE and sched.has_request(rid):
            # The scheduler moves an import to FAILED (from which it may recompute) only
            # through a failed transfer; record one that never reached NIXL.
            tid = sched.post_import(rid, components=comps) if comps else None
            if tid is not None and (tid or isinstance(tid, int)):
                sched.transfer_failed(tid)
                sched.recompute(rid)
                return Result(request_id=rid, outcome=Outcome.RECOMPUTE, error=error)
        sched.abort(rid)
        return Result(request_id=rid, outcome=Outcome.FAILED, error=error)

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        if self.peer is not None and self.peer.alive:
            await _send_quietly(self.peer.channel, wire.Bye(reason="closing"))
            await self.peer.channel.close()
        await super().close()


_REMEMBER = 1 << 16


def _remember(seen: OrderedDict, rid: str) -> None:
    seen[rid] = None
    if len(seen) > _REMEMBER:
        seen.popitem(last=False)


async def _send_quietly(ch: control.Channel, msg: wire.Message) -> None:
    try:
        await ch.send(msg)
    except PeerLost:
        pass
