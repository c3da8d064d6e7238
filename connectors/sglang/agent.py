"""The NIXL (UCX) agent the SGLang backend moves bytes with.

A thin adapter: hybridkv.transport had no agent API yet when this backend was
written; this keeps every NIXL call of the backend in one place.
"""

from __future__ import annotations

import threading

import numpy as np

from connectors.sglang.regions import MemKind


def _nixl_api():
    try:
        from nixl_cu12 import _api  # the PyPI wheel's import name
    except ImportError:
        try:
            from nixl import _api
        except ImportError as e:
            raise ImportError("the hybridkv SGLang backend needs NIXL: pip install 'hybridkv[transport]'") from e
    return _api


class TransferState:
    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


class NixlAgent:
    def __init__(self, name: str) -> None:
        api = _nixl_api()
        cfg = api.nixl_agent_config(backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.name = name
        self._agent = api.nixl_agent(name, cfg)
        # "peer" error handling makes a write to a dead process fail instead of hanging.
        self._agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})
        self._regs: list = []
        self._remotes: set[str] = set()
        self._lock = threading.Lock()
        self.posted = 0
        self.descriptors_posted = 0

    def register(self, ranges: dict[MemKind, np.ndarray]) -> None:
        for mem, rows in ranges.items():
            descs = [(int(a), int(n), int(d), "") for a, n, d in rows.tolist()]
            self._regs.append(self._agent.register_memory(descs, mem.value))

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_remote(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        with self._lock:
            self._remotes.add(name)
        return name

    def post_write(self, peer: str, src: np.ndarray, src_mem: MemKind, dst: np.ndarray, dst_mem: MemKind):
        local = self._agent.get_xfer_descs(np.ascontiguousarray(src, dtype=np.uint64), src_mem.value)
        remote = self._agent.get_xfer_descs(np.ascontiguousarray(dst, dtype=np.uint64), dst_mem.value)
        handle = self._agent.initialize_xfer("WRITE", local, remote, peer)
        if not handle:
            raise RuntimeError(f"NIXL refused a transfer of {len(src)} descriptors to {peer}")
        state = self._agent.transfer(handle)
        self.posted += 1
        self.descriptors_posted += len(src)
        if state == TransferState.ERR:
            self.release(handle)
            raise RuntimeError(f"NIXL failed to post a transfer of {len(src)} descriptors to {peer}")
        return handle

    def state(self, handle) -> str:
        try:
            return self._agent.check_xfer_state(handle)
        except Exception:  # NIXL raises typed errors for transport failures
            return TransferState.ERR

    def release(self, handle) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            pass  # an errored handle may refuse release; nothing is in flight on it

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
