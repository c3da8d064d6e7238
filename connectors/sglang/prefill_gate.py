"""A prefill rank's side of the shared-secret handshake (sessions.py describes the protocol): Hellos answered
without keeping state, a session made of a valid Proof, sealed messages opened."""

from __future__ import annotations

import collections
import logging
from typing import Optional

import zmq

from hybridkv.connectors.sglang import messages as msgs
from hybridkv.connectors.sglang.sessions import (
    FORMAT, COOKIE_TTL_S, LABEL_DECODE, LABEL_PREFILL, MAX_SESSIONS, REFUSED, AuthStats, Session,
    derive_session_key, endpoint_bytes, handshake_transcript, open_sealed, read_handshake,
)
from hybridkv import wire
from hybridkv.transport import auth
from hybridkv.transport.cookies import Cookies
from hybridkv.transport.throttle import TokenBucket

logger = logging.getLogger(__name__)

REPLIES_PER_S = 64.0  # Challenges and refusals a prefill rank sends to peers not yet proven
_REPLY_SOCKETS = 16  # sockets kept to addresses that are not (yet) a session


class ReplySockets:
    """PUSH sockets to addresses that are not a session (yet): few, oldest closed first, never blocking."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._socks: collections.OrderedDict[str, zmq.Socket] = collections.OrderedDict()

    def send(self, tcp: str, frames: list[bytes]) -> None:
        sock = self._socks.pop(tcp, None)
        if sock is None:
            if len(self._socks) >= _REPLY_SOCKETS:
                self._socks.popitem(last=False)[1].close(linger=0)
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4)
            if tcp.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(tcp)
        self._socks[tcp] = sock
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # a peer that does not read is not waited for

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()


class PrefillGate:
    """A prefill rank's side: answers Hellos without keeping state, makes a session of a valid Proof,
    and opens sealed messages. Only the control thread calls it (replies go out through `send`).

    At most `max_sessions` sessions: past it the oldest ends. `on_end(session)` is called for each
    session that ended (evicted, or replaced by a new handshake from the same address, whose session
    takes over its agent and rooms) after the new one is in place, so `agent_owner` already answers for it."""

    def __init__(self, *, secret: bytes, local: tuple[str, int], send, tcp_of, stats: AuthStats,
                 max_sessions: int = MAX_SESSIONS, on_end=None, allowed=None) -> None:
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions = {max_sessions!r}; expected an int >= 1")
        self._secret = secret
        self._max_sessions = max_sessions
        self._on_end = on_end or (lambda session: None)
        self._local = endpoint_bytes(*local)
        self._send = send  # (ip, port, frames): a reply to an address that is not a session
        self._tcp_of = tcp_of  # (ip, port) -> the ZMQ endpoint string SGLang's sends name
        # (named ip, the address the message came from or None) -> whether a reply may be sent to that ip:
        # a Hello must not make this rank dial whatever address it names
        self._allowed = allowed or (lambda ip, source: True)
        self.stats = stats
        # a Hello leaves no state: the prefill's nonce is a cookie bound to the decode's nonce and endpoint
        self._cookies = Cookies(size=wire.NONCE_BYTES, ttl_s=COOKIE_TTL_S)
        self._throttle = TokenBucket(REPLIES_PER_S)  # a flood of Hellos costs the flood
        self.by_sid: collections.OrderedDict[bytes, Session] = collections.OrderedDict()
        self.by_peer: dict[str, Session] = {}  # by the decode rank's ZMQ endpoint (what a push names)

    # ------------------------------------------------------------ handshake
    def on_handshake(self, frames: list[bytes], source: Optional[str] = None) -> None:
        """A Hello or Proof that came from `source` (the sending connection's IP, if known)."""
        m = read_handshake(frames, self.stats)
        if m is None:
            return
        if isinstance(m, (msgs.Hello, msgs.Proof)) and not self._allowed(m.endpoint, source):
            self.stats.disallowed += 1
            if self.stats.disallowed & (self.stats.disallowed - 1) == 0:  # 1, 2, 4, ...: the log is bounded
                logger.warning("hybridkv: %d handshake(s) naming an address this rank does not dial dropped (the "
                               "last: %s:%s, from %s); see HYBRIDKV_SGLANG_ALLOWED_DECODE_HOSTS",
                               self.stats.disallowed, m.endpoint, m.port, source)
            return
        if isinstance(m, msgs.Hello):
            self._on_hello(m)
        elif isinstance(m, msgs.Proof):
            self._on_proof(m)
        else:
            self.stats.unproven += 1

    def _reply(self, ip: str, port: int, frames: list[bytes]) -> None:
        if not self._throttle.take():
            self.stats.throttled += 1
            return
        self._send(ip, port, frames)

    def _on_hello(self, m: msgs.Hello) -> None:
        np_ = self._cookies.issue(m.nonce, endpoint_bytes(m.endpoint, m.port))
        transcript = handshake_transcript(m.nonce, np_, endpoint_bytes(m.endpoint, m.port), self._local)
        proof = auth.labelled_proof(self._secret, LABEL_PREFILL, *transcript)
        self.stats.challenges += 1
        self._reply(m.endpoint, m.port, msgs.Challenge(decode_nonce=m.nonce, prefill_nonce=np_,
                                                       proof=proof).to_frames())

    def _on_proof(self, m: msgs.Proof) -> None:
        decode_ep = endpoint_bytes(m.endpoint, m.port)
        transcript = handshake_transcript(m.decode_nonce, m.prefill_nonce, decode_ep, self._local)
        if not (self._cookies.valid(m.prefill_nonce, m.decode_nonce, decode_ep)
                and auth.proven(auth.labelled_proof(self._secret, LABEL_DECODE, *transcript), m.proof)):
            self.stats.refused += 1
            logger.info("hybridkv: refused a decode handshake from %s:%s (stale, replayed or unproven)",
                        m.endpoint, m.port)
            self._reply(m.endpoint, m.port, msgs.Refused(reason=REFUSED).to_frames())
            return
        self._cookies.spend(m.prefill_nonce)
        peer = (m.endpoint, int(m.port))
        tcp = self._tcp_of(*peer)
        sid = m.decode_nonce + m.prefill_nonce
        old = self.by_peer.pop(tcp, None)
        if old is not None:  # that decode rank started over (re-registration, restart): its old session ends
            self.by_sid.pop(old.sid, None)
        evicted = None
        if len(self.by_sid) >= self._max_sessions:
            _, evicted = self.by_sid.popitem(last=False)
            self.by_peer.pop(evicted.tcp, None)
            logger.warning("hybridkv: %d decode sessions (max_sessions); the oldest (%s:%s) ends",
                           self._max_sessions, *evicted.peer)
        s = Session(sid=sid, key=derive_session_key(self._secret, *transcript), peer=peer, prefill_side=True)
        s.tcp = tcp
        if old is not None:
            s.agent, s.rooms = old.agent, old.rooms
        self.by_sid[sid] = s
        self.by_peer[tcp] = s
        self.stats.sessions += 1
        logger.info("hybridkv: decode rank %s:%s proved the shared secret", *peer)
        for ended in (old, evicted):
            if ended is not None:
                self._on_end(ended)

    # ------------------------------------------------------------ sealed messages
    def open(self, frames: list[bytes]) -> Optional[tuple[Session, list[bytes]]]:
        sid = FORMAT.sid_of(frames)
        return open_sealed(self.by_sid.get(sid) if sid is not None else None, frames, self.stats)

    def agent_owner(self, agent: str) -> Optional[Session]:
        return next((s for s in self.by_sid.values() if s.agent == agent), None)


__all__ = ["PrefillGate", "ReplySockets"]
