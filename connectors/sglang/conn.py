"""Manager, sender, receiver and bootstrap server of the `hybridkv` backend.

Built on SGLang's Common* layer (HTTP bootstrap, ZMQ sockets, rank mapping,
KV_STATUS messages, timeouts, heartbeats); this module adds what that layer
leaves to a backend, and hybridkv's guarantees:

* layout: SGLang's `kv_data_ptrs`, Mamba `state_data_ptrs` and aux buffers are
  adopted as one buffer table; touching buffers share one NIXL registration;
* descriptors: per chunk, one descriptor per run of pages consecutive on both
  sides per buffer, neighbours merged again (SGLang's NIXL backend: one per
  page per layer buffer);
* fencing:
  - success covers every component: prefill reports Success for a room only
    after every handle of every chunk (KV, every state tensor, aux) is DONE,
    and decode only after every prefill rank it pulls from did (#39846);
  - failure never frees memory a write may still reach: a prefill rank
    settles all its handles before it reports Failed, and a decode receiver
    whose room failed after it published destinations reports Failed only
    once every prefill rank is quiet for that room (Success/Failed status or
    an explicit DRAINED answer to its ABORT), that rank is declared dead, or
    the drain deadline passed (#24527). On prefill, a sender reports its
    terminal state only when no chunk of the room is in flight, so source
    pages are not reused under an outbound read;
  - export: a chunk sent early waits on SGLang's event before reading.
Heterogeneous attention TP is refused at registration with a clear reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
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
from connectors.sglang.agent import NixlAgent, TransferState
from connectors.sglang.plan import build_plan, pair_buffers
from connectors.sglang.regions import BufferKind, BufferTable, MemKind, adopt_kv_args, registration_ranges
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


@dataclasses.dataclass
class _Peer:
    agent_name: str
    buffers: BufferTable
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
        # The agent and the buffer table must exist before the base class
        # registers to the bootstrap server: a decode may connect right after.
        self.mem = MemKind.DRAM if get_device().device == "cpu" else MemKind.VRAM
        self.buffers = adopt_kv_args(args, device_mem=self.mem, gpu_id=int(getattr(args, "gpu_id", 0) or 0))
        self.agent = NixlAgent(f"hybridkv-{uuid.uuid4().hex[:12]}")
        self.agent.register(registration_ranges(self.buffers))
        self.stats = TransferStats()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._inflight: dict[int, int] = defaultdict(int)
        self._inflight_lock = threading.Lock()
        self._drain_waiters: dict[int, set[tuple[str, int]]] = {}
        self._quiet: dict[int, set[int]] = {}
        self._dead_addrs: set[str] = set()
        self.peers: dict[str, _Peer] = {}
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.drain_timeout_s = float(getattr(self, "waiting_timeout", 300.0))
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
        with self._inflight_lock:
            return self._inflight.get(room, 0)

    def fingerprint(self) -> str:
        t = self.buffers
        shape = (t.kind, t.component.tolist(), t.layer.tolist(), t.item_len.tolist(), t.mem)
        return hashlib.sha256(repr(shape).encode()).hexdigest()[:16]

    # ------------------------------------------------------------ decode -> prefill messages
    def build_receiver_registration_message(self) -> list[bytes]:
        return msgs.Register(
            endpoint=self.local_ip, port=self.rank_port, agent_name=self.agent.name,
            agent_metadata=self.agent.metadata(), buffers=self.buffers.describe(),
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
        peer_buffers = BufferTable.from_description(reg.buffers)
        rejection = None
        if reg.attn_tp_size != self.attn_tp_size:
            rejection = (
                f"heterogeneous attention TP (prefill {self.attn_tp_size}, decode {reg.attn_tp_size}) "
                "is not supported by the hybridkv SGLang backend yet"
            )
        else:
            try:
                pair_buffers(self.buffers, peer_buffers, BufferKind.KV)
                for c in sorted(set(self.buffers.component[self.buffers.component >= 0].tolist())):
                    pair_buffers(self.buffers, peer_buffers, BufferKind.STATE, c)
            except ValueError as e:
                rejection = f"layouts do not match: {e}"
        name = self.agent.add_remote(reg.agent_metadata)
        if name != reg.agent_name:
            raise ValueError(f"agent metadata names {name!r} but the message says {reg.agent_name!r}")
        self.peers[name] = _Peer(agent_name=name, buffers=peer_buffers, rejection=rejection)
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
            with self._inflight_lock:
                self._drain_waiters.setdefault(room, set()).add((note.decode_ip, int(note.decode_port)))
        self._maybe_send_drained(room)

    def _maybe_send_drained(self, room: int) -> None:
        with self._inflight_lock:
            if self._inflight.get(room, 0) > 0:
                return
            waiters = self._drain_waiters.pop(room, None)
        frames = msgs.Drained(room=room, prefill_rank=self._prefill_unique_rank()).to_frames()
        for ip, port in waiters or ():
            na = NetworkAddress(ip, port)
            try:
                self._send_multipart_locked(na.to_tcp(), frames, is_ipv6=na.is_ipv6)
            except Exception as e:
                logger.warning("hybridkv: DRAINED for room %s to %s:%s failed: %s", room, ip, port, e)

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
        with self._inflight_lock:
            self._inflight[bootstrap_room] += 1
        self.update_status(bootstrap_room, KVPoll.Transferring)
        self._queues[bootstrap_room % len(self._queues)].put(
            _Chunk(room=bootstrap_room, kv_indices=np.asarray(kv_indices, dtype=np.int64), index_slice=index_slice,
                   is_last=is_last_chunk, aux_index=aux_index, state_indices=state_indices, wait_event=wait_event)
        )
        return None

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
                with self._inflight_lock:
                    self._inflight[chunk.room] -= 1
                    if self._inflight[chunk.room] <= 0:
                        del self._inflight[chunk.room]
                self._maybe_send_drained(chunk.room)

    def _plan_for(self, chunk: _Chunk, md: msgs.Metadata, peer: _Peer):
        dst_pages = md.kv_indices[chunk.index_slice]
        if len(dst_pages) != len(chunk.kv_indices):
            raise ValueError(
                f"room {chunk.room}: {len(chunk.kv_indices)} source pages for {len(dst_pages)} destination pages"
            )
        states = []
        if chunk.is_last and chunk.state_indices:
            for c, idx in enumerate(chunk.state_indices):
                if idx is None or len(idx) == 0:
                    continue
                if c >= len(md.state_indices) or md.state_indices[c] is None:
                    raise ValueError(f"room {chunk.room}: decode sent no destination for state component {c}")
                states.append((c, np.asarray(idx, dtype=np.int64).ravel(), md.state_indices[c]))
        aux = (int(chunk.aux_index), md.aux_index) if chunk.is_last else None
        if aux is not None and md.aux_index < 0:
            raise ValueError(f"room {chunk.room}: decode sent no aux index")
        return build_plan(self.buffers, peer.buffers, kv=(chunk.kv_indices, dst_pages), states=states, aux=aux)

    def _process(self, chunk: _Chunk) -> None:
        room = chunk.room
        status = self.request_status.get(room)
        infos = self.transfer_infos.get(room)
        if status is None or status == KVPoll.Failed or infos is None:
            return  # aborted or cleared: nothing is written for it
        if chunk.wait_event is not None and hasattr(chunk.wait_event, "synchronize"):
            chunk.wait_event.synchronize()  # export fence: source pages written
            if self.request_status.get(room) in (None, KVPoll.Failed):
                return  # aborted while the device was still writing the source
        self.update_status(room, KVPoll.Transferring)
        handles = []
        try:
            for md in list(infos.values()):
                if md.is_dummy:
                    continue
                peer = self.peers[md.agent_name]
                plan = self._plan_for(chunk, md, peer)
                for (smem, dmem), (src, dst) in plan.groups.items():
                    handles.append(self.agent.post_write(md.agent_name, src, smem, dst, dmem))
                self.stats.descriptors += plan.num_descriptors
                self.stats.bytes += plan.num_bytes
            self.stats.chunks += 1
            self.stats.handles += len(handles)
            self.stats.pages += len(chunk.kv_indices)
            failed = self._settle(handles)
            if failed:
                raise RuntimeError(f"NIXL reported an error for {failed} of {len(handles)} handles of room {room}")
        except Exception as e:
            stuck = self._settle(handles, count_stuck=True) if handles else 0
            if stuck < 0:
                # A write may still land: say nothing that lets decode reuse pages.
                self.record_failure(room, str(e))
                self.update_status(room, KVPoll.Failed)
                logger.error("hybridkv: room %s failed with a handle still running: %s", room, e)
            else:
                self.conclude_failure(bootstrap_room=room, failure_reason=f"hybridkv transfer failed: {e}")
            return
        finally:
            for h in handles:
                self.agent.release(h)
        if chunk.is_last:
            self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)
            self.transfer_infos.pop(room, None) if self.check_status(room) == KVPoll.Success else None

    def _settle(self, handles: list, *, count_stuck: bool = False) -> int:
        """Wait until no handle is PROC. Returns the number that failed, or -1 if one is stuck."""
        deadline = time.monotonic() + _SETTLE_TIMEOUT_S
        pending = list(handles)
        failed = 0
        while pending:
            still = []
            for h in pending:
                s = self.agent.state(h)
                if s == TransferState.PROC:
                    still.append(h)
                elif s == TransferState.ERR:
                    failed += 1
            pending = still
            if pending:
                if time.monotonic() > deadline:
                    return -1
                time.sleep(0.0005)
        return failed

    # ------------------------------------------------------------ decode side
    def _decode_listener_loop(self) -> None:
        for frames in self._recv():
            try:
                if frames and frames[0] == msgs.TAG:
                    kind, m = msgs.decode(frames)
                    if kind is not msgs.MsgType.DRAINED:
                        raise ValueError(f"decode got a {kind.value} message")
                    d = msgs.Drained.parse(m)
                    self._note_quiet(d.room, d.prefill_rank)
                    continue
                if self.handle_abort_ack_message(frames):
                    continue
                parsed = self.parse_kv_status_message(frames)
                if parsed is None:
                    raise ValueError(f"unknown message tag {frames[0][:16]!r}")
                room, status, rank, reason = parsed
                if status in (KVPoll.Success, KVPoll.Failed):
                    self._note_quiet(room, rank)
                self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank,
                                          failure_reason=reason)
            except Exception:
                logger.exception("hybridkv: dropped a decode-side message")

    def _note_quiet(self, room: int, rank: int) -> None:
        with self._inflight_lock:
            if room in self._quiet:
                self._quiet[room].add(rank)

    def _handle_node_failure(self, failed_bootstrap_addr: str):
        with self._inflight_lock:
            self._dead_addrs.add(failed_bootstrap_addr)
        super()._handle_node_failure(failed_bootstrap_addr)

    def _on_heartbeat_success(self, bootstrap_addr: str):
        with self._inflight_lock:
            self._dead_addrs.discard(bootstrap_addr)

    def is_quiet(self, room: int, bootstrap_addr: str, expected: int) -> bool:
        with self._inflight_lock:
            if bootstrap_addr in self._dead_addrs:
                return True
            return len(self._quiet.get(room, ())) >= expected


class HybridKVSender(CommonKVSender):
    kv_mgr: HybridKVManager

    def poll(self) -> KVPoll:
        status = super().poll()
        if status in (KVPoll.Success, KVPoll.Failed) and self.kv_mgr.inflight(self.bootstrap_room) > 0:
            # The scheduler frees source pages on a terminal state; an
            # outbound read of them is still running.
            return KVPoll.Transferring
        return status


class HybridKVReceiver(CommonKVReceiver):
    kv_mgr: HybridKVManager

    def __init__(self, mgr: HybridKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None):
        self._published = False
        self._drain_since: Optional[float] = None
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        with mgr._inflight_lock:
            mgr._quiet[bootstrap_room] = set()

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None, **kwargs):
        # From the first attempt on, some prefill rank may hold our destinations.
        self._published = self.bootstrap_infos is not None
        return super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, **kwargs)

    def _writers_expected(self) -> int:
        return sum(1 for info in (self.bootstrap_infos or []) if not info.get("is_dummy"))

    def poll(self) -> KVPoll:
        status = super().poll()
        if status != KVPoll.Failed or not self._published:
            return status
        if self.kv_mgr.is_quiet(self.bootstrap_room, self.bootstrap_addr, self._writers_expected()):
            return KVPoll.Failed
        # Ask the prefill ranks to stop and to say when nothing is in flight.
        self.ensure_abort_notified()
        now = time.monotonic()
        if self._drain_since is None:
            self._drain_since = now
        if now - self._drain_since >= self.kv_mgr.drain_timeout_s:
            logger.error("hybridkv: room %s released after %.0fs without a drain answer",
                         self.bootstrap_room, now - self._drain_since)
            return KVPoll.Failed
        return KVPoll.Transferring

    def clear(self) -> None:
        super().clear()
        with self.kv_mgr._inflight_lock:
            self.kv_mgr._quiet.pop(self.bootstrap_room, None)


class HybridKVBootstrapServer(CommonKVBootstrapServer):
    pass
