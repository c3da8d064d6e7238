"""NIXL (UCX backend) data plane: one agent, regions registered once, prepped lists per peer.

Two ways to post, one agent:

- :meth:`DataPlane.post`, the fast path for whole pages: a transfer costs two int32
  index arrays. The local side's strided list (one Nx5 row per region) is prepped
  once, and each peer's list once at handshake. ``make_prepped_xfer`` merges
  consecutive indices that are back to back on both sides (docs/background/nixl.md §1.1),
  which the planner arranges (pairs ordered by the consumer's index); telemetry reports
  how many descriptors NIXL actually posted. A prepped list has one memory kind,
  so this path needs both sides' regions in one kind.
- :meth:`DataPlane.post_rows`, arbitrary (addr, len, dev) rows (field-level plans,
  SGLang's state slots and aux rows). Either side's rows may span memory kinds (on
  a GPU server SGLang keeps its aux rows in host memory): rows are grouped by
  (local kind, remote kind), one NIXL handle per pair, and the :class:`Transfer`
  covers them all.

Memory is registered once per memory kind, regions that touch or overlap merged
into one span (:class:`MemorySpans`); rows are classified by the span they lie in.

Threading: with the progress thread off (the default: it slowed small
descriptors on small machines), the *target* agent must be progressed or an
initiator's transfer stays in progress; :meth:`DataPlane.pump` does that and
the control loop calls it. A waiter (``Side.wait_xfer``) may poll back to back for
``DataPlaneConfig.spin_s`` (default 0) before it yields between polls. An agent shared by several threads needs
``SyncMode.STRICT`` (default) or ``RW``.
"""

from __future__ import annotations

import enum
import functools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv import wire
from hybridkv.errors import TransferError
from hybridkv.transport.memory import MemoryMap
from hybridkv.transport.nixl_shim import load_nixl
from hybridkv.transport.plan import TransferPlan
from hybridkv.transport.primer import Primer


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


_STATES = {s.value: s for s in XferState}
_I32 = np.dtype(np.int32)


def _int32(a) -> np.ndarray:
    """``a`` as a C-contiguous int32 array; an array that is one already passes as it is, no numpy call."""
    if type(a) is np.ndarray and a.dtype is _I32 and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a, dtype=np.int32)


@dataclass(frozen=True, kw_only=True)
class DataPlaneConfig:
    name: str | None = None  # agent name; unique per process (default: random)
    progress_thread: bool = False
    sync: SyncMode = SyncMode.STRICT
    telemetry: bool = True
    #: how long a waiter (``Side.wait_xfer``) polls a transfer back to back before it yields to its
    #: event loop between polls, blocking the loop that long at most per wait. Off: on one H100 a
    #: fetch's READ was seen landed no later than a busy-polled raw READ (198 vs 211 us after the
    #: post, 320 MB), so a spin buys nothing there; `bench transfer --spin-us` measures it.
    spin_s: float = 0.0
    #: extra UCX backend parameters, e.g. {"ucx_error_handling_mode": "peer"}
    ucx_params: tuple[tuple[str, str], ...] = (("ucx_error_handling_mode", "peer"),)
    #: a consumer primes the posting path with a READ of a few bytes into a scratch buffer of its own
    #: once it asked a producer for a request (transport/primer.py): its own READ posts warmer (one H100:
    #: NIXL's transfer() 44-46 us of CPU instead of 70-94, the whole fetch no longer)
    prime: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.spin_s <= 1:
            raise ValueError(f"DataPlaneConfig.spin_s = {self.spin_s}; expected 0 to 1 second")


@dataclass(frozen=True, kw_only=True)
class Telemetry:
    descriptors: int  # what NIXL posted after merging
    nbytes: int
    post_us: int
    xfer_us: int


