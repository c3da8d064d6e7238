"""Renewable leases on exported blocks (fencing rule 6 of docs/design.md).

A producer keeps a finished request's blocks for its consumer only under a
lease: the consumer renews it with heartbeats, and when it lapses the blocks
are released, so a vanished consumer cannot pin memory forever. The other
half of the rule belongs to the reader: it never starts a read it cannot
finish before the lease deadline (:meth:`LeaseTable.fits`).

Time comes from an injectable clock (``Callable[[], float]`` seconds,
``time.monotonic`` by default) so tests and simulators drive it. A consumer
that learns a lease duration over the network must place the deadline in its
own clock conservatively: *the time it sent the request that produced the
grant* plus the granted duration, never the time the answer arrived.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from hybridkv.ids import RequestId

Clock = Callable[[], float]


@dataclass(frozen=True, kw_only=True)
class LeaseGrant:
    """A granted or renewed lease: the holder may use the blocks until ``deadline``."""

    request: RequestId
    deadline: float


class LeaseTable:
    """Deadlines per request, with expiry found in O(expired · log n)."""

    __slots__ = ("duration_s", "_clock", "_deadline", "_heap")

    def __init__(self, *, duration_s: float, clock: Clock) -> None:
        if not duration_s > 0:
            raise ValueError(f"lease duration {duration_s!r} s; expected a positive number")
        self.duration_s = float(duration_s)
        self._clock = clock
        self._deadline: dict[RequestId, float] = {}
        # (deadline, request); stale entries (renewed leases) are skipped on pop.
        self._heap: list[tuple[float, RequestId]] = []

    def now(self) -> float:
        return self._clock()

    def grant(self, request: RequestId) -> LeaseGrant:
        deadline = self._clock() + self.duration_s
        self._deadline[request] = deadline
        heapq.heappush(self._heap, (deadline, request))
        return LeaseGrant(request=request, deadline=deadline)

    def renew(self, request: RequestId) -> LeaseGrant | None:
        """Extend a live lease; None if it is unknown or already lapsed."""
        old = self._deadline.get(request)
        now = self._clock()
        if old is None or now > old:
            return None
        return self.grant(request)

    def deadline(self, request: RequestId) -> float | None:
        return self._deadline.get(request)

    def fits(self, request: RequestId, duration_s: float) -> bool:
        """A read of ``duration_s`` started now finishes inside the lease."""
        d = self._deadline.get(request)
        return d is not None and self._clock() + duration_s <= d

    def end(self, request: RequestId) -> None:
        self._deadline.pop(request, None)

    def expire(self) -> list[RequestId]:
        """Drop and return every lease whose deadline has passed."""
        now = self._clock()
        heap = self._heap
        out: list[RequestId] = []
        while heap and heap[0][0] < now:
            deadline, request = heapq.heappop(heap)
            if self._deadline.get(request) == deadline:
                del self._deadline[request]
                out.append(request)
        return out

    def __len__(self) -> int:
        return len(self._deadline)
