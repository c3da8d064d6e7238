"""Manager, sender, receiver and bootstrap server of the `hybridkv` backend.

Built on SGLang's Common* layer (HTTP bootstrap, ZMQ sockets, rank mapping,
KV_STATUS messages, timeouts, heartbeats); this module adds what that layer
leaves to a backend, and runs everything else on hybridkv's core:

* layout: `hybridkv.layout.adopt_buffers` over SGLang's `kv_data_ptrs`, Mamba
  `state_data_ptrs` and aux buffers (connectors/sglang/adopt.py); the peer's
  Layout is rebuilt from its registration message;
* descriptors: one `descriptors.TransferPlanner` per (peer, component), built at
  registration; each chunk is `compile()`d into (addr, len, dev) rows, one per
  run of pages consecutive on both sides per region (SGLang's NIXL backend: one
  per page per layer buffer);
* NIXL: the Layout's regions registered once (agent.py), plans posted as WRITEs;
* fencing: a `hybridkv.scheduler.TransferScheduler` per manager over the
  engine-owned pools (KV pages, one pool per state type, aux rows):
  - decode: `send_metadata` assigns the request's pages/slots/row and posts one
    import per component (KV; Mamba conv; Mamba SSM; aux) before anything is
    published. A component lands only on the writer's LANDED message, sent
    after every NIXL handle of it is DONE; the receiver reports Success only
    when the scheduler says every expected component arrived (#39846). An
    abort hands the blocks back to the scheduler, which keeps them out of reuse
    while an import is in flight; imports become terminal only when every
    writer is quiet for the room (KV_STATUS, DRAINED answer to the ABORT), the
    writer is declared dead, or the drain deadline passed (#24527). The
    receiver reports Failed, which lets SGLang free the pages, only then; a
    page SGLang hands out while still fenced fails that new request before its
    destinations are published;
  - prefill: each chunk is an export (`post_export`, lease renewed per chunk)
    whose reads are terminal only once every handle settled; a sender reports
    its terminal state only after the scheduler dropped the request, i.e. when
    no read of its source pages is queued or running.
Heterogeneous attention TP is refused at registration with a clear reason.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections import defaultdict
from typing import Any, Optional

import numpy as np
import zmq

from connectors.sglang import messages as msgs
from connectors.sglang.adopt import KV_GROUP, AdoptedLayout, adopt_kv_args, check_peer, from_description
from connectors.sglang.agent import NixlWriter, XferState, split_by_memory
from descriptors.compiler import TransferPlanner
from hybridkv.alloc import MemKind
from hybridkv.fence import NotYet, RequestId, TransferId
from hybridkv.request_state import Component, ComponentKind
from hybridkv.scheduler import TransferScheduler
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_device
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.network import NetworkAddress

logger = logging.getLogger(__name__)

_RECV_POLL_MS = 200
# A handle still PROC this long after a sibling failed is treated as stuck: the
# room is then left to the decode's drain deadline instead of reported Failed.
_SETTLE_TIMEOUT_S = 30.0


def _state_blocks(state_indices) -> list[tuple[int, np.ndarray]]:
    """(state type, int64 slot ids) for each state type with indices; SGLang passes
    per type None, a list, or a list holding one numpy array (Mamba)."""
    out = []
    for c, idx in enumerate(state_indices or ()):
        if idx is None:
            continue
        arr = np.concatenate([np.asarray(x).ravel() for x in idx]) if isinstance(idx, (list, tuple)) and idx \
            else np.asarray(idx).ravel()
        if arr.size:
            out.append((c, arr.astype(np.int64)))
    return out


def request_id(room: int) -> RequestId:
    return RequestId(f"room-{int(room)}")


@dataclasses.dataclass
class _Peer:
    agent_name: str
    layout: AdoptedLayout
    planners: dict[Component, TransferPlanner]
    rejection: Optional[str]


@dataclasses.dataclass
class _Chunk:
    room: int
    kv_indices: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: Optional[int]
    state_indices: Optional[list]
    wait_event: Any


@dataclasses.dataclass
class _Import:
    """Decode side: a room whose destinations were (or are about to be) published."""

    bootstrap_addr: str
    writers: int  # prefill ranks expected to write
    tids: dict[Component, TransferId]  # imports still in flight
    landed_from: dict[Component, set[int]] = dataclasses.field(default_factory=lambda: defaultdict(set))
    quiet: set[int] = dataclasses.field(default_factory=set)
    unlanded: list[Component] = dataclasses.field(default_factory=list)  # ended without landing
    cleared: bool = False


@dataclasses.dataclass
class TransferStats:
    """Counters a test or a benchmark reads; only worker threads write them."""

    chunks: int = 0
    handles: int = 0
    descriptors: int = 0
    bytes: int = 0
    pages: int = 0


class HybridKVManager(CommonKVManager):
    kv_status_msg_tag = b"KV_STATUS"
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True
    num_workers = 2

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: Optional[bool] = False,
    ):
        # Layout, agent and scheduler exist before the base class registers to
        # the bootstrap server: a decode may connect right after.
        self.mem = MemKind.DRAM if get_device().device == "cpu" else MemKind.VRAM
        self.adopted = adopt_kv_args(args, device_mem=self.mem, gpu_id=int(getattr(args, "gpu_id", 0) or 0))
        self.agent = NixlWriter(f"hybridkv-{uuid.uuid4().hex[:12]}", self.adopted.layout)
        self.stats = TransferStats()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # The scheduler is not thread-safe: SGLang's thread, the workers, the
        # listener and the heartbeat thread all take this lock around it.
        self.sched_lock = threading.RLock()
        self._inflight: dict[int, int] = defaultdict(int)  # prefill: chunks queued or being written
        self._exports: dict[int, set[TransferId]] = defaultdict(set)  # prefill: outbound reads in flight
        self._imports: dict[int, _Import] = {}  # decode
        self._drain_waiters: dict[int, set[tuple[str, int]]] = {}
        #: blocks the engine handed back that the scheduler does not yet let it reuse: (group, block)
        self.fenced: set[tuple[int, int]] = set()
        self.peers: dict[str, _Peer] = {}
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.drain_timeout_s = float(getattr(self, "waiting_timeout", 300.0))
        self.sched = TransferScheduler(self.adopted.pool_layout(), managed_pool=False,
                                       lease_s=max(self.drain_timeout_s, 60.0))
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._queues = [queue.Queue() for _ in range(self.num_workers)]
            for i, q in enumerate(self._queues):
                self._spawn(self._worker_loop, f"hybridkv-worker-{i}", q)
            self._spawn(self._prefill_control_loop, "hybridkv-control")
        else:
            self._spawn(self._decode_listener_loop, "hybridkv-listener")
            self._heartbeat_thread = self._start_heartbeat_checker_thread()

    # ------------------------------------------------------------ lifecycle
    def _spawn(self, fn, name: str, *args) -> None:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        """Stop the threads, release NIXL state and the sockets (tests, role switch)."""
        self._stop.set()
        if getattr(self, "_heartbeat_shutdown", None) is not None:
            self._heartbeat_shutdown.set()
        for t in self._threads:
            t.join(timeout=5)
        self.agent.close()
        for sock in list(self._socket_cache.values()) + list(self._monitor_cache.values()):
            sock.close(linger=0)
        self.server_socket.close(linger=0)

    def inflight(self, room: int) -> int:
        with self.sched_lock:
            return self._inflight.get(room, 0)

    def fingerprint(self) -> str:
        return self.adopted.layout.shape_fingerprint

    # ------------------------------------------------------------ scheduler helpers (hold sched_lock)
    def _drop_request(self, rid: RequestId, *, export: bool = False) -> None:
        """Hand a request's blocks back: still-fenced ones are remembered in `fenced`."""
        if not self.sched.has_request(rid):
            return
        blocks = [(g, int(b)) for g in range(self.sched.layout.num_groups) for b in self.sched.blocks(rid, g)]
        self.fenced.update(blocks)
        if export:
            self.sched.export_done(rid)
        else:
            self.sched.abort(rid)
        self._collect_reusable()

    def _collect_reusable(self) -> None:
        # One pool per group, so the pool index is the group.
        for pool, block in self.sched.take_reusable():
            self.fenced.discard((pool, int(block)))

    # ------------------------------------------------------------ decode -> prefill messages
    def build_receiver_registration_message(self) -> list[bytes]:
        return msgs.Register(
            endpoint=self.local_ip, port=self.rank_port, agent_name=self.agent.name,
            agent_metadata=self.agent.metadata(), layout=self.adopted.describe(),
            attn_tp_size=self.attn_tp_size, attn_tp_rank=self.attn_tp_rank,
            state_types=tuple(str(getattr(s, "value", s)) for s in (getattr(self.kv_args, "state_types", None) or [])),
            fingerprint=self.fingerprint(),
        ).to_frames()

    def build_receiver_metadata_message(
        self, *, bootstrap_room: int, required_dst_info_num: int, kv_indices, aux_index, state_indices,
        decode_prefix_len, is_dummy: bool, device_kv_indices=None,
    ) -> list[bytes]:
        states = tuple(
            None if s is None else np.asarray(s, dtype=np.int32).ravel() for s in (state_indices or [])
        )
        return msgs.Metadata(
            room=int(bootstrap_room), endpoint=self.local_ip, port=self.rank_port, agent_name=self.agent.name,
            kv_indices=np.asarray(kv_indices if not is_dummy else [], dtype=np.int32),
            aux_index=int(aux_index if aux_index is not None else -1),
            state_indices=states if not is_dummy else (),
            required_dst_info_num=int(required_dst_info_num), decode_prefix_len=int(decode_prefix_len or 0),
            is_dummy=bool(is_dummy),
        ).to_frames()

    # ------------------------------------------------------------ prefill side
    def _recv(self):
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(_RECV_POLL_MS):
                yield self.server_socket.recv_multipart()

    def _prefill_control_loop(self) -> None:
        for frames in self._recv():
            try:
                if frames and frames[0] == ABORT_TAG:
                    self._on_abort(frames)
                elif frames and frames[0] == msgs.TAG:
                    kind, m = msgs.decode(frames)
                    if kind is msgs.MsgType.REGISTER:
                        self._on_register(msgs.Register.parse(m))
                    elif kind is msgs.MsgType.METADATA:
                        self._on_metadata(msgs.Metadata.parse(m))
                    else:
                        raise ValueError(f"prefill got a {kind.value} message")
                else:
                    raise ValueError(f"unknown control message tag {frames[0][:16]!r}")
            except Exception:
                logger.exception("hybridkv: dropped a control message")

    def _on_register(self, reg: msgs.Register) -> None:
        peer_layout = from_description(reg.layout)
        rejection = None
        planners: dict[Component, TransferPlanner] = {}
        if reg.attn_tp_size != self.attn_tp_size:
            rejection = (
                f"heterogeneous attention TP (prefill {self.attn_tp_size}, decode {reg.attn_tp_size}) "
                "is not supported by the hybridkv SGLang backend yet"
            )
        else:
            try:
                check_peer(self.adopted, peer_layout)
                for comp, _ in self.adopted.components:
                    planners[comp] = TransferPlanner(self.adopted.layout, peer_layout.layout,
                                                     keys=self.adopted.field_keys(comp))
            except ValueError as e:
                rejection = f"layouts do not match: {e}"
        name = self.agent.add_remote(reg.agent_metadata)
        if name != reg.agent_name:
            raise ValueError(f"agent metadata names {name!r} but the message says {reg.agent_name!r}")
        self.peers[name] = _Peer(agent_name=name, layout=peer_layout, planners=planners, rejection=rejection)
        if rejection:
            logger.error("hybridkv: decode %s refused: %s", name, rejection)

    def _on_metadata(self, md: msgs.Metadata) -> None:
        room = md.room
        peer = self.peers.get(md.agent_name)
        infos = self.transfer_infos.setdefault(room, {})
        infos[md.agent_name] = md
        if peer is None or peer.rejection:
            reason = peer.rejection if peer else f"decode agent {md.agent_name} never registered"
            self.record_failure(room, reason)
            self.conclude_failure(bootstrap_room=room, failure_reason=reason)
            return
        if len(infos) == md.required_dst_info_num:
            self.req_to_decode_prefix_len[room] = next(
                (i.decode_prefix_len for i in infos.values() if i.decode_prefix_len), 0
            )
            self.update_status(room, KVPoll.WaitingForInput)

    def _room_notify_targets(self, bootstrap_room: int):
        infos = self.transfer_infos.get(bootstrap_room) or {}
        targets = []
        for md in list(infos.values()):
            if not md.is_dummy and (md.endpoint, md.port) not in targets:
                targets.append((md.endpoint, md.port))
        return targets

    def _on_abort(self, frames: list[bytes]) -> None:
        note = AbortNotification.from_zmq(frames)
        if note is None:
            return
        room = note.room
        if room in self.request_status and self.check_status(room) != KVPoll.Success:
            self.record_failure(room, "Aborted by decode-side abort notification.")
            self.update_status(room, KVPoll.Failed)
        if note.decode_ip and note.decode_port:
            with self.sched_lock:
                self._drain_waiters.setdefault(room, set()).add((note.decode_ip, int(note.decode_port)))
        self.retire_export(room)
        self._maybe_send_drained(room)

    def _maybe_send_drained(self, room: int) -> None:
        with self.sched_lock:
            if self._inflight.get(room, 0) > 0:
                return
            waiters = self._drain_waiters.pop(room, None)
        frames = msgs.Drained(room=room, prefill_rank=self._prefill_unique_rank()).to_frames()
        for ip, port in waiters or ():
            self._push(ip, port, frames, f"DRAINED for room {room}")

    def _push(self, ip: str, port: int, frames: list[bytes], what: str) -> None:
        na = NetworkAddress(ip, port)
        try:
            self._send_multipart_locked(na.to_tcp(), frames, is_ipv6=na.is_ipv6)
        except Exception as e:
            logger.warning("hybridkv: %s to %s:%s failed: %s", what, ip, port, e)

    def add_transfer_request(
        self, bootstrap_room: int, kv_indices, index_slice: slice, is_last_chunk: bool,
        aux_index: Optional[int] = None, state_indices: Optional[list] = None, num_kv_tokens: Optional[int] = None,
        *, wait_event=None, indices_event=None, trace_ctx=None,
    ):
        if self.disaggregation_mode != DisaggregationMode.PREFILL:
            raise RuntimeError("add_transfer_request called on a decode manager")
        if is_last_chunk and aux_index is None:
            raise ValueError(f"room {bootstrap_room}: the last chunk needs an aux index")
        if bootstrap_room not in self.transfer_infos:
            return None  # dummy rank, or cleared
        chunk = _Chunk(room=bootstrap_room, kv_indices=np.asarray(kv_indices, dtype=np.int64),
                       index_slice=index_slice, is_last=is_last_chunk, aux_index=aux_index,
                       state_indices=state_indices, wait_event=wait_event)
        try:
            with self.sched_lock:
                self._hold_sources(chunk)
                self._inflight[bootstrap_room] += 1
        except ValueError as e:
            # Nothing was posted for this chunk; earlier ones (if any) settle on their own.
            self.conclude_failure(bootstrap_room=bootstrap_room, failure_reason=f"hybridkv refused the chunk: {e}")
            self.retire_export(bootstrap_room)
            return None
        self.update_status(bootstrap_room, KVPoll.Transferring)
        self._queues[bootstrap_room % len(self._queues)].put(chunk)
        return None

    def _hold_sources(self, chunk: _Chunk) -> None:
        """The chunk's source blocks join the room's export (held until every read of them is terminal)."""
        rid = request_id(chunk.room)
        sched = self.sched
        if not sched.has_request(rid):
            sched.add_request(rid)
            sched.request_finished(rid, export=True)  # its blocks are read by outbound writes from now on
        wanted = [(KV_GROUP, chunk.kv_indices)]
        if chunk.is_last:
            for c, idx in _state_blocks(chunk.state_indices):
                if c < self.adopted.num_state_groups:
                    wanted.append((self.adopted.state_group(c), idx))
            wanted.append((self.adopted.aux_group, np.asarray([chunk.aux_index], dtype=np.int64)))
        for group, blocks in wanted:
            size = sched.layout.pool_sizes[sched.layout.group_pools[group]]
            bad = [int(b) for b in blocks if not 0 <= int(b) < size]
            if bad:
                raise ValueError(f"source block {bad[0]} of group {group} is outside its pool (valid 0..{size - 1})")
        for group, blocks in wanted:
            held = set(int(b) for b in sched.blocks(rid, group))
            new = [int(b) for b in blocks if int(b) not in held]
            try:
                sched.assign(rid, group, new)
            except ValueError:
                # A prefix page shared with another live room (radix cache): that
                # room holds it; this room's reads are still counted by its own
                # export and gate its own sender.
                for b in new:
                    try:
                        sched.assign(rid, group, [b])
                    except ValueError:
                        pass

    def retire_export(self, room: int) -> None:
        """Drop the room's export once nothing of it is queued or being read and it is terminal."""
        with self.sched_lock:
            if self._inflight.get(room, 0) > 0 or self._exports.get(room):
                return
            self._exports.pop(room, None)
            status = self.request_status.get(room)
            if status is None or status in (KVPoll.Success, KVPoll.Failed):
                self._drop_request(request_id(room), export=True)

    def exporting(self, room: int) -> bool:
        with self.sched_lock:
            return self.sched.has_request(request_id(room))

    def _worker_loop(self, q: queue.Queue) -> None:
        while not self._stop.is_set():
            try:
                chunk = q.get(timeout=_RECV_POLL_MS / 1000)
            except queue.Empty:
                continue
            try:
                self._process(chunk)
            except Exception:
                logger.exception("hybridkv: worker failed on room %s", chunk.room)
            finally:
                with self.sched_lock:
                    self._inflight[chunk.room] -= 1
                    if self._inflight[chunk.room] <= 0:
                        del self._inflight[chunk.room]
                self.retire_export(chunk.room)
                self._maybe_send_drained(chunk.room)

    def _plans_for(self, chunk: _Chunk, md: msgs.Metadata, peer: _Peer):
        """Per component, the compiled plan split by memory kind. Raises ValueError before anything is posted."""
        dst_pages = md.kv_indices[chunk.index_slice]
        if len(dst_pages) != len(chunk.kv_indices):
            raise ValueError(
                f"room {chunk.room}: {len(chunk.kv_indices)} source pages for {len(dst_pages)} destination pages"
            )
        blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {KV_GROUP: (chunk.kv_indices, dst_pages)}
        if chunk.is_last:
            for c, idx in _state_blocks(chunk.state_indices):
                if c >= len(md.state_indices) or md.state_indices[c] is None:
                    raise ValueError(f"room {chunk.room}: decode sent no destination for state component {c}")
                blocks[self.adopted.state_group(c)] = (idx, md.state_indices[c])
            if md.aux_index < 0:
                raise ValueError(f"room {chunk.room}: decode sent no aux index")
            blocks[self.adopted.aux_group] = (np.asarray([int(chunk.aux_index)]), np.asarray([md.aux_index]))
        out = []
        for comp, planner in peer.planners.items():
            if comp.group not in blocks:
                continue
            src, dst = blocks[comp.group]
            plan = planner.compile({comp.group: src}, {comp.group: dst})
            out.append((comp, plan, split_by_memory(plan, self.adopted.layout, peer.layout.layout)))
        return out

    def _process(self, chunk: _Chunk) -> None:
        room = chunk.room
        rid = request_id(room)
        status = self.request_status.get(room)
        infos = self.transfer_infos.get(room)
        if status is None or status == KVPoll.Failed or infos is None:
            return  # aborted or cleared: nothing is written for it
        if chunk.wait_event is not None and hasattr(chunk.wait_event, "synchronize"):
            chunk.wait_event.synchronize()  # export fence: the device finished writing the source
            if self.request_status.get(room) in (None, KVPoll.Failed):
                return  # aborted while the device was still writing the source
        self.update_status(room, KVPoll.Transferring)
        handles = []
        tid = None
        sent: list[Component] = []
        try:
            targets = [(md, self.peers[md.agent_name]) for md in list(infos.values()) if not md.is_dummy]
            plans = [(md, self._plans_for(chunk, md, peer)) for md, peer in targets]
            with self.sched_lock:
                self.sched.heartbeat(rid)
                tid = self.sched.post_export(rid)
                if isinstance(tid, NotYet):
                    raise RuntimeError(f"the scheduler refused the read of room {room}: {tid.reason.value}")
                self._exports[room].add(tid)
            for md, comp_plans in plans:
                for comp, plan, by_mem in comp_plans:
                    for (smem, dmem), (src, dst) in by_mem.items():
                        handles.append(self.agent.post_write(md.agent_name, src, smem, dst, dmem))
                    self.stats.descriptors += plan.num_descriptors
                    self.stats.bytes += plan.nbytes
                    if comp not in sent:
                        sent.append(comp)
            self.stats.chunks += 1
            self.stats.handles += len(handles)
            self.stats.pages += len(chunk.kv_indices)
            failed = self._settle(handles)
            if failed:
                raise RuntimeError(f"NIXL reported an error for {failed} of {len(handles)} handles of room {room}")
        except Exception as e:
            stuck = self._settle(handles, count_stuck=True) if handles else 0
            if stuck < 0:
                # A write may still land: say nothing that lets decode reuse pages,
                # and keep the read counted so the source is not reused either.
                self.record_failure(room, str(e))
                self.update_status(room, KVPoll.Failed)
                logger.error("hybridkv: room %s failed with a handle still running: %s", room, e)
                tid = None
            else:
                self.conclude_failure(bootstrap_room=room, failure_reason=f"hybridkv transfer failed: {e}")
            self._end_export(room, tid, ok=False)
            return
        finally:
            for h in handles:
                self.agent.release(h)
        self._end_export(room, tid, ok=True)
        if chunk.is_last:
            # Every chunk of the room ran on this worker, in order, and settled:
            # the KV component is complete with this one.
            landed = msgs.Landed(room=room, prefill_rank=self._prefill_unique_rank(),
                                 components=tuple((c.group, c.kind.value) for c in sent)).to_frames()
            for ip, port in self._room_notify_targets(room):
                self._push(ip, port, landed, f"LANDED for room {room}")
            self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)
            self.transfer_infos.pop(room, None) if self.check_status(room) == KVPoll.Success else None

    def _end_export(self, room: int, tid: Optional[TransferId], *, ok: bool) -> None:
        if tid is None:
            return
        with self.sched_lock:
            self._exports[room].discard(tid)
            if ok:
                self.sched.transfer_landed(tid)
            else:
                self.sched.transfer_failed(tid)
            self._collect_reusable()

    def _settle(self, handles: list, *, count_stuck: bool = False) -> int:
        """Wait until no handle is PROC. Returns the number that failed, or -1 if one is stuck."""
        deadline = time.monotonic() + _SETTLE_TIMEOUT_S
        pending = list(handles)
        failed = 0
        while pending:
            still = []
            for h in pending:
                s = self.agent.state(h)
                if s is XferState.PROC:
                    still.append(h)
                elif s is XferState.ERR:
                    failed += 1
            pending = still
            if pending:
                if time.monotonic() > deadline:
                    return -1
                time.sleep(0.0005)
        return failed

    # ------------------------------------------------------------ decode side
    def begin_import(self, room: int, bootstrap_addr: str, writers: int, blocks: dict[int, np.ndarray]) -> None:
        """Assign the request's blocks and post one import per component, before anything is published.

        ValueError (nothing applied) if a block is held or still fenced: SGLang
        handed out a page that a write of an earlier request may still reach.
        """
        rid = request_id(room)
        with self.sched_lock:
            if room in self._imports or self.sched.has_request(rid):
                raise ValueError(f"room {room} already has destinations published; expected a new room")
            comps = [c for g in sorted(blocks) for c in self.adopted.components_of(g) if len(blocks[g])]
            self.sched.add_request(rid, expect=comps)
            tids: dict[Component, TransferId] = {}
            try:
                for g in sorted(blocks):
                    self.sched.assign(rid, g, [int(b) for b in blocks[g]])
                for c in comps:
                    tid = self.sched.post_import(rid, components=[c])
                    if isinstance(tid, NotYet):
                        raise ValueError(f"room {room}: the scheduler refused the import of {c}: {tid.reason.value}")
                    tids[c] = tid
            except ValueError:
                for tid in tids.values():
                    self.sched.transfer_failed(tid)  # nothing was published: no write can come
                self.sched.abort(rid)
                self._collect_reusable()
                raise
            self._imports[room] = _Import(bootstrap_addr=bootstrap_addr, writers=max(1, writers), tids=tids)

    def end_import(self, room: int, *, landed: bool) -> bool:
        """Receiver side: the engine is done with the room. True if nothing is in flight any more."""
        rid = request_id(room)
        with self.sched_lock:
            imp = self._imports.get(room)
            if landed:
                if self.sched.has_request(rid):
                    self.sched.request_finished(rid)  # the pages belong to the running request now
                    self._collect_reusable()
            else:
                self._drop_request(rid)
            if imp is None or not imp.tids:
                self._imports.pop(room, None)
                return True
            imp.cleared = True
            return False

    def imports_in_flight(self, room: int) -> int:
        with self.sched_lock:
            imp = self._imports.get(room)
            return len(imp.tids) if imp else 0

    def import_ready(self, room: int) -> bool:
        with self.sched_lock:
            rid = request_id(room)
            return self.sched.has_request(rid) and self.sched.is_ready(rid)

    def missing_components(self, room: int) -> list[Component]:
        """Components of the room not landed: still in flight, or ended without landing."""
        with self.sched_lock:
            imp = self._imports.get(room)
            return imp.unlanded + list(imp.tids) if imp else []

    def settle_imports(self, room: int, reason: str) -> None:
        """Every writer of the room is quiet (or gone): imports still open will never land."""
        with self.sched_lock:
            imp = self._imports.get(room)
            if imp is None:
                return
            if imp.tids:
                logger.info("hybridkv: room %s: %d import(s) end unlanded (%s)", room, len(imp.tids), reason)
            for comp, tid in imp.tids.items():
                self.sched.transfer_failed(tid)
                imp.unlanded.append(comp)
            imp.tids.clear()
            if imp.cleared:
                self._imports.pop(room, None)
            self._collect_reusable()

    def _on_landed(self, landed: msgs.Landed) -> None:
        with self.sched_lock:
            imp = self._imports.get(landed.room)
            if imp is None:
                return
            for group, kind in landed.components:
                comp = Component(group=group, kind=ComponentKind(kind))
                if comp not in imp.tids:
                    continue
                imp.landed_from[comp].add(landed.prefill_rank)
                if len(imp.landed_from[comp]) >= imp.writers:
                    self.sched.transfer_landed(imp.tids.pop(comp))

    def _note_quiet(self, room: int, rank: int) -> None:
        with self.sched_lock:
            imp = self._imports.get(room)
            if imp is None:
                return
            imp.quiet.add(rank)
            done = len(imp.quiet) >= imp.writers
        if done:
            self.settle_imports(room, "every writer is quiet")

    def _decode_listener_loop(self) -> None:
        for frames in self._recv():
            try:
                if frames and frames[0] == msgs.TAG:
                    kind, m = msgs.decode(frames)
                    if kind is msgs.MsgType.LANDED:
                        self._on_landed(msgs.Landed.parse(m))
                    elif kind is msgs.MsgType.DRAINED:
                        d = msgs.Drained.parse(m)
                        self._note_quiet(d.room, d.prefill_rank)
                    else:
                        raise ValueError(f"decode got a {kind.value} message")
                    continue
                if self.handle_abort_ack_message(frames):
                    continue
                parsed = self.parse_kv_status_message(frames)
                if parsed is None:
                    raise ValueError(f"unknown message tag {frames[0][:16]!r}")
                room, status, rank, reason = parsed
                self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank,
                                          failure_reason=reason)
                if status in (KVPoll.Success, KVPoll.Failed):
                    # A prefill rank reports a terminal status only with every handle settled.
                    self._note_quiet(room, rank)
            except Exception:
                logger.exception("hybridkv: dropped a decode-side message")

    def _handle_node_failure(self, failed_bootstrap_addr: str):
        with self.sched_lock:
            rooms = [r for r, imp in self._imports.items() if imp.bootstrap_addr == failed_bootstrap_addr]
        for room in rooms:
            self.settle_imports(room, f"prefill {failed_bootstrap_addr} is dead")
        super()._handle_node_failure(failed_bootstrap_addr)


