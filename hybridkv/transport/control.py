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
from hybridkv.errors import PeerLost
from hybridkv.transport.env import apply_ucx_defaults


def _ucxx():
    # Here, not at import: ucxx's UCX context reads the environment when the first listen or dial
    # creates it, and importing hybridkv must leave os.environ alone.
    apply_ucx_defaults()
    try:
        import ucxx
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("ucxx is not installed; expected ucxx-cu12 or ucxx-cu13 "
                          "(pip install 'hybridkv[transport]')") from exc
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
        self._tag = _recv_tag(endpoint)
        if self._tag is not None:
            _LIVE_TAGS.add(self._tag)

    async def send(self, msg: wire.Message) -> None:
        data = wire.encode(msg)
        header = np.array([len(data)], dtype="<u8")
        body = np.frombuffer(data, dtype=np.uint8)
        async with self._send_lock:
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
        return wire.decode(body.tobytes())

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

    def __init__(self, *, grace_s: float = 0.25, budget: int = 4096, max_pending: int = 1024) -> None:
        self.grace_s, self.budget, self.max_pending = grace_s, budget, max_pending
        self._since: float | None = None
        self._pending: list[tuple] = []  # (request, Array, buffer): kept alive until UCX is done with them

    def __call__(self) -> int:
        """Messages dropped now."""
        ucxx = _ucxx()
        from ucxx._lib.arr import Array
        from ucxx._lib.libucxx import UCXXTag, UCXXTagMask

        try:
            worker = ucxx.core._get_ctx().worker  # the context the listener and channels use
        except Exception:
            return 0
        self._pending = [p for p in self._pending if not p[0].completed]
        any_tag, any_mask = UCXXTag(0), UCXXTagMask(0)
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

    return ucxx.create_listener(on_connect, port=port)


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
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[4:8])
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24])
    return None


async def dial(host: str, port: int, timeout_s: float) -> Channel:
    ucxx = _ucxx()
    try:
        ep = await asyncio.wait_for(ucxx.create_endpoint(host, port, connect_timeout=timeout_s), timeout_s)
    except asyncio.TimeoutError:
        raise
    except Exception as exc:
        raise PeerLost(f"cannot reach {host}:{port}: {type(exc).__name__}: {exc}") from exc
    return Channel(ep)
