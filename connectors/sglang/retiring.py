"""Prefill side: a decode rank's NIXL agent leaves once nothing proven uses it.

An agent retires when its session ends and no live session took it over (evicted past
``max_sessions``; a session replaced by a new handshake from the same address keeps it), or when
the decode rank at its address registers another agent. Then:

* no chunk is planned for it any more (it leaves ``peers``);
* every room it claimed fails: its writes can never complete, and a room with several destination
  ranks (decode TP above prefill TP) fails for all of them, as one rank's failure fails the
  request on every decode rank anyway;
* each such room's decode ranks are told Failed only when no chunk of the room is queued, being
  written or stuck (drains.py), because a decode reads a terminal status as "nothing will land
  any more" and frees the pages; the ended session still seals that message (peer_auth.py);
* the agent is removed from NIXL (``DataPlane.remove_peer``: remove_remote_agent) at that point too,
  not before: this rank's WRITEs in flight name it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Optional

from hybridkv.connectors.sglang.drains import Drains
from hybridkv.connectors.sglang.prefill_side import PrefillExports
from hybridkv.connectors.sglang.rooms import Rooms
from hybridkv.transport.dataplane import DataPlane
from sglang.srt.disaggregation.base.conn import KVPoll

if TYPE_CHECKING:
    from hybridkv.connectors.sglang.registrations import Peer
    from hybridkv.transport.piece_lists import PieceLists

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Retiring:
    rooms: frozenset[int]  # rooms it claimed, which fail; it is removed when none of them is drained
    reason: str
    kv_lists: Optional[PieceLists] = None  # its prepped lists (different TP), released with it


class RetiringAgents:
    """The prefill manager's retiring decode agents. Given SGLang's rooms, the registered peers (an agent that
    retires leaves them), the exports and drains of its rooms, the data plane it is removed from, and the lock
    the drains are read under. The authentication (an ended session) and the registrations (a decode rank
    that registered another agent) call `retire`; the control thread calls `reap`."""

    def __init__(self, *, rooms: Rooms, peers: MutableMapping[str, Peer], exports: PrefillExports, drains: Drains,
                 dp: DataPlane, lock: threading.RLock) -> None:
        self.rooms = rooms
        self.peers = peers
        self.exports = exports
        self.drains = drains
        self.dp = dp
        self.lock = lock
        self._retiring: dict[str, _Retiring] = {}

    def agents(self) -> list[str]:
        """The agents retiring now, sorted (for tests)."""
        with self.lock:
            return sorted(self._retiring)

    def retire(self, agent: str, reason: str) -> None:
        peer = self.peers.pop(agent, None)
        if peer is None:
            return
        rooms = self.rooms.claimed_by(agent)
        targets = {room: self.rooms.notify_targets(room) for room in rooms}
        with self.lock:
            self._retiring[agent] = _Retiring(rooms=rooms, reason=reason, kv_lists=peer.kv_lists)
            for room in rooms:
                self.drains.fail_when_drained(room, f"hybridkv: {reason}", targets[room])
        logger.warning("hybridkv: decode agent %s retires (%s); %d room(s) fail", agent, reason, len(rooms))
        for room in rooms:
            self.rooms.record_failure(room, f"hybridkv: {reason}")
            self.rooms.update_status(room, KVPoll.Failed)  # nothing more is posted for it; no status yet: none made
            self.exports.retire_export(room)
            self.drains.maybe_send(room)
        self.reap()

    def reap(self) -> None:
        """Remove the retiring agents none of whose rooms has a write queued, running or stuck."""
        if not self._retiring:
            return
        with self.lock:
            done = [a for a, r in self._retiring.items()
                    if all(self.exports.drained(room) and not self.drains.failure_pending(room) for room in r.rooms)]
            gone = [self._retiring.pop(a) for a in done]
        for a, r in zip(done, gone):
            if r.kv_lists is not None:
                r.kv_lists.release()  # nothing of the agent runs: its rooms drained
            try:
                self.dp.remove_peer(a)
            except Exception as e:  # NIXL's own error: the agent stays loaded, nothing else depends on it
                logger.warning("hybridkv: removing decode agent %s from NIXL failed: %s", a, e)
            else:
                logger.info("hybridkv: decode agent %s removed from NIXL", a)
