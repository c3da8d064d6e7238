"""The decode side: asks producers for requests (``wire.Want``) and imports them.

A :class:`Consumer` may be connected to several producers (one per prefill TP
rank it needs); one import then has a *part* per producer and lands only when
every part landed: the scheduler sees one transfer for the whole request, so
its components become visible together (rule 4) or not at all. How it dials a
producer (the handshake, retried) is in :mod:`hybridkv.transport.dial`.

The consumer never pairs blocks itself: its :class:`~hybridkv.transport.plan.Planner`
(given at construction) is prepared once per set of producers and turns each
import's block lists into a :class:`~hybridkv.transport.plan.TransferPlan`. A plan
of whole pages is posted as prepped-list index pairs (NIXL merges back-to-back
pages), any other as ``(addr, len, dev)`` rows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hybridkv import wire
from hybridkv.errors import HybridKVError, PeerError, PeerLost
from hybridkv.fencing import NotYet, NotYetReason, TransferOutcome
from hybridkv.transport import auth
from hybridkv.transport.config import FailurePolicy, Outcome, Result, TransportConfig
from hybridkv.transport.dataplane import Op, Transfer, XferState
from hybridkv.transport.dial import _Dial
from hybridkv.transport.metrics import FailureKind
from hybridkv.transport.plan import PeerPlanner, Planner, TransferPlan
from hybridkv.transport.side import NOTIF_PREFIX, _Peer, _remember, _rid_of, _send_quietly, _Side


@dataclass(eq=False, kw_only=True)
class _Part:
    """One producer's share of an import."""

    rid: str
    peer: _Peer
    export: asyncio.Future  # -> (wire.Export, receipt time)
    token: bytes  # the request's capability, as the producer side issued it
    deadline: float = float("inf")
    landed: asyncio.Event = field(default_factory=asyncio.Event)
    failed: str | None = None  # the producer will not write / the blocks are gone / it refused
    kind: FailureKind | None = None  # why, for the metrics
    lease_lost: bool = False
    notified: bool = False
    wanted: bool = False


@dataclass(eq=False, kw_only=True)
class _Work:
    part: _Part
    plan: TransferPlan  # src: the producer's side, dst: ours


