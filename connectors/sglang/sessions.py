"""Who a rank of the SGLang backend listens to: the handshake that proves the shared secret, and the
sessions that seal every message after it.

SGLang's control sockets are ZMQ PUSH/PULL: one-way, and a PULL socket cannot tell who sent a message.
So the peer is not a connection but a session, named in every message. The decode rank starts one per
prefill rank before its REGISTER:

1. decode -> prefill ``Hello``: nonce Nd and the decode's endpoint (where the answer goes);
2. prefill -> decode ``Challenge``: nonce Np and the prefill's proof over (Nd, Np, both endpoints). Np is
   a cookie (a timestamp and a MAC under a key of this process), so a Hello leaves no state behind;
3. the decode checks the proof (a prefill that cannot prove the secret gets nothing, not even the
   REGISTER) and sends ``Proof``: its proof over the same transcript, another label;
4. the prefill checks the cookie (fresh, not used before) and the proof; only then is there a session,
   keyed by both nonces and the secret. Everything after (REGISTER, METADATA, ABORT one way; KV_STATUS,
   LANDED, DRAINED, STUCK the other) travels sealed: ``[SEAL_TAG, sid + seq, mac, *frames]``, the MAC
   over the direction's label, the sequence number and every frame, and a sequence number is accepted once.

Both endpoints are in the transcript, so a proof relayed through another address (a forged bootstrap
route) fails, and a recorded exchange or sealed message is useless later (fresh nonces, one-time
sequence numbers). The labels differ from hybridkv's transport handshake, so no proof of one protocol
is accepted by the other. Nothing is encrypted: the MAC authenticates, it does not hide.

A decode rank without a secret sends the same Hello and nothing more (`AuthProbe`): a prefill rank that
answers it with a Challenge requires a secret, and the decode fails that rank's rooms at once, naming the
cause, instead of at SGLang's timeout.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import logging
import secrets
import threading
import time
from typing import Optional

import zmq

from hybridkv.connectors.sglang import messages as msgs
from hybridkv import wire
from hybridkv.transport import auth

logger = logging.getLogger(__name__)

SEAL_TAG = b"HYBRIDKV-SEAL"
_LABEL_PREFILL = b"hybridkv-sglang-v1 prefill proof"
_LABEL_DECODE = b"hybridkv-sglang-v1 decode proof"
_LABEL_KEY = b"hybridkv-sglang-v1 session key"
_TO_PREFILL = b"hybridkv-sglang-v1 decode->prefill"
_TO_DECODE = b"hybridkv-sglang-v1 prefill->decode"

REFUSED = "refused"  # all a peer that has not proved the secret is told
COOKIE_TTL_S = 30.0  # a Challenge's nonce is good for this long
MAX_SESSIONS = 256  # sessions a decode rank keeps open for reading (a prefill rank's bound: max_sessions)
MAX_ROOMS_PER_SESSION = 4096  # rooms one decode rank may hold open on one prefill rank
MAX_SEALED_FRAMES = 8
REPLIES_PER_S = 64.0  # Challenges and refusals a prefill rank sends to peers not yet proven
_REPLY_SOCKETS = 16  # sockets kept to addresses that are not (yet) a session
_WINDOW = 1024  # sequence numbers behind the highest one still accepted once


@dataclasses.dataclass
class AuthStats:
    """What the gate let in and what it dropped (tests and logs read it; the manager's threads write it)."""

    challenges: int = 0  # Hellos answered
    sessions: int = 0  # peers proven
    refused: int = 0  # proofs that failed, told "refused"
    unproven: int = 0  # messages dropped: no valid session (unsealed, unknown session, bad MAC)
    oversize: int = 0  # handshake messages dropped for their size, unparsed
    replayed: int = 0  # sealed messages whose sequence number was used
    foreign: int = 0  # a proven peer's message about an agent, address or room that is not its own
    throttled: int = 0  # replies not sent: over REPLIES_PER_S
    disallowed: int = 0  # handshakes naming an address this rank does not dial (PrefillGate's `allowed`)


def _endpoint(ip: str, port: int) -> bytes:
    return f"{ip}:{int(port)}".encode()


def _transcript(nd: bytes, np_: bytes, decode_ep: bytes, prefill_ep: bytes) -> tuple[bytes, ...]:
    return (nd, np_, decode_ep, prefill_ep)


def _read_handshake(frames: list[bytes], stats: AuthStats) -> Optional[msgs.Message]:
    """A handshake message from a peer not yet proven, or None: dropped and counted (oversize ones never
    unpacked)."""
    if msgs.frames_size(frames) > wire.MAX_PREAUTH_BYTES:
        stats.oversize += 1
        return None
    try:
        return msgs.decode_auth(frames)
    except ValueError as e:
        stats.unproven += 1
        logger.info("hybridkv: dropped a handshake message: %s", e)
        return None


def _open_in(session: Optional[Session], frames: list[bytes],
             stats: AuthStats) -> Optional[tuple[Session, list[bytes]]]:
    """(session, the frames it sealed), or None: no such session, or a MAC or sequence number that fails
    (counted either way)."""
    if session is None:
        stats.unproven += 1
        return None
    inner = session.open(frames, stats)
    return None if inner is None else (session, inner)


class _Window:
    """Sequence numbers seen: each accepted once, none more than _WINDOW behind the highest."""

    def __init__(self) -> None:
        self.top = -1
        self.seen = 0  # bit i: top - i was accepted

    def accept(self, seq: int) -> bool:
        if seq > self.top:
            shift = seq - self.top
            self.seen = ((self.seen << shift) | 1) & ((1 << _WINDOW) - 1) if shift < _WINDOW else 1
            self.top = seq
            return True
        back = self.top - seq
        if back >= _WINDOW or self.seen >> back & 1:
            return False
        self.seen |= 1 << back
        return True


class Session:
    """Keys and sequence numbers shared with one proven peer rank."""

    def __init__(self, *, sid: bytes, key: bytes, peer: tuple[str, int], prefill_side: bool) -> None:
        self.sid = sid
        self.peer = peer  # the other rank's ZMQ endpoint (ip, port), as proven in the transcript
        self.tcp = ""  # the same as SGLang names it in a push ("tcp://ip:port")
        self._key = key
        self._send_label, self._recv_label = (_TO_DECODE, _TO_PREFILL) if prefill_side else (_TO_PREFILL, _TO_DECODE)
        self._lock = threading.Lock()
        self._next = 0
        self._window = _Window()
        #: prefill side: the NIXL agent this decode rank registered, and the rooms it claimed (oldest first)
        self.agent: Optional[str] = None
        self.rooms: dict[int, None] = {}

    def _mac(self, label: bytes, seq: bytes, frames: list[bytes]) -> bytes:
        h = hmac.new(self._key, label + self.sid + seq, hashlib.sha256)
        for f in frames:
            h.update(len(f).to_bytes(8, "big"))
            h.update(f)
        return h.digest()

    def seal(self, frames: list[bytes]) -> list[bytes]:
        # Called under the socket's send lock, so sequence numbers leave in order.
        with self._lock:
            seq = self._next.to_bytes(8, "big")
            self._next += 1
        frames = [bytes(f) for f in frames]
        return [SEAL_TAG, self.sid + seq, self._mac(self._send_label, seq, frames), *frames]

    def open(self, frames: list[bytes], stats: AuthStats) -> Optional[list[bytes]]:
        """The inner frames of a message sealed by the peer, or None (forged, altered or replayed: counted)."""
        seq = frames[1][len(self.sid):]
        inner = frames[3:]
        if not auth.proven(self._mac(self._recv_label, seq, inner), frames[2]):
            stats.unproven += 1
            return None
        with self._lock:
            if not self._window.accept(int.from_bytes(seq, "big")):
                stats.replayed += 1
                return None
        return inner


def sealed_sid(frames: list[bytes]) -> Optional[bytes]:
    """The session a sealed message names, or None if it is not one (checked before any state is looked up)."""
    if (len(frames) < 4 or len(frames) > 3 + MAX_SEALED_FRAMES or frames[0] != SEAL_TAG
            or len(frames[1]) != wire.NONCE_BYTES * 2 + 8 or len(frames[2]) != wire.PROOF_BYTES):
        return None
    return frames[1][: wire.NONCE_BYTES * 2]


def is_sealed(frames: list[bytes]) -> bool:
    return bool(frames) and frames[0] == SEAL_TAG


def is_handshake(frames: list[bytes]) -> bool:
    return bool(frames) and frames[0] == msgs.AUTH_TAG


def _session_key(secret: bytes, nd: bytes, np_: bytes, decode_ep: bytes, prefill_ep: bytes) -> bytes:
    return auth.labelled_proof(secret, _LABEL_KEY, *_transcript(nd, np_, decode_ep, prefill_ep))


class _Throttle:
    """A token bucket: replies to unproven peers cost a token, so a flood of Hellos costs the flood."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = rate
        self.at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


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
        self._local = _endpoint(*local)
        self._send = send  # (ip, port, frames): a reply to an address that is not a session
        self._tcp_of = tcp_of  # (ip, port) -> the ZMQ endpoint string SGLang's sends name
        # (named ip, the address the message came from or None) -> whether a reply may be sent to that ip:
        # a Hello must not make this rank dial whatever address it names
        self._allowed = allowed or (lambda ip, source: True)
        self.stats = stats
        self._cookie_key = secrets.token_bytes(32)
        self._throttle = _Throttle(REPLIES_PER_S)
        self.by_sid: collections.OrderedDict[bytes, Session] = collections.OrderedDict()
        self.by_peer: dict[str, Session] = {}  # by the decode rank's ZMQ endpoint (what a push names)
        self._used: dict[bytes, float] = {}  # cookies that became a session -> when they expire

    # ------------------------------------------------------------ handshake
    def _cookie(self, stamp: bytes, nd: bytes, ip: str, port: int) -> bytes:
        mac = hmac.new(self._cookie_key, stamp + nd + _endpoint(ip, port), hashlib.sha256).digest()
        return stamp + mac[: wire.NONCE_BYTES - len(stamp)]

    def on_handshake(self, frames: list[bytes], source: Optional[str] = None) -> None:
        """A Hello or Proof that came from `source` (the sending connection's IP, if known)."""
        m = _read_handshake(frames, self.stats)
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
        stamp = int(time.time()).to_bytes(8, "big")
        np_ = self._cookie(stamp, m.nonce, m.endpoint, m.port)
        proof = auth.labelled_proof(self._secret, _LABEL_PREFILL,
                                    *_transcript(m.nonce, np_, _endpoint(m.endpoint, m.port), self._local))
        self.stats.challenges += 1
        self._reply(m.endpoint, m.port, msgs.Challenge(decode_nonce=m.nonce, prefill_nonce=np_,
                                                       proof=proof).to_frames())

    def _on_proof(self, m: msgs.Proof) -> None:
        now = time.time()
        for c in [c for c, until in self._used.items() if until < now]:
            del self._used[c]
        stamp = m.prefill_nonce[:8]
        fresh = 0 <= now - int.from_bytes(stamp, "big") <= COOKIE_TTL_S
        ours = hmac.compare_digest(self._cookie(stamp, m.decode_nonce, m.endpoint, m.port), m.prefill_nonce)
        decode_ep = _endpoint(m.endpoint, m.port)
        transcript = _transcript(m.decode_nonce, m.prefill_nonce, decode_ep, self._local)
        if not (fresh and ours and m.prefill_nonce not in self._used
                and auth.proven(auth.labelled_proof(self._secret, _LABEL_DECODE, *transcript), m.proof)):
            self.stats.refused += 1
            logger.info("hybridkv: refused a decode handshake from %s:%s (stale, replayed or unproven)",
                        m.endpoint, m.port)
            self._reply(m.endpoint, m.port, msgs.Refused(reason=REFUSED).to_frames())
            return
        self._used[m.prefill_nonce] = now + COOKIE_TTL_S
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
        s = Session(sid=sid, key=_session_key(self._secret, *transcript), peer=peer, prefill_side=True)
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
        sid = sealed_sid(frames)
        return _open_in(self.by_sid.get(sid) if sid is not None else None, frames, self.stats)

    def agent_owner(self, agent: str) -> Optional[Session]:
        return next((s for s in self.by_sid.values() if s.agent == agent), None)


class _Pending:
    def __init__(self, prefill: tuple[str, int]) -> None:
        self.prefill = prefill
        self.done = threading.Event()
        self.session: Optional[Session] = None
        self.error: Optional[str] = None


class DecodeKeys:
    """A decode rank's side: starts a handshake per prefill rank, checks the prefill's proof, keeps the
    sessions. `handshake` runs on SGLang's thread; `on_handshake` and `open` on the listener thread."""

    def __init__(self, *, secret: bytes, local: tuple[str, int], send, stats: AuthStats) -> None:
        self._secret = secret
        self._local = local
        self._send = send  # (ip, port, frames) on the socket SGLang's REGISTER will take, in order
        self.stats = stats
        self._lock = threading.Lock()
        self._pending: dict[bytes, _Pending] = {}
        # Older sessions with a prefill rank stay open (oldest dropped past MAX_SESSIONS): a REGISTER
        # again (SGLang re-registers per bootstrap key) must not orphan a room's LANDED still sealed with one.
        self.by_sid: collections.OrderedDict[bytes, Session] = collections.OrderedDict()
        self.by_peer: dict[tuple[str, int], Session] = {}  # the newest, which this rank seals with

    def handshake(self, prefill: tuple[str, int], timeout_s: float) -> Session:
        """A fresh session with the prefill rank at `prefill`; ValueError saying why there is none."""
        nd = auth.new_nonce()
        p = _Pending(prefill)
        with self._lock:
            self._pending[nd] = p
        try:
            self._send(*prefill, msgs.Hello(nonce=nd, endpoint=self._local[0], port=self._local[1]).to_frames())
            if not p.done.wait(timeout_s):
                raise ValueError(f"prefill rank {prefill[0]}:{prefill[1]} did not answer the authentication "
                                 f"handshake within {timeout_s:g} s; expected a hybridkv prefill with the same "
                                 "shared secret (one without a secret drops it)")
        finally:
            with self._lock:
                self._pending.pop(nd, None)
        if p.session is None:
            raise ValueError(p.error or "handshake failed")
        return p.session

    def on_handshake(self, frames: list[bytes]) -> None:
        m = _read_handshake(frames, self.stats)
        if m is None:
            return
        if isinstance(m, msgs.Refused):
            self.stats.refused += 1
            logger.warning("hybridkv: a prefill rank refused this decode rank's handshake")
            return
        if not isinstance(m, msgs.Challenge):
            self.stats.unproven += 1
            return
        with self._lock:
            p = self._pending.get(m.decode_nonce)
        if p is None:
            self.stats.unproven += 1  # not a handshake of ours (or it timed out)
            return
        transcript = _transcript(m.decode_nonce, m.prefill_nonce, _endpoint(*self._local), _endpoint(*p.prefill))
        if not auth.proven(auth.labelled_proof(self._secret, _LABEL_PREFILL, *transcript), m.proof):
            self.stats.refused += 1
            p.error = (f"prefill rank {p.prefill[0]}:{p.prefill[1]} did not prove the shared secret; expected "
                       "both sides to read the same secret (HYBRIDKV_SGLANG_SECRET_FILE / _SECRET_ENV)")
            logger.error("hybridkv: %s", p.error)
            p.done.set()
            return
        proof = auth.labelled_proof(self._secret, _LABEL_DECODE, *transcript)
        s = Session(sid=m.decode_nonce + m.prefill_nonce, key=_session_key(self._secret, *transcript),
                    peer=p.prefill, prefill_side=False)
        with self._lock:
            self.by_sid[s.sid] = s
            self.by_peer[p.prefill] = s
            while len(self.by_sid) > MAX_SESSIONS:
                self.by_sid.popitem(last=False)
        self.stats.sessions += 1
        self._send(*p.prefill, msgs.Proof(decode_nonce=m.decode_nonce, prefill_nonce=m.prefill_nonce,
                                          endpoint=self._local[0], port=self._local[1], proof=proof).to_frames())
        p.session = s
        p.done.set()

    def session(self, prefill: tuple[str, int]) -> Optional[Session]:
        with self._lock:
            return self.by_peer.get(prefill)

    def ended(self, session: Session) -> None:
        """The prefill rank ended `session`: nothing is sealed with it any more (the next REGISTER starts a new
        one), but it still opens what the prefill sends about the rooms it had."""
        with self._lock:
            if self.by_peer.get(session.peer) is session:
                del self.by_peer[session.peer]

    def open(self, frames: list[bytes]) -> Optional[tuple[Session, list[bytes]]]:
        sid = sealed_sid(frames)
        with self._lock:
            s = self.by_sid.get(sid) if sid is not None else None
        return _open_in(s, frames, self.stats)


class AuthProbe:
    """A decode rank without a secret: does a prefill rank require one?

    Before its REGISTER it sends the prefill rank a Hello it cannot complete. A prefill rank with a secret
    answers any Hello with a Challenge (stateless, rate-limited, told to anyone: nothing new); one without
    drops it. A Challenge answering one of these Hellos (its nonce) means that prefill rank requires
    authentication, which this rank cannot give, so the rooms it was to write can fail at once rather than at
    SGLang's timeout. The proof in it cannot be checked without the secret and is not: in lab mode any peer
    can fail a room anyway. `probe` runs on SGLang's thread, `on_handshake` on the listener thread."""

    def __init__(self, *, local: tuple[str, int], send, stats: AuthStats) -> None:
        self._local = local
        self._send = send  # (ip, port, frames) on the socket SGLang's REGISTER will take
        self.stats = stats
        self._lock = threading.Lock()
        self._pending: collections.OrderedDict[bytes, tuple[str, int]] = collections.OrderedDict()

    def probe(self, prefill: tuple[str, int]) -> None:
        nd = auth.new_nonce()
        with self._lock:
            self._pending[nd] = prefill
            while len(self._pending) > _MAX_PROBES:
                self._pending.popitem(last=False)
        self._send(*prefill, msgs.Hello(nonce=nd, endpoint=self._local[0], port=self._local[1]).to_frames())

    def on_handshake(self, frames: list[bytes]) -> Optional[tuple[str, int]]:
        """The prefill rank (ip, port) that answered one of this rank's probes, or None (dropped: counted)."""
        m = _read_handshake(frames, self.stats)
        if m is None:
            return None
        with self._lock:
            prefill = self._pending.pop(m.decode_nonce, None) if isinstance(m, msgs.Challenge) else None
        if prefill is None:
            self.stats.unproven += 1
        return prefill


_MAX_PROBES = 1024  # probes awaiting an answer that a decode rank remembers (oldest forgotten first)


__all__ = ["AuthProbe", "AuthStats", "DecodeKeys", "PrefillGate", "ReplySockets", "SEAL_TAG", "Session", "is_handshake",
           "is_sealed", "sealed_sid"]
