"""The worker half of HybridKVConnector: vLLM's KV tensors, adopted, moved over NIXL by hybridkv.transport.

Each vLLM worker (one TP rank) adopts the tensors vLLM hands to
``register_kv_caches`` into a hybridkv layout and runs a hybridkv transport
endpoint on a background asyncio thread: a :class:`~hybridkv.transport.endpoint.Producer`
listening on its own port on a prefill instance (``connectors/vllm/addressing.py``:
unique per DP engine and TP rank, reported with its incarnation to the scheduler
through vLLM's handshake metadata), a :class:`~hybridkv.transport.endpoint.Consumer`
dialing the producer rank(s) named in the request's ``kv_transfer_params`` on a
decode instance (both for ``kv_both``). A decode worker asks for a request as soon
as its engine queues it and renews its lease until it reads it; a producer that
answers at a known address under another incarnation (restarted) replaces the old
one, and requests naming a gone incarnation fail at once.
A consumer asks for the request it wants, so one prefill instance serves any
number of decode instances. Both endpoints get descriptors' planner, which alone
decides how blocks pair: whole pages where both sides cut them alike, field by
field for different TP sizes (either way, as NixlConnector's TP mapping) and
block sizes (descriptors/planning.py).

The *step* fencing happens in the scheduler process (scheduler_half): a load
order reaches this worker only once no in-flight step touches its blocks, an
export offer only once every step that wrote the blocks completed. The
worker-local :class:`~hybridkv.fencing.scheduler.TransferScheduler` the transport drives
keeps the transfer-level rules (transfers in flight, leases, failures).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from hybridkv.fencing.fence import PoolLayout
from hybridkv.fencing.request_state import Component
from hybridkv.errors import PeerError
from hybridkv.transport.allowlist import PeerAllowlist
from hybridkv.fencing.scheduler import TransferScheduler
from hybridkv.transport.metrics import MetricsSnapshot

from hybridkv.connectors.vllm.addressing import RankAddress, listen_port, resolve_host
from hybridkv.connectors.vllm.config import HybridKVVllmConfig
from hybridkv.connectors.vllm.metadata import (
    HybridKVConnectorMetadata,
    HybridKVHandshakeMetadata,
    HybridKVWorkerMetadata,
    RecvOrder,
)
from hybridkv.connectors.vllm.params import DECODE_HOSTS, RemotePrefill, claimants

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

#: How long a producer waits for its side-channel port at start-up (a restarted engine's
#: previous incarnation may still hold it for a moment).
PORT_WAIT_S = 30.0


class _RenewalsReported(TransferScheduler):
    """The worker-local scheduler, also telling the scheduler process which export
    leases a consumer renewed (its hold on the blocks must be renewed too)."""

    def __init__(self, *args: Any, on_renew, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_renew = on_renew

    def heartbeat(self, request):
        lease = super().heartbeat(request)
        if lease is not None:
            self._on_renew(str(request))
        return lease


def _tp_rank(cfg: HybridKVVllmConfig) -> int:
    if cfg.tp_rank is not None:
        return cfg.tp_rank
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, RuntimeError, ImportError):
        return 0  # no distributed group: a single worker


class RecentResults(OrderedDict):
    """The last ``limit`` entries only: a worker serves requests for ever, and a result nobody
    reads must not be kept for ever."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit = {limit}; expected >= 1")
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


#: How many load results a worker keeps for inspection (tests, an operator's debugger).
LOAD_RESULTS_KEPT = 1024


