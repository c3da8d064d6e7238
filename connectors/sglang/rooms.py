"""SGLang's per-room state of one manager, as hybridkv's parts of it use it.

SGLang's ``CommonKVManager`` keeps each room's status (``request_status``), the decode
destinations that claimed it (``transfer_infos``, prefill side) and its failure record, and
has the calls that change them and tell the decode ranks (``update_status``,
``conclude_transfer``, KV_STATUS). `Rooms` is the one place that names them: the parts
(prefill_side.py, drains.py, retiring.py, registrations.py, peer_auth.py) are given a
`Rooms`, not the manager. Every method is SGLang's own call, unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Optional

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.utils.network import NetworkAddress

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]


class Rooms:
    """One manager's rooms, through SGLang's calls (the manager's overrides included:
    `notify_targets` is its ``_room_notify_targets``, `push` goes through its sealed
    ``_send_multipart_locked``)."""

    def __init__(self, mgr: CommonKVManager) -> None:
        self._mgr = mgr
        #: called with a room and the decode agents that claimed it when its claims are forgotten here (the
        #: authentication's per-session room count, peer_auth.py); set once the manager's parts exist
        self.on_forget: Callable[[int, frozenset[str]], None] = lambda room, agents: None

    # ------------------------------------------------------------ status
    def status(self, room: int) -> Optional[KVPoll]:
        """The room's status, None if SGLang has none (never made, or cleared)."""
        return self._mgr.request_status.get(room)

    def has_status(self, room: int) -> bool:
        return room in self._mgr.request_status

    def check_status(self, room: int) -> KVPoll:
        return self._mgr.check_status(room)

    def update_status(self, room: int, status: KVPoll) -> None:
        self._mgr.update_status(room, status)

    def failure(self, room: int) -> Optional[str]:
        """The room's recorded failure reason, or None."""
        with self._mgr.failure_lock:
            return self._mgr.failure_records.get(room)

    def record_failure(self, room: int, reason: str) -> None:
        self._mgr.record_failure(room, reason)

    def conclude_failure(self, room: int, reason: str,
                         targets: Optional[list[Endpoint]] = None) -> Optional[KVPoll]:
        """Record the reason, mark the room Failed and tell its decode ranks (`targets`, by default
        the room's); None if SGLang cleared the room already."""
        return self._mgr.conclude_failure(bootstrap_room=room, failure_reason=reason, targets=targets)

    def conclude_success(self, room: int) -> Optional[KVPoll]:
        return self._mgr.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)

    def send_status(self, targets: list[Endpoint], room: int, status: KVPoll, reason: Optional[str]) -> None:
        """SGLang's KV_STATUS to `targets`, whether or not the room has a status here."""
        self._mgr.send_kv_status_message(targets=targets, bootstrap_room=room, status=status, failure_reason=reason)

    # ------------------------------------------------------------ decode: what prefill ranks say
    def abort_ack(self, frames: list[bytes]) -> bool:
        """SGLang's ABORT_ACK handling; whether `frames` was one."""
        return self._mgr.handle_abort_ack_message(frames)

    def parse_status(self, frames: list[bytes]):
        """SGLang's KV_STATUS as (room, status, prefill rank, reason), or None."""
        return self._mgr.parse_kv_status_message(frames)

    def apply_prefill_status(self, room: int, status: KVPoll, rank: int, reason: Optional[str]) -> None:
        self._mgr.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank, failure_reason=reason)

    # ------------------------------------------------------------ prefill: who claimed the room
    def claimed(self, room: int) -> bool:
        return room in self._mgr.transfer_infos

    def infos(self, room: int) -> Optional[dict]:
        """The room's destinations (decode agent -> its METADATA), or None."""
        return self._mgr.transfer_infos.get(room)

    def claim(self, room: int) -> dict:
        """The room's destinations, created empty if none claimed it yet."""
        return self._mgr.transfer_infos.setdefault(room, {})

    def claimed_by(self, agent: str) -> frozenset[int]:
        return frozenset(r for r, infos in list(self._mgr.transfer_infos.items()) if agent in infos)

    def forget_claims(self, room: int) -> None:
        infos = self._mgr.transfer_infos.pop(room, None)
        if infos:
            self.on_forget(room, frozenset(infos))

    def generations(self, room: int) -> dict[Endpoint, int]:
        """The decode import generation each of the room's decode ranks sent with its METADATA (decode_side.py)."""
        return {(md.endpoint, md.port): md.generation
                for md in list((self._mgr.transfer_infos.get(room) or {}).values()) if not md.is_dummy}

    def set_decode_prefix_len(self, room: int, n: int) -> None:
        self._mgr.req_to_decode_prefix_len[room] = n

    def notify_targets(self, room: int) -> list[Endpoint]:
        """The room's decode ranks (ip, port), as SGLang tells them its statuses."""
        return self._mgr._room_notify_targets(room)

    # ------------------------------------------------------------ pushes to decode ranks
    def prefill_rank(self) -> int:
        """This rank's id in the messages it sends (SGLang's ``_prefill_unique_rank``)."""
        return self._mgr._prefill_unique_rank()

    def push(self, ip: str, port: int, frames: list[bytes], what: str) -> None:
        """Send `frames` to a decode rank on SGLang's socket (sealed where the manager seals); a failure is logged."""
        na = NetworkAddress(ip, port)
        try:
            self._mgr._send_multipart_locked(na.to_tcp(), frames, is_ipv6=na.is_ipv6)
        except Exception as e:
            logger.warning("hybridkv: %s to %s:%s failed: %s", what, ip, port, e)
