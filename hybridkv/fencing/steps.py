"""Requests and steps: the rules a worker applies as its engine schedules.

Blocks enter a request (``add_request``, ``allocate``, ``assign``), steps fence
them (``step_scheduled``, ``step_completed``) and blocks leave it
(``free_blocks``, ``request_finished``, ``abort``, ``recompute``).
:class:`RequestSteps` applies them to a :class:`~hybridkv.fencing.records.SchedulerRecords`
on behalf of :class:`~hybridkv.fencing.scheduler.TransferScheduler`, which documents
them; the design is in :mod:`hybridkv.fencing.scheduler`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from hybridkv.fencing.fence import NotYet, NotYetReason
from hybridkv.fencing.lease import LeaseGrant
from hybridkv.fencing.records import RecordsView, SchedulerRecords
from hybridkv.fencing.request_state import Component, RequestPhase, RequestRecord
from hybridkv.ids import BlockId, RequestId

BlockRef = tuple[int, int]  # (group, block id)

# Enum members as module constants: an attribute of an Enum class costs several
# times a global lookup, and the rules test phases on every call.
_LOCAL = RequestPhase.LOCAL
_IMPORTING = RequestPhase.IMPORTING
_READY = RequestPhase.READY
_RUNNING = RequestPhase.RUNNING
_EXPORTING = RequestPhase.EXPORTING
_FAILED = RequestPhase.FAILED

_EXHAUSTED = NotYet(reason=NotYetReason.POOL_EXHAUSTED)


def _extend_held(rec: RequestRecord, group: int, keys: list[int]) -> None:
    held = rec.blocks.get(group)
    if held is None:
        rec.blocks[group] = keys
    else:
        held.extend(keys)


def _check_ids(blocks: Collection[int], pool: int, size: int) -> None:
    """ValueError unless every id is an int block id of a pool of ``size`` blocks."""
    bad = [b for b in blocks if b.__class__ is not int or not 0 <= b < size]
    if bad:
        raise ValueError(f"blocks {bad[:8]!r} of pool {pool}; expected block ids (int) in [0, {size})")


@dataclass(frozen=True, kw_only=True)
class StepTicket:
    """What the engine must know about a step it just scheduled."""

    step: int
    #: zeroing requested for blocks an inbound transfer writes or wrote: do not run it.
    skip_zeroing: tuple[BlockRef, ...] = ()


class RequestSteps(RecordsView):
    """Request lifecycle and step fencing over one set of records."""

    __slots__ = ("_pool_base", "_group_pools", "_managed", "_expect_sets")

    def __init__(self, records: SchedulerRecords) -> None:
        super().__init__(records)
        self._pool_base = records.pool_base
        self._group_pools = records.layout.group_pools
        self._managed = records.pool.managed
        # Expectation sets add_request validated, by the set and by the tuple the caller
        # passed (a connector passes one tuple for every remote request): one shared set
        # per expectation, and no set built or checked again.
        self._expect_sets: dict[tuple[Component, ...] | frozenset[Component], frozenset[Component]] = {}

    # ---------------------------------------------------------------- requests
    def add_request(self, request: RequestId, expect: Iterable[Component]) -> None:
        requests = self._requests
        if request in requests:
            raise ValueError(f"request {request!r} already exists; expected a new request id")
        sets = self._expect_sets
        expected = sets.get(expect) if expect.__class__ is tuple else None
        if expected is None:
            given = frozenset(expect)
            expected = sets.get(given)
            if expected is None:
                ngroups = len(self._group_pools)
                for c in given:
                    if not isinstance(c, Component) or not 0 <= c.group < ngroups:
                        raise ValueError(
                            f"component {c!r} of request {request!r}; expected a Component of a group "
                            f"in [0, {ngroups})"
                        )
                expected = sets[given] = given
            if expect.__class__ is tuple:
                sets[expect] = expected
        requests[request] = RequestRecord(id=request, phase=_IMPORTING if expected else _LOCAL, expected=expected)

    def allocate(self, request: RequestId, group: int, n: int) -> tuple[BlockId, ...] | NotYet:
        rec = self._requests.get(request)
        if rec is None:
            rec = self._records.require(request)  # raises, naming the request
        if not self._managed:
            raise ValueError("allocate() on an engine-owned pool; expected assign()")
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n = {n!r}; expected a non-negative int")
        pools = self._group_pools
        if not isinstance(group, int) or not 0 <= group < len(pools):
            raise ValueError(f"group {group!r}; expected a group index in [0, {len(pools)})")
        pool = pools[group]
        keys = self._pool.take(pool, n)
        if keys is None:
            return _EXHAUSTED
        holder = self._table.holder  # _hold, inlined: allocate runs several times per request per step
        for k in keys:
            holder[k] = rec
        held = rec.blocks.get(group)
        if held is None:
            rec.blocks[group] = list(keys)
        else:
            held.extend(keys)
        base = self._pool_base[pool]
        if base == 0:
            return tuple(keys)  # type: ignore[return-value]
        return tuple([k - base for k in keys])  # type: ignore[return-value]

    def assign(self, request: RequestId, group: int, blocks: Sequence[int]) -> None:
        rec = self._records.require(request)
        t = self._table
        keys = [t.key(group, b) for b in blocks]
        if len(set(keys)) != len(keys):
            raise ValueError(f"blocks {list(blocks)!r}; expected distinct block ids")
        holder = t.holder
        pool = self._pool
        mine: set[int] | None = None
        for k in keys:
            h = holder[k]
            if h is None:
                pool.adopt(k)  # free (or parked: raises)
                continue
            # Rule 7: a block another live request holds (a cached prefix) gets one more hold.
            if mine is None:
                mine = {k for ks in rec.blocks.values() for k in ks}
            if k in mine:
                raise ValueError(
                    f"block {t.block_of(k)} of group {group} is already held by request {request!r}; "
                    "expected a block it does not hold"
                )
            self._refuse_written(k, group, request)
        for k in keys:
            t.add_hold(k, rec)
        _extend_held(rec, group, keys)

    def share(self, request: RequestId, group: int, blocks: Sequence[int]) -> None:
        """Rule 7, a read hold: ``request`` holds these blocks too. Each is held by a live
        request, or freed and parked (a prefix-cache hit on a block not yet reusable: it
        leaves the pool's waiting lists), or, in an engine-owned pool, the engine's."""
        rec = self._records.require(request)
        t = self._table
        keys = [t.key(group, b) for b in blocks]
        if len(set(keys)) != len(keys):
            raise ValueError(f"blocks {list(blocks)!r}; expected distinct block ids")
        mine = {k for ks in rec.blocks.values() for k in ks}
        pool = self._pool
        for k in keys:
            if k in mine:
                raise ValueError(
                    f"block {t.block_of(k)} of group {group} is already held by request {request!r}; "
                    "expected a block it does not hold"
                )
            if self._managed and t.holder[k] is None and not pool.is_parked(k):
                raise ValueError(
                    f"block {t.block_of(k)} of group {group} is neither held nor parked; expected a "
                    "block another request holds or released (a cached prefix)"
                )
            self._refuse_written(k, group, request)
        for k in keys:
            if t.holder[k] is None and pool.is_parked(k):
                pool.unpark(k)
            t.add_hold(k, rec)
        _extend_held(rec, group, keys)

    def _refuse_written(self, key: int, group: int, request: RequestId) -> None:
        """Rule 7: a block an inbound transfer is writing holds no cached prefix yet; a second holder would
        outlive the importer's abort and free the block under the write."""
        if self._fenced and self._table.writers[key]:
            raise ValueError(
                f"block {self._table.block_of(key)} of group {group} is being written by an import; request "
                f"{request!r} may hold it only once that write ended (expected a block no transfer writes)"
            )

    def free_blocks(self, request: RequestId, group: int, blocks: Sequence[int]) -> None:
        rec = self._records.require(request)
        t = self._table
        held = rec.blocks.get(group, [])
        keys = [t.key(group, b) for b in blocks]
        missing = [t.block_of(k) for k in keys if k not in held]
        if missing:
            raise ValueError(
                f"blocks {missing} of group {group} are not held by request {request!r}; "
                "expected blocks it holds"
            )
        drop = set(keys)
        rec.blocks[group] = [k for k in held if k not in drop]
        for k in keys:
            if t.release_hold(k, rec):
                self._imported.discard(k)
                self._pool.park(k)

    def request_finished(self, request: RequestId, export: bool) -> LeaseGrant | None:
        rec = self._requests.get(request)
        if rec is None:
            rec = self._records.require(request)  # raises, naming the request
        if rec.resident:
            rec.resident = False
            rec.last_step = self._table.scheduled
        if export:
            rec.phase = _EXPORTING
            return self._leases.grant(request)
        self._records.drop(rec)
        return None

    def abort(self, request: RequestId) -> bool:
        rec = self._requests.get(request)
        if rec is None:
            return False
        if rec.resident:
            rec.resident = False
            rec.last_step = self._table.scheduled
        if self._fenced and rec.phase is _EXPORTING and self._leases.deadline(request) is not None:
            # The lease is a promise to a consumer that may be reading without
            # telling us (pull): keep the blocks until it lapses, stop renewing.
            rec.abandoned = True
            return True
        self._leases.end(request)
        self._records.drop(rec)
        return True

    def recompute(self, request: RequestId) -> None:
        rec = self._records.require(request)
        # Importing too: an import given up before any transfer was posted (no export in time, the
        # lease lapsed during a stall) recomputes as a failed one does, whatever steps are pending.
        if rec.phase is not _FAILED and rec.phase is not _IMPORTING:
            raise ValueError(f"request {request!r} is {rec.phase.value}; expected failed or importing")
        if self._fenced and rec.transfers:
            raise ValueError(f"request {request!r} still has transfers in flight; expected none")
        rec.phase = _LOCAL

    # ------------------------------------------------------------------- steps
    def step_scheduled(
        self,
        step: int,
        joined: Iterable[RequestId],
        touched: Iterable[BlockRef],
        zeroing: Iterable[BlockRef],
        pool_touched: Mapping[int, Collection[int]] | None = None,
    ) -> StepTicket:
        t = self._table
        fenced = self._fenced
        requests = self._requests
        joiners = []
        for rid in joined:
            rec = requests.get(rid)
            if rec is None:
                rec = self._records.require(rid)  # raises, naming the request
            if fenced and rec.phase is not _LOCAL and rec.phase is not _READY:
                raise ValueError(
                    f"request {rid!r} joined step {step!r} while {rec.phase.value}; expected a "
                    "ready request (is_ready)"
                )
            joiners.append(rec)
        writers = t.writers
        touch_keys: Collection[int] = t.keys(touched)
        unchecked = False
        if pool_touched:
            touch_keys = self._pool_keys(pool_touched, touch_keys)  # type: ignore[arg-type]
            unchecked = touch_keys is pool_touched.get(0)
            if unchecked and not fenced:
                _check_ids(touch_keys, 0, len(writers))
                unchecked = False
        if fenced and touch_keys:
            if unchecked:
                busy = [t.block_of(k) for k in self._busy_pool_keys(touch_keys)]
            else:
                busy = [t.block_of(k) for k in touch_keys if writers[k]]
            if busy:
                raise ValueError(
                    f"step {step!r} touches blocks {busy} that an inbound transfer is writing; "
                    "expected blocks with no transfer in flight"
                )
        zero_refs = list(zeroing)
        zero_keys = t.keys(zero_refs)
        # Everything else validated: the step itself is checked (and recorded) last,
        # so a rejected step leaves nothing applied.
        t.advance_scheduled(step)
        for rec in joiners:
            rec.resident = True
            if rec.phase is not _EXPORTING:
                rec.phase = _RUNNING
        if touch_keys:
            t.touch(touch_keys, step)
        if not zero_keys:
            return StepTicket(step=step)
        # Zeroing a block an inbound transfer writes, or wrote, would erase its bytes (Race B).
        skip: list[int] = []  # indices into zero_keys
        if fenced:
            imported = self._imported
            if imported.isdisjoint(zero_keys):
                for i, k in enumerate(zero_keys):
                    if writers[k]:
                        skip.append(i)
            else:
                for i, k in enumerate(zero_keys):
                    if k in imported or writers[k]:
                        skip.append(i)
        if not skip:
            t.touch(zero_keys, step)
            return StepTicket(step=step)
        skipped = set(skip)
        t.touch([k for i, k in enumerate(zero_keys) if i not in skipped], step)
        return StepTicket(step=step, skip_zeroing=tuple([zero_refs[i] for i in skip]))

    def _pool_keys(self, pool_touched: Mapping[int, Collection[int]], keys: list[int]) -> Collection[int]:
        """The table keys of blocks given per pool, each pool's ids checked at once (no pair per
        block: an engine whose groups share one pool passes its block ids, which are the keys).
        The ids of a table's only pool are checked in the step's writer check (_busy_pool_keys)."""
        t = self._table
        sizes = t.layout.pool_sizes
        if len(sizes) == 1 and not keys and len(pool_touched) == 1 and 0 in pool_touched:
            return pool_touched[0]
        for pool, blocks in pool_touched.items():
            if not isinstance(pool, int) or not 0 <= pool < len(sizes):
                raise ValueError(f"pool {pool!r}; expected a pool index in [0, {len(sizes)})")
            if blocks:
                _check_ids(blocks, pool, sizes[pool])
                base = self._pool_base[pool]
                keys.extend(blocks if base == 0 else [base + b for b in blocks])
        return keys

    def _busy_pool_keys(self, keys: Collection[int]) -> list[int]:
        """Keys of a one-pool table that an inbound transfer writes; ValueError naming any key that is
        no block id of it. One pass over the keys does both (the writers list is the pool's size)."""
        writers = self._table.writers
        try:
            flagged = [k for k in keys if k < 0 or writers[k]]
        except (IndexError, TypeError):
            flagged = [-1]
        if flagged and min(flagged) < 0:
            _check_ids(keys, 0, len(writers))
        return flagged

    def step_completed(self, step: int) -> bool:
        if not self._table.advance_watermark(step):
            return False
        self._pool.on_watermark()
        return True


__all__ = ["BlockRef", "RequestSteps", "StepTicket"]
