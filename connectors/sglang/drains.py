"""Prefill side: who is told when a room's writes are over.

A room is drained when no chunk of it is queued, being written or stuck (prefill_side.py). Two
kinds of decode rank wait for that: one that sent an ABORT for the room (it holds its pages until
this rank's DRAINED), and the decode ranks of a room that failed because its decode agent retired
(retiring.py): they are told Failed only once drained, because a decode reads a terminal status as
"nothing will land any more" and frees the pages.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hybridkv.connectors.sglang import messages as msgs
from hybridkv.connectors.sglang.rooms import Endpoint, Rooms
from sglang.srt.disaggregation.base.conn import KVPoll


class Drains:
    """Given SGLang's rooms, `drained` (the exports' answer) and the lock `drained` is read under."""

    def __init__(self, *, rooms: Rooms, drained: Callable[[int], bool], lock: threading.RLock) -> None:
        self.rooms = rooms
        self.drained = drained
        self.lock = lock
        self._waiters: dict[int, set[Endpoint]] = {}  # decode ranks that sent an ABORT for the room
        # Rooms failed by a retiring agent -> the reason and their decode ranks, told once drained. The ranks are
        # taken when it retires: SGLang may clear the room (and its transfer_infos) before it drains.
        self._fail_when_drained: dict[int, tuple[str, list[Endpoint]]] = {}

    def wait(self, room: int, decode: Endpoint) -> None:
        """That decode rank sent an ABORT for the room: it is told DRAINED once the room is."""
        with self.lock:
            self._waiters.setdefault(room, set()).add(decode)

    def fail_when_drained(self, room: int, reason: str, targets: list[Endpoint]) -> None:
        with self.lock:
            self._fail_when_drained.setdefault(room, (reason, targets))

    def failure_pending(self, room: int) -> bool:
        """The room's decode ranks are still to be told it failed."""
        with self.lock:
            return room in self._fail_when_drained

    def waiting(self) -> dict[int, set[Endpoint]]:
        """The rooms decode ranks wait on (a copy, for tests)."""
        with self.lock:
            return dict(self._waiters)

    def maybe_send(self, room: int) -> None:
        """If the room is drained, tell whoever waits for it."""
        with self.lock:
            if not self.drained(room):
                return
            waiters = self._waiters.pop(room, None)
            failed = self._fail_when_drained.pop(room, None)
        if failed is not None:
            self._tell_failed(room, failed)
        frames = msgs.Drained(room=room, prefill_rank=self.rooms.prefill_rank()).to_frames()
        for ip, port in waiters or ():
            self.rooms.push(ip, port, frames, f"DRAINED for room {room}")

    def _tell_failed(self, room: int, failed: tuple[str, list[Endpoint]]) -> None:
        """The room's decode ranks learn it failed (it is drained)."""
        reason, targets = failed
        if self.rooms.conclude_failure(room, reason, targets=targets) is None:
            # No sender, or cleared already (SGLang's conclude does nothing for a room without a status): told here.
            self.rooms.send_status(targets, room, KVPoll.Failed, reason)
