"""The asynchronous-scheduling race simulator.

An engine-step model of a decode worker in a disaggregated pair, driving the
real :class:`hybridkv.fencing.scheduler.TransferScheduler` (not a model of it):
remote requests arrive, blocks are allocated from one hybrid pool (attention
and GDN pages alias the same memory, as in vLLM's hybrid allocator), imports
are posted and land after a random latency (RDMA, outside the device stream),
the scheduler runs ``async_depth`` steps ahead of the device, every step
rewrites each running request's whole GDN state, and requests finish when the
output of their last step is processed - by which time later steps that still
include them are already queued.

Memory is simulated per page, with the writer of every byte range recorded,
so a request that computes on bytes its producer did not write is caught and
the race responsible is read off the bytes it found. Each race class runs as
its own scenario, enabling only the ingredients of that race:

* ``free-reuse`` (vLLM Race A): requests finish under async scheduling; their
  freed pages are reused by incoming transfers while stale steps still run;
* ``zeroing`` (vLLM Race B): newly allocated attention pages are zeroed by a
  kernel queued behind the in-flight step; the RDMA lands first;
* ``abort-reuse`` (SGLang #24527): importing requests are aborted while their
  transfer is in flight; their pages are reused before the writer finished;
* ``partial-state`` (SGLang #39846): KV, conv and SSM state arrive as separate
  transfers with separate latencies.
* ``stuck-writers`` (SGLang #24527 with remote writers, issue 47): imports pushed by one or two
  writers through the :class:`~hybridkv.fencing.imports.ImportLedger`; a writer may fail and still
  write late (inside the drain deadline), drain late or never; the engine aborts a failed import
  (and admits the request again under the same id: a new incarnation, while the old one's writers
  may still write and speak) or gives it up and recomputes the prompt locally. A late write that
  lands in a block of another request, another incarnation, or a request computing locally corrupts it.
"""

from __future__ import annotations

import enum
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridkv.fencing.fence import FencePolicy, NotYet, PoolLayout
from hybridkv.fencing.request_state import Component, ComponentKind, RequestPhase, TransferOutcome
from hybridkv.fencing.scheduler import TransferScheduler

ATT, GDN = 0, 1
KV = Component(group=ATT, kind=ComponentKind.KV)
CONV = Component(group=GDN, kind=ComponentKind.CONV)
SSM = Component(group=GDN, kind=ComponentKind.SSM)
ALL = frozenset((KV, CONV, SSM))


class RaceClass(enum.Enum):
    FREE_REUSE = "free-reuse"
    ZEROING = "zeroing"
    ABORT_REUSE = "abort-reuse"
    PARTIAL_STATE = "partial-state"
    STUCK_WRITERS = "stuck-writers"


class Writer(enum.Enum):
    STEP = "step"
    TRANSFER = "transfer"
    ZERO = "zero"


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """The ingredients enabled for one race class."""

    zeroing: bool = False
    abort_rate: float = 0.0
    split_components: bool = False

    @classmethod
    def of(cls, race: RaceClass) -> Scenario:
        if race is RaceClass.ZEROING:
            return cls(zeroing=True)
        if race is RaceClass.ABORT_REUSE:
            return cls(abort_rate=0.15)
        if race is RaceClass.PARTIAL_STATE:
            return cls(split_components=True)
        return cls()


@dataclass(frozen=True, kw_only=True)
class RaceResult:
    race: RaceClass
    requests: int
    corrupted: int  # requests corrupted by this scenario's race
    corrupted_any: int  # by any race (unfenced, races of other classes show up too)
    aborted: int
    steps: int
    causes: dict[str, int]


@dataclass(eq=False)
class _Req:
    uid: int
    att: list[int]
    gdn: int
    decode_steps: int
    expect: dict[tuple[int, str], tuple] = field(default_factory=dict)
    to_post: set = field(default_factory=set)
    landed: set = field(default_factory=set)  # parts whose transfer landed and was accepted
    executed: int = 0
    live: bool = True
    corrupted: bool = False


@dataclass(eq=False)
class _Xfer:
    req: _Req
    tid: int
    comps: frozenset
    land_at: int


# A page is a dict part -> value; value = (writer, uid, detail).
_Page = dict


