"""DataPlane with arbitrary rows and mixed memory kinds: two agents in this process, real
NIXL (UCX) moving the bytes. Host memory everywhere on CPU; with a GPU, regions of
device and host memory on both sides (SGLang's KV/state in VRAM, aux rows in DRAM), one
transfer covering a NIXL handle per pair of kinds."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hybridkv import wire
from hybridkv.transport.dataplane import DataPlane, DataPlaneConfig, Op, XferState
from hybridkv.transport.memory import MemoryMap
from tests.transport.harness import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs NIXL")


def _cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _region(rid: int, addr: int, nbytes: int, pages: int, mem: wire.Mem, dev: int = 0) -> wire.RegionInfo:
    page = nbytes // pages
    return wire.RegionInfo(region_id=rid, base_addr=addr, stride=page, page_bytes=page, num_pages=pages, mem=mem,
                           device_id=dev)


def _memory(*regions: wire.RegionInfo) -> MemoryMap:
    return MemoryMap(regions=regions, groups=(wire.GroupInfo(group_id=0, region_ids=(0,)),))


def _wait(dp: DataPlane, xfer, timeout: float = 20.0) -> XferState:
    deadline = time.monotonic() + timeout
    while (s := dp.state(xfer)) is XferState.IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(0.001)
    return s


def _pair(local: MemoryMap, remote: MemoryMap):
    cfg = DataPlaneConfig(progress_thread=True, telemetry=True)
    a, b = DataPlane(local, cfg), DataPlane(remote, cfg)
    peer = a.add_peer(b.metadata(), remote)
    b.add_peer(a.metadata(), local)
    return a, b, peer


def test_rows_and_pages_between_host_regions():
    src = [np.arange(4096, dtype=np.uint8) * (i + 1) for i in range(2)]
    dst = [np.zeros(4096, dtype=np.uint8) for _ in range(2)]
    local = _memory(*(_region(i, a.ctypes.data, a.nbytes, 8, wire.Mem.DRAM) for i, a in enumerate(src)))
    remote = _memory(*(_region(i, a.ctypes.data, a.nbytes, 8, wire.Mem.DRAM) for i, a in enumerate(dst)))
    a, b, peer = _pair(local, remote)
    try:
        # Arbitrary rows: 100 bytes inside page 1 of region 0, and the whole of region 1.
        lr = np.array([[src[0].ctypes.data + 512 + 7, 100, 0], [src[1].ctypes.data, 4096, 0]], dtype=np.uint64)
        rr = np.array([[dst[0].ctypes.data + 3000, 100, 0], [dst[1].ctypes.data, 4096, 0]], dtype=np.uint64)
        x = a.post_rows(Op.WRITE, peer, lr, rr)
        assert len(x.handles) == 1  # one memory kind on each side: one handle
        assert _wait(a, x) is XferState.DONE
        assert a.telemetry(x).nbytes == 4196
        a.release(x)
        assert (dst[0][3000:3100] == src[0][519:619]).all() and (dst[1] == src[1]).all()
        # The prepped fast path: page 2 of region 0 -> page 5 of region 0.
        x = a.post(Op.WRITE, peer, np.array([2]), np.array([5]))
        assert _wait(a, x) is XferState.DONE
        a.release(x)
        assert (dst[0][5 * 512:6 * 512] == src[0][2 * 512:3 * 512]).all()
        with pytest.raises(ValueError, match="equal non-empty"):
            a.post_rows(Op.WRITE, peer, lr[:0], rr[:0])
    finally:
        a.close()
        b.close()


@pytest.mark.gpu
@pytest.mark.skipif(_cuda() is None, reason="needs a CUDA device")
def test_rows_spanning_device_and_host_memory_move_in_one_transfer():
    torch = _cuda()
    n = 1 << 16
    g_src = torch.arange(n, dtype=torch.int32, device="cuda").view(torch.uint8)[:n].contiguous()
    g_dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    h_src = (np.arange(n, dtype=np.uint32) * 7).astype(np.uint8)
    h_dst = np.zeros(n, dtype=np.uint8)
    dev = torch.cuda.current_device()
    local = _memory(_region(0, g_src.data_ptr(), n, 16, wire.Mem.VRAM, dev),
                    _region(1, h_src.ctypes.data, n, 16, wire.Mem.DRAM))
    remote = _memory(_region(0, g_dst.data_ptr(), n, 16, wire.Mem.VRAM, dev),
                     _region(1, h_dst.ctypes.data, n, 16, wire.Mem.DRAM))
    torch.cuda.synchronize()
    a, b, peer = _pair(local, remote)
    try:
        with pytest.raises(ValueError, match="mix memory kinds"):
            a.post(Op.WRITE, peer, np.array([0]), np.array([0]))
        # VRAM -> VRAM, DRAM -> DRAM, VRAM -> DRAM and DRAM -> VRAM rows, interleaved.
        lr = np.array([[g_src.data_ptr(), 1000, dev], [h_src.ctypes.data + 4096, 2000, 0],
                       [g_src.data_ptr() + 8192, 512, dev], [h_src.ctypes.data + 100, 300, 0]], dtype=np.uint64)
        rr = np.array([[g_dst.data_ptr() + 50, 1000, dev], [h_dst.ctypes.data, 2000, 0],
                       [h_dst.ctypes.data + 10000, 512, 0], [g_dst.data_ptr() + 20000, 300, dev]], dtype=np.uint64)
        x = a.post_rows(Op.WRITE, peer, lr, rr)
        assert len(x.handles) == 4
        assert _wait(a, x) is XferState.DONE
        assert a.telemetry(x).nbytes == 3812
        a.release(x)
        torch.cuda.synchronize()
        gs, gd = g_src.cpu().numpy(), g_dst.cpu().numpy()
        assert (gd[50:1050] == gs[:1000]).all()
        assert (h_dst[:2000] == h_src[4096:6096]).all()
        assert (h_dst[10000:10512] == gs[8192:8704]).all()
        assert (gd[20000:20300] == h_src[100:400]).all()
    finally:
        a.close()
        b.close()
