"""Decode side of the scheduler half: loads from a remote prefill, from queueing to vLLM's finished_recving.

A request whose ``kv_transfer_params`` name a producer is an *intent* while queued (the worker renews
the producer's lease from its arrival on), a *pending* load once vLLM allocated its blocks, and goes
to the worker as a :class:`~hybridkv.connectors.vllm.metadata.RecvOrder` only when hybridkv's import
rule allows writing every target block (no step still in flight touches them: Race A). Landed, it is
reported to vLLM only once every component of every group arrived (visibility). Decode loads exactly
the token range the producer computed (``remote_num_tokens``) or nothing: a shifted range is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from hybridkv.fencing.fence import NotYet
from hybridkv.fencing.request_state import Component, TransferOutcome
from hybridkv.fencing.scheduler import TransferScheduler
from hybridkv.ids import RequestId, TransferId
from hybridkv.transport.metrics import TransferMetrics

from hybridkv.connectors.vllm.metadata import BlockIds, HybridKVConnectorMetadata, RecvOrder
from hybridkv.connectors.vllm.params import RemotePrefill, wants_remote_prefill

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class Loads:
    """Every load of one engine, from the request's arrival to vLLM's finished_recving."""

    def __init__(self, ts: TransferScheduler, *, transfer_groups: tuple[int, ...], components: frozenset[Component],
                 prefill_backoff: int, metrics: TransferMetrics,
                 clip: Callable[[tuple[tuple[int, ...], ...]], BlockIds]) -> None:
        self.ts = ts
        self.transfer_groups = transfer_groups
        self.components = components
        self.prefill_backoff = prefill_backoff
        self.metrics = metrics
        self._clip = clip
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
        self._first_step: dict[str, int] = {}  # pending load -> the first step it could have started in
        self._quarantined: dict[str, int] = {}  # aborted during its load -> blocks held until the load ends

    # ------------------------------------------------------------ requests
    def on_new_request(self, request: Request) -> None:
        try:
            remote = RemotePrefill.from_params(request.kv_transfer_params)
        except ValueError:
            return  # get_num_new_matched_tokens says why and computes the prompt locally
        # Renewed from now on, not from when a load can start: a queue longer than the
        # producer's lease must not lose the request (rule 6).
        self._intents[request.request_id] = remote
        self._new_intents[request.request_id] = remote

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
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
        # after_alloc and reported failed, so vLLM applies kv_load_failure_policy.
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

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int, *, step: int) -> None:
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return
        rid = request.request_id
        params["do_remote_prefill"] = False  # one load per request
        if num_external_tokens <= 0:
            self.release(rid)  # nothing to read (a local hit covers it): the producer may free now
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
            self.release(rid)
            self._refused[rid] = why
            return
        self._intents.pop(rid, None)  # the load takes over
        local = self._clip(tuple(tuple(g) for g in blocks.get_unhashed_block_ids_all_groups()))
        self.ts.add_request(RequestId(rid), expect=self.components)
        self._pending[rid] = (remote, local)
        self._first_step[rid] = step + 1

    def finished(self, rid: str) -> bool:
        """vLLM finished the request: True when it was a load's (nothing more to do for it)."""
        if rid in self._intents:
            self.release(rid)  # finished (aborted) while queued: never allocated, never read
        if rid in self._pending:
            # Aborted before its load was allowed to start: vLLM holds the blocks
            # until it hears the load finished, so tell it; and the producer, which frees at once.
            remote, _ = self._pending.pop(rid)
            self._releases[rid] = remote
            self._first_step.pop(rid, None)
            self.ts.abort(RequestId(rid))
            self._inject_recving.add(rid)
            return True
        if rid in self._inflight:
            # vLLM keeps the blocks until the worker reports the (now ignored)
            # load finished; hybridkv quarantines them until it is terminal.
            held = sum(len(self.ts.blocks(RequestId(rid), g)) for g in self.transfer_groups)
            self._quarantined[rid] = held
            self.metrics.quarantined(held)
            self.ts.abort(RequestId(rid))
            return True
        return False

    def release(self, rid: str) -> None:
        remote = self._intents.pop(rid, None)
        if remote is None:
            return
        # Told even if the worker never asked for it: the producer has exported it already.
        self._new_intents.pop(rid, None)
        self._releases[rid] = remote

    # ------------------------------------------------------------ steps
    def order_ready(self, meta: HybridKVConnectorMetadata, step: int) -> None:
        """Hand the worker every pending load whose target blocks may be written now."""
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

    def tell(self, meta: HybridKVConnectorMetadata) -> None:
        """What the worker tells producers this step: intents to renew, releases, refusals."""
        meta.heartbeats, self._new_intents = self._new_intents, {}
        meta.releases, self._releases = self._releases, {}
        meta.refused, self._refused = self._refused, {}

    def on_output(self, output: KVConnectorOutput) -> set[str]:
        """The loads the workers ended this step; returns what vLLM may hear as finished_recving."""
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
        return recving

    def _load_ended(self, rid: str) -> None:
        held = self._quarantined.pop(rid, None)
        if held is not None:
            self.metrics.quarantine_released(held)

    def idle(self) -> bool:
        return not (self._pending or self._inflight or self._held_back or self._inject_recving
                    or self._intents or self._new_intents or self._releases or self._refused)


__all__ = ["Loads"]
