"""How an export's blocks reach a reader other than by its plain READ: a staging slot, or a push WRITE.

:class:`ExportStaging` packs what one consumer reads (pull mode, heterogeneous TP) into a slot of
the producer's :class:`~hybridkv.transport.staging.StagePool`; the slot is the export's until it
ends (the rules are in :mod:`hybridkv.transport.staging`). :class:`PushWrites` is push mode: this
side WRITEs an export's blocks into the blocks the consumer's Import names and watches the write to
its end. Both serve :class:`~hybridkv.transport.exports.Exports`, which decides when each is used.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from hybridkv import wire
from hybridkv.transport.config import Outcome
from hybridkv.transport.dataplane import Op, Transfer, XferState
from hybridkv.transport.export_record import ExportRecord, Finish
from hybridkv.transport.metrics import FailureKind
from hybridkv.transport.plan import PeerPlanner
from hybridkv.transport.side import Peer, Side, notification
from hybridkv.transport.staging import BadFieldMask, StagePool, Stager

log = logging.getLogger(__name__)

_MASKS_PER_PEER = 4  # field masks one consumer may name (it names one per producer pair; more are refused)


class ExportStaging:
    """The exports' staging slots. Given the side (its planner, memory map and scheduler's leases)
    and the pool (None: every Want is exported unstaged)."""

    def __init__(self, side: Side, pool: StagePool | None) -> None:
        #: where staged reads are packed (None: every Want is exported unstaged)
        self.pool = pool
        self._scheduler = side.scheduler
        self._planner = side.planner
        self._memory = side.memory
        #: per consumer agent, per field mask its Wants named (a consumer names one per pair; a few kept)
        self._stagers: dict[str, dict[bytes, Stager | None]] = {}

    def describe(self) -> dict:
        return {} if self.pool is None else {"staging": self.pool.describe()}

    def stager(self, peer: Peer, fields: bytes = b"") -> Stager | None:
        """What this side packs for ``peer`` under the field mask ``fields`` (wire.Want.fields), or None where it
        stages nothing for that peer (no pool, layouts that do not pair by fields). A mask that names no field of
        the pair or one past them, or a new mask past the few a consumer may name, raises BadFieldMask naming it
        (the Want is refused)."""
        if self.pool is None:
            return None
        mine = self._stagers.setdefault(peer.agent, {})
        if fields not in mine:
            if len(mine) >= _MASKS_PER_PEER:
                # A consumer names one mask per producer pair; one cycling masks would make this side rebuild a
                # stager per Want (ms of CPU at model size), so a new mask past the few kept is refused instead.
                raise BadFieldMask(f"stage field mask {fields.hex() or '(every field)'}: this consumer named "
                                   f"{len(mine)} others; expected at most {_MASKS_PER_PEER} masks per connection")
            make = getattr(self._planner, "stager", None)
            try:
                # a Want without a mask asks by the planner's own signature (models in the tests take no mask)
                got = None if make is None else make(self._memory, peer.memory, fields) if fields else \
                    make(self._memory, peer.memory)
            except BadFieldMask:
                raise  # the peer's mask: its Want is refused, with the reason
            except ValueError as exc:
                log.debug("no staging for %s: %s", peer.agent, exc)  # unstaged: the plan will say why
                got = None
            mine[fields] = got
        return mine[fields]

    def stage(self, rec: ExportRecord, peer: Peer, fields: bytes = b"") -> tuple[int, ...]:
        """Pack what ``peer`` reads (the fields its Want named, ``fields``) into a staging slot: (offset, nbytes)
        for its Export, or () where this side cannot (no pool, nothing to gather for that peer, no free slot:
        the consumer then posts the sliced plan). The slot is the export's until it ends. The mask was checked
        when the Want came (:meth:`stager`)."""
        pool = self.pool
        if pool is None:
            return ()
        try:
            stager = self.stager(peer, fields)
        except BadFieldMask:
            return ()  # refused when its Want came: never here
        if stager is None:
            return ()
        slot = pool.take(stager.nbytes(rec.blocks))
        if slot is None:
            return ()  # full: unstaged (back-pressure falls back, never waits)
        pool.copier.run(stager.pack(rec.blocks, base=slot.offset))
        rec.slots[peer.agent] = slot
        if not pool.config.fence:
            # HYBRIDKV_STAGING_RULE_OFF: the slot goes back as soon as it is packed, while its reader
            # has yet to read it (the next request's slices may land in it first).
            pool.give_back(rec.slots.pop(peer.agent))
        return (slot.offset, slot.nbytes)

    def release(self, rec: ExportRecord, *, now: bool) -> None:
        """The export's staging slots go back with its blocks: now where every reader is done with
        them, else (a reader may still be reading) when the lease lapses (a reader never reads past it)."""
        if not rec.slots or self.pool is None:
            return
        leases = self._scheduler.leases
        deadline = None if now else leases.deadline(rec.rid)
        if not now and deadline is None:
            deadline = leases.now() + leases.duration_s
        for slot in rec.slots.values():
            if deadline is None:
                self.pool.give_back(slot)
            else:
                self.pool.hold(slot, deadline)
        rec.slots.clear()

    def tick(self) -> None:
        """From the pump: slots held past a lease go back."""
        if self.pool is not None:
            self.pool.tick(self._scheduler.leases.now())

    def forget(self, agent: str) -> None:
        """A consumer is gone: its stager goes (its slots go with its exports)."""
        self._stagers.pop(agent, None)


class PushWrites:
    """Push mode's WRITEs. Given the side (its planner, memory map, data plane, counters, and the
    pump it spins up while a write is in flight) and how an export ends."""

    def __init__(self, side: Side, *, finish: Finish) -> None:
        self._side = side
        self._planner = side.planner
        self._memory = side.memory
        self._dp = side.dp
        self._stats = side.stats
        self._metrics = side.metrics
        self._finish = finish
        self._plans: dict[str, PeerPlanner] = {}  # the planner prepared per consumer

    def post(self, rec: ExportRecord, peer: Peer, msg: wire.Import) -> None:
        """WRITE ``rec``'s blocks into those ``peer``'s Import names (its claim on ``rec`` checked)."""
        try:
            wire.check_blocks(msg.blocks, peer.memory.group_bounds(), what=f"import of {msg.request_id}")
            dst = {g.group_id: np.asarray(g.ids, dtype=np.int64) for g in msg.blocks}
            prepared = self._plans.get(peer.agent)
            if prepared is None:
                prepared = self._plans[peer.agent] = self._planner.prepare((self._memory,), peer.memory)
            plan = prepared.plan(0, rec.blocks, dst)
            plan.check()
            notif = notification(peer, rec.rid)
            rec.posted_at = time.perf_counter()
            rec.xfer = xfer = self._dp.post_plan(Op.WRITE, peer.agent, plan, notif)
            rec.descriptors = plan.num_descriptors
        except Exception as exc:  # bad block lists, NIXL refusal
            self._stats.rejected += 1
            self._metrics.failure(FailureKind.PROTOCOL if isinstance(exc, ValueError) else FailureKind.TRANSFER)
            self._finish(rec, ok=False, outcome=Outcome.FAILED, error=str(exc),
                         tell=wire.Failure(request_id=rec.rid, code=wire.FailureCode.TRANSFER_ERROR,
                                           detail=str(exc)[: wire.MAX_TEXT]))
            return
        self._side.spin_up()
        asyncio.ensure_future(self._watch(rec, xfer))

    async def _watch(self, rec: ExportRecord, xfer: Transfer) -> None:
        try:
            state = await self._side.wait_xfer(xfer)
        finally:
            self._side.spin_down()
        if state is XferState.DONE:
            self._metrics.transfer(nbytes=xfer.nbytes, descriptors=rec.descriptors,
                                   seconds=time.perf_counter() - rec.posted_at)
        else:
            self._metrics.failure(FailureKind.TRANSFER)
        if state is XferState.DONE and not rec.abort_asked:
            self._finish(rec, ok=True, outcome=Outcome.DONE)
        elif state is XferState.DONE:
            # The consumer gave up but the bytes landed; its notification tells it so.
            self._finish(rec, ok=True, outcome=Outcome.FAILED, error="consumer aborted")
        else:
            self._finish(rec, ok=False, outcome=Outcome.FAILED, error="WRITE failed",
                         tell=wire.Failure(request_id=rec.rid, code=wire.FailureCode.TRANSFER_ERROR,
                                           detail="WRITE failed"))

    def forget(self, agent: str) -> None:
        """A consumer is gone: the plan prepared for it goes."""
        self._plans.pop(agent, None)


__all__ = ["ExportStaging", "PushWrites"]