@dataclass(frozen=True, kw_only=True, eq=False)
class MemorySpans:
    """What one side registers: per memory kind, (addr, len, dev) spans covering its regions,
    spans that touch or overlap on one device merged (one registration holds them)."""

    rows: dict[wire.Mem, np.ndarray]
    # every span sorted by address, for classifying rows: start, end, memory-kind code
    _start: np.ndarray
    _end: np.ndarray
    _kind: np.ndarray

    @classmethod
    def of(cls, regions: Sequence[wire.RegionInfo]) -> MemorySpans:
        rows: dict[wire.Mem, np.ndarray] = {}
        for mem in wire.Mem:
            spans = sorted((r.device_id, r.base_addr, r.base_addr + r.stride * (r.num_pages - 1) + r.page_bytes)
                           for r in regions if r.mem is mem)
            merged: list[list[int]] = []
            for dev, start, end in spans:
                if merged and merged[-1][2] == dev and start <= merged[-1][0] + merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], end - merged[-1][0])
                else:
                    merged.append([start, end - start, dev])
            if merged:
                rows[mem] = np.asarray(merged, dtype=np.uint64)
        flat = [(int(a), int(a) + int(n), int(mem)) for mem, rs in rows.items() for a, n, _ in rs]
        flat.sort()
        a = np.asarray(flat, dtype=np.int64).reshape(-1, 3)
        return cls(rows=rows, _start=a[:, 0].copy(), _end=a[:, 1].copy(), _kind=a[:, 2].copy())

    @property
    def single(self) -> wire.Mem | None:
        """The one memory kind, or None where the side mixes kinds (or registers nothing)."""
        return next(iter(self.rows)) if len(self.rows) == 1 else None

    def kinds(self, rows: np.ndarray, *, side: str = "local") -> np.ndarray:
        """The wire.Mem code of each (addr, len, dev) row; ValueError for a row in no span."""
        addr = rows[:, 0].astype(np.int64)
        end = addr + rows[:, 1].astype(np.int64)
        i = np.searchsorted(self._start, addr, side="right") - 1
        ok = (i >= 0) & (end <= self._end[np.maximum(i, 0)])
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"{side} row {bad} ({hex(int(addr[bad]))}, {int(rows[bad, 1])} bytes) lies in no "
                             f"registered region; expected rows inside the {side} side's regions")
        return self._kind[i]


def group_by_kind(local_rows: np.ndarray, local: MemorySpans, remote_rows: np.ndarray,
                  remote: MemorySpans) -> dict[tuple[wire.Mem, wire.Mem], tuple[np.ndarray, np.ndarray]]:
    """Rows paired i <-> i, grouped by (local kind, remote kind) in row order: one NIXL handle each."""
    if local.single is not None and remote.single is not None:
        return {(local.single, remote.single): (local_rows, remote_rows)}
    lk = local.kinds(local_rows, side="local") if local.single is None \
        else np.full(len(local_rows), int(local.single))
    rk = remote.kinds(remote_rows, side="remote") if remote.single is None \
        else np.full(len(remote_rows), int(remote.single))
    out = {}
    for lm in wire.Mem:
        for rm in wire.Mem:
            sel = (lk == int(lm)) & (rk == int(rm))
            if sel.any():
                out[(lm, rm)] = (local_rows[sel], remote_rows[sel])
    return out


class Transfer:
    """One posted transfer (one NIXL handle, or one per pair of memory kinds); poll with
    :meth:`DataPlane.state`. ``handles`` holds those NIXL has not released yet. ``nbytes`` may be
    given as a function, called once when first read: summing page sizes costs a few us that the
    post itself need not wait for."""

    __slots__ = ("handles", "peer", "indices", "_nbytes", "failed")

    def __init__(self, handles: list, peer: str, indices: int, nbytes: int | Callable[[], int]) -> None:
        self.handles = handles
        self.peer = peer
        self.indices = indices
        self._nbytes = nbytes
        self.failed = False  # a handle failed to post after others were running

    @property
    def nbytes(self) -> int:
        if callable(self._nbytes):
            self._nbytes = int(self._nbytes())
        return self._nbytes


@dataclass(frozen=True, kw_only=True, eq=False)
class _Peer:
    prepped: object | None  # the peer's prepped region list; None where its regions mix memory kinds
    memory: MemoryMap
    spans: MemorySpans


