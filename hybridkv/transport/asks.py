"""What consumers ask of the producer's exports besides reading them: Wants ahead, releases, renewals.

:class:`AsksAhead` holds the Wants that came before their request was exported (the consumer may be
first), each with the token its asker holds, and the requests a consumer released before they were
exported (it will never read them). :class:`~hybridkv.transport.exports.Exports` bounds the waiting
Wants per peer and in total (``TransportConfig.max_wants*``) and cuts off a peer flooding them.

:class:`LeaseRenewals` answers a reader's Heartbeat with the leases it holds, one sending task per
peer, and drops a peer's Heartbeats while a few batches still wait to be answered (a flood).
"""

from __future__ import annotations

import asyncio
import hmac
from collections import OrderedDict
from collections.abc import Callable, Mapping

from hybridkv import wire
from hybridkv.errors import PeerLost
from hybridkv.transport.export_record import ExportRecord
from hybridkv.transport.side import Peer, Side, remember

#: A Want waiting for its export: (asker, readers it announced, the token it holds, the fields it asks staged:
#: None where it asks no staging, else its field mask, checked when it came; b"": every field)
Ask = tuple[Peer, int, bytes, bytes | None]


class AsksAhead:
    """Asks for requests not yet exported: the Wants waiting for their export, and the releases."""

    def __init__(self) -> None:
        self._wants: dict[str, list[Ask]] = {}
        #: Wants waiting, every peer's together (each peer counts its own in ``Peer.wants``)
        self.count = 0
        # Requests a consumer released before they were exported (it will never read them), with the
        # token it released them with: their export ends as soon as it starts if the tokens match.
        self._released: OrderedDict[str, tuple[bytes, Peer]] = OrderedDict()

    def describe(self) -> dict[str, int]:
        return {r: len(v) for r, v in self._wants.items()}

    def asked(self, rid: str, peer: Peer) -> bool:
        """Whether a Want of ``peer`` for ``rid`` already waits."""
        return any(a[0] is peer for a in self._wants.get(rid, ()))

    def add(self, rid: str, ask: Ask) -> None:
        pending = self._wants.setdefault(rid, [])
        pending.append(ask)
        ask[0].wants += 1
        self.count += 1

    def most(self) -> Peer:
        """The peer holding the most waiting Wants (a flooder has them)."""
        return max({id(a[0]): a[0] for asks in self._wants.values() for a in asks}.values(),
                   key=lambda p: p.wants)

    def take(self, rid: str) -> list[Ask]:
        """The Wants for ``rid``, which wait no more (its export starts, or its lease lapsed first)."""
        asks = self._wants.pop(rid, [])
        for asker, *_ in asks:
            asker.wants -= 1
            self.count -= 1
        return asks

    def release(self, peer: Peer, rid: str, token: bytes) -> None:
        """A consumer will not read a request not yet exported (the decode engine aborted it while
        it queued, or found nothing to load): forget its ask, and end the export when it starts
        (checked then against the token the export is made with)."""
        asks = self._wants.get(rid, [])
        rest = [a for a in asks if a[0] is not peer]
        dropped = len(asks) - len(rest)
        peer.wants -= dropped
        self.count -= dropped
        if rest:
            self._wants[rid] = rest
            return  # another reader still wants it
        self._wants.pop(rid, None)
        remember(self._released, rid, (token, peer))

    def released(self, rid: str) -> tuple[bytes, Peer] | None:
        """The release of ``rid`` ahead of its export, (token, peer), if any; forgotten (its export starts)."""
        return self._released.pop(rid, None)

    def drop(self, peer: Peer) -> None:
        """A consumer is gone: its Wants wait no more."""
        if peer.wants:
            for rid in [r for r, asks in self._wants.items() if any(a[0] is peer for a in asks)]:
                self._wants[rid] = [a for a in self._wants[rid] if a[0] is not peer]
                if not self._wants[rid]:
                    del self._wants[rid]
            self.count -= peer.wants
            peer.wants = 0


_MAX_LEASE_BATCHES = 8  # Heartbeats per peer whose Lease replies may wait to be sent (8,192 ids)


class LeaseRenewals:
    """Readers' Heartbeats, answered. Given the side (its scheduler and counters), the exports by
    request id (read only) and what to do with a peer lost while it is answered."""

    def __init__(self, side: Side, exports: Mapping[str, ExportRecord], *, lost: Callable[[Peer], None]) -> None:
        self._scheduler = side.scheduler
        self._stats = side.stats
        self._exports = exports
        self._lost = lost

    def on_heartbeat(self, peer: Peer, msg: wire.Heartbeat) -> None:
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
            asyncio.ensure_future(self._send(peer))

    async def _send(self, peer: Peer) -> None:
        try:
            while peer.lease_replies and peer.alive:
                for lease in peer.lease_replies[0]:
                    await peer.channel.send(lease)
                peer.lease_replies.pop(0)
        except PeerLost:
            self._lost(peer)
        finally:
            peer.renewing = False
            if not peer.alive:
                peer.lease_replies.clear()


__all__ = ["Ask", "AsksAhead", "LeaseRenewals"]
