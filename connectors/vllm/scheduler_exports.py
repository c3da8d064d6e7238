"""Prefill side of the scheduler half: exports, from a finished request to vLLM's finished_sending.

A finished request's blocks are held under a renewable lease (an export is a read hold, rule 7),
offered to readers only once every step that wrote them completed (export rule), and handed back to
vLLM (``finished_sending``) only when hybridkv says they are settled and no transfer reads them. The
prompt is truncated on arrival by the tokens decode computes itself (``prefill_backoff``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hybridkv.fencing.fence import NotYet
from hybridkv.fencing.scheduler import TransferScheduler
from hybridkv.ids import RequestId
from hybridkv.transport.auth import new_token
from hybridkv.transport.metrics import TransferMetrics

from hybridkv.connectors.vllm.addressing import RankAddress
from hybridkv.connectors.vllm.metadata import BlockIds, HybridKVConnectorMetadata
from hybridkv.connectors.vllm.params import DECODE_HOSTS, claimants, producer_params, wants_remote_decode

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class Exports:
    """Every export of one engine, from the request's finish to vLLM's finished_sending."""

    def __init__(self, ts: TransferScheduler, *, engine_id: str, transfer_groups: tuple[int, ...], tp_size: int,
                 lease_s: float, prefill_backoff: int, metrics: TransferMetrics,
                 clip: Callable[[tuple[tuple[int, ...], ...]], BlockIds],
                 ranks: Callable[[], tuple[RankAddress, ...]]) -> None:
        self.ts = ts
        self.engine_id = engine_id
        self.transfer_groups = transfer_groups
        self.tp_size = tp_size
        self.lease_s = lease_s
        self.prefill_backoff = prefill_backoff
        self.metrics = metrics
        self._clip = clip
        self._ranks = ranks
        self._exports: dict[str, BlockIds] = {}  # exporting, not yet offered to readers
        self._capabilities: dict[str, bytes] = {}  # their tokens, until offered
        self._decode_hosts: dict[str, list[str]] = {}  # where a request names its decode: bound to it
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

    # ------------------------------------------------------------ requests
    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
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

    def finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        params = request.kv_transfer_params
        if not wants_remote_decode(params):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        try:  # whom the capability is bound to (a router that picks the decode first names it)
            bound = claimants(params)
        except ValueError as e:  # a client's value: refused for this request, never the engine
            log.warning("request %s: not exporting its KV: %s", rid, e)
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
        ranks = self._ranks()
        # Issued here, where kv_transfer_params are made: the decode instance the router hands
        # them to presents it; no other peer can claim, renew or end the export.
        token = self._capabilities[rid] = new_token()
        if bound is not None:  # validated above; the worker binds the export to these (metadata is pickled)
            hosts = params[DECODE_HOSTS]
            self._decode_hosts[rid] = [hosts] if isinstance(hosts, str) else list(hosts)
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

    # ------------------------------------------------------------ steps
    def offer_ready(self, meta: HybridKVConnectorMetadata) -> None:
        """Offer readers every export whose blocks every writing step completed; then what ended."""
        for rid in list(self._exports):
            if not isinstance(self.ts.export_ready(RequestId(rid)), NotYet):
                meta.exports_ready[rid] = self._exports.pop(rid)
                meta.capabilities[rid] = self._capabilities.pop(rid)
                if rid in self._decode_hosts:
                    meta.decode_hosts[rid] = self._decode_hosts.pop(rid)
                self._offered.add(rid)
                self._owed.add(rid)
        for rid in self.ts.poll():
            self._released(rid)
        meta.exports_ended, self._ended = self._ended, []

    def on_output(self, output: KVConnectorOutput) -> set[str]:
        """The exports the workers ended this step; returns what vLLM may hear as finished_sending."""
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
            self._decode_hosts.pop(rid, None)
            if self.ts.export_done(RequestId(rid)):
                self._hold_until_reusable(rid, self._export_blocks.pop(rid, []))
                self._ended.append(rid)
        self._drain_reusable()
        sending |= self._inject_sending
        self._reported_sending |= self._inject_sending & self._owed
        self._inject_sending = set()
        return sending

    def _released(self, rid: str) -> None:
        """A lapsed lease released the request's blocks inside hybridkv."""
        self.metrics.lease_expired()  # the scheduler's hold lapsed: the worker never reported the export ended
        self._exports.pop(rid, None)
        self._capabilities.pop(rid, None)
        self._decode_hosts.pop(rid, None)
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
    def releasing(self) -> bool:
        """Blocks whose export ended wait to settle (they come back to vLLM soon)."""
        return bool(self._releasing)

    def idle(self) -> bool:
        return not (self._releasing or self._exports or self._offered or self._inject_sending)


__all__ = ["Exports"]
