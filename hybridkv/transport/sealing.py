"""Sealed messages over a channel that may drop or reorder them: a session key, numbered messages, a replay window.

:class:`~hybridkv.transport.auth.Sealer` seals one ordered stream (a UCX control channel: each frame's number
is implicit, one out of order fails the channel). Where messages travel one-way over sockets that say
nothing of their sender (SGLang's ZMQ PUSH/PULL), a message names its session and its number, and the
receiver accepts each number once, up to ``window`` behind the highest seen, in any order.

A sealed message is the frames ``[tag, sid + seq, mac, *frames]``: ``tag`` says which protocol sealed it,
``sid`` names the session (fixed length, known before any key is looked up), ``seq`` is the sender's 8-byte
number in its direction, and ``mac`` an HMAC-SHA256 under the session key over the direction's label, the
sid, the number and every frame, each length-prefixed. The labels are the protocol's, one per direction, so
a message reflected to its sender does not open. Nothing is encrypted: the MAC authenticates, it does not hide.

No engine import: the core's primitive, used by the SGLang backend's sessions (connectors/sglang/sessions.py).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv import wire

SEQ_BYTES = 8
DEFAULT_WINDOW = 1024


class SealError(ValueError):
    """A message that does not open: not sealed, another session's, forged or altered."""


class Replayed(SealError):
    """A message that opens but whose number was accepted before, or is past the window."""


@dataclass(frozen=True, kw_only=True)
class SealedFormat:
    """What a protocol's sealed messages look like, checked before any session state is looked up."""

    tag: bytes
    sid_bytes: int
    max_frames: int  # inner frames a sealed message may carry

    def __post_init__(self) -> None:
        if not self.tag or self.sid_bytes < 1 or self.max_frames < 1:
            raise ValueError(f"SealedFormat(tag={self.tag!r}, sid_bytes={self.sid_bytes}, max_frames="
                             f"{self.max_frames}); expected a tag and counts >= 1")

    def is_sealed(self, frames: Sequence[bytes]) -> bool:
        return bool(frames) and frames[0] == self.tag

    def sid_of(self, frames: Sequence[bytes]) -> bytes | None:
        """The session a sealed message names, or None if it is not one of this format's."""
        if (not 4 <= len(frames) <= 3 + self.max_frames or frames[0] != self.tag
                or len(frames[1]) != self.sid_bytes + SEQ_BYTES or len(frames[2]) != wire.MAC_BYTES):
            return None
        return bytes(frames[1][: self.sid_bytes])


class ReplayWindow:
    """Sequence numbers seen: each accepted once, none ``size`` or more behind the highest."""

    def __init__(self, size: int = DEFAULT_WINDOW) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"replay window of {size!r}; expected an int >= 1")
        self.size = size
        self.top = -1
        self._seen = 0  # bit i: top - i was accepted

    def accept(self, seq: int) -> bool:
        if seq > self.top:
            shift = seq - self.top
            self._seen = ((self._seen << shift) | 1) & ((1 << self.size) - 1) if shift < self.size else 1
            self.top = seq
            return True
        back = self.top - seq
        if back >= self.size or self._seen >> back & 1:
            return False
        self._seen |= 1 << back
        return True


class WindowedSealer:
    """Seals this side's messages of one session and opens the peer's (thread-safe)."""

    def __init__(self, *, fmt: SealedFormat, key: bytes, sid: bytes, send_label: bytes, recv_label: bytes,
                 window: int = DEFAULT_WINDOW) -> None:
        if len(sid) != fmt.sid_bytes:
            raise ValueError(f"session id of {len(sid)} bytes; expected {fmt.sid_bytes}")
        if send_label == recv_label:
            raise ValueError(f"one label {send_label!r} for both directions; expected two (a reflected message opens)")
        self.fmt, self.sid = fmt, sid
        self._key, self._send, self._recv = key, send_label, recv_label
        self._lock = threading.Lock()
        self._next = 0
        self._window = ReplayWindow(window)

    def _mac(self, label: bytes, seq: bytes, frames: Sequence[bytes]) -> bytes:
        h = hmac.new(self._key, label + self.sid + seq, hashlib.sha256)
        for f in frames:
            h.update(len(f).to_bytes(8, "big"))
            h.update(f)
        return h.digest()

    def seal(self, frames: Sequence[bytes]) -> list[bytes]:
        """The sealed message; numbers follow the order of calls (send under the same lock to keep it)."""
        frames = [bytes(f) for f in frames]
        with self._lock:
            seq = self._next.to_bytes(SEQ_BYTES, "big")
            self._next += 1
        return [self.fmt.tag, self.sid + seq, self._mac(self._send, seq, frames), *frames]

    def open(self, sealed: Sequence[bytes]) -> list[bytes]:
        """The inner frames of a message the peer sealed. SealError where it is not this session's or its MAC
        fails; Replayed where its number was accepted before or is out of the window."""
        if self.fmt.sid_of(sealed) != self.sid:
            raise SealError("not a sealed message of this session")
        seq, inner = bytes(sealed[1][self.fmt.sid_bytes:]), [bytes(f) for f in sealed[3:]]
        if not hmac.compare_digest(self._mac(self._recv, seq, inner), sealed[2]):
            raise SealError(f"message {int.from_bytes(seq, 'big')} does not carry the session's MAC (forged, altered "
                            "or sealed for the other direction)")
        with self._lock:
            if not self._window.accept(int.from_bytes(seq, "big")):
                raise Replayed(f"message {int.from_bytes(seq, 'big')} was accepted before or is more than "
                               f"{self._window.size} behind the newest")
        return inner


__all__ = ["DEFAULT_WINDOW", "ReplayWindow", "Replayed", "SealError", "SealedFormat", "WindowedSealer"]
