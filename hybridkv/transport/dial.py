"""How the consumer gets in: its side of the handshake, retried, one dial per producer address.

A :class:`~hybridkv.transport.consumer.Consumer` holds a :class:`Dialer`, as a
:class:`~hybridkv.transport.producer.Producer` holds an
:class:`~hybridkv.transport.admission.Admission`. The consumer proves the shared
secret and checks the producer's proof (:mod:`hybridkv.transport.auth`) before it sends its Hello;
only a producer whose Hello checks out becomes a peer (its NIXL agent added, its control messages
served, its leases renewed). A handshake that times out is not cancelled (see ``_connect_once``):
the next try waits on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from hybridkv import wire
from hybridkv.errors import HandshakeRefused, HandshakeTimeout, PeerLost, ProtocolViolation
from hybridkv.transport import auth, control
from hybridkv.transport.metrics import FailureKind
from hybridkv.transport.side import Peer, Side, send_quietly

log = logging.getLogger(__name__)

#: How long a handshake that timed out may stay in flight (the next try waits on it) before UCX gives up.
_LATE_TRY_LIMIT_S = 600.0


class Dialer:
    """The consumer's dialling. Given the side (its config, metrics, data plane, peers and Hello)
    and ``on_peer``, called with each producer let in once it is in ``side.peers``."""

    def __init__(self, side: Side, *, on_peer: Callable[[Peer], None]) -> None:
        self._side = side
        self._on_peer = on_peer
        self._dialing: dict[tuple[str, int], asyncio.Task] = {}  # a handshake in flight per producer address

    async def connect(self, host: str, port: int) -> str:
        """Handshake; returns the producer's agent name. A timeout or an unreachable producer is
        retried (``TransportConfig.handshake_retries``, with backoff). Raises HandshakeRefused
        (saying what differs, never retried), HandshakeTimeout or PeerLost once the tries are spent.
        Callers connecting to one address at once share one call (as the connectors do)."""
        try:
            return await self._connect_retrying(host, port)
        except Exception:
            self._side.metrics.failure(FailureKind.HANDSHAKE)
            raise

    async def _connect_retrying(self, host: str, port: int) -> str:
        cfg = self._side.config
        for attempt in range(cfg.handshake_retries + 1):
            try:
                return await self._connect_once(host, port)
            except (HandshakeTimeout, PeerLost) as exc:
                if attempt == cfg.handshake_retries:
                    tries = cfg.handshake_retries + 1
                    raise type(exc)(f"{exc} ({tries} tr{'y' if tries == 1 else 'ies'})") from exc
                log.warning("handshake with %s:%d failed (%s); trying again in %.1f s", host, port, exc,
                            cfg.handshake_backoff_s * 2 ** attempt)
                await asyncio.sleep(cfg.handshake_backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    async def _connect_once(self, host: str, port: int) -> str:
        timeout = self._side.config.handshake_timeout_s
        # Waited for, never cancelled: ucxx's endpoint creation and receives post UCX requests into
        # buffers that a cancellation frees while the request stays posted, so a producer that
        # answers after a cancelled try (one resumed from a stall) writes into freed memory (a
        # segfault on the next try, seen with a SIGSTOPped producer). A try that times out stays in
        # flight, and the next try waits on it rather than dialling again: one dial per producer.
        key = (host, port)
        attempt = self._dialing.get(key)
        if attempt is None:
            attempt = self._dialing[key] = asyncio.get_running_loop().create_task(self._exchange_hellos(host, port))
        done, _ = await asyncio.wait({attempt}, timeout=timeout)
        if not done:
            raise HandshakeTimeout(f"no handshake from {host}:{port} within {timeout} s")
        self._dialing.pop(key, None)
        ch, reply = attempt.result()
        if isinstance(reply, wire.Refuse):
            await ch.close()
            # The producer lists what differs as it sees it: local is ours here.
            mine = [wire.Difference(field=d.field, local=d.remote, remote=d.local) for d in reply.differences]
            raise HandshakeRefused(f"refused by {host}:{port}: {_refusal_reason(reply)}", mine)
        if not isinstance(reply, wire.Hello):
            await ch.close()
            raise ProtocolViolation(f"handshake reply is {type(reply).__name__}; expected Hello or Refuse")
        side = self._side
        try:
            remote = side.check_hello(reply)
        except HandshakeRefused:
            await send_quietly(ch, wire.Bye(reason="incompatible"))
            await ch.close()
            raise
        agent = side.dp.add_peer(reply.metadata, remote)
        if agent != reply.agent:  # the metadata must be of the agent that proved itself in the handshake
            if agent not in side.peers:
                side.drop_agent(agent)
            await ch.close()
            raise ProtocolViolation(f"{host}:{port} sent NIXL metadata of agent {agent!r}; its Hello named "
                                    f"{reply.agent!r}")
        if agent in side.peers:  # dialled twice: keep the first channel
            await send_quietly(ch, wire.Bye(reason="already connected"))
            await ch.close()
            return agent
        side.dp.connect(agent)
        peer = Peer(agent=agent, channel=ch, memory=remote, lease_s=reply.lease_s)
        side.peers[agent] = peer
        self._on_peer(peer)
        return agent

    async def _exchange_hellos(self, host: str, port: int) -> tuple[control.Channel, wire.Message]:
        # The dial's own limit is far out: _connect_once bounds the wait without cancelling (see there).
        ch = await control.dial(host, port, _LATE_TRY_LIMIT_S)
        side = self._side
        secret = side.config.secret
        # Both sides prove the secret, over this connection as each sees it, before either sends its
        # metadata (auth.py); this side proves first, and only to the address it chose to dial.
        dialled = auth.address(host, port)
        nonce = auth.new_nonce()
        await ch.send(wire.Auth(nonce=nonce, address=dialled, agent=side.dp.name))
        reply = await _recv_preauth(ch, host, port)
        if not isinstance(reply, wire.Auth):
            return ch, reply
        if len(reply.nonce) != wire.NONCE_BYTES or not reply.agent or not reply.address:
            await ch.close()
            raise ProtocolViolation(f"{host}:{port} answered Auth without a nonce, its address or its agent name")
        transcript = auth.Transcript(consumer_nonce=nonce, producer_nonce=reply.nonce, dialled=dialled,
                                     producer=reply.address, consumer_agent=side.dp.name, producer_agent=reply.agent)
        try:
            await ch.send(wire.Auth(proof=auth.proof(secret, wire.Role.CONSUMER, transcript)))
        except PeerLost:
            pass  # a producer that refused at once: its Refuse may be here, and says more than the reset
        reply = await _recv_preauth(ch, host, port)
        if not isinstance(reply, wire.Auth):
            return ch, reply
        if not auth.proves(secret, wire.Role.PRODUCER, transcript, reply.proof):
            await ch.close()
            raise HandshakeRefused(f"{host}:{port} did not prove the shared secret over this connection "
                                   f"({'no proof' if not reply.proof else 'a wrong proof'}); expected a producer "
                                   "configured with the same TransportConfig.secret, dialled directly")
        if secret is not None:
            ch.seal(auth.Sealer(auth.session_key(secret, transcript), wire.Role.CONSUMER))
        await ch.send(side.hello())
        reply = await ch.recv()
        if isinstance(reply, wire.Hello) and reply.agent != transcript.producer_agent:
            await ch.close()
            raise ProtocolViolation(f"{host}:{port} sent a Hello of agent {reply.agent!r}; its Auth named "
                                    f"{transcript.producer_agent!r}")
        return ch, reply

    async def close(self) -> None:
        """Handshakes nobody waits for any more: ended here, their channels closed."""
        dialing, self._dialing = list(self._dialing.values()), {}
        for t in dialing:
            t.cancel()
        for result in await asyncio.gather(*dialing, return_exceptions=True):
            if isinstance(result, tuple):
                await result[0].close()


async def _recv_preauth(ch: control.Channel, host: str, port: int) -> wire.Message:
    # Nothing the producer says before it proved the secret needs more than a pre-auth frame (its
    # Auth or a Refuse): a longer one is refused before anything is allocated for it.
    try:
        return await ch.recv(limit=wire.MAX_PREAUTH_BYTES)
    except wire.WireError as exc:
        await ch.close()
        raise ProtocolViolation(f"{host}:{port} answered the handshake with {exc}, before proving the "
                                "shared secret") from None


def _refusal_reason(reply: wire.Refuse) -> str:
    """The producer's reason without the differences it appends as it sees them: the consumer's error
    lists them once, as this side sees them (its own value as local). A peer that has not proved the
    shared secret, or any peer in lab mode, hears a bare "refused" (what differs would let it forge a
    Hello that passes): the producer's log names it."""
    reason = reply.reason
    detail = "; ".join(str(d) for d in reply.differences)
    if detail and reason.endswith(f": {detail}"):
        return reason[: -len(detail) - 2]
    return reason


__all__ = ["Dialer"]
