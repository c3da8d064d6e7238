"""The scheduler half of HybridKVConnector: vLLM's scheduler hooks over hybridkv's fencing.

vLLM owns the block pool; hybridkv's :class:`~hybridkv.fencing.scheduler.TransferScheduler`
(engine-owned pool mode) decides *when* a block may be written by an incoming
transfer, read by an outgoing one, or handed back to vLLM:

* every scheduled step is reported with the blocks it writes (``touched``: its new tokens' blocks,
  the GDN/Mamba state slots, the blocks vLLM may free while the request still runs; see
  :mod:`~hybridkv.connectors.vllm.step_writes`), never a cached prefix block it only reads, and every
  executed step comes back from the workers as a watermark (:class:`HybridKVWorkerMetadata.step`);
* decode side: a load is given to the worker only when hybridkv's import rule
  allows writing all its target blocks, i.e. no step still in flight touches
  them (Race A: under ``--async-scheduling`` vLLM may reallocate a block that
  an already dispatched step still rewrites); a request is reported to vLLM as
  received only once every component of every group arrived (visibility);
  vLLM skips zeroing the blocks a load overwrites (Race B) because
  ``get_loaded_kv_cache_group_ids`` names every transfer group;
* prefill side: a finished request's blocks are held under a renewable lease,
  offered to readers only once every step that wrote them completed (export
  rule), and handed back to vLLM (``finished_sending``) only when hybridkv says
  they are settled and no transfer reads them.

This module holds what both sides share (the fence, each step's writes, the blocks a transfer moves) and
composes the two sides: :mod:`~hybridkv.connectors.vllm.scheduler_loads` (decode) and
:mod:`~hybridkv.connectors.vllm.scheduler_exports` (prefill).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from hybridkv.fencing.fence import PoolLayout
from hybridkv.fencing.lease import Clock
from hybridkv.fencing.request_state import Component, RequestPhase, attention_component, gdn_components
from hybridkv.fencing.scheduler import TransferScheduler
from hybridkv.ids import RequestId
from hybridkv.transport.metrics import MetricsSnapshot, TransferMetrics

from hybridkv.connectors.vllm.addressing import RankAddress, listen_port, ranks_from_handshake, resolve_host
from hybridkv.connectors.vllm.config import HybridKVVllmConfig
from hybridkv.connectors.vllm.metadata import BlockIds, HybridKVConnectorMetadata, HybridKVWorkerMetadata
from hybridkv.connectors.vllm.params import wants_remote_prefill
from hybridkv.connectors.vllm.scheduler_exports import Exports
from hybridkv.connectors.vllm.scheduler_loads import Loads
from hybridkv.connectors.vllm.step_writes import StepWrites

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: Scheduler-side hold / transport lease (see SchedulerHalf.__init__).
LEASE_HOLD_FACTOR = 1.5


class SchedulerHalf:
    """Scheduler-process state of one engine (all its TP ranks share one block table)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        *,
        engine_id: str,
        clock: Clock = time.monotonic,
    ) -> None:
        from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

        self.config = cfg = HybridKVVllmConfig.from_vllm_config(vllm_config)
        self.engine_id = engine_id
        self.kv_cache_config = kv_cache_config
        self.transfer_groups: tuple[int, ...] = tuple(kv_cache_config.transfer_group_ids)
        self.lease_s = cfg.kv_lease_duration
        # The workers' transport enforces the lease the consumer sees; the blocks
        # go back to vLLM on this longer one, so that a worker can never still
        # serve a read of blocks vLLM already reallocated.
        self.hold_s = self.lease_s * LEASE_HOLD_FACTOR
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.dp_index = vllm_config.parallel_config.data_parallel_index
        self.side_host = cfg.side_channel_host
        self.side_port = listen_port(cfg.side_channel_port, dp_index=self.dp_index, tp_size=self.tp_size, tp_rank=0)
        # Every rank's address and incarnation, once the engine core hands over what the workers
        # reported (set_xfer_handshake_metadata); until then, where the workers are configured to listen.
        self._ranks: tuple[RankAddress, ...] | None = None
        self.has_mamba = bool(kv_cache_config.has_mamba_layers)
        # Trailing prompt tokens the producer leaves to the decoder (NixlConnector's _prefill_backoff):
        # Mamba/GDN needs h(N-1) to compute token N itself, and multi-module MTP keeps its whole
        # lookahead window off the producer (its drafts would otherwise sit unverified in the MTP
        # layers' KV, and decode never rebuilds them).
        self.prefill_backoff = max(1 if self.has_mamba else 0, vllm_config.num_prefill_lookahead_tokens - 1)
        self.num_blocks = kv_cache_config.num_blocks
        groups = kv_cache_config.kv_cache_groups
        self._mamba_spec_blocks: dict[int, int] = {}
        self._window_blocks: dict[int, int] = {}
        for g in self.transfer_groups:
            spec = groups[g].kv_cache_spec
            if isinstance(spec, MambaSpec):
                self._mamba_spec_blocks[g] = spec.num_speculative_blocks
            elif isinstance(spec, SlidingWindowSpec):
                self._window_blocks[g] = -(-spec.sliding_window // spec.block_size) + 1
        comps: list[Component] = []
        for g in self.transfer_groups:
            comps.extend(gdn_components(g) if g in self._mamba_spec_blocks else (attention_component(g),))
        self.components = frozenset(comps)
        # Only the race tests turn fencing off, to show what breaks without it.
        policy = cfg.hybridkv_fence_policy
        # vLLM's hybrid allocator: one pool, block b of every group is page b.
        self.ts = TransferScheduler(
            PoolLayout.shared(num_blocks=self.num_blocks, num_groups=len(groups)),
            policy=policy,
            managed_pool=False,
            lease_s=self.hold_s,
            clock=clock,
        )
        # What each step writes; on an engine that imports, also what a preempted request still read.
        self._writes = StepWrites(kv_cache_config, imports=vllm_config.kv_transfer_config.is_kv_consumer)
        self._kv_cache_manager: KVCacheManager | None = None
        self._null_block = 0
        self._step = -1
        self._warned_no_watermark = False
        #: fence waits and quarantines seen here; the workers count the transfers (stats.py)
        self.metrics = TransferMetrics()
        #: decode side: loads from a remote prefill
        self.loads = Loads(self.ts, transfer_groups=self.transfer_groups, components=self.components,
                           prefill_backoff=self.prefill_backoff, metrics=self.metrics, clip=self._clip)
        #: prefill side: exports to a remote decode
        self.exports = Exports(self.ts, engine_id=engine_id, transfer_groups=self.transfer_groups,
                               tp_size=self.tp_size, lease_s=self.lease_s, prefill_backoff=self.prefill_backoff,
                               metrics=self.metrics, clip=self._clip, ranks=self.rank_addresses)

    # ------------------------------------------------------------ binding
    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager
        self._null_block = manager.block_pool.null_block.block_id

    # ------------------------------------------------------------ requests
    def set_xfer_handshake_metadata(self, by_rank: dict[int, Any]) -> None:
        """What every worker reported at start-up (vLLM's engine core collects it): the addresses
        and incarnations request_finished names in kv_transfer_params."""
        if not by_rank:
            return  # a consumer-only engine: its workers listen nowhere
        self._ranks = ranks_from_handshake(by_rank, tp_size=self.tp_size)
        log.info("HybridKVConnector DP engine %d serves from %s", self.dp_index,
                 ", ".join(f"{a.host}:{a.port} ({a.agent})" for a in self._ranks))

    def rank_addresses(self) -> tuple[RankAddress, ...]:
        if self._ranks is not None:
            return self._ranks
        host = resolve_host(self.side_host)
        return tuple(RankAddress(host=host, port=listen_port(self.config.side_channel_port, dp_index=self.dp_index,
                                                             tp_size=self.tp_size, tp_rank=r))
                     for r in range(self.tp_size))

    def on_new_request(self, request: Request) -> None:
        if wants_remote_prefill(request.kv_transfer_params):
            self.loads.on_new_request(request)
        else:
            self.exports.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.loads.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.loads.after_alloc(request, blocks, num_external_tokens, step=self._step)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._writes.forget(rid)
        if self.loads.finished(rid):
            return False, None
        if self.ts.has_request(RequestId(rid)):
            self.ts.abort(RequestId(rid))
        return self.exports.finished(request, block_ids)

    def _clip(self, block_ids: tuple[tuple[int, ...], ...]) -> BlockIds:
        """The transferable blocks of each transfer group: no null padding, only a
        sliding window's tail, only a state group's running-state slot."""
        if not block_ids:
            return ()
        null = self._null_block
        out = []
        for g in self.transfer_groups:
            ids = block_ids[g] if g < len(block_ids) else ()
            if g in self._window_blocks:
                ids = ids[-self._window_blocks[g]:]
            elif g in self._mamba_spec_blocks and ids:
                scratch = min(self._mamba_spec_blocks[g], len(ids) - 1)
                ids = (ids[:-scratch] if scratch else ids)[-1:]
            out.append(tuple(b for b in ids if b != null))
        return tuple(out)

    # ------------------------------------------------------------ steps
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HybridKVConnectorMetadata:
        self._step += 1
        step = self._step
        touched = self._touched(scheduler_output)
        # Pool 0: vLLM's hybrid allocator shares one block id space over all groups (ids as they are).
        self.ts.step_scheduled(step, pool_touched={0: touched})
        meta = HybridKVConnectorMetadata(step=step)
        self.loads.order_ready(meta, step)
        self.exports.offer_ready(meta)
        self.loads.tell(meta)
        return meta

    def _touched(self, scheduler_output: SchedulerOutput) -> set[int]:
        """The blocks this step writes (a cached prefix block it only reads is not one of them)."""
        manager = self._kv_cache_manager
        if manager is None:
            raise RuntimeError("the KV cache manager was never bound to the connector")
        out = self._writes.of_step(scheduler_output, manager)
        out.discard(self._null_block)
        return out

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, HybridKVWorkerMetadata):
            if meta.step > self.ts.watermark:
                self.ts.step_completed(meta.step)
            for rid in meta.renewed:
                self.ts.heartbeat(RequestId(rid))
        elif not self._warned_no_watermark:
            self._warned_no_watermark = True
            log.warning("worker output without hybridkv step metadata: the fence watermark cannot advance")
        recving = self.loads.on_output(output)
        sending = self.exports.on_output(output)
        output.finished_recving = recving
        output.finished_sending = sending

    def metrics_snapshot(self) -> MetricsSnapshot:
        return self.metrics.take()

    # ------------------------------------------------------------ queries
    def get_loaded_kv_cache_group_ids(self) -> tuple[int, ...]:
        return self.transfer_groups

    def has_pending_block_frees(self) -> bool:
        # Only blocks whose export already ended come back soon (once the steps that touched them
        # completed). An export still waiting for its reader may hold its blocks for a whole lease:
        # saying True for it would stop vLLM from preempting for that long.
        return self.exports.releasing()

    def idle(self) -> bool:
        """Nothing tracked: every block is vLLM's again."""
        return (
            self.ts.requests_in_flight() == 0
            and self.ts.transfers_in_flight() == 0
            and self.loads.idle()
            and self.exports.idle()
        )

    def phase(self, rid: str) -> RequestPhase | None:
        r = RequestId(rid)
        return self.ts.phase(r) if self.ts.has_request(r) else None
