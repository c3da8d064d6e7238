"""NIXL (UCX backend) data plane: one agent, regions registered once, prepped lists per peer.

A transfer costs two int32 index arrays: the local side's strided list (one
Nx5 row per region) is prepped once, and each peer's list once at handshake.
``make_prepped_xfer`` merges consecutive indices that are back to back on both
sides (anchors/nixl.md §1), which :func:`~hybridkv.transport.memory.pair_indices`
arranges; telemetry reports how many descriptors NIXL actually posted.

Threading: with the progress thread off (the default: it slowed small
descriptors on small machines), the *target* agent must be progressed or an
initiator's transfer stays in progress; :meth:`DataPlane.pump` does that and
the control loop calls it. An agent shared by several threads needs
``SyncMode.STRICT`` (default) or ``RW``.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass

import numpy as np

from hybridkv import wire
from hybridkv.errors import TransferError
from hybridkv.transport.memory import MemoryMap
from hybridkv.transport.nixl_shim import load_nixl


class SyncMode(enum.Enum):
    NONE = "NIXL_THREAD_SYNC_NONE"  # one thread only
    STRICT = "NIXL_THREAD_SYNC_STRICT"  # every call serialised
    RW = "NIXL_THREAD_SYNC_RW"  # readers in parallel


class Op(enum.Enum):
    READ = "READ"  # pull: the consumer reads the producer's pages
    WRITE = "WRITE"  # push: the producer writes the consumer's pages


class XferState(enum.Enum):
    IN_PROGRESS = "PROC"
    DONE = "DONE"
    ERROR = "ERR"


@dataclass(frozen=True, kw_only=True)
class DataPlaneConfig:
    name: str | None = None  # agent name; unique per process (default: random)
    progress_thread: bool = False
    sync: SyncMode = SyncMode.STRICT
    telemetry: bool = True
    #: extra UCX backend parameters, e.g. {"ucx_error_handling_mode": "peer"}
    ucx_params: tuple[tuple[str, str], ...] = (("ucx_error_handling_mode", "peer"),)


@dataclass(frozen=True, kw_only=True)
class Telemetry:
    descriptors: int  # what NIXL posted after merging
    nbytes: int
    post_us: int
    xfer_us: int


class Transfer:
    """One posted transfer; poll with :meth:`DataPlane.state`."""

    __slots__ = ("handle", "peer", "indices", "nbytes")

    def __init__(self, handle, peer: str, indices: int, nbytes: int) -> None:
        self.handle = handle
        self.peer = peer
        self.indices = indices
        self.nbytes = nbytes


class DataPlane:
    def __init__(self, memory: MemoryMap, config: DataPlaneConfig = DataPlaneConfig()) -> None:
        api = load_nixl()
        self._api = api
        self.memory = memory
        self.mem_name = memory.mem.name
        self.name = config.name or f"hybridkv-{uuid.uuid4().hex[:12]}"
        self.config = config
        cfg = api.nixl_agent_config(
            enable_prog_thread=config.progress_thread,
            capture_telemetry=config.telemetry,
            backends=[],
            sync_mode=getattr(api.nixl_thread_sync_t, config.sync.value),
        )
        self.agent = api.nixl_agent(self.name, cfg)
        self.agent.create_backend("UCX", dict(config.ucx_params))
        self._reg = self.agent.register_memory(memory.reg_rows(), self.mem_name)
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", memory.strided_rows(), self.mem_name)
        self._peers: dict[str, tuple[object, MemoryMap]] = {}
        self._page_bytes = np.concatenate(
            [np.full(r.num_pages, r.page_bytes, np.int64) for r in memory.regions]) if memory.regions else np.zeros(0)
        self._closed = False

    # ---------------------------------------------------------------- peers
    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes, remote: MemoryMap) -> str:
        """Load a peer's agent metadata and prep its region list once; returns its agent name."""
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name in self._peers:
            return name
        if remote.mem is not wire.Mem.DRAM and remote.mem is not wire.Mem.VRAM:
            raise ValueError(f"peer memory {remote.mem}; expected DRAM or VRAM")
        handle = self.agent.prep_xfer_dlist(name, remote.strided_rows(), remote.mem.name)
        self._peers[name] = (handle, remote)
        return name

    def connect(self, peer: str) -> None:
        self.agent.make_connection(peer)

    def remove_peer(self, peer: str) -> None:
        entry = self._peers.pop(peer, None)
        if entry is None:
            return
        try:
            self.agent.release_dlist_handle(entry[0])
        finally:
            self.agent.remove_remote_agent(peer)

    def peer_memory(self, peer: str) -> MemoryMap:
        return self._peer(peer)[1]

    def _peer(self, peer: str):
        entry = self._peers.get(peer)
        if entry is None:
            raise ValueError(f"peer {peer!r} is not connected; expected one of {sorted(self._peers)}")
        return entry

    # ---------------------------------------------------------------- transfers
    def post(self, op: Op, peer: str, local_idx: np.ndarray, remote_idx: np.ndarray, notif: bytes = b"") -> Transfer:
        """Make and post a transfer of local_idx[i] <-> remote_idx[i]; raises TransferError on refusal."""
        remote_handle, _ = self._peer(peer)
        li = np.ascontiguousarray(local_idx, dtype=np.int32)
        ri = np.ascontiguousarray(remote_idx, dtype=np.int32)
        if li.shape != ri.shape or li.ndim != 1 or li.size == 0:
            raise ValueError(f"index arrays of shapes {li.shape} and {ri.shape}; expected equal non-empty 1-D")
        nbytes = int(self._page_bytes[li].sum())
        try:
            h = self.agent.make_prepped_xfer(op.value, self._local, li, remote_handle, ri, notif)
        except Exception as exc:  # nixl raises its own typed errors (nixlInvalidParamError, ...)
            raise TransferError(f"NIXL refused the transfer to {peer}: {type(exc).__name__}: {exc}") from exc
        return self._start(Transfer(h, peer, li.size, nbytes))

    def post_rows(self, op: Op, peer: str, local_rows: np.ndarray, remote_rows: np.ndarray,
                  notif: bytes = b"") -> Transfer:
        """Make and post a transfer of (addr, len, dev) rows: local_rows[i] <-> remote_rows[i].

        For field-level plans (heterogeneous TP, different block sizes), whose rows are
        not whole pages. ``initialize_xfer`` checks each row against the registrations and
        does not merge rows, so the plan arrives merged already."""
        _, remote = self._peer(peer)
        lr = np.ascontiguousarray(local_rows, dtype=np.uint64)
        rr = np.ascontiguousarray(remote_rows, dtype=np.uint64)
        if lr.shape != rr.shape or lr.ndim != 2 or lr.shape[1] != 3 or lr.shape[0] == 0:
            raise ValueError(f"row arrays of shapes {lr.shape} and {rr.shape}; expected equal non-empty Nx3")
        try:
            ld = self.agent.get_xfer_descs(lr, self.mem_name)
            rd = self.agent.get_xfer_descs(rr, remote.mem.name)
            h = self.agent.initialize_xfer(op.value, ld, rd, peer, notif)
        except Exception as exc:
            raise TransferError(f"NIXL refused the transfer to {peer}: {type(exc).__name__}: {exc}") from exc
        return self._start(Transfer(h, peer, lr.shape[0], int(lr[:, 1].sum())))

    def _start(self, xfer: Transfer) -> Transfer:
        h, peer = xfer.handle, xfer.peer
        try:
            state = self.agent.transfer(h)
        except Exception as exc:
            self.release(xfer)
            raise TransferError(f"posting to {peer} failed: {type(exc).__name__}: {exc}") from exc
        if state == "ERR":
            self.release(xfer)
            raise TransferError(f"posting to {peer} failed (ERR)")
        return xfer

    def repost(self, xfer: Transfer, notif: bytes = b"") -> None:
        if self.agent.transfer(xfer.handle, notif) == "ERR":
            raise TransferError(f"reposting to {xfer.peer} failed (ERR)")

    def state(self, xfer: Transfer) -> XferState:
        try:
            return XferState(self.agent.check_xfer_state(xfer.handle))
        except Exception:
            return XferState.ERROR

    def telemetry(self, xfer: Transfer) -> Telemetry:
        t = self.agent.get_xfer_telemetry(xfer.handle)
        return Telemetry(descriptors=int(t.descCount), nbytes=int(t.totalBytes), post_us=int(t.postDuration),
                         xfer_us=int(t.xferDuration))

    def release(self, xfer: Transfer) -> None:
        # An active handle cannot always be aborted (anchors/nixl.md §1.1); NIXL keeps
        # it on a leak list and finalises it with the agent.
        self.abort(xfer)

    def abort(self, xfer: Transfer) -> bool:
        """Abort a transfer in progress; True when NIXL confirmed it (no byte moves after),
        False when the handle is still active and its memory must stay untouched."""
        try:
            self.agent.release_xfer_handle(xfer.handle)
        except Exception:
            return False
        return True

    def backend_of(self, xfer: Transfer) -> str:
        return self.agent.query_xfer_backend(xfer.handle)

    # ---------------------------------------------------------------- notifications / progress
    def pump(self) -> dict[str, list[bytes]]:
        """Progress this agent (target side of the peer's transfers) and take new notifications."""
        return self.agent.get_new_notifs()

    def notify(self, peer: str, msg: bytes) -> None:
        self.agent.send_notif(peer, msg)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers):
            try:
                self.remove_peer(peer)
            except Exception:
                pass
        try:
            self.agent.release_dlist_handle(self._local)
            self.agent.deregister_memory(self._reg)
        except Exception:
            pass
