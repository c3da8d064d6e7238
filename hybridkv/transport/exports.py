"""What the producer offers: its exports, the consumers' asks for them, and their ends.

:class:`Exports` is held by :class:`~hybridkv.transport.producer.Producer` and serves the control
channel of every consumer let in. A request is exported to whoever asks for it (``wire.Want``),
before or after ``export`` starts; a Want that comes first waits, bounded per peer and in total (a
peer flooding them is cut off). A request several decode ranks share (``readers``) ends when every
reader is done; any other claim on it is refused (``FailureCode.CLAIMED``). In pull mode the
consumer's READ (its Done or its notification) ends a reader; in push mode this side WRITEs on the
consumer's Import and watches the write. Leases are renewed on a reader's Heartbeat and lapse on
the pump's tick. The design is in :mod:`hybridkv.transport.endpoint`.

``Exports`` holds the table of exports and their ends, and dispatches a consumer's messages; its
parts, one module each: the record of one export (:mod:`~hybridkv.transport.export_record`), the
asks that come ahead of an export and the lease renewals (:mod:`~hybridkv.transport.asks`), and the
staging slots and push WRITEs (:mod:`~hybridkv.transport.delivery`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from collections import OrderedDict

import numpy as np

from hybridkv import wire
from hybridkv.errors import PeerLost
from hybridkv.fencing import NotYet
from hybridkv.transport.asks import AsksAhead, LeaseRenewals
from hybridkv.transport.auth import Claimants
from hybridkv.transport.config import Outcome, Result
from hybridkv.transport.delivery import ExportStaging, PushWrites
from hybridkv.transport.export_record import ExportRecord, holds
from hybridkv.transport.side import Peer, Side, remember, send_quietly
from hybridkv.transport.staging import BadFieldMask, StagePool

log = logging.getLogger(__name__)


class Exports:
    """The producer's exports. Given the side (its scheduler, config, planner, memory map, data
    plane, peers and counters, which it shares with its parts) and the staging pool, if any."""

    def __init__(self, side: Side, staging: StagePool | None = None) -> None:
        self._side = side
        self._scheduler = side.scheduler
        self._config = side.config
        self._memory = side.memory
        self._dp = side.dp
        self._peers = side.peers
        self._stats = side.stats
        self._metrics = side.metrics
        self._exports: dict[str, ExportRecord] = {}
        # Recently terminal requests (with their tokens) and completion notifications seen, so a
        # repeated or crossing completion is told apart from a stray one (bounded).
        self._finished: OrderedDict[str, bytes] = OrderedDict()
        self._notified: OrderedDict[str, None] = OrderedDict()
        # Wants that came before the request was exported (the consumer may be first), bounded per
        # peer and in total (TransportConfig.max_wants*), and requests released before their export.
        self._asks = AsksAhead()
        self._renewals = LeaseRenewals(side, self._exports, lost=self.peer_lost)
        #: where staged reads are packed (its pool None: every Want is exported unstaged)
        self._staging = ExportStaging(side, staging)
        self._writes = PushWrites(side, finish=self._finish)  # push mode

    def describe(self) -> dict:
        return {"exports": {r: {"claims": sorted(e.claims), "ended": sorted(e.ended), "readers": e.readers,
                                "writing": e.xfer is not None, "staged": sorted(e.slots)}
                            for r, e in self._exports.items()},
                "wants_ahead": self._asks.describe(), **self._staging.describe()}

    async def serve(self, peer: Peer) -> None:
        """A consumer's control messages, until it is lost or the producer closes."""
        while not self._side.closing:
            msg = await self._side.next_message(peer)
            if msg is None:
                self.peer_lost(peer)
                return
            if not peer.alive:
                # Cut off (or lost) while its frames were still arriving: what it sent after that goes
                # with it, never into the tables (a Want would wait there for an export for ever).
                return
            self._on_message(peer, msg)

    def _on_message(self, peer: Peer, msg: wire.Message) -> None:
        if isinstance(msg, wire.Heartbeat):
            self._renewals.on_heartbeat(peer, msg)
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
                        self._stats.forbidden += 1
                elif msg.request_id not in self._finished:
                    self._asks.release(peer, msg.request_id, msg.token)
                return
            if rec is None or rec.claims.get(peer.agent) is not peer or not hmac.compare_digest(rec.token, msg.token):
                if rec is not None:
                    self._stats.forbidden += 1
                if msg.request_id not in self._finished:
                    self._stats.unknown += 1
                return
            if isinstance(msg, wire.Done) and msg.ok:
                if self._config.mode is wire.Mode.PULL:
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
            self.peer_lost(peer)
        else:
            self._stats.rejected += 1

    def _on_want(self, peer: Peer, msg: wire.Want) -> None:
        rid = msg.request_id
        rec = self._exports.get(rid)
        if self._bad_mask(peer, msg):
            return  # refused: a field mask this side cannot pack by
        stage = msg.fields if msg.stage else None  # what it asks staged (b"": every field)
        if rec is not None:
            if holds(rec, peer, msg.token):
                self._claim(rec, peer, msg.readers, msg.token, stage)
            else:
                self._stats.forbidden += 1  # no answer: a refusal would say the request exists
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
        if self._asks.asked(rid, peer):
            self._stats.duplicates += 1
            return
        if peer.wants >= self._config.max_wants_per_peer:
            self._cut_off(peer, f"more than {self._config.max_wants_per_peer} requests asked for ahead of their export")
            return
        if self._asks.count >= self._config.max_wants:
            # Full: the peer holding the most waiting Wants goes (a flooder has them), not the asker.
            worst = self._asks.most()
            self._cut_off(worst, f"{worst.wants} requests asked for ahead, the most of any peer, with "
                                 f"{self._asks.count} waiting in total")
            if worst is peer:
                return
        self._asks.add(rid, (peer, msg.readers, msg.token, stage))

    def _bad_mask(self, peer: Peer, msg: wire.Want) -> bool:
        """Whether the Want asks staging by a field mask that names no field of the pair or one past them: then it
        is refused, naming it (this side serves on). Checked (its stager kept) before any claim or wait."""
        if not msg.stage:
            return False
        try:
            self._staging.stager(peer, msg.fields)
        except BadFieldMask as exc:
            # whether the request exists or not alike: the mask is the pair's, the answer says nothing of it
            self._refuse_want(peer, msg.request_id, wire.FailureCode.PROTOCOL, f"Want of {msg.request_id}: {exc}",
                              msg.token)
            return True
        return False

    def _cut_off(self, peer: Peer, why: str) -> None:
        """A peer flooding the producer loses its connection (and every claim it holds)."""
        self._stats.cut_off += 1
        log.warning("disconnected consumer %s: %s", peer.agent, why)
        self.peer_lost(peer)  # which closes its channel and removes its NIXL agent

    def _claim(self, rec: ExportRecord, peer: Peer, readers: int, token: bytes, stage: bytes | None = None) -> None:
        """Give the request to a consumer that asked for it, or refuse it clearly. ``stage``: the field mask its
        Want asked staged (None: unstaged)."""
        if peer.agent in rec.claims:
            self._stats.duplicates += 1  # asked twice by the same consumer: it has its Export
            return
        error = None
        if readers > 1 and self._config.mode is not wire.Mode.PULL:
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
        staged = self._staging.stage(rec, peer, stage) if stage is not None and self._config.mode is wire.Mode.PULL \
            else ()
        deadline = self._scheduler.leases.deadline(rec.rid)
        left = max(0.0, deadline - self._scheduler.leases.now()) if deadline is not None else 0.0
        asyncio.ensure_future(self._send_export(rec, peer, left, staged))

    async def _send_export(self, rec: ExportRecord, peer: Peer, left: float, staged: tuple[int, ...] = ()) -> None:
        try:
            await peer.channel.send(wire.Export(
                request_id=rec.rid, lease_s=left, stage=staged,
                blocks=rec.wire_blocks))
        except PeerLost:
            self.peer_lost(peer)

    def _refuse_want(self, peer: Peer, rid: str, code: wire.FailureCode, detail: str, token: bytes) -> None:
        self._stats.rejected += 1
        asyncio.ensure_future(send_quietly(peer.channel, wire.Failure(request_id=rid, code=code,
                                                                      detail=detail[: wire.MAX_TEXT], token=token)))

    def _reader_ended(self, rec: ExportRecord, agent: str, ok: bool, detail: str | None = None) -> None:
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

    def _on_import(self, peer: Peer, msg: wire.Import) -> None:
        rec = self._exports.get(msg.request_id)
        if rec is None or rec.peer is not peer or self._config.mode is not wire.Mode.PUSH or rec.xfer is not None:
            self._stats.rejected += 1
            return
        self._writes.post(rec, peer, msg)

    async def export(self, request_id: str, *, token: bytes, target: Peer | None,
                     claimants: Claimants | None = None) -> Result:
        """``Producer.export``, its arguments checked: ``target`` is the consumer to offer the
        request to unasked, if any; ``claimants`` the sessions that may present ``token``."""
        sched = self._scheduler
        while True:
            if not sched.has_request(request_id):  # the lease lapsed (poll) before we got here
                self._expired_before_export(request_id)
                return Result(request_id=request_id, outcome=Outcome.EXPIRED, error="lease expired before export")
            if not isinstance(sched.export_ready(request_id), NotYet):
                break
            await asyncio.sleep(self._config.pump_idle_s)  # the engine advances the watermark
        tid = sched.post_export(request_id)
        if isinstance(tid, NotYet):
            return Result(request_id=request_id, outcome=Outcome.EXPIRED, error=tid.reason.value)
        blocks = {g.group_id: np.asarray(sched.blocks(request_id, g.group_id), dtype=np.int64)
                  for g in self._memory.groups}
        rec = ExportRecord(rid=request_id, tid=tid, token=token, blocks=blocks,
                           wire_blocks=tuple(wire.GroupBlocks(group_id=g, ids=tuple(b.tolist()))
                                             for g, b in blocks.items()),
                           done=asyncio.get_running_loop().create_future(), claimants=claimants)
        self._exports[request_id] = rec
        released = self._asks.released(request_id)
        if released is not None:
            if holds(rec, released[1], released[0]):
                self._finish(rec, ok=False, outcome=Outcome.FAILED, error="released by its consumer before the export")
                return await rec.done
            self._stats.forbidden += 1  # released with a guessed token: ignored
        if target is not None:
            self._claim(rec, target, 1, token)
        for asker, readers, held, stage in self._asks.take(request_id):
            if not asker.alive:
                continue
            if holds(rec, asker, held):
                self._claim(rec, asker, readers, held, stage)
            else:
                self._stats.forbidden += 1  # asked with a guessed token: no answer
        return await rec.done

    def on_notif(self, agent: str, msg: bytes) -> None:
        """A completion notification: in pull mode, a reader's READ is done."""
        rid = self._side.notified(agent, msg)
        if rid is None:
            return  # not ours, or not from the session of that agent name: counted there
        seen = f"{agent}\0{rid}"
        if seen in self._notified:
            self._stats.duplicates += 1  # a completion repeated: already terminal, ignored
            return
        remember(self._notified, seen)
        rec = self._exports.get(rid)
        if rec is None or agent not in rec.claims or self._config.mode is not wire.Mode.PULL:
            if rid not in self._finished:
                self._stats.unknown += 1  # never ours (or not from that peer): ignored
            return
        self._reader_ended(rec, agent, True)

    def tick(self) -> None:
        """From the pump: exports whose lease lapsed end; staging slots held past a lease go back."""
        self._staging.tick()
        for rid in self._scheduler.poll():  # lapsed leases: the scheduler dropped the request
            rec = self._exports.get(rid)
            self._metrics.lease_expired()
            if rec is None:
                self._expired_before_export(rid)
                continue
            if rec.xfer is not None:
                continue  # a WRITE in flight ends through PushWrites watching it
            self._finish(rec, ok=False, outcome=Outcome.EXPIRED, error="lease expired", tell=wire.Failure(
                request_id=rid, code=wire.FailureCode.LEASE_EXPIRED, detail="lease expired"))

    def _expired_before_export(self, rid: str) -> None:
        """The lease lapsed before export() (a stalled prefill): every consumer that asked for the
        request hears so now, not after its export timeout, and a later ask is refused at once."""
        remember(self._finished, rid)
        for peer, _, held, _ in self._asks.take(rid):
            if peer.alive:
                asyncio.ensure_future(send_quietly(peer.channel, wire.Failure(
                    request_id=rid, code=wire.FailureCode.LEASE_EXPIRED, detail="lease expired before export",
                    token=held)))

    def _finish(self, rec: ExportRecord, *, ok: bool, outcome: Outcome, error: str | None = None,
                tell: wire.Message | None = None) -> None:
        if self._exports.get(rec.rid) is not rec:
            return
        del self._exports[rec.rid]
        remember(self._finished, rec.rid, rec.token)
        sched = self._scheduler
        (sched.transfer_landed if ok else sched.transfer_failed)(rec.tid)
        alive = all(p.alive for p in rec.claims.values())
        freed = outcome is Outcome.DONE or outcome is Outcome.FAILED and alive
        self._staging.release(rec, now=freed)
        if sched.has_request(rec.rid):
            if freed:
                sched.export_done(rec.rid)
            else:
                sched.abort(rec.rid)  # a reader gone: held until the lease lapses (it may have been reading)
        if rec.xfer is not None:
            self._dp.release(rec.xfer)
        if tell is not None:
            tell = dataclasses.replace(tell, token=rec.token)  # the readers hold it; nobody else is told
            told = [tell]
            if isinstance(tell, wire.Failure) and self._config.mode is wire.Mode.PUSH:
                # A Failure is not "drained" to a consumer (transport/drains.py): Done says that no WRITE
                # of this side's can reach its blocks any more (here, its WRITE ended or none was posted).
                told.append(wire.Done(request_id=rec.rid, ok=False, token=rec.token))
            for p in rec.claims.values():
                if p.alive:
                    asyncio.ensure_future(_send_all(p.channel, told))
        if not rec.done.done():
            rec.done.set_result(Result(request_id=rec.rid, outcome=outcome, error=error))

    def peer_lost(self, peer: Peer) -> None:
        """A consumer is gone (or cut off): its asks and claims end, its agent and channel go."""
        if not peer.alive:
            return
        peer.alive = False
        self._peers.pop(peer.agent, None)
        self._writes.forget(peer.agent)
        self._staging.forget(peer.agent)
        self._asks.drop(peer)
        for rec in [r for r in self._exports.values() if r.claims.get(peer.agent) is peer]:
            if rec.xfer is None:
                self._reader_ended(rec, peer.agent, False, "consumer lost")
            else:
                rec.abort_asked = True
        # Its NIXL agent goes with it (remove_remote_agent disconnects too), and so does the channel.
        self._side.drop_agent(peer.agent)
        if not self._side.closing:
            asyncio.ensure_future(peer.channel.close())


async def _send_all(ch, msgs: list[wire.Message]) -> None:
    """In order, ignoring a lost peer."""
    for m in msgs:
        await send_quietly(ch, m)


__all__ = ["Exports"]
