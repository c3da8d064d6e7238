"""Prefill side: a decode rank's NIXL agent leaves once nothing proven uses it.

An agent retires when its session ends and no live session took it over (evicted past
``max_sessions``; a session replaced by a new handshake from the same address keeps it), or when
the decode rank at its address registers another agent. Then:

* no chunk is planned for it any more (it leaves ``peers``);
* every room it claimed fails: its writes can never complete, and a room with several destination
  ranks (decode TP above prefill TP) fails for all of them, as one rank's failure fails the
  request on every decode rank anyway;
* each such room's decode ranks are told Failed only when no chunk of the room is queued, being
  written or stuck (``drained``), because a decode reads a terminal status as "nothing will land
  any more" and frees the pages; the ended session still seals that message (sessions.py);
* the decode rank is told its session ended (if it was evicted rather than replaced), so that it
  registers again before its next room there;
* the agent is removed from NIXL (``DataPlane.remove_peer``: remove_remote_agent) at that point too,
  not before: this rank's WRITEs in flight name it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Optional

from hybridkv.connectors.sglang import messages as msgs
from hybridkv.connectors.sglang.sessions import MAX_SESSIONS, Session
from sglang.srt.disaggregation.base.conn import KVPoll

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Retiring:
    rooms: frozenset[int]  # rooms it claimed, which fail; it is removed when none of them is drained
    reason: str


class RetiringAgents:
    """Mixin of HybridKVManager (prefill mode, with a secret). The control thread calls it."""

    def _init_retiring(self) -> None:
        self._retiring: dict[str, _Retiring] = {}
        # Rooms failed by a retiring agent -> the reason and their decode ranks, told once drained. The ranks are
        # taken when it retires: SGLang may clear the room (and its transfer_infos) before it drains.
        self._fail_when_drained: dict[int, tuple[str, list[tuple[str, int]]]] = {}
        # Sessions that ended, by the decode's ZMQ endpoint: what is still told to a decode rank whose session
        # ended (its rooms' Failed) is sealed with them; bounded, the oldest forgotten first.
        self._ended: OrderedDict[str, Session] = OrderedDict()

    def session_for(self, endpoint: str) -> Optional[Session]:
        """The session that seals a push to `endpoint`: the live one, else the last one that ended."""
        return self.gate.by_peer.get(endpoint) or self._ended.get(endpoint)

    def _session_ended(self, session: Session) -> None:
        """PrefillGate's on_end."""
        self._ended.pop(session.tcp, None)
        self._ended[session.tcp] = session
        while len(self._ended) > MAX_SESSIONS:
            self._ended.popitem(last=False)
        if self.gate.by_peer.get(session.tcp) is None:
            # Evicted, not replaced: the decode rank does not know, and would seal its next METADATA with it.
            self._push(*session.peer, msgs.SessionEnded(prefill_rank=self._prefill_unique_rank()).to_frames(),
                       "the end of its session")
        agent = session.agent
        if agent is None or self.gate.agent_owner(agent) is not None:
            return  # it never registered, or the session that replaced it took the agent over
        self._retire_agent(agent, f"the authenticated session of decode rank {session.peer[0]}:{session.peer[1]} "
                                  f"ended (more than max_sessions = {self.config.max_sessions} decode ranks, or "
                                  "replaced); its NIXL agent is removed")

    def _retire_agent(self, agent: str, reason: str) -> None:
        if self.peers.pop(agent, None) is None:
            return
        rooms = frozenset(r for r, infos in list(self.transfer_infos.items()) if agent in infos)
        targets = {room: self._room_notify_targets(room) for room in rooms}
        with self.sched_lock:
            self._retiring[agent] = _Retiring(rooms=rooms, reason=reason)
            for room in rooms:
                self._fail_when_drained.setdefault(room, (f"hybridkv: {reason}", targets[room]))
        logger.warning("hybridkv: decode agent %s retires (%s); %d room(s) fail", agent, reason, len(rooms))
        for room in rooms:
            self.record_failure(room, f"hybridkv: {reason}")
            self.update_status(room, KVPoll.Failed)  # nothing more is posted for it; no status yet: none made
            self.retire_export(room)
            self._maybe_send_drained(room)
        self._reap_retired()

    def _drained(self, room: int) -> bool:
        """Hold sched_lock."""
        return self._inflight.get(room, 0) == 0 and not any(st.room == room for st in self._stuck.values())

    def _tell_failed(self, room: int, failed: tuple[str, list[tuple[str, int]]]) -> None:
        """The room's decode ranks learn it failed (it is drained)."""
        reason, targets = failed
        if self.conclude_failure(bootstrap_room=room, failure_reason=reason, targets=targets) is None:
            # No sender, or cleared already (SGLang's conclude does nothing for a room without a status): told here.
            self.send_kv_status_message(targets=targets, bootstrap_room=room, status=KVPoll.Failed,
                                        failure_reason=reason)

    def _reap_retired(self) -> None:
        """Remove the retiring agents none of whose rooms has a write queued, running or stuck."""
        with self.sched_lock:
            done = [a for a, r in self._retiring.items()
                    if all(self._drained(room) and room not in self._fail_when_drained for room in r.rooms)]
            for a in done:
                del self._retiring[a]
        for a in done:
            try:
                self.dp.remove_peer(a)
            except Exception as e:  # NIXL's own error: the agent stays loaded, nothing else depends on it
                logger.warning("hybridkv: removing decode agent %s from NIXL failed: %s", a, e)
            else:
                logger.info("hybridkv: decode agent %s removed from NIXL", a)
