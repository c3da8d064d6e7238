"""What one import runs through: the Exports awaited, the transfer posted when the fence allows, the end.

:class:`Importer` is held by :class:`~hybridkv.transport.consumer.Consumer`. ``fetch`` asks each
producer for its *part* of the request, waits for every Export, plans the transfer with the planner
prepared for those producers, posts it only when the scheduler's fence allows (``post_import``) and
ends the request in a defined state: READY once every part landed, else per the failure policy
(RECOMPUTE or FAILED). Pull mode posts one READ per producer and judges the blocks only once every
READ ended (rule 5): one NIXL will not abort keeps them quarantined until it does (``settled``).
Push mode asks the one producer to WRITE and waits for its notification or its word.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv import wire
from hybridkv.errors import HybridKVError, PeerLost
from hybridkv.fencing import NotYet, NotYetReason, TransferOutcome
from hybridkv.transport.config import FailurePolicy, Outcome, Result
from hybridkv.transport.dataplane import Op, Transfer, XferState
from hybridkv.transport.metrics import FailureKind
from hybridkv.transport.parts import Part, Parts
from hybridkv.transport.plan import PeerPlanner, TransferPlan
from hybridkv.transport.side import Peer, Side, notification, send_quietly


@dataclass(frozen=True, eq=False, kw_only=True)
class Work:
    """One producer's READ of an import: its part and the plan for it."""

    part: Part
    plan: TransferPlan  # src: the producer's side, dst: ours