class DataPlane:
    def __init__(self, memory: MemoryMap, config: DataPlaneConfig = DataPlaneConfig()) -> None:
        api = load_nixl()
        self._api = api
        self.memory = memory
        self.spans = MemorySpans.of(memory.regions)
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
        self._regs = [self.agent.register_memory(rows, mem.name) for mem, rows in self.spans.rows.items()]
        mem = self.spans.single
        # A prepped list has one memory kind: a side that mixes kinds posts rows only.
        self._local = None if mem is None else \
            self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", memory.strided_rows(), mem.name)
        self._peers: dict[str, _Peer] = {}
        first = memory.regions[0] if memory.regions else None
        self._primer = Primer(self.agent, mem, first.device_id) if config.prime and mem is not None \
            and first is not None else None
        self._page_bytes = np.concatenate(
            [np.full(r.num_pages, r.page_bytes, np.int64) for r in memory.regions]) if memory.regions else np.zeros(0)
        self._closed = False

    # ---------------------------------------------------------------- peers
    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes, remote: MemoryMap) -> str:
        """Load a peer's agent metadata; returns its agent name. Its region list is prepped
        once for :meth:`post` where its regions are of one memory kind (else only
        :meth:`post_rows` reaches it)."""
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name in self._peers:
            return name
        spans = MemorySpans.of(remote.regions)
        mem = spans.single
        prepped = None if mem is None else self.agent.prep_xfer_dlist(name, remote.strided_rows(), mem.name)
        self._peers[name] = _Peer(prepped=prepped, memory=remote, spans=spans)
        if self._primer is not None and remote.regions:
            self._primer.add_peer(name, remote.regions[0])
        return name

    def connect(self, peer: str) -> None:
        self.agent.make_connection(peer)

    def remove_peer(self, peer: str) -> None:
        entry = self._peers.pop(peer, None)
        if entry is None:
            return
        if self._primer is not None:
            self._primer.remove_peer(peer)
        try:
            if entry.prepped is not None:
                self.agent.release_dlist_handle(entry.prepped)
        finally:
            self.agent.remove_remote_agent(peer)

    def prepped(self, peer: str) -> tuple[object, object]:
        """(this side's prepped region list, the peer's): what :meth:`post`'s index pairs index,
        for a caller that posts the same pairs itself (``bench transfer``'s plain-NIXL baseline)."""
        entry = self._peer(peer)
        if self._local is None or entry.prepped is None:
            raise ValueError(f"no prepped lists for {peer}: a side's regions mix memory kinds")
        return self._local, entry.prepped

    def _peer(self, peer: str) -> _Peer:
        entry = self._peers.get(peer)
        if entry is None:
            raise ValueError(f"peer {peer!r} is not connected; expected one of {sorted(self._peers)}")
        return entry

    # ---------------------------------------------------------------- transfers
    def post_plan(self, op: Op, peer: str, plan: TransferPlan, notif: bytes = b"") -> Transfer:
        """Post a planned transfer: its prepped-list index pairs where it has them, else its rows.

        A plan's ``src`` is the producer's side, so this agent's side is ``dst`` when it READs
        (the consumer pulls) and ``src`` when it WRITEs (the producer pushes)."""
        return self.ready(op, peer, plan, notif)()

    def ready(self, op: Op, peer: str, plan: TransferPlan, notif: bytes = b"") -> Callable[[], Transfer]:
        """:meth:`post_plan`, checked now and posted when the returned function is called.

        The post is the hot path of every fetch and it runs cold: between the fence allowing it and NIXL's
        ``transfer()`` every call and check costs several us, while whatever runs after ``transfer()``
        overlaps the wire. So an import checks its READs first (a refusal then posts none of them) and
        its posting window holds NIXL's two calls alone. Raises as :meth:`post` does."""
        reading = op is Op.READ
        src_i, dst_i = plan.src_index, plan.dst_index
        if src_i is not None and dst_i is not None:  # the index form (read directly: every fetch runs this)
            return self._ready(op, peer, dst_i if reading else src_i, src_i if reading else dst_i, notif)
        local, remote = (plan.dst, plan.src) if reading else (plan.src, plan.dst)
        return self._ready_rows(op, peer, local, remote, notif)

    def post(self, op: Op, peer: str, local_idx: np.ndarray, remote_idx: np.ndarray, notif: bytes = b"") -> Transfer:
        """Make and post a transfer of local_idx[i] <-> remote_idx[i]; raises TransferError on refusal."""
        return self._ready(op, peer, local_idx, remote_idx, notif)()

    def _ready(self, op: Op, peer: str, local_idx: np.ndarray, remote_idx: np.ndarray,
               notif: bytes) -> Callable[[], Transfer]:
        """:meth:`post`'s checks now, its NIXL calls when the result is called (one handle, int32 arrays
        passed unconverted, the byte count left to its reader: the H100 bench measured +38 us of posting
        CPU where the post did more)."""
        entry = self._peers.get(peer)
        local = self._local
        if entry is None or local is None or entry.prepped is None:
            self._peer(peer)  # raises for a peer not connected
            side = "this side's" if local is None else f"peer {peer}'s"
            raise ValueError(f"{side} regions mix memory kinds, so they have no prepped list; "
                             "expected post_rows for them")
        li, ri = _int32(local_idx), _int32(remote_idx)
        if li.ndim != 1 or li.shape != ri.shape or not li.size:
            raise ValueError(f"index arrays of shapes {li.shape} and {ri.shape}; expected equal non-empty 1-D")
        make, transfer, remote, name = self.agent.make_prepped_xfer, self.agent.transfer, entry.prepped, op._value_
        release, page_bytes = self._release, self._page_bytes

        def go() -> Transfer:
            try:
                h = make(name, local, li, remote, ri, notif)
            except Exception as exc:  # nixl raises its own typed errors (nixlInvalidParamError, ...)
                raise TransferError(f"NIXL refused the transfer to {peer}: {type(exc).__name__}: {exc}") from exc
            try:
                state = transfer(h)
            except Exception as exc:
                state = f"{type(exc).__name__}: {exc}"
            if state != "PROC" and state != "DONE":
                release(h)
                raise TransferError(f"posting to {peer} failed ({state})")
            return Transfer([h], peer, li.size, lambda: page_bytes[li].sum())

        return go

    def post_rows(self, op: Op, peer: str, local_rows: np.ndarray, remote_rows: np.ndarray,
                  notif: bytes = b"") -> Transfer:
        """Make and post a transfer of (addr, len, dev) rows: local_rows[i] <-> remote_rows[i].

        For field-level plans (heterogeneous TP, different block sizes) and engines whose
        items are not whole pages. ``initialize_xfer`` checks each row against the
        registrations and does not merge rows, so the plan arrives merged already. Rows
        may span memory kinds on either side: one NIXL handle per (local, remote) pair
        of kinds, every one made before any is posted, so a refusal (TransferError)
        leaves nothing running. Should a later handle fail to post while earlier ones
        run, the transfer is returned and settles as ERROR."""
        return self._ready_rows(op, peer, local_rows, remote_rows, notif)()

    def _ready_rows(self, op: Op, peer: str, local_rows: np.ndarray, remote_rows: np.ndarray,
                    notif: bytes) -> Callable[[], Transfer]:
        """:meth:`post_rows`' checks now (shapes, every row inside a registration), its NIXL calls when the
        result is called."""
        entry = self._peer(peer)
        lr = np.ascontiguousarray(local_rows, dtype=np.uint64)
        rr = np.ascontiguousarray(remote_rows, dtype=np.uint64)
        if lr.shape != rr.shape or lr.ndim != 2 or lr.shape[1] != 3 or lr.shape[0] == 0:
            raise ValueError(f"row arrays of shapes {lr.shape} and {rr.shape}; expected equal non-empty Nx3")
        groups = group_by_kind(lr, self.spans, rr, entry.spans)

        def go() -> Transfer:
            handles = []
            try:
                for (lm, rm), (l_part, r_part) in groups.items():
                    ld = self.agent.get_xfer_descs(l_part, lm.name)
                    rd = self.agent.get_xfer_descs(r_part, rm.name)
                    handles.append(self.agent.initialize_xfer(op.value, ld, rd, peer, notif))
            except Exception as exc:
                self._release_all(handles)
                raise TransferError(f"NIXL refused the transfer to {peer}: {type(exc).__name__}: {exc}") from exc
            return self._start(Transfer(handles, peer, lr.shape[0], lambda: lr[:, 1].sum()))

        return go

    def _start(self, xfer: Transfer) -> Transfer:
        peer = xfer.peer
        for i, h in enumerate(xfer.handles):
            try:
                state = self.agent.transfer(h)
                error = None if state != "ERR" else "ERR"
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            if error is None:
                continue
            if i == 0:
                self.release(xfer)
                raise TransferError(f"posting to {peer} failed ({error})")
            # Earlier handles are running: the caller must still see them settle.
            self._release_all(xfer.handles[i:])
            xfer.handles = xfer.handles[:i]
            xfer.failed = True
            break
        return xfer

    def state(self, xfer: Transfer) -> XferState:
        """IN_PROGRESS while any of its handles runs; then ERROR if one failed, else DONE."""
        if len(xfer.handles) == 1 and not xfer.failed:
            return self._state(xfer.handles[0])
        states = [self._state(h) for h in xfer.handles]
        if XferState.IN_PROGRESS in states:
            return XferState.IN_PROGRESS
        return XferState.ERROR if xfer.failed or XferState.ERROR in states else XferState.DONE

    def poller(self, xfer: Transfer) -> Callable[[], XferState]:
        """A function that tells :meth:`state` of ``xfer`` (as the transfer stands now: its handles are
        not released meanwhile), in one call for a one-handle transfer: a waiter calls it back to back."""
        if len(xfer.handles) != 1 or xfer.failed:
            return lambda: self.state(xfer)
        return functools.partial(self._state, xfer.handles[0])

    def _state(self, handle) -> XferState:
        try:
            # A dict, not XferState(value): this runs back to back while a waiter spins.
            return _STATES.get(self.agent.check_xfer_state(handle), XferState.ERROR)
        except Exception:
            return XferState.ERROR

    def telemetry(self, xfer: Transfer) -> Telemetry:
        ts = [self.agent.get_xfer_telemetry(h) for h in xfer.handles]
        return Telemetry(descriptors=sum(int(t.descCount) for t in ts), nbytes=sum(int(t.totalBytes) for t in ts),
                         post_us=sum(int(t.postDuration) for t in ts),
                         xfer_us=max((int(t.xferDuration) for t in ts), default=0))

    def release(self, xfer: Transfer) -> None:
        # An active handle cannot always be aborted (docs/background/nixl.md §1.1); NIXL keeps
        # it on a leak list and finalises it with the agent.
        self.abort(xfer)

    def abort(self, xfer: Transfer) -> bool:
        """End a transfer: True when every handle had ended and was released (no byte moves
        after), False when a handle is still active and its memory must stay untouched (the
        transfer then keeps only those handles, until NIXL ends them)."""
        # A handle still running is kept, not released: NIXL's UCX backend releases a READ in progress and
        # reports success, yet its bytes still land once the peer answers (seen over UCX's tcp transport).
        xfer.handles = [h for h in xfer.handles if self._state(h) is XferState.IN_PROGRESS or not self._release(h)]
        return not xfer.handles

    def _release(self, handle) -> bool:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:
            return False
        return True

    def _release_all(self, handles: list) -> None:
        for h in handles:
            self._release(h)

    def prime(self, peer: str) -> bool:
        """Post a primer READ from ``peer`` (``DataPlaneConfig.prime``); whether one went out."""
        return self._primer is not None and self._primer.prime(peer)

    @property
    def priming(self) -> bool:
        return self._primer is not None

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
        if self._primer is not None:
            self._primer.close()
        try:
            if self._local is not None:
                self.agent.release_dlist_handle(self._local)
        except Exception:
            pass
        for reg in self._regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception:
                pass
