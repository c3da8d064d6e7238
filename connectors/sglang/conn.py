"""The `hybridkv` backend's manager: SGLang's CommonKVManager, composed of hybridkv's parts.

SGLang's Common* layer keeps the HTTP bootstrap, the ZMQ sockets, the rank mapping, KV_STATUS,
timeouts and heartbeats; the manager adds what it leaves to a backend and runs the rest on hybridkv's
core, each part with its own state and given only what it uses:

* both roles: SGLang's buffers adopted as a Layout (adopt.py) registered once with NIXL (`DataPlane`),
  the fencing scheduler over SGLang's pools (fenced_blocks.py), SGLang's rooms (rooms.py), and the
  shared-secret sessions every control message is sealed in (peer_auth.py, sessions.py; routes on the
  bootstrap server are MACed: routes.py, bootstrap.py);
* prefill: REGISTER / METADATA / ABORT from decode ranks (registrations.py; planners per decode rank at
  any attention TP: pairing.py), chunks as fenced exports written by bounded WRITEs (prefill_side.py),
  DRAINED answers (drains.py), decode agents whose session ended (retiring.py); with staging on, KV at
  different attention TP packed into slots of a pool registered with the rest (staged_kv.py);
* decode: published destinations as fenced imports, released only once every writer drained or the
  drain deadline passed (decode_side.py), fed by what prefill ranks send (decode_inbox.py); with staging on,
  a slot per prefill rank of a room at different TP, unpacked before the room is ready (staged_kv.py). At decode
  TP > 1 the manager opts into SGLang's deferred decode KV release, so a request failed on one rank
  keeps its pages on every rank until each rank's imports allow it (`is_abort_release_safe`).

The manager runs the threads (workers and control loop on a prefill rank, listener on a decode rank),
hands received messages to the parts and answers SGLang's hooks through them.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import numpy as np
import zmq

from hybridkv.connectors.sglang import messages as msgs
from hybridkv.connectors.sglang import routes, startup
from hybridkv.connectors.sglang.adopt import adopt_kv_args, parallel_of, request_id
from hybridkv.connectors.sglang.config import SGLangConfig
from hybridkv.connectors.sglang.decode_inbox import DecodeInbox
from hybridkv.connectors.sglang.decode_side import DecodeImports
from hybridkv.connectors.sglang.drains import Drains
from hybridkv.connectors.sglang.fenced_blocks import FencedBlocks
from hybridkv.connectors.sglang.metrics import HybridKVSGLangMetrics, metrics_for_engine
from hybridkv.connectors.sglang.peer_auth import PeerAuth
from hybridkv.connectors.sglang.prefill_side import PrefillExports, TransferStats
from hybridkv.connectors.sglang.registrations import Peer, Registrations
from hybridkv.connectors.sglang.retiring import RetiringAgents
from hybridkv.connectors.sglang.rooms import Rooms
from hybridkv.connectors.sglang.decode_keys import DecodeKeys
from hybridkv.connectors.sglang.staged_kv import DecodeSlots, PrefillStaging
from hybridkv.connectors.sglang.sessions import AuthStats
from hybridkv import wire
from hybridkv.fencing.request_state import Component
from hybridkv.fencing.scheduler import TransferScheduler
from hybridkv.layout.alloc import MemKind
from hybridkv.transport.dataplane import DataPlane
from hybridkv.transport.host_memory import check_host_memory
from hybridkv.transport.metrics import TransferMetrics
from hybridkv.transport.staging import StagePool
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_device, get_parallel, linear_attn_tp_size
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class HybridKVManager(CommonKVManager):
    kv_status_msg_tag = b"KV_STATUS"
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True
    # SGLang's deferred decode KV release (decode.py, DecodeTransferQueue): a request
    # that fails on any decode TP rank (polls are MIN-reduced) is held on every rank
    # until each rank's is_abort_release_safe() says no write can land (decode_side.py),
    # instead of its pages going back to the allocator at once.
    supports_deferred_decode_kv_release = True

    #: prefill mode's parts (None on a decode rank)
    exports: Optional[PrefillExports] = None
    drains: Optional[Drains] = None
    retiring: Optional[RetiringAgents] = None
    registrations: Optional[Registrations] = None
    #: decode mode's part (None on a prefill rank)
    imports: Optional[DecodeImports] = None

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: Optional[bool] = False,
    ):
        # Layout and agent exist before the base class registers to the
        # bootstrap server: a decode may connect right after.
        self.config = SGLangConfig.from_server_args(server_args)
        par = get_parallel()
        decode = disaggregation_mode == DisaggregationMode.DECODE
        # Read before anything is bound: a secret that cannot be read stops the server here.
        secret = self.config.secret()
        if secret is None:
            logger.warning(
                "hybridkv: no shared secret (HYBRIDKV_SGLANG_SECRET_FILE or HYBRIDKV_SGLANG_SECRET_ENV)%s: this %s rank "
                "accepts REGISTER/METADATA/ABORT from any process that reaches its ZMQ port, which can then have KV "
                "written into memory it controls; unauthenticated mode is for a lab only",
                ", lab mode by name (HYBRIDKV_SGLANG_INSECURE_NO_AUTH)" if self.config.insecure_no_auth else "",
                "decode" if decode else "prefill")
        #: what the authentication let in and dropped (sessions.py)
        self.auth_stats = AuthStats()
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
            aux_roles=startup.aux_roles(args, server_args, sampling_mask=envs.SGLANG_ENABLE_DISAGG_SAMPLING_MASK.get()),
            parallel=parallel_of(args, attn_tp=par.attn_tp_size, attn_rank=par.attn_tp_rank,
                                 state_tp=linear_attn_tp_size(), mla=bool(is_mla_backend)))
        check_host_memory(authenticated=secret is not None,
                          host_memory=any(r.mem is wire.Mem.DRAM for r in self.adopted.memory.regions),
                          accepted=self.config.insecure_host_memory, what="SGLang backend",
                          opt_in="HYBRIDKV_SGLANG_INSECURE_HOST_MEMORY=1")
        # NIC binding and UCX threads as SGLang's NIXL backend takes them (config.py)
        plane = self.config.dataplane(prefill=not decode, ib_device=getattr(args, "ib_device", None),
                                      gpu_id=int(getattr(args, "gpu_id", 0) or 0))
        #: KV at different attention TP through staging slots (staged_kv.py): a pool registered with the rest
        self.staging_pool: Optional[StagePool] = None
        memory = self.adopted.memory
        staging = self.config.staging_config()
        if staging is not None:
            try:
                self.staging_pool = StagePool(memory, staging,
                                              mem=wire.Mem.VRAM if self.mem is MemKind.VRAM else wire.Mem.DRAM)
            except ValueError as e:
                raise ValueError(f"hybridkv: HYBRIDKV_SGLANG_STAGING={staging.mode.value}: {e}") from None
            memory = self.staging_pool.memory
        try:
            self.dp = DataPlane(memory, plane)
        except Exception as e:  # NIXL's own error names no setting (NIXL_ERR_BACKEND)
            raise RuntimeError(f"hybridkv: NIXL could not start its UCX backend with {dict(plane.ucx_params)} "
                               f"({type(e).__name__}: {e}); check --disaggregation-ib-device and "
                               "SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS") from e
        self.stats = TransferStats()
        #: what moved, failed and was quarantined; the control thread observes it into the
        #: sglang:hybridkv_* series (metrics.py) and starts over
        self.metrics = TransferMetrics()
        self.prom: Optional[HybridKVSGLangMetrics] = metrics_for_engine(
            model_name=server_args.served_model_name or server_args.model_path,
            engine_type=DisaggregationMode.to_engine_type(disaggregation_mode.value),
            tp_rank=par.tp_rank, dp_rank=par.dp_rank)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        #: the decode ranks registered here (prefill): their agents, layouts and planners
        self.peers: dict[str, Peer] = {}
        self._route_secret = secret  # a prefill rank's route is MACed under it (routes.py)
        if secret is not None and decode:
            routes.sign_dp_queries(secret)  # SGLang's decode asks /query_dp_ranks through the base class
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.rooms = Rooms(self)
        self.auth = PeerAuth(
            secret=secret, decode=decode, local=(self.local_ip, int(self.rank_port)), zmq_ctx=self._zmq_ctx,
            config=self.config, stats=self.auth_stats, rooms=self.rooms,
            retire_agent=lambda agent, reason: self.retiring.retire(agent, reason),
            forget_registration=self.forget_registration,
            settle=lambda room, reason: self.imports.settle_imports(room, reason))
        self.rooms.on_forget = self.auth.release_room  # a room whose claims go leaves its session's count
        self.blocks = FencedBlocks(TransferScheduler(self.adopted.pool_layout(), managed_pool=False,
                                                     lease_s=self.config.lease_s(self.drain_timeout_s)))
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._start_prefill()
        else:
            self._start_decode()

    def _start_prefill(self) -> None:
        self.exports = PrefillExports(
            blocks=self.blocks, rooms=self.rooms, adopted=self.adopted, dp=self.dp, peers=self.peers,
            config=self.config, metrics=self.metrics, stats=self.stats,
            on_settled=lambda room: self.drains.maybe_send(room),
            fail_room=lambda room, reason: self.drains.fail(room, reason), stop=self._stop,
            staging=None if self.staging_pool is None else PrefillStaging(self.staging_pool, self.blocks.lock))
        self.drains = Drains(rooms=self.rooms, drained=self.exports.drained, lock=self.blocks.lock)
        self.retiring = RetiringAgents(rooms=self.rooms, peers=self.peers, exports=self.exports, drains=self.drains,
                                       dp=self.dp, lock=self.blocks.lock)
        self.registrations = Registrations(
            adopted=self.adopted, dp=self.dp, peers=self.peers, rooms=self.rooms, auth=self.auth,
            exports=self.exports, drains=self.drains, retiring=self.retiring)
        for i in range(self.config.workers):
            self._spawn(self.exports.worker_loop, f"hybridkv-worker-{i}")
        self._spawn(self._prefill_control_loop, "hybridkv-control")

    def _start_decode(self) -> None:
        self.imports = DecodeImports(blocks=self.blocks, adopted=self.adopted, metrics=self.metrics,
                                     drain_timeout_s=self.drain_timeout_s,
                                     slots=None if self.staging_pool is None else DecodeSlots(self.adopted,
                                                                                               self.staging_pool))
        self.inbox = DecodeInbox(auth=self.auth, imports=self.imports, rooms=self.rooms)
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
        self.auth.close()
        for sock in list(self._socket_cache.values()) + list(self._monitor_cache.values()):
            sock.close(linger=0)
        self.server_socket.close(linger=0)

    # ------------------------------------------------------------ what tests and tools read
    @property
    def sched(self) -> TransferScheduler:
        return self.blocks.sched

    @property
    def sched_lock(self) -> threading.RLock:
        return self.blocks.lock

    @property
    def fenced(self) -> set[tuple[int, int]]:
        """Blocks the engine handed back that the scheduler does not yet let it reuse: (group, block)."""
        return self.blocks.fenced

    @property
    def keys(self) -> Optional[DecodeKeys]:
        return self.auth.keys

    def fingerprint(self) -> str:
        return self.adopted.layout.shape_fingerprint

    def inflight(self, room: int) -> int:
        """Prefill: the room's chunks queued or being written."""
        return self.exports.inflight(room) if self.exports is not None else 0

    def exporting(self, room: int) -> bool:
        """The scheduler still holds the room (prefill: a read of its source pages may be queued or running)."""
        with self.blocks.lock:
            return self.blocks.sched.has_request(request_id(room))

    def imports_in_flight(self, room: int) -> int:
        return self.imports.imports_in_flight(room) if self.imports is not None else 0

    def missing_components(self, room: int) -> list[Component]:
        """Decode: the room's components not landed."""
        return self.imports.missing_components(room) if self.imports is not None else []

    def publish_metrics(self) -> None:
        """Observe what was counted since the last call into the sglang:hybridkv_* series."""
        snap = self.metrics.take()
        if self.prom is not None and not snap.is_empty():
            self.prom.observe(snap)

    # ------------------------------------------------------------ SGLang's calls and hooks
    def add_transfer_request(
        self, bootstrap_room: int, kv_indices, index_slice: slice, is_last_chunk: bool,
        aux_index: Optional[int] = None, state_indices: Optional[list] = None, num_kv_tokens: Optional[int] = None,
        *, wait_event=None, indices_event=None, trace_ctx=None,
    ):
        if self.disaggregation_mode != DisaggregationMode.PREFILL:
            raise RuntimeError("add_transfer_request called on a decode manager")
        return self.exports.add_chunk(bootstrap_room, kv_indices, index_slice, is_last_chunk, aux_index,
                                      state_indices, wait_event)

    def build_receiver_registration_message(self) -> list[bytes]:
        return msgs.Register(
            endpoint=self.local_ip, port=self.rank_port, agent_name=self.dp.name, agent_metadata=self.dp.metadata(),
            layout=self.adopted.peer_view(),
            attn_tp_size=self.attn_tp_size, attn_tp_rank=self.attn_tp_rank,
            state_types=self.adopted.state_types,
            fingerprint=self.fingerprint(),
            staging_region=self.staging_pool.region if self.staging_pool is not None else None,
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
            is_dummy=bool(is_dummy), generation=self.imports.generation(int(bootstrap_room)),
            staging=self.imports.offers(int(bootstrap_room)) if not is_dummy else (),
        ).to_frames()

    def _register_topology_row(self, url: str, payload: dict) -> None:
        """SGLang's PUT /route of this prefill rank, with a secret MACed over a nonce of the server's
        (routes.py): no process without the secret can put another address in this rank's place."""
        if self._route_secret is not None:
            payload = routes.sign_route(self._route_secret, payload, routes.fetch_nonce(url))
        super()._register_topology_row(url, payload)

    def _room_notify_targets(self, bootstrap_room: int):
        infos = self.transfer_infos.get(bootstrap_room) or {}
        targets = []
        for md in list(infos.values()):
            if not md.is_dummy and (md.endpoint, md.port) not in targets:
                targets.append((md.endpoint, md.port))
        return targets

    def _send_multipart_locked(self, endpoint: str, parts: list[bytes], is_ipv6: bool = False):
        """Every push of this prefill rank (SGLang's KV_STATUS, LANDED, DRAINED, STUCK) goes sealed, and only
        to a decode rank that proved the secret."""
        if self.auth.gate is None:
            return super()._send_multipart_locked(endpoint, parts, is_ipv6=is_ipv6)
        session = self.auth.session_for(endpoint)
        if session is None:
            raise RuntimeError(f"no authenticated session with {endpoint}; nothing is sent to it")
        sock = self._connect(endpoint, is_ipv6=is_ipv6)
        with self._socket_send_locks[endpoint]:
            sock.send_multipart(session.seal(parts))  # sealed under the lock: sequence numbers leave in order

    def forget_registration(self, prefill: tuple[str, int]) -> None:
        """Decode: SGLang's cached registrations with that prefill rank go; the next request there registers again."""
        with self.connection_lock:
            for key in [k for k, infos in self.connection_pool.items()
                        if any((i["rank_ip"], int(i["rank_port"])) == prefill for i in infos or ())]:
                del self.connection_pool[key]

    # SGLang's deferred decode KV release and heartbeat (decode_side.py says how they hold the pages)
    def register_deferred_abort_room(self, bootstrap_room: int) -> Optional[int]:
        super().register_deferred_abort_room(bootstrap_room)  # SGLang's ACK tracker (hybridkv answers DRAINED)
        self.imports.hold(bootstrap_room)
        # What the ABORT carries: the import's generation (None: nothing published), which the prefill ranks
        # match with the room's METADATA (registrations.py)
        return self.imports.generation(bootstrap_room) or None

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        return self.imports.release_safe(bootstrap_room)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        super().clear_deferred_abort_state(bootstrap_room)
        self.imports.released(bootstrap_room)

    def _handle_node_failure(self, failed_bootstrap_addr: str):
        self.imports.writer_dead(failed_bootstrap_addr)
        super()._handle_node_failure(failed_bootstrap_addr)

    # ------------------------------------------------------------ the control threads
    def _recv(self, tick=None):
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(int(self.config.poll_interval_s * 1000)):
                frames = self.server_socket.recv_multipart(copy=False)
                # The sending connection's IP: a prefill answers a handshake only there (prefill_gate.PrefillGate)
                yield [f.bytes for f in frames], frames[0].get("Peer-Address")
            if tick is not None:
                try:
                    tick()
                except Exception:
                    logger.exception("hybridkv: periodic check failed")
            self.publish_metrics()

    def tick(self) -> None:
        """Prefill control thread, every loop: expire export leases, end stuck writes that settled, remove
        decode agents that retired once their writes are over (retiring.py)."""
        self.exports.expire_leases()
        self.exports.watch_stuck()
        self.retiring.reap()

    def _prefill_control_loop(self) -> None:
        for frames, source in self._recv(tick=self.tick):
            try:
                got = self.auth.open(frames, source)
                if got is not None:
                    self.registrations.on_message(*got)
            except Exception:
                logger.exception("hybridkv: dropped a control message")

    def _decode_listener_loop(self) -> None:
        for frames, source in self._recv(tick=self.imports.tick):
            try:
                got = self.auth.open(frames, source)
                if got is not None:
                    self.inbox.on_message(*got)
            except Exception:
                logger.exception("hybridkv: dropped a decode-side message")
