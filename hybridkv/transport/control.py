"""Control-plane channel over ucxx (UCX's maintained Python binding): framed wire messages.

Each message is an 8-byte little-endian length followed by the msgpack body;
the length is checked against :data:`hybridkv.wire.MAX_MESSAGE_BYTES` before
anything is allocated. Sends are serialised per channel so frames never
interleave. Any transport error surfaces as :class:`hybridkv.errors.PeerLost`.

UCX queues a tag message nobody has asked for until someone receives it, and ucxx tags are
the sender's to choose: :class:`Drainer` discards what is queued under tags no live channel
receives (a closed channel's leftovers, or a flood under made-up tags), so that costs a peer its
bytes, not the listener its memory.

ucxx 0.52's listener API takes a port only and listens on every interface;
the configured host is what a producer advertises and a consumer dials.
:func:`listen` can close connections from outside a
:class:`~hybridkv.transport.allowlist.PeerAllowlist` before reading them; it
reads the peer's address from UCX itself (``ucp_ep_query``), which ucxx does
not expose.

ucxx's context, its event loop and its notifier thread are :mod:`hybridkv.transport.ucxx_context`'s.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import socket
import struct
import time

import numpy as np

from hybridkv import wire
from hybridkv.errors import MissingExtra, PeerLost
from hybridkv.transport import ucxx_context
from hybridkv.transport.env import apply_ucx_defaults

def _ucxx():
    # Here, not at import: ucxx's UCX context reads the environment when the first listen or dial
    # creates it, and importing hybridkv must leave os.environ alone.
    apply_ucx_defaults()
    try:
        import ucxx
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise MissingExtra("ucxx", "transport", detail="expected ucxx-cu12 or ucxx-cu13") from exc
    ucxx_context.guard_exit()
    return ucxx


# The ucxx tags live channels receive under (this process's one ucxx context): anything queued
# under another tag is nobody's, and Drainer discards it.
_LIVE_TAGS: set[int] = set()


def _recv_tag(endpoint) -> int | None:
    tags = getattr(endpoint, "_tags", None)  # ucxx's Endpoint: {"msg_send": ..., "msg_recv": ...}
    return None if not tags else int(tags["msg_recv"])


class Channel:
    def __init__(self, endpoint) -> None:
        self._ep = endpoint
        self._send_lock = asyncio.Lock()
        self.closed = False
        self._sealer = None  # auth.Sealer once the handshake's proofs held: every frame MACed from then on
        self._tag = _recv_tag(endpoint)
        if self._tag is not None:
            _LIVE_TAGS.add(self._tag)
        # The connection UCX accepted for it: StrayConnections leaves it alone.
        self.peer = remote_sockaddr(endpoint) if hasattr(endpoint, "ucp_endpoint") else None
        ucxx_context.opened(self)

    @property
    def sealer(self):
        """The channel's auth.Sealer (None before its handshake's proofs, or in a lab): completion
        notifications of its requests are tagged under the same session key."""
        return self._sealer

    def seal(self, sealer) -> None:
        """From now on every frame sent is sealed and every frame received must open
        (:class:`hybridkv.transport.auth.Sealer`): one that does not ends the channel (PeerLost)."""
        self._sealer = sealer

    async def send(self, msg: wire.Message) -> None:
        data = wire.encode(msg)
        async with self._send_lock:
            if self._sealer is not None:  # sealed in the order sent: the MAC numbers the frame
                data = self._sealer.seal(data)
            header = np.array([len(data)], dtype="<u8")
            body = np.frombuffer(data, dtype=np.uint8)
            try:
                await self._ep.send(header)
                await self._ep.send(body)
            except Exception as exc:
                self.closed = True
                raise PeerLost(f"control channel send failed: {type(exc).__name__}: {exc}") from exc

    async def recv(self, limit: int = wire.MAX_MESSAGE_BYTES) -> wire.Message:
        """The next message; a frame longer than ``limit`` is a WireError before anything is
        allocated for it (the caller closes the channel: its body is still queued)."""
        header = np.zeros(1, dtype="<u8")
        sealer = self._sealer
        if sealer is not None:
            limit += wire.MAC_BYTES
        try:
            await self._ep.recv(header)
            n = int(header[0])
            if not 0 < n <= limit:
                raise wire.WireError(f"frame of {n} bytes; expected 1..{limit}")
            body = np.empty(n, dtype=np.uint8)
            await self._ep.recv(body)
        except wire.WireError:
            raise
        except Exception as exc:
            self.closed = True
            raise PeerLost(f"control channel receive failed: {type(exc).__name__}: {exc}") from exc
        data = body.tobytes()
        if sealer is not None:
            try:
                data = sealer.open(data)
            except ValueError as exc:  # not the session's peer (or not its frame): the caller closes it
                raise PeerLost(f"control channel: {exc}") from None
        return wire.decode(data)

    async def close(self) -> None:
        _LIVE_TAGS.discard(self._tag)  # what is still queued for it is nobody's now
        if self.closed:
            return
        self.closed = True
        try:
            await self._ep.close()
        except Exception:
            pass


class Drainer:
    """Receives and drops messages queued under ucxx tags no live channel receives.

    Called from the producer's pump. UCX shows only the oldest queued message (a probe with an
    empty mask), so a message under an unknown tag blocks the view of those behind it; one is
    drained only after such a message has stood at the front for ``grace_s``: a new connection's
    first message may arrive a moment before its channel exists (the listener's handler runs on
    the loop), and in normal operation nothing under an unknown tag is ever queued at all.
    """

    def __init__(self, *, grace_s: float = 0.1, budget: int = 4096, max_pending: int = 1024) -> None:
        self.grace_s, self.budget, self.max_pending = grace_s, budget, max_pending
        self._since: float | None = None
        self._pending: list[tuple] = []  # (request, Array, buffer): kept alive until UCX is done with them

    def __call__(self) -> int:
        """Messages dropped now."""
        ucxx = _ucxx()
        # ucxx 0.52's public API cannot drain: its tag_probe (context or endpoint) always uses the full
        # mask, get_ucxx_worker() is a pointer, not the worker, and an endpoint's tags and the receive
        # buffer type (Array) have no public name. tests/transport/test_attacks.py fails if these go.
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMask

        ctx = ucxx.core._ctx  # the context the listener and channels use (none: nothing to drain)
        if ctx is None:
            return 0
        worker = ctx.worker
        self._pending = [p for p in self._pending if not p[0].completed]
        any_tag, any_mask = Tag(0), TagMask(0)
        probe = worker.tag_probe(any_tag, any_mask, remove=False)
        if not probe.matched or probe.sender_tag.value in _LIVE_TAGS:
            self._since = None
            return 0
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if now - self._since < self.grace_s:
            return 0
        dropped = 0
        while dropped < self.budget and len(self._pending) < self.max_pending:
            probe = worker.tag_probe(any_tag, any_mask, remove=False)
            if not probe.matched or probe.sender_tag.value in _LIVE_TAGS:
                break
            probe = worker.tag_probe(probe.sender_tag, remove=True)
            if not probe.matched:
                break
            # Up to 1 MiB received whole (and dropped); a longer one truncated, which ends it too.
            buf = np.empty(max(1, min(probe.length, 1 << 20)), dtype=np.uint8)
            arr = Array(buf)
            self._pending.append((worker.tag_recv_with_handle(arr, probe), arr, buf))
            dropped += 1
        return dropped


def listen(handler, port: int = 0, allow=None, on_refused=None):
    """Start a ucxx listener; ``handler(Channel)`` runs per incoming connection. With ``allow`` (a
    PeerAllowlist), a peer it does not allow is closed unread and ``on_refused(address)`` is called."""
    ucxx = _ucxx()

    async def on_connect(ep):
        if allow is not None:
            address = remote_address(ep)
            if not allow.allows(address):
                if on_refused is not None:
                    on_refused(address)
                try:
                    await ep.close()
                except Exception:
                    pass
                return
        await handler(Channel(ep))

    ucxx_context.context(ucxx)
    listener = ucxx.create_listener(on_connect, port=port)
    ucxx_context.opened(listener)
    return listener


# ucp_ep_attr_t (ucp.h, UCX 1.21): uint64 field_mask, char name[32], sockaddr_storage local_sockaddr,
# sockaddr_storage remote_sockaddr, ... ; the buffer is larger than the struct in case it grew.
_UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR = 1 << 2
_REMOTE_SOCKADDR_OFFSET = 8 + 32 + 128
_EP_ATTR_BYTES = 4096


@functools.cache
def _ucp_ep_query():
    import libucx

    lib = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so"))
    fn = lib.ucp_ep_query
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def remote_address(ep) -> str | None:
    """The peer's IP address as UCX sees it, or None where it cannot be read."""
    peer = remote_sockaddr(ep)
    return None if peer is None else peer[0]


