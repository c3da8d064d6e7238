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
* NIXL: hybridkv's `DataPlane` registers the Layout's regions once and posts
  each chunk's plans as WRITEs (rows, one NIXL handle per pair of memory kinds);
* fencing: a `hybridkv.fencing.scheduler.TransferScheduler` per manager over the
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
    destinations are published. At decode TP > 1 SGLang MIN-reduces the ranks'
    polls, so one rank's Failed fails the request on every rank while another
    rank's write may still land: the manager opts into SGLang's deferred decode
    KV release, which holds the request's pages on every rank until each rank's
    `is_abort_release_safe` (the scheduler: no import of the room in flight)
    says so (decode_side.py);
  - prefill: each chunk is an export (`post_export`, lease renewed per chunk)
    whose reads are terminal only once every handle settled; a sender reports
    its terminal state only after the scheduler dropped the request, i.e. when
    no read of its source pages is queued or running. The control thread
    expires leases (`poll`); a chunk's WRITEs are bounded by
    `transfer_timeout_s` and the lease, then aborted, or quarantined where NIXL
    will not abort them (prefill_side.py).
Heterogeneous attention TP (prefill TP != decode TP, KV heads and GDN heads):
the planners come from hybridkv.connectors/sglang/pairing.py, which keys every byte
range of SGLang's buffers by what it holds (head, state dims) and lets the
descriptor compiler pair the decode rank's slice with the prefill ranks that
hold it, each field written by one prefill rank only. A pair that cannot match
is refused at registration, naming the values.
Authentication (with HYBRIDKV_SGLANG_SECRET_FILE / _SECRET_ENV): a decode rank
proves the shared secret to each prefill rank before its REGISTER, and every
message after that, both ways, is sealed to that session (sessions.py); the
prefill adds NIXL agents, takes METADATA and ABORTs, and pushes statuses only
within proven sessions, and binds each room to the decode agent that claimed it.
A decode agent whose session ended leaves NIXL once its rooms' writes are over, and
those rooms fail (retiring.py).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections import OrderedDict, defaultdict
from typing import Optional

import numpy as np
import zmq

from hybridkv.connectors.sglang import messages as msgs
from hybridkv.connectors.sglang import startup
from hybridkv.connectors.sglang.adopt import AdoptedLayout, adopt_kv_args, from_peer, parallel_of
from hybridkv.connectors.sglang.config import SGLangConfig
from hybridkv.connectors.sglang.decode_side import DecodeImports, _Import
from hybridkv.connectors.sglang.metrics import HybridKVSGLangMetrics
from hybridkv.connectors.sglang.pairing import PeerPlan, plan_peer
from hybridkv.connectors.sglang.peer_auth import PeerAuth
from hybridkv.connectors.sglang.prefill_side import PrefillExports, TransferStats
from hybridkv.connectors.sglang.retiring import RetiringAgents
from hybridkv.connectors.sglang.sessions import AuthProbe, AuthStats, DecodeKeys, PrefillGate, Session
from hybridkv.descriptors.compiler import TransferPlanner
from hybridkv.layout.alloc import MemKind
from hybridkv.transport.dataplane import DataPlane
from hybridkv.transport.metrics import TransferMetrics
from hybridkv.fencing.request_state import Component
from hybridkv.fencing.scheduler import TransferScheduler
from hybridkv.ids import RequestId, TransferId
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_device, get_parallel, linear_attn_tp_size
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.network import NetworkAddress

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Peer:
    agent_name: str
    layout: AdoptedLayout
    planners: dict[Component, Optional[TransferPlanner]]  # None: another prefill rank writes these fields
    plan: Optional[PeerPlan]
    rejection: Optional[str]


