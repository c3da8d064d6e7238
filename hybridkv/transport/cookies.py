"""Stateless handshake cookies: a nonce that a server can check later without having stored it.

A server that answers a first message (a Hello) with its own nonce should keep no state per Hello, or a
flood of them costs its memory. The nonce is a cookie instead: a timestamp and a MAC, under a key of this
process, over the timestamp and whatever the answer is bound to (the client's nonce and address). The
client's next message carries it back; :meth:`Cookies.valid` says whether it is this process's, fresh
and not spent, and :meth:`Cookies.spend` spends it once it made a session, so a recorded exchange does not
make a second one. Only spent cookies are remembered, until they expire.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

STAMP_BYTES = 8  # seconds since the epoch, big-endian


class Cookies:
    """Cookies of ``size`` bytes (the stamp, then a truncated HMAC-SHA256) good for ``ttl_s`` seconds."""

    def __init__(self, *, size: int, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        if not STAMP_BYTES + 8 <= size <= STAMP_BYTES + hashlib.sha256().digest_size:
            raise ValueError(f"cookie size = {size!r}; expected {STAMP_BYTES + 8}..{STAMP_BYTES + 32} bytes")
        if not ttl_s > 0:
            raise ValueError(f"cookie ttl_s = {ttl_s!r}; expected seconds > 0")
        self._key = secrets.token_bytes(32)
        self._size = size
        self._ttl_s = ttl_s
        self._clock = clock
        self._spent: dict[bytes, float] = {}  # cookie -> when it expires

    def _make(self, stamp: bytes, bound: tuple[bytes, ...]) -> bytes:
        mac = hmac.new(self._key, stamp + b"".join(bound), hashlib.sha256).digest()
        return stamp + mac[: self._size - len(stamp)]

    def issue(self, *bound: bytes) -> bytes:
        """A fresh cookie bound to these values (each later check must name the same ones)."""
        return self._make(int(self._clock()).to_bytes(STAMP_BYTES, "big"), bound)

    def valid(self, cookie: bytes, *bound: bytes) -> bool:
        """Whether ``cookie`` is one this process issued for ``bound``, younger than the TTL and not spent."""
        now = self._clock()
        for c in [c for c, until in self._spent.items() if until < now]:
            del self._spent[c]
        if len(cookie) != self._size:
            return False
        stamp = cookie[:STAMP_BYTES]
        fresh = 0 <= now - int.from_bytes(stamp, "big") <= self._ttl_s
        ours = hmac.compare_digest(self._make(stamp, bound), cookie)
        return fresh and ours and cookie not in self._spent

    def spend(self, cookie: bytes) -> None:
        """``cookie`` made its session: :meth:`valid` refuses it from now on (until it would be stale anyway)."""
        self._spent[cookie] = self._clock() + self._ttl_s


__all__ = ["Cookies", "STAMP_BYTES"]
