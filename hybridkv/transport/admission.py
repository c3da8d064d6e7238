"""Who the producer lets in: its side of the handshake, and the listener's bounds.

:class:`Admission` is held by :class:`~hybridkv.transport.producer.Producer` and runs its
listener. A connection first proves the shared secret (:mod:`hybridkv.transport.auth`), reading at
most ``wire.MAX_PREAUTH_BYTES`` per frame until it has, then sends its Hello; only then is its NIXL
agent added and the producer's Hello (metadata, region table) sent. A peer that has not proved the
secret is told "refused" and nothing more. Around that, from the producer's pump: messages queued
under ucxx tags nobody receives are drained (a flood of them closes every connection still
unproven), and TCP connections on the listener port that never become a channel are shut down.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hybridkv import wire
from hybridkv.errors import HandshakeRefused, PeerLost, ProtocolViolation
from hybridkv.transport import auth, control
from hybridkv.transport.memory import MemoryMap
from hybridkv.transport.side import Peer, Side, send_quietly

log = logging.getLogger(__name__)


class Admission:
    """The producer's admission. Given the side (its config, counters, data plane, peers and
    Hello), ``serve`` (awaited with each peer let in, once it is in ``side.peers``: its control
    messages, for as long as it stays) and ``lost`` (a peer let in whose channel failed first)."""

    def __init__(self, side: Side, *, serve: Callable[[Peer], Awaitable[None]],
                 lost: Callable[[Peer], None]) -> None:
        self._side = side
        self._serve = serve
        self._lost = lost
        self._connected = asyncio.Event()
        self._listener = None
        self._address = ""
        # channels in their handshake, oldest first, and how many of them each address holds
        self._pending: dict[control.Channel, _Pending] = {}
        self._per_address: collections.Counter = collections.Counter()
        # new connections waiting for a slot, oldest first (see _accept_channel)
        self._waiting: collections.deque[_Waiter] = collections.deque()
        self._admitting = False
        self._fd_budget: int | None = None  # fds past which new connections wait (back-pressure)
        self._pressure = False
        self._drain = control.Drainer()
        self._channels: set[control.Channel] = set()  # every control channel open now
        self._strays: control.StrayConnections | None = None
        self._next_sweep = 0.0

    def listen(self) -> int:
        """Start listening (``TransportConfig.port``, 0 for any); returns the port."""
        cfg = self._side.config
        listener = self._listener = control.listen(self._accept, cfg.port, allow=cfg.allowlist,
                                                   on_refused=self._refused_peer)
        self._address = auth.address(cfg.host, int(listener.port))  # what a consumer's proof must name
        self._strays = control.StrayConnections(int(listener.port), idle_s=cfg.idle_connection_s)
        self._fd_budget = fd_budget(cfg.fd_budget)
        return int(listener.port)

    def _refused_peer(self, address: str | None) -> None:
        self._side.stats.refused_peers += 1
        log.warning("closed a control connection from %s: not in allowed_peers %s",
                    address or "an unreadable address", list(self._side.config.allowed_peers))

    async def wait_peer(self, timeout_s: float) -> None:
        """Until a first peer was let in."""
        await asyncio.wait_for(self._connected.wait(), timeout_s)

    def close(self) -> None:
        """Stop listening."""
        if self._listener is not None:
            self._listener.close()

    async def _accept(self, ch: control.Channel) -> None:
        self._channels.add(ch)
        try:
            await self._accept_channel(ch)
        finally:
            self._channels.discard(ch)

    async def _accept_channel(self, ch: control.Channel) -> None:
        side = self._side
        address = ch.peer[0] if ch.peer else None
        if not await self._slot(ch, address):
            # A flood of connections that never finish the handshake: each costs a task and a UCX
            # endpoint, so one that waited too long for a slot, or finds the queue full, is closed
            # unread; so is any while fds are short.
            side.stats.refused += 1
            side.stats.unauthenticated += 1
            await ch.close()
            return
        try:
            got = await self._handshake_or_refusal(ch)
            if not isinstance(got, tuple):
                side.stats.refused += 1
                reason, diffs = (str(got), got.differences) if isinstance(got, HandshakeRefused) else (_REFUSED, ())
                await send_quietly(ch, wire.Refuse(reason=reason[: wire.MAX_TEXT], differences=diffs))
                # A moment before closing, in the handshake's slot: a consumer that sent its Hello
                # right behind its proof reads the refusal instead of a reset.
                await asyncio.sleep(_REFUSE_LINGER_S)
                await ch.close()
                return
        finally:
            self._drop_pending(ch)
        msg, remote = got
        peer = Peer(agent=msg.agent, channel=ch, memory=remote, lease_s=msg.lease_s)
        side.peers[peer.agent] = peer
        try:
            await ch.send(side.hello())
        except PeerLost:
            self._lost(peer)
            return
        self._connected.set()
        await self._serve(peer)

    def _add_pending(self, ch: control.Channel, address: str | None) -> None:
        self._pending[ch] = _Pending(address=address, heard=time.monotonic())
        self._per_address[address] += 1

    def _drop_pending(self, ch: control.Channel) -> None:
        pending = self._pending.pop(ch, None)
        if pending is not None:
            self._per_address[pending.address] -= 1
            if self._per_address[pending.address] <= 0:
                del self._per_address[pending.address]
            if self._waiting:
                self._admit_waiting()

    def _heard(self, ch: control.Channel) -> None:
        pending = self._pending.get(ch)
        if pending is not None:
            pending.heard = time.monotonic()

    async def _slot(self, ch: control.Channel, address: str | None) -> bool:
        """Wait for a handshake slot (True: ``ch`` holds one now). Past the bounds a new connection is
        not turned away but waits, unread, behind those that came before it: turned away, a consumer
        that shares its address with a flood of half-open handshakes (loopback, a NAT) would get in
        only at an instant when a slot had just gone stale, which the flood's own reconnections take
        first; waiting, it is let in after the connections ahead of it, and a half-open handshake told
        nothing keeps its attacker from reconnecting at once."""
        if self._pressure:
            return False
        if not any(w.address == address for w in self._waiting) and self._make_room(address, time.monotonic()):
            self._add_pending(ch, address)
            return True
        if len(self._waiting) >= self._side.config.max_handshakes * _WAITING_PER_SLOT:
            return False
        waiter = _Waiter(channel=ch, address=address, since=time.monotonic(),
                         admitted=asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        try:
            return await waiter.admitted
        finally:
            if not waiter.admitted.done():  # the listener is closing
                waiter.admitted.cancel()
                self._waiting.remove(waiter)

    def _admit_waiting(self) -> None:
        """Hand the slots that are free, or whose handshake went stale, to the connections waiting,
        oldest first (one that waited longer than a handshake may take is closed unread)."""
        if self._admitting:
            return  # a slot taken from a stale handshake below frees it through _drop_pending
        self._admitting = True
        try:
            now = time.monotonic()
            limit = self._side.config.handshake_timeout_s * _WAIT_TIMEOUTS
            for waiter in list(self._waiting):
                if waiter.admitted.done():
                    self._waiting.remove(waiter)
                elif self._pressure or now - waiter.since > limit:
                    self._waiting.remove(waiter)
                    waiter.admitted.set_result(False)
                elif self._make_room(waiter.address, now):
                    self._waiting.remove(waiter)
                    self._add_pending(waiter.channel, waiter.address)
                    waiter.admitted.set_result(True)
        finally:
            self._admitting = False

    def _make_room(self, address: str | None, now: float) -> bool:
        """Whether a connection from ``address`` may start its handshake now. Past the bound per address
        or in total, it takes the slot of the handshake (of that address, or of the address holding the
        most) that has waited longest on its peer, if that one has waited longer than a peer that answers
        takes (_ANSWER_S): a consumer proves the secret within a round trip of connecting, so silence is
        a half-open handshake's, and every handshake has that long to answer, however many come behind."""
        cfg = self._side.config
        full_address = self._per_address[address] >= cfg.max_handshakes_per_address
        if len(self._pending) < cfg.max_handshakes and not full_address:
            return True
        crowded = address if full_address else max(self._per_address, key=self._per_address.__getitem__)
        silent = [(p.heard, ch) for ch, p in self._pending.items()
                  if not p.proven and p.address == crowded and now - p.heard > _ANSWER_S]
        if not silent:
            return False
        victim = min(silent, key=lambda hc: hc[0])[1]
        self._drop_pending(victim)
        self._side.stats.cut_off += 1
        asyncio.ensure_future(victim.close())
        return True

    async def _handshake_or_refusal(self, ch: control.Channel):
        """(Hello, memory map) of a peer let in; else what to refuse it with: a HandshakeRefused
        (an authenticated peer hears what differs) or None ("refused", nothing more)."""
        side = self._side
        proven: list[bool] = []  # the handshake appends once the peer proved the secret
        try:
            return await asyncio.wait_for(self._handshake(ch, proven), side.config.handshake_timeout_s)
        except asyncio.TimeoutError:
            side.stats.unauthenticated += not proven
            log.info("refused a control connection: no handshake within %s s", side.config.handshake_timeout_s)
        except _Unproven as exc:
            side.stats.unauthenticated += 1
            log.info("refused a control connection before authentication: %s", exc)
        except HandshakeRefused as exc:
            if side.config.secret is None:
                # Unauthenticated peers learn nothing of ours: the differences are logged here only.
                log.warning("refused a consumer's handshake: %s", exc)
                return HandshakeRefused(_REFUSED)
            return exc
        except (PeerLost, ProtocolViolation, wire.WireError) as exc:
            side.stats.unauthenticated += not proven  # closed before it proved the secret (a half-open one cut)
            log.info("refused a control connection: handshake failed: %s", exc)
        except Exception as exc:  # nothing a peer sends may end the listener's task with a traceback
            log.warning("refused a control connection: handshake failed: %s: %s", type(exc).__name__, exc)
        return None

    async def _handshake(self, ch: control.Channel, proven: list) -> tuple[wire.Hello, MemoryMap]:
        """Auth both ways (the consumer proves first), then the consumer's Hello, sealed; its NIXL
        agent is added only once all held. Raises _Unproven (the peer learns "refused"),
        HandshakeRefused (an authenticated peer learns what differs) or a transport error."""
        side = self._side
        secret = side.config.secret
        knock = await _recv_unproven(ch)
        self._heard(ch)
        if not isinstance(knock, wire.Auth) or len(knock.nonce) != wire.NONCE_BYTES or not knock.agent \
                or not knock.address:
            raise _Unproven(f"first message is {type(knock).__name__}; expected Auth with a nonce, the address "
                            "dialled and an agent name")
        nonce = auth.new_nonce()
        # Nothing here proves anything: a peer that has not proved the secret gets no HMAC to guess it from.
        await ch.send(wire.Auth(nonce=nonce, address=self._address, agent=side.dp.name))
        self._heard(ch)  # its silence counts from here: the turn is the peer's
        answer = await _recv_unproven(ch)
        if not isinstance(answer, wire.Auth):
            raise _Unproven(f"second message is {type(answer).__name__}; expected Auth")
        transcript = auth.Transcript(consumer_nonce=knock.nonce, producer_nonce=nonce, dialled=knock.address,
                                     producer=self._address, consumer_agent=knock.agent, producer_agent=side.dp.name)
        if not auth.proves(secret, wire.Role.CONSUMER, transcript, answer.proof):
            raise _Unproven("the peer did not prove the shared secret")
        proven.append(True)
        pending = self._pending.get(ch)
        if pending is not None:
            pending.proven = True  # no longer a half-open handshake: its slot is not taken from it
        if secret is not None and knock.address != self._address:
            # It proved the secret over the address it dialled, which is not this producer's: whoever it
            # dialled passes our words on (a relay), or TransportConfig.host is not what consumers dial.
            raise HandshakeRefused(
                f"the consumer dialled {knock.address}, not this producer ({self._address}): a relay between "
                "them, or TransportConfig.host is not the address consumers dial")
        await ch.send(wire.Auth(proof=auth.proof(secret, wire.Role.PRODUCER, transcript)))
        if secret is not None:
            ch.seal(auth.Sealer(auth.session_key(secret, transcript), wire.Role.PRODUCER))
        msg = await ch.recv()
        if not isinstance(msg, wire.Hello):
            raise ProtocolViolation(f"message after Auth is {type(msg).__name__}; expected Hello")
        if msg.agent != knock.agent:
            raise HandshakeRefused("the peer's Hello names another agent than its Auth", [
                wire.Difference(field="agent", local=knock.agent, remote=msg.agent)])
        remote = side.check_hello(msg)
        if msg.agent in side.peers or msg.agent == side.dp.name:
            raise HandshakeRefused("a peer of that NIXL agent name is already connected", [
                wire.Difference(field="agent", local=None, remote=msg.agent)])
        try:
            agent = side.dp.add_peer(msg.metadata, remote)
        except Exception as exc:  # NIXL refused the metadata (forged, or of another build)
            raise HandshakeRefused(f"NIXL refused the peer's metadata: {type(exc).__name__}") from exc
        if agent != msg.agent:
            if agent not in side.peers:
                side.drop_agent(agent)
            raise HandshakeRefused("the peer's NIXL metadata names another agent than its Hello", [
                wire.Difference(field="agent", local=agent, remote=msg.agent)])
        return msg, remote

    def sweep(self) -> None:
        """From the pump: drop control messages queued for nobody (the listener is what gets
        flooded), end connections on the listener port that never became a channel, and hold new
        connections back while the process is short of fds."""
        stats = self._side.stats
        now = time.monotonic()
        if self._strays is not None and now >= self._next_sweep:
            self._next_sweep = now + min(_SWEEP_S, self._side.config.idle_connection_s / 4)
            self._check_fds()
            stats.swept += self._strays({ch.peer for ch in self._channels}, pressure=self._pressure)
            if self._pressure:
                self._close_unproven(_ANSWER_S)  # half-open handshakes hold fds too
        if self._waiting:
            self._admit_waiting()
        dropped = self._drain()
        stats.drained += dropped
        if dropped < _FLOOD_MESSAGES:
            return  # a closed channel's leftovers, not a flood
        # Messages under made-up tags come from a peer that bypasses the channel; UCX cannot say
        # which, and its buffers grow faster than they drain. A consumer proves the secret within
        # milliseconds of connecting, so a connection still unproven this long into a flood is
        # closed: the flood costs the flooder its connection.
        self._close_unproven(_FLOOD_UNPROVEN_S)

    def _close_unproven(self, older_s: float) -> None:
        now = time.monotonic()
        for ch, pending in list(self._pending.items()):
            if not pending.proven and now - pending.heard > older_s:
                self._drop_pending(ch)
                self._side.stats.cut_off += 1
                asyncio.ensure_future(ch.close())

    def _check_fds(self) -> None:
        """Back-pressure: past the fd budget, no new handshake starts and every stray connection
        goes at once, until the count is back under it (with some room, so it does not flap)."""
        if self._fd_budget is None:
            return
        held = control.open_fds()
        if held is None:
            return
        was = self._pressure
        self._pressure = held >= self._fd_budget if not was else held >= self._fd_budget * 0.9
        if self._pressure and not was:
            self._side.stats.fd_pressure += 1
            log.warning("%d file descriptors open, past the budget of %d (TransportConfig.fd_budget of the "
                        "process limit): new connections are closed unread and stray ones ended until it falls",
                        held, self._fd_budget)


