"""Transfers: imports (consumer side), exports and their leases (producer side), and their ends.

A transfer is posted only when the fence allows it (``post_import`` /
``post_export``) and its end is reported back (``transfer_landed`` /
``transfer_failed``). :class:`TransferRules` applies them to a
:class:`~hybridkv.fencing.records.SchedulerRecords` on behalf of
:class:`~hybridkv.fencing.scheduler.TransferScheduler`, which documents them; the design
is in :mod:`hybridkv.fencing.scheduler`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from hybridkv.fencing.fence import NotYet, NotYetReason
from hybridkv.fencing.lease import LeaseGrant
from hybridkv.fencing.records import RecordsView, SchedulerRecords
from hybridkv.fencing.request_state import (
    Component,
    RequestPhase,
    RequestRecord,
    TransferDirection,
    TransferOutcome,
    TransferRecord,
)
from hybridkv.ids import RequestId, TransferId

# Enum members as module constants: an attribute of an Enum class costs several
# times a global lookup, and the rules test them on every call.
_IMPORTING = RequestPhase.IMPORTING
_READY = RequestPhase.READY
_EXPORTING = RequestPhase.EXPORTING
_FAILED = RequestPhase.FAILED
_INBOUND = TransferDirection.INBOUND
_OUTBOUND = TransferDirection.OUTBOUND
_ACCEPTED = TransferOutcome.ACCEPTED
_DUPLICATE = TransferOutcome.DUPLICATE
_DISCARDED = TransferOutcome.DISCARDED
_LATE = TransferOutcome.LATE
_UNKNOWN = TransferOutcome.UNKNOWN

_PENDING = NotYet(reason=NotYetReason.PENDING_STEP)
_BUSY = NotYet(reason=NotYetReason.TRANSFER_IN_FLIGHT)
_SHORT = NotYet(reason=NotYetReason.LEASE_TOO_SHORT)
_NO_COMPONENTS: frozenset[Component] = frozenset()


def _names(comps: Iterable[Component]) -> list[str]:
    return sorted(c.kind.value + str(c.group) for c in comps)


class TransferRules(RecordsView):
    """Imports, exports, leases and transfer ends over one set of records."""

    __slots__ = ("_transfers", "_clock", "_component_sets")

    def __init__(self, records: SchedulerRecords) -> None:
        super().__init__(records)
        self._transfers = records.transfers
        self._clock = records.clock
        # (the set, its sorted groups) of each component set imports were asked for, by
        # the set and by the tuple the caller passed: a connector retries a post with the
        # same tuple every step until the fence allows it, and building the set is most
        # of a "not yet". Components are interned and immutable, so neither goes stale.
        self._component_sets: dict[
            tuple[Component, ...] | frozenset[Component], tuple[frozenset[Component], tuple[int, ...]]
        ] = {}

    # ------------------------------------------------------------ consumer side
    def post_import(
        self,
        request: RequestId,
        components: Iterable[Component],
        blocks: Mapping[int, Sequence[int]] | None,
        lease_deadline: float | None,
        expected_s: float,
    ) -> TransferId | NotYet:
        rec = self._requests.get(request)
        if rec is None:
            rec = self._records.require(request)  # raises, naming the request
        known = self._component_sets.get(components) if components.__class__ is tuple else None
        comps = frozenset(components) if known is None else known[0]
        if rec.phase is not _IMPORTING and rec.phase is not _FAILED:
            raise ValueError(f"import into request {request!r} while {rec.phase.value}; expected importing")
        if not comps or not comps <= rec.expected:
            raise ValueError(
                f"components {_names(comps)} for request {request!r}; "
                "expected a non-empty subset of what it expects"
            )
        if rec.transfers:
            busy = self._components_in_flight(rec) & comps
            if busy:
                raise ValueError(
                    f"components {_names(busy)} of request {request!r} already have a transfer "
                    "in flight; expected one at a time"
                )
        if blocks is None:
            # Every block the request holds in the components' groups.
            if known is None:
                sets = self._component_sets
                known = sets.get(comps)
                if known is None:
                    known = sets[comps] = (comps, tuple(sorted({c.group for c in comps})))
                if components.__class__ is tuple:  # valid (a subset of what is expected)
                    sets[components] = known
            gs = known[1]
            held = rec.blocks
            if len(gs) == 1:
                keys = list(held.get(gs[0], ()))
            else:
                keys = []
                for g in gs:
                    ks = held.get(g)
                    if ks:
                        keys += ks
        else:
            keys = self._chosen_keys(rec, comps, blocks)
        t = self._table
        if t.sharers and keys:
            sharers = t.sharers
            shared = [t.block_of(k) for k in keys if k in sharers]
            if shared:
                raise ValueError(
                    f"import into blocks {shared} of request {request!r}, which other requests hold too "
                    "(rule 7); expected blocks it holds alone (load only the missing suffix)"
                )
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
        rec = self._records.require(request)
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

    def _chosen_keys(
        self, rec: RequestRecord, comps: frozenset[Component], blocks: Mapping[int, Sequence[int]]
    ) -> list[int]:
        """Keys of an import narrowed to ``blocks``; each must be the request's own, in a component's group."""
        groups = {c.group for c in comps}
        key = self._table.key
        keys: list[int] = []
        for g, bs in blocks.items():
            if g not in groups:
                raise ValueError(
                    f"blocks given for group {g}; expected only groups of the components {sorted(groups)}"
                )
            held = rec.blocks.get(g, [])
            for b in bs:
                k = key(g, b)
                if k not in held:
                    raise ValueError(
                        f"block {b} of group {g} is not held by request {rec.id!r}; expected its own blocks"
                    )
                keys.append(k)
        return keys

    # ------------------------------------------------------------ producer side
    def export_ready(self, request: RequestId) -> bool | NotYet:
        rec = self._requests.get(request)
        if rec is None:
            rec = self._records.require(request)  # raises, naming the request
        if rec.phase is not _EXPORTING:
            raise ValueError(f"request {request!r} is {rec.phase.value}; expected exporting")
        if self._fenced:
            t = self._table
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

    def post_export(self, request: RequestId, groups: Iterable[int] | None, expected_s: float) -> TransferId | NotYet:
        ready = self.export_ready(request)
        if ready is not True:
            return ready
        rec = self._requests[request]
        leases = self._leases
        if self._fenced and not leases.fits(request, expected_s):
            return _SHORT
        held = rec.blocks
        keys: list[int] = []
        for g in sorted(held) if groups is None else sorted(set(groups)):
            ks = held.get(g)
            if ks:
                keys += ks
        tid = self._new_transfer(rec, _OUTBOUND, keys, _NO_COMPONENTS, leases.deadline(request))
        readers = self._table.readers
        for k in keys:
            readers[k] += 1
        return tid

    def heartbeat(self, request: RequestId) -> LeaseGrant | None:
        rec = self._requests.get(request)
        if rec is None or rec.phase is not _EXPORTING or rec.abandoned:
            return None
        return self._leases.renew(request)

    def export_done(self, request: RequestId) -> bool:
        rec = self._requests.get(request)
        if rec is None:
            return False
        if rec.phase is not _EXPORTING:
            raise ValueError(f"request {request!r} is {rec.phase.value}; expected exporting")
        self._leases.end(request)
        self._records.drop(rec)
        return True

    def poll(self) -> list[RequestId]:
        lapsed = self._leases.expire()
        if not lapsed:
            return lapsed
        requests = self._requests
        for rid in lapsed:
            rec = requests.get(rid)
            if rec is not None and rec.phase is _EXPORTING:
                self._records.drop(rec)
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
        records = self._records
        tid = TransferId(records.next_tid)
        records.next_tid = tid + 1
        self._transfers[tid] = TransferRecord(
            id=tid, request=rec.id, direction=direction, keys=keys, components=comps, deadline=deadline
        )
        rec.transfers.add(tid)
        return tid

    def terminal(self, tid: TransferId, ok: bool) -> TransferOutcome:
        """A transfer ended: landed (``ok``) or failed. What the scheduler made of it."""
        tr = self._transfers.pop(tid, None)
        if tr is None:
            if isinstance(tid, int) and 0 <= tid < self._records.next_tid:
                return _DUPLICATE
            return _UNKNOWN
        t = self._table
        inbound = tr.direction is _INBOUND
        counts = t.writers if inbound else t.readers
        for k in tr.keys:
            counts[k] -= 1
        rec = None if tr.orphaned else self._requests.get(tr.request)
        if rec is not None:
            rec.transfers.discard(tid)
        self._pool.on_transfer_terminal(tr.keys)
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


__all__ = ["TransferRules"]