def _classify(got: tuple | None, part: str, landed: set[str], aborted: set[int]) -> RaceClass | None:
    if part not in landed:
        return RaceClass.PARTIAL_STATE  # computed before its own bytes arrived
    if got is None:
        return None
    if got[0] is Writer.ZERO:
        return RaceClass.ZEROING
    if got[0] is Writer.TRANSFER and got[1] in aborted:
        return RaceClass.ABORT_REUSE
    if got[0] is Writer.STEP:
        return RaceClass.FREE_REUSE
    return None


def admit(sched: TransferScheduler, rid: str, n_att: int) -> tuple[list, object]:
    """A new request of every component: n_att attention blocks and one GDN slot, as page keys."""
    sched.add_request(rid, expect=ALL)
    att = list(sched.allocate(rid, ATT, n_att))  # type: ignore[arg-type]
    gdn = sched.allocate(rid, GDN, 1)[0]  # type: ignore[index]
    key = sched.table.key
    return [key(ATT, b) for b in att], key(GDN, gdn)


def transfer_expect(att: list, gdn: object, writer: object) -> dict:
    """What the transfer of `writer` (a request, or a request's incarnation) puts in each of its pages."""
    expect = {(k, "kv"): (Writer.TRANSFER, writer, ("kv", i)) for i, k in enumerate(att)}
    expect[(gdn, "conv")] = (Writer.TRANSFER, writer, ("conv", 0))
    expect[(gdn, "ssm")] = (Writer.TRANSFER, writer, ("ssm", 0))
    return expect


