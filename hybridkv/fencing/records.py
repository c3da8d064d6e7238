"""What a transfer scheduler knows: its fence table, block pool, leases, and a record per
live request and per transfer in flight.

:class:`SchedulerRecords` holds that state and the operations every rule shares: finding
a request (:meth:`~SchedulerRecords.require`), retiring one's blocks
(:meth:`~SchedulerRecords.drop`) and checking the whole for consistency
(:meth:`~SchedulerRecords.audit`). The rules that change it are its collaborators:
:class:`~hybridkv.fencing.steps.RequestSteps` (requests and steps) and
:class:`~hybridkv.fencing.transfers.TransferRules` (imports, exports, leases). The design,
and the API in one page, is in :mod:`hybridkv.fencing.scheduler`.

Nothing here imports torch or an engine.
"""

from __future__ import annotations

import time

from hybridkv.fencing.block_pool import BlockPool
from hybridkv.fencing.fence import FencePolicy, FenceTable, PoolLayout
from hybridkv.fencing.lease import Clock, LeaseTable
from hybridkv.fencing.request_state import RequestRecord, TransferDirection, TransferRecord
from hybridkv.ids import RequestId, TransferId

_INBOUND = TransferDirection.INBOUND


class SchedulerRecords:
    """The state of one :class:`~hybridkv.fencing.scheduler.TransferScheduler`, shared by its rules.

    The rules keep references to the containers (they are never replaced) so a hot
    path reads them in one attribute lookup; only ``next_tid`` is rebound.
    """

    __slots__ = (
        "layout",
        "policy",
        "fenced",
        "clock",
        "table",
        "pool",
        "leases",
        "requests",
        "transfers",
        "next_tid",
        "imported",
        "pool_base",
    )

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
        self.fenced = policy is FencePolicy.FENCED
        self.clock = clock
        self.table = FenceTable(layout)
        self.pool = BlockPool(self.table, fenced=self.fenced, managed=managed_pool)
        self.leases = LeaseTable(duration_s=lease_s, clock=clock)
        self.requests: dict[RequestId, RequestRecord] = {}
        self.transfers: dict[TransferId, TransferRecord] = {}
        self.next_tid = 0
        # Keys an inbound transfer has been posted into since they were allocated:
        # zeroing them later would erase received bytes (Race B), so it is skipped.
        self.imported: set[int] = set()
        # First key of each pool, to turn keys back into block ids.
        self.pool_base = [self.table.pool_keys(p).start for p in range(len(layout.pool_sizes))]

    def require(self, request: RequestId) -> RequestRecord:
        """The live request's record; ValueError naming it if there is none."""
        rec = self.requests.get(request)
        if rec is None:
            raise ValueError(f"request {request!r} is unknown; expected a live request id")
        return rec

    def drop(self, rec: RequestRecord) -> None:
        """Forget a request; its blocks go back to the pool once the rules allow."""
        del self.requests[rec.id]
        t = self.table
        # The request is retired (not resident): its blocks' fence is at least its last step.
        hs = rec.last_step
        fence, holder, imported = t.fence, t.holder, self.imported
        keys: list[int] = []
        for ks in rec.blocks.values():
            keys += ks
        if t.sharers:
            # Rule 7: blocks another request still holds lose this hold only.
            release_hold = t.release_hold
            keys = [k for k in keys if release_hold(k, rec)]
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
        # A transfer may read or write these blocks: this request's own, or one that outlived its request
        # (another holder's read of a shared block, a transfer of a quarantined block a prefix hit took back).
        readers, writers = t.readers, t.writers
        busy = bool(rec.transfers) or any(map(readers.__getitem__, keys)) or any(map(writers.__getitem__, keys))
        if rec.transfers:
            transfers = self.transfers
            for tid in rec.transfers:
                transfers[tid].orphaned = True
        if busy or not uniform:
            self.pool.park_many(keys)  # per block: quarantined while a transfer touches it
        else:
            self.pool.park_idle(keys, hs)  # idle and one fence: one entry, no per-block checks
        rec.blocks.clear()

    def audit(self) -> None:
        """Check internal consistency; RuntimeError on a broken invariant."""
        t = self.table
        total = self.layout.total_blocks
        held = [0] * total
        for rec in self.requests.values():
            for g, keys in rec.blocks.items():
                for k in keys:
                    held[k] += 1
                    if not any(h is rec for h in t.holders(k)):
                        raise RuntimeError(f"block key {k} of group {g} listed by {rec.id!r} but held by others")
        for k in range(total):
            if t.hold_count(k) != held[k]:
                raise RuntimeError(f"block key {k}: {t.hold_count(k)} holds recorded, {held[k]} listed by requests")
        for k, more in t.sharers.items():
            if not more or t.holder[k] is None:
                raise RuntimeError(f"block key {k}: sharers {more!r} without a first holder")
        readers = [0] * total
        writers = [0] * total
        for tr in self.transfers.values():
            c = writers if tr.direction is _INBOUND else readers
            for k in tr.keys:
                c[k] += 1
        if readers != t.readers or writers != t.writers:
            raise RuntimeError("transfer reader/writer counts disagree with the fence table")
        if self.pool.managed:
            for k in range(total):
                free = self.pool.is_free(k)
                states = (held[k] > 0) + self.pool.is_parked(k) + free
                if states != 1:
                    raise RuntimeError(
                        f"block key {k}: held {held[k]}, parked {self.pool.is_parked(k)}, "
                        f"free {free}; expected exactly one"
                    )
                if free and self.fenced and (readers[k] or writers[k]):
                    raise RuntimeError(
                        f"block key {k} is free with {readers[k]} reader(s) and {writers[k]} writer(s) in flight; "
                        "expected a free block no transfer touches"
                    )



class RecordsView:
    """A part of the scheduler that applies rules to one set of records.

    The records' containers are copied onto the part, one attribute lookup away on the
    per-step paths (they are never replaced, so the copies cannot go stale)."""

    __slots__ = ("_records", "_requests", "_table", "_pool", "_leases", "_imported", "_fenced")

    def __init__(self, records: SchedulerRecords) -> None:
        self._records = records
        self._requests = records.requests
        self._table = records.table
        self._pool = records.pool
        self._leases = records.leases
        self._imported = records.imported
        self._fenced = records.fenced

__all__ = ["RecordsView", "SchedulerRecords"]
