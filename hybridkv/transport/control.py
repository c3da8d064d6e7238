"""Control-plane channel over ucxx (UCX's maintained Python binding): framed wire messages.

Each message is an 8-byte little-endian length followed by the msgpack body;
the length is checked against :data:`hybridkv.wire.MAX_MESSAGE_BYTES` before
anything is allocated. Sends are serialised per channel so frames never
interleave. Any transport error surfaces as :class:`hybridkv.errors.PeerLost`.

ucxx 0.52's listener API takes a port only and listens on every interface;
the configured host is what a producer advertises and a consumer dials.
Restrict exposure with a firewall or ``UCX_NET_DEVICES`` where that matters.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np

from hybridkv import wire
from hybridkv.errors import PeerLost

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def _ucxx():
    try:
        import ucxx
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("ucxx is not installed; expected ucxx-cu12 or ucxx-cu13 "
                          "(pip install 'hybridkv[transport]')") from exc
    return ucxx


class Channel:
    def __init__(self, endpoint) -> None:
        self._ep = endpoint
        self._send_lock = asyncio.Lock()
        self.closed = False

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

    async def recv(self) -> wire.Message:
        header = np.zeros(1, dtype="<u8")
        try:
            await self._ep.recv(header)
            n = int(header[0])
            if not 0 < n <= wire.MAX_MESSAGE_BYTES:
                raise wire.WireError(f"frame of {n} bytes; expected 1..{wire.MAX_MESSAGE_BYTES}")
            body = np.empty(n, dtype=np.uint8)
            await self._ep.recv(body)
        except wire.WireError:
            raise
        except Exception as exc:
            self.closed = True
            raise PeerLost(f"control channel receive failed: {type(exc).__name__}: {exc}") from exc
        return wire.decode(body.tobytes())

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            await self._ep.close()
        except Exception:
            pass


def listen(handler, port: int = 0):
    """Start a ucxx listener; ``handler(Channel)`` runs per incoming connection."""
    ucxx = _ucxx()

    async def on_connect(ep):
        await handler(Channel(ep))

    return ucxx.create_listener(on_connect, port=port)


async def dial(host: str, port: int, timeout_s: float) -> Channel:
    ucxx = _ucxx()
    try:
        ep = await asyncio.wait_for(ucxx.create_endpoint(host, port, connect_timeout=timeout_s), timeout_s)
    except asyncio.TimeoutError:
        raise
    except Exception as exc:
        raise PeerLost(f"cannot reach {host}:{port}: {type(exc).__name__}: {exc}") from exc
    return Channel(ep)
