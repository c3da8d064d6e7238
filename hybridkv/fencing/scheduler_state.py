"""The scheduler's records and its read-only queries.

:class:`_SchedulerState` holds what a :class:`~hybridkv.fencing.scheduler.TransferScheduler`
knows: the fence table, the block pool, the export leases, and a record per live
request and per transfer in flight. The rules that change them live beside it:
:mod:`hybridkv.fencing.scheduler_steps` (requests and steps) and
:mod:`hybridkv.fencing.scheduler_transfers` (imports, exports, leases). The design, and
the API in one page, is in :mod:`hybridkv.fencing.scheduler`.

Nothing here imports torch or an engine.
"""

from __future__ import annotations

import time

from hybridkv.fencing.block_pool import BlockPool
from hybridkv.fencing.fence import (
    BlockId,
    FencePolicy,
    FenceTable,
    NotYet,
    NotYetReason,
    PoolLayout,
    RequestId,
    TransferId,
)
from hybridkv.fencing.lease import Clock, LeaseTable
from hybridkv.fencing.request_state import (
    Component,
    RequestPhase,
    RequestRecord,
    TransferDirection,
    TransferRecord,
)

# Enum members as module constants: an attribute of an Enum class costs several
# times a global lookup, and the rules test phases on every call.
_LOCAL = RequestPhase.LOCAL
_IMPORTING = RequestPhase.IMPORTING
_READY = RequestPhase.READY
_RUNNING = RequestPhase.RUNNING
_EXPORTING = RequestPhase.EXPORTING
_FAILED = RequestPhase.FAILED
_INBOUND = TransferDirection.INBOUND
_OUTBOUND = TransferDirection.OUTBOUND

_PENDING = NotYet(reason=NotYetReason.PENDING_STEP)
_BUSY = NotYet(reason=NotYetReason.TRANSFER_IN_FLIGHT)
_EXHAUSTED = NotYet(reason=NotYetReason.POOL_EXHAUSTED)
_SHORT = NotYet(reason=NotYetReason.LEASE_TOO_SHORT)
_INCOMPLETE = NotYet(reason=NotYetReason.INCOMPLETE)