class Consumer(_Dial, _Side):
    """Decode side: dials producers and imports requests from them."""

    role = wire.Role.CONSUMER

    def __init__(self, memory, scheduler, config=None, *, planner: Planner) -> None:
        super().__init__(memory, scheduler, config or TransportConfig(), planner)
        self.peers: dict[str, _Peer] = {}
        self._parts: dict[tuple[str, str], _Part] = {}
        self._tasks: list[asyncio.Task] = []
        self._hb_sent: dict[str, float] = {}
        self._seq = 0
        self._init_dial()
        # (agent, request) this consumer released: an Export arriving after is refused at
        # once, not renewed for a reader that will never come (bounded).
        self._released: OrderedDict[tuple[str, str], bytes] = OrderedDict()  # -> the request's token
        #: the planner prepared per set of producers (agent names, in the order read)
        self.plans: dict[tuple[str, ...], PeerPlanner] = {}
        #: requests whose READ NIXL would not abort: ends when the READ does (see settled())
        self._settling: dict[str, asyncio.Task] = {}
        self._warn_if_open("")

    def describe(self) -> dict:
        return {**super().describe(),
                "parts": {f"{a}/{r}": {"wanted": p.wanted, "exported": p.export.done(), "landed": p.landed.is_set(),
                                       "failed": p.failed, "lease_lost": p.lease_lost}
                          for (a, r), p in self._parts.items()}}

    @property
    def peer(self) -> _Peer | None:
        """The first producer connected (the only one in the common 1:1 case)."""
        return next(iter(self.peers.values()), None)

    def prepared(self, agents: Sequence[str]) -> PeerPlanner:
        """The planner prepared for an import from these producers (made on first use)."""
        key = tuple(agents)
        prepared = self.plans.get(key)
        if prepared is None:
            prepared = self.planner.prepare(tuple(self._peer(a).memory for a in key), self.memory)
            self.plans[key] = prepared
        return prepared

    def _peer(self, agent: str | None) -> _Peer:
        if agent is None:
            if len(self.peers) != 1:
                raise ValueError(f"{len(self.peers)} producers connected; expected exactly one or a producer name")
            return next(iter(self.peers.values()))
        peer = self.peers.get(agent)
        if peer is None:
            raise ValueError(f"producer {agent!r}; expected one of {sorted(self.peers)}")
        return peer

    def _part(self, rid: str, peer: _Peer, token: bytes) -> _Part:
        part = self._parts.get((peer.agent, rid))
        if part is None:
            part = _Part(rid=rid, peer=peer, export=asyncio.get_running_loop().create_future(), token=token)
            self._parts[(peer.agent, rid)] = part
        elif part.token != token:
            raise ValueError(f"request {rid!r} was asked for with another capability token; expected the one "
                             "the producer side issued with it")
        return part

    async def want(self, request_id: str, *, token: bytes, peer: str | None = None, readers: int = 1) -> None:
        """Ask a producer for a request (``fetch`` does this; calling it earlier lets the
        Export arrive ahead). ``token``: the request's capability, issued by the producer side
        with the request. ``readers``: how many consumers read it together."""
        if not 1 <= readers <= wire.MAX_READERS:
            raise ValueError(f"readers = {readers}; expected 1..{wire.MAX_READERS}")
        auth.check_token(token, f"request {request_id!r}: token")
        p = self._peer(peer)
        part = self._part(request_id, p, token)
        if part.wanted:
            return
        part.wanted = True
        try:
            await p.channel.send(wire.Want(request_id=request_id, token=token, readers=readers))
        except PeerLost:
            self._lost(p)

    def exported(self, request_id: str, *, peer: str | None = None) -> bool:
        """Whether the producer's Export for the request arrived."""
        part = self._parts.get((self._peer(peer).agent, request_id))
        return part is not None and part.export.done()

    # ------------------------------------------------------------ control messages
    async def _serve(self, peer: _Peer) -> None:
        while not self._closing:
            msg = await self._next_message(peer)
            if msg is None:
                self._lost(peer)
                return
            if isinstance(msg, wire.Export):
                token = self._released.get((peer.agent, msg.request_id))
                if token is not None:
                    await _send_quietly(peer.channel, wire.Failure(
                        request_id=msg.request_id, code=wire.FailureCode.ABORTED, detail="released by the consumer",
                        token=token))
                    continue
                part = self._parts.get((peer.agent, msg.request_id))
                if part is None:
                    self.stats.unknown += 1  # never asked for (an Export comes only after a Want)
                elif not part.export.done():
                    part.export.set_result((msg, time.monotonic()))
            elif isinstance(msg, wire.Lease):
                self._on_lease(peer, msg)
            elif isinstance(msg, (wire.Failure, wire.Done)):
                part = self._parts.get((peer.agent, msg.request_id))
                if part is None or msg.token != part.token:
                    self.stats.unknown += 1
                elif not (isinstance(msg, wire.Done) and msg.ok):
                    part.failed = msg.detail if isinstance(msg, wire.Failure) else "producer failed"
                    part.kind = _KIND_OF_CODE.get(msg.code, FailureKind.REFUSED) if isinstance(
                        msg, wire.Failure) else FailureKind.TRANSFER
                    if not part.export.done():  # refused before any Export (claimed, unknown)
                        part.export.set_exception(PeerError(f"producer refused {msg.request_id}: {part.failed}"))
                    part.landed.set()
            elif isinstance(msg, wire.Bye):
                self._lost(peer)
                return
            else:
                self.stats.rejected += 1

    def _lost(self, peer: _Peer) -> None:
        if not peer.alive:
            return
        peer.alive = False
        for (agent, _), part in self._parts.items():
            if agent != peer.agent:
                continue
            if part.failed is None:
                part.failed, part.kind = "producer lost", FailureKind.PEER_LOST
            if not part.export.done():
                part.export.set_exception(PeerLost("producer lost"))
            part.landed.set()

    def alive(self, agent: str) -> bool:
        """Whether the producer ``agent`` is connected and its control channel works."""
        peer = self.peers.get(agent)
        return peer is not None and peer.alive

    async def release(self, request_id: str, *, token: bytes, peer: str,
                      detail: str = "released by the consumer") -> None:
        """This consumer will not read the request (asked for or not): the producer frees its
        blocks now instead of when the lease lapses. A fetch of it in progress fails. ``token``:
        the request's capability (the producer ignores a release without it)."""
        p = self._peer(peer)
        _remember(self._released, (p.agent, request_id), token)
        part = self._parts.pop((p.agent, request_id), None)
        if part is not None:
            part.failed = part.failed or detail
            if not part.export.done():
                part.export.set_exception(PeerError(f"{request_id}: {detail}"))
                part.export.exception()  # retrieved: nobody may wait on it
            part.landed.set()
        if p.alive:
            await _send_quietly(p.channel, wire.Failure(request_id=request_id, code=wire.FailureCode.ABORTED,
                                                        detail=detail[: wire.MAX_TEXT], token=token))

    async def forget(self, agent: str) -> None:
        """Drop a producer (a restarted one answers under a new agent name at the same address):
        its parts fail, its channel closes, NIXL unloads its agent (``remove_remote_agent``)."""
        peer = self.peers.pop(agent, None)
        if peer is None:
            return
        was_alive = peer.alive
        self._lost(peer)
        if was_alive:
            await _send_quietly(peer.channel, wire.Bye(reason="forgotten"))
        await peer.channel.close()
        for key in [k for k in self.plans if agent in k]:
            del self.plans[key]
        self._hb_sent.pop(agent, None)
        try:
            self.dp.remove_peer(agent)
        except Exception:  # NIXL may already have dropped a dead peer; nothing else refers to it
            pass

    def _on_lease(self, peer: _Peer, msg: wire.Lease) -> None:
        part = self._parts.get((peer.agent, msg.request_id))
        if part is None:
            return
        if msg.lease_s <= 0:
            part.lease_lost = True
            return
        # Conservative: from when our renewal left, not when the answer came (lease.py).
        sent = self._hb_sent.get(peer.agent, time.monotonic())
        deadline = sent + msg.lease_s * (1 - self.config.lease_margin)
        if deadline > part.deadline or part.deadline == float("inf"):
            part.deadline = deadline
            # The request's lease is its shortest part's.
            earliest = min(p.deadline for (_, r), p in self._parts.items() if r == msg.request_id)
            if earliest != float("inf") and self.scheduler.has_request(msg.request_id):
                self.scheduler.lease_renewed(msg.request_id, earliest)

    async def _heartbeats(self, peer: _Peer) -> None:
        period = self.config.heartbeat_s or max(0.05, peer.lease_s / 6)
        while not self._closing and peer.alive:
            await asyncio.sleep(period)
            tickets = [wire.Ticket(request_id=r, token=p.token) for (a, r), p in self._parts.items()
                       if a == peer.agent and p.export.done()]
            self._seq += 1
            self._hb_sent[peer.agent] = time.monotonic()
            try:
                # In pieces the wire allows; the producer answers one before it reads the next.
                for i in range(0, max(len(tickets), 1), wire.MAX_REQUESTS_PER_HEARTBEAT):
                    await peer.channel.send(wire.Heartbeat(
                        seq=self._seq, tickets=tuple(tickets[i:i + wire.MAX_REQUESTS_PER_HEARTBEAT])))
            except PeerLost:
                self._lost(peer)
                return

    def _on_notif(self, agent: str, msg: bytes) -> None:
        rid = _rid_of(msg)
        part = self._parts.get((agent, rid)) if rid is not None else None
        if part is None or self.config.mode is not wire.Mode.PUSH:
            self.stats.unknown += 1
            return
        if part.notified:
            self.stats.duplicates += 1
            return
        part.notified = True
        part.landed.set()

    # ------------------------------------------------------------ imports
    async def fetch(self, request_id: str, components: Iterable, *, token: bytes,
                    peers: Sequence[str] | None = None, readers: int = 1) -> Result:
        """Import a request whose blocks the engine allocated (scheduler.add_request(expect=...)).

        Asks each producer in ``peers`` (default: the only one connected) for the
        request, waits for their Exports, posts the transfer the planner made when
        the fence allows, and ends in a defined state: READY once every part landed,
        or per the failure policy RECOMPUTE or FAILED. ``token``: the request's capability,
        issued by the producer side with the request. ``readers``: consumers sharing each
        producer's copy.
        """
        auth.check_token(token, f"request {request_id!r}: token")
        comps = tuple(components)
        targets = [self._peer(a) for a in peers] if peers else [self._peer(None)]
        if len({p.agent for p in targets}) != len(targets):
            raise ValueError(f"producers {[p.agent for p in targets]} repeat; expected distinct ones")
        if len(targets) > 1 and self.config.mode is not wire.Mode.PULL:
            raise ValueError(f"{len(targets)} producers for one request in {self.config.mode.name} mode; "
                             "expected pull mode")
        parts = [self._part(request_id, p, token) for p in targets]
        async def ask_and_wait():
            for p in targets:
                await self.want(request_id, token=token, peer=p.agent, readers=readers)
            return await asyncio.gather(*(asyncio.shield(x.export) for x in parts))

        try:
            try:
                # Asking is inside the timeout too: a send that never completes must not hang the import.
                got = await asyncio.wait_for(ask_and_wait(), self.config.export_timeout_s)
            except asyncio.TimeoutError:
                await self._tell_parts(parts, "no export from every producer in time")
                return self._give_up(request_id, comps, "no export from the producer in time",
                                     kind=FailureKind.NO_EXPORT)
            except HybridKVError as exc:  # lost, or refused (claimed by another consumer)
                await self._tell_parts(parts, str(exc))
                kind = FailureKind.PEER_LOST if isinstance(exc, PeerLost) else next(
                    (p.kind for p in parts if p.kind is not None), FailureKind.REFUSED)
                return self._give_up(request_id, comps, str(exc), kind=kind)
            result = await self._import(request_id, parts, got, comps)
            if result.outcome is Outcome.READY and result.planned is not None:  # pull: this side posted
                self.metrics.transfer(nbytes=result.nbytes, seconds=result.seconds, post_seconds=result.post_seconds,
                                      descriptors=result.planned if result.descriptors is None else result.descriptors)
            return result
        finally:
            for p in targets:
                self._parts.pop((p.agent, request_id), None)

    async def _tell_parts(self, parts: Sequence[_Part], detail: str) -> None:
        """Producers that exported to us while the import gave up: their blocks are free."""
        for part in parts:
            if part.export.done() and not part.export.cancelled() and part.export.exception() is None:
                await _send_quietly(part.peer.channel, wire.Failure(
                    request_id=part.rid, code=wire.FailureCode.ABORTED, detail=detail[: wire.MAX_TEXT],
                    token=part.token))

    def _work(self, part: _Part, export: wire.Export, mine: dict[int, np.ndarray], planned: PeerPlanner,
              source: int) -> _Work:
        wire.check_blocks(export.blocks, part.peer.memory.group_bounds(), what=f"export of {part.rid}")
        theirs = {g.group_id: np.asarray(g.ids, dtype=np.int64) for g in export.blocks}
        plan = planned.plan(source, theirs, mine)
        plan.check()
        return _Work(part=part, plan=plan)

    async def _import(self, rid: str, parts: list[_Part], got, comps) -> Result:
        sched = self.scheduler
        for part, (export, received) in zip(parts, got):
            if part.deadline == float("inf"):
                part.deadline = received + export.lease_s * (1 - self.config.lease_margin)
        mine = {g.group_id: np.asarray(sched.blocks(rid, g.group_id), dtype=np.int64) for g in self.memory.groups}
        try:
            # Push mode posts the producer's plan; planning here too refuses a mismatched export early.
            planned = self.prepared([p.peer.agent for p in parts])
            work = [self._work(part, export, mine, planned, i) for i, (part, (export, _)) in enumerate(zip(parts, got))]
        except ValueError as exc:
            self.stats.rejected += 1
            for part in parts:
                await _send_quietly(part.peer.channel, wire.Failure(
                    request_id=rid, code=wire.FailureCode.PROTOCOL, detail=str(exc)[: wire.MAX_TEXT],
                    token=part.token))
            return self._give_up(rid, comps, f"export does not match the request: {exc}", kind=FailureKind.PROTOCOL)
        fenced_from = time.perf_counter()
        while True:
            failed = next((p.failed for p in parts if p.failed), None)
            if failed or any(p.lease_lost for p in parts):
                await self._tell_parts(parts, failed or "lease lost")
                kind = next((p.kind for p in parts if p.failed), None) or FailureKind.LEASE
                return self._give_up(rid, comps, failed or "lease lost before the transfer started", kind=kind)
            tid = sched.post_import(rid, components=comps, lease_deadline=min(p.deadline for p in parts))
            if not isinstance(tid, NotYet):
                break
            if tid.reason is NotYetReason.LEASE_TOO_SHORT:
                await self._tell_parts(parts, "lease too short")
                return self._give_up(rid, comps, "lease expired before the transfer could start",
                                     kind=FailureKind.LEASE)
            await asyncio.sleep(self.config.pump_idle_s)
        fence_wait = time.perf_counter() - fenced_from
        if self.config.mode is wire.Mode.PULL:
            result = await self._pull_parts(rid, tid, work)
        else:
            result = await self._push(parts[0], tid)
        return dataclasses.replace(result, fence_wait_seconds=fence_wait)

    async def _end_parts(self, work: Sequence[_Work], ok: bool) -> None:
        for w in work:
            await _send_quietly(w.part.peer.channel, wire.Done(request_id=w.part.rid, ok=ok, token=w.part.token))

    def _post(self, w: _Work, notif: bytes) -> Transfer:
        """Post one producer's READ (the demo's fault injection overrides this)."""
        return self.dp.post_plan(Op.READ, w.part.peer.agent, w.plan, notif)

    async def _pull_parts(self, rid: str, tid: int, work: list[_Work]) -> Result:
        t0 = time.perf_counter()
        notif = NOTIF_PREFIX + rid.encode() if self.config.notify_reads else b""
        posted: list[Transfer] = []
        error = None
        for w in work:
            if w.plan.num_descriptors == 0:
                continue  # nothing of this producer's is needed here (GQA duplicate): Done tells it
            try:
                posted.append(self._post(w, notif))
            except Exception as exc:
                error = str(exc)
                break
        post_seconds = time.perf_counter() - t0
        # Every posted READ ends before the blocks are judged: bytes may land until then (rule 5).
        # Past the lease the bytes are not trusted anyway; past the timeout the peer or link is stuck.
        give_up_at = time.monotonic() + self.config.transfer_timeout_s
        parts = [w.part for w in work]
        until = lambda: min(give_up_at, min(p.deadline for p in parts))  # noqa: E731 - leases renew meanwhile
        states = [await self._wait_xfer(x, until) for x in posted]
        seconds = time.perf_counter() - t0
        stuck = [x for x, s in zip(posted, states) if s is XferState.IN_PROGRESS]
        if stuck:
            return await self._abandon(rid, tid, work, posted, stuck)
        ok = error is None and all(s is XferState.DONE for s in states)
        tel = [self.dp.telemetry(x) for x in posted] if self.config.dataplane.telemetry and ok else None
        for x in posted:
            self.dp.release(x)
        if not ok:
            self.scheduler.transfer_failed(tid)
            await self._end_parts(work, False)
            return self._policy(rid, error or "READ failed", kind=FailureKind.TRANSFER)
        if any(w.part.lease_lost for w in work):
            self.scheduler.transfer_failed(tid)
            await self._end_parts(work, False)
            return self._policy(rid, "lease lapsed during the READ: bytes not trusted", kind=FailureKind.LEASE)
        outcome = self.scheduler.transfer_landed(tid)
        await self._end_parts(work, True)
        if outcome is not TransferOutcome.ACCEPTED:
            return self._policy(rid, f"transfer {outcome.value}", kind=_kind_of_outcome(outcome))
        return Result(request_id=rid, outcome=Outcome.READY,
                      descriptors=None if tel is None else sum(t.descriptors for t in tel),
                      planned=sum(w.plan.num_descriptors for w in work),
                      indices=sum(w.plan.num_indices for w in work), nbytes=sum(x.nbytes for x in posted),
                      seconds=seconds, post_seconds=post_seconds)

    async def _abandon(self, rid: str, tid: int, work: list[_Work], posted: list[Transfer],
                       stuck: list[Transfer]) -> Result:
        """READs still in progress past their lease or the timeout: abort them. Aborted, the
        import failed like any other; not abortable, its blocks are quarantined until NIXL
        ends the READ (it may still write them) and the request fails."""
        self.stats.timed_out += 1
        self.metrics.failure(FailureKind.TIMEOUT)
        unabortable = [x for x in stuck if not self.dp.abort(x)]
        for x in posted:
            if x not in stuck:
                self.dp.release(x)
        await self._end_parts(work, False)
        why = f"READ of {rid} not done within its lease or {self.config.transfer_timeout_s} s"
        if not unabortable:
            self.scheduler.transfer_failed(tid)
            return self._policy(rid, why + "; aborted", kind=None)
        blocks = sum(len(self.scheduler.blocks(rid, g.group_id)) for g in self.memory.groups)
        self.metrics.quarantined(blocks)
        self.scheduler.abort(rid)  # rule 5: the blocks stay out of the pool while the READ is active
        task = asyncio.get_running_loop().create_task(self._settle_later(rid, tid, unabortable, blocks))
        self._tasks.append(task)
        self._settling[rid] = task
        return Result(request_id=rid, outcome=Outcome.FAILED, error=why + "; could not abort, blocks quarantined")

    async def _settle_later(self, rid: str, tid: int, xfers: list[Transfer], blocks: int) -> None:
        try:
            for x in xfers:
                # At the idle pace, not _wait_xfer's spin: this READ is already known to hang.
                while self.dp.state(x) is XferState.IN_PROGRESS:
                    await asyncio.sleep(self.config.pump_idle_s)
                self.dp.release(x)
            self.scheduler.transfer_failed(tid)
            self.metrics.quarantine_released(blocks)
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

    async def _push(self, part: _Part, tid: int) -> Result:
        rid, peer, sched = part.rid, part.peer, self.scheduler
        blocks = tuple(wire.GroupBlocks(group_id=g.group_id, ids=tuple(int(b) for b in sched.blocks(rid, g.group_id)))
                       for g in self.memory.groups)
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
                await _send_quietly(peer.channel, wire.Failure(request_id=rid, code=wire.FailureCode.LEASE_EXPIRED,
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
            self.metrics.failure(kind)
        if self.config.failure_policy is FailurePolicy.RECOMPUTE and self.scheduler.has_request(rid):
            self.scheduler.recompute(rid)
            return Result(request_id=rid, outcome=Outcome.RECOMPUTE, error=error)
        self.scheduler.abort(rid)
        return Result(request_id=rid, outcome=Outcome.FAILED, error=error)

    def _give_up(self, rid: str, comps, error: str, *, kind: FailureKind = FailureKind.TRANSFER) -> Result:
        """Failed before any transfer was posted: nothing is in flight. Under RECOMPUTE the request
        computes locally even while steps touching its blocks are pending (a stalled decode): a load
        that can no longer complete degrades, it does not fail."""
        self.metrics.failure(kind)
        sched = self.scheduler
        if self.config.failure_policy is FailurePolicy.RECOMPUTE and sched.has_request(rid):
            sched.recompute(rid)
            return Result(request_id=rid, outcome=Outcome.RECOMPUTE, error=error)
        sched.abort(rid)
        return Result(request_id=rid, outcome=Outcome.FAILED, error=error)

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        await self._close_dialing()
        for peer in self.peers.values():
            if peer.alive:
                await _send_quietly(peer.channel, wire.Bye(reason="closing"))
                await peer.channel.close()
        await super().close()


#: What a producer's Failure says, as a failure kind.
_KIND_OF_CODE = {
    wire.FailureCode.TRANSFER_ERROR: FailureKind.TRANSFER,
    wire.FailureCode.LEASE_EXPIRED: FailureKind.LEASE,
    wire.FailureCode.UNKNOWN_REQUEST: FailureKind.REFUSED,
    wire.FailureCode.ABORTED: FailureKind.REFUSED,
    wire.FailureCode.PROTOCOL: FailureKind.PROTOCOL,
    wire.FailureCode.CLAIMED: FailureKind.REFUSED,
}


def _kind_of_outcome(outcome: TransferOutcome) -> FailureKind:
    # LATE: landed past the lease, bytes not trusted; anything else is a transfer the scheduler refused.
    return FailureKind.LEASE if outcome is TransferOutcome.LATE else FailureKind.TRANSFER