class HybridKVManager(PrefillExports, RetiringAgents, DecodeImports, PeerAuth, CommonKVManager):
    kv_status_msg_tag = b"KV_STATUS"
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True
    # SGLang's deferred decode KV release (decode.py, DecodeTransferQueue): a request
    # that fails on any decode TP rank (polls are MIN-reduced) is held on every rank
    # until each rank's is_abort_release_safe() says no write can land (decode_side.py),
    # instead of its pages going back to the allocator at once.
    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: Optional[bool] = False,
    ):
        # Layout, agent and scheduler exist before the base class registers to
        # the bootstrap server: a decode may connect right after.
        self.config = SGLangConfig.from_server_args(server_args)
        par = get_parallel()
        decode = disaggregation_mode == DisaggregationMode.DECODE
        # Read before anything is bound: a secret that cannot be read stops the server here.
        secret = self.config.secret()
        if secret is None:
            logger.warning(
                "hybridkv: no shared secret (HYBRIDKV_SGLANG_SECRET_FILE or HYBRIDKV_SGLANG_SECRET_ENV): this %s rank "
                "accepts REGISTER/METADATA/ABORT from any process that reaches its ZMQ port, which can then have KV "
                "written into memory it controls; unauthenticated mode is for a lab only",
                "decode" if decode else "prefill")
        #: what the authentication let in and dropped (sessions.py)
        self.auth_stats = AuthStats()
        self.gate: Optional[PrefillGate] = None
        self.keys: Optional[DecodeKeys] = None
        self.probe: Optional[AuthProbe] = None  # decode without a secret: which prefill ranks require one
        self._auth_required: set[tuple[str, int]] = set()  # prefill ranks that answered a probe
        # decode: the prefill ranks (ip, port) each room's receiver expects to hear from, oldest first
        self._room_writers: OrderedDict[int, frozenset[tuple[str, int]]] = OrderedDict()
        # Refused or settled before anything is registered or bound (startup.py).
        startup.check_parallel(pp_size=par.pp_size, attn_cp_size=par.attn_cp_size,
                               role="decode" if decode else "prefill")
        startup.check_state_types(getattr(args, "state_types", None))
        self.drain_timeout_s = startup.drain_timeout(
            self.config, decode=decode, waiting_timeout=envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get(),
            deferred_release=bool(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()
                                  and self.supports_deferred_decode_kv_release),
            deferred_timeout=envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get(),
            attn_tp_size=par.attn_tp_size)
        self.mem = MemKind.DRAM if get_device().device == "cpu" else MemKind.VRAM
        self.adopted = adopt_kv_args(
            args, device_mem=self.mem, gpu_id=int(getattr(args, "gpu_id", 0) or 0),
            parallel=parallel_of(args, attn_tp=par.attn_tp_size, attn_rank=par.attn_tp_rank,
                                 state_tp=linear_attn_tp_size(), mla=bool(is_mla_backend)))
        self.dp = DataPlane(self.adopted.memory, self.config.dataplane())
        self.stats = TransferStats()
        #: what moved, failed and was quarantined; the control thread observes it into the
        #: sglang:hybridkv_* series (metrics.py) and starts over
        self.metrics = TransferMetrics()
        try:
            self.prom: Optional[HybridKVSGLangMetrics] = HybridKVSGLangMetrics({
                "model_name": server_args.served_model_name or server_args.model_path,
                "engine_type": DisaggregationMode.to_engine_type(disaggregation_mode.value),
                "tp_rank": par.attn_tp_rank})
        except ImportError as e:  # sglang requires prometheus-client; a stripped install may lack it
            logger.warning("hybridkv: no sglang:hybridkv_* metrics (%s); pip install prometheus-client", e)
            self.prom = None
        self._room_bytes: dict[int, int] = {}  # prefill: bytes this rank wrote per room (get_transfer_metric)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # The scheduler is not thread-safe: SGLang's thread, the workers, the
        # listener and the heartbeat thread all take this lock around it.
        self.sched_lock = threading.RLock()
        self._inflight: dict[int, int] = defaultdict(int)  # prefill: chunks queued or being written
        self._exports: dict[int, set[TransferId]] = defaultdict(set)  # prefill: outbound reads in flight
        self._imports: dict[int, _Import] = {}  # decode
        self._drain_waiters: dict[int, set[tuple[str, int]]] = {}
        self._init_retiring()  # prefill: decode agents whose session ended (retiring.py)
        self._held_since: dict[int, float] = {}  # decode: rooms SGLang holds for a deferred release
        self._stuck: dict[TransferId, object] = {}  # prefill: reads whose WRITEs NIXL would not abort
        self.transfer_timeout_s = self.config.transfer_timeout_s  # an attribute: tests shorten it
        #: blocks the engine handed back that the scheduler does not yet let it reuse: (group, block)
        self.fenced: set[tuple[int, int]] = set()
        self.peers: dict[str, _Peer] = {}
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if secret is not None:
            self._start_auth(secret, decode=decode)
        elif decode:
            self.probe = AuthProbe(local=(self.local_ip, int(self.rank_port)), send=self._push_to_prefill,
                                   stats=self.auth_stats)
        self.sched = TransferScheduler(self.adopted.pool_layout(), managed_pool=False,
                                       lease_s=self.config.lease_s(self.drain_timeout_s))
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._queues = [queue.Queue() for _ in range(self.config.workers)]
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
        self.dp.close()
        if getattr(self, "_reply_socks", None) is not None:
            self._reply_socks.close()
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
            endpoint=self.local_ip, port=self.rank_port, agent_name=self.dp.name, agent_metadata=self.dp.metadata(),
            layout=self.adopted.peer_view(),
            attn_tp_size=self.attn_tp_size, attn_tp_rank=self.attn_tp_rank,
            state_types=self.adopted.state_types,
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
            room=int(bootstrap_room), endpoint=self.local_ip, port=self.rank_port, agent_name=self.dp.name,
            kv_indices=np.asarray(kv_indices if not is_dummy else [], dtype=np.int32),
            aux_index=int(aux_index if aux_index is not None else -1),
            state_indices=states if not is_dummy else (),
            required_dst_info_num=int(required_dst_info_num), decode_prefix_len=int(decode_prefix_len or 0),
            is_dummy=bool(is_dummy),
        ).to_frames()

    # ------------------------------------------------------------ prefill side
    def _recv(self, tick=None):
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(int(self.config.poll_interval_s * 1000)):
                yield self.server_socket.recv_multipart()
            if tick is not None:
                try:
                    tick()
                except Exception:
                    logger.exception("hybridkv: periodic check failed")
            self.publish_metrics()

    def publish_metrics(self) -> None:
        """Observe what was counted since the last call into the sglang:hybridkv_* series."""
        snap = self.metrics.take()
        if self.prom is not None and not snap.is_empty():
            self.prom.observe(snap)

    def _prefill_control_loop(self) -> None:
        for frames in self._recv(tick=self.tick):
            try:
                got = self._unproven_message(frames)
                if got is None:
                    continue
                session, frames = got
                if frames and frames[0] == ABORT_TAG:
                    self._on_abort(frames, session)
                elif frames and frames[0] == msgs.TAG:
                    m = msgs.decode(frames)
                    if isinstance(m, msgs.Register):
                        self._on_register(m, session)
                    elif isinstance(m, msgs.Metadata):
                        self._on_metadata(m, session)
                    else:
                        raise ValueError(f"prefill got a {type(m).__name__} message")
                else:
                    raise ValueError(f"unknown control message tag {frames[0][:16]!r}")
            except Exception:
                logger.exception("hybridkv: dropped a control message")

    def _on_register(self, reg: msgs.Register, session: Optional[Session] = None) -> None:
        if session is not None:
            owner = self.gate.agent_owner(reg.agent_name)
            if (reg.endpoint, reg.port) != session.peer:
                return self._foreign(session, f"REGISTER names another address ({reg.endpoint}:{reg.port})")
            if owner is not None and owner is not session and owner.peer != session.peer:
                return self._foreign(session, f"REGISTER names agent {reg.agent_name!r}, registered by another peer")
        peer_layout = from_peer(reg.layout)
        rejection = None
        plan = None
        mine = self.adopted.parallel
        try:
            theirs = peer_layout.parallel
            if (reg.attn_tp_size, reg.attn_tp_rank) != (theirs.attn_tp, theirs.attn_rank):
                raise ValueError(f"the message says decode rank {reg.attn_tp_rank}/{reg.attn_tp_size}, its layout "
                                 f"{theirs.attn_rank}/{theirs.attn_tp}")
            if tuple(reg.state_types) != self.adopted.state_types:
                raise ValueError(f"state types {list(self.adopted.state_types)} on the prefill, "
                                 f"{list(reg.state_types)} on the decode; expected the same model")
            plan = plan_peer(self.adopted, peer_layout)
        except ValueError as e:
            rejection = (f"hybridkv cannot pair prefill rank {mine.attn_rank}/{mine.attn_tp} with decode rank "
                         f"{reg.attn_tp_rank}/{reg.attn_tp_size}: {e}")
        name = self.dp.add_peer(reg.agent_metadata, peer_layout.memory)
        if name != reg.agent_name:
            if name not in self.peers:
                self.dp.remove_peer(name)
            raise ValueError(f"agent metadata names {name!r} but the message says {reg.agent_name!r}")
        if session is not None:
            if session.agent is not None and session.agent != name:
                # The decode rank at that address restarted with another agent: the old one retires.
                self._retire_agent(session.agent, f"decode rank {reg.endpoint}:{reg.port} registered another "
                                                  f"NIXL agent ({name}); its previous one is removed")
            session.agent = name
        self.peers[name] = _Peer(agent_name=name, layout=peer_layout, planners=plan.planners if plan else {},
                                 plan=plan, rejection=rejection)
        if rejection:
            logger.error("hybridkv: decode %s refused: %s", name, rejection)

    def _on_metadata(self, md: msgs.Metadata, session: Optional[Session] = None) -> None:
        room = md.room
        if session is not None and not self._may_claim(md, session):
            return
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

    def _on_abort(self, frames: list[bytes], session: Optional[Session] = None) -> None:
        note = AbortNotification.from_zmq(frames)
        if note is None:
            return
        room = note.room
        if session is not None:
            if note.decode_ip is not None and (note.decode_ip, note.decode_port) != session.peer:
                return self._foreign(session, f"ABORT for room {room} names another address")
            claimed = self.transfer_infos.get(room)
            if claimed and session.agent not in claimed:
                self._foreign(session, f"ABORT for room {room}, claimed by another decode")
                # Answered as an unknown room is (DRAINED at once), so the answer tells nothing of the room.
                if note.decode_ip is not None:
                    frames = msgs.Drained(room=room, prefill_rank=self._prefill_unique_rank()).to_frames()
                    self._push(note.decode_ip, note.decode_port, frames, f"DRAINED for room {room}")
                return
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
            if not self._drained(room):
                return
            waiters = self._drain_waiters.pop(room, None)
            failed = self._fail_when_drained.pop(room, None)
        if failed is not None:
            self._tell_failed(room, failed)
        frames = msgs.Drained(room=room, prefill_rank=self._prefill_unique_rank()).to_frames()
        for ip, port in waiters or ():
            self._push(ip, port, frames, f"DRAINED for room {room}")

    def _push(self, ip: str, port: int, frames: list[bytes], what: str) -> None:
        na = NetworkAddress(ip, port)
        try:
            self._send_multipart_locked(na.to_tcp(), frames, is_ipv6=na.is_ipv6)
        except Exception as e:
            logger.warning("hybridkv: %s to %s:%s failed: %s", what, ip, port, e)



