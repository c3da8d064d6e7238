"""What the producer offers: its exports, the consumers' asks for them, and their ends.

:class:`Exports` is held by :class:`~hybridkv.transport.producer.Producer` and serves the control
channel of every consumer let in. A request is exported to whoever asks for it (``wire.Want``),
before or after ``export`` starts; a Want that comes first waits, bounded per peer and in total (a
peer flooding them is cut off). A request several decode ranks share (``readers``) ends when every
reader is done; any other claim on it is refused (``FailureCode.CLAIMED``). In pull mode the
consumer's READ (its Done or its notification) ends a reader; in push mode this side WRITEs on the
consumer's Import and watches the write. Leases are renewed on a reader's Heartbeat and lapse on
the pump's tick. The design is in :mod:`hybridkv.transport.endpoint`.
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
from hybridkv.transport.auth import Claimants
from hybridkv.transport.config import Outcome, Result
from hybridkv.transport.dataplane import Op, Transfer, XferState
from hybridkv.transport.metrics import FailureKind
from hybridkv.transport.plan import PeerPlanner
from hybridkv.transport.side import Peer, Side, notification, remember, send_quietly
from hybridkv.transport.staging import Slot, StagePool, Stager

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class _Export:
    rid: str
    tid: int
    token: bytes  # the request's capability: every message about it must carry this
    blocks: dict[int, np.ndarray]
    done: asyncio.Future
    #: ``blocks`` as an Export names them: made once at export(), not on each reader's Want
    wire_blocks: tuple[wire.GroupBlocks, ...] = ()
    claimants: Claimants | None = None  # the decode it was issued for (None: whoever holds the token)
    readers: int | None = None  # how many consumers share it (set by the first claim)
    claims: dict[str, Peer] = field(default_factory=dict)  # agent -> reader
    ended: dict[str, tuple[bool, str | None]] = field(default_factory=dict)  # agent -> (ok, detail)
    xfer: Transfer | None = None
    abort_asked: bool = False
    descriptors: int = 0  # push: what the WRITE posted, and when (for the metrics)
    posted_at: float = 0.0
    slots: dict[str, Slot] = field(default_factory=dict)  # agent -> its staging slot (pull, staged)

    @property
    def peer(self) -> Peer | None:
        """The reader, where there is exactly one (push mode has one)."""
        return next(iter(self.claims.values())) if len(self.claims) == 1 else None


class Exports:
    """The producer's exports. Given the side: its scheduler, config, planner, memory map, data
    plane, peers and counters."""

    def __init__(self, side: Side, staging: StagePool | None = None) -> None:
        self._side = side
        #: where staged reads are packed (None: every Want is exported unstaged)
        self._staging = staging
        self._stagers: dict[str, Stager | None] = {}  # per consumer agent
        self._scheduler = side.scheduler
        self._config = side.config
        self._planner = side.planner
        self._memory = side.memory
        self._dp = side.dp
        self._peers = side.peers
        self._stats = side.stats
        self._metrics = side.metrics
        self._plans: dict[str, PeerPlanner] = {}  # push: the planner prepared per consumer
        self._exports: dict[str, _Export] = {}
        # Recently terminal requests (with their tokens) and completion notifications seen, so a
        # repeated or crossing completion is told apart from a stray one (bounded).
        self._finished: OrderedDict[str, bytes] = OrderedDict()
        self._notified: OrderedDict[str, None] = OrderedDict()
        # Wants that came before the request was exported (the consumer may be first), with the
        # token each asker holds; bounded per peer and in total (TransportConfig.max_wants*).
        self._wants: dict[str, list[tuple[Peer, int, bytes, bool]]] = {}
        self._want_count = 0
        # Requests a consumer released before they were exported (it will never read them), with the
        # token it released them with: their export ends as soon as it starts if the tokens match.
        self._released: OrderedDict[str, tuple[bytes, Peer]] = OrderedDict()

    def describe(self) -> dict:
        return {"exports": {r: {"claims": sorted(e.claims), "ended": sorted(e.ended), "readers": e.readers,
                                "writing": e.xfer is not None, "staged": sorted(e.slots)}
                            for r, e in self._exports.items()},
                "wants_ahead": {r: len(v) for r, v in self._wants.items()},
                **({} if self._staging is None else {"staging": self._staging.describe()})}

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
            if len(peer.lease_replies) >= _MAX_LEASE_BATCHES:
                # Its earlier renewals are still being answered: a consumer renews every lease/6 s
                # (in batches of up to 1,024 ids), so this is a flood: dropped, not queued.
                self._stats.rejected += 1
                return
            leases = []
            for t in msg.tickets:
                # Only a reader holding the token renews; anyone else hears "gone" (0), which
                # is also what an unknown id gets: nothing tells ids that exist from ones that don't.
                rec = self._exports.get(t.request_id)
                ok = rec is not None and rec.claims.get(peer.agent) is peer and hmac.compare_digest(rec.token, t.token)
                lease = self._scheduler.heartbeat(t.request_id) if ok else None
                left = 0.0 if lease is None else max(0.0, lease.deadline - self._scheduler.leases.now())
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
                        self._stats.forbidden += 1
                elif msg.request_id not in self._finished:
                    self._released_ahead(peer, msg.request_id, msg.token)
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

    def _released_ahead(self, peer: Peer, rid: str, token: bytes) -> None:
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
        remember(self._released, rid, (token, peer))

    async def _send_leases(self, peer: Peer) -> None:
        try:
            while peer.lease_replies and peer.alive:
                for lease in peer.lease_replies[0]:
                    await peer.channel.send(lease)
                peer.lease_replies.pop(0)
        except PeerLost:
            self.peer_lost(peer)
        finally:
            peer.renewing = False
            if not peer.alive:
                peer.lease_replies.clear()

    def _on_want(self, peer: Peer, msg: wire.Want) -> None:
        rid = msg.request_id
        rec = self._exports.get(rid)
        if rec is not None:
            if _holds(rec, peer, msg.token):
                self._claim(rec, peer, msg.readers, msg.token, msg.stage)
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
        if any(a[0] is peer for a in self._wants.get(rid, ())):
            self._stats.duplicates += 1
            return
        if peer.wants >= self._config.max_wants_per_peer:
            self._cut_off(peer, f"more than {self._config.max_wants_per_peer} requests asked for ahead of their export")
            return
        if self._want_count >= self._config.max_wants:
            # Full: the peer holding the most waiting Wants goes (a flooder has them), not the asker.
            worst = max({id(a[0]): a[0] for asks in self._wants.values() for a in asks}.values(),
                        key=lambda p: p.wants)
            self._cut_off(worst, f"{worst.wants} requests asked for ahead, the most of any peer, with "
                                 f"{self._want_count} waiting in total")
            if worst is peer:
                return
        pending = self._wants.setdefault(rid, [])
        pending.append((peer, msg.readers, msg.token, msg.stage))
        peer.wants += 1
        self._want_count += 1

    def _cut_off(self, peer: Peer, why: str) -> None:
        """A peer flooding the producer loses its connection (and every claim it holds)."""
        self._stats.cut_off += 1
        log.warning("disconnected consumer %s: %s", peer.agent, why)
        self.peer_lost(peer)  # which closes its channel and removes its NIXL agent

    def _claim(self, rec: _Export, peer: Peer, readers: int, token: bytes, stage: bool = False) -> None:
        """Give the request to a consumer that asked for it, or refuse it clearly."""
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
        staged = self._stage(rec, peer) if stage and self._config.mode is wire.Mode.PULL else ()
        pool = self._staging
        if staged and pool is not None and not pool.config.fence:
            # HYBRIDKV_STAGING_RULE_OFF: the slot goes back as soon as it is packed, while its reader
            # has yet to read it (the next request's slices may land in it first).
            pool.give_back(rec.slots.pop(peer.agent))
        deadline = self._scheduler.leases.deadline(rec.rid)
        left = max(0.0, deadline - self._scheduler.leases.now()) if deadline is not None else 0.0
        asyncio.ensure_future(self._send_export(rec, peer, left, staged))

    def _stage(self, rec: _Export, peer: Peer) -> tuple[int, ...]:
        """Pack what ``peer`` reads into a staging slot: (offset, nbytes) for its Export, or ()
        where this side cannot (no pool, nothing to gather for that peer, no free slot: the
        consumer then posts the sliced plan). The slot is the export's until it ends."""
        pool = self._staging
        if pool is None:
            return ()
        if peer.agent not in self._stagers:
            stager = getattr(self._planner, "stager", None)
            try:
                self._stagers[peer.agent] = None if stager is None else stager(self._memory, peer.memory)
            except ValueError as exc:  # layouts that do not pair by fields: unstaged, the plan will say why
                log.debug("no staging for %s: %s", peer.agent, exc)
                self._stagers[peer.agent] = None
        stager = self._stagers[peer.agent]
        if stager is None:
            return ()
        slot = pool.take(stager.nbytes(rec.blocks))
        if slot is None:
            return ()  # full: unstaged (back-pressure falls back, never waits)
        pool.copier.run(stager.pack(rec.blocks, base=slot.offset))
        rec.slots[peer.agent] = slot
        return (slot.offset, slot.nbytes)

    async def _send_export(self, rec: _Export, peer: Peer, left: float, staged: tuple[int, ...] = ()) -> None:
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

    def _on_import(self, peer: Peer, msg: wire.Import) -> None:
        rec = self._exports.get(msg.request_id)
        if rec is None or rec.peer is not peer or self._config.mode is not wire.Mode.PUSH or rec.xfer is not None:
            self._stats.rejected += 1
            return
        try:
            wire.check_blocks(msg.blocks, peer.memory.group_bounds(), what=f"import of {msg.request_id}")
            dst = {g.group_id: np.asarray(g.ids, dtype=np.int64) for g in msg.blocks}
            prepared = self._plans.get(peer.agent)
            if prepared is None:
                prepared = self._plans[peer.agent] = self._planner.prepare((self._memory,), peer.memory)
            plan = prepared.plan(0, rec.blocks, dst)
            plan.check()
            notif = notification(peer, rec.rid)
            rec.posted_at = time.perf_counter()
            rec.xfer = xfer = self._dp.post_plan(Op.WRITE, peer.agent, plan, notif)
            rec.descriptors = plan.num_descriptors
        except Exception as exc:  # bad block lists, NIXL refusal
            self._stats.rejected += 1
            self._metrics.failure(FailureKind.PROTOCOL if isinstance(exc, ValueError) else FailureKind.TRANSFER)
            self._finish(rec, ok=False, outcome=Outcome.FAILED, error=str(exc),
                         tell=wire.Failure(request_id=rec.rid, code=wire.FailureCode.TRANSFER_ERROR,
                                           detail=str(exc)[: wire.MAX_TEXT]))
            return
        self._side.spin_up()
        asyncio.ensure_future(self._watch_write(rec, xfer))

    async def _watch_write(self, rec: _Export, xfer: Transfer) -> None:
        try:
            state = await self._side.wait_xfer(xfer)
        finally:
            self._side.spin_down()
        if state is XferState.DONE:
            self._metrics.transfer(nbytes=xfer.nbytes, descriptors=rec.descriptors,
                                   seconds=time.perf_counter() - rec.posted_at)
        else:
            self._metrics.failure(FailureKind.TRANSFER)
        if state is XferState.DONE and not rec.abort_asked:
            self._finish(rec, ok=True, outcome=Outcome.DONE)
        elif state is XferState.DONE:
            # The consumer gave up but the bytes landed; its notification tells it so.
            self._finish(rec, ok=True, outcome=Outcome.FAILED, error="consumer aborted")
        else:
            self._finish(rec, ok=False, outcome=Outcome.FAILED, error="WRITE failed",
                         tell=wire.Failure(request_id=rec.rid, code=wire.FailureCode.TRANSFER_ERROR,
                                           detail="WRITE failed"))

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
        rec = _Export(rid=request_id, tid=tid, token=token, blocks=blocks,
                      wire_blocks=tuple(wire.GroupBlocks(group_id=g, ids=tuple(b.tolist())) for g, b in blocks.items()),
                      done=asyncio.get_running_loop().create_future(), claimants=claimants)
        self._exports[request_id] = rec
        released = self._released.pop(request_id, None)
        if released is not None:
            if _holds(rec, released[1], released[0]):
                self._finish(rec, ok=False, outcome=Outcome.FAILED, error="released by its consumer before the export")
                return await rec.done
            self._stats.forbidden += 1  # released with a guessed token: ignored
        if target is not None:
            self._claim(rec, target, 1, token)
        for asker, readers, held, stage in self._wants.pop(request_id, []):
            asker.wants -= 1
            self._want_count -= 1
            if not asker.alive:
                continue
            if _holds(rec, asker, held):
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
        if self._staging is not None:
            self._staging.tick(self._scheduler.leases.now())
        for rid in self._scheduler.poll():  # lapsed leases: the scheduler dropped the request
            rec = self._exports.get(rid)
            self._metrics.lease_expired()
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
        remember(self._finished, rid)
        for peer, _, held, _ in self._wants.pop(rid, []):
            peer.wants -= 1
            self._want_count -= 1
            if peer.alive:
                asyncio.ensure_future(send_quietly(peer.channel, wire.Failure(
                    request_id=rid, code=wire.FailureCode.LEASE_EXPIRED, detail="lease expired before export",
                    token=held)))

    def _finish(self, rec: _Export, *, ok: bool, outcome: Outcome, error: str | None = None,
                tell: wire.Message | None = None) -> None:
        if self._exports.get(rec.rid) is not rec:
            return
        del self._exports[rec.rid]
        remember(self._finished, rec.rid, rec.token)
        sched = self._scheduler
        (sched.transfer_landed if ok else sched.transfer_failed)(rec.tid)
        alive = all(p.alive for p in rec.claims.values())
        freed = outcome is Outcome.DONE or outcome is Outcome.FAILED and alive
        self._release_slots(rec, now=freed)
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

    def _release_slots(self, rec: _Export, *, now: bool) -> None:
        """The export's staging slots go back with its blocks: now where every reader is done with
        them, else (a reader may still be reading) when the lease lapses (a reader never reads past it)."""
        if not rec.slots or self._staging is None:
            return
        leases = self._scheduler.leases
        deadline = None if now else leases.deadline(rec.rid)
        if not now and deadline is None:
            deadline = leases.now() + leases.duration_s
        for slot in rec.slots.values():
            if deadline is None:
                self._staging.give_back(slot)
            else:
                self._staging.hold(slot, deadline)
        rec.slots.clear()

    def peer_lost(self, peer: Peer) -> None:
        """A consumer is gone (or cut off): its asks and claims end, its agent and channel go."""
        if not peer.alive:
            return
        peer.alive = False
        self._peers.pop(peer.agent, None)
        self._plans.pop(peer.agent, None)
        self._stagers.pop(peer.agent, None)
        if peer.wants:
            for rid in [r for r, asks in self._wants.items() if any(a[0] is peer for a in asks)]:
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
        self._side.drop_agent(peer.agent)
        if not self._side.closing:
            asyncio.ensure_future(peer.channel.close())


async def _send_all(ch, msgs: list[wire.Message]) -> None:
    """In order, ignoring a lost peer."""
    for m in msgs:
        await send_quietly(ch, m)


_MAX_LEASE_BATCHES = 8  # Heartbeats per peer whose Lease replies may wait to be sent (8,192 ids)


def _holds(rec: _Export, peer: Peer, token: bytes) -> bool:
    """Whether ``peer`` presents ``rec``'s capability: its token, on a session the capability was issued
    for (an insider that saw the token elsewhere claims nothing: the decode it was issued for still can)."""
    if not hmac.compare_digest(rec.token, token):
        return False
    if rec.claimants is None:
        return True
    return rec.claimants.admit(peer.agent, peer.channel.peer[0] if peer.channel.peer else None)


__all__ = ["Exports"]
