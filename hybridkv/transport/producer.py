"""The prefill side: exports finished requests to the consumers that ask for them.

A :class:`Producer` listens; a consumer dials it and asks for a request
(``wire.Want``). A request several decode ranks share (``readers``) ends when
every reader is done; any other claim on it is refused (``FailureCode.CLAIMED``).
The design, pull and push, is in :mod:`hybridkv.transport.endpoint`.

The producer is three parts, one module each, and delegates to them: its core
(:class:`~hybridkv.transport.side.Side`: data plane, peers, counters, the pump), who
it lets in (:class:`~hybridkv.transport.admission.Admission`: the listener and the
handshake) and what it offers (:class:`~hybridkv.transport.exports.Exports`: exports,
the asks for them, leases and ends).
"""

from __future__ import annotations

from hybridkv import wire
from hybridkv.transport import auth
from hybridkv.transport.admission import Admission
from hybridkv.transport.config import Result, TransportConfig
from hybridkv.transport.exports import Exports
from hybridkv.transport.memory import MemoryMap
from hybridkv.transport.plan import Planner
from hybridkv.transport.side import Peer, Side, send_quietly
from hybridkv.transport.staging import StagePool, StagingConfig


class Producer:
    """Prefill side: exports finished requests to connected consumers.

    ``memory``, ``scheduler``, ``config``, ``planner``, ``pairing``, ``dp`` (the data plane),
    ``compat`` (the handshake's compatibility fields), ``stats``, ``metrics`` and ``peers``
    (connected consumers by NIXL agent name) are its core's, exposed for connectors and tests:
    read them, never rebind them.
    """

    role = wire.Role.PRODUCER

    def __init__(self, memory: MemoryMap, scheduler, config: TransportConfig | None = None, *,
                 planner: Planner, staging: StagingConfig | None = None) -> None:
        """``staging``: a pool to pack heterogeneous-TP reads into (transport/staging.py), in the
        regions' memory kind, its region appended to ``memory``; None (default): no pool, every
        read is posted sliced."""
        pool = StagePool(memory, staging) if staging is not None and staging.enabled and memory.regions else None
        if pool is not None:
            memory = pool.memory
        side = self._side = Side(memory, scheduler, config or TransportConfig(), planner, role=self.role)
        self.memory, self.scheduler, self.config, self.planner = side.memory, side.scheduler, side.config, side.planner
        self.pairing, self.dp, self.compat = side.pairing, side.dp, side.compat
        self.stats, self.metrics, self.peers = side.stats, side.metrics, side.peers
        self._exports = Exports(side, pool)
        #: the staging pool (None: staging off on this side)
        self.staging = pool
        self._admission = Admission(side, serve=self._exports.serve, lost=self._exports.peer_lost)

    def hello(self) -> wire.Hello:
        return self._side.hello()

    def check_hello(self, h: wire.Hello) -> MemoryMap:
        """Refuse an incompatible peer, saying what differs; returns its memory map."""
        return self._side.check_hello(h)

    def describe(self) -> dict:
        """What is in flight, for an operator or a stuck test to print (plain data)."""
        return {**self._side.describe(), **self._exports.describe()}

    async def start(self) -> tuple[str, int]:
        """Listen (``TransportConfig.port``, 0 for any); returns the address consumers dial."""
        self._side.warn_if_open(f"listening on port {self.config.port or '(any)'}")
        port = self._admission.listen()
        self._side.start_pump(self._exports.on_notif, self._tick)
        return self.config.host, port

    def _tick(self) -> None:
        # Every pump round: the listener's queues first, then lapsed leases.
        self._admission.sweep()
        self._exports.tick()

    async def wait_peer(self, timeout_s: float) -> None:
        await self._admission.wait_peer(timeout_s)

    async def export(self, request_id: str, *, token: bytes, peer: str | None = None,
                     claimants: auth.Claimants | None = None) -> Result:
        """Export a finished request (``request_finished(export=True)`` done) and wait until
        its readers are done with the blocks, failed, or the lease lapsed.

        The request goes to whichever consumer asks for it (``wire.Want``, sent by
        ``Consumer.fetch``), before or after this call; a claim beyond the readers the
        first claim announced is refused. ``token`` is the request's capability
        (:func:`hybridkv.transport.auth.new_token`, handed to the decode side with the request):
        a Want, Heartbeat, Done or Failure without it is ignored. ``peer`` names a consumer to
        offer it to unasked. ``claimants`` binds the capability to the decode it is issued for (its
        agent names, its networks): a Want with the token from any other session is ignored as one
        with a wrong token is, so an insider that sees the token first claims nothing.
        """
        auth.check_token(token, f"export of {request_id!r}: token")
        target: Peer | None = None
        if peer is not None:
            target = self.peers.get(peer)
            if target is None:
                raise ValueError(f"peer {peer!r}; expected one of {sorted(self.peers)}")
        if claimants is not None and not isinstance(claimants, auth.Claimants):
            raise ValueError(f"export of {request_id!r}: claimants {claimants!r}; expected auth.Claimants or None")
        return await self._exports.export(request_id, token=token, target=target, claimants=claimants)

    async def close(self) -> None:
        self._side.start_closing()
        for peer in list(self.peers.values()):
            await send_quietly(peer.channel, wire.Bye(reason="closing"))
            await peer.channel.close()
        self._admission.close()
        await self._side.close()


__all__ = ["Producer"]
