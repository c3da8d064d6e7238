"""The prefill side: exports finished requests to the consumers that ask for them.

A :class:`Producer` listens; a consumer dials it and asks for a request
(``wire.Want``). A request several decode ranks share (``readers``) ends when
every reader is done; any other claim on it is refused (``FailureCode.CLAIMED``).
The design, pull and push, is in :mod:`hybridkv.transport.endpoint`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from hybridkv import wire
from hybridkv.errors import PeerLost
from hybridkv.fencing import NotYet
from hybridkv.transport import auth, control
from hybridkv.transport.admission import _Admission
from hybridkv.transport.config import Outcome, Result, TransportConfig
from hybridkv.transport.dataplane import Op, Transfer, XferState
from hybridkv.transport.memory import MemoryMap
from hybridkv.transport.metrics import FailureKind
from hybridkv.transport.plan import PeerPlanner, Planner
from hybridkv.transport.side import NOTIF_PREFIX, _Peer, _remember, _rid_of, _send_quietly, _Side

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class _Export:
    rid: str
    tid: int
    token: bytes  # the request's capability: every message about it must carry this
    blocks: dict[int, np.ndarray]
    done: asyncio.Future
    readers: int | None = None  # how many consumers share it (set by the first claim)
    claims: dict[str, _Peer] = field(default_factory=dict)  # agent -> reader
    ended: dict[str, tuple[bool, str | None]] = field(default_factory=dict)  # agent -> (ok, detail)
    xfer: Transfer | None = None
    abort_asked: bool = False
    descriptors: int = 0  # push: what the WRITE posted, and when (for the metrics)
    posted_at: float = 0.0

    @property
    def peer(self) -> _Peer | None:
        """The reader, where there is exactly one (push mode has one)."""
        return next(iter(self.claims.values())) if len(self.claims) == 1 else None


class Producer(_Admission, _Side):
    """Prefill side: exports finished requests to connected consumers."""

    role = wire.Role.PRODUCER

    def __init__(self, memory: MemoryMap, scheduler, config: TransportConfig = TransportConfig(), *,
                 planner: Planner) -> None:
        super().__init__(memory, scheduler, config, planner)
        self._plans: dict[str, PeerPlanner] = {}  # push: the planner prepared per consumer
        self.peers: dict[str, _Peer] = {}
        self._exports: dict[str, _Export] = {}
        self._connected = asyncio.Event()
        self._listener = None
        # Recently terminal requests (with their tokens) and completion notifications seen, so a
        # repeated or crossing completion is told apart from a stray one (bounded).
        self._finished: OrderedDict[str, bytes] = OrderedDict()
        self._notified: OrderedDict[str, None] = OrderedDict()
        # Wants that came before the request was exported (the consumer may be first), with the
        # token each asker holds; bounded per peer and in total (TransportConfig.max_wants*).
        self._wants: dict[str, list[tuple[_Peer, int, bytes]]] = {}
        self._want_count = 0
        self._init_admission()
        # Requests a consumer released before they were exported (it will never read them), with the
        # token it released them with: their export ends as soon as it starts if the tokens match.
        self._released: OrderedDict[str, bytes] = OrderedDict()

    def describe(self) -> dict:
        return {**super().describe(),
                "exports": {r: {"claims": sorted(e.claims), "ended": sorted(e.ended), "readers": e.readers,
                                "writing": e.xfer is not None} for r, e in self._exports.items()},
                "wants_ahead": {r: len(v) for r, v in self._wants.items()}}

    async def start(self) -> tuple[str, int]:
        self._warn_if_open(f"listening on port {self.config.port or '(any)'}")
        self._listener = control.listen(self._accept, self.config.port, allow=self.config.allowlist,
                                        on_refused=self._refused_peer)
        self._strays = control.StrayConnections(int(self._listener.port), idle_s=self.config.idle_connection_s)
        self._start_pump()
        return self.config.host, int(self._listener.port)

    def _refused_peer(self, address: str | None) -> None:
        self.stats.refused_peers += 1
        log.warning("closed a control connection from %s: not in allowed_peers %s",
                    address or "an unreadable address", list(self.config.allowed_peers))

    async def wait_peer(self, timeout_s: float) -> None:
        await asyncio.wait_for(self._connected.wait(), timeout_s)

    async def _serve(self, peer: _Peer) -> None:
        while not self._closing:
            msg = await self._next_message(peer)
            if msg is None:
                self._peer_lost(peer)
                return
            self._on_message(peer, msg)

    def _on_message(self, peer: _Peer, msg: wire.Message) -> None:
        if isinstance(msg, wire.Heartbeat):
            if len(peer.lease_replies) >= _MAX_LEASE_BATCHES:
                # Its earlier renewals are still being answered: a consumer renews every lease/6 s
                # (in batches of up to 1,024 ids), so this is a flood: dropped, not queued.
                self.stats.rejected += 1
                return
            leases = []
            for t in msg.tickets:
                # Only a reader holding the token renews; anyone else hears "gone" (0), which
                # is also what an unknown id gets: nothing tells ids that exist from ones that don't.
                rec = self._exports.get(t.request_id)
                ok = rec is not None and rec.claims.get(peer.agent) is peer and hmac.compare_digest(rec.token, t.token)
                lease = self.scheduler.heartbeat(t.request_id) if ok else None
                left = 0.0 if lease is None else max(0.0, lease.deadline - self.scheduler.leases.now())
                leases.append(wire.Lease(request_id=t.request_id, lease_s=left))
            peer.lease_replies.append(leases)
            if not peer.renewing:
                peer.renewing = True  # one task per peer sends every batch, never one per id
                asyncio.ensure_future(self._send_leases(peer))
        elif isinstance(msg, wire.Want):
            self._on_want(peer, msg)
        elif isinstance(msg, wire.Import):
            self._on_import(peer, msg)
        elif isinstance(msg, (wire.Done, wire.Failure)):
            rec = self._exports.get(msg.request_id)
            if isinstance(msg, wire.Failure) and msg.code is wire.FailureCode.ABORTED \
                    and (rec is None or not rec.claims):
                # Released by a consumer that never claimed it: it will not be read.
                if rec is not None:
                    if hmac.compare_digest(rec.token, msg.token):
                        self._finish(rec, ok=False, outcome=Outcome.FAILED, error="released by its consumer")
                    else:
                        self.stats.forbidden += 1
                elif msg.request_id not in self._finished:
                    self._released_ahead(peer, msg.request_id, msg.token)
                return
            if rec is None or rec.claims.get(peer.agent) is not peer or not hmac.compare_digest(rec.token, msg.token):
                if rec is not None:
                    self.stats.forbidden += 1
                if msg.request_id not in self._finished:
                    self.stats.unknown += 1
                return
            if isinstance(msg, wire.Done) and msg.ok:
                if self.config.mode is wire.Mode.PULL:
                    # The consumer's READ completed on its side: it no longer needs the
                    # blocks. Its NIXL notification says the same and may come later.
                    self._reader_ended(rec, peer.agent, True)
                return
            if rec.xfer is not None:
                rec.abort_asked = True  # finish the write first; the blocks are read until then
                return
            detail = msg.detail if isinstance(msg, wire.Failure) else "consumer failed the transfer"
            self._reader_ended(rec, peer.agent, False, detail)
        elif isinstance(msg, wire.Bye):
            self._peer_lost(peer)
        else:
            self.stats.rejected += 1

    def _released_ahead(self, peer: _Peer, rid: str, token: bytes) -> None:
        """A consumer will not read a request not yet exported (the decode engine aborted it while
        it queued, or found nothing to load): forget its ask, and end the export when it starts
        (checked then against the token the export is made with)."""
        asks = self._wants.get(rid, [])
        rest = [a for a in asks if a[0] is not peer]
        dropped = len(asks) - len(rest)
        peer.wants -= dropped
        self._want_count -= dropped
        if rest:
            self._wants[rid] = rest
            return  # another reader still wants it
        self._wants.pop(rid, None)
        _remember(self._released, rid, token)

    async def _send_leases(self, peer: _Peer) -> None:
        try:
            while peer.lease_replies and peer.alive:
                for lease in peer.lease_replies[0]:
                    await peer.channel.send(lease)
                peer.lease_replies.pop(0)
        except PeerLost:
            self._peer_lost(peer)
        finally:
            peer.renewing = False
            if not peer.alive:
                peer.lease_replies.clear()

    def _on_want(self, peer: _Peer, msg: wire.Want) -> None:
        rid = msg.request_id
        rec = self._exports.get(rid)
        if rec is not None:
            if hmac.compare_digest(rec.token, msg.token):
                self._claim(rec, peer, msg.readers, msg.token)
            else:
                self.stats.forbidden += 1  # no answer: a refusal would say the request exists
            return
        if rid in self._finished and self._finished[rid] is None:
            # Its lease lapsed before export() (a stalled prefill): no token was ever issued here to
            # check against, and the asker should not wait out its export timeout for nothing.
            self._refuse_want(peer, rid, wire.FailureCode.LEASE_EXPIRED, "lease expired before export", msg.token)
            return
        ended = self._finished.get(rid)
        if ended is not None and hmac.compare_digest(ended, msg.token):
            self._refuse_want(peer, rid, wire.FailureCode.UNKNOWN_REQUEST,
                              f"request {rid} was already exported and its export has ended", msg.token)
            return
        if any(p is peer for p, _, _ in self._wants.get(rid, ())):
            self.stats.duplicates += 1
            return
        if peer.wants >= self.config.max_wants_per_peer:
            self._cut_off(peer, f"more than {self.config.max_wants_per_peer} requests asked for ahead of their export")
            return
        if self._want_count >= self.config.max_wants:
            # Full: the peer holding the most waiting Wants goes (a flooder has them), not the asker.
            worst = max({id(p): p for asks in self._wants.values() for p, _, _ in asks}.values(),
                        key=lambda p: p.wants)
            self._cut_off(worst, f"{worst.wants} requests asked for ahead, the most of any peer, with "
                                 f"{self._want_count} waiting in total")
            if worst is peer:
                return
        pending = self._wants.setdefault(rid, [])
        pending.append((peer, msg.readers, msg.token))
        peer.wants += 1
        self._want_count += 1

    def _cut_off(self, peer: _Peer, why: str) -> None:
        """A peer flooding the producer loses its connection (and every claim it holds)."""
        self.stats.cut_off += 1
        log.warning("disconnected consumer %s: %s", peer.agent, why)
        self._peer_lost(peer)  # which closes its channel and removes its NIXL agent

    def _claim(self, rec: _Export, peer: _Peer, readers: int, token: bytes) -> None:
        """Give the request to a consumer that asked for it, or refuse it clearly."""
        if peer.agent in rec.claims:
            self.stats.duplicates += 1  # asked twice by the same consumer: it has its Export
            return
        error = None
        if readers > 1 and self.config.mode is not wire.Mode.PULL:
            error = f"request {rec.rid}: {readers} readers asked; shared reads need pull mode"
        elif rec.readers is not None and readers != rec.readers:
            error = (f"request {rec.rid} is shared by {rec.readers} consumer(s); this consumer asked for it "
                     f"with {readers}")
        elif rec.readers is not None and len(rec.claims) >= rec.readers:
            # Who the other readers are is theirs to know.
            error = (f"request {rec.rid} is already claimed by {len(rec.claims)} other consumer(s); "
                     f"expected {rec.readers} reader(s)")
        if error is not None:
            self._refuse_want(peer, rec.rid, wire.FailureCode.CLAIMED, error, token)
            return
        rec.readers = readers
        rec.claims[peer.agent] = peer
        deadline = self.scheduler.leases.deadline(rec.rid)
        left = max(0.0, deadline - self.scheduler.leases.now()) if deadline is not None else 0.0
        asyncio.ensure_future(self._send_export(rec, peer, left))

    async def _send_export(self, rec: _Export, peer: _Peer, left: float) -> None:
        try:
            await peer.channel.send(wire.Export(
                request_id=rec.rid, lease_s=left,
                blocks=tuple(wire.GroupBlocks(group_id=g, ids=tuple(b.tolist())) for g, b in rec.blocks.items())))
        except PeerLost:
            self._peer_lost(peer)

    def _refuse_want(self, peer: _Peer, rid: str, code: wire.FailureCode, detail: str, token: bytes) -> None:
        self.stats.rejected += 1
        asyncio.ensure_future(_send_quietly(peer.channel, wire.Failure(request_id=rid, code=code,
                                                                      detail=detail[: wire.MAX_TEXT], token=token)))

    def _reader_ended(self, rec: _Export, agent: str, ok: bool, detail: str | None = None) -> None:
        """One reader is finished with the blocks; the export ends once every reader is."""
        rec.ended.setdefault(agent, (ok, detail))
        if len(rec.ended) < (rec.readers or 1):
            return
        bad = [d for o, d in rec.ended.values() if not o]
        if not bad:
            self._finish(rec, ok=True, outcome=Outcome.DONE)
        else:
            self._finish(rec, ok=False, outcome=Outcome.FAILED, error=bad[0] or "consumer failed the transfer",
                         tell=wire.Done(request_id=rec.rid, ok=False))

    def _on_import(self, peer: _Peer, msg: wire.Import) -> None:
        rec = self._exports.get(msg.request_id)
        if rec is None or rec.peer is not peer or self.config.mode is not wire.Mode.PUSH or rec.xfer is not None:
            self.stats.rejected += 1
            return
        try:
            wire.check_blocks(msg.blocks, peer.memory.group_bounds(), what=f"import of {msg.request_id}")
            dst = {g.group_id: np.asarray(g.ids, dtype=np.int64) for g in msg.blocks}
            prepared = self._plans.get(peer.agent)
            if prepared is None:
                prepared = self._plans[peer.agent] = self.planner.prepare((self.memory,), peer.memory)
            plan = prepared.plan(0, rec.blocks, dst)
            plan.check()
            notif = NOTIF_PREFIX + rec.rid.encode()
            rec.posted_at = time.perf_counter()
            rec.xfer = self.dp.post_plan(Op.WRITE, peer.agent, plan, notif)
            rec.descriptors = plan.num_descriptors
        except Exception as exc:  # bad block lists, NIXL refusal
            self.stats.rejected += 1
            self.metrics.failure(FailureKind.PROTOCOL if isinstance(exc, ValueError) else FailureKind.TRANSFER)
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
        if state is XferState.DONE:
            self.metrics.transfer(nbytes=rec.xfer.nbytes, descriptors=rec.descriptors,
                                  seconds=time.perf_counter() - rec.posted_at)
        else:
            self.metrics.failure(FailureKind.TRANSFER)
        if state is XferState.DONE and not rec.abort_asked:
            self._finish(rec, ok=True, outcome=Outcome.DONE)
        elif state is XferState.DONE:
            # The consumer gave up but the bytes landed; its notification tells it so.
            self._finish(rec, ok=True, outcome=Outcome.FAILED, error="consumer aborted")
        else:
            self._finish(rec, ok=False, outcome=Outcome.FAILED, error="WRITE failed",
                         tell=wire.Failure(request_id=rec.rid, code=wire.FailureCode.TRANSFER_ERROR,
                                           detail="WRITE failed"))

    async def export(self, request_id: str, *, token: bytes, peer: str | None = None) -> Result:
        """Export a finished request (``request_finished(export=True)`` done) and wait until
        its readers are done with the blocks, failed, or the lease lapsed.

        The request goes to whichever consumer asks for it (``wire.Want``, sent by
        ``Consumer.fetch``), before or after this call; a claim beyond the readers the
        first claim announced is refused. ``token`` is the request's capability
        (:func:`hybridkv.transport.auth.new_token`, handed to the decode side with the request):
        a Want, Heartbeat, Done or Failure without it is ignored. ``peer`` names a consumer to
        offer it to unasked.
        """
        auth.check_token(token, f"export of {request_id!r}: token")
        sched = self.scheduler
        target = None
        if peer is not None:
            target = self.peers.get(peer)
            if target is None:
                raise ValueError(f"peer {peer!r}; expected one of {sorted(self.peers)}")
        while True:
            if not sched.has_request(request_id):  # the lease lapsed (poll) before we got here
                self._expired_before_export(request_id)
                return Result(request_id=request_id, outcome=Outcome.EXPIRED, error="lease expired before export")
            if not isinstance(sched.export_ready(request_id), NotYet):
                break
            await asyncio.sleep(self.config.pump_idle_s)  # the engine advances the watermark
        tid = sched.post_export(request_id)
        if isinstance(tid, NotYet):
            return Result(request_id=request_id, outcome=Outcome.EXPIRED, error=tid.reason.value)
        blocks = {g.group_id: np.asarray(sched.blocks(request_id, g.group_id), dtype=np.int64)
                  for g in self.memory.groups}
        rec = _Export(rid=request_id, tid=tid, token=token, blocks=blocks,
                      done=asyncio.get_running_loop().create_future())
        self._exports[request_id] = rec
        released = self._released.pop(request_id, None)
        if released is not None:
            if hmac.compare_digest(token, released):
                self._finish(rec, ok=False, outcome=Outcome.FAILED, error="released by its consumer before the export")
                return await rec.done
            self.stats.forbidden += 1  # released with a guessed token: ignored
        if target is not None:
            self._claim(rec, target, 1, token)
        for asker, readers, held in self._wants.pop(request_id, []):
            asker.wants -= 1
            self._want_count -= 1
            if not asker.alive:
                continue
            if hmac.compare_digest(token, held):
                self._claim(rec, asker, readers, held)
            else:
                self.stats.forbidden += 1  # asked with a guessed token: no answer
        return await rec.done

    def _on_notif(self, agent: str, msg: bytes) -> None:
        rid = _rid_of(msg)
        seen = f"{agent}\0{rid}"
        if rid is not None and seen in self._notified:
            self.stats.duplicates += 1  # a completion repeated: already terminal, ignored
            return
        if rid is not None:
            _remember(self._notified, seen)
        rec = self._exports.get(rid) if rid is not None else None
        if rec is None or agent not in rec.claims or self.config.mode is not wire.Mode.PULL:
            if rid not in self._finished:
                self.stats.unknown += 1  # never ours (or not from that peer): ignored
            return
        self._reader_ended(rec, agent, True)

    def _tick(self) -> None:
        for rid in self.scheduler.poll():  # lapsed leases: the scheduler dropped the request
            rec = self._exports.get(rid)
            self.metrics.lease_expired()
            if rec is None:
                self._expired_before_export(rid)
                continue
            if rec.xfer is not None:
                continue  # a WRITE in flight ends through _watch_write
            self._finish(rec, ok=False, outcome=Outcome.EXPIRED, error="lease expired", tell=wire.Failure(
                request_id=rid, code=wire.FailureCode.LEASE_EXPIRED, detail="lease expired"))

    def _expired_before_export(self, rid: str) -> None:
        """The lease lapsed before export() (a stalled prefill): every consumer that asked for the
        request hears so now, not after its export timeout, and a later ask is refused at once."""
        _remember(self._finished, rid)
        for peer, _, held in self._wants.pop(rid, []):
            peer.wants -= 1
            self._want_count -= 1
            if peer.alive:
                asyncio.ensure_future(_send_quietly(peer.channel, wire.Failure(
                    request_id=rid, code=wire.FailureCode.LEASE_EXPIRED, detail="lease expired before export",
                    token=held)))

    def _finish(self, rec: _Export, *, ok: bool, outcome: Outcome, error: str | None = None,
                tell: wire.Message | None = None) -> None:
        if self._exports.get(rec.rid) is not rec:
            return
        del self._exports[rec.rid]
        _remember(self._finished, rec.rid, rec.token)
        sched = self.scheduler
        (sched.transfer_landed if ok else sched.transfer_failed)(rec.tid)
        alive = all(p.alive for p in rec.claims.values())
        if sched.has_request(rec.rid):
            if outcome is Outcome.DONE or outcome is Outcome.FAILED and alive:
                sched.export_done(rec.rid)
            else:
                sched.abort(rec.rid)  # a reader gone: held until the lease lapses (it may have been reading)
        if rec.xfer is not None:
            self.dp.release(rec.xfer)
        if tell is not None:
            tell = dataclasses.replace(tell, token=rec.token)  # the readers hold it; nobody else is told
            for p in rec.claims.values():
                if p.alive:
                    asyncio.ensure_future(_send_quietly(p.channel, tell))
        if not rec.done.done():
            rec.done.set_result(Result(request_id=rec.rid, outcome=outcome, error=error))

    def _peer_lost(self, peer: _Peer) -> None:
        if not peer.alive:
            return
        peer.alive = False
        self.peers.pop(peer.agent, None)
        self._plans.pop(peer.agent, None)
        if peer.wants:
            for rid in [r for r, asks in self._wants.items() if any(p is peer for p, _, _ in asks)]:
                self._wants[rid] = [a for a in self._wants[rid] if a[0] is not peer]
                if not self._wants[rid]:
                    del self._wants[rid]
            self._want_count -= peer.wants
            peer.wants = 0
        for rec in [r for r in self._exports.values() if r.claims.get(peer.agent) is peer]:
            if rec.xfer is None:
                self._reader_ended(rec, peer.agent, False, "consumer lost")
            else:
                rec.abort_asked = True
        # Its NIXL agent goes with it (remove_remote_agent disconnects too), and so does the channel.
        self._drop_agent(peer.agent)
        if not self._closing:
            asyncio.ensure_future(peer.channel.close())

    async def close(self) -> None:
        self._closing = True
        for peer in list(self.peers.values()):
            await _send_quietly(peer.channel, wire.Bye(reason="closing"))
            await peer.channel.close()
        if self._listener is not None:
            self._listener.close()
        await super().close()


_MAX_LEASE_BATCHES = 8  # Heartbeats per peer whose Lease replies may wait to be sent (8,192 ids)




__all__ = ["Producer"]