class WorkerHalf:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, engine_id: str) -> None:
        from hybridkv.connectors.vllm.specs import adopt_specs

        kvt = vllm_config.kv_transfer_config
        self.config = cfg = HybridKVVllmConfig.from_vllm_config(vllm_config)
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.engine_id = engine_id
        self.role = kvt.kv_role
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        self.rank = _tp_rank(cfg)
        self.host = cfg.side_channel_host
        self.base_port = cfg.side_channel_port
        self.dp_index = vllm_config.parallel_config.data_parallel_index
        #: The port this rank listens on when it produces: unique per DP engine and TP rank.
        self.port = listen_port(cfg.side_channel_port, dp_index=self.dp_index, tp_size=self.tp, tp_rank=self.rank)
        self.lease_s = cfg.kv_lease_duration
        self.export_timeout_s = cfg.export_timeout_s
        self.allowed_peers = cfg.allowed_peers  # checked by the config: a bad entry fails at startup, named
        # Which producers this decode dials: never simply what a request body names (a client can set it).
        self.allowed_producers = PeerAllowlist.parse(cfg.allowed_producers) if cfg.allowed_producers else None
        if self.allowed_producers is None and self.role in ("kv_consumer", "kv_both"):
            log.warning("hybridkv decode dials any producer a request's kv_transfer_params name (a client can put "
                        "them in its request body); set kv_connector_extra_config['allowed_producers'] to the "
                        "prefill workers' addresses or networks")
        self.secret = cfg.secret()  # read once, here: a missing file or variable fails at start-up, named
        self.transfer_groups = tuple(kv_cache_config.transfer_group_ids)
        #: what vLLM's KVCacheConfig holds, as hybridkv moves it; a cache it cannot move is refused here,
        #: before vLLM allocates the tensors (specs.py names the layer and why)
        self.specs = adopt_specs(vllm_config, kv_cache_config, tp=self.tp)
        # Each group's separately-arriving pieces are its kind's (attention KV; GDN conv and SSM; a state).
        self.components = tuple(Component(group=g.group_id, kind=c) for g in self.specs.groups
                                for c in self.specs.geometry.layers[g.layer_indices[0]].components)
        self.layout = None
        self.memory = None
        self._step = -1
        self._lock = threading.Lock()
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        self._sending: set[str] = set()
        self._renewed: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ts: TransferScheduler | None = None
        self._producer = None
        self._consumer = None  # one per worker: one NIXL agent, connected to every producer rank it reads
        self._agents: dict[tuple[str, int], str] = {}  # (host, port) -> producer agent (incarnation) there
        self._connecting: dict[tuple[str, int], asyncio.Future] = {}
        self._gone: dict[str, None] = {}  # incarnations replaced at their address or found dead (bounded)
        self._intents: dict[str, Future] = {}  # request -> its early ask (leases from arrival)
        self.listen_port: int | None = None
        #: request -> the transport's result of its load (descriptors posted, bytes, seconds); the
        #: latest LOAD_RESULTS_KEPT only. The metrics (get_kv_connector_stats) count every load.
        self.load_results: RecentResults = RecentResults(LOAD_RESULTS_KEPT)
        #: request -> why its load failed (a handshake refusal names the difference); the latest only
        self.load_errors: RecentResults = RecentResults(LOAD_RESULTS_KEPT)

    # ------------------------------------------------------------ registration
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from hybridkv.transport.memory import from_layout

        from hybridkv.connectors.vllm.layout_adopt import adopt_vllm_kv_caches

        self.layout = adopt_vllm_kv_caches(self.vllm_config, self.kv_cache_config, kv_caches, tp=self.tp,
                                           rank=self.rank, specs=self.specs)
        self.memory = from_layout(self.layout)
        # Before any thread or endpoint: named as this connector's key (the transport checks it again, by its name)
        from hybridkv import wire
        from hybridkv.transport.host_memory import check_host_memory

        check_host_memory(authenticated=self.secret is not None,
                          host_memory=any(r.mem is wire.Mem.DRAM for r in self.memory.regions),
                          accepted=self.config.insecure_host_memory, what="HybridKVConnector",
                          opt_in="kv_connector_extra_config 'insecure_host_memory': true")
        groups = len(self.kv_cache_config.kv_cache_groups)
        self._ts = _RenewalsReported(
            PoolLayout.shared(num_blocks=self.kv_cache_config.num_blocks, num_groups=groups),
            managed_pool=False, lease_s=self.lease_s, on_renew=self._record_renewal)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hybridkv-transport", daemon=True)
        self._thread.start()
        if self.role in ("kv_producer", "kv_both"):
            self._call(self._start_producer()).result()

    def _config(self, port: int = 0):
        from hybridkv.transport.dataplane import DataPlaneConfig
        from hybridkv.transport.endpoint import FailurePolicy, TransportConfig

        # vLLM applies kv_load_failure_policy itself; the transport only reports.
        from hybridkv.connectors.vllm.specs import compat_fields

        # The address consumers dial (protocol 3 binds it into the proofs): "auto" resolved, as advertised.
        return TransportConfig(host=resolve_host(self.host), port=port, failure_policy=FailurePolicy.FAIL,
                               export_timeout_s=self.export_timeout_s, allowed_peers=self.allowed_peers,
                               secret=self.secret, insecure_no_auth=self.config.insecure_no_auth,
                               insecure_host_memory=self.config.insecure_host_memory,
                               compat=compat_fields(self.vllm_config),
                               dataplane=DataPlaneConfig(prime=self.config.prime_reads))

    @staticmethod
    def _planner():
        from hybridkv.transport.endpoint import Pairing

        from hybridkv.descriptors.planning import DescriptorPlanner

        # Pairing by fields lets a decode instance of another TP size or block size read (the
        # handshake carries each side's field tables); the planner still pairs whole pages
        # wherever both sides cut them alike. It alone decides, per set of producer ranks.
        return DescriptorPlanner(pairing=Pairing.FIELDS)

    async def _start_producer(self) -> None:
        from hybridkv.transport.endpoint import Producer

        self._producer = Producer(self.memory, self._ts, self._config(self.port), planner=self._planner(),
                                  staging=self.config.staging_config())
        # A restarted engine may find its port still held for a moment (the previous incarnation's
        # connections closing): wait for it rather than fail start-up, within a bound.
        deadline = time.monotonic() + PORT_WAIT_S
        while True:
            try:
                _, self.listen_port = await self._producer.start()
                break
            except Exception as exc:  # ucxx.UCXXBusyError; ucxx is imported by the transport only
                if "Busy" not in type(exc).__name__ or time.monotonic() > deadline:
                    raise RuntimeError(f"HybridKVConnector cannot listen on side-channel port {self.port} "
                                       f"(TP rank {self.rank} of DP engine {self.dp_index}): {exc}") from exc
                log.warning("side-channel port %d is busy; retrying for up to %.0f s", self.port, PORT_WAIT_S)
                await asyncio.sleep(0.5)
        self.advertised = RankAddress(host=resolve_host(self.host), port=self.listen_port,
                                      agent=self._producer.dp.name)

    def _call(self, coro) -> Future:
        if self._loop is None:
            raise RuntimeError("register_kv_caches was never called on this worker")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # ------------------------------------------------------------ per step
    def start_step(self, meta: HybridKVConnectorMetadata) -> None:
        self._step = meta.step
        for rid, remote in meta.heartbeats.items():
            self._intents[rid] = self._call(self._intend(rid, remote))
        for rid, remote in meta.releases.items():
            self._call(self._release(rid, remote))
        for order in meta.recvs:
            self._call(self._load(order))
        for rid, why in meta.refused.items():  # never started: failed at once (kv_load_failure_policy)
            self.load_errors[rid] = why
            with self._lock:
                self._recving.add(rid)
                self._failed.add(rid)
        for rid, blocks in meta.exports_ready.items():
            self._call(self._export(rid, blocks, meta.capabilities[rid], meta.decode_hosts.get(rid)))

    async def _agent_for(self, address: RankAddress) -> str:
        """The producer agent at the address, dialled once (concurrent loads share the dial) and
        again when its connection died or a request names another incarnation there. Raises
        PeerError at once when the incarnation the request names is gone."""
        from hybridkv.transport.endpoint import Consumer

        key = (address.host, address.port)
        want = address.agent
        if self.allowed_producers is not None and not self.allowed_producers.allows(address.host):
            raise PeerError(f"producer address {address.host}:{address.port} is not in allowed_producers; "
                            "not dialled (a request's kv_transfer_params name it)")
        if want is not None and want in self._gone:
            raise PeerError(f"producer {want} at {address.host}:{address.port} is gone (restarted or stopped); "
                            f"this request was prefilled by it")
        if self._consumer is None:
            self._consumer = Consumer(self.memory, self._ts, self._config(), planner=self._planner(),
                                      staging=self.config.staging_config())
        current = self._agents.get(key)
        if current is not None and self._consumer.alive(current) and want in (None, current):
            return current
        agent = await self._dial(key)
        if want is not None and agent != want:
            _remember(self._gone, want)
            raise PeerError(f"producer at {address.host}:{address.port} is now {agent}; this request names {want}, "
                            "an earlier incarnation (restarted): its blocks are gone")
        return agent

    async def _dial(self, key: tuple[str, int]) -> str:
        pending = self._connecting.get(key)
        if pending is not None:
            return await pending
        pending = asyncio.get_running_loop().create_future()
        self._connecting[key] = pending
        try:
            old = self._agents.pop(key, None)
            if old is not None and not self._consumer.alive(old):
                await self._consumer.forget(old)  # NIXL drops its agent; a new one may answer there
            agent = await self._consumer.connect(*key)
            if old is not None and old != agent:
                # Another incarnation answers at this address: the old one is gone for good.
                _remember(self._gone, old)
                await self._consumer.forget(old)
                log.warning("hybridkv: producer at %s:%d restarted (%s -> %s); loads naming %s fail", *key, old,
                            agent, old)
            self._agents[key] = agent
        except Exception as exc:
            pending.set_exception(exc)
            pending.exception()  # consumed here; waiters re-raise it
            raise
        finally:
            del self._connecting[key]
        pending.set_result(agent)
        return agent

    async def _producer_agents(self, remote: RemotePrefill) -> tuple[tuple[str, ...], int]:
        from hybridkv.descriptors.planning import source_ranks

        # Which producer ranks hold this rank's heads, and how many decode ranks share each.
        ranks, readers = source_ranks(self.tp, self.rank, remote.tp_size)
        return tuple([await self._agent_for(remote.rank_address(r)) for r in ranks]), readers

    async def _intend(self, rid: str, remote: RemotePrefill) -> None:
        """The engine queued the request: ask its producer rank(s) for it now, so their leases are
        renewed while it waits for room here (the Export comes ahead; heartbeats renew it)."""
        try:
            agents, readers = await self._producer_agents(remote)
            for agent in agents:
                await self._consumer.want(remote.request_id, token=remote.token, peer=agent, readers=readers)
        except Exception as exc:  # the load, when it comes, fails and says why
            log.debug("hybridkv: early ask for %s (remote %s) failed: %s", rid, remote.request_id, exc)

    async def _release(self, rid: str, remote: RemotePrefill) -> None:
        """The engine will not read the request (aborted while queued, or nothing to load):
        tell its producer rank(s), which free the blocks now rather than after the lease."""
        asked = self._intents.pop(rid, None)
        if asked is not None:
            await asyncio.wrap_future(asked)  # its Want goes out before the release
        try:
            agents, _ = await self._producer_agents(remote)
            for agent in agents:
                await self._consumer.release(remote.request_id, token=remote.token, peer=agent)
        except Exception as exc:  # the producer is gone: nothing of it to free
            log.debug("hybridkv: release of %s (remote %s) not delivered: %s", rid, remote.request_id, exc)

    async def _load(self, order: RecvOrder) -> None:
        from hybridkv.transport.endpoint import Outcome

        rid, remote = order.request_id, order.remote
        prid = remote.request_id
        self._intents.pop(rid, None)  # its early ask (if any) is the fetch's ask
        ok, error = False, None
        try:
            agents, readers = await self._producer_agents(remote)
            self._ts.add_request(prid, expect=self.components)
            for g, ids in zip(self.transfer_groups, order.local_block_ids):
                self._ts.assign(prid, g, ids)
            result = await self._consumer.fetch(prid, self.components, token=remote.token, peers=agents,
                                                readers=readers)
            self.load_results[rid] = result
            ok, error = result.outcome is Outcome.READY, result.error
            if not ok and self._consumer.settling(prid):
                # A READ NIXL would not abort may still write the blocks: reported finished (and
                # failed), vLLM would free them now. It hears of the load only once the READ ended.
                log.warning("hybridkv load of %s failed, but its READ could not be aborted: holding the blocks "
                            "until it ends", rid)
                await self._consumer.settled(prid)
        except Exception as exc:  # handshake refused, peer lost, bad block lists, TP sizes that do not divide
            error = f"{type(exc).__name__}: {exc}"
        finally:
            if self._ts.has_request(prid):
                # Landed (READY) or given up: vLLM owns the blocks again.
                self._ts.abort(prid)
            self._ts.take_reusable()
        if not ok:
            self.load_errors[rid] = error
            log.warning("hybridkv load of %s (remote %s) failed: %s", rid, prid, error)
        with self._lock:
            self._recving.add(rid)  # vLLM expects failed loads in finished_recving too
            if not ok:
                self._failed.add(rid)

    async def _export(self, rid: str, blocks, token: bytes, decode_hosts: list[str] | None = None) -> None:
        ts = self._ts
        try:
            ts.add_request(rid)
            for g, ids in zip(self.transfer_groups, blocks):
                ts.assign(rid, g, ids)
            ts.request_finished(rid, export=True)
            # Whichever decode rank(s) ask for it (wire.Want) read it; the lease bounds the wait.
            # decode_hosts: only a session from those networks may claim it (checked by the scheduler half).
            bound = claimants({DECODE_HOSTS: decode_hosts}) if decode_hosts else None
            result = await self._producer.export(rid, token=token, claimants=bound)
            log.debug("hybridkv export of %s: %s (%s)", rid, result.outcome.value, result.error)
        except Exception as exc:
            log.warning("hybridkv export of %s failed: %s", rid, exc)
            ts.abort(rid)
        finally:
            ts.take_reusable()
        with self._lock:
            self._sending.add(rid)

    # ------------------------------------------------------------ reports
    def transfer_results(self) -> KVConnectorTransferResults:
        with self._lock:
            out = KVConnectorTransferResults(finished_sending=self._sending, finished_recving=self._recving,
                                             failed_recving=self._failed)
            self._sending, self._recving, self._failed = set(), set(), set()
        return out

    def _record_renewal(self, rid: str) -> None:
        with self._lock:
            self._renewed.add(rid)

    def worker_meta(self) -> HybridKVWorkerMetadata:
        with self._lock:
            renewed, self._renewed = self._renewed, set()
        return HybridKVWorkerMetadata(step=self._step, renewed=renewed)

    def metrics_snapshot(self) -> MetricsSnapshot:
        """What this worker's transport counted since the last call (both endpoints)."""
        snap = MetricsSnapshot()
        for side in (self._consumer, self._producer):
            if side is not None:
                snap = snap.merge(side.metrics.take())
        return snap

    def handshake_metadata(self) -> HybridKVHandshakeMetadata | None:
        """A producer rank's address and incarnation, for the scheduler's kv_transfer_params (the
        transport itself handshakes on its own control channel). None on a consumer-only rank."""
        if self._producer is None:
            return None
        return HybridKVHandshakeMetadata(tp_rank=self.rank, address=self.advertised)

    def shutdown(self) -> None:
        """Close the transport within SHUTDOWN_S in all, and never raise: vLLM calls this while it tears
        the engine down, where an exception (a peer that never answers the close) stops the rest."""
        if self._loop is None:
            return

        async def close_all():
            if self._consumer is not None:
                await self._consumer.close()
            if self._producer is not None:
                await self._producer.close()

        deadline = time.monotonic() + SHUTDOWN_S
        closing = self._call(close_all())
        try:
            closing.result(timeout=SHUTDOWN_S)
        except Exception as exc:  # the bound passed (TimeoutError), or the close itself failed
            closing.cancel()
            log.warning("hybridkv worker shutdown: the transport did not close cleanly within %.0f s (%s: %s); "
                        "stopping it", SHUTDOWN_S, type(exc).__name__, exc)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
            self._loop = None


_GONE_REMEMBERED = 4096
#: The most shutdown() takes, the transport's close and its thread's stop together.
SHUTDOWN_S = 10.0


def _remember(seen: dict[str, None], agent: str) -> None:
    seen[agent] = None
    while len(seen) > _GONE_REMEMBERED:
        del seen[next(iter(seen))]