def remote_sockaddr(ep) -> tuple[str, int] | None:
    """The peer's (IP address, port) of the connection UCX accepted, or None where it cannot be read."""
    try:
        query = _ucp_ep_query()
        handle = int(ep.ucp_endpoint)
    except Exception:
        return None
    buf = (ctypes.c_uint8 * _EP_ATTR_BYTES)()
    struct.pack_into("<Q", buf, 0, _UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR)
    if query(ctypes.c_void_p(handle), buf) != 0:  # UCS_OK
        return None
    raw = bytes(buf[_REMOTE_SOCKADDR_OFFSET:_REMOTE_SOCKADDR_OFFSET + 128])
    family = struct.unpack_from("=H", raw, 0)[0]
    port = struct.unpack_from("!H", raw, 2)[0]
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[4:8]), port
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port
    return None


class StrayConnections:
    """Ends TCP connections to the listener's port that never became a channel.

    UCX accepts every TCP connection on the listener's port itself and waits, with no timeout, for
    a UCX connection request on it: a raw connection that never sends one (or sends garbage and
    stays) holds a file descriptor for as long as its peer keeps it open, below anything hybridkv
    sees; one that sends more garbage than UCX's connection request holds (2 KiB) and closes stays
    in CLOSE-WAIT for good, and UCX's progress thread spins on it. Linux only: this process's
    connections on the listener's port are read from /proc in every TCP state (CLOSE-WAIT,
    LAST-ACK, FIN-WAIT, CLOSING as well as ESTABLISHED); each whose peer is not a live channel's
    (``remote_sockaddr``) is ended: at once in a dead state, after ``idle_s`` while established, and
    at once under fd pressure. Ending is ``connect(AF_UNSPEC)`` on a duplicate of UCX's fd (a TCP
    disconnect, as a reset): UCX then sees the connection fail and closes its fd (a ``shutdown``
    only closes the TCP side, and UCX keeps the fd and spins). Nothing is swept while some live
    channel's address cannot be read (it could not be told apart from a stray one).
    """

    def __init__(self, port: int, *, idle_s: float) -> None:
        self.port, self.idle_s = port, idle_s
        self._seen: dict[int, float] = {}  # socket inode -> first seen stray

    def __call__(self, live: set[tuple[str, int] | None], *, pressure: bool = False) -> int:
        """Connections ended now; under ``pressure`` (fds near the budget) established strays too,
        however young."""
        if None in live or not os.path.isdir("/proc/self/fd"):
            return 0
        fds = _socket_fds()
        if fds is None:
            return 0
        now, swept, strays = time.monotonic(), 0, set()
        for inode, peer, state in _connections(self.port):
            if inode not in fds or peer in live or _mapped(peer) in live:
                continue
            strays.add(inode)
            first = self._seen.setdefault(inode, now)
            if state == _ESTABLISHED and now - first < self.idle_s and not pressure:
                continue
            if _disconnect(fds[inode]):
                swept += 1
        self._seen = {i: t for i, t in self._seen.items() if i in strays}
        return swept


