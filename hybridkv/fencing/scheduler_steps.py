"""Requests and steps: the rules a worker applies as its engine schedules.

Blocks enter a request (``add_request``, ``allocate``, ``assign``), steps fence
them (``step_scheduled``, ``step_completed``) and blocks leave it
(``free_blocks``, ``request_finished``, ``abort``, ``recompute``). Part of
:class:`~hybridkv.fencing.scheduler.TransferScheduler`; the design is in
:mod:`hybridkv.fencing.scheduler`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hybridkv.fencing.fence import BlockId, NotYet, RequestId
from hybridkv.fencing.lease import LeaseGrant
from hybridkv.fencing.request_state import Component, RequestRecord
from hybridkv.fencing.scheduler_state import (
    _EXHAUSTED,
    _EXPORTING,
    _FAILED,
    _IMPORTING,
    _LOCAL,
    _READY,
    _RUNNING,
    _SchedulerState,
)

BlockRef = tuple[int, int]  # (group, block id)


@dataclass(frozen=True, kw_only=True)
class StepTicket:
    """What the engine must know about a step it just scheduled."""

    step: int
    #: zeroing requested for blocks an inbound transfer writes or wrote: do not run it.
    skip_zeroing: tuple[BlockRef, ...] = ()


class _RequestSteps(_SchedulerState):
    """Request lifecycle and step fencing of :class:`~hybridkv.fencing.scheduler.TransferScheduler`."""

    # ---------------------------------------------------------------- requests
    def add_request(self, request: RequestId, *, expect: Iterable[Component] = ()) -> None:
        """Register a request; ``expect`` lists the components that must arrive first."""
        if request in self._requests:
            raise ValueError(f"request {request!r} already exists; expected a new request id")
        expected = frozenset(expect)
        if expected and expected not in self._valid_expect:
            for c in expected:
                if not isinstance(c, Component) or not 0 <= c.group < self.layout.num_groups:
                    raise ValueError(
                        f"component {c!r} of request {request!r}; expected a Component of a group "
                        f"in [0, {self.layout.num_groups})"
                    )
            self._valid_expect.add(expected)
        phase = _IMPORTING if expected else _LOCAL
        self._requests[request] = RequestRecord(id=request, phase=phase, expected=expected)

    def allocate(self, request: RequestId, group: int, n: int) -> tuple[BlockId, ...] | NotYet:
        """Take ``n`` reusable blocks of ``group`` for ``request`` (all or none)."""
        rec = self._requests.get(request)
        if rec is None:
            rec = self._get(request)  # raises, naming the request
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
        holder = self.table.holder  # _hold, inlined: allocate runs several times per request per step
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
        held = rec.blocks.get(group)
        if held is None:
            rec.blocks[group] = list(keys)
        else:
            held.extend(keys)

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

    def request_finished(self, request: RequestId, *, export: bool = False) -> LeaseGrant | None:
        """The request left the batch for good. With ``export`` its blocks are held
        for a consumer under a lease (returned); otherwise they are freed."""
        rec = self._requests.get(request)
        if rec is None:
            rec = self._get(request)  # raises, naming the request
        if rec.resident:
            rec.resident = False
            rec.last_step = self.table.scheduled
        if export:
            rec.phase = _EXPORTING
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
        if self._fenced and rec.phase is _EXPORTING and self.leases.deadline(request) is not None:
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
        if rec.phase is not _FAILED:
            raise ValueError(f"request {request!r} is {rec.phase.value}; expected failed")
        if self._fenced and rec.transfers:
            raise ValueError(f"request {request!r} still has transfers in flight; expected none")
        rec.phase = _LOCAL

    def _retire(self, rec: RequestRecord) -> None:
        if rec.resident:
            rec.resident = False
            rec.last_step = self.table.scheduled

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
        fenced = self._fenced
        requests = self._requests
        joiners = []
        for rid in joined:
            rec = requests.get(rid)
            if rec is None:
                rec = self._get(rid)  # raises, naming the request
            if fenced and rec.phase is not _LOCAL and rec.phase is not _READY:
                raise ValueError(
                    f"request {rid!r} joined step {step} while {rec.phase.value}; expected a "
                    "ready request (is_ready)"
                )
            joiners.append(rec)
        writers = t.writers
        touch_keys = t.keys(touched)
        if fenced and touch_keys:
            busy = [t.block_of(k) for k in touch_keys if writers[k]]
            if busy:
                raise ValueError(
                    f"step {step} touches blocks {busy} that an inbound transfer is writing; "
                    "expected blocks with no transfer in flight"
                )
        zero_refs = list(zeroing)
        zero_keys = t.keys(zero_refs)
        # Everything validated; apply.
        t.scheduled = step
        for rec in joiners:
            rec.resident = True
            if rec.phase is not _EXPORTING:
                rec.phase = _RUNNING
        fence = t.fence
        for k in touch_keys:
            if step > fence[k]:
                fence[k] = step
        skipped: list[BlockRef] = []
        imported = self._imported
        if not fenced:
            for k in zero_keys:
                if step > fence[k]:
                    fence[k] = step
        elif imported.isdisjoint(zero_keys):
            for ref, k in zip(zero_refs, zero_keys):
                if writers[k]:
                    skipped.append(ref)
                elif step > fence[k]:
                    fence[k] = step
        else:
            for ref, k in zip(zero_refs, zero_keys):
                if k in imported or writers[k]:
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


__all__ = ["BlockRef", "StepTicket"]