class HybridKVSender(CommonKVSender):
    kv_mgr: HybridKVManager

    def poll(self) -> KVPoll:
        status = super().poll()
        if status in (KVPoll.Success, KVPoll.Failed):
            self.kv_mgr.retire_export(self.bootstrap_room)
            if self.kv_mgr.exporting(self.bootstrap_room):
                # The scheduler frees source pages on a terminal state; an
                # outbound read of them is still queued or running.
                return KVPoll.Transferring
        return status

    def abort(self) -> None:
        super().abort()
        self.kv_mgr.retire_export(self.bootstrap_room)


class HybridKVReceiver(CommonKVReceiver):
    kv_mgr: HybridKVManager

    def __init__(self, mgr: HybridKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None):
        self._published = False
        self._final: Optional[KVPoll] = None
        self._drain_since: Optional[float] = None
        super().__init__(mgr, bootstrap_addr, bootstrap_room)

    def _writers_expected(self) -> int:
        return sum(1 for info in (self.bootstrap_infos or []) if not info.get("is_dummy"))

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None, **kwargs):
        if self.bootstrap_infos is not None and not self._published:
            mgr = self.kv_mgr
            blocks = {KV_GROUP: np.asarray(kv_indices, dtype=np.int64).ravel()}
            for c, idx in _state_blocks(state_indices):
                if c < mgr.adopted.num_state_groups:
                    blocks[mgr.adopted.state_group(c)] = idx
            if aux_index is not None:
                blocks[mgr.adopted.aux_group] = np.asarray([aux_index], dtype=np.int64)
            try:
                mgr.begin_import(self.bootstrap_room, self.bootstrap_addr, self._writers_expected(), blocks)
            except ValueError as e:
                # Nothing was published: failing here frees nothing a write can reach.
                mgr.record_failure(self.bootstrap_room, f"hybridkv refused the destinations: {e}")
                mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                self.ensure_abort_notified()  # the prefill ranks stop waiting for this room
                return None
            # From the first attempt on, some prefill rank may hold our destinations.
            self._published = True
        return super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, **kwargs)

    def poll(self) -> KVPoll:
        if self._final is not None:
            return self._final
        status = super().poll()
        mgr = self.kv_mgr
        room = self.bootstrap_room
        if status == KVPoll.Success:
            if mgr.import_ready(room):
                mgr.end_import(room, landed=True)
                self._final = KVPoll.Success
                return KVPoll.Success
            # Every prefill rank said Success (after its LANDED, on the same
            # socket) and is quiet, yet a component never landed (#39846).
            missing = mgr.missing_components(room)
            mgr.settle_imports(room, "prefill reported success")
            mgr.end_import(room, landed=False)
            names = ", ".join(f"{c.kind.value}@group{c.group}" for c in missing) or "?"
            mgr.record_failure(room, f"prefill reported success but components [{names}] never landed")
            mgr.update_status(room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
            self._final = KVPoll.Failed
            return KVPoll.Failed
        if status != KVPoll.Failed:
            return status
        if not self._published or mgr.imports_in_flight(room) == 0:
            mgr.end_import(room, landed=False)
            self._final = KVPoll.Failed
            return KVPoll.Failed
        # Ask the prefill ranks to stop and to say when nothing is in flight.
        self.ensure_abort_notified()
        now = time.monotonic()
        if self._drain_since is None:
            self._drain_since = now
        if now - self._drain_since >= mgr.drain_timeout_s:
            logger.error("hybridkv: room %s released after %.0fs without a drain answer", room, now - self._drain_since)
            mgr.settle_imports(room, "drain deadline passed")
            mgr.end_import(room, landed=False)
            self._final = KVPoll.Failed
            return KVPoll.Failed
        return KVPoll.Transferring

    def abort(self) -> None:
        super().abort()
        # The engine gives the request up: its blocks go back to the scheduler,
        # which keeps any with an import in flight out of reuse.
        self.kv_mgr.end_import(self.bootstrap_room, landed=False)

    def clear(self) -> None:
        super().clear()
        if self._final is None:
            self.kv_mgr.end_import(self.bootstrap_room, landed=False)


class HybridKVBootstrapServer(CommonKVBootstrapServer):
    pass
