"""An oracle for one :class:`~hybridkv.fencing.scheduler.TransferScheduler`, rule by rule.

The two-sided machine (``test_fencing_machine.py``) checks content: a request that computes on
bytes it did not expect. That catches a broken rule only when the early-freed block happens to be
handed out again, written, and read within one example. Here each call the scheduler answers is
checked against what the rules of docs/design.md say it must answer, from bookkeeping of this
module's own (never the scheduler's records):

* every block handed out (``allocate``) is settled (no scheduled step that may touch it is
  pending), has no transfer reading or writing it, and no live holder (rules 2, 5, 6, 7);
* ``share`` (rule 7) adds a holder to another request's blocks, and is refused exactly when an import
  writes one of them; an import into a block another request holds is refused;
* ``post_export`` says yes exactly when every block of the request is settled and the read fits
  the lease (rules 1, 6); ``post_import`` exactly when no pending step touches the target blocks,
  no transfer reads them and the read fits the lease (rules 3, 6);
* a zeroing of a block an import wrote, or writes, is skipped, and only those (rule 3);
* a request is ready exactly when every expected component landed (rule 4);
* ``poll`` expires exactly the leases whose deadline passed, ``heartbeat`` renews exactly the
  live ones, a transfer reports ``LATE`` exactly when it landed past its lease (rule 6);
* at the end, with everything finished, every block is back in the pool (nothing leaks).

Operations are plain tuples, so a scenario is a list hypothesis can generate, shrink and replay as
an ``@example``; :data:`GRAB` hands out every free block at once, which makes an early free visible
inside the example that caused it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybridkv.fencing.fence import NEVER, FencePolicy, NotYet, NotYetReason, PoolLayout
from hybridkv.fencing.request_state import Component, ComponentKind, TransferOutcome
from hybridkv.fencing.scheduler import TransferScheduler

ATT, GDN = 0, 1
KV = Component(group=ATT, kind=ComponentKind.KV)
CONV = Component(group=GDN, kind=ComponentKind.CONV)
SSM = Component(group=GDN, kind=ComponentKind.SSM)
COMPONENTS = (KV, CONV, SSM)
BLOCKS = 6  # one pool shared by both groups (vLLM's hybrid allocator): small, so blocks are reused
LEASE_S = 4.0

# Operation names (the first item of each tuple).
NEW = "new"  # (NEW, n, remote): a request of n attention blocks and one GDN block; remote: it imports
STEP = "step"  # (STEP, mask): schedule a step; ready requests selected by mask join the running batch
COMPLETE = "complete"  # (COMPLETE,): the device finishes the oldest pending step
FINISH = "finish"  # (FINISH, i, export): request i leaves the batch, freed or held for export
FREE = "free"  # (FREE, i): request i gives back its last attention block (sliding-window clipping)
ABORT = "abort"  # (ABORT, i)
IMPORT = "import"  # (IMPORT, i, mask, lease_s, expected_s): post an import of the masked components
EXPORT = "export"  # (EXPORT, i, expected_s): post an outbound read of request i
LAND = "land"  # (LAND, i, ok): transfer i in flight ends, landed or failed
RENEW = "renew"  # (RENEW, i): the producer renewed the lease behind request i's imports (now + LEASE_S)
HEARTBEAT = "heartbeat"  # (HEARTBEAT, i): the consumer of export i renews its lease
DONE = "done"  # (DONE, i): the consumer of export i is done with the blocks
TICK = "tick"  # (TICK, dt): time passes; poll() expires lapsed leases
WAIT = "wait"  # (WAIT, dt): time passes, nobody polls yet (a heartbeat may come first)
RECOMPUTE = "recompute"  # (RECOMPUTE, i): a failed (or given-up) import computes locally
GRAB = "grab"  # (GRAB,): hand every free block to a new request at once, then free it
SHARE = "share"  # (SHARE, i, j): request j holds request i's attention blocks too (rule 7: a cached prefix)


class Violation(AssertionError):
    """The scheduler answered what a fencing rule forbids."""


@dataclass
class _Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)
class _Req:
    rid: str
    att: list[int]
    gdn: int
    expect: frozenset
    phase: str  # local, importing, failed, ready, exporting
    resident: bool = False
    last: int = NEVER  # the last step scheduled while it was resident (its residency's fence)
    arrived: set = field(default_factory=set)
    abandoned: bool = False

    @property
    def blocks(self) -> list[int]:
        return [*self.att, self.gdn]


@dataclass(eq=False)
class _Xfer:
    tid: int
    rid: str
    inbound: bool
    blocks: list[int]
    comps: frozenset
    deadline: float | None
    orphaned: bool = False


class Oracle:
    """Drives a real TransferScheduler and checks each of its answers against the rules."""

    def __init__(self, policy: FencePolicy = FencePolicy.FENCED) -> None:
        self.clock = _Clock()
        self.s = TransferScheduler(PoolLayout.shared(num_blocks=BLOCKS, num_groups=2), policy=policy,
                                   lease_s=LEASE_S, clock=self.clock)
        self.fence = [NEVER] * BLOCKS  # last scheduled step that may touch the block
        # The same without the live holders' residency (zeroing, and holders that let go): with a request's own
        # residency, what rules 1 and 3 ask of its blocks (rule 7: they apply per holder).
        self.frozen = [NEVER] * BLOCKS
        self.readers = [0] * BLOCKS
        self.writers = [0] * BLOCKS
        self.holder: dict[int, list[str]] = {}  # rule 7: every live holder, the first first
        self.imported: set[int] = set()  # written by an import since allocated: never zero them
        self.zero_next: list[int] = []  # new attention blocks, zeroed by the next step
        self.scheduled = NEVER
        self.watermark = NEVER
        self.pending: deque[int] = deque()
        self.reqs: dict[str, _Req] = {}
        self.xfers: dict[int, _Xfer] = {}
        self.leases: dict[str, float] = {}  # granted, not yet polled away
        self.n = 0

    # ------------------------------------------------------------------ helpers
    def _pick(self, i: int, cond) -> _Req | None:
        cand = [r for _, r in sorted(self.reqs.items()) if cond(r)]
        return cand[i % len(cand)] if cand else None

    def _settled(self, b: int) -> bool:
        return self.fence[b] <= self.watermark

    def _settled_for(self, r: _Req, b: int) -> bool:
        return max(self.frozen[b], r.last) <= self.watermark

    def _fresh(self, blocks, who: str) -> None:
        for b in blocks:
            why = ("a step that may touch it is pending" if not self._settled(b) else
                   "a transfer reads it" if self.readers[b] else "a transfer writes it" if self.writers[b] else
                   f"request {self.holder[b][0]} holds it" if b in self.holder else None)
            if why:
                raise Violation(f"block {b} handed to {who} while {why} (fence {self.fence[b]}, "
                                f"watermark {self.watermark})")

    def _release(self, r: _Req) -> None:
        """The scheduler forgot request ``r``: its blocks go back once the rules allow."""
        del self.reqs[r.rid]
        self.leases.pop(r.rid, None)
        gone = [b for b in r.blocks if self._let_go(b, r)]
        self.imported.difference_update(gone)
        self.zero_next = [b for b in self.zero_next if b not in gone]
        for x in self.xfers.values():
            if x.rid == r.rid:
                x.orphaned = True

    def _let_go(self, b: int, r: _Req) -> bool:
        """``r`` releases its hold on block ``b`` (its residency freezes into the block's fence); True if that
        was the last hold (rule 7)."""
        self.frozen[b] = max(self.frozen[b], r.last)
        hs = self.holder.get(b, [])
        if r.rid in hs:
            hs.remove(r.rid)
        if hs:
            return False
        self.holder.pop(b, None)
        return True

    def _allocate(self, rid: str, n: int) -> tuple[list[int], int] | None:
        s = self.s
        att = s.allocate(rid, ATT, n)
        gdn = att if isinstance(att, NotYet) else s.allocate(rid, GDN, 1)
        if isinstance(gdn, NotYet):
            s.abort(rid)  # all or none
            return None
        att, gdn = list(att), gdn[0]
        self._fresh([*att, gdn], rid)
        return att, gdn

    # --------------------------------------------------------------- operations
    def apply(self, op: tuple) -> None:
        getattr(self, "_op_" + op[0])(*op[1:])
        self.s.audit()
        # What GRAB would hand out next: a block back in the free list too early is caught at once.
        self._fresh([b for b in range(BLOCKS) if self.s.pool.is_free(b)], "the free list")

    def run(self, ops) -> None:
        for op in ops:
            self.apply(op)
        self.finish_all()

    def _op_new(self, n: int, remote: bool) -> None:
        self.n += 1
        rid = f"r{self.n}"
        self.s.add_request(rid, expect=COMPONENTS if remote else ())
        got = self._allocate(rid, n)
        if got is None:
            return
        att, gdn = got
        r = _Req(rid=rid, att=att, gdn=gdn, expect=frozenset(COMPONENTS if remote else ()),
                 phase="importing" if remote else "local")
        self.reqs[rid] = r
        for b in r.blocks:
            self.holder[b] = [rid]
        self.zero_next += att  # hybrid models zero new attention blocks (vLLM #35219)

    def _op_step(self, mask: int) -> None:
        s = self.s
        ready = [r for _, r in sorted(self.reqs.items()) if not r.resident and r.phase in ("local", "ready")]
        joined = [r for j, r in enumerate(ready) if mask >> j & 1]
        step = self.scheduled + 1
        zero = list(self.zero_next)
        ticket = s.step_scheduled(step, joined=[r.rid for r in joined], zeroing=[(ATT, b) for b in zero])
        skipped = sorted(b for _, b in ticket.skip_zeroing)
        must_skip = sorted(b for b in zero if b in self.imported or self.writers[b])
        if skipped != must_skip:
            raise Violation(f"step {step} skips zeroing {skipped}; rule 3 says exactly {must_skip} "
                            "(blocks an import wrote or writes)")
        self.zero_next = []
        self.scheduled = step
        self.pending.append(step)
        for b in zero:
            if b not in must_skip:
                self.fence[b] = self.frozen[b] = step
        for r in joined:
            r.resident = True
        for r in self.reqs.values():
            if r.resident:
                r.last = step
                for b in r.blocks:
                    self.fence[b] = step

    def _op_complete(self) -> None:
        if self.pending:
            step = self.pending.popleft()
            self.s.step_completed(step)
            self.watermark = step

    def _op_finish(self, i: int, export: bool) -> None:
        r = self._pick(i, lambda r: r.phase in ("local", "ready"))
        if r is None:
            return
        grant = self.s.request_finished(r.rid, export=export)
        r.resident = False
        if export:
            r.phase = "exporting"
            deadline = self.clock.now + LEASE_S
            if grant is None or grant.deadline != deadline:
                raise Violation(f"export of {r.rid} granted {grant}; expected a lease until {deadline}")
            self.leases[r.rid] = deadline
        else:
            self._release(r)

    def _op_free(self, i: int) -> None:
        r = self._pick(i, lambda r: len(r.att) > 1 and r.phase != "exporting")
        if r is None:
            return
        b = r.att.pop()
        self.s.free_blocks(r.rid, ATT, [b])
        if self._let_go(b, r):
            self.imported.discard(b)
            self.zero_next = [k for k in self.zero_next if k != b]

    def _op_abort(self, i: int) -> None:
        r = self._pick(i, lambda r: True)
        if r is None:
            return
        self.s.abort(r.rid)
        r.resident = False
        if r.phase == "exporting" and r.rid in self.leases:
            r.abandoned = True  # a pulling consumer may still read: kept until the lease lapses
        else:
            self._release(r)

    def _op_import(self, i: int, mask: int, lease_s: float | None, expected_s: float) -> None:
        r = self._pick(i, lambda r: r.phase in ("importing", "failed"))
        if r is None:
            return
        flying = {c for x in self.xfers.values() if x.rid == r.rid and not x.orphaned for c in x.comps}
        comps = frozenset(c for j, c in enumerate(COMPONENTS) if mask >> j & 1) - flying - r.arrived
        if not comps:
            return
        deadline = None if lease_s is None else self.clock.now + lease_s
        blocks = (r.att if KV in comps else []) + ([r.gdn] if comps - {KV} else [])
        if any(len(self.holder[b]) > 1 for b in blocks):
            try:  # rule 7: an import never writes a block another request holds
                self.s.post_import(r.rid, components=comps, lease_deadline=deadline, expected_s=expected_s)
            except ValueError:
                return
            raise Violation(f"import into {r.rid} blocks {blocks} posted although another request holds some "
                            "(rule 7)")
        got = self.s.post_import(r.rid, components=comps, lease_deadline=deadline, expected_s=expected_s)
        if deadline is not None and self.clock.now + expected_s > deadline:
            want = NotYetReason.LEASE_TOO_SHORT
        elif any(not self._settled_for(r, b) for b in blocks):
            want = NotYetReason.PENDING_STEP
        elif any(self.readers[b] for b in blocks):
            want = NotYetReason.TRANSFER_IN_FLIGHT
        else:
            want = None
        if want is None and isinstance(got, NotYet):
            raise Violation(f"import into {r.rid} refused ({got.reason.name}) with every rule met")
        if want is not None and not isinstance(got, NotYet):
            raise Violation(f"import into {r.rid} blocks {blocks} posted although {want.value} (rules 3, 6)")
        if want is not None:
            return
        self.xfers[got] = _Xfer(tid=got, rid=r.rid, inbound=True, blocks=blocks, comps=comps, deadline=deadline)
        for b in blocks:
            self.writers[b] += 1
        self.imported.update(blocks)
        r.phase = "importing"

    def _op_export(self, i: int, expected_s: float) -> None:
        r = self._pick(i, lambda r: r.phase == "exporting")
        if r is None:
            return
        got = self.s.post_export(r.rid, expected_s=expected_s)
        deadline = self.leases.get(r.rid)
        if any(not self._settled_for(r, b) for b in r.blocks):
            want = NotYetReason.PENDING_STEP
        elif deadline is None or self.clock.now + expected_s > deadline:
            want = NotYetReason.LEASE_TOO_SHORT
        else:
            want = None
        if want is None and isinstance(got, NotYet):
            raise Violation(f"export of {r.rid} refused ({got.reason.name}) with every rule met")
        if want is not None and not isinstance(got, NotYet):
            raise Violation(f"export of {r.rid} blocks {r.blocks} posted although {want.value} (rules 1, 6)")
        if want is not None:
            return
        self.xfers[got] = _Xfer(tid=got, rid=r.rid, inbound=False, blocks=r.blocks, comps=frozenset(),
                                deadline=deadline)
        for b in r.blocks:
            self.readers[b] += 1

    def _op_land(self, i: int, ok: bool) -> None:
        if not self.xfers:
            return
        x = self.xfers.pop(sorted(self.xfers)[i % len(self.xfers)])
        out = self.s.transfer_landed(x.tid) if ok else self.s.transfer_failed(x.tid)
        for b in x.blocks:
            (self.writers if x.inbound else self.readers)[b] -= 1
        r = None if x.orphaned else self.reqs.get(x.rid)
        if r is None:
            want = TransferOutcome.DISCARDED
        elif not x.inbound:
            want = TransferOutcome.ACCEPTED
        elif ok and x.deadline is not None and self.clock.now > x.deadline:
            want = TransferOutcome.LATE
        else:
            want = TransferOutcome.ACCEPTED
        if out is not want:
            raise Violation(f"transfer {x.tid} of {x.rid} ({'in' if x.inbound else 'out'}bound, "
                            f"{'landed' if ok else 'failed'}, deadline {x.deadline}, now {self.clock.now}) "
                            f"answered {out.name}; expected {want.name}")
        if r is None or not x.inbound:
            return
        if want is TransferOutcome.ACCEPTED and ok:
            r.arrived |= x.comps
            if r.phase == "importing" and r.arrived >= r.expect:  # a failed import stays failed
                r.phase = "ready"
        else:
            r.phase = "failed"
        ready = self.s.is_ready(r.rid)
        if ready != (r.phase == "ready"):
            raise Violation(f"{r.rid} ready={ready} with {len(r.arrived)} of {len(r.expect)} components "
                            "landed (rule 4: ready exactly when all arrived)")

    def _op_renew(self, i: int) -> None:
        r = self._pick(i, lambda r: any(x.rid == r.rid and x.inbound for x in self.xfers.values()))
        if r is None:
            return
        deadline = self.clock.now + LEASE_S
        self.s.lease_renewed(r.rid, deadline)
        for x in self.xfers.values():
            if x.rid == r.rid and x.inbound and not x.orphaned and x.deadline is not None:
                x.deadline = max(x.deadline, deadline)

    def _op_heartbeat(self, i: int) -> None:
        r = self._pick(i, lambda r: r.phase == "exporting")
        if r is None:
            return
        got = self.s.heartbeat(r.rid)
        d = self.leases.get(r.rid)
        live = d is not None and not r.abandoned and self.clock.now <= d
        if live:
            self.leases[r.rid] = self.clock.now + LEASE_S
        if (got is not None) != live or (got is not None and got.deadline != self.leases[r.rid]):
            raise Violation(f"heartbeat of {r.rid} (lease until {d}, now {self.clock.now}, abandoned "
                            f"{r.abandoned}) answered {got}; rule 6 renews exactly the live, unabandoned leases")

    def _op_done(self, i: int) -> None:
        r = self._pick(i, lambda r: r.phase == "exporting")
        if r is not None:
            self.s.export_done(r.rid)
            self._release(r)

    def _op_tick(self, dt: float) -> None:
        self.clock.now += dt
        lapsed = sorted(self.s.poll())
        want = sorted(rid for rid, d in self.leases.items() if d < self.clock.now)
        if lapsed != want:
            raise Violation(f"poll at {self.clock.now} expired {lapsed}; leases {self.leases} say {want}")
        for rid in lapsed:
            self.leases.pop(rid)
            r = self.reqs.get(rid)
            if r is not None and r.phase == "exporting":
                self._release(r)

    def _op_wait(self, dt: float) -> None:
        self.clock.now += dt

    def _op_recompute(self, i: int) -> None:
        # Failed, or importing with nothing in flight (given up before a post, e.g. a lapsed lease); one with an
        # import still writing its blocks may not give up (the write would land in blocks it computes on).
        r = self._pick(i, lambda r: r.phase in ("failed", "importing"))
        if r is None:
            return
        writing = any(x.rid == r.rid and not x.orphaned and x.inbound for x in self.xfers.values())
        if writing and self.s.policy is FencePolicy.FENCED:
            try:
                self.s.recompute(r.rid)
            except ValueError:
                return
            raise Violation(f"{r.rid} gave up its import (recompute) while an inbound write into its blocks runs")
        self.s.recompute(r.rid)
        r.phase = "local"

    def _op_share(self, i: int, j: int) -> None:
        r = self._pick(i, lambda r: True)
        t = self._pick(j, lambda t: t is not r and t.phase in ("local", "ready"))
        if r is None or t is None:
            return
        blocks = [b for b in r.att if b not in t.blocks]
        if not blocks:
            return
        written = [b for b in blocks if self.writers[b]]
        try:
            self.s.share(t.rid, ATT, blocks)
        except ValueError:
            if written or self.s.policy is not FencePolicy.FENCED:
                return
            raise
        if written and self.s.policy is FencePolicy.FENCED:
            raise Violation(f"{t.rid} took a hold on blocks {written} an import is writing (rule 7: the importer's "
                            "abort and this hold's release would free them under the write)")
        t.att += blocks
        for b in blocks:
            self.holder[b].append(t.rid)

    def _op_grab(self) -> None:
        n = self.s.free_count()
        if not n:
            return
        self.n += 1
        rid = f"g{self.n}"
        self.s.add_request(rid)
        got = self.s.allocate(rid, ATT, n)
        if isinstance(got, NotYet):
            raise Violation(f"{n} blocks free but allocating them answered {got}")
        self._fresh(got, rid)
        self.s.request_finished(rid)  # never scheduled: the blocks keep the fences they had

    # --------------------------------------------------------------------- end
    def finish_all(self) -> None:
        """End everything by the protocol; then every block must be back in the pool."""
        for tid in sorted(self.xfers):
            self._op_land(0, True)
        for r in list(self.reqs.values()):
            self._op_abort(sorted(self.reqs).index(r.rid))
            self.s.audit()
        self._op_tick(2 * LEASE_S)
        while self.pending:
            self._op_complete()
        self._op_step(0)
        self._op_complete()
        self.s.audit()
        if self.s.free_count() != BLOCKS:
            raise Violation(f"{BLOCKS - self.s.free_count()} of {BLOCKS} blocks never came back to the pool")
