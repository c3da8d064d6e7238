"""The NIXL (UCX) agent the SGLang backend writes with.

NIXL comes from `hybridkv.transport.nixl_shim.load_nixl`. The memory it
registers is the adopted `Layout`'s regions (once, at start; regions that touch
share one registration), and a transfer is a compiled `TransferPlan`: its
(addr, len, dev) rows go to `initialize_xfer` as they are, one handle per pair of
memory kinds (on a GPU the aux rows are host memory). `DataPlane`'s prepped
index lists do not fit here: they address whole region pages, while SGLang's
aux and state items and the planner's merged runs are arbitrary (addr, len).
"""

from __future__ import annotations

import enum
import threading

import numpy as np

from descriptors.compiler import TransferPlan
from hybridkv.layout.alloc import MemKind
from hybridkv.layout import Layout
from hybridkv.transport.nixl_shim import load_nixl


class XferState(enum.Enum):
    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


def registration_rows(layout: Layout) -> dict[MemKind, np.ndarray]:
    """Per memory kind, (addr, len, dev) rows covering every region; touching regions merged."""
    out: dict[MemKind, np.ndarray] = {}
    for mem in MemKind:
        spans = sorted((r.device_id, r.base_addr, r.base_addr + r.nbytes) for r in layout.regions if r.mem is mem)
        merged: list[list[int]] = []
        for dev, start, end in spans:
            if merged and merged[-1][2] == dev and start <= merged[-1][0] + merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end - merged[-1][0])
            else:
                merged.append([start, end - start, dev])
        if merged:
            out[mem] = np.asarray(merged, dtype=np.int64)
    return out


def split_by_memory(plan: TransferPlan, src: Layout, dst: Layout) -> dict[tuple[MemKind, MemKind], tuple[np.ndarray, np.ndarray]]:
    """The plan's rows grouped by (src memory kind, dst memory kind), order kept."""
    if plan.num_descriptors == 0:
        return {}
    s_mem = np.asarray([r.mem is MemKind.VRAM for r in src.regions], dtype=bool)[plan.src_region]
    d_mem = np.asarray([r.mem is MemKind.VRAM for r in dst.regions], dtype=bool)[plan.dst_region]
    out = {}
    for sv in (False, True):
        for dv in (False, True):
            sel = (s_mem == sv) & (d_mem == dv)
            if sel.any():
                key = (MemKind.VRAM if sv else MemKind.DRAM, MemKind.VRAM if dv else MemKind.DRAM)
                out[key] = (plan.src[sel], plan.dst[sel])
    return out


class NixlWriter:
    def __init__(self, name: str, layout: Layout) -> None:
        api = load_nixl()
        cfg = api.nixl_agent_config(backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.name = name
        self._agent = api.nixl_agent(name, cfg)
        # "peer" error handling makes a write to a dead process fail instead of hanging.
        self._agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})
        self.registrations = registration_rows(layout)
        self._regs = [
            self._agent.register_memory([(int(a), int(n), int(d), "") for a, n, d in rows.tolist()], mem.value)
            for mem, rows in self.registrations.items()
        ]
        self._remotes: set[str] = set()
        self._lock = threading.Lock()

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_remote(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        with self._lock:
            self._remotes.add(name)
        return name

    def post_write(self, peer: str, src: np.ndarray, src_mem: MemKind, dst: np.ndarray, dst_mem: MemKind):
        """Post one WRITE of rows src[i] -> dst[i]; RuntimeError if NIXL refuses it."""
        local = self._agent.get_xfer_descs(np.ascontiguousarray(src, dtype=np.uint64), src_mem.value)
        remote = self._agent.get_xfer_descs(np.ascontiguousarray(dst, dtype=np.uint64), dst_mem.value)
        try:
            handle = self._agent.initialize_xfer("WRITE", local, remote, peer)
        except Exception as e:  # NIXL raises its own typed errors
            raise RuntimeError(f"NIXL refused a WRITE of {len(src)} descriptors to {peer}: {e}") from e
        if not handle:
            raise RuntimeError(f"NIXL refused a WRITE of {len(src)} descriptors to {peer}")
        try:
            state = self._agent.transfer(handle)
        except Exception as e:
            self.release(handle)
            raise RuntimeError(f"NIXL failed to post a WRITE of {len(src)} descriptors to {peer}: {e}") from e
        if state == XferState.ERR.value:
            self.release(handle)
            raise RuntimeError(f"NIXL failed to post a WRITE of {len(src)} descriptors to {peer}")
        return handle

    def state(self, handle) -> XferState:
        try:
            return XferState(self._agent.check_xfer_state(handle))
        except Exception:  # NIXL raises typed errors for transport failures
            return XferState.ERR

    def release(self, handle) -> None:
        self.abort(handle)  # an errored handle may refuse release; NIXL finalises it with the agent

    def abort(self, handle) -> bool:
        """Abort a WRITE still in progress: True when NIXL released it (no byte moves
        after), False when it refused and the handle may still write."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            return False
        return True

    def close(self) -> None:
        with self._lock:
            remotes, self._remotes = list(self._remotes), set()
        for r in remotes:
            try:
                self._agent.remove_remote_agent(r)
            except Exception:
                pass
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception:
                pass
        self._regs = []
