"""The decode side: asks producers for requests (``wire.Want``) and imports them.

A :class:`Consumer` may be connected to several producers (one per prefill TP
rank it needs); one import then has a *part* per producer and lands only when
every part landed: the scheduler sees one transfer for the whole request, so
its components become visible together (rule 4) or not at all. Here: the
producers as peers, what they say on the control channel, the leases the consumer
renews and the requests it releases. How it dials a producer (the handshake,
retried) is in :mod:`hybridkv.transport.dial`; what one import runs through, in
:mod:`hybridkv.transport.fetch`.

The consumer never pairs blocks itself: its :class:`~hybridkv.transport.plan.Planner`
(given at construction) is prepared once per set of producers and turns each
import's block lists into a :class:`~hybridkv.transport.plan.TransferPlan`. A plan
of whole pages is posted as prepped-list index pairs (NIXL merges back-to-back
pages), any other as ``(addr, len, dev)`` rows.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Sequence

from hybridkv import wire
from hybridkv.errors import PeerError, PeerLost
from hybridkv.transport import auth
from hybridkv.transport.config import TransportConfig
from hybridkv.transport.dial import _Dial
from hybridkv.transport.fetch import _Fetch, _Part
from hybridkv.transport.metrics import FailureKind
from hybridkv.transport.plan import PeerPlanner, Planner
from hybridkv.transport.side import _Peer, _remember, _rid_of, _send_quietly, _Side


class Consumer(_Fetch, _Dial, _Side):
    """Decode side: dials producers and imports requests from them."""

    role = wire.Role.CONSUMER

    def __init__(self, memory, scheduler, config=None, *, planner: Planner) -> None:
        super().__init__(memory, scheduler, config or TransportConfig(), planner)
        self.peers: dict[str, _Peer] = {}
        self._parts: dict[tuple[str, str], _Part] = {}
        self._tasks: list[asyncio.Task] = []
        self._hb_sent: dict[str, float] = {}
        self._seq = 0
        self._init_dial()
        # (agent, request) this consumer released: an Export arriving after is refused at
        # once, not renewed for a reader that will never come (bounded).
        self._released: OrderedDict[tuple[str, str], bytes] = OrderedDict()  # -> the request's token
        #: the planner prepared per set of producers (agent names, in the order read)
        self.plans: dict[tuple[str, ...], PeerPlanner] = {}
        self._init_fetch()
        self._warn_if_open("")

    def describe(self) -> dict:
        return {**super().describe(),
                "parts": {f"{a}/{r}": {"wanted": p.wanted, "exported": p.export.done(), "landed": p.landed.is_set(),
                                       "failed": p.failed, "lease_lost": p.lease_lost}
                          for (a, r), p in self._parts.items()}}

    @property
    def peer(self) -> _Peer | None:
        """The first producer connected (the only one in the common 1:1 case)."""
        return next(iter(self.peers.values()), None)

    def prepared(self, agents: Sequence[str]) -> PeerPlanner:
        """The planner prepared for an import from these producers (made on first use)."""
        key = tuple(agents)
        prepared = self.plans.get(key)
        if prepared is None:
            prepared = self.planner.prepare(tuple(self._peer(a).memory for a in key), self.memory)
            self.plans[key] = prepared
        return prepared

    def _peer(self, agent: str | None) -> _Peer:
        if agent is None:
            if len(self.peers) != 1:
                raise ValueError(f"{len(self.peers)} producers connected; expected exactly one or a producer name")
            return next(iter(self.peers.values()))
        peer = self.peers.get(agent)
        if peer is None:
            raise ValueError(f"producer {agent!r}; expected one of {sorted(self.peers)}")
        return peer

    def _part(self, rid: str, peer: _Peer, token: bytes) -> _Part:
        part = self._parts.get((peer.agent, rid))
        if part is None:
            part = _Part(rid=rid, peer=peer, export=asyncio.get_running_loop().create_future(), token=token)
            self._parts[(peer.agent, rid)] = part
        elif part.token != token:
            raise ValueError(f"request {rid!r} was asked for with another capability token; expected the one "
                             "the producer side issued with it")
        return part

    async def want(self, request_id: str, *, token: bytes, peer: str | None = None, readers: int = 1) -> None:
        """Ask a producer for a request (``fetch`` does this; calling it earlier lets the
        Export arrive ahead). ``token``: the request's capability, issued by the producer side
        with the request. ``readers``: how many consumers read it together."""
        if not 1 <= readers <= wire.MAX_READERS:
            raise ValueError(f"readers = {readers}; expected 1..{wire.MAX_READERS}")
        auth.check_token(token, f"request {request_id!r}: token")
        p = self._peer(peer)
        part = self._part(request_id, p, token)
        if part.wanted:
            return
        part.wanted = True
        try:
            await p.channel.send(wire.Want(request_id=request_id, token=token, readers=readers))
        except PeerLost:
            self._lost(p)

    def exported(self, request_id: str, *, peer: str | None = None) -> bool:
        """Whether the producer's Export for the request arrived."""
        part = self._parts.get((self._peer(peer).agent, request_id))
        return part is not None and part.export.done()

    # ------------------------------------------------------------ control messages
    async def _serve(self, peer: _Peer) -> None:
        while not self._closing:
            msg = await self._next_message(peer)
            if msg is None:
                self._lost(peer)
                return
            if isinstance(msg, wire.Export):
                token = self._released.get((peer.agent, msg.request_id))
                if token is not None:
                    await _send_quietly(peer.channel, wire.Failure(
                        request_id=msg.request_id, code=wire.FailureCode.ABORTED, detail="released by the consumer",
                        token=token))
                    continue
                part = self._parts.get((peer.agent, msg.request_id))
                if part is None:
                    self.stats.unknown += 1  # never asked for (an Export comes only after a Want)
                elif not part.export.done():
                    part.export.set_result((msg, time.monotonic()))
            elif isinstance(msg, wire.Lease):
                self._on_lease(peer, msg)
            elif isinstance(msg, (wire.Failure, wire.Done)):
                part = self._parts.get((peer.agent, msg.request_id))
                if part is None or msg.token != part.token:
                    self.stats.unknown += 1
                elif not (isinstance(msg, wire.Done) and msg.ok):
                    part.failed = msg.detail if isinstance(msg, wire.Failure) else "producer failed"
                    part.kind = _KIND_OF_CODE.get(msg.code, FailureKind.REFUSED) if isinstance(
                        msg, wire.Failure) else FailureKind.TRANSFER
                    if not part.export.done():  # refused before any Export (claimed, unknown)
                        part.export.set_exception(PeerError(f"producer refused {msg.request_id}: {part.failed}"))
                    part.landed.set()
            elif isinstance(msg, wire.Bye):
                self._lost(peer)
                return
            else:
                self.stats.rejected += 1

    def _lost(self, peer: _Peer) -> None:
        if not peer.alive:
            return
        peer.alive = False
        for (agent, _), part in self._parts.items():
            if agent != peer.agent:
                continue
            if part.failed is None:
                part.failed, part.kind = "producer lost", FailureKind.PEER_LOST
            if not part.export.done():
                part.export.set_exception(PeerLost("producer lost"))
            part.landed.set()

    def alive(self, agent: str) -> bool:
        """Whether the producer ``agent`` is connected and its control channel works."""
        peer = self.peers.get(agent)
        return peer is not None and peer.alive

    async def release(self, request_id: str, *, token: bytes, peer: str,
                      detail: str = "released by the consumer") -> None:
        """This consumer will not read the request (asked for or not): the producer frees its
        blocks now instead of when the lease lapses. A fetch of it in progress fails. ``token``:
        the request's capability (the producer ignores a release without it)."""
        p = self._peer(peer)
        _remember(self._released, (p.agent, request_id), token)
        part = self._parts.pop((p.agent, request_id), None)
        if part is not None:
            part.failed = part.failed or detail
            if not part.export.done():
                part.export.set_exception(PeerError(f"{request_id}: {detail}"))
                part.export.exception()  # retrieved: nobody may wait on it
            part.landed.set()
        if p.alive:
            await _send_quietly(p.channel, wire.Failure(request_id=request_id, code=wire.FailureCode.ABORTED,
                                                        detail=detail[: wire.MAX_TEXT], token=token))

    async def forget(self, agent: str) -> None:
        """Drop a producer (a restarted one answers under a new agent name at the same address):
        its parts fail, its channel closes, NIXL unloads its agent (``remove_remote_agent``)."""
        peer = self.peers.pop(agent, None)
        if peer is None:
            return
        was_alive = peer.alive
        self._lost(peer)
        if was_alive:
            await _send_quietly(peer.channel, wire.Bye(reason="forgotten"))
        await peer.channel.close()
        for key in [k for k in self.plans if agent in k]:
            del self.plans[key]
        self._hb_sent.pop(agent, None)
        try:
            self.dp.remove_peer(agent)
        except Exception:  # NIXL may already have dropped a dead peer; nothing else refers to it
            pass

    def _on_lease(self, peer: _Peer, msg: wire.Lease) -> None:
        part = self._parts.get((peer.agent, msg.request_id))
        if part is None:
            return
        if msg.lease_s <= 0:
            part.lease_lost = True
            return
        # Conservative: from when our renewal left, not when the answer came (lease.py).
        sent = self._hb_sent.get(peer.agent, time.monotonic())
        deadline = sent + msg.lease_s * (1 - self.config.lease_margin)
        if deadline > part.deadline or part.deadline == float("inf"):
            part.deadline = deadline
            # The request's lease is its shortest part's.
            earliest = min(p.deadline for (_, r), p in self._parts.items() if r == msg.request_id)
            if earliest != float("inf") and self.scheduler.has_request(msg.request_id):
                self.scheduler.lease_renewed(msg.request_id, earliest)

    async def _heartbeats(self, peer: _Peer) -> None:
        period = self.config.heartbeat_s or max(0.05, peer.lease_s / 6)
        while not self._closing and peer.alive:
            await asyncio.sleep(period)
            tickets = [wire.Ticket(request_id=r, token=p.token) for (a, r), p in self._parts.items()
                       if a == peer.agent and p.export.done()]
            self._seq += 1
            self._hb_sent[peer.agent] = time.monotonic()
            try:
                # In pieces the wire allows; the producer answers one before it reads the next.
                for i in range(0, max(len(tickets), 1), wire.MAX_REQUESTS_PER_HEARTBEAT):
                    await peer.channel.send(wire.Heartbeat(
                        seq=self._seq, tickets=tuple(tickets[i:i + wire.MAX_REQUESTS_PER_HEARTBEAT])))
            except PeerLost:
                self._lost(peer)
                return

    def _on_notif(self, agent: str, msg: bytes) -> None:
        rid = _rid_of(msg)
        part = self._parts.get((agent, rid)) if rid is not None else None
        if part is None or self.config.mode is not wire.Mode.PUSH:
            self.stats.unknown += 1
            return
        if part.notified:
            self.stats.duplicates += 1
            return
        part.notified = True
        part.landed.set()

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        await self._close_dialing()
        for peer in self.peers.values():
            if peer.alive:
                await _send_quietly(peer.channel, wire.Bye(reason="closing"))
                await peer.channel.close()
        await super().close()


#: What a producer's Failure says, as a failure kind.
_KIND_OF_CODE = {
    wire.FailureCode.TRANSFER_ERROR: FailureKind.TRANSFER,
    wire.FailureCode.LEASE_EXPIRED: FailureKind.LEASE,
    wire.FailureCode.UNKNOWN_REQUEST: FailureKind.REFUSED,
    wire.FailureCode.ABORTED: FailureKind.REFUSED,
    wire.FailureCode.PROTOCOL: FailureKind.PROTOCOL,
    wire.FailureCode.CLAIMED: FailureKind.REFUSED,
}

