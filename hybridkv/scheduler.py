"""Async-safe transfer scheduling for both sides of a disaggregated pair.

:class:`TransferScheduler` is the one object an engine connector talks to
about *when* blocks may be read, written, reused or computed on. It enforces
the six fencing rules of DESIGN.md over a :class:`~hybridkv.fence.FenceTable`:

1. *export*: an outbound transfer reads a block only once the step that wrote
   it completed (``watermark >= fence``);
2. *reuse*: a freed block returns to the pool only when settled and no
   transfer touches it (vLLM Race A, #45357);
3. *import*: an inbound transfer writes a block only when no pending step
   touches it; a zeroing scheduled for it before the post is fenced (the post
   waits for it), one scheduled after the post (write in flight or landed) is
   skipped (vLLM Race B, #48481);
4. *visibility*: a request may join a step only once every component of every
   group arrived (SGLang #39846);
5. *abort/failure*: blocks with a transfer in flight are quarantined until the
   transfer is terminal (SGLang #24527);
6. *lease*: exported blocks live under a renewable lease; expiry releases
   them; a read that cannot finish inside its lease is never started, and one
   that lands after it is not trusted.

Engine-shaped, non-blocking API (every call returns at once; a call that
cannot proceed returns a falsy :class:`~hybridkv.fence.NotYet` and the engine
asks again on a later step). Block ids are ints per KV-cache group; groups map
onto physical pools through :class:`~hybridkv.fence.PoolLayout`.

Both sides::

    add_request(rid, expect=components)   # expect=() for a locally computed request
    allocate(rid, group, n) -> blocks | NotYet     # managed pool
    assign(rid, group, blocks)                     # engine-owned pool
    step_scheduled(step, joined=..., touched=..., zeroing=...) -> StepTicket
    step_completed(step)                           # the worker's watermark
    free_blocks(rid, group, blocks)                # e.g. sliding-window tail clipping
    request_finished(rid, export=False) -> Lease | None
    abort(rid)
    transfer_landed(tid) / transfer_failed(tid) -> TransferOutcome
    poll()                                         # lease expiry; call once per step

Consumer (decode) side::

    post_import(rid, components=..., lease_deadline=..., expected_s=...) -> tid | NotYet
    lease_renewed(rid, deadline);  is_ready(rid);  recompute(rid)

Producer (prefill) side::

    export_ready(rid) -> True | NotYet;  post_export(rid, expected_s=...) -> tid | NotYet
    heartbeat(rid) -> Lease | None;  export_done(rid)

A request joins the running batch through ``step_scheduled(joined=...)`` and
stays *resident* (touched by every later step) until it finishes or aborts;
see :mod:`hybridkv.fence` for why. The per-step cost is therefore
proportional to what changed in the step, not to the batch size.

``FencePolicy.NONE`` answers yes to every check: frees are immediate, imports
post at once, a request is ready after its first component, leases are not
checked. It exists to show what breaks.

Nothing here imports torch or an engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hybridkv.block_pool import BlockPool
from hybridkv.fence import (
    BlockId,
    FencePolicy,
    FenceTable,
    GroupId,
    NotYet,
    NotYetReason,
    PoolLayout,
    RequestId,
    TransferId,
)
from hybridkv.lease import Clock, Lease, LeaseTable
from hybridkv.request_state import (
    Component,
    RequestPhase,
    RequestRecord,
    TransferDirection,
    TransferOutcome,
    TransferRecord,
    TransferState,
)

_PENDING = NotYet(reason=NotYetReason.PENDING_STEP)
_BUSY = NotYet(reason=NotYetReason.TRANSFER_IN_FLIGHT)
_EXHAUSTED = NotYet(reason=NotYetReason.POOL_EXHAUSTED)
_SHORT = NotYet(reason=NotYetReason.LEASE_TOO_SHORT)
_INCOMPLETE = NotYet(reason=NotYetReason.INCOMPLETE)

BlockRef = tuple[int, int]  # (group, block id)


@dataclass(frozen=True, kw_only=True)
class StepTicket:
    """What the engine must know about a step it just scheduled."""

    step: int
    #: zeroing requested for blocks an inbound transfer writes or wrote: do not run it.
    skip_zeroing: tuple[BlockRef, ...] = ()


class TransferScheduler:
    """Fencing rules for one worker (one rank) of either side. Not thread-safe."""

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
        phase = self._get(request).phase
        return phase is RequestPhase.LOCAL or phase is RequestPhase.READY

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

    # ---------------------------------------------------------------- requests
    def add_request(self, request: RequestId, *, expect: Iterable[Component] = ()) -> None:
        """Register a request; ``expect`` lists the components that must arrive first."""
        if request in self._requests:
            raise ValueError(f"request {request!r} already exists; expected a new request id")
        expected = frozenset(expect)
        for c in expected:
            if not isinstance(c, Component) or not 0 <= c.group < self.layout.num_groups:
                raise ValueError(
                    f"component {c!r} of request {request!r}; expected a Component of a group "
                    f"in [0, {self.layout.num_groups})"
                )
        phase = RequestPhase.IMPORTING if expected else RequestPhase.LOCAL
        self._requests[request] = RequestRecord(id=request, phase=phase, expected=expected)

    def allocate(self, request: RequestId, group: int, n: int) -> tuple[BlockId, ...] | NotYet:
        """Take ``n`` reusable blocks of ``group`` for ``request`` (all or none)."""
        rec = self._get(request)
        if not self.pool.managed:
            raise ValueError("allocate() on an engine-owned pool; expected assign()")
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n = {n!r}; expected a non-negative int")
        pools = self.layout.group_pools
        if not isinstance(group, int) or not 0 <= group < len(pools):
            raise ValueError(f"group {group!r}; expected a group index in [0, {len(pools)})")
        pool = pools[group]
        keys = self.pool.take(pool, n)
        if keys is None:
            return _EXHAUSTED
        self._hold(rec, group, keys)
        base = self.table.pool_keys(pool).start
        return tuple([k - base for k in keys])  # type: ignore[return-value]

    def assign(self, request: RequestId, group: int, blocks: Sequence[int]) -> None:
        """Engine-owned pool: the engine gave ``blocks`` of ``group`` to ``request``."""
        rec = self._get(request)
        keys = [self.table.key(group, b) for b in blocks]
        if len(set(keys)) != len(keys):
            raise ValueError(f"blocks {list(blocks)!r}; expected distinct block ids")
        for k in keys:
            if self.table.holder[k] is not None:
                raise ValueError(
                    f"block {self.table.block_of(k)} of group {group} is held by another "
                    "request; expected a free block"
                )
            self.pool.adopt(k)
        self._hold(rec, group, keys)

    def _hold(self, rec: RequestRecord, group: int, keys: list[int]) -> None:
        holder = self.table.holder
        for k in keys:
            holder[k] = rec
        rec.blocks.setdefault(group, []).extend(keys)

    def free_blocks(self, request: RequestId, group: int, blocks: Sequence[int]) -> None:
        """Give back some blocks of a live request (sliding-window clipping)."""
        rec = self._get(request)
        held = rec.blocks.get(group, [])
        keys = [self.table.key(group, b) for b in blocks]
        missing = [self.table.block_of(k) for k in keys if k not in held]
        if missing:
            raise ValueError(
                f"blocks {missing} of group {group} are not held by request {request!r}; "
                "expected blocks it holds"
            )
        drop = set(keys)
        rec.blocks[group] = [k for k in held if k not in drop]
        for k in keys:
            self._release_key(k)

    def request_finished(self, request: RequestId, *, export: bool = False) -> Lease | None:
        """The request left the batch for good. With ``export`` its blocks are held
        for a consumer under a lease (returned); otherwise they are freed."""
        rec = self._get(request)
        self._retire(rec)
        if export:
            rec.phase = RequestPhase.EXPORTING
            return self.leases.grant(request)
        self._drop(rec)
        return None

    def abort(self, request: RequestId) -> bool:
        """Drop a request anywhere in its life; False if it is unknown (already gone).
        Blocks with transfers in flight stay quarantined until those are terminal;
        an exporting request keeps its blocks until its lease lapses (no renewals)."""
        rec = self._requests.get(request)
        if rec is None:
            return False
        self._retire(rec)
        if self._fenced and rec.phase is RequestPhase.EXPORTING and self.leases.deadline(request) is not None:
            # The lease is a promise to a consumer that may be reading without
            # telling us (pull): keep the blocks until it lapses, stop renewing.
            rec.abandoned = True
            return True
        self.leases.end(request)
        self._drop(rec)
        return True

    def recompute(self, request: RequestId) -> None:
        """A failed import is abandoned: the request computes its prompt locally."""
        rec = self._get(request)
        if rec.phase is not RequestPhase.FAILED:
            raise ValueError(f"request {request!r} is {rec.phase.value}; expected failed")
        if self._fenced and rec.transfers:
            raise ValueError(f"request {request!r} still has transfers in flight; expected none")
        rec.phase = RequestPhase.LOCAL

    def _retire(self, rec: RequestRecord) -> None:
        if rec.resident:
            rec.resident = False
            rec.last_step = self.table.scheduled

    def _drop(self, rec: RequestRecord) -> None:
        del self._requests[rec.id]
        for tid in rec.transfers:
            self._transfers[tid].orphaned = True
        t = self.table
        # The request is retired (not resident): its blocks' fence is at least its last step.
        hs = rec.last_step
        fence, holder, imported = t.fence, t.holder, self._imported
        keys = [k for ks in rec.blocks.values() for k in ks]
        for k in keys:
            if hs > fence[k]:
                fence[k] = hs
            holder[k] = None
        if imported:
            imported.difference_update(keys)
        self.pool.park_many(keys)
        rec.blocks.clear()

    def _release_key(self, key: int) -> None:
        self._imported.discard(key)
        self.table.release_holder(key)
        self.pool.park(key)

    # ------------------------------------------------------------------- steps
    def step_scheduled(
        self,
        step: int,
        *,
        joined: Iterable[RequestId] = (),
        touched: Iterable[BlockRef] = (),
        zeroing: Iterable[BlockRef] = (),
    ) -> StepTicket:
        """The engine scheduled ``step``. ``joined`` requests enter the running batch
        (they must be ready); ``touched`` blocks are read or written by the step
        beyond what resident requests hold; ``zeroing`` blocks are initialised by it."""
        t = self.table
        if not isinstance(step, int) or step <= t.scheduled:
            raise ValueError(
                f"step {step!r} scheduled; expected an int greater than {t.scheduled}"
            )
        joiners = []
        for rid in joined:
            rec = self._get(rid)
            if self._fenced and rec.phase is not RequestPhase.LOCAL and rec.phase is not RequestPhase.READY:
                raise ValueError(
                    f"request {rid!r} joined step {step} while {rec.phase.value}; expected a "
                    "ready request (is_ready)"
                )
            joiners.append(rec)
        key = t.key
        touch_keys = [key(g, b) for g, b in touched]
        if self._fenced:
            busy = [t.block_of(k) for k in touch_keys if t.writers[k]]
            if busy:
                raise ValueError(
                    f"step {step} touches blocks {busy} that an inbound transfer is writing; "
                    "expected blocks with no transfer in flight"
                )
        zero_refs = list(zeroing)
        zero_keys = [key(g, b) for g, b in zero_refs]
        # Everything validated; apply.
        t.scheduled = step
        for rec in joiners:
            rec.resident = True
            if rec.phase is not RequestPhase.EXPORTING:
                rec.phase = RequestPhase.RUNNING
        fence = t.fence
        for k in touch_keys:
            if step > fence[k]:
                fence[k] = step
        skipped: list[BlockRef] = []
        imported = self._imported
        writers = t.writers
        for ref, k in zip(zero_refs, zero_keys):
            if self._fenced and (k in imported or writers[k]):
                skipped.append(ref)
            elif step > fence[k]:
                fence[k] = step
        if skipped:
            return StepTicket(step=step, skip_zeroing=tuple(skipped))
        return StepTicket(step=step)

    def step_completed(self, step: int) -> bool:
        """The worker finished ``step`` (and every earlier one). False if stale."""
        if not self.table.advance_watermark(step):
            return False
        self.pool.on_watermark()
        return True

    # ------------------------------------------------------------ consumer side
    def post_import(
        self,
        request: RequestId,
        *,
        components: Iterable[Component],
        blocks: Mapping[int, Sequence[int]] | None = None,
        lease_deadline: float | None = None,
        expected_s: float = 0.0,
    ) -> TransferId | NotYet:
        """May an inbound transfer of ``components`` into the request's blocks start
        now? On yes, the transfer is recorded as posted and its id returned.
        ``blocks`` narrows the target to a subset (default: every block the request
        holds in the components' groups). ``lease_deadline`` is the producer's lease
        in this clock (see :mod:`hybridkv.lease`)."""
        rec = self._get(request)
        comps = frozenset(components)
        if rec.phase is not RequestPhase.IMPORTING and rec.phase is not RequestPhase.FAILED:
            raise ValueError(
                f"import into request {request!r} while {rec.phase.value}; expected importing"
            )
        if not comps or not comps <= rec.expected:
            raise ValueError(
                f"components {sorted(c.kind.value + str(c.group) for c in comps)} for request "
                f"{request!r}; expected a non-empty subset of what it expects"
            )
        busy = self._components_in_flight(rec) & comps
        if busy:
            raise ValueError(
                f"components {sorted(c.kind.value + str(c.group) for c in busy)} of request "
                f"{request!r} already have a transfer in flight; expected one at a time"
            )
        keys = self._target_keys(rec, comps, blocks)
        t = self.table
        if self._fenced:
            if lease_deadline is not None and self._clock() + expected_s > lease_deadline:
                return _SHORT
            w = t.watermark
            for k in keys:
                if t.readers[k]:
                    return _BUSY
                if t.effective_fence(k) > w:
                    return _PENDING
        tid = self._new_transfer(rec, TransferDirection.INBOUND, keys, comps, lease_deadline)
        writers = t.writers
        for k in keys:
            writers[k] += 1
        self._imported.update(keys)
        rec.phase = RequestPhase.IMPORTING
        return tid

    def lease_renewed(self, request: RequestId, deadline: float) -> None:
        """The producer renewed the lease behind this request's inbound reads."""
        rec = self._get(request)
        for tid in rec.transfers:
            tr = self._transfers[tid]
            if tr.direction is TransferDirection.INBOUND and tr.deadline is not None:
                tr.deadline = max(tr.deadline, deadline)

    def _components_in_flight(self, rec: RequestRecord) -> frozenset[Component]:
        out: set[Component] = set()
        for tid in rec.transfers:
            tr = self._transfers[tid]
            if tr.direction is TransferDirection.INBOUND:
                out |= tr.components
        return frozenset(out)

    def _target_keys(
        self,
        rec: RequestRecord,
        comps: frozenset[Component],
        blocks: Mapping[int, Sequence[int]] | None,
    ) -> list[int]:
        groups = {c.group for c in comps}
        if blocks is None:
            return [k for g in sorted(groups) for k in rec.blocks.get(g, ())]
        keys: list[int] = []
        for g, bs in blocks.items():
            if g not in groups:
                raise ValueError(
                    f"blocks given for group {g}; expected only groups of the components {sorted(groups)}"
                )
            held = rec.blocks.get(g, [])
            for b in bs:
                k = self.table.key(g, b)
                if k not in held:
                    raise ValueError(
                        f"block {b} of group {g} is not held by request {rec.id!r}; expected its own blocks"
                    )
                keys.append(k)
        return keys

    # ------------------------------------------------------------ producer side
    def export_ready(self, request: RequestId) -> bool | NotYet:
        """Rule 1: have all writes into the request's blocks completed?"""
        rec = self._get(request)
        if rec.phase is not RequestPhase.EXPORTING:
            raise ValueError(f"request {request!r} is {rec.phase.value}; expected exporting")
        if self._fenced:
            t = self.table
            w = t.watermark
            for keys in rec.blocks.values():
                for k in keys:
                    if t.effective_fence(k) > w:
                        return _PENDING
        return True

    def post_export(
        self,
        request: RequestId,
        *,
        groups: Iterable[int] | None = None,
        expected_s: float = 0.0,
    ) -> TransferId | NotYet:
        """May an outbound read of the request's blocks (all, or of ``groups``)
        start now? It must be settled (rule 1) and finish inside the lease (rule 6)."""
        ready = self.export_ready(request)
        if not ready:
            return ready
        rec = self._requests[request]
        if self._fenced and not self.leases.fits(request, expected_s):
            return _SHORT
        gs = sorted(rec.blocks) if groups is None else sorted(set(groups))
        keys = [k for g in gs for k in rec.blocks.get(g, ())]
        tid = self._new_transfer(
            rec, TransferDirection.OUTBOUND, keys, frozenset(), self.leases.deadline(request)
        )
        readers = self.table.readers
        for k in keys:
            readers[k] += 1
        return tid

    def heartbeat(self, request: RequestId) -> Lease | None:
        """Renew an export lease; None if it lapsed or the request is gone."""
        rec = self._requests.get(request)
        if rec is None or rec.phase is not RequestPhase.EXPORTING or rec.abandoned:
            return None
        return self.leases.renew(request)

    def export_done(self, request: RequestId) -> bool:
        """The consumer is done with the request: free its blocks. False if gone."""
        rec = self._requests.get(request)
        if rec is None:
            return False
        if rec.phase is not RequestPhase.EXPORTING:
            raise ValueError(f"request {request!r} is {rec.phase.value}; expected exporting")
        self.leases.end(request)
        self._drop(rec)
        return True

    def poll(self) -> list[RequestId]:
        """Expire lapsed export leases, releasing their blocks; returns their requests."""
        lapsed = self.leases.expire()
        for rid in lapsed:
            rec = self._requests.get(rid)
            if rec is not None and rec.phase is RequestPhase.EXPORTING:
                self._drop(rec)
        return lapsed

    # ---------------------------------------------------------------- transfers
    def _new_transfer(
        self,
        rec: RequestRecord,
        direction: TransferDirection,
        keys: list[int],
        comps: frozenset[Component],
        deadline: float | None,
    ) -> TransferId:
        tid = TransferId(self._next_tid)
        self._next_tid += 1
        self._transfers[tid] = TransferRecord(
            id=tid, request=rec.id, direction=direction, keys=keys, components=comps, deadline=deadline
        )
        rec.transfers.add(tid)
        return tid

    def transfer_landed(self, tid: TransferId) -> TransferOutcome:
        return self._terminal(tid, ok=True)

    def transfer_failed(self, tid: TransferId) -> TransferOutcome:
        return self._terminal(tid, ok=False)

    def _terminal(self, tid: TransferId, *, ok: bool) -> TransferOutcome:
        tr = self._transfers.pop(tid, None)
        if tr is None:
            if isinstance(tid, int) and 0 <= tid < self._next_tid:
                return TransferOutcome.DUPLICATE
            return TransferOutcome.UNKNOWN
        t = self.table
        counts = t.writers if tr.direction is TransferDirection.INBOUND else t.readers
        for k in tr.keys:
            counts[k] -= 1
        tr.state = TransferState.LANDED if ok else TransferState.FAILED
        rec = None if tr.orphaned else self._requests.get(tr.request)
        if rec is not None:
            rec.transfers.discard(tid)
        self.pool.on_transfer_terminal(tr.keys)
        if rec is None:
            return TransferOutcome.DISCARDED
        if tr.direction is TransferDirection.OUTBOUND:
            return TransferOutcome.ACCEPTED
        outcome = TransferOutcome.ACCEPTED
        if ok and self._fenced and tr.deadline is not None and self._clock() > tr.deadline:
            ok, outcome = False, TransferOutcome.LATE
        if not ok:
            rec.phase = RequestPhase.FAILED
            return outcome
        rec.arrived |= tr.components
        if rec.phase is RequestPhase.IMPORTING:
            if not self._fenced or rec.arrived >= rec.expected:
                rec.phase = RequestPhase.READY
        return outcome

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


__all__ = ["GroupId", "StepTicket", "TransferScheduler"]
