"""A work queue of FIFO lanes, shared by every worker: one lane per peer, so a stalled peer holds one worker.

Used by the SGLang prefill's workers (one lane per room's decode peers). A chunk is written to the
decode ranks that claimed its room, and a worker waits for those WRITEs to end before it takes another. Sharded by room, one slow decode held the worker of every
room that hashed with one of its rooms, on every decode instance (head-of-line blocking). Here a
chunk joins the lane of its room's decode peers; an idle worker takes the next chunk of the lane
that has waited longest, and a lane is worked on by one worker at a time. So a room's chunks are
written in order (its lane is fixed while any of them is queued or being written), and a decode
that stalls holds one worker: with ``workers`` threads, up to ``workers - 1`` stalled decodes
delay no other decode.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable
from typing import Generic, Optional, TypeVar

T = TypeVar("T")


class Lanes(Generic[T]):
    """FIFO lanes of items, keyed by any hashable; `take` hands out one item of a lane no worker holds."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[Hashable, deque[T]] = {}
        self._ready: deque[Hashable] = deque()  # lanes with items that no worker holds, longest waiting first
        self._busy: set[Hashable] = set()

    def put(self, lane: Hashable, item: T) -> None:
        with self._cond:
            items = self._items.get(lane)
            if items is None:
                items = self._items[lane] = deque()
            items.append(item)
            if lane not in self._busy and len(items) == 1:
                self._ready.append(lane)
                self._cond.notify()

    def take(self, timeout: float) -> Optional[tuple[Hashable, T]]:
        """The next item of the lane that waited longest, which the caller now holds until `done(lane)`;
        None if none came within `timeout` seconds."""
        with self._cond:
            if not self._ready and not self._cond.wait_for(lambda: bool(self._ready), timeout):
                return None
            lane = self._ready.popleft()
            self._busy.add(lane)
            return lane, self._items[lane].popleft()

    def done(self, lane: Hashable) -> None:
        """The caller finished the item it took from `lane`: the lane's next item may go to any worker."""
        with self._cond:
            self._busy.discard(lane)
            if self._items.get(lane):
                self._ready.append(lane)  # behind the lanes already waiting
                self._cond.notify()
            else:
                self._items.pop(lane, None)

    def queued(self) -> int:
        """Items waiting in every lane (not those being worked on)."""
        with self._cond:
            return sum(len(q) for q in self._items.values())