def simulate(
    race: RaceClass,
    *,
    policy: FencePolicy,
    requests: int,
    seed: int,
    async_depth: int,
    on_request_done: Callable[[], None] | None = None,
) -> RaceResult:
    """Replay ``requests`` remote requests through one scenario; count corruption."""
    if not isinstance(requests, int) or requests <= 0:
        raise ValueError(f"requests = {requests!r}; expected a positive int")
    if not isinstance(async_depth, int) or not 0 <= async_depth <= 8:
        raise ValueError(f"async depth {async_depth!r}; expected an int in [0, 8]")
    if race is RaceClass.STUCK_WRITERS:
        from hybridkv.sims.race_stuck import simulate_stuck  # it builds on this module's names

        return simulate_stuck(policy=policy, requests=requests, seed=seed, async_depth=async_depth,
                              on_request_done=on_request_done)
    scen = Scenario.of(race)
    rng = random.Random(f"{seed}:{race.value}")
    blocks = 48
    sched = TransferScheduler(PoolLayout.shared(num_blocks=blocks, num_groups=2), policy=policy)
    mem: dict[int, _Page] = {}
    pending: deque[tuple[int, list[tuple[_Req, list[int], int]], list[int]]] = deque()
    inflight: list[_Xfer] = []
    reqs: dict[int, _Req] = {}
    resident: dict[int, _Req] = {}
    aborted: set[int] = set()
    causes: dict[str, int] = {}
    arrived = 0
    done = 0
    corrupted_any = 0
    n_aborted = 0
    step = -1
    t = 0

    def finish(r: _Req) -> None:
        nonlocal done
        r.live = False
        reqs.pop(r.uid, None)
        resident.pop(r.uid, None)
        done += 1
        if on_request_done is not None:
            on_request_done()

    def execute() -> None:
        nonlocal corrupted_any
        s, work, zero = pending.popleft()
        for k in zero:
            mem[k] = {"kv": (Writer.ZERO, -1, s), "conv": (Writer.ZERO, -1, s), "ssm": (Writer.ZERO, -1, s)}
        outputs = []
        for r, att, gdn in work:
            if r.live and not r.corrupted:
                found = set()
                for (k, part), want in r.expect.items():
                    got = mem.get(k, {}).get(part)
                    if got != want:
                        cls = _classify(got, part, r.landed, aborted)
                        found.add(cls.value if cls else "other")
                if found:
                    r.corrupted = True
                    corrupted_any += 1
                    for name in found:
                        causes[name] = causes.get(name, 0) + 1
            # GDN state is rewritten in full by every step, live or stale.
            v = (Writer.STEP, r.uid, s)
            mem[gdn] = {"kv": v, "conv": v, "ssm": v}  # the whole page
            if r.live:
                r.landed.update(("conv", "ssm"))
                r.expect[(gdn, "conv")] = v
                r.expect[(gdn, "ssm")] = v
                outputs.append(r)
        sched.step_completed(s)
        for r in outputs:
            r.executed += 1
            if r.executed >= r.decode_steps:
                sched.request_finished(str(r.uid))
                finish(r)

    while done < requests:
        t += 1
        if t > 200 * requests + 1000:
            raise RuntimeError(f"race simulation made no progress after {t} iterations")
        # RDMA lands outside the device stream, whenever its latency is up.
        still = []
        for x in inflight:
            if x.land_at > t:
                still.append(x)
                continue
            for c in x.comps:
                keys = x.req.att if c is KV else [x.req.gdn]
                part = "kv" if c is KV else ("conv" if c is CONV else "ssm")
                for i, k in enumerate(keys):
                    v = (Writer.TRANSFER, x.req.uid, (part, i))
                    if part == "kv":
                        mem[k] = {"kv": v, "conv": v, "ssm": v}  # the whole page
                    else:
                        page = mem.setdefault(k, {})
                        page[part] = v
                        page["kv"] = v  # read as attention, the page's bytes changed
            if sched.transfer_landed(x.tid) is TransferOutcome.ACCEPTED:
                x.req.landed.update("kv" if c is KV else ("conv" if c is CONV else "ssm") for c in x.comps)
        inflight = still
        # The device finishes the oldest step once the scheduler is depth ahead.
        while len(pending) > async_depth:
            execute()
        # Aborts hit importing requests (a client gives up, a peer times out).
        if scen.abort_rate:
            for r in list(reqs.values()):
                if r.uid not in resident and rng.random() < scen.abort_rate / 4:
                    sched.abort(str(r.uid))
                    aborted.add(r.uid)
                    n_aborted += 1
                    finish(r)
        # Admit arrivals while the pool has room (decode pools run full).
        new_zero: list[int] = []
        while arrived < requests and len(reqs) < 24:
            n_att = rng.randint(1, 3)
            if sched.free_count() < n_att + 1:
                break
            uid = arrived
            arrived += 1
            att, gdn = admit(sched, str(uid), n_att)
            r = _Req(uid=uid, att=att, gdn=gdn, decode_steps=rng.randint(2, 6))
            r.expect.update(transfer_expect(att, gdn, uid))
            r.to_post = {frozenset((c,)) for c in ALL} if scen.split_components else {ALL}
            reqs[uid] = r
            if scen.zeroing:
                new_zero.extend(att)
        # Schedule the next step: ready requests join; new attention pages are zeroed.
        step += 1
        joined = [
            r for r in reqs.values() if r.uid not in resident and sched.is_ready(str(r.uid))
        ]
        ticket = sched.step_scheduled(
            step, joined=[str(r.uid) for r in joined], zeroing=[(ATT, b) for b in new_zero]
        )
        skip = {sched.table.key(g, b) for g, b in ticket.skip_zeroing}
        zero = [k for k in (sched.table.key(ATT, b) for b in new_zero) if k not in skip]
        for r in joined:
            resident[r.uid] = r
        pending.append((step, [(r, r.att, r.gdn) for r in resident.values()], zero))
        # The connector starts loads when the step launches (outside the stream).
        for r in list(reqs.values()):
            if sched.phase(str(r.uid)) is not RequestPhase.IMPORTING:
                continue
            for comps in list(r.to_post):
                tid = sched.post_import(str(r.uid), components=comps)
                if not isinstance(tid, NotYet):
                    r.to_post.discard(comps)
                    latency = rng.randint(1, async_depth + 2)
                    if scen.split_components:
                        latency += rng.randint(0, 6)  # separate transfers, separate sizes and queues
                    if scen.abort_rate and rng.random() < 0.3:
                        latency += rng.randint(2, 8)  # slow transfers are the ones aborted
                    inflight.append(_Xfer(req=r, tid=tid, comps=comps, land_at=t + latency))
    # Drain so the scheduler's books can be checked too.
    while pending:
        execute()
    for x in inflight:
        sched.transfer_landed(x.tid)
    for rid in sched.request_ids():
        sched.abort(rid)
    sched.audit()
    if sched.free_count() != blocks:
        raise RuntimeError(f"{blocks - sched.free_count()} blocks leaked in the {race.value} scenario")
    return RaceResult(
        race=race,
        requests=requests,
        corrupted=causes.get(race.value, 0),
        corrupted_any=corrupted_any,
        aborted=n_aborted,
        steps=step + 1,
        causes=dict(sorted(causes.items())),
    )

