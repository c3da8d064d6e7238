"""The worker half of HybridKVConnector: vLLM's KV tensors, adopted, moved over NIXL by hybridkv.transport.

Each vLLM worker (one TP rank) adopts the tensors vLLM hands to
``register_kv_caches`` into a hybridkv layout and runs a hybridkv transport
endpoint on a background asyncio thread: a :class:`~hybridkv.transport.endpoint.Producer`
listening on ``side_channel_port + tp_rank`` on a prefill instance, a
:class:`~hybridkv.transport.endpoint.Consumer` dialing the producer rank(s) named in
the request's ``kv_transfer_params`` on a decode instance (both for ``kv_both``).
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
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from hybridkv.fencing.fence import PoolLayout
from hybridkv.fencing.request_state import Component, attention_component, gdn_components
from hybridkv.fencing.scheduler import TransferScheduler

from connectors.vllm.config import HybridKVVllmConfig
from connectors.vllm.metadata import HybridKVConnectorMetadata, HybridKVWorkerMetadata, RecvOrder

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


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


class WorkerHalf:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, engine_id: str) -> None:
        from vllm.v1.kv_cache_interface import MambaSpec

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
        self.lease_s = cfg.kv_lease_duration
        self.export_timeout_s = cfg.export_timeout_s
        self.allowed_peers = cfg.allowed_peers  # checked by the config: a bad entry fails at startup, named
        self.secret = cfg.secret()  # read once, here: a missing file or variable fails at start-up, named
        self.transfer_groups = tuple(kv_cache_config.transfer_group_ids)
        comps: list[Component] = []
        for g in self.transfer_groups:
            spec = kv_cache_config.kv_cache_groups[g].kv_cache_spec
            comps.extend(gdn_components(g) if isinstance(spec, MambaSpec) else (attention_component(g),))
        self.components = tuple(comps)
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
        self._agents: dict[tuple[str, int], str] = {}  # (host, port) -> producer agent
        self._connecting: dict[tuple[str, int], asyncio.Future] = {}
        self.listen_port: int | None = None
        #: request -> the transport's result of its load (descriptors posted, bytes, seconds)
        self.load_results: dict[str, Any] = {}

    # ------------------------------------------------------------ registration
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from hybridkv.transport.memory import from_layout

        from connectors.vllm.layout_adopt import adopt_vllm_kv_caches

        self.layout = adopt_vllm_kv_caches(self.vllm_config, self.kv_cache_config, kv_caches, tp=self.tp,
                                           rank=self.rank)
        self.memory = from_layout(self.layout)
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
        from hybridkv.transport.endpoint import FailurePolicy, TransportConfig

        # vLLM applies kv_load_failure_policy itself; the transport only reports.
        return TransportConfig(host=self.host, port=port, failure_policy=FailurePolicy.FAIL,
                               export_timeout_s=self.export_timeout_s, allowed_peers=self.allowed_peers,
                               secret=self.secret)

    @staticmethod
    def _planner():
        from hybridkv.transport.endpoint import Pairing

        from descriptors.planning import DescriptorPlanner

        # Pairing by fields lets a decode instance of another TP size or block size read (the
        # handshake carries each side's field tables); the planner still pairs whole pages
        # wherever both sides cut them alike. It alone decides, per set of producer ranks.
        return DescriptorPlanner(pairing=Pairing.FIELDS)

    async def _start_producer(self) -> None:
        from hybridkv.transport.endpoint import Producer

        self._producer = Producer(self.memory, self._ts, self._config(self.base_port + self.rank),
                                  planner=self._planner())
        _, self.listen_port = await self._producer.start()

    def _call(self, coro) -> Future:
        if self._loop is None:
            raise RuntimeError("register_kv_caches was never called on this worker")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # ------------------------------------------------------------ per step
    def start_step(self, meta: HybridKVConnectorMetadata) -> None:
        self._step = meta.step
        for order in meta.recvs:
            self._call(self._load(order))
        for rid, blocks in meta.exports_ready.items():
            self._call(self._export(rid, blocks, meta.capabilities[rid]))

    async def _agent_for(self, host: str, port: int) -> str:
        """The producer agent at host:port, dialled once (concurrent loads share the dial)."""
        from hybridkv.transport.endpoint import Consumer

        key = (host, port)
        if key in self._agents:
            return self._agents[key]
        if self._consumer is None:
            self._consumer = Consumer(self.memory, self._ts, self._config(), planner=self._planner())
        pending = self._connecting.get(key)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._connecting[key] = pending
            try:
                agent = await self._consumer.connect(host, port)
            except Exception as exc:
                del self._connecting[key]
                pending.set_exception(exc)
                pending.exception()  # consumed here; waiters re-raise it
                raise
            self._agents[key] = agent
            del self._connecting[key]
            pending.set_result(agent)
            return agent
        return await pending

    async def _load(self, order: RecvOrder) -> None:
        from hybridkv.transport.endpoint import Outcome

        from descriptors.planning import source_ranks

        rid, remote = order.request_id, order.remote
        prid = remote.request_id
        ok, error = False, None
        try:
            # Which producer ranks hold this rank's heads, and how many decode ranks share each.
            ranks, readers = source_ranks(self.tp, self.rank, remote.tp_size)
            agents = tuple([await self._agent_for(remote.host, remote.port + r) for r in ranks])
            self._ts.add_request(prid, expect=self.components)
            for g, ids in zip(self.transfer_groups, order.local_block_ids):
                self._ts.assign(prid, g, ids)
            result = await self._consumer.fetch(prid, self.components, token=remote.token, peers=agents,
                                                readers=readers)
            self.load_results[rid] = result
            ok, error = result.outcome is Outcome.READY, result.error
        except Exception as exc:  # handshake refused, peer lost, bad block lists, TP sizes that do not divide
            error = f"{type(exc).__name__}: {exc}"
        finally:
            if self._ts.has_request(prid):
                # Landed (READY) or given up: vLLM owns the blocks again.
                self._ts.abort(prid)
            self._ts.take_reusable()
        if not ok:
            log.warning("hybridkv load of %s (remote %s) failed: %s", rid, prid, error)
        with self._lock:
            self._recving.add(rid)  # vLLM expects failed loads in finished_recving too
            if not ok:
                self._failed.add(rid)

    async def _export(self, rid: str, blocks, token: bytes) -> None:
        ts = self._ts
        try:
            ts.add_request(rid)
            for g, ids in zip(self.transfer_groups, blocks):
                ts.assign(rid, g, ids)
            ts.request_finished(rid, export=True)
            # Whichever decode rank(s) ask for it (wire.Want) read it; the lease bounds the wait.
            result = await self._producer.export(rid, token=token)
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

    def handshake_metadata(self):
        return None  # the transport handshakes on its own control channel

    def shutdown(self) -> None:
        if self._loop is None:
            return

        async def close_all():
            if self._consumer is not None:
                await self._consumer.close()
            if self._producer is not None:
                await self._producer.close()

        try:
            self._call(close_all()).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._loop = None