def fd_budget(fraction: float) -> int | None:
    """The fd count past which a producer holds new connections back: ``fraction`` of the soft
    RLIMIT_NOFILE (None where there is none to read)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    return max(1, int(soft * fraction))


@dataclass(eq=False, kw_only=True)
class _Waiter:
    """A new connection waiting, unread, for a handshake slot; ``admitted`` says whether it got one."""

    channel: control.Channel
    address: str | None
    since: float
    admitted: asyncio.Future


@dataclass(eq=False, kw_only=True)
class _Pending:
    """A connection in its handshake: where from, since when the turn is its peer's (it sent a frame, or
    this side answered one), whether it proved the secret."""

    address: str | None
    heard: float
    proven: bool = False


_SWEEP_S = 0.5  # at most this long between two looks at the listener's connections and the fd count
_ANSWER_S = 0.5  # a peer that answers sends its next handshake frame within this (a round trip); a half-open one does not
_WAITING_PER_SLOT = 4  # new connections that may wait for a slot, per slot (max_handshakes)
_WAIT_TIMEOUTS = 3  # a new connection waits for a slot at most this many handshake_timeout_s
_REFUSED = "refused"  # all an unauthenticated peer is told
_REFUSE_LINGER_S = 0.2
_FLOOD_MESSAGES = 32  # dropped in one pump tick: a flood under made-up tags is going on
_FLOOD_UNPROVEN_S = 1.0  # then connections unproven and silent for longer than this are closed


class _Unproven(Exception):
    """The peer did not authenticate: it is told "refused" and nothing more."""


async def _recv_unproven(ch: control.Channel) -> wire.Message:
    try:
        return await ch.recv(limit=wire.MAX_PREAUTH_BYTES)
    except wire.WireError as exc:  # a long frame or garbage before any proof
        raise _Unproven(str(exc)) from None


__all__ = ["Admission"]