class Importer:
    """The consumer's import path. Given the side (its config, scheduler, memory map, data plane
    and counters), the consumer's parts table, and from the consumer:

    - ``want(request_id, *, token, peer, readers)``: ask a producer for a request;
    - ``prepared(agents)``: the planner prepared for a set of producers;
    - ``lost(peer)``: a producer's channel failed;
    - ``post(work, notif)`` and ``wait(xfer, until)``: post one producer's READ (:meth:`post_read`)
      and wait for a transfer's end (``Side.wait_xfer``). They are the consumer's own methods, so
      that a subclass (the reference demo's fault injection) can override them.
    """

    def __init__(self, side: Side, parts: Parts, *, want: Callable[..., Awaitable[None]],
                 prepared: Callable[[Sequence[str]], PeerPlanner], lost: Callable[[Peer], None],
                 post: Callable[[Work, bytes], Transfer],
                 wait: Callable[[Transfer, Callable[[], float] | None], Awaitable[XferState]]) -> None:
        self._parts = parts
        self._want = want
        self._prepared = prepared
        self._lost = lost
        self._post = post
        self._wait_xfer = wait
        self._config = side.config
        self._scheduler = side.scheduler
        self._memory = side.memory
        self._dp = side.dp
        self._stats = side.stats
        self._metrics = side.metrics
        #: requests whose READ NIXL would not abort: ends when the READ does (see settled())
        self._settling: dict[str, asyncio.Task] = {}

    def cancel(self) -> None:
        """The consumer closes: waits for READs NIXL would not abort end here."""
        for task in list(self._settling.values()):
            task.cancel()

    async def fetch(self, request_id: str, comps: tuple, *, token: bytes, targets: Sequence[Peer],
                    readers: int) -> Result:
        """``Consumer.fetch``, its token checked and its producers found (``targets``)."""
        if len({p.agent for p in targets}) != len(targets):
            raise ValueError(f"producers {[p.agent for p in targets]} repeat; expected distinct ones")
        if len(targets) > 1 and self._config.mode is not wire.Mode.PULL:
            raise ValueError(f"{len(targets)} producers for one request in {self._config.mode.name} mode; "
                             "expected pull mode")
        parts = [self._parts.open(request_id, p, token) for p in targets]
        async def ask_and_wait():
            for p in targets:
                await self._want(request_id, token=token, peer=p.agent, readers=readers)
            return await asyncio.gather(*(asyncio.shield(x.export) for x in parts))

        try:
            try:
                # Asking is inside the timeout too: a send that never completes must not hang the import.
                got = await asyncio.wait_for(ask_and_wait(), self._config.export_timeout_s)
            except asyncio.TimeoutError:
                await self._tell_parts(parts, "no export from every producer in time")
                return self.give_up(request_id, comps, "no export from the producer in time",
                                    kind=FailureKind.NO_EXPORT)
            except HybridKVError as exc:  # lost, or refused (claimed by another consumer)
                await self._tell_parts(parts, str(exc))
                kind = FailureKind.PEER_LOST if isinstance(exc, PeerLost) else next(
                    (p.kind for p in parts if p.kind is not None), FailureKind.REFUSED)
                return self.give_up(request_id, comps, str(exc), kind=kind)
            result = await self._import(request_id, parts, got, comps)
            if result.outcome is Outcome.READY and result.planned is not None:  # pull: this side posted
                self._metrics.transfer(nbytes=result.nbytes, seconds=result.seconds, post_seconds=result.post_seconds,
                                       descriptors=result.planned if result.descriptors is None else result.descriptors)
            return result
        finally:
            for p in targets:
                self._parts.pop(p.agent, request_id)

    async def _tell_parts(self, parts: Sequence[Part], detail: str) -> None:
        """Producers that exported to us while the import gave up: their blocks are free."""
        for part in parts:
            if part.export.done() and not part.export.cancelled() and part.export.exception() is None:
                await send_quietly(part.peer.channel, wire.Failure(
                    request_id=part.rid, code=wire.FailureCode.ABORTED, detail=detail[: wire.MAX_TEXT],
                    token=part.token))

    def _work(self, part: Part, export: wire.Export, mine: dict[int, np.ndarray], planned: PeerPlanner,
              source: int) -> Work:
        wire.check_blocks(export.blocks, part.peer.memory.group_bounds(), what=f"export of {part.rid}")
        theirs = {g.group_id: np.asarray(g.ids, dtype=np.int64) for g in export.blocks}
        plan = planned.plan(source, theirs, mine)
        plan.check()
        return Work(part=part, plan=plan)

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
            return self.give_up(rid, comps, f"export does not match the request: {exc}", kind=FailureKind.PROTOCOL)
        fenced_from = time.perf_counter()
        while True:
            failed = next((p.failed for p in parts if p.failed), None)
            if failed or any(p.lease_lost for p in parts):
                await self._tell_parts(parts, failed or "lease lost")
                kind = next((p.kind for p in parts if p.failed), None) or FailureKind.LEASE
                return self.give_up(rid, comps, failed or "lease lost before the transfer started", kind=kind)
            tid = sched.post_import(rid, components=comps, lease_deadline=min(p.deadline for p in parts))
            if not isinstance(tid, NotYet):
                break
            if tid.reason is NotYetReason.LEASE_TOO_SHORT:
                await self._tell_parts(parts, "lease too short")
                return self.give_up(rid, comps, "lease expired before the transfer could start",
                                    kind=FailureKind.LEASE)
            await asyncio.sleep(self._config.pump_idle_s)
        fence_wait = time.perf_counter() - fenced_from
        if self._config.mode is wire.Mode.PULL:
            result = await self._pull_parts(rid, tid, work)
        else:
            result = await self._push(parts[0], tid)
        return dataclasses.replace(result, fence_wait_seconds=fence_wait)

    async def _end_parts(self, work: Sequence[Work], ok: bool) -> None:
        for w in work:
            await send_quietly(w.part.peer.channel, wire.Done(request_id=w.part.rid, ok=ok, token=w.part.token))

    def post_read(self, w: Work, notif: bytes) -> Transfer:
        """Post one producer's READ: what the consumer's ``post`` does unless overridden."""
        return self._dp.post_plan(Op.READ, w.part.peer.agent, w.plan, notif)

    async def _pull_parts(self, rid: str, tid: int, work: list[Work]) -> Result:
        t0 = time.perf_counter()
        posted: list[Transfer] = []
        error = None
        for w in work:
            if w.plan.num_descriptors == 0:
                continue  # nothing of this producer's is needed here (GQA duplicate): Done tells it
            # tagged for the session of the producer it goes to (side.notification)
            notif = notification(w.part.peer, rid) if self._config.notify_reads else b""
            try:
                posted.append(self._post(w, notif))
            except Exception as exc:
                error = str(exc)
                break
        post_seconds = time.perf_counter() - t0
        # Every posted READ ends before the blocks are judged: bytes may land until then (rule 5).
        # Past the lease the bytes are not trusted anyway; past the timeout the peer or link is stuck.
        give_up_at = time.monotonic() + self._config.transfer_timeout_s
        parts = [w.part for w in work]
        until = lambda: min(give_up_at, min(p.deadline for p in parts))  # noqa: E731 - leases renew meanwhile
        states = [await self._wait_xfer(x, until) for x in posted]
        seconds = time.perf_counter() - t0
        stuck = [x for x, s in zip(posted, states) if s is XferState.IN_PROGRESS]
        if stuck:
            return await self._abandon(rid, tid, work, posted, stuck)
        ok = error is None and all(s is XferState.DONE for s in states)
        tel = [self._dp.telemetry(x) for x in posted] if self._config.dataplane.telemetry and ok else None
        for x in posted:
            self._dp.release(x)
        if not ok:
            self._scheduler.transfer_failed(tid)
            await self._end_parts(work, False)
            return self._policy(rid, error or "READ failed", kind=FailureKind.TRANSFER)
        if any(w.part.lease_lost for w in work):
            self._scheduler.transfer_failed(tid)
            await self._end_parts(work, False)
            return self._policy(rid, "lease lapsed during the READ: bytes not trusted", kind=FailureKind.LEASE)
        outcome = self._scheduler.transfer_landed(tid)
        await self._end_parts(work, True)
        if outcome is not TransferOutcome.ACCEPTED:
            return self._policy(rid, f"transfer {outcome.value}", kind=_kind_of_outcome(outcome))
        return Result(request_id=rid, outcome=Outcome.READY,
                      descriptors=None if tel is None else sum(t.descriptors for t in tel),
                      planned=sum(w.plan.num_descriptors for w in work),
                      indices=sum(w.plan.num_indices for w in work), nbytes=sum(x.nbytes for x in posted),
                      seconds=seconds, post_seconds=post_seconds)

    async def _abandon(self, rid: str, tid: int, work: list[Work], posted: list[Transfer],
                       stuck: list[Transfer]) -> Result:
        """READs still in progress past their lease or the timeout: abort them. Aborted, the
        import failed like any other; not abortable, its blocks are quarantined until NIXL
        ends the READ (it may still write them) and the request fails."""
        self._stats.timed_out += 1
        self._metrics.failure(FailureKind.TIMEOUT)
        unabortable = [x for x in stuck if not self._dp.abort(x)]
        for x in posted:
            if x not in stuck:
                self._dp.release(x)
        await self._end_parts(work, False)
        why = f"READ of {rid} not done within its lease or {self._config.transfer_timeout_s} s"
        if not unabortable:
            self._scheduler.transfer_failed(tid)
            return self._policy(rid, why + "; aborted", kind=None)
        blocks = sum(len(self._scheduler.blocks(rid, g.group_id)) for g in self._memory.groups)
        self._metrics.quarantined(blocks)
        self._scheduler.abort(rid)  # rule 5: the blocks stay out of the pool while the READ is active
        task = asyncio.get_running_loop().create_task(self._settle_later(rid, tid, unabortable, blocks))
        self._settling[rid] = task
        return Result(request_id=rid, outcome=Outcome.FAILED, error=why + "; could not abort, blocks quarantined")

    async def _settle_later(self, rid: str, tid: int, xfers: list[Transfer], blocks: int) -> None:
        try:
            for x in xfers:
                # At the idle pace, not _wait_xfer's spin: this READ is already known to hang.
                while self._dp.state(x) is XferState.IN_PROGRESS:
                    await asyncio.sleep(self._config.pump_idle_s)
                self._dp.release(x)
            self._scheduler.transfer_failed(tid)
            self._metrics.quarantine_released(blocks)
        finally:
            if self._settling.get(rid) is asyncio.current_task():
                del self._settling[rid]

    def settling(self, request_id: str) -> bool:
        """Whether a READ of the request that NIXL would not abort may still write its blocks."""
        return request_id in self._settling

    async def settled(self, request_id: str) -> None:
        """Wait until no READ of the request may still write its blocks: a failed import whose
        READ NIXL would not abort ends only when that READ does (rule 5). At once otherwise."""
        task = self._settling.get(request_id)
        if task is not None:
            await asyncio.shield(task)

    async def _push(self, part: Part, tid: int) -> Result:
        rid, peer, sched = part.rid, part.peer, self._scheduler
        blocks = tuple(wire.GroupBlocks(group_id=g.group_id, ids=tuple(int(b) for b in sched.blocks(rid, g.group_id)))
                       for g in self._memory.groups)
        t0 = time.perf_counter()
        try:
            await peer.channel.send(wire.Import(request_id=rid, blocks=blocks))
        except PeerLost:
            self._lost(peer)
        told = False
        while not part.landed.is_set():
            left = part.deadline - time.monotonic()
            if left <= 0 and not told:
                # Past the lease: ask the producer to stop, but keep the blocks quarantined
                # until it confirms or the write lands (it may be in flight).
                told = True
                await send_quietly(peer.channel, wire.Failure(request_id=rid, code=wire.FailureCode.LEASE_EXPIRED,
                                                              detail="consumer lease deadline passed",
                                                              token=part.token))
            try:
                await asyncio.wait_for(part.landed.wait(), max(left, 0.05) if not told else None)
            except asyncio.TimeoutError:
                pass
        seconds = time.perf_counter() - t0
        if part.notified and not part.lease_lost:
            outcome = sched.transfer_landed(tid)  # LATE if past the deadline
            if outcome is TransferOutcome.ACCEPTED:
                return Result(request_id=rid, outcome=Outcome.READY, seconds=seconds)
            return self._policy(rid, f"transfer {outcome.value}", kind=_kind_of_outcome(outcome))
        sched.transfer_failed(tid)
        return self._policy(rid, part.failed or "lease lapsed", kind=part.kind or FailureKind.LEASE)

    def _policy(self, rid: str, error: str, *, kind: FailureKind | None = FailureKind.TRANSFER) -> Result:
        """The import failed after a transfer was posted: apply the failure policy (``kind``: why,
        for the metrics; None where it was counted already)."""
        if kind is not None:
            self._metrics.failure(kind)
        if self._config.failure_policy is FailurePolicy.RECOMPUTE and self._scheduler.has_request(rid):
            self._scheduler.recompute(rid)
            return Result(request_id=rid, outcome=Outcome.RECOMPUTE, error=error)
        self._scheduler.abort(rid)
        return Result(request_id=rid, outcome=Outcome.FAILED, error=error)

    def give_up(self, rid: str, comps, error: str, *, kind: FailureKind = FailureKind.TRANSFER) -> Result:
        """Failed before any transfer was posted: nothing is in flight. Under RECOMPUTE the request
        computes locally even while steps touching its blocks are pending (a stalled decode): a load
        that can no longer complete degrades, it does not fail."""
        self._metrics.failure(kind)
        sched = self._scheduler
        if self._config.failure_policy is FailurePolicy.RECOMPUTE and sched.has_request(rid):
            sched.recompute(rid)
            return Result(request_id=rid, outcome=Outcome.RECOMPUTE, error=error)
        sched.abort(rid)
        return Result(request_id=rid, outcome=Outcome.FAILED, error=error)


def _kind_of_outcome(outcome: TransferOutcome) -> FailureKind:
    # LATE: landed past the lease, bytes not trusted; anything else is a transfer the scheduler refused.
    return FailureKind.LEASE if outcome is TransferOutcome.LATE else FailureKind.TRANSFER


__all__ = ["Importer", "Work"]
