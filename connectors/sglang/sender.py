"""The prefill side's end of a room in SGLang's terms (`HybridKVSender`): SGLang's CommonKVSender, with the
room's exports held until no read of its source pages is queued or running (prefill_side.py), a refusal
that came before the sender existed reported at once (registrations.py), and SGLang's abort paths telling
the decode ranks (drains.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from hybridkv.connectors.sglang import routes
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVSender

if TYPE_CHECKING:
    from hybridkv.connectors.sglang.conn import HybridKVManager


class HybridKVSender(CommonKVSender):
    kv_mgr: HybridKVManager

    _sent_bytes: Optional[int] = None

    def __init__(self, mgr: HybridKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        refused = mgr.registrations.take_refusal(bootstrap_room) if mgr.registrations is not None else None
        if refused is not None and mgr.request_status.get(bootstrap_room) not in (None, KVPoll.Failed):
            # A decode rank of the room was refused before this sender existed (it was told then).
            mgr.record_failure(bootstrap_room, refused)
            mgr.update_status(bootstrap_room, KVPoll.Failed)

    def poll(self) -> KVPoll:
        status = super().poll()
        if status in (KVPoll.Success, KVPoll.Failed):
            exports = self.kv_mgr.exports
            exports.retire_export(self.bootstrap_room)
            sent = exports.take_room_bytes(self.bootstrap_room)
            if sent is not None:
                self._sent_bytes = (self._sent_bytes or 0) + sent
            if exports.exporting(self.bootstrap_room):
                # The scheduler frees source pages on a terminal state; an
                # outbound read of them is still queued or running.
                return KVPoll.Transferring
        return status

    def _register_prefill_dp_rank(self) -> None:
        """SGLang's /register_dp_rank of this prefill DP rank for the room, MACed with a secret (routes.py)."""
        secret = self.kv_mgr._route_secret
        if secret is None:
            return super()._register_prefill_dp_rank()
        routes.register_dp_rank(self.bootstrap_server_url, secret, self.bootstrap_room, self.kv_mgr.attn_dp_rank)

    def abort(self) -> None:
        super().abort()
        mgr = self.kv_mgr
        mgr.exports.retire_export(self.bootstrap_room)
        mgr.exports.take_room_bytes(self.bootstrap_room)
        # SGLang's abort paths (AbortReq, chunked prefill's) never clear the sender: its decode ranks are told
        # Failed now (and DRAINED once nothing of the room is in flight here), and the room's claims, which
        # count against each decode's authenticated session, go then.
        mgr.drains.fail(self.bootstrap_room, mgr.rooms.failure(self.bootstrap_room) or "Aborted by AbortReq.",
                        end=True)

    def get_transfer_metric(self):
        """SGLang's KVTransferMetric, with the bytes this rank's WRITEs moved for the room (SGLang's
        own figure is pages x item sizes, which counts what hybridkv does not move, e.g. padding)."""
        metric = super().get_transfer_metric()
        if self._sent_bytes is not None:
            metric.transfer_total_bytes = self._sent_bytes
        return metric