class HybridKVSender(CommonKVSender):
    kv_mgr: HybridKVManager

    _sent_bytes: Optional[int] = None

    def poll(self) -> KVPoll:
        status = super().poll()
        if status in (KVPoll.Success, KVPoll.Failed):
            self.kv_mgr.retire_export(self.bootstrap_room)
            sent = self.kv_mgr.take_room_bytes(self.bootstrap_room)
            if sent is not None:
                self._sent_bytes = (self._sent_bytes or 0) + sent
            if self.kv_mgr.exporting(self.bootstrap_room):
                # The scheduler frees source pages on a terminal state; an
                # outbound read of them is still queued or running.
                return KVPoll.Transferring
        return status

    def abort(self) -> None:
        super().abort()
        self.kv_mgr.retire_export(self.bootstrap_room)
        self.kv_mgr.take_room_bytes(self.bootstrap_room)

    def get_transfer_metric(self):
        """SGLang's KVTransferMetric, with the bytes this rank's WRITEs moved for the room (SGLang's
        own figure is pages x item sizes, which counts what hybridkv does not move, e.g. padding)."""
        metric = super().get_transfer_metric()
        if self._sent_bytes is not None:
            metric.transfer_total_bytes = self._sent_bytes
        return metric


class HybridKVBootstrapServer(CommonKVBootstrapServer):
    pass
