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
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from hybridkv.fencing.fence import NotYet, PoolLayout
from hybridkv.fencing.lease import Clock
from hybridkv.fencing.request_state import Component, RequestPhase, TransferOutcome, attention_component, gdn_components
from hybridkv.fencing.scheduler import TransferScheduler
from hybridkv.ids import RequestId, TransferId
from hybridkv.transport.metrics import MetricsSnapshot, TransferMetrics
from hybridkv.transport.auth import new_token

from hybridkv.connectors.vllm.addressing import RankAddress, listen_port, ranks_from_handshake, resolve_host
from hybridkv.connectors.vllm.config import HybridKVVllmConfig
from hybridkv.connectors.vllm.metadata import BlockIds, HybridKVConnectorMetadata, HybridKVWorkerMetadata, RecvOrder
from hybridkv.connectors.vllm.params import RemotePrefill, producer_params, wants_remote_decode, wants_remote_prefill
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
        # decode side
        self._pending: dict[str, tuple[RemotePrefill, BlockIds]] = {}  # allocated, load not yet allowed
        self._inflight: dict[str, TransferId] = {}  # load handed to the worker
        self._failed: set[str] = set()
        self._held_back: set[str] = set()  # landed, but not every component arrived yet
        self._inject_recving: set[str] = set()  # aborted before the load started: vLLM waits for this
        # Queued, not yet allocated: the worker renews their producer leases from arrival (rule 6).
        self._intents: dict[str, RemotePrefill] = {}
        self._new_intents: dict[str, RemotePrefill] = {}
        self._releases: dict[str, RemotePrefill] = {}  # to be told to the producer: we will not read them
        self._refused: dict[str, str] = {}  # loads refused (why): the worker reports them failed
        self._warned_no_range = False
        # prefill side
        self._exports: dict[str, BlockIds] = {}  # exporting, not yet offered to readers
        self._capabilities: dict[str, bytes] = {}  # their tokens, until offered
        self._offered: set[str] = set()
        self._export_blocks: dict[str, list[int]] = {}
        self._ended: list[str] = []
        # requests whose hybridkv blocks must settle before vLLM may free them
        self._releasing: dict[str, set[int]] = {}
        self._owner: dict[int, set[str]] = {}  # a shared block may be waited on by several requests
        self._inject_sending: set[str] = set()
        # Exports offered to the worker whose finished_sending it has not reported yet: it reports each
        # exactly once, whatever becomes of the export.
        self._owed: set[str] = set()
        # Reported to vLLM by us while the worker still owed its report: that late report must not
        # reach vLLM, which asserts the request still exists. Each entry leaves when the report comes,
        # so it holds at most the exports in flight (no cap that could drop one).
        self._reported_sending: set[str] = set()
        self._warned_no_watermark = False
        #: fence waits and quarantines seen here; the workers count the transfers (stats.py)
        self.metrics = TransferMetrics()
        self._first_step: dict[str, int] = {}  # pending load -> the first step it could have started in
        self._quarantined: dict[str, int] = {}  # aborted during its load -> blocks held until the load ends

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
        params = request.kv_transfer_params
        if wants_remote_prefill(params):
            try:
                remote = RemotePrefill.from_params(params)
            except ValueError:
                return  # get_num_new_matched_tokens says why and computes the prompt locally
            # Renewed from now on, not from when a load can start: a queue longer than the
            # producer's lease must not lose the request (rule 6).
            self._intents[request.request_id] = remote
            self._new_intents[request.request_id] = remote
            return
        if not wants_remote_decode(params) or params.get("_hybridkv_truncated"):
            return
        back = self.prefill_backoff
        # A request that skips reading the prefix cache (prompt logprobs) wants every prompt token computed
        # here, and decode loads nothing of it (vLLM gives it no external tokens): never truncated.
        if (back and request.num_prompt_tokens > back and request.prompt_token_ids is not None
                and not request.get_skip_reading_prefix_cache()):
            del request.prompt_token_ids[-back:]
            del request._all_token_ids[-back:]
            request.num_prompt_tokens -= back
            params["_hybridkv_truncated"] = True
        request.max_tokens = 1

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return 0, False
        try:
            RemotePrefill.from_params(params)
        except ValueError as e:
            # Claiming tokens now would park the request for a load that never starts.
            log.warning("request %s: computing its prompt locally, its kv_transfer_params are unusable: %s",
                        request.request_id, e)
            params["do_remote_prefill"] = False
            return 0, False
        count = self._load_end(request) - num_computed_tokens
        # A token range the producer did not compute is still claimed: the load is then refused in
        # update_state_after_alloc and reported failed, so vLLM applies kv_load_failure_policy.
        return (count, True) if count > 0 else (0, False)

    def _load_end(self, request: Request) -> int:
        """The prompt tokens decode loads (all but the backoff, which it computes itself)."""
        n = len(request.prompt_token_ids or ())
        back = self.prefill_backoff
        return n - back if back and n > back else n

    def _range_error(self, request: Request, remote: RemotePrefill) -> str | None:
        """Why the producer's blocks do not hold what decode would load, or None. The loaded range is
        paired with the tail of the producer's blocks (a local prefix hit keeps the front): a producer
        that computed fewer or more tokens than decode loads would hand over blocks and a GDN state of
        other positions, which then enter decode's prefix cache as if they were this prompt's."""
        end = self._load_end(request)
        if remote.num_tokens is None:
            if not self._warned_no_range:
                self._warned_no_range = True
                log.warning("kv_transfer_params without remote_num_tokens (request %s): the token range loaded "
                            "cannot be checked against what the producer computed", request.request_id)
            return None
        if remote.num_tokens != end:
            return (f"the producer computed {remote.num_tokens} prompt tokens (remote_num_tokens), this engine "
                    f"loads {end} ({len(request.prompt_token_ids or ())} prompt tokens less the "
                    f"{self.prefill_backoff} it computes itself): a different template, tokenizer, model or "
                    "speculative setting between prefill and decode")
        return None

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return
        rid = request.request_id
        params["do_remote_prefill"] = False  # one load per request
        if num_external_tokens <= 0:
            self._release(rid)  # nothing to read (a local hit covers it): the producer may free now
            return
        try:
            remote = RemotePrefill.from_params(params)
        except ValueError as e:
            log.warning("request %s: not loading its KV: %s", rid, e)
            return
        why = self._range_error(request, remote)
        if why is not None:
            # Never a shifted load: the worker reports it failed, vLLM recomputes or fails the request
            # (kv_load_failure_policy) and frees its blocks uncached; the producer frees its export now.
            log.warning("request %s: refusing to load its KV from %s: %s", rid, remote.engine_id, why)
            self._release(rid)
            self._refused[rid] = why
            return
        self._intents.pop(rid, None)  # the load takes over
        local = self._clip(tuple(tuple(g) for g in blocks.get_unhashed_block_ids_all_groups()))
        self.ts.add_request(RequestId(rid), expect=self.components)
        self._pending[rid] = (remote, local)
        self._first_step[rid] = self._step + 1

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self._writes.forget(rid)
        if rid in self._intents:
            self._release(rid)  # finished (aborted) while queued: never allocated, never read
        if rid in self._pending:
            # Aborted before its load was allowed to start: vLLM holds the blocks
            # until it hears the load finished, so tell it; and the producer, which frees at once.
            remote, _ = self._pending.pop(rid)
            self._releases[rid] = remote
            self._first_step.pop(rid, None)
            self.ts.abort(RequestId(rid))
            self._inject_recving.add(rid)
            return False, None
        if rid in self._inflight:
            # vLLM keeps the blocks until the worker reports the (now ignored)
            # load finished; hybridkv quarantines them until it is terminal.
            held = sum(len(self.ts.blocks(RequestId(rid), g)) for g in self.transfer_groups)
            self._quarantined[rid] = held
            self.metrics.quarantined(held)
            self.ts.abort(RequestId(rid))
            return False, None
        if self.ts.has_request(RequestId(rid)):
            self.ts.abort(RequestId(rid))
        params = request.kv_transfer_params
        if not wants_remote_decode(params):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        clipped = self._clip(tuple(tuple(g) for g in block_ids))
        if not any(clipped):
            return False, None
        r = RequestId(rid)
        self.ts.add_request(r)
        try:
            # Rule 7: an export is a read hold. With prefix caching a block may be held by
            # another exporting request too, or be parked (released, not yet reusable).
            for g, ids in zip(self.transfer_groups, clipped):
                self.ts.share(r, g, ids)
        except ValueError as e:
            # Never crash the engine on one request: it finishes without a transfer.
            log.warning("request %s: not exporting its KV: %s", rid, e)
            self.ts.abort(r)
            return False, None
        self.ts.request_finished(r, export=True)
        self._exports[rid] = clipped
        self._export_blocks[rid] = [b for ids in clipped for b in ids]
        ranks = self.rank_addresses()
        # Issued here, where kv_transfer_params are made: the decode instance the router hands
        # them to presents it; no other peer can claim, renew or end the export.
        token = self._capabilities[rid] = new_token()
        return True, producer_params(
            token=token,
            engine_id=self.engine_id,
            request_id=rid,
            host=ranks[0].host,
            port=ranks[0].port,
            block_ids=clipped,
            tp_size=self.tp_size,
            num_tokens=request.num_computed_tokens,
            lease_s=self.lease_s,
            ranks=ranks,
        )

    def _release(self, rid: str) -> None:
        remote = self._intents.pop(rid, None)
        if remote is None:
            return
        # Told even if the worker never asked for it: the producer has exported it already.
        self._new_intents.pop(rid, None)
        self._releases[rid] = remote

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
        for rid in list(self._pending):
            remote, local = self._pending[rid]
            r = RequestId(rid)
            if not any(self.ts.blocks(r, g) for g in self.transfer_groups) and any(local):
                try:
                    for g, ids in zip(self.transfer_groups, local):
                        self.ts.assign(r, g, ids)
                except ValueError as e:
                    # vLLM handed out a block hybridkv still fences (should not happen:
                    # every block we park reaches vLLM only through us); undo, retry later.
                    log.warning("load of %s waits: %s", rid, e)
                    for g in self.transfer_groups:
                        if self.ts.blocks(r, g):
                            self.ts.free_blocks(r, g, self.ts.blocks(r, g))
                    continue
            tid = self.ts.post_import(r, components=self.components)
            if isinstance(tid, NotYet):
                log.debug("load of %s waits: %s", rid, tid.reason.value)
                continue
            del self._pending[rid]
            self._inflight[rid] = tid
            self.metrics.fence_wait(max(0, step - self._first_step.pop(rid, step)))
            meta.recvs.append(RecvOrder(request_id=rid, transfer_id=int(tid), local_block_ids=local, remote=remote))
        for rid in list(self._exports):
            if not isinstance(self.ts.export_ready(RequestId(rid)), NotYet):
                meta.exports_ready[rid] = self._exports.pop(rid)
                meta.capabilities[rid] = self._capabilities.pop(rid)
                self._offered.add(rid)
                self._owed.add(rid)
        for rid in self.ts.poll():
            self._export_released(rid)
        meta.exports_ended, self._ended = self._ended, []
        meta.heartbeats, self._new_intents = self._new_intents, {}
        meta.releases, self._releases = self._releases, {}
        meta.refused, self._refused = self._refused, {}
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
        for rid in output.failed_recving or ():
            tid = self._inflight.pop(rid, None)
            if tid is not None:
                self.ts.transfer_failed(tid)
                self._load_ended(rid)
                self._failed.add(rid)
        recving = set(output.finished_recving or ())
        for rid in list(recving):
            if rid in self._failed:
                # vLLM recomputes or fails it; either way it is no longer ours.
                self._failed.discard(rid)
                self.ts.abort(RequestId(rid))
                continue
            tid = self._inflight.pop(rid, None)
            if tid is None:
                continue
            outcome = self.ts.transfer_landed(tid)
            self._load_ended(rid)
            if outcome is TransferOutcome.DISCARDED:
                continue  # aborted while in flight; vLLM frees the blocks now
            if outcome is not TransferOutcome.ACCEPTED:
                raise RuntimeError(f"load of {rid} completed as {outcome.value}; expected accepted")
            self._held_back.add(rid)
            recving.discard(rid)
        for rid in list(self._held_back):
            r = RequestId(rid)
            if self.ts.is_ready(r):
                self._held_back.discard(rid)
                self.ts.request_finished(r)  # vLLM owns the blocks from here on
                recving.add(rid)
        recving |= self._inject_recving
        self._inject_recving = set()
        sending = set(output.finished_sending or ())
        for rid in list(sending):
            self._owed.discard(rid)
            if rid in self._reported_sending:
                sending.discard(rid)
                self._reported_sending.discard(rid)
                continue
            if rid not in self._export_blocks and rid not in self._releasing:
                continue  # not ours
            # Ours are reported to vLLM only once hybridkv lets the blocks go.
            sending.discard(rid)
            self._offered.discard(rid)
            self._exports.pop(rid, None)
            self._capabilities.pop(rid, None)
            if self.ts.export_done(RequestId(rid)):
                self._hold_until_reusable(rid, self._export_blocks.pop(rid, []))
                self._ended.append(rid)
        self._drain_reusable()
        sending |= self._inject_sending
        self._reported_sending |= self._inject_sending & self._owed
        self._inject_sending = set()
        output.finished_recving = recving
        output.finished_sending = sending

    def _load_ended(self, rid: str) -> None:
        held = self._quarantined.pop(rid, None)
        if held is not None:
            self.metrics.quarantine_released(held)

    def metrics_snapshot(self) -> MetricsSnapshot:
        return self.metrics.take()

    def _export_released(self, rid: str) -> None:
        """A lapsed lease released the request's blocks inside hybridkv."""
        self.metrics.lease_expired()  # the scheduler's hold lapsed: the worker never reported the export ended
        self._exports.pop(rid, None)
        self._capabilities.pop(rid, None)
        self._offered.discard(rid)
        self._ended.append(rid)
        self._hold_until_reusable(rid, self._export_blocks.pop(rid, []))

    def _hold_until_reusable(self, rid: str, blocks: list[int]) -> None:
        pending = self._releasing.setdefault(rid, set())
        owner = self._owner
        for b in blocks:
            pending.add(b)
            ws = owner.get(b)
            if ws is None:
                owner[b] = {rid}
            else:
                ws.add(rid)

    def _drain_reusable(self) -> None:
        for _, b in self.ts.take_reusable():
            for rid in self._owner.pop(int(b), ()):
                self._releasing[rid].discard(int(b))
        for rid in [r for r, s in self._releasing.items() if not s]:
            del self._releasing[rid]
            self._inject_sending.add(rid)

    # ------------------------------------------------------------ queries
    def get_loaded_kv_cache_group_ids(self) -> tuple[int, ...]:
        return self.transfer_groups

    def has_pending_block_frees(self) -> bool:
        # Only blocks whose export already ended come back soon (once the steps that touched them
        # completed). An export still waiting for its reader may hold its blocks for a whole lease:
        # saying True for it would stop vLLM from preempting for that long.
        return bool(self._releasing)

    def idle(self) -> bool:
        """Nothing tracked: every block is vLLM's again."""
        return (
            self.ts.requests_in_flight() == 0
            and self.ts.transfers_in_flight() == 0
            and not (self._pending or self._inflight or self._held_back or self._releasing or self._exports)
            and not (self._offered or self._inject_recving or self._inject_sending)
            and not (self._intents or self._new_intents or self._releases or self._refused)
        )

    def phase(self, rid: str) -> RequestPhase | None:
        r = RequestId(rid)
        return self.ts.phase(r) if self.ts.has_request(r) else None