class _SchedulerState:
    """The records every rule reads; the rules are the subclasses' (see TransferScheduler)."""

    def __init__(
        self,
        layout: PoolLayout,
        *,
        policy: FencePolicy = FencePolicy.FENCED,
        lease_s: float = 30.0,
        clock: Clock = time.monotonic,
        managed_pool: bool = True,
    ) -> None:
        if not isinstance(layout, PoolLayout):
            raise ValueError(f"layout {layout!r}; expected a PoolLayout")
        if not isinstance(policy, FencePolicy):
            raise ValueError(f"policy {policy!r}; expected a FencePolicy")
        self.layout = layout
        self.policy = policy
        self._fenced = policy is FencePolicy.FENCED
        self.table = FenceTable(layout)
        self.pool = BlockPool(self.table, fenced=self._fenced, managed=managed_pool)
        self.leases = LeaseTable(duration_s=lease_s, clock=clock)
        self._clock = clock
        self._requests: dict[RequestId, RequestRecord] = {}
        self._transfers: dict[TransferId, TransferRecord] = {}
        self._next_tid = 0
        # Keys an inbound transfer has been posted into since they were allocated:
        # zeroing them later would erase received bytes (Race B), so it is skipped.
        self._imported: set[int] = set()
        # First key of each pool, to turn keys back into block ids.
        self._pool_base = [self.table.pool_keys(p).start for p in range(len(layout.pool_sizes))]
        # Sorted groups of each component set imports were posted for (components are immutable).
        self._sorted_groups: dict[frozenset[Component], tuple[int, ...]] = {}
        # Expectation sets already validated by add_request.
        self._valid_expect: set[frozenset[Component]] = set()

    # ------------------------------------------------------------------ queries
    @property
    def watermark(self) -> int:
        return self.table.watermark

    @property
    def scheduled_step(self) -> int:
        return self.table.scheduled

    def has_request(self, request: RequestId) -> bool:
        return request in self._requests

    def phase(self, request: RequestId) -> RequestPhase:
        return self._get(request).phase

    def blocks(self, request: RequestId, group: int) -> tuple[BlockId, ...]:
        rec = self._get(request)
        b = self.table.block_of
        return tuple(BlockId(b(k)) for k in rec.blocks.get(group, ()))

    def request_ids(self) -> list[RequestId]:
        return list(self._requests)

    def arrived(self, request: RequestId) -> frozenset[Component]:
        """Components of the request whose inbound transfer landed."""
        return frozenset(self._get(request).arrived)

    def holder(self, group: int, block: int) -> RequestId | None:
        """The live request holding a block, or None (free, or fenced after a free)."""
        h = self.table.holder[self.table.key(group, block)]
        return None if h is None else h.id  # type: ignore[attr-defined]

    def is_ready(self, request: RequestId) -> bool:
        """Rule 4: may the request join a step now?"""
        rec = self._requests.get(request)
        if rec is None:
            self._get(request)  # raises, naming the request
        phase = rec.phase  # type: ignore[union-attr]
        return phase is _LOCAL or phase is _READY

    def free_count(self, pool: int = 0) -> int:
        return self.pool.free_count(pool)

    def transfers_in_flight(self) -> int:
        return len(self._transfers)

    def requests_in_flight(self) -> int:
        return len(self._requests)

    def take_reusable(self) -> list[tuple[int, BlockId]]:
        """Engine-owned pools: (pool, block) pairs now safe to hand out again."""
        t = self.table
        return [(t.pool_of_key(k), BlockId(t.block_of(k))) for k in self.pool.take_reusable()]

    # ----------------------------------------------------------------- records
    def _drop(self, rec: RequestRecord) -> None:
        del self._requests[rec.id]
        t = self.table
        # The request is retired (not resident): its blocks' fence is at least its last step.
        hs = rec.last_step
        fence, holder, imported = t.fence, t.holder, self._imported
        keys: list[int] = []
        for ks in rec.blocks.values():
            keys += ks
        uniform = True  # every block's fence is now hs
        for k in keys:
            f = fence[k]
            if hs > f:
                fence[k] = hs
            elif f != hs:
                uniform = False
            holder[k] = None
        if imported:
            imported.difference_update(keys)
        if rec.transfers:
            transfers = self._transfers
            for tid in rec.transfers:
                transfers[tid].orphaned = True
            self.pool.park_many(keys)
        elif uniform:
            # Idle: a block stays quarantined (parked) while any transfer reads or
            # writes it, so a held block's only transfers are its holder's - none here.
            self.pool.park_idle(keys, hs)
        else:
            self.pool.park_many(keys)
        rec.blocks.clear()

    # -------------------------------------------------------------- invariants
    def audit(self) -> None:
        """Check internal consistency; RuntimeError on a broken invariant."""
        t = self.table
        total = self.layout.total_blocks
        held = [0] * total
        for rec in self._requests.values():
            for g, keys in rec.blocks.items():
                for k in keys:
                    held[k] += 1
                    if t.holder[k] is not rec:
                        raise RuntimeError(f"block key {k} of group {g} listed by {rec.id!r} but held by another")
        readers = [0] * total
        writers = [0] * total
        for tr in self._transfers.values():
            c = writers if tr.direction is TransferDirection.INBOUND else readers
            for k in tr.keys:
                c[k] += 1
        if readers != t.readers or writers != t.writers:
            raise RuntimeError("transfer reader/writer counts disagree with the fence table")
        if self.pool.managed:
            for k in range(total):
                states = held[k] + self.pool.is_parked(k) + self.pool.is_free(k)
                if states != 1:
                    raise RuntimeError(
                        f"block key {k}: held {held[k]}, parked {self.pool.is_parked(k)}, "
                        f"free {self.pool.is_free(k)}; expected exactly one"
                    )

    def _get(self, request: RequestId) -> RequestRecord:
        rec = self._requests.get(request)
        if rec is None:
            raise ValueError(f"request {request!r} is unknown; expected a live request id")
        return rec


__all__: list[str] = []
