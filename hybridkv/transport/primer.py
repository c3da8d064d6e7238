"""Priming the posting path: a tiny READ into a private scratch buffer while a fetch waits for its Exports.

NIXL's two posting calls (``make_prepped_xfer`` and ``transfer``: NIXL, UCX and the CUDA driver) run cold
once a request's own work ran on the thread: on one H100 host they cost 92-99 us of CPU after it, and 23-25 us
right after another READ completed (docs/benchmarks/transfer.md, issue 49 item 4). A consumer that asked a
producer for a request has nothing to do until the Export arrives; a READ of a few bytes posted then runs the
same code and leaves it warm for the request's own post.

What it may write is its own scratch buffer only (registered with NIXL here, never part of any request's
pages); what it reads is the first bytes of the peer's first region, which it never looks at. One primer READ
per peer at a time: a peer whose last one still runs is not primed again. Nothing of a request waits for it
and its failure is no request's (it is dropped, logged at debug).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from hybridkv import wire

log = logging.getLogger(__name__)

#: bytes a primer READ moves: small enough to cost nothing on any link, large enough for UCX's zero-copy path
PRIME_BYTES = 256


class Primer:
    """The scratch buffer, its prepped list, one prepped list per peer and the primer READs in flight."""

    def __init__(self, agent, mem: wire.Mem, device_id: int) -> None:
        self._agent = agent
        self._mem = mem
        if mem is wire.Mem.VRAM:
            import torch  # a VRAM side has torch (its pages are torch's); a host-only side never imports it

            self._buf = torch.zeros(PRIME_BYTES, dtype=torch.uint8, device=f"cuda:{device_id}")
            addr = self._buf.data_ptr()
        else:
            self._buf = np.zeros(PRIME_BYTES, dtype=np.uint8)
            addr = self._buf.ctypes.data
        rows = np.array([[addr, PRIME_BYTES, device_id]], dtype=np.uint64)
        self._reg = agent.register_memory(rows, mem.name)
        self._local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem.name)
        self._zero = np.zeros(1, dtype=np.int32)
        self._remote: dict[str, object] = {}  # peer -> its prepped one-row list
        self._running: dict[str, object] = {}  # peer -> its primer READ's handle, until released

    def add_peer(self, peer: str, region: wire.RegionInfo) -> None:
        """Prime reads of ``peer`` from its region ``region`` (of this side's memory kind, at least
        PRIME_BYTES long); a peer without such a region is never primed."""
        if region.mem is not self._mem or region.page_bytes < PRIME_BYTES or peer in self._remote:
            return
        rows = np.array([[region.base_addr, PRIME_BYTES, region.device_id]], dtype=np.uint64)
        self._remote[peer] = self._agent.prep_xfer_dlist(peer, rows, self._mem.name)

    def prime(self, peer: str) -> bool:
        """Post one primer READ from ``peer`` unless its last one still runs; whether one went out."""
        remote = self._remote.get(peer)
        if remote is None or not self._reap(peer):
            return False
        agent = self._agent
        try:
            h = agent.make_prepped_xfer("READ", self._local, self._zero, remote, self._zero, b"")
        except Exception as exc:  # a peer going away: its request fails on its own, not here
            log.debug("primer READ from %s not made: %r", peer, exc)
            return False
        try:
            state = agent.transfer(h)
        except Exception as exc:
            state = f"{type(exc).__name__}: {exc}"
        if state not in ("PROC", "DONE"):
            log.debug("primer READ from %s not posted: %s", peer, state)
            self._release(h)
            return False
        self._running[peer] = h
        return True

    def _reap(self, peer: str) -> bool:
        """Release ``peer``'s primer READ if it ended; whether none runs now."""
        h = self._running.get(peer)
        if h is None:
            return True
        try:
            state = self._agent.check_xfer_state(h)
        except Exception:
            state = "ERR"
        if state == "PROC":
            return False
        del self._running[peer]
        self._release(h)
        return True

    def _release(self, h) -> None:
        try:
            self._agent.release_xfer_handle(h)
        except Exception as exc:
            log.debug("primer handle not released: %r", exc)

    def remove_peer(self, peer: str, *, wait_s: float = 0.2) -> None:
        """Before the peer's metadata goes: its primer READ ended (waited for up to ``wait_s``; a READ of
        PRIME_BYTES takes microseconds) and released, its list released. One still running past that
        keeps its list: releasing a list a READ still uses is NIXL's undefined behaviour."""
        end = time.monotonic() + wait_s
        while not self._reap(peer):
            if time.monotonic() > end:
                log.warning("primer READ from %s still running after %.1f s; its list is kept", peer, wait_s)
                return
            time.sleep(1e-4)
        remote = self._remote.pop(peer, None)
        if remote is not None:
            try:
                self._agent.release_dlist_handle(remote)
            except Exception as exc:
                log.debug("primer list of %s not released: %r", peer, exc)

    def close(self) -> None:
        for peer in list(self._remote):
            self.remove_peer(peer)
        if self._running:  # kept running past their wait: the scratch stays registered with them
            return
        for release in (lambda: self._agent.release_dlist_handle(self._local),
                        lambda: self._agent.deregister_memory(self._reg)):
            try:
                release()
            except Exception as exc:
                log.debug("primer teardown: %r", exc)

    @property
    def running(self) -> int:
        """Primer READs not yet released (for tests and describe)."""
        return len(self._running)
