"""Transfers: imports (consumer side), exports and their leases (producer side), and their ends.

A transfer is posted only when the fence allows it (``post_import`` /
``post_export``) and its end is reported back (``transfer_landed`` /
``transfer_failed``). Part of :class:`~hybridkv.fencing.scheduler.TransferScheduler`;
the design is in :mod:`hybridkv.fencing.scheduler`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from hybridkv.fencing.fence import NotYet, RequestId, TransferId
from hybridkv.fencing.lease import LeaseGrant
from hybridkv.fencing.request_state import (
    Component,
    RequestRecord,
    TransferDirection,
    TransferOutcome,
    TransferRecord,
    TransferState,
)
from hybridkv.fencing.scheduler_state import (
    _BUSY,
    _EXPORTING,
    _FAILED,
    _IMPORTING,
    _INBOUND,
    _OUTBOUND,
    _PENDING,
    _READY,
    _SHORT,
    _SchedulerState,
)

# Enum members as module constants (see scheduler_state).
_ACCEPTED = TransferOutcome.ACCEPTED
_DUPLICATE = TransferOutcome.DUPLICATE
_DISCARDED = TransferOutcome.DISCARDED
_LATE = TransferOutcome.LATE
_UNKNOWN = TransferOutcome.UNKNOWN
_LANDED = TransferState.LANDED
_TFAILED = TransferState.FAILED
_NO_COMPONENTS: frozenset[Component] = frozenset()


class _TransferRules(_SchedulerState):
    """Imports, exports, leases and transfer ends of :class:`~hybridkv.fencing.scheduler.TransferScheduler`."""

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
        rec = self._requests.get(request)
        if rec is None:
            rec = self._get(request)  # raises, naming the request
        comps = frozenset(components)
        if rec.phase is not _IMPORTING and rec.phase is not _FAILED:
            raise ValueError(
                f"import into request {request!r} while {rec.phase.value}; expected importing"
            )
        if not comps or not comps <= rec.expected:
            raise ValueError(
                f"components {sorted(c.kind.value + str(c.group) for c in comps)} for request "
                f"{request!r}; expected a non-empty subset of what it expects"
            )
        if rec.transfers:
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
            if keys:  # the first key read by a transfer or not settled decides
                readers, fence, w = t.readers, t.fence, t.watermark
                # Every key is held by ``rec`` (audit checks it), so its residency adds
                # one fence common to all keys.
                if (t.scheduled if rec.resident else rec.last_step) > w:
                    return _BUSY if readers[keys[0]] else _PENDING
                for k in keys:
                    if readers[k]:
                        return _BUSY
                    if fence[k] > w:
                        return _PENDING
        tid = self._new_transfer(rec, _INBOUND, keys, comps, lease_deadline)
        writers = t.writers
        for k in keys:
            writers[k] += 1
        self._imported.update(keys)
        rec.phase = _IMPORTING
        return tid

    def lease_renewed(self, request: RequestId, deadline: float) -> None:
        """The producer renewed the lease behind this request's inbound reads."""
        rec = self._get(request)
        for tid in rec.transfers:
            tr = self._transfers[tid]
            if tr.direction is _INBOUND and tr.deadline is not None:
                tr.deadline = max(tr.deadline, deadline)

    def _components_in_flight(self, rec: RequestRecord) -> frozenset[Component]:
        out: set[Component] = set()
        for tid in rec.transfers:
            tr = self._transfers[tid]
            if tr.direction is _INBOUND:
                out |= tr.components
        return frozenset(out)

    def _target_keys(
        self,
        rec: RequestRecord,
        comps: frozenset[Component],
        blocks: Mapping[int, Sequence[int]] | None,
    ) -> list[int]:
        if blocks is None:
            gs = self._sorted_groups.get(comps)
            if gs is None:
                gs = self._sorted_groups[comps] = tuple(sorted({c.group for c in comps}))
            held = rec.blocks
            if len(gs) == 1:
                return list(held.get(gs[0], ()))
            out: list[int] = []
            for g in gs:
                ks = held.get(g)
                if ks:
                    out += ks
            return out
        groups = {c.group for c in comps}
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
        rec = self._requests.get(request)
        if rec is None:
            rec = self._get(request)  # raises, naming the request
        if rec.phase is not _EXPORTING:
            raise ValueError(f"request {request!r} is {rec.phase.value}; expected exporting")
        if self._fenced:
            t = self.table
            fence, w = t.fence, t.watermark
            # Every key is held by ``rec`` (audit checks it): its residency is one fence for all.
            hs = t.scheduled if rec.resident else rec.last_step
            for keys in rec.blocks.values():
                if keys:
                    if hs > w:
                        return _PENDING
                    for k in keys:
                        if fence[k] > w:
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
        held = rec.blocks
        keys: list[int] = []
        for g in sorted(held) if groups is None else sorted(set(groups)):
            ks = held.get(g)
            if ks:
                keys += ks
        tid = self._new_transfer(rec, _OUTBOUND, keys, _NO_COMPONENTS, self.leases.deadline(request))
        readers = self.table.readers
        for k in keys:
            readers[k] += 1
        return tid

    def heartbeat(self, request: RequestId) -> LeaseGrant | None:
        """Renew an export lease; None if it lapsed or the request is gone."""
        rec = self._requests.get(request)
        if rec is None or rec.phase is not _EXPORTING or rec.abandoned:
            return None
        return self.leases.renew(request)

    def export_done(self, request: RequestId) -> bool:
        """The consumer is done with the request: free its blocks. False if gone."""
        rec = self._requests.get(request)
        if rec is None:
            return False
        if rec.phase is not _EXPORTING:
            raise ValueError(f"request {request!r} is {rec.phase.value}; expected exporting")
        self.leases.end(request)
        self._drop(rec)
        return True

    def poll(self) -> list[RequestId]:
        """Expire lapsed export leases, releasing their blocks; returns their requests."""
        lapsed = self.leases.expire()
        if not lapsed:
            return lapsed
        for rid in lapsed:
            rec = self._requests.get(rid)
            if rec is not None and rec.phase is _EXPORTING:
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
        return self._terminal(tid, True)

    def transfer_failed(self, tid: TransferId) -> TransferOutcome:
        return self._terminal(tid, False)

    def _terminal(self, tid: TransferId, ok: bool) -> TransferOutcome:
        tr = self._transfers.pop(tid, None)
        if tr is None:
            if isinstance(tid, int) and 0 <= tid < self._next_tid:
                return _DUPLICATE
            return _UNKNOWN
        t = self.table
        inbound = tr.direction is _INBOUND
        counts = t.writers if inbound else t.readers
        for k in tr.keys:
            counts[k] -= 1
        tr.state = _LANDED if ok else _TFAILED
        rec = None if tr.orphaned else self._requests.get(tr.request)
        if rec is not None:
            rec.transfers.discard(tid)
        self.pool.on_transfer_terminal(tr.keys)
        if rec is None:
            return _DISCARDED
        if not inbound:
            return _ACCEPTED
        outcome = _ACCEPTED
        if ok and self._fenced and tr.deadline is not None and self._clock() > tr.deadline:
            ok, outcome = False, _LATE
        if not ok:
            rec.phase = _FAILED
            return outcome
        rec.arrived |= tr.components
        if rec.phase is _IMPORTING:
            if not self._fenced or rec.arrived >= rec.expected:
                rec.phase = _READY
        return outcome


__all__: list[str] = []
