"""The decode side: asks producers for requests (``wire.Want``) and imports them.

A :class:`Consumer` may be connected to several producers (one per prefill TP
rank it needs); one import then has a *part* per producer and lands only when
every part landed: the scheduler sees one transfer for the whole request, so
its components become visible together (rule 4) or not at all.

The consumer is six parts, one module each, and delegates to them: its core
(:class:`~hybridkv.transport.side.Side`: data plane, peers, counters, the pump), how
it dials a producer (:class:`~hybridkv.transport.dial.Dialer`: the handshake, retried),
what it asked for (:class:`~hybridkv.transport.parts.Parts`), what it hears from its
producers and the leases it renews (:class:`~hybridkv.transport.links.ProducerLinks`),
what one import runs through (:class:`~hybridkv.transport.fetch.Importer`) and who may
still write a posted import (:class:`~hybridkv.transport.drains.Drains`, the core's
``ImportLedger``: blocks go back only once every writer landed or drained, or the drain
deadline passed). Here: the calls of its API, and the requests it releases.

The consumer never pairs blocks itself: its :class:`~hybridkv.transport.plan.Planner`
(given at construction) is prepared once per set of producers and turns each
import's block lists into a :class:`~hybridkv.transport.plan.TransferPlan`. A plan
of whole pages is posted as prepped-list index pairs (NIXL merges back-to-back
pages), any other as ``(addr, len, dev)`` rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence

from hybridkv import wire
from hybridkv.errors import PeerError, PeerLost
from hybridkv.transport import auth
from hybridkv.transport.config import Result, TransportConfig
from hybridkv.transport.dataplane import Transfer, XferState
from hybridkv.transport.dial import Dialer
from hybridkv.transport.drains import Drains
from hybridkv.transport.fetch import Importer, Work
from hybridkv.transport.links import ProducerLinks
from hybridkv.transport.memory import MemoryMap
from hybridkv.transport.metrics import FailureKind
from hybridkv.transport.parts import Parts
from hybridkv.transport.plan import PeerPlanner, Planner
from hybridkv.transport.side import Peer, Side, send_quietly
from hybridkv.transport.staging import StagePool, StagingConfig


class Consumer:
    """Decode side: dials producers and imports requests from them.

    ``memory``, ``scheduler``, ``config``, ``planner``, ``pairing``, ``dp`` (the data plane),
    ``compat`` (the handshake's compatibility fields), ``stats``, ``metrics`` and ``peers``
    (connected producers by NIXL agent name) are its core's, exposed for connectors and tests:
    read them, never rebind them.
    """

    role = wire.Role.CONSUMER

    def __init__(self, memory, scheduler, config=None, *, planner: Planner, staging: StagingConfig | None = None) -> None:
        """``staging``: ask producers to stage heterogeneous-TP reads (transport/staging.py), with a
        pool of this side's own (its region appended to ``memory``) to read them through where the
        read would land in many pieces; None (default): never, every read is posted sliced."""
        pool = StagePool(memory, staging) if staging is not None and staging.enabled and memory.regions else None
        if pool is not None:
            memory = pool.memory
        side = self._side = Side(memory, scheduler, config or TransportConfig(), planner, role=self.role)
        self.memory, self.scheduler, self.config, self.planner = side.memory, side.scheduler, side.config, side.planner
        self.pairing, self.dp, self.compat = side.pairing, side.dp, side.compat
        self.stats, self.metrics, self.peers = side.stats, side.metrics, side.peers
        #: the planner prepared per set of producers (agent names, in the order read)
        self.plans: dict[tuple[str, ...], PeerPlanner] = {}
        self._tasks: list[asyncio.Task] = []  # per producer: its control channel and its heartbeats
        self._parts = Parts()
        self._drains = Drains(side)
        self._links = ProducerLinks(side, self._parts, self._drains)
        self._dialer = Dialer(side, on_peer=self._on_peer)
        # post and wait are this object's where a subclass overrides them (that override is what runs);
        # else the importer posts and waits itself, two frames fewer on the path from the plan to the READ
        # seen landed, which runs cold once per request (issue 49 item 4).
        cls = type(self)
        self._importer = Importer(side, self._parts, want=self.want, prepared=self.prepared, lost=self._links.lost,
                                  post=self._post if cls._post is not Consumer._post else None,
                                  wait=self._wait_xfer if cls._wait_xfer is not Consumer._wait_xfer else None,
                                  drains=self._drains, staging=staging, pool=pool)
        #: this side's staging pool (None: none)
        self.staging = pool
        side.warn_if_open("")

    def hello(self) -> wire.Hello:
        return self._side.hello()

    def check_hello(self, h: wire.Hello) -> MemoryMap:
        """Refuse an incompatible peer, saying what differs; returns its memory map."""
        return self._side.check_hello(h)

    def describe(self) -> dict:
        """What is in flight, for an operator or a stuck test to print (plain data)."""
        return {**self._side.describe(), "parts": self._parts.describe(), "imports": self._drains.describe()}

    @property
    def peer(self) -> Peer | None:
        """The first producer connected (the only one in the common 1:1 case)."""
        return next(iter(self.peers.values()), None)

    async def connect(self, host: str, port: int) -> str:
        """Handshake; returns the producer's agent name. A timeout or an unreachable producer is
        retried (``TransportConfig.handshake_retries``, with backoff). Raises HandshakeRefused
        (saying what differs, never retried), HandshakeTimeout or PeerLost once the tries are spent.
        Callers connecting to one address at once share one call (as the connectors do)."""
        return await self._dialer.connect(host, port)

    def _on_peer(self, peer: Peer) -> None:
        # A producer let in: serve its channel, renew its leases, pump its notifications.
        loop = asyncio.get_running_loop()
        self._tasks += [loop.create_task(self._links.serve(peer)), loop.create_task(self._links.heartbeats(peer))]
        self._side.start_pump(self._links.on_notif, self._drains.expire)

    def prepared(self, agents: Sequence[str]) -> PeerPlanner:
        """The planner prepared for an import from these producers (made on first use)."""
        key = tuple(agents)
        prepared = self.plans.get(key)
        if prepared is None:
            prepared = self.planner.prepare(tuple(self._peer(a).memory for a in key), self.memory)
            self.plans[key] = prepared
        return prepared

    def _peer(self, agent: str | None) -> Peer:
        if agent is None:
            if len(self.peers) != 1:
                raise ValueError(f"{len(self.peers)} producers connected; expected exactly one or a producer name")
            return next(iter(self.peers.values()))
        peer = self.peers.get(agent)
        if peer is None:
            raise ValueError(f"producer {agent!r}; expected one of {sorted(self.peers)}")
        return peer

    async def want(self, request_id: str, *, token: bytes, peer: str | None = None, readers: int = 1,
                   stage: bool = False, fields: bytes = b"") -> None:
        """Ask a producer for a request (``fetch`` does this; calling it earlier lets the
        Export arrive ahead). ``token``: the request's capability, issued by the producer side
        with the request. ``readers``: how many consumers read it together. ``stage``: ask the producer to
        pack this side's slices into a staging slot (``fetch`` decides; a producer without a pool ignores it),
        ``fields`` of them (the stager's mask, ``ImportStaging.fields``; empty: every field it holds)."""
        if not 1 <= readers <= wire.MAX_READERS:
            raise ValueError(f"readers = {readers}; expected 1..{wire.MAX_READERS}")
        auth.check_token(token, f"request {request_id!r}: token")
        p = self._peer(peer)
        part = self._parts.open(request_id, p, token)
        if part.wanted:
            return
        part.wanted = True
        part.fields = fields if stage else None  # the staged read is planned by what was asked
        try:
            await p.channel.send(wire.Want(request_id=request_id, token=token, readers=readers, stage=stage,
                                           fields=part.fields or b""))
        except PeerLost:
            self._links.lost(p)
            return
        self.dp.prime(p.agent)  # nothing to do here until the Export: warm the posting path (if it primes)

    def exported(self, request_id: str, *, peer: str | None = None) -> bool:
        """Whether the producer's Export for the request arrived."""
        part = self._parts.get(self._peer(peer).agent, request_id)
        return part is not None and part.export.done()

    async def fetch(self, request_id: str, components: Iterable, *, token: bytes,
                    peers: Sequence[str] | None = None, readers: int = 1, stage: bool | None = None) -> Result:
        """Import a request whose blocks the engine allocated (scheduler.add_request(expect=...)).

        Asks each producer in ``peers`` (default: the only one connected) for the
        request, waits for their Exports, posts the transfer the planner made when
        the fence allows, and ends in a defined state: READY once every part landed,
        or per the failure policy RECOMPUTE or FAILED. ``token``: the request's capability,
        issued by the producer side with the request. ``readers``: consumers sharing each
        producer's copy. ``stage``: False reads this request sliced whatever the staging config
        says (None: as it says).
        """
        auth.check_token(token, f"request {request_id!r}: token")
        comps = tuple(components)
        targets = [self._peer(a) for a in peers] if peers else [self._peer(None)]
        return await self._importer.fetch(request_id, comps, token=token, targets=targets, readers=readers,
                                          stage=stage)

    def settling(self, request_id: str) -> bool:
        """Whether an import of the request that ended (failed) may still be written: a READ NIXL would
        not abort, which holds its blocks until it ends (rule 5)."""
        return self._importer.settling(request_id)

    async def settled(self, request_id: str) -> None:
        """Wait until no READ of the request may still write its blocks: a failed import whose
        READ NIXL would not abort ends only when that READ does (rule 5). At once otherwise."""
        await self._importer.settled(request_id)

    # Hooks of the import path (given to the Importer); the reference demo's fault injection
    # overrides _post and _wait_xfer, and calls _give_up for an import that cannot start.
    def _post(self, w: Work, notif: bytes) -> Transfer:
        """Post one producer's READ."""
        return self._importer.post_read(w, notif)

    async def _wait_xfer(self, xfer: Transfer, until: Callable[[], float] | None = None) -> XferState:
        """The transfer's terminal state, or IN_PROGRESS once ``until()`` (a monotonic time) passed."""
        return await self._side.wait_xfer(xfer, until)

    def _give_up(self, rid: str, comps, error: str, *, kind: FailureKind = FailureKind.TRANSFER) -> Result:
        """Failed before any transfer was posted: recomputed or failed per the failure policy."""
        return self._importer.give_up(rid, comps, error, kind=kind)

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
        # A WRITE of the producer's may be in flight (push): the import fails, its blocks stay out of
        # reuse until the producer drains or the drain deadline passes.
        self._drains.aborted(p.agent, request_id, token, detail)
        part = self._parts.release(p.agent, request_id, token)
        if part is not None:
            part.failed = part.failed or detail
            if not part.export.done():
                part.export.set_exception(PeerError(f"{request_id}: {detail}"))
                part.export.exception()  # retrieved: nobody may wait on it
            part.landed.set()
        if p.alive:
            await send_quietly(p.channel, wire.Failure(request_id=request_id, code=wire.FailureCode.ABORTED,
                                                       detail=detail[: wire.MAX_TEXT], token=token))

    async def forget(self, agent: str) -> None:
        """Drop a producer (a restarted one answers under a new agent name at the same address):
        its parts fail, its channel closes, NIXL unloads its agent (``remove_remote_agent``)."""
        peer = self.peers.pop(agent, None)
        if peer is None:
            return
        was_alive = peer.alive
        self._links.lost(peer)
        if was_alive:
            await send_quietly(peer.channel, wire.Bye(reason="forgotten"))
        await peer.channel.close()
        for key in [k for k in self.plans if agent in k]:
            del self.plans[key]
        self._links.forget(agent)
        self._side.drop_agent(agent)

    async def close(self) -> None:
        self._side.start_closing()
        for t in self._tasks:
            t.cancel()
        self._importer.cancel()
        # Done of the imports that landed goes before the Bye (a send takes well under a ms; a peer that
        # takes the bound is stuck, and its lease frees the blocks anyway)
        await self._importer.flush(min(self.config.export_timeout_s, 2.0))
        await self._dialer.close()
        for peer in self.peers.values():
            if peer.alive:
                await send_quietly(peer.channel, wire.Bye(reason="closing"))
                await peer.channel.close()
        await self._side.close()


__all__ = ["Consumer"]
