"""A decode rank's authenticated link to each prefill rank, made off SGLang's scheduler thread.

SGLang registers a decode rank with a prefill rank from its scheduler thread (the receiver's `init`),
and the shared-secret handshake (decode_keys.DecodeKeys) is a round trip of up to `handshake_timeout_s`.
Done there, one slow or unreachable prefill rank stalls every other room's poll for that long, once
per prefill rank, one after another. Here the handshake runs on a thread of its own, once per prefill
rank (again only after its session ended or the handshake failed); what SGLang sends to that rank
meanwhile (REGISTER, BOOTSTRAP, METADATA) waits in the link, in order, and goes out sealed once the
session is proven. A link whose handshake failed drops what it held; the rooms that sent through it
fail at their next poll, naming the reason (receiver.py).
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Callable, Optional

import zmq

from hybridkv.connectors.sglang.decode_keys import DecodeKeys
from hybridkv.connectors.sglang.sessions import Session

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]


class LinkState(enum.Enum):
    PENDING = "pending"  # handshake under way: sends wait in order
    READY = "ready"  # session proven: sends go out sealed
    FAILED = "failed"  # handshake failed: sends are dropped, rooms fail


class Link:
    """One handshake with one prefill rank and what waits for it."""

    def __init__(self, prefill: Endpoint, session_of: Callable[[Endpoint], Optional[Session]]) -> None:
        self.prefill = prefill
        self.state = LinkState.PENDING
        self.error: Optional[str] = None
        #: something went out through this link (a room that sent only through failed links reached no one)
        self.delivered = False
        self._session_of = session_of
        self._queue: list[list[bytes]] = []
        self._lock = threading.Lock()

    def send(self, sock, frames: list[bytes]) -> None:
        """Called under SGLang's lock of `sock`, the socket to this prefill rank."""
        with self._lock:
            if self.state is LinkState.PENDING:
                self._queue.append(list(frames))
                return
            if self.state is LinkState.FAILED:
                return  # nothing goes out; the room fails at its next poll
        # The newest session with the rank seals (a REGISTER again may have made one); none: it ended
        session = self._session_of(self.prefill)
        if session is None:
            raise zmq.ZMQError(zmq.EHOSTUNREACH, f"no authenticated session with prefill rank "
                                                 f"{self.prefill[0]}:{self.prefill[1]}")
        sock.send_multipart(session.seal(list(frames)))
        self.delivered = True

    def settle(self, session: Optional[Session], error: Optional[str], sock, lock) -> None:
        """The handshake ended: flush what waited (under the socket's lock, so in order) or drop it."""
        with lock:
            with self._lock:
                queued, self._queue = self._queue, []
                if session is None:
                    self.state, self.error = LinkState.FAILED, error or "handshake failed"
                    return
                for frames in queued:
                    sock.send_multipart(session.seal(frames))
                    self.delivered = True
                self.state = LinkState.READY


class PrefillLinks:
    """A decode rank's links, one per prefill rank. Given the keys that make sessions, how long a
    handshake may take, and SGLang's (socket, lock) to a prefill rank."""

    def __init__(self, *, keys: DecodeKeys, timeout_s: float,
                 socket_of: Callable[[Endpoint], tuple[object, threading.Lock]]) -> None:
        self.keys = keys
        self.timeout_s = timeout_s
        self._socket_of = socket_of
        self._links: dict[Endpoint, Link] = {}
        self._lock = threading.Lock()

    def ensure(self, prefill: Endpoint) -> Link:
        """The link to `prefill`, starting a handshake on a thread of its own unless one is under way or
        its session is live. Never blocks on the peer."""
        with self._lock:
            link = self._links.get(prefill)
            if link is not None and (link.state is LinkState.PENDING or
                                     (link.state is LinkState.READY and self.keys.session(prefill) is not None)):
                return link
            link = self._links[prefill] = Link(prefill, self.keys.session)
        threading.Thread(target=self._handshake, args=(link,), name=f"hybridkv-auth-{prefill[0]}:{prefill[1]}",
                         daemon=True).start()
        return link

    def current(self, prefill: Endpoint) -> Optional[Link]:
        """The link SGLang's sends to `prefill` take now (None: no handshake was started with it)."""
        with self._lock:
            return self._links.get(prefill)

    def _handshake(self, link: Link) -> None:
        session, error = None, None
        try:
            session = self.keys.handshake(link.prefill, self.timeout_s)
        except ValueError as e:
            error = str(e)
        except Exception as e:  # a socket error: the link fails, the thread does not die silently
            error = f"{type(e).__name__}: {e}"
        if error:
            logger.error("hybridkv: %s", error)
        try:
            sock, lock = self._socket_of(link.prefill)
            link.settle(session, error, sock, lock)
        except Exception as e:
            link.settle(None, f"could not send to prefill rank {link.prefill[0]}:{link.prefill[1]}: {e}",
                        None, threading.Lock())