def open_fds() -> int | None:
    """How many file descriptors this process holds (Linux; None elsewhere)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def _socket_fds() -> dict[int, int] | None:
    """socket inode -> fd, for this process's sockets."""
    fds: dict[int, int] = {}
    try:
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if target.startswith("socket:["):
                fds[int(target[8:-1])] = int(name)
    except OSError:
        return None
    return fds


class _Sockaddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_char * 14)]


@functools.cache
def _libc_connect():
    fn = ctypes.CDLL(None, use_errno=True).connect
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _disconnect(fd: int) -> bool:
    """A TCP disconnect of the socket behind ``fd`` (``connect`` to AF_UNSPEC), through a duplicate."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        addr = _Sockaddr(family=socket.AF_UNSPEC)
        return _libc_connect()(dup, ctypes.byref(addr), ctypes.sizeof(addr)) == 0
    finally:
        os.close(dup)


def _mapped(peer: tuple[str, int]) -> tuple[str, int]:
    """An IPv4 peer as a dual-stack socket names it, or the other way round."""
    ip, port = peer
    return (ip[7:], port) if ip.startswith("::ffff:") else (f"::ffff:{ip}", port)


_ESTABLISHED = "01"
# LISTEN is the listener; TIME-WAIT and CLOSE hold no fd of ours; SYN states are not accepted yet.
_NOT_SWEPT = frozenset({"02", "03", "06", "07", "0A"})


def _connections(port: int):
    """(inode, (peer ip, peer port), state) of this namespace's TCP connections on local ``port``
    that a process may hold (established, or dead and waiting for their holder to close them)."""
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] in _NOT_SWEPT:
                continue
            local, remote = cols[1].split(":"), cols[2].split(":")
            if int(local[1], 16) != port:
                continue
            raw = bytes.fromhex(remote[0])
            # /proc prints the address as 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            yield int(cols[9]), (socket.inet_ntop(family, raw), int(remote[1], 16)), cols[3]


async def dial(host: str, port: int, timeout_s: float) -> Channel:
    ucxx = _ucxx()
    ucxx_context.context(ucxx)
    with ucxx_context.dialing():  # release() leaves the context alone meanwhile
        try:
            ep = await asyncio.wait_for(ucxx.create_endpoint(host, port, connect_timeout=timeout_s), timeout_s)
        except asyncio.TimeoutError:
            raise
        except Exception as exc:
            raise PeerLost(f"cannot reach {host}:{port}: {type(exc).__name__}: {exc}") from exc
        return Channel(ep)
