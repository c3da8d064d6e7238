"""The consumer's control channels to its producers: what it hears, the leases it renews, losing one.

:class:`ProducerLinks` is held by :class:`~hybridkv.transport.consumer.Consumer`. Per producer it
serves the control channel (an Export answers a Want; a Lease renews or ends a part's lease; a
Failure or a failed Done ends a part; a Bye or a broken channel loses the producer) and sends
Heartbeats for the parts exported to it, from which the producer answers with Leases. In push
mode the producer writes: its completion notification lands an import, its Done drains it, and its
Failure or its loss only fail it (:mod:`hybridkv.transport.drains` says when it is over).
"""

from __future__ import annotations

import asyncio
import time

from hybridkv import wire
from hybridkv.errors import PeerError, PeerLost
from hybridkv.transport.drains import Drains
from hybridkv.transport.metrics import FailureKind
from hybridkv.transport.parts import Parts
from hybridkv.transport.side import Peer, Side, send_quietly


class ProducerLinks:
    """Given the side (its config, scheduler and counters), the consumer's parts table and its imports
    by writer (``drains``)."""

    def __init__(self, side: Side, parts: Parts, drains: Drains) -> None:
        self._side = side
        self._parts = parts
        self._drains = drains
        self._hb_sent: dict[str, float] = {}  # producer agent -> when its last Heartbeat left
        self._seq = 0

    async def serve(self, peer: Peer) -> None:
        """The producer's control messages, until it is lost or the consumer closes."""
        side, parts = self._side, self._parts
        while not side.closing:
            msg = await side.next_message(peer)
            if msg is None:
                self.lost(peer)
                return
            if isinstance(msg, wire.Export):
                token = parts.released(peer.agent, msg.request_id)
                if token is not None:
                    await send_quietly(peer.channel, wire.Failure(
                        request_id=msg.request_id, code=wire.FailureCode.ABORTED, detail="released by the consumer",
                        token=token))
                    continue
                part = parts.get(peer.agent, msg.request_id)
                if part is None:
                    side.stats.unknown += 1  # never asked for (an Export comes only after a Want)
                elif not part.export.done():
                    part.export.set_result((msg, time.monotonic()))
            elif isinstance(msg, wire.Lease):
                self._on_lease(peer, msg)
            elif isinstance(msg, (wire.Failure, wire.Done)):
                # Push: about an import it may be writing (Done drains it, a Failure only fails it).
                heard = self._drains.heard(peer.agent, msg)
                part = parts.get(peer.agent, msg.request_id)
                if part is None or msg.token != part.token:
                    if not heard:
                        side.stats.unknown += 1
                elif not (isinstance(msg, wire.Done) and msg.ok):
                    part.failed = msg.detail if isinstance(msg, wire.Failure) else "producer failed"
                    part.kind = _KIND_OF_CODE.get(msg.code, FailureKind.REFUSED) if isinstance(
                        msg, wire.Failure) else FailureKind.TRANSFER
                    if not part.export.done():  # refused before any Export (claimed, unknown)
                        part.export.set_exception(PeerError(f"producer refused {msg.request_id}: {part.failed}"))
                    part.landed.set()
            elif isinstance(msg, wire.Bye):
                self.lost(peer)
                return
            else:
                side.stats.rejected += 1

    def lost(self, peer: Peer) -> None:
        """The producer is gone: every part of it fails (once). An import it may be writing stays open
        until it drains or the drain deadline passes: its writer may outlive its control channel."""
        if not peer.alive:
            return
        peer.alive = False
        self._drains.lost(peer.agent, "producer lost")
        for part in self._parts.of(peer.agent):
            if part.failed is None:
                part.failed, part.kind = "producer lost", FailureKind.PEER_LOST
            if not part.export.done():
                part.export.set_exception(PeerLost("producer lost"))
            part.landed.set()

    def forget(self, agent: str) -> None:
        """The producer was dropped: nothing of its renewals is kept."""
        self._hb_sent.pop(agent, None)

    def _on_lease(self, peer: Peer, msg: wire.Lease) -> None:
        part = self._parts.get(peer.agent, msg.request_id)
        if part is None:
            return
        if msg.lease_s <= 0:
            part.lease_lost = True
            return
        # Conservative: from when our renewal left, not when the answer came (lease.py).
        sent = self._hb_sent.get(peer.agent, time.monotonic())
        deadline = sent + msg.lease_s * (1 - self._side.config.lease_margin)
        if deadline > part.deadline or part.deadline == float("inf"):
            part.deadline = deadline
            earliest = self._parts.earliest_deadline(msg.request_id)
            scheduler = self._side.scheduler
            if earliest != float("inf") and scheduler.has_request(msg.request_id):
                scheduler.lease_renewed(msg.request_id, earliest)

    async def heartbeats(self, peer: Peer) -> None:
        """Renew the leases of the producer's exported parts, every ``heartbeat_s`` (lease / 6 by default)."""
        side = self._side
        period = side.config.heartbeat_s or max(0.05, peer.lease_s / 6)
        while not side.closing and peer.alive:
            await asyncio.sleep(period)
            tickets = [wire.Ticket(request_id=p.rid, token=p.token) for p in self._parts.of(peer.agent)
                       if p.export.done()]
            self._seq += 1
            self._hb_sent[peer.agent] = time.monotonic()
            try:
                # In pieces the wire allows; the producer answers one before it reads the next.
                for i in range(0, max(len(tickets), 1), wire.MAX_REQUESTS_PER_HEARTBEAT):
                    await peer.channel.send(wire.Heartbeat(
                        seq=self._seq, tickets=tuple(tickets[i:i + wire.MAX_REQUESTS_PER_HEARTBEAT])))
            except PeerLost:
                self.lost(peer)
                return

    def on_notif(self, agent: str, msg: bytes) -> None:
        """A completion notification: in push mode, the producer's WRITE of an import landed."""
        side = self._side
        rid = side.notified(agent, msg)
        if rid is None:
            return  # not ours, or not from the session of that agent name: counted there
        part = self._parts.get(agent, rid)
        if side.config.mode is not wire.Mode.PUSH or not self._drains.notified(agent, rid):
            # Not a write we wait for: one already over (repeated, or after its drain), or none.
            if part is not None and side.config.mode is wire.Mode.PUSH:
                side.stats.duplicates += 1
            else:
                side.stats.unknown += 1
            return
        if part is not None:
            part.notified = True
            part.landed.set()


#: What a producer's Failure says, as a failure kind.
_KIND_OF_CODE = {
    wire.FailureCode.TRANSFER_ERROR: FailureKind.TRANSFER,
    wire.FailureCode.LEASE_EXPIRED: FailureKind.LEASE,
    wire.FailureCode.UNKNOWN_REQUEST: FailureKind.REFUSED,
    wire.FailureCode.ABORTED: FailureKind.REFUSED,
    wire.FailureCode.PROTOCOL: FailureKind.PROTOCOL,
    wire.FailureCode.CLAIMED: FailureKind.REFUSED,
}

__all__ = ["ProducerLinks"]
