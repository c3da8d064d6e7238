"""The decode side's end of a room in SGLang's terms (`HybridKVReceiver`): SGLang's CommonKVReceiver, with the
import fenced through the manager's imports (`conn.HybridKVManager.imports`, decode_side.py) and what SGLang sends to prefill ranks
sealed to each rank's authenticated session (sessions.py; the handshake off SGLang's thread: prefill_links.py);
with a secret, a prefill rank's route is taken from the bootstrap server only MACed (routes.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import numpy as np
import zmq

from hybridkv.connectors.sglang import routes
from hybridkv.connectors.sglang.adopt import KV_GROUP, state_blocks
from hybridkv.connectors.sglang.prefill_links import Link, LinkState
from hybridkv.transport.metrics import FailureKind
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVReceiver

if TYPE_CHECKING:
    from hybridkv.connectors.sglang.conn import HybridKVManager

logger = logging.getLogger(__name__)


class HybridKVReceiver(CommonKVReceiver):
    kv_mgr: HybridKVManager

    def __init__(self, mgr: HybridKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None):
        self._published = False
        self._final: Optional[KVPoll] = None
        self._links_used: list[Link] = []  # the links SGLang's sends for this room took (prefill_links.py)
        self._link_failed = False
        super().__init__(mgr, bootstrap_addr, bootstrap_room)

    # ------------------------------------------------------------ the bootstrap server's answers (routes.py)
    def _get_bootstrap_info_from_server(self, prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank):
        """A prefill rank's route; with a secret asked MACed with a fresh nonce and taken only MACed back
        (routes.lookup_route): None, as SGLang's lookup answers a failure, fails the room SGLang's way."""
        secret = self.kv_mgr._route_secret
        if secret is None:
            return super()._get_bootstrap_info_from_server(prefill_dp_rank, prefill_cp_rank, target_tp_rank,
                                                           target_pp_rank)
        try:
            info = routes.lookup_route(self.bootstrap_addr, secret, prefill_dp_rank, prefill_cp_rank,
                                       target_tp_rank, target_pp_rank)
        except routes.LookupRefused as e:
            self._lookup_refused = f"hybridkv: {e}"  # the room's failure names it (_setup_bootstrap_infos)
            return None
        info["pp_rank"] = int(target_pp_rank)  # as SGLang's lookup adds it
        return info

    # ------------------------------------------------------------ authentication (sessions.py)
    def _setup_bootstrap_infos(self):
        self._lookup_refused: Optional[str] = None
        super()._setup_bootstrap_infos()
        if self._lookup_refused is not None and self.bootstrap_infos is None:
            self.kv_mgr.record_failure(self.bootstrap_room, self._lookup_refused)  # in place of SGLang's words
        if self.bootstrap_infos:
            self.kv_mgr.auth.expect_writers(self.bootstrap_room, self._writers())
            self._fail_if_auth_required()

    def _writers(self) -> frozenset[tuple[str, int]]:
        return frozenset((info["rank_ip"], int(info["rank_port"])) for info in self.bootstrap_infos or ())

    def _fail_if_auth_required(self) -> bool:
        """Without a secret: a prefill rank of this room answered a probe (decode_keys.AuthProbe): fail now."""
        mgr = self.kv_mgr
        reason = mgr.auth.refusal(self._writers()) if mgr.auth.probe is not None else None
        if reason is None:
            return False
        mgr.record_failure(self.bootstrap_room, reason)
        self.conclude_state = KVPoll.Failed
        mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        return True

    def _register_kv_args(self) -> bool:
        """An authenticated session with each prefill rank before SGLang's REGISTER reaches it: the handshake
        runs on a thread of its own (prefill_links.py) and the REGISTER waits in the link, so SGLang's
        scheduler thread never waits for a prefill rank."""
        mgr = self.kv_mgr
        if mgr.auth.probe is not None and self.bootstrap_infos:
            for info in self.bootstrap_infos:
                mgr.auth.probe_prefill((info["rank_ip"], int(info["rank_port"])))
        if mgr.auth.links is not None and self.bootstrap_infos:
            for info in self.bootstrap_infos:
                mgr.auth.links.ensure((info["rank_ip"], int(info["rank_port"])))
        return super()._register_kv_args()

    def _connect_to_bootstrap_server(self, bootstrap_info: dict):
        """SGLang's socket to a prefill rank, sealing what SGLang sends on it (REGISTER, METADATA, ABORT)
        with the session that rank proved, or holding it in the link until then; an instance method here,
        so SGLang's calls through `self` reach it."""
        sock, lock = super()._connect_to_bootstrap_server(bootstrap_info)
        links = self.kv_mgr.auth.links
        if links is None:
            return sock, lock
        prefill = (bootstrap_info["rank_ip"], int(bootstrap_info["rank_port"]))
        link = links.current(prefill)
        if link is None:
            raise zmq.ZMQError(zmq.EHOSTUNREACH,
                               f"no authenticated session with prefill rank {prefill[0]}:{prefill[1]}")
        self._links_used.append(link)
        return _Sealing(sock, link), lock

    def _fail_if_link_failed(self) -> None:
        """A handshake this room's frames waited for failed: the room fails now, naming why (and SGLang
        registers again for the next request). Where nothing of the room went out, no writer can write."""
        failed = next((link for link in self._links_used if link.state is LinkState.FAILED), None)
        if failed is None or self._link_failed:
            return
        self._link_failed = True
        mgr = self.kv_mgr
        mgr.record_failure(self.bootstrap_room, f"hybridkv: {failed.error}")
        self.invalidate_cached_bootstrap_infos()
        mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        if self._published and not any(link.delivered for link in self._links_used):
            mgr.imports.settle_imports(self.bootstrap_room, "no prefill rank got the room (authentication failed)")

    def _writers_expected(self) -> int:
        return sum(1 for info in (self.bootstrap_infos or []) if not info.get("is_dummy"))

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None, **kwargs):
        if self.conclude_state == KVPoll.Failed or self._fail_if_auth_required():
            return None  # failed in init (e.g. the prefill did not prove the secret): nothing is published
        if self.bootstrap_infos is not None and not self._published:
            mgr = self.kv_mgr
            blocks = {KV_GROUP: np.asarray(kv_indices, dtype=np.int64).ravel()}
            for c, idx in state_blocks(state_indices):
                if c < mgr.adopted.num_state_groups:
                    blocks[mgr.adopted.state_group(c)] = idx
            if aux_index is not None:
                blocks[mgr.adopted.aux_group] = np.asarray([aux_index], dtype=np.int64)
            try:
                mgr.imports.begin_import(self.bootstrap_room, self.bootstrap_addr, self._writers_expected(), blocks)
            except ValueError as e:
                # Nothing was published: failing here frees nothing a write can reach.
                mgr.metrics.failure(FailureKind.FENCED)
                mgr.record_failure(self.bootstrap_room, f"hybridkv refused the destinations: {e}")
                mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                self.ensure_abort_notified()  # the prefill ranks stop waiting for this room
                return None
            # From the first attempt on, some prefill rank may hold our destinations.
            self._published = True
            prefill_tp = getattr(getattr(self, "prefill_info", None), "attn_tp_size", None)
            if prefill_tp and prefill_tp != mgr.attn_tp_size:
                mgr.imports.offer_slots(self.bootstrap_room, int(prefill_tp), blocks[KV_GROUP])
            if self._fail_if_auth_required():
                # A prefill rank answered the probe while the imports opened, too late for its listener to end
                # them (none was open yet): nothing was sent, so no write can come.
                mgr.imports.settle_imports(self.bootstrap_room, "a writer requires authentication")
                return None
        return super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, **kwargs)

    def poll(self) -> KVPoll:
        if self._final is not None:
            return self._final
        if self._links_used:
            self._fail_if_link_failed()
        status = super().poll()
        mgr = self.kv_mgr
        room = self.bootstrap_room
        if status == KVPoll.Success:
            unpacked = None
            if mgr.imports.import_ready(room):
                try:
                    mgr.imports.unpack(room)  # staged KV into the pages, before SGLang reads them
                except ValueError as e:
                    unpacked = str(e)
            if unpacked is None and mgr.imports.import_ready(room):
                mgr.imports.end_import(room, landed=True)
                self._final = KVPoll.Success
                return KVPoll.Success
            # Every prefill rank said Success (after its LANDED, on the same
            # socket) and is quiet, yet a component never landed (#39846).
            missing = mgr.imports.missing_components(room)
            mgr.imports.settle_imports(room, "prefill reported success")
            mgr.imports.end_import(room, landed=False)
            names = ", ".join(f"{c.kind.value}@group{c.group}" for c in missing) or "?"
            mgr.metrics.failure(FailureKind.INCOMPLETE)
            mgr.record_failure(room, f"prefill reported success but components [{names}] never landed"
                               if unpacked is None else f"hybridkv could not unpack the staged KV: {unpacked}")
            mgr.update_status(room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
            self._final = KVPoll.Failed
            return KVPoll.Failed
        if status != KVPoll.Failed:
            return status
        if self._published:
            # Failed is not drained: ask the prefill ranks to stop and to say DRAINED once nothing of the
            # room is in flight; the drain deadline runs from the room's first failure (the ledger's).
            mgr.imports.fail(room, "the room failed")
            self.ensure_abort_notified()
            if not mgr.imports.check_deadline(room):
                return KVPoll.Transferring
        mgr.imports.end_import(room, landed=False)
        self._final = KVPoll.Failed
        return KVPoll.Failed

    def _send_abort_notification(self, *, force_arm: bool = False):
        # Every path of SGLang's that sends the ABORT (abort, the waiting timeout, clear) comes here. The ABORT
        # names the import's generation (the manager's register_deferred_abort_room answers it too, where SGLang
        # arms its deferred release), so a prefill rank never fails a later request of the same room with it.
        if self._abort_generation is None:
            self._abort_generation = self.kv_mgr.imports.generation(self.bootstrap_room) or None
        super()._send_abort_notification(force_arm=force_arm)
        self.kv_mgr.imports.abort_sent(self.bootstrap_room)

    def abort(self) -> None:
        super().abort()
        # The engine gives the request up: its blocks go back to the scheduler,
        # which keeps any with an import in flight out of reuse.
        self.kv_mgr.imports.end_import(self.bootstrap_room, landed=False)

    def clear(self) -> None:
        super().clear()
        if self._final is None:
            self.kv_mgr.imports.end_import(self.bootstrap_room, landed=False)


class _Sealing:
    """What SGLang sends on the socket goes through the link: sealed, or held until the session is proven
    (SGLang sends under the socket's lock: in order)."""

    def __init__(self, sock, link: Link) -> None:
        self._sock = sock
        self._link = link

    def send_multipart(self, frames, *args, **kwargs):
        self._link.send(self._sock, list(frames))
