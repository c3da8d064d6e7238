"""What a post costs beyond NIXL's own calls, and how a waiter sees it land.

The post path leaves summing page sizes to whoever reads ``Transfer.nbytes`` (real NIXL, two agents
in this process), and ``Side.wait_xfer`` polls back to back for ``DataPlaneConfig.spin_s`` before it
yields to its event loop, so a transfer that lands soon after its post is seen as soon as raw NIXL
polling would see it (a fake data plane there: a real transfer's landing time cannot be set).
"""

from __future__ import annotations

import asyncio
import time
import types

import numpy as np
import pytest

from hybridkv import wire
from hybridkv.errors import TransferError
from hybridkv.transport.dataplane import DataPlane, DataPlaneConfig, Op, Transfer, XferState
from hybridkv.transport.memory import MemoryMap
from hybridkv.transport.side import Side
from tests.transport.harness import nixl_available


def _memory(buf: np.ndarray, pages: int) -> MemoryMap:
    page = buf.nbytes // pages
    region = wire.RegionInfo(region_id=0, base_addr=buf.ctypes.data, stride=page, page_bytes=page, num_pages=pages,
                             mem=wire.Mem.DRAM, device_id=0)
    return MemoryMap(regions=(region,), groups=(wire.GroupInfo(group_id=0, region_ids=(0,)),))


@pytest.mark.skipif(not nixl_available(), reason="needs NIXL")
def test_post_counts_its_bytes_when_read_and_refuses_an_index_past_the_list():
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    local, remote = _memory(src, 8), _memory(dst, 8)
    cfg = DataPlaneConfig(progress_thread=True)
    a, b = DataPlane(local, cfg), DataPlane(remote, cfg)
    try:
        peer = a.add_peer(b.metadata(), remote)
        b.add_peer(a.metadata(), local)
        x = a.post(Op.WRITE, peer, np.array([1, 2, 3]), np.array([4, 5, 6]))
        while a.state(x) is XferState.IN_PROGRESS:
            pass
        assert x.nbytes == 3 * 512 and isinstance(x.nbytes, int)
        a.release(x)
        assert (dst[4 * 512:7 * 512] == src[512:4 * 512]).all()
        # Past the prepped list: NIXL's refusal, as for any index it rejects (never an IndexError of ours).
        for bad in (8, -1):
            with pytest.raises(TransferError, match="refused"):
                a.post(Op.WRITE, peer, np.array([0, bad]), np.array([0, 1]))
    finally:
        a.close()
        b.close()


def test_spin_budget_is_checked():
    assert DataPlaneConfig(spin_s=0).spin_s == 0
    for bad in (-0.001, 2.0):
        with pytest.raises(ValueError, match="spin_s"):
            DataPlaneConfig(spin_s=bad)
    assert Transfer([], "p", 1, lambda: np.int64(7)).nbytes == 7


class _LandsAfterPolls:
    """Fake data plane: its one transfer lands at the n-th poll."""

    def __init__(self, polls: int, spin_s: float) -> None:
        self.config = DataPlaneConfig(spin_s=spin_s)
        self.left = polls

    def state(self, xfer) -> XferState:
        self.left -= 1
        return XferState.IN_PROGRESS if self.left > 0 else XferState.DONE

    def poller(self, xfer):
        return lambda: self.state(xfer)


async def _wait_counting_yields(dp, until=None) -> tuple[XferState, int]:
    side = types.SimpleNamespace(dp=dp, _busy=0)
    rounds = 0

    async def other_task():
        nonlocal rounds
        while True:
            rounds += 1
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(other_task())
    await asyncio.sleep(0)
    rounds = 0
    try:
        state = await Side.wait_xfer(side, None, until)
    finally:
        task.cancel()
    assert side._busy == 0
    return state, rounds


def test_wait_sees_a_soon_landing_without_yielding_then_yields_between_polls():
    # Within the budget: DONE at the poll it lands, no event-loop round in between.
    assert asyncio.run(_wait_counting_yields(_LandsAfterPolls(50, spin_s=1.0))) == (XferState.DONE, 0)
    # No budget: every poll after the first gives the loop a round, as before.
    state, rounds = asyncio.run(_wait_counting_yields(_LandsAfterPolls(50, spin_s=0.0)))
    assert state is XferState.DONE and rounds >= 49
    # A deadline that passed ends the wait inside the spin too.
    assert asyncio.run(_wait_counting_yields(_LandsAfterPolls(10**9, spin_s=1.0), until=lambda: 0.0))[0] \
        is XferState.IN_PROGRESS


def test_wait_asks_for_the_deadline_again_only_once_the_clock_passed_it():
    # A deadline only moves later (a lease renewed): the wait asks once, then again only once its clock
    # passed the last answer, and ends when the new answer has passed too; a renewed one keeps it going.
    asked = []

    def until():  # passed at once, renewed 2 ms ahead at the second ask, then passed for good
        asked.append(time.monotonic())
        return time.monotonic() + 0.002 if len(asked) == 2 else asked[0] - 1

    state, _ = asyncio.run(_wait_counting_yields(_LandsAfterPolls(10**9, spin_s=0.0), until=until))
    assert state is XferState.IN_PROGRESS and len(asked) == 3, asked
    assert asked[2] - asked[1] >= 0.002  # the renewed deadline held the wait until it passed
    asked.clear()
    state, _ = asyncio.run(_wait_counting_yields(_LandsAfterPolls(2000, spin_s=0.0),
                                                 until=lambda: asked.append(0) or time.monotonic() + 60))
    assert state is XferState.DONE and asked == [0]  # one ask for 2,000 polls
