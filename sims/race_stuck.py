"""The ``stuck-writers`` race class of ``hybridkv sim race`` (issue 47): imports pushed through the ImportLedger.

Imports are pushed by one or two writers (SGLang's prefill ranks) through the real
:class:`~hybridkv.fencing.imports.ImportLedger` over the real scheduler, or pulled one read per component. A writer
may fail and still write late (inside the drain deadline), drain late or never; a read may fail while the others
run. The engine aborts a failed import (the client sends the request again under the same id: a new incarnation,
while the old one's writers may still write and speak) or gives it up and recomputes the prompt locally once the
scheduler lets it. A write that lands in a block of another request or incarnation, or of a request computing
locally, corrupts what that request computes on.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridkv.fencing.fence import FencePolicy, NotYet, PoolLayout
from hybridkv.fencing.imports import ImportLedger
from hybridkv.fencing.request_state import Component, RequestPhase, TransferOutcome
from hybridkv.fencing.scheduler import TransferScheduler
from hybridkv.ids import TransferId
from hybridkv.sims.race import CONV, GDN, KV, SSM, RaceClass, RaceResult, Writer, _Page, admit, transfer_expect

DRAIN_TICKS = 12  # the ledger's drain deadline, in loop iterations
_PART = {KV: "kv", CONV: "conv", SSM: "ssm"}


@dataclass(eq=False)
class _PReq:
    """One incarnation of a pushed request (an id aborted may come back: a new incarnation)."""

    uid: int
    inc: int
    att: list[int]
    gdn: int
    decode_steps: int
    expect: dict[tuple[int, str], tuple] = field(default_factory=dict)
    gen: int | None = None  # its import's ledger generation, once posted
    posted: bool = False
    pulls: int = 0  # pulled: its reads (one per component) still in flight
    landed: set = field(default_factory=set)  # parts its own writers landed (what it may compute on)
    executed: int = 0
    live: bool = True
    corrupted: bool = False
    local: bool = False  # gave its import up: computes its prompt here
    failed: bool = False  # its import failed (a writer's Failed): abort or give up
    give_up: bool = False

    @property
    def rid(self) -> str:
        return str(self.uid)


def _classify_stuck(got: tuple | None, part: str, r: _PReq) -> RaceClass | None:
    if got is not None and got[0] is Writer.TRANSFER and (got[1] != (r.uid, r.inc) or r.local):
        return RaceClass.STUCK_WRITERS  # a write of another request or incarnation, or after a give-up
    if part not in r.landed and not r.local:
        return RaceClass.PARTIAL_STATE  # computed before its own bytes arrived
    if got is not None and got[0] is Writer.STEP:
        return RaceClass.FREE_REUSE
    return None


def simulate_stuck(*, policy: FencePolicy, requests: int, seed: int, async_depth: int,
                    on_request_done: Callable[[], None] | None) -> RaceResult:
    rng = random.Random(f"{seed}:{RaceClass.STUCK_WRITERS.value}")
    blocks = 48
    now = [0.0]
    sched = TransferScheduler(PoolLayout.shared(num_blocks=blocks, num_groups=2), policy=policy,
                              clock=lambda: now[0])
    ledger = ImportLedger(sched, drain_timeout_s=DRAIN_TICKS, clock=lambda: now[0])
    mem: dict[int, _Page] = {}
    pending: deque[tuple[int, list[tuple[_PReq, list[int], int]]]] = deque()
    events: list[tuple[int, int, str, _PReq, int, Component | None, int]] = []  # (tick, seq, kind, ...)
    reqs: dict[int, _PReq] = {}  # the live incarnation of each id
    resident: dict[int, _PReq] = {}
    incs: dict[int, int] = {}
    retry: deque[int] = deque()  # aborted ids the client sends again
    causes: dict[str, int] = {}
    arrived = done = corrupted_any = n_aborted = seq = 0
    step = -1
    t = 0

    def finish(r: _PReq, *, completed: bool) -> None:
        nonlocal done, n_aborted
        r.live = False
        reqs.pop(r.uid, None)
        resident.pop(r.uid, None)
        if r.gen is not None:
            ledger.release(r.rid)  # the entry goes once every writer drained or the deadline passed
        if completed:
            done += 1
            if on_request_done is not None:
                on_request_done()
        else:
            n_aborted += 1
            retry.append(r.uid)

    def execute() -> None:
        nonlocal corrupted_any
        s, work = pending.popleft()
        for r, att, gdn in work:
            if r.live and not r.corrupted:
                found = set()
                for (k, part), want in r.expect.items():
                    got = mem.get(k, {}).get(part)
                    if got != want:
                        cls = _classify_stuck(got, part, r)
                        found.add(cls.value if cls else "other")
                if found:
                    r.corrupted = True
                    corrupted_any += 1
                    for name in found:
                        causes[name] = causes.get(name, 0) + 1
            v = (Writer.STEP, (r.uid, r.inc), s)
            mem[gdn] = {"kv": v, "conv": v, "ssm": v}  # GDN state rewritten in full by every step
            writes = {(gdn, "conv"): v, (gdn, "ssm"): v}
            if r.local:  # recomputing: the step writes the prompt's KV too
                for k in att:
                    mem[k] = {"kv": v, "conv": v, "ssm": v}
                    writes[(k, "kv")] = v
            if r.live:
                r.landed.update(("conv", "ssm"))
                r.expect.update(writes)
        sched.step_completed(s)
        for r, _, _ in work:
            if r.live:
                r.executed += 1
                if r.executed >= r.decode_steps:
                    sched.request_finished(r.rid)
                    finish(r, completed=True)

    def land(r: _PReq, comp: Component) -> None:
        """A writer's WRITE of one component of ``r``'s import lands in its blocks, whatever became of them."""
        part = _PART[comp]
        keys = r.att if comp is KV else [r.gdn]
        for i, k in enumerate(keys):
            v = (Writer.TRANSFER, (r.uid, r.inc), (part, i))
            if part == "kv":
                mem[k] = {"kv": v, "conv": v, "ssm": v}
            else:
                page = mem.setdefault(k, {})
                page[part] = v
                page["kv"] = v

    def post(r: _PReq) -> None:
        nonlocal seq
        r.posted = True
        if rng.random() < 0.3:  # pulled: one read per component, each may fail (no remote writer to drain)
            for c in (KV, CONV, SSM):
                tid = sched.post_import(r.rid, components=(c,))
                if isinstance(tid, NotYet):  # fresh blocks settle at once: not expected; try again later
                    r.posted = r.pulls > 0
                    return
                heapq.heappush(events, (t + rng.randint(1, async_depth + 6), seq := seq + 1, "read", r,
                                        int(rng.random() < 0.2), c, tid))  # type: ignore[arg-type]
                r.pulls += 1
            return
        tids: dict[Component, TransferId] = {}
        for c in (KV, CONV, SSM):
            tid = sched.post_import(r.rid, components=(c,))
            if isinstance(tid, NotYet):  # fresh blocks settle at once; nothing was published if not
                for x in tids.values():
                    sched.transfer_failed(x)
                return
            tids[c] = tid
        writers = rng.choice((1, 2))
        r.gen = gen = ledger.open(r.rid, request=r.rid, tids=tids, writers=writers)
        for w in range(writers):
            if rng.random() < 0.3:  # stuck: it fails, and its writes still land (inside the drain deadline)
                fail_at = t + rng.randint(0, 2)
                heapq.heappush(events, (fail_at, seq := seq + 1, "failed", r, w, None, gen))
                ticks = [t + rng.randint(2, DRAIN_TICKS - 1) for _ in tids]
                drains = rng.random() < 0.5  # or never: the deadline ends its transfers
            else:
                ticks = [t + rng.randint(1, async_depth + 2) for _ in tids]
                drains = True
            for c, at in zip(tids, ticks):
                heapq.heappush(events, (at, seq := seq + 1, "write", r, w, c, gen))
            if drains:
                heapq.heappush(events, (max(ticks) + rng.randint(0, 1), seq := seq + 1, "drained", r, w, None, gen))

    def deliver(until: float) -> None:
        while events and events[0][0] <= until:
            _, _, kind, r, w, comp, gen = heapq.heappop(events)
            if kind == "read":  # a pulled component's read ends; w: it failed, gen: its transfer id
                r.pulls -= 1
                if w:
                    sched.transfer_failed(gen)  # type: ignore[arg-type]
                    continue
                land(r, comp)  # type: ignore[arg-type]
                if sched.transfer_landed(gen) is TransferOutcome.ACCEPTED and reqs.get(r.uid) is r:  # type: ignore[arg-type]
                    r.landed.add(_PART[comp])  # type: ignore[index]
            elif kind == "write":
                land(r, comp)  # type: ignore[arg-type]
                got = ledger.landed(r.rid, w, (comp,), generation=gen)  # type: ignore[arg-type]
                if got and reqs.get(r.uid) is r:
                    r.landed.update(_PART[c] for c in got)
            elif kind == "drained":
                ledger.drained(r.rid, w, generation=gen)
            else:
                ledger.writer_failed(r.rid, w, "a WRITE may still land", generation=gen)

    while done < requests:
        t += 1
        now[0] = float(t)
        if t > 200 * requests + 1000:
            raise RuntimeError(f"race simulation made no progress after {t} iterations")
        deliver(t)
        ledger.expire()
        while len(pending) > async_depth:
            execute()
        # The engine answers failed imports: abort (the client will send the request again under its id) or
        # give up and recompute, once nothing of the import can still land (the scheduler refuses before).
        for r in list(reqs.values()):
            if r.uid in resident or r.local or not r.posted:
                continue
            if not r.failed and not sched.is_ready(r.rid):
                view = ledger.view(r.rid) if r.gen is not None else None
                if view is not None and view.generation == r.gen and view.failure is not None \
                        or sched.phase(r.rid) is RequestPhase.FAILED:
                    r.failed = True
                    r.give_up = rng.random() < 0.5
            if r.failed and not sched.is_ready(r.rid):
                if r.give_up:
                    try:
                        sched.recompute(r.rid)
                    except ValueError:
                        continue  # a write may still land: ask again next step
                    r.local = True
                    r.expect = {}
                else:
                    sched.abort(r.rid)
                    finish(r, completed=False)
            elif rng.random() < 0.02 and not sched.is_ready(r.rid):  # a client gives up
                sched.abort(r.rid)
                finish(r, completed=False)
        while len(reqs) < 24 and (arrived < requests or retry):
            n_att = rng.randint(1, 3)
            if sched.free_count() < n_att + 1:
                break
            if retry and (arrived >= requests or rng.random() < 0.5):
                uid = retry.popleft()
                if uid in reqs:
                    continue
            else:
                uid = arrived
                arrived += 1
            att, gdn = admit(sched, str(uid), n_att)
            inc = incs[uid] = incs.get(uid, 0) + 1
            r = _PReq(uid=uid, inc=inc, att=att, gdn=gdn, decode_steps=rng.randint(2, 6))
            r.expect.update(transfer_expect(att, gdn, (uid, inc)))
            reqs[uid] = r
        step += 1
        joined = [r for r in reqs.values() if r.uid not in resident and sched.is_ready(r.rid)]
        sched.step_scheduled(step, joined=[r.rid for r in joined])
        for r in joined:
            resident[r.uid] = r
        pending.append((step, [(r, r.att, r.gdn) for r in resident.values()]))
        # Imports are posted (the prefill learns the blocks) once the key's previous import is gone.
        for r in list(reqs.values()):
            if not r.posted and not r.local and r.rid not in ledger \
                    and sched.phase(r.rid) is RequestPhase.IMPORTING:
                post(r)
        if done >= requests:
            break
    # Drain: every write lands, every deadline passes, then the books are checked.
    while pending:
        execute()
    for r in list(reqs.values()):
        sched.abort(r.rid)
        finish(r, completed=False)
    t += DRAIN_TICKS + 2
    now[0] = float(t)
    deliver(t)
    ledger.expire()
    for rid in sched.request_ids():
        sched.abort(rid)
    sched.audit()
    if sched.free_count() != blocks:
        raise RuntimeError(f"{blocks - sched.free_count()} blocks leaked in the stuck-writers scenario")
    return RaceResult(race=RaceClass.STUCK_WRITERS, requests=requests, corrupted=causes.get("stuck-writers", 0),
                      corrupted_any=corrupted_any, aborted=n_aborted, steps=step + 1,
                      causes=dict(sorted(causes.items())))


__all__ = ["DRAIN_TICKS", "simulate_stuck"]
