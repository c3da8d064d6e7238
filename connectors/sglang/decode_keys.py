"""A decode rank's side of the shared-secret handshake (sessions.py describes the protocol): a handshake per
prefill rank and the sessions it made (`DecodeKeys`), and, without a secret, the probe that tells whether a
prefill rank requires one (`AuthProbe`)."""

from __future__ import annotations

import logging
import threading
from typing import Optional

from hybridkv.connectors.sglang import messages as msgs
from hybridkv.connectors.sglang.sessions import (
    FORMAT, LABEL_DECODE, LABEL_PREFILL, MAX_SESSIONS, AuthStats, Session, derive_session_key, endpoint_bytes,
    handshake_transcript, open_sealed, read_handshake,
)
from hybridkv.transport import auth
from hybridkv.transport.recent import Recent

logger = logging.getLogger(__name__)


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
        self.by_sid: Recent[bytes, Session] = Recent(MAX_SESSIONS)
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
        m = read_handshake(frames, self.stats)
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
        transcript = handshake_transcript(m.decode_nonce, m.prefill_nonce, endpoint_bytes(*self._local),
                                          endpoint_bytes(*p.prefill))
        if not auth.proven(auth.labelled_proof(self._secret, LABEL_PREFILL, *transcript), m.proof):
            self.stats.refused += 1
            p.error = (f"prefill rank {p.prefill[0]}:{p.prefill[1]} did not prove the shared secret; expected "
                       "both sides to read the same secret (HYBRIDKV_SGLANG_SECRET_FILE / _SECRET_ENV)")
            logger.error("hybridkv: %s", p.error)
            p.done.set()
            return
        proof = auth.labelled_proof(self._secret, LABEL_DECODE, *transcript)
        s = Session(sid=m.decode_nonce + m.prefill_nonce, key=derive_session_key(self._secret, *transcript),
                    peer=p.prefill, prefill_side=False)
        with self._lock:
            self.by_sid[s.sid] = s
            self.by_peer[p.prefill] = s
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
        sid = FORMAT.sid_of(frames)
        with self._lock:
            s = self.by_sid.get(sid) if sid is not None else None
        return open_sealed(s, frames, self.stats)


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
        self._pending: Recent[bytes, tuple[str, int]] = Recent(_MAX_PROBES)

    def probe(self, prefill: tuple[str, int]) -> None:
        nd = auth.new_nonce()
        with self._lock:
            self._pending[nd] = prefill
        self._send(*prefill, msgs.Hello(nonce=nd, endpoint=self._local[0], port=self._local[1]).to_frames())

    def on_handshake(self, frames: list[bytes]) -> Optional[tuple[str, int]]:
        """The prefill rank (ip, port) that answered one of this rank's probes, or None (dropped: counted)."""
        m = read_handshake(frames, self.stats)
        if m is None:
            return None
        with self._lock:
            prefill = self._pending.pop(m.decode_nonce, None) if isinstance(m, msgs.Challenge) else None
        if prefill is None:
            self.stats.unproven += 1
        return prefill


_MAX_PROBES = 1024  # probes awaiting an answer that a decode rank remembers (oldest forgotten first)


__all__ = ["AuthProbe", "DecodeKeys"]
