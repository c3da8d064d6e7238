"""PieceLists: pieces of pages (head slices, say) prepped once per peer, a transfer as index arrays into them.
Real NIXL (UCX), two agents in this process."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv import wire
from hybridkv.transport.dataplane import DataPlane, DataPlaneConfig, Op, XferState
from hybridkv.transport.memory import MemoryMap
from hybridkv.transport.piece_lists import PieceLists
from tests.transport.harness import nixl_available

PAGES, PAGE = 8, 512


def _memory(buf: np.ndarray) -> MemoryMap:
    region = wire.RegionInfo(region_id=0, base_addr=buf.ctypes.data, stride=PAGE, page_bytes=PAGE, num_pages=PAGES,
                             mem=wire.Mem.DRAM, device_id=0)
    return MemoryMap(regions=(region,), groups=(wire.GroupInfo(group_id=0, region_ids=(0,)),))


def _halves(buf: np.ndarray, swap: bool) -> np.ndarray:
    """Two pieces per page: its halves (swapped on one side), each a strided run over every page."""
    base = buf.ctypes.data
    offs = (PAGE // 2, 0) if swap else (0, PAGE // 2)
    return np.array([[base + o, PAGE // 2, 0, PAGE, PAGES] for o in offs], dtype=np.uint64)


@pytest.mark.skipif(not nixl_available(), reason="needs NIXL")
def test_pieces_land_where_their_rows_say_and_bad_pages_are_refused_before_posting():
    src, dst = np.arange(PAGES * PAGE, dtype=np.uint32).astype(np.uint8), np.zeros(PAGES * PAGE, dtype=np.uint8)
    cfg = DataPlaneConfig(progress_thread=True)
    a, b = DataPlane(_memory(src), cfg), DataPlane(_memory(dst), cfg)
    try:
        peer = a.add_peer(b.metadata(), _memory(dst))
        b.add_peer(a.metadata(), _memory(src))
        lists = PieceLists(dp=a, peer=peer, local=_halves(src, False), local_mem="DRAM", remote=_halves(dst, True),
                           remote_mem="DRAM")
        assert lists.pieces == 2 and lists.listed == 2 * 2 * PAGES
        li, ri = lists.indices(np.array([1, 6]), np.array([3, 0]))
        assert li.tolist() == [1, 6, 9, 14] and ri.tolist() == [3, 0, 11, 8]  # piece-major
        x = lists.post(Op.WRITE, np.array([1, 6]), np.array([3, 0]))
        while a.state(x) is XferState.IN_PROGRESS:
            pass
        assert a.state(x) is XferState.DONE and x.nbytes == 2 * PAGE
        a.release(x)
        h = PAGE // 2
        page = lambda buf, p: buf[p * PAGE:(p + 1) * PAGE]  # noqa: E731
        for s, d in ((1, 3), (6, 0)):  # halves swapped
            assert (page(dst, d)[h:] == page(src, s)[:h]).all() and (page(dst, d)[:h] == page(src, s)[h:]).all()
        assert not page(dst, 1).any()
        for bad in ((np.array([PAGES]), np.array([0])), (np.array([0]), np.array([-1])),
                    (np.array([0, 1]), np.array([0]))):
            with pytest.raises(ValueError, match="pages"):
                lists.post(Op.WRITE, *bad)
        lists.release()
    finally:
        a.close()
        b.close()


def test_rows_that_do_not_pair_are_refused_naming_them():
    rows = np.array([[0, 8, 0, 16, 4]], dtype=np.uint64)
    with pytest.raises(ValueError, match="Nx5"):
        PieceLists(dp=None, peer="p", local=rows, local_mem="DRAM", remote=rows[:, :4],  # type: ignore[arg-type]
                   remote_mem="DRAM")
    other = rows.copy()
    other[0, 1] = 16
    with pytest.raises(ValueError, match="different lengths"):
        PieceLists(dp=None, peer="p", local=rows, local_mem="DRAM", remote=other,  # type: ignore[arg-type]
                   remote_mem="DRAM")
