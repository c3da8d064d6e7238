"""Async-safe transfer scheduling for both sides of a disaggregated pair.

:class:`TransferScheduler` is the one object an engine connector talks to
about *when* blocks may be read, written, reused or computed on. It enforces
fencing rules 1-7 of docs/design.md over a :class:`~hybridkv.fencing.fence.FenceTable`:

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
   that lands after it is not trusted;
7. *sharing*: holds are counted (``share``; ``assign`` of a held block); a
   block is parked only at its last holder's release; an export is a read
   hold; an import never writes a block another request holds.

Engine-shaped, non-blocking API (every call returns at once; a call that
cannot proceed returns a :class:`~hybridkv.fencing.fence.NotYet` - test it with
``isinstance(x, NotYet)``, it has no truth value - and the engine asks again on a
later step). Block ids are ints per KV-cache group; groups map
onto physical pools through :class:`~hybridkv.fencing.fence.PoolLayout`.

Both sides::

    add_request(rid, expect=components)   # expect=() for a locally computed request
    allocate(rid, group, n) -> blocks | NotYet     # managed pool
    assign(rid, group, blocks)                     # engine-owned pool
    step_scheduled(step, joined=..., touched=..., zeroing=...) -> StepTicket
    step_completed(step)                           # the worker's watermark
    free_blocks(rid, group, blocks)                # e.g. sliding-window tail clipping
    request_finished(rid, export=False) -> LeaseGrant | None
    abort(rid)
    transfer_landed(tid) / transfer_failed(tid) -> TransferOutcome
    poll()                                         # lease expiry; call once per step

Consumer (decode) side::

    post_import(rid, components=..., lease_deadline=..., expected_s=...) -> tid | NotYet
    lease_renewed(rid, deadline);  is_ready(rid);  recompute(rid)

Producer (prefill) side::

    export_ready(rid) -> True | NotYet;  post_export(rid, expected_s=...) -> tid | NotYet
    heartbeat(rid) -> LeaseGrant | None;  export_done(rid)

A request joins the running batch through ``step_scheduled(joined=...)`` and
stays *resident* (touched by every later step) until it finishes or aborts;
see :mod:`hybridkv.fencing.fence` for why. The per-step cost is therefore
proportional to what changed in the step, not to the batch size.

``FencePolicy.NONE`` answers yes to every check: frees are immediate, imports
post at once, a request is ready after its first component, leases are not
checked. It exists to show what breaks.

The scheduler is composed of three parts, one module each, and delegates to them:
its state (:mod:`hybridkv.fencing.records`), the rules of requests and steps
(:mod:`hybridkv.fencing.steps`) and those of transfers and leases
(:mod:`hybridkv.fencing.transfers`). The read-only queries are its own.

Nothing here imports torch or an engine.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence

from hybridkv.fencing.fence import FencePolicy, NotYet, PoolLayout
from hybridkv.fencing.lease import Clock, LeaseGrant
from hybridkv.fencing.records import SchedulerRecords
from hybridkv.fencing.request_state import Component, RequestPhase, TransferOutcome
from hybridkv.fencing.steps import BlockRef, RequestSteps, StepTicket
from hybridkv.fencing.transfers import TransferRules
from hybridkv.ids import BlockId, RequestId, TransferId

# Enum members as module constants: is_ready runs per request per step.
_LOCAL = RequestPhase.LOCAL
_READY = RequestPhase.READY


class TransferScheduler:
    """Fencing rules for one worker (one rank) of either side. Not thread-safe.

    ``layout`` and ``policy`` are what it was built with; ``table`` (the
    :class:`~hybridkv.fencing.fence.FenceTable`), ``pool`` (the
    :class:`~hybridkv.fencing.block_pool.BlockPool`) and ``leases`` (the
    :class:`~hybridkv.fencing.lease.LeaseTable`) are the parts its rules share, exposed for
    engines and tests: read them, never rebind them.
    """

    def __init__(
        self,
        layout: PoolLayout,
        *,
        policy: FencePolicy = FencePolicy.FENCED,
        lease_s: float = 30.0,
        clock: Clock = time.monotonic,
        managed_pool: bool = True,
    ) -> None:
        records = SchedulerRecords(layout, policy=policy, lease_s=lease_s, clock=clock, managed_pool=managed_pool)
        self._records = records
        self._requests = records.requests
        self._steps = RequestSteps(records)
        self._rules = TransferRules(records)
        self.layout = records.layout
        self.policy = records.policy
        self.table = records.table
        self.pool = records.pool
        self.leases = records.leases

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
        return self._records.require(request).phase

    def blocks(self, request: RequestId, group: int) -> tuple[BlockId, ...]:
        rec = self._records.require(request)
        b = self.table.block_of
        return tuple(BlockId(b(k)) for k in rec.blocks.get(group, ()))

    def request_ids(self) -> list[RequestId]:
        return list(self._requests)

    def arrived(self, request: RequestId) -> frozenset[Component]:
        """Components of the request whose inbound transfer landed."""
        return frozenset(self._records.require(request).arrived)

    def holder(self, group: int, block: int) -> RequestId | None:
        """The live request holding a block, or None (free, or fenced after a free)."""
        h = self.table.holder[self.table.key(group, block)]
        return None if h is None else h.id  # type: ignore[attr-defined]

    def holders(self, group: int, block: int) -> tuple[RequestId, ...]:
        """Rule 7: every live request holding a block (several for a shared prefix)."""
        return tuple(h.id for h in self.table.holders(self.table.key(group, block)))  # type: ignore[attr-defined]

    def is_ready(self, request: RequestId) -> bool:
        """Rule 4: may the request join a step now?"""
        rec = self._requests.get(request)
        if rec is None:
            rec = self._records.require(request)  # raises, naming the request
        phase = rec.phase
        return phase is _LOCAL or phase is _READY

    def free_count(self, pool: int = 0) -> int:
        return self.pool.free_count(pool)

    def transfers_in_flight(self) -> int:
        return len(self._records.transfers)

    def requests_in_flight(self) -> int:
        return len(self._requests)

    def take_reusable(self) -> list[tuple[int, BlockId]]:
        """Engine-owned pools: (pool, block) pairs now safe to hand out again."""
        t = self.table
        return [(t.pool_of_key(k), BlockId(t.block_of(k))) for k in self.pool.take_reusable()]

    def audit(self) -> None:
        """Check internal consistency; RuntimeError on a broken invariant."""
        self._records.audit()

    # ----------------------------------------------------- requests and steps
    def add_request(self, request: RequestId, *, expect: Iterable[Component] = ()) -> None:
        """Register a request; ``expect`` lists the components that must arrive first."""
        self._steps.add_request(request, expect)

    def allocate(self, request: RequestId, group: int, n: int) -> tuple[BlockId, ...] | NotYet:
        """Take ``n`` reusable blocks of ``group`` for ``request`` (all or none)."""
        return self._steps.allocate(request, group, n)

    def assign(self, request: RequestId, group: int, blocks: Sequence[int]) -> None:
        """Engine-owned pool: the engine gave ``blocks`` of ``group`` to ``request``. A block
        another live request holds gets one more hold (rule 7)."""
        self._steps.assign(request, group, blocks)

    def share(self, request: RequestId, group: int, blocks: Sequence[int]) -> None:
        """Rule 7: ``request`` holds ``blocks`` of ``group`` too (a cached prefix, or a read
        hold for an export). Holds are counted: a block is reused only once its last holder
        released it and it settled. A parked block (freed, not yet reusable) leaves the pool."""
        self._steps.share(request, group, blocks)

    def free_blocks(self, request: RequestId, group: int, blocks: Sequence[int]) -> None:
        """Give back some blocks of a live request (sliding-window clipping)."""
        self._steps.free_blocks(request, group, blocks)

    def request_finished(self, request: RequestId, *, export: bool = False) -> LeaseGrant | None:
        """The request left the batch for good. With ``export`` its blocks are held
        for a consumer under a lease (returned); otherwise they are freed."""
        return self._steps.request_finished(request, export)

    def abort(self, request: RequestId) -> bool:
        """Drop a request anywhere in its life; False if it is unknown (already gone).
        Blocks with transfers in flight stay quarantined until those are terminal;
        an exporting request keeps its blocks until its lease lapses (no renewals)."""
        return self._steps.abort(request)

    def recompute(self, request: RequestId) -> None:
        """A failed import, or one given up with no transfer in flight, is abandoned: the request
        computes its prompt locally."""
        self._steps.recompute(request)

    def step_scheduled(
        self,
        step: int,
        *,
        joined: Iterable[RequestId] = (),
        touched: Iterable[BlockRef] = (),
        zeroing: Iterable[BlockRef] = (),
        pool_touched: Mapping[int, Collection[int]] | None = None,
    ) -> StepTicket:
        """The engine scheduled ``step``. ``joined`` requests enter the running batch
        (they must be ready); ``touched`` blocks are read or written by the step
        beyond what resident requests hold; ``zeroing`` blocks are initialised by it.
        ``pool_touched`` is more touched blocks, as block ids per pool (an engine whose
        groups share one pool passes its ids as they are: no ``(group, block)`` pair per
        block, the per-step cost of a large batch). A step rejected (ValueError) leaves
        nothing applied."""
        return self._steps.step_scheduled(step, joined, touched, zeroing, pool_touched)

    def step_completed(self, step: int) -> bool:
        """The worker finished ``step`` (and every earlier one). False if stale."""
        return self._steps.step_completed(step)

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
        in this clock (see :mod:`hybridkv.fencing.lease`)."""
        return self._rules.post_import(request, components, blocks, lease_deadline, expected_s)

    def lease_renewed(self, request: RequestId, deadline: float) -> None:
        """The producer renewed the lease behind this request's inbound reads."""
        self._rules.lease_renewed(request, deadline)

    # ------------------------------------------------------------ producer side
    def export_ready(self, request: RequestId) -> bool | NotYet:
        """Rule 1: have all writes into the request's blocks completed? True or NotYet."""
        return self._rules.export_ready(request)

    def post_export(
        self,
        request: RequestId,
        *,
        groups: Iterable[int] | None = None,
        expected_s: float = 0.0,
    ) -> TransferId | NotYet:
        """May an outbound read of the request's blocks (all, or of ``groups``)
        start now? It must be settled (rule 1) and finish inside the lease (rule 6)."""
        return self._rules.post_export(request, groups, expected_s)

    def heartbeat(self, request: RequestId) -> LeaseGrant | None:
        """Renew an export lease; None if it lapsed or the request is gone."""
        return self._rules.heartbeat(request)

    def export_done(self, request: RequestId) -> bool:
        """The consumer is done with the request: free its blocks. False if gone."""
        return self._rules.export_done(request)

    def poll(self) -> list[RequestId]:
        """Expire lapsed export leases, releasing their blocks; returns their requests."""
        return self._rules.poll()

    # ---------------------------------------------------------------- transfers
    def transfer_landed(self, tid: TransferId) -> TransferOutcome:
        return self._rules.terminal(tid, True)

    def transfer_failed(self, tid: TransferId) -> TransferOutcome:
        return self._rules.terminal(tid, False)


__all__ = ["BlockRef", "StepTicket", "TransferScheduler"]
