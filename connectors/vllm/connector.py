"""HybridKVConnector: vLLM's KV connector interface, thin over hybridkv.

One instance per role, as vLLM builds them: the scheduler process gets a
:class:`~hybridkv.connectors.vllm.scheduler_half.SchedulerHalf`, each worker a
:class:`~hybridkv.connectors.vllm.worker_half.WorkerHalf`; this class only forwards.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybridkv.connectors.versions import Engine, check_engine_version
from hybridkv.connectors.vllm.metadata import HybridKVConnectorMetadata
from hybridkv.connectors.vllm.stats import HybridKVConnectorStats, HybridKVPromMetrics

# vLLM imports this module when it builds the connector, in the scheduler and in every worker:
# another vLLM minor release is refused there, before any request is served.
check_engine_version(Engine.VLLM)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: The block-outermost layout we ask vLLM for: one logical block of a group is
#: one contiguous span over all the group's layers (docs/background/vllm.md section 9),
#: so a request moves with about one descriptor per block per group.
REQUESTED_LAYOUT = "BLHNC"


class HybridKVConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kvt = vllm_config.kv_transfer_config
        self.engine_id: str = kvt.engine_id or str(uuid.uuid4())
        self.scheduler = None
        self.worker = None
        # A KV cache hybridkv cannot move is refused here, in either role, naming the layer and why
        # (vLLM builds the workers' connectors before it allocates the KV tensors).
        from hybridkv.connectors.vllm.specs import adopt_specs

        if kv_cache_config is not None:
            adopt_specs(vllm_config, kv_cache_config)
        if role is KVConnectorRole.SCHEDULER:
            from hybridkv.connectors.vllm.scheduler_half import SchedulerHalf

            self.scheduler = SchedulerHalf(vllm_config, kv_cache_config, engine_id=self.engine_id)
        else:
            from hybridkv.connectors.vllm.worker_half import WorkerHalf

            self.worker = WorkerHalf(vllm_config, kv_cache_config, engine_id=self.engine_id)

    # ------------------------------------------------------------ class-level
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # vLLM keeps this only if every attention backend supports it; otherwise
        # it warns and falls back, and the worker half logs what it adopted.
        return REQUESTED_LAYOUT

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False

    # ------------------------------------------------------------ scheduler side
    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        # A decode-side prefix hit that reaches deeper in full attention than in the GDN groups is
        # completed by the load: it moves the attention suffix and always the running GDN state
        # (docs/design.md, rule 7), so vLLM may report the attention hit as the local prefix.
        return True

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched().bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._sched().get_loaded_kv_cache_group_ids()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        # The engine core hands over every worker's address and incarnation (pp_rank 0 only:
        # the base class refuses others, and the config refuses PP at start-up).
        self._sched().set_xfer_handshake_metadata(metadata)

    def has_pending_block_frees(self) -> bool:
        return self._sched().has_pending_block_frees()

    def get_finished_count(self) -> int | None:
        return None

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, HybridKVConnectorMetadata):
            raise ValueError(f"connector metadata {type(meta).__name__}; expected HybridKVConnectorMetadata")
        self._work().start_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are whole-request and asynchronous: the request is not scheduled
        # before they land, so no layer ever waits.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        # Pull mode: the consumer reads the blocks in place; nothing to save.
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending, r.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._work().transfer_results()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work().worker_meta()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._work().handshake_metadata()

    # ------------------------------------------------------------ metrics (both roles)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # Workers report transfers; the scheduler reports fence waits and its quarantines.
        # vLLM aggregates the workers' and joins the scheduler's (connectors/vllm/stats.py).
        half = self.worker if self.worker is not None else self.scheduler
        snapshot = half.metrics_snapshot()
        return None if snapshot.is_empty() else HybridKVConnectorStats.of(snapshot)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HybridKVConnectorStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> HybridKVPromMetrics:
        return HybridKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    # ------------------------------------------------------------ helpers
    def _sched(self):
        if self.scheduler is None:
            raise RuntimeError("scheduler-side call on a worker-role HybridKVConnector")
        return self.scheduler

    def _work(self):
        if self.worker is None:
            raise RuntimeError("worker-side call on a scheduler-role HybridKVConnector")
        return self.worker
