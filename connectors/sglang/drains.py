"""Prefill side: who is told when a room's writes are over.

A room is drained when no chunk of it is queued, being written or stuck (prefill_side.py). A decode
rank frees a room's pages only once every prefill rank that writes it said DRAINED (a Failed status
is not enough: a rank may fail a room while an earlier chunk of it is still being written), so every
decode rank that may wait is told DRAINED once the room is, with the generation of its import:

* one that sent an ABORT for the room (`wait`);
* every decode rank of a room that failed here (`fail`: refused chunk, failed or aborted WRITE,
  lapsed lease, SGLang's abort): told Failed at once, and DRAINED once drained;
* the decode ranks of a room that failed because its decode agent retired (retiring.py): they are
  told Failed only once drained (`fail_when_drained`), and DRAINED with it.

A room that ended here (SGLang's abort, which never clears the sender) leaves SGLang's claims (and
with them its authenticated session's room count) once drained (`end`).
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
        # decode ranks to tell DRAINED, with their import's generation (0: not known here)
        self._waiters: dict[int, dict[Endpoint, int]] = {}
        # Rooms failed by a retiring agent -> the reason and their decode ranks, told once drained. The ranks are
        # taken when it retires: SGLang may clear the room (and its transfer_infos) before it drains.
        self._fail_when_drained: dict[int, tuple[str, dict[Endpoint, int]]] = {}
        self._ending: set[int] = set()  # rooms whose claims go once drained

    def wait(self, room: int, decode: Endpoint, generation: int = 0) -> None:
        """That decode rank waits for the room's DRAINED (it sent an ABORT, or the room failed here)."""
        with self.lock:
            got = self._waiters.setdefault(room, {})
            got[decode] = generation or got.get(decode, 0)

    def fail(self, room: int, reason: str, *, end: bool = False) -> None:
        """The room failed on this rank: its decode ranks are told Failed now and DRAINED once nothing of it
        is in flight here. With `end` (SGLang ended the room without clearing it) its claims go then too."""
        with self.lock:
            gens = self.rooms.generations(room)
            for decode, gen in gens.items():
                self.wait(room, decode, gen)
            if end:
                self._ending.add(room)
        if self.rooms.conclude_failure(room, reason) is None and gens:
            self.rooms.send_status(list(gens), room, KVPoll.Failed, reason)  # no status here (cleared): told anyway
        self.maybe_send(room)

    def fail_when_drained(self, room: int, reason: str, targets: list[Endpoint]) -> None:
        with self.lock:
            gens = self.rooms.generations(room)
            self._fail_when_drained.setdefault(room, (reason, {t: gens.get(t, 0) for t in targets}))

    def failure_pending(self, room: int) -> bool:
        """The room's decode ranks are still to be told it failed."""
        with self.lock:
            return room in self._fail_when_drained

    def waiting(self) -> dict[int, set[Endpoint]]:
        """The rooms decode ranks wait on (a copy, for tests)."""
        with self.lock:
            return {room: set(w) for room, w in self._waiters.items()}

    def maybe_send(self, room: int) -> None:
        """If the room is drained, tell whoever waits for it."""
        with self.lock:
            if not self.drained(room):
                return
            waiters = self._waiters.pop(room, {})
            failed = self._fail_when_drained.pop(room, None)
            ending = room in self._ending
            self._ending.discard(room)
        if failed is not None:
            reason, targets = failed
            self._tell_failed(room, reason, list(targets))
            for t, gen in targets.items():
                waiters.setdefault(t, gen)
        rank = self.rooms.prefill_rank()
        for (ip, port), gen in waiters.items():
            frames = msgs.Drained(room=room, prefill_rank=rank, generation=gen).to_frames()
            self.rooms.push(ip, port, frames, f"DRAINED for room {room}")
        if ending:
            self.rooms.forget_claims(room)

    def _tell_failed(self, room: int, reason: str, targets: list[Endpoint]) -> None:
        """The room's decode ranks learn it failed (it is drained)."""
        if self.rooms.conclude_failure(room, reason, targets=targets) is None:
            # No sender, or cleared already (SGLang's conclude does nothing for a room without a status): told here.
            self.rooms.send_status(targets, room, KVPoll.Failed, reason)
