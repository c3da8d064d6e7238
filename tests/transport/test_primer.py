"""The primer (transport/primer.py): a READ of a few bytes into the consumer's own scratch buffer once it asked
for a request, so that its own READ posts warm. Real NIXL, two agents in this process (DRAM).

What must hold: it writes nothing but its scratch (no page of any request), one runs per peer at a time, every
handle it made is released, and a peer removed or a plane closed with it leaves nothing behind.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv import wire
from hybridkv.transport.dataplane import DataPlane, DataPlaneConfig, Op, XferState
from hybridkv.transport.memory import MemoryMap
from hybridkv.transport.primer import PRIME_BYTES
from tests.transport.harness import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs NIXL")


def _memory(buf: np.ndarray, pages: int) -> MemoryMap:
    page = buf.nbytes // pages
    region = wire.RegionInfo(region_id=0, base_addr=buf.ctypes.data, stride=page, page_bytes=page, num_pages=pages,
                             mem=wire.Mem.DRAM, device_id=0)
    return MemoryMap(regions=(region,), groups=(wire.GroupInfo(group_id=0, region_ids=(0,)),))


def _pair(mine: np.ndarray, theirs: np.ndarray, pages: int, *, prime: bool):
    a = DataPlane(_memory(mine, pages), DataPlaneConfig(progress_thread=True, prime=prime))
    b = DataPlane(_memory(theirs, pages), DataPlaneConfig(progress_thread=True))
    peer = a.add_peer(b.metadata(), _memory(theirs, pages))
    b.add_peer(a.metadata(), _memory(mine, pages))
    return a, b, peer


def _settle(a: DataPlane, peer: str) -> None:
    for _ in range(200_000):
        if a._primer._reap(peer):
            return
    raise AssertionError("the primer READ never ended")


def test_primer_reads_into_its_scratch_only_and_releases_its_handle():
    theirs = np.arange(8192, dtype=np.uint32).view(np.uint8).copy()  # 32 KiB, every byte known
    mine = np.zeros(theirs.nbytes, dtype=np.uint8)
    a, b, peer = _pair(mine, theirs, 8, prime=True)
    try:
        assert a.priming
        assert a.prime(peer)
        _settle(a, peer)
        assert a._primer.running == 0  # ended and released
        # It read the first bytes of the peer's first region into its own buffer, and wrote nothing of ours.
        assert bytes(np.asarray(a._primer._buf)) == theirs[:PRIME_BYTES].tobytes()
        assert not mine.any()
        # The request's own READ after it lands exactly as without it.
        x = a.post(Op.READ, peer, np.array([2, 3]), np.array([5, 6]))
        while a.state(x) is XferState.IN_PROGRESS:
            pass
        a.release(x)
        page = mine.nbytes // 8
        assert (mine[2 * page:4 * page] == theirs[5 * page:7 * page]).all()
        assert not mine[:2 * page].any() and not mine[4 * page:].any()
    finally:
        a.close()
        b.close()


class _HeldAgent:
    """NIXL's agent, but a primer READ reads as still running while ``held`` (fake: a real READ of 256 bytes
    cannot be kept running on demand)."""

    def __init__(self, agent) -> None:
        self.agent, self.held = agent, True

    def check_xfer_state(self, h):
        return "PROC" if self.held else self.agent.check_xfer_state(h)

    def __getattr__(self, name):
        return getattr(self.agent, name)


def test_one_primer_per_peer_at_a_time_and_none_left_at_removal_faked_running_read():
    theirs, mine = np.ones(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    a, b, peer = _pair(mine, theirs, 4, prime=True)
    held = a._primer._agent = _HeldAgent(a._primer._agent)
    try:
        assert a.prime(peer)
        # A second ask while the first still runs posts nothing; once it ended, the next goes out.
        assert not a.prime(peer) and a._primer.running == 1
        held.held = False
        _settle(a, peer)
        assert a._primer.running == 0 and a.prime(peer) and a._primer.running == 1
        a.remove_peer(peer)  # waits for the primer READ to end, then releases it and the peer's list
        assert a._primer.running == 0 and peer not in a._primer._remote
        assert not a.prime(peer)  # a peer gone is not primed
        assert not mine.any()
    finally:
        a.close()
        b.close()


def test_priming_off_and_a_region_too_small_post_nothing():
    theirs, mine = np.ones(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    a, b, peer = _pair(mine, theirs, 4, prime=False)
    try:
        assert not a.priming and not a.prime(peer)
    finally:
        a.close()
        b.close()
    small_theirs, small_mine = np.ones(4 * (PRIME_BYTES // 2), dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    a = DataPlane(_memory(small_mine, 4), DataPlaneConfig(progress_thread=True, prime=True))
    b = DataPlane(_memory(small_theirs, 4), DataPlaneConfig(progress_thread=True))
    try:
        peer = a.add_peer(b.metadata(), _memory(small_theirs, 4))
        assert not a.prime(peer)  # its first region's pages are shorter than a primer READ
    finally:
        a.close()
        b.close()
