"""What one import runs through: the Exports awaited, the transfer posted when the fence allows, the end.

:class:`Importer` is held by :class:`~hybridkv.transport.consumer.Consumer`. ``fetch`` asks each
producer for its *part* of the request, waits for every Export, plans the transfer with the planner
prepared for those producers, posts it only when the scheduler's fence allows (``post_import``) and
ends the request in a defined state: READY once every part landed, else per the failure policy
(RECOMPUTE or FAILED). Every posted import is tracked by its writers in the consumer's
:class:`~hybridkv.transport.drains.Drains` (the core's ``ImportLedger``), and its blocks are judged
only once it is over (rule 5). Pull mode posts one READ per producer (each a writer) and waits for
every READ to end: one NIXL will not abort keeps the import open, and its blocks quarantined, until it
does (``settled``). Push mode asks the one producer to WRITE and waits for its notification or its
Done; its Failure, losing it or our own abort only fail the import, which then ends when the producer
drains or the drain deadline (``transfer_timeout_s``) passes. The staging side of an import (whether to ask
a producer to stage, the staged read's plan, our own slot) is :mod:`hybridkv.transport.import_staging`; the
Failure / Done sent to the producers and the failure policy are :mod:`hybridkv.transport.import_ends`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from hybridkv import wire
from hybridkv.errors import HybridKVError, PeerLost
from hybridkv.fencing import ImportState, NotYet, NotYetReason, TransferOutcome
from hybridkv.transport import bounded
from hybridkv.transport.config import Outcome, Result
from hybridkv.transport.dataplane import Op, Transfer, XferState
from hybridkv.transport.drains import Drains, Import
from hybridkv.transport.import_ends import Endings, kind_of_outcome
from hybridkv.transport.import_staging import ImportStaging, Work
from hybridkv.transport.metrics import FailureKind
from hybridkv.transport.parts import Part, Parts
from hybridkv.transport.plan import PeerPlanner
from hybridkv.transport.side import Peer, Side, notification, send_quietly
from hybridkv.transport.staging import StagePool, StagingConfig


class Importer:
    """The consumer's import path. Given the side (its config, scheduler, memory map, data plane
    and counters), the consumer's parts table, and from the consumer:

    - ``want(request_id, *, token, peer, readers)``: ask a producer for a request;
    - ``prepared(agents)``: the planner prepared for a set of producers;
    - ``lost(peer)``: a producer's channel failed;
    - ``post(work, notif)`` and ``wait(xfer, until)``: post one producer's READ and wait for a transfer's
      end, where a consumer subclass overrides them (the reference demo's fault injection); None: this
      importer's own :meth:`post_read` and ``Side.wait_xfer``.
    """

    def __init__(self, side: Side, parts: Parts, *, want: Callable[..., Awaitable[None]],
                 prepared: Callable[[Sequence[str]], PeerPlanner], lost: Callable[[Peer], None],
                 post: Callable[[Work, bytes], Transfer] | None,
                 wait: Callable[[Transfer, Callable[[], float] | None], Awaitable[XferState]] | None, drains: Drains,
                 staging: StagingConfig | None = None, pool: StagePool | None = None) -> None:
        self._parts = parts
        #: whether to ask producers to stage, the staged reads' plans and this side's own slots
        self._staging = ImportStaging(side, staging=staging, pool=pool, prepared=prepared)
        #: Failure / Done to the producers, and the failure policy
        self._ends = Endings(side)
        self._want = want
        self._prepared = prepared
        self._lost = lost
        #: posts one producer's READ when called, checked before (DataPlane.ready); an override posts when called
        self._ready = (lambda w, notif: functools.partial(post, w, notif)) if post else self.ready_read
        self._wait_xfer = wait or side.wait_xfer
        self._config = side.config
        self._scheduler = side.scheduler
        self._memory = side.memory
        self._dp = side.dp
        self._stats = side.stats
        self._metrics = side.metrics
        #: who writes each posted import, and when it is over (rule 5, per writer)
        self._drains = drains
        #: waits for READs NIXL would not abort (their imports end when the READ does, see settled())
        self._settling: set[asyncio.Task] = set()

    def cancel(self) -> None:
        """The consumer closes: waits for READs NIXL would not abort end here."""
        for task in list(self._settling):
            task.cancel()

    async def fetch(self, request_id: str, comps: tuple, *, token: bytes, targets: Sequence[Peer],
                    readers: int, stage: bool | None = None) -> Result:
        """``Consumer.fetch``, its token checked and its producers found (``targets``)."""
        if len({p.agent for p in targets}) != len(targets):
            raise ValueError(f"producers {[p.agent for p in targets]} repeat; expected distinct ones")
        if len(targets) > 1 and self._config.mode is not wire.Mode.PULL:
            raise ValueError(f"{len(targets)} producers for one request in {self._config.mode.name} mode; "
                             "expected pull mode")
        parts = [self._parts.open(request_id, p, token) for p in targets]
        flags = self._staging.flags(request_id, targets) if stage is not False else [False] * len(targets)
        masks = self._staging.fields(targets) if any(flags) else [b""] * len(targets)

        async def ask_and_wait():
            for p, st, mask in zip(targets, flags, masks):
                await self._want(request_id, token=token, peer=p.agent, readers=readers, stage=st,
                                 fields=mask if st else b"")
            return await asyncio.gather(*(asyncio.shield(x.export) for x in parts))

        try:
            try:
                # Asking is inside the timeout too: a send that never completes must not hang the import.
                got = await asyncio.wait_for(ask_and_wait(), self._config.export_timeout_s)
            except asyncio.TimeoutError:
                await self._ends.tell_parts(parts, "no export from every producer in time")
                return self._ends.give_up(request_id, comps, "no export from the producer in time",
                                    kind=FailureKind.NO_EXPORT)
            except HybridKVError as exc:  # lost, or refused (claimed by another consumer)
                await self._ends.tell_parts(parts, str(exc))
                kind = FailureKind.PEER_LOST if isinstance(exc, PeerLost) else next(
                    (p.kind for p in parts if p.kind is not None), FailureKind.REFUSED)
                return self._ends.give_up(request_id, comps, str(exc), kind=kind)
            result = await self._import(request_id, parts, got, comps)
            if result.outcome is Outcome.READY and result.planned is not None:  # pull: this side posted
                self._metrics.transfer(nbytes=result.nbytes, seconds=result.seconds, post_seconds=result.post_seconds,
                                       descriptors=result.planned if result.descriptors is None else result.descriptors)
            return result
        finally:
            for p in targets:
                self._parts.pop(p.agent, request_id)
                self._staging.done(request_id, p.agent)

    def _work(self, part: Part, export: wire.Export, mine: dict[int, np.ndarray], planned: PeerPlanner,
              source: int) -> Work:
        wire.check_blocks(export.blocks, part.peer.memory.group_bounds(), what=f"export of {part.rid}")
        theirs = {g.group_id: np.asarray(g.ids, dtype=np.int64) for g in export.blocks}
        plan = planned.plan(source, theirs, mine)
        plan.check()
        if not export.stage:
            return Work(part=part, plan=plan)
        return self._staging.staged_work(part, export, theirs, mine, planned, source, plan)


    async def _import(self, rid: str, parts: list[Part], got, comps) -> Result:
        sched = self._scheduler
        for part, (export, received) in zip(parts, got):
            if part.deadline == float("inf"):
                part.deadline = received + export.lease_s * (1 - self._config.lease_margin)
        mine = {g.group_id: np.asarray(sched.blocks(rid, g.group_id), dtype=np.int64) for g in self._memory.groups}
        try:
            # Push mode posts the producer's plan; planning here too refuses a mismatched export early.
            planned = self._prepared([p.peer.agent for p in parts])
            work = [self._work(part, export, mine, planned, i) for i, (part, (export, _)) in enumerate(zip(parts, got))]
        except ValueError as exc:
            self._stats.rejected += 1
            for part in parts:
                await send_quietly(part.peer.channel, wire.Failure(
                    request_id=rid, code=wire.FailureCode.PROTOCOL, detail=str(exc)[: wire.MAX_TEXT],
                    token=part.token))
            return self._ends.give_up(rid, comps, f"export does not match the request: {exc}",
                                      kind=FailureKind.PROTOCOL)
        fenced_from = time.perf_counter()
        while True:
            failed = next((p.failed for p in parts if p.failed), None)
            if failed or any(p.lease_lost for p in parts):
                await self._ends.tell_parts(parts, failed or "lease lost")
                kind = next((p.kind for p in parts if p.failed), None) or FailureKind.LEASE
                return self._ends.give_up(rid, comps, failed or "lease lost before the transfer started", kind=kind)
            tid = sched.post_import(rid, components=comps, lease_deadline=min(p.deadline for p in parts))
            if not isinstance(tid, NotYet):
                break
            if tid.reason is NotYetReason.LEASE_TOO_SHORT:
                await self._ends.tell_parts(parts, "lease too short")
                return self._ends.give_up(rid, comps, "lease expired before the transfer could start",
                                    kind=FailureKind.LEASE)
            await asyncio.sleep(self._config.pump_idle_s)
        fence_wait = time.perf_counter() - fenced_from
        if self._config.mode is wire.Mode.PULL:
            result = await self._pull_parts(rid, tid, work, comps)
        else:
            result = await self._push(parts[0], tid, comps)
        return dataclasses.replace(result, fence_wait_seconds=fence_wait)

    def post_read(self, w: Work, notif: bytes) -> Transfer:
        """Post one producer's READ: what the consumer's ``post`` does unless overridden."""
        return self.ready_read(w, notif)()

    def ready_read(self, w: Work, notif: bytes) -> Callable[[], Transfer]:
        """One producer's READ, checked now and posted when called (DataPlane.ready)."""
        return self._dp.ready(Op.READ, w.part.peer.agent, w.plan, notif)

    async def _pull_parts(self, rid: str, tid: int, work: list[Work], comps: tuple) -> Result:
        work = [self._staging.slot_for(w) for w in work]
        # nothing of a producer whose plan is empty is needed here (GQA duplicate): Done tells it
        todo = [w for w in work if w.plan.num_descriptors]
        for w in work:
            if w.slot is not None and not w.plan.num_descriptors:
                self._staging.free_slot(w)  # never posted: nothing lands there
        if not todo:  # no READ to post: nothing can write the blocks, no writer to wait for
            return await self._nothing_posted(rid, tid, work)
        # tagged for the session of the producer it goes to (side.notification)
        notifs = [notification(w.part.peer, rid) for w in todo] if self._config.notify_reads else [b""] * len(todo)
        # Each READ is a writer of the blocks, tracked before it is posted (nothing runs between the two and
        # the first poll): its share lands when it completes, and the blocks are judged only once every READ
        # ended (rule 5). Past the lease the bytes are not trusted; past the timeout the peer or link is stuck.
        imp = self._drains.open(rid, tid, comps, [w.part.peer.agent for w in todo])
        parts = [w.part for w in work]
        give_up_at = time.monotonic() + self._config.transfer_timeout_s
        until = lambda: min(give_up_at, min(p.deadline for p in parts))  # noqa: E731 - leases renew meanwhile
        posted: list[tuple[Work, Transfer]] = []
        error = None
        try:  # every READ checked before any is posted: a refusal posts none of them
            goes = [self._ready(w, notif) for w, notif in zip(todo, notifs)]
        except Exception as exc:
            goes, error = [], str(exc)
        telemetry = self._config.dataplane.telemetry
        c0 = time.thread_time() if telemetry else 0.0
        t0 = time.perf_counter()
        for w, go in zip(todo, goes):  # the posting window: NIXL's calls, little else (DataPlane.ready)
            try:
                posted.append((w, go()))
            except Exception as exc:
                error = str(exc)
                break
        post_seconds = time.perf_counter() - t0
        post_cpu = time.thread_time() - c0 if telemetry else 0.0
        if error is not None:
            self._posting_failed(imp, work, todo[len(posted):], error)
            if not posted:
                return await self._none_posted(rid, imp, work, error)
        states = [await self._wait_xfer(x, until) for _, x in posted]
        seconds = time.perf_counter() - t0
        stuck = [wx for wx, s in zip(posted, states) if s is XferState.IN_PROGRESS]
        if stuck:
            return await self._abandon(rid, imp, work, posted, stuck)
        ok = error is None and all(s is XferState.DONE for s in states)
        if ok:
            error = self._staging.unpack([w for w, _ in posted])  # before the blocks are judged landed
            ok = error is None
        for w, _ in posted:
            self._staging.free_slot(w)
        xfers = [x for _, x in posted]
        tel = [self._dp.telemetry(x) for x in xfers] if self._config.dataplane.telemetry and ok else None
        for x in xfers:
            self._dp.release(x)
        lease_lost = any(w.part.lease_lost for w in work)
        if not ok:
            self._drains.fail(imp, error or "READ failed")
        elif lease_lost:
            self._drains.fail(imp, "lease lapsed during the READ: bytes not trusted")
        for (w, _), s in zip(posted, states):
            # Every READ ended: a completed one landed its share (only drained, once the import failed),
            # any other drained it.
            (self._drains.landed if s is XferState.DONE else self._drains.drained)(imp, w.part.peer.agent)
        self._drains.release(imp)
        if not ok or lease_lost:
            await self._ends.end_parts(work, False)
            if not ok:
                return self._ends.policy(rid, error or "READ failed", kind=FailureKind.TRANSFER)
            return self._ends.policy(rid, "lease lapsed during the READ: bytes not trusted", kind=FailureKind.LEASE)
        outcome = self._drains.outcome(imp)
        # Every READ ended and the ledger judged the blocks: Done only lets the producers free theirs, so
        # the import returns without waiting for the send (two ucxx completions through its notifier
        # thread: ~0.2 ms on an H100 host, ~1 ms on the 2-core box), in the channel's order of sends.
        self._ends.end_parts_soon(work, True)
        if outcome is not TransferOutcome.ACCEPTED:
            outcome = outcome or TransferOutcome.UNKNOWN
            return self._ends.policy(rid, f"transfer {outcome.value}", kind=kind_of_outcome(outcome))
        return Result(request_id=rid, outcome=Outcome.READY,
                      descriptors=None if tel is None else sum(t.descriptors for t in tel),
                      planned=sum(w.plan.num_descriptors for w in work),
                      indices=sum(w.plan.num_indices for w in work), nbytes=sum(x.nbytes for x in xfers),
                      seconds=seconds, post_seconds=post_seconds, post_cpu_seconds=post_cpu)

    def _posting_failed(self, imp: Import, work: Sequence[Work], unposted: Sequence[Work], error: str) -> None:
        """A READ could not be posted: the import fails; it and those after it never went out, so they
        write nothing (drained) and their slots go back."""
        self._drains.fail(imp, f"a READ could not be posted: {error}")
        for w in unposted:
            self._drains.drained(imp, w.part.peer.agent)
        for w in work:
            if w.slot is not None and any(u is w for u in unposted):
                self._staging.free_slot(w)  # never posted: nothing lands there

    async def _none_posted(self, rid: str, imp: Import, work: Sequence[Work], error: str) -> Result:
        """No READ went out (the first was refused): the import ended with its writers drained."""
        self._drains.release(imp)
        await self._ends.end_parts(work, False)
        return self._ends.policy(rid, error, kind=FailureKind.TRANSFER)

    async def _nothing_posted(self, rid: str, tid: int, work: list[Work]) -> Result:
        """No producer's plan has a descriptor: the request needs nothing read (landed now, as the fence allows)."""
        if any(w.part.lease_lost for w in work):
            self._scheduler.transfer_failed(tid)
            await self._ends.end_parts(work, False)
            return self._ends.policy(rid, "lease lapsed before the READ: bytes not trusted", kind=FailureKind.LEASE)
        outcome = self._scheduler.transfer_landed(tid)
        await self._ends.end_parts(work, True)
        if outcome is not TransferOutcome.ACCEPTED:
            return self._ends.policy(rid, f"transfer {outcome.value}", kind=kind_of_outcome(outcome))
        return Result(request_id=rid, outcome=Outcome.READY, descriptors=0 if self._config.dataplane.telemetry else None,
                      planned=sum(w.plan.num_descriptors for w in work), indices=sum(w.plan.num_indices for w in work),
                      post_seconds=0.0)

    async def _abandon(self, rid: str, imp: Import, work: list[Work], posted: list[tuple[Work, Transfer]],
                       stuck: list[tuple[Work, Transfer]]) -> Result:
        """READs still in progress past their lease or the timeout: the request fails. One that ended
        meanwhile is released; one still running stays open in the ledger (its blocks quarantined)
        until NIXL ends the READ (it may still write them: DataPlane.abort)."""
        self._stats.timed_out += 1
        self._metrics.failure(FailureKind.TIMEOUT)
        why = f"READ of {rid} not done within its lease or {self._config.transfer_timeout_s} s"
        self._drains.fail(imp, why)
        kept = bounded.abort_or_keep(self._dp, [x for _, x in posted], [x for _, x in stuck])
        held = {id(x) for x in kept}
        unabortable = [(w, x) for w, x in stuck if id(x) in held]
        for w, x in posted:
            if id(x) in held:
                continue
            self._staging.free_slot(w)
            self._drains.drained(imp, w.part.peer.agent)  # ended (or aborted): nothing more lands from it
        await self._ends.end_parts(work, False)
        if not unabortable:
            self._drains.release(imp)
            return self._ends.policy(rid, why + "; aborted", kind=None)
        blocks = sum(len(self._scheduler.blocks(rid, g.group_id)) for g in self._memory.groups)
        self._scheduler.abort(rid)  # rule 5: the blocks stay out of the pool while the READ is active
        self._drains.release(imp, quarantined=blocks)
        task = asyncio.get_running_loop().create_task(self._settle_later(imp, unabortable))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return Result(request_id=rid, outcome=Outcome.FAILED, error=why + "; could not abort, blocks quarantined")

    async def _settle_later(self, imp: Import, xfers: list[tuple[Work, Transfer]]) -> None:
        for w, x in xfers:
            # At the idle pace, not _wait_xfer's spin: this READ is already known to hang.
            while not bounded.ended(self._dp, [x]):
                await asyncio.sleep(self._config.pump_idle_s)
            self._dp.release(x)
            self._staging.free_slot(w)  # its slot too: the READ that could write it ended
            self._drains.drained(imp, w.part.peer.agent)  # the last one ends the import: the blocks go back

    def settling(self, request_id: str) -> bool:
        """Whether an import of the request that the consumer gave up may still write its blocks."""
        return self._drains.settling(request_id)

    async def settled(self, request_id: str) -> None:
        """Wait until no import of the request may still write its blocks: a failed import whose
        READ NIXL would not abort ends only when that READ does (rule 5). At once otherwise."""
        await self._drains.settled(request_id)

    async def _push(self, part: Part, tid: int, comps: tuple) -> Result:
        rid, peer, sched = part.rid, part.peer, self._scheduler
        blocks = tuple(wire.GroupBlocks(group_id=g.group_id, ids=tuple(int(b) for b in sched.blocks(rid, g.group_id)))
                       for g in self._memory.groups)
        # The producer is the writer: opened before the Import goes (its notification may come at once).
        imp = self._drains.open(rid, tid, comps, [peer.agent], part=part)
        t0 = time.perf_counter()
        try:
            await peer.channel.send(wire.Import(request_id=rid, blocks=blocks))
        except PeerLost:
            self._lost(peer)
        told = False
        # Until the producer's notification lands it, or its Done drains it, or (once it failed: the
        # producer's Failure, losing it, our lease deadline) the drain deadline passes.
        while not imp.ended.is_set():
            now = time.monotonic()
            if not told and now >= part.deadline:
                # Past the lease: ask the producer to stop, but keep the blocks out of reuse until it
                # confirms, the write lands, or the drain deadline passes (it may be in flight).
                told = True
                await send_quietly(peer.channel, wire.Failure(request_id=rid, code=wire.FailureCode.LEASE_EXPIRED,
                                                              detail="consumer lease deadline passed",
                                                              token=part.token))
                self._drains.fail(imp, "consumer lease deadline passed")
                continue
            self._drains.check_deadline(imp)
            wake = [] if told else [part.deadline]
            drain_by = self._drains.deadline(imp)
            if drain_by is not None:
                wake.append(drain_by)
            # At least once a second: a renewed lease or a failure heard meanwhile moves these.
            timeout = min([*(w - now for w in wake), 1.0])
            try:
                await asyncio.wait_for(imp.ended.wait(), max(timeout, 0.01))
            except asyncio.TimeoutError:
                pass
        self._drains.release(imp)
        seconds = time.perf_counter() - t0
        if imp.state is ImportState.LANDED:  # every component landed, with nothing failed before
            outcome = self._drains.outcome(imp) or TransferOutcome.UNKNOWN
            if outcome is TransferOutcome.ACCEPTED:
                return Result(request_id=rid, outcome=Outcome.READY, seconds=seconds)
            return self._ends.policy(rid, f"transfer {outcome.value}", kind=kind_of_outcome(outcome))
        error = part.failed or imp.failure or "the producer ended the transfer without writing"
        if imp.state is ImportState.EXPIRED:
            error += (f"; no word that its WRITE ended within {self._config.transfer_timeout_s} s of the failure: "
                      "blocks released at the drain deadline")
        return self._ends.policy(rid, error, kind=part.kind or FailureKind.LEASE)

    def give_up(self, rid: str, comps, error: str, *, kind: FailureKind = FailureKind.TRANSFER) -> Result:
        """Failed before any transfer was posted: recomputed or failed per the failure policy (Endings)."""
        return self._ends.give_up(rid, comps, error, kind=kind)

    async def flush(self, timeout_s: float) -> None:
        """The consumer closes: the Done messages still being sent go before its Bye (Endings.flush)."""
        await self._ends.flush(timeout_s)


__all__ = ["Importer", "Work"]
