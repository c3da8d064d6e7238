"""Stateful race tests: a producer and a consumer under asynchronous scheduling.

hypothesis drives both engines through the real TransferScheduler: steps
scheduled up to ``depth`` ahead of each device, GDN state rewritten by every
step, attention blocks appended and zeroed on allocation, transfers of the
KV / conv / SSM components posted separately and landing, failing, landing
late or twice at any moment, aborts on both sides, lease heartbeats and
expiry. Memory is the shadow model of ``shadow.py``; the checks are on
content. With ``--fence-policy none`` this must fail.

The quarantine paths are actions of their own, each with its invariant:

* **quarantine**: the owner of a transfer in flight goes (the decode aborts, the producer's lease lapses);
  the blocks it reads or writes stay out of the pool until it is terminal and settled (``idle_free_lists``:
  no free block is touched by a pending step, a transfer in flight, or a writer that may still write);
* **stall**: a transfer stops progressing (it lands only when named), so the rest of the example runs around it;
* **unpark**: a prefix hit takes back a quarantined producer block; its old read's end must not free it;
* **incarnations**: a request id the decode dropped is admitted again; every landing, write or word of the
  dead incarnation is ``DISCARDED`` or ignored, and ``arrived()`` is exactly what the live one received
  (``books``);
* **give-up**: ``recompute`` is refused exactly while an inbound write of the request runs; after it the
  request computes its prompt locally;
* **pushed imports** (``push.py``): remote writers through the real ``ImportLedger``, which write, drain,
  fail (and may still write), meet the drain deadline, and speak late under a dead generation.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hybridkv.fencing.fence import FencePolicy, NotYet
from hybridkv.fencing.request_state import RequestPhase, TransferOutcome
from tests.property import counter
from tests.property.push import PushSide
from tests.property.shadow import (
    ATT,
    KV,
    BLOCKS,
    COMPONENTS,
    GARBAGE,
    GDN,
    PART,
    LEASE_S,
    Clock,
    Req,
    Violation,
    Worker,
    Xfer,
)

CI = bool(os.environ.get("CI"))


class FencingMachine(RuleBasedStateMachine):
    policy = FencePolicy.FENCED

    def __init__(self) -> None:
        super().__init__()
        counter.add(1)
        self.clock = Clock()
        self.P = Worker("P", self.policy, self.clock)
        self.D = Worker("D", self.policy, self.clock)
        self.depth = 1
        self.uid = 0
        self.final: dict[str, dict] = {}  # uid -> producer's final cells (what D must receive)
        self.xfers: list[Xfer] = []
        self.computed: dict[str, Req] = {}  # producer requests that computed their prompt KV
        # Block key -> the request whose prompt KV it caches. Allocating the block to another
        # request evicts that entry (as vLLM drops a block's hash when it hands the block out
        # again), even while a step of the new owner that rewrites it is still in flight.
        self.cached_by: dict[int, str] = {}
        self.inc: dict[str, int] = {}  # decode side: request id -> its latest incarnation
        self.push_mode = 0  # 0: every import pulled; 1: every import pushed; 2: by request number
        self.writers = 1
        self.push = PushSide(self)

    @initialize(depth=st.integers(min_value=1, max_value=3), push=st.integers(min_value=0, max_value=2),
                writers=st.integers(min_value=1, max_value=2), n=st.integers(min_value=0, max_value=2),
                size=st.integers(min_value=0, max_value=3))
    def set_depth(self, depth: int, push: int = 0, writers: int = 1, n: int = 0, size: int = 0) -> None:
        """``depth`` steps in flight per device; imports pulled (push 0), pushed by ``writers`` writers (1),
        or either by request number (2); and ``n`` prompts prefilled and admitted by the decode side, their
        imports posted, so that the quarantine, incarnation and give-up actions have transfers to act on from
        the first step."""
        self.depth = depth
        self.push_mode = push
        self.writers = writers
        if not n:
            return
        self.p_schedule(n, size)
        while self.P.pending:
            self.p_execute()
        self.d_schedule(0)

    # ------------------------------------------------------------ producer
    @rule(arrivals=st.integers(min_value=0, max_value=2), size=st.integers(min_value=0, max_value=3))
    def p_schedule(self, arrivals: int, size: int) -> None:
        """One producer scheduler iteration: admit arrivals, schedule a step. When
        ``depth`` steps are already in flight the engine first waits for the oldest."""
        if len(self.P.pending) > self.depth:
            self.p_execute()
        for _ in range(arrivals):
            self._p_new(n=1 + size % 2, chunks=1 + size // 2)
        self.P.schedule()

    def _p_new(self, *, n: int, chunks: int) -> None:
        s = self.P.sched
        if s.free_count() < n + 1:
            return
        self.uid += 1
        uid = f"r{self.uid}"
        s.add_request(uid)
        att = s.allocate(uid, ATT, n)
        gdn = s.allocate(uid, GDN, 1)
        self._evict(att, gdn)
        w = self.P
        w.reqs[uid] = Req(uid=uid, att=[w.key(ATT, b) for b in att], gdn=w.key(GDN, gdn[0]), chunks=chunks)

    def _evict(self, att: list[int], gdn: list[int]) -> None:
        for k in [*(self.P.key(ATT, b) for b in att), *(self.P.key(GDN, b) for b in gdn)]:
            self.cached_by.pop(k, None)

    def _cached(self, quarantined: bool = False) -> list[Req]:
        """Producer requests (live, or finished with their blocks not yet reusable) whose
        computed attention blocks a new request may hit as a cached prefix; with ``quarantined``,
        only those whose first block is parked in quarantine (a read of it still in flight)."""
        P = self.P
        s = P.sched
        pool, t = s.pool, s.table
        out = []
        for uid, r in sorted(self.computed.items()):
            k = r.att[0]
            if self.cached_by.get(k) != uid or P.mem.get((k, "kv")) != (uid, "kv", 0):
                continue
            parked = pool.is_parked(k) and not s.holders(ATT, t.block_of(k))
            if quarantined and not (parked and t.readers[k]):
                continue
            if parked or uid in s.holders(ATT, t.block_of(k)):
                out.append(r)
        return out

    def _quarantined_p(self) -> bool:
        t, pool = self.P.sched.table, self.P.sched.pool
        return any(t.readers[k] and pool.is_parked(k) for k in range(BLOCKS))

    @precondition(lambda self: self._cached())
    @rule(i=st.integers(min_value=0, max_value=7), m=st.integers(min_value=1, max_value=2),
          n=st.integers(min_value=1, max_value=2), chunks=st.integers(min_value=1, max_value=2))
    def p_prefix_hit(self, i: int, m: int, n: int, chunks: int, quarantined: bool = False) -> None:
        """Rule 7: a new request shares the cached prefix of a live one (prefix caching) and
        computes only its own suffix; the prefix blocks now have two holders."""
        cand = self._cached(quarantined)
        if not cand:
            return
        # Half the time prefer a prompt the decode side already received: a local hit there.
        on_d = [r for r in cand if r.uid in self.D.reqs and KV in self.D.sched.arrived(r.uid)]
        if on_d and i % 2 == 0:
            cand = on_d
        o = cand[i % len(cand)]
        s, w = self.P.sched, self.P
        if s.free_count() < n + 1:
            return
        pre = o.att[:1] if m == 1 or len(o.att) == 1 else o.att[:2]
        if len(pre) == 2 and not (
            self.cached_by.get(pre[1]) == o.uid
            and w.mem.get((pre[1], "kv")) == (o.uid, "kv", 1)
            and (o.uid in s.holders(ATT, s.table.block_of(pre[1]))
                 or s.pool.is_parked(pre[1]) and not s.holders(ATT, s.table.block_of(pre[1])))
        ):
            pre = pre[:1]
        self.uid += 1
        uid = f"r{self.uid}"
        s.add_request(uid)
        s.share(uid, ATT, [s.table.block_of(k) for k in pre])
        for k in pre:  # taken back out of the pool (unparked, quarantined or not): held, never free
            if s.pool.is_parked(k) or s.pool.is_free(k):
                raise Violation(f"P: block {k} shared by {uid} is still in the pool (parked or free)")
        att = s.allocate(uid, ATT, n)
        gdn = s.allocate(uid, GDN, 1)
        self._evict(att, gdn)
        r = Req(uid=uid, att=[w.key(ATT, b) for b in att], gdn=w.key(GDN, gdn[0]), chunks=chunks,
                pre=list(pre), pre_from=o.uid)
        for j, k in enumerate(pre):
            r.expect[(k, "kv")] = (o.uid, "kv", j)  # computed by o: read, never rewritten
        w.reqs[uid] = r

    @precondition(lambda self: self._quarantined_p())
    @rule(i=st.integers(min_value=0, max_value=7), n=st.integers(min_value=1, max_value=2))
    def p_unpark(self, i: int, n: int) -> None:
        """Rule 7 on a quarantined block: a prefix hit takes back a block whose request is gone while a read
        of it is in flight. Its old read's end must leave it with its new holder."""
        self.p_prefix_hit(i, 1, n, 1, quarantined=True)

    @precondition(lambda self: self.P.pending)
    @rule()
    def p_execute(self) -> None:
        # Processing the step's output is when the engine learns a prefill is done;
        # by then later steps that still include the request may be scheduled.
        for r in self.P.execute():
            if not r.pre and r.uid not in self.computed:
                self.computed[r.uid] = r
                self.cached_by.update((k, r.uid) for k in r.att)
            if r.v >= r.chunks and r.uid not in self.final:
                self._finish(r)

    def _finish(self, r: Req) -> None:
        self.P.sched.request_finished(r.uid, export=True)
        self.P.resident.pop(r.uid, None)
        r.live = False
        cells = {(k, "kv"): r.expect[(k, "kv")] for k in r.pre}
        cells.update({(k, "kv"): (r.uid, "kv", j) for j, k in enumerate(r.att)})
        cells[(r.gdn, "conv")] = (r.uid, "conv", r.steps_in)
        cells[(r.gdn, "ssm")] = (r.uid, "ssm", r.steps_in)
        self.final[r.uid] = cells
        self.d_new(r.uid)  # the decode side admits the request when its prefill is done

    @precondition(lambda self: self.P.reqs)
    @rule(i=st.integers(min_value=0, max_value=7))
    def p_abort(self, i: int) -> None:
        if not self.P.reqs:
            return
        uid = sorted(self.P.reqs)[i % len(self.P.reqs)]
        self.P.sched.abort(uid)
        if not self.P.sched.has_request(uid):
            self.P.drop(uid)
        else:
            self.P.resident.pop(uid, None)
            self.P.reqs[uid].live = False

    @rule()
    def heartbeat(self) -> None:
        for uid in self.final:
            lease = self.P.sched.heartbeat(uid) if uid in self.P.reqs else None
            if lease is not None and self.D.sched.has_request(uid):
                self.D.sched.lease_renewed(uid, lease.deadline)

    @rule(dt=st.sampled_from([0.25, 1.0, 3.0]))
    def advance_clock(self, dt: float) -> None:
        self.clock.now += dt
        for uid in self.P.sched.poll():
            if uid in self.P.reqs:
                self.P.drop(uid)
        self.push.expire()

    # ------------------------------------------------------------ consumer
    def d_new(self, uid: str) -> None:
        src = self.P.reqs[uid]
        s = self.D.sched
        w = self.D
        s.add_request(uid, expect=COMPONENTS)
        inc = self.inc[uid] = self.inc.get(uid, 0) + 1
        src_all = src.pre + src.att
        # Rule 7, decode side: a local prefix hit when the request the prompt shares its
        # prefix with already received it here; then only the missing suffix is loaded.
        hit: list[int] = []
        o = w.reqs.get(src.pre_from) if src.pre_from is not None else None
        if o is not None and not o.pre and len(o.att) >= len(src.pre) and KV in s.arrived(o.uid) \
                and s.phase(o.uid) in (RequestPhase.READY, RequestPhase.RUNNING):
            hit = o.att[: len(src.pre)]
            s.share(uid, ATT, [s.table.block_of(k) for k in hit])
        att = s.allocate(uid, ATT, len(src_all) - len(hit))
        gdn = att if isinstance(att, NotYet) else s.allocate(uid, GDN, 1)
        if isinstance(gdn, NotYet):  # att's NotYet, or gdn's own
            s.abort(uid)
            return
        r = Req(uid=uid, att=[w.key(ATT, b) for b in att], gdn=w.key(GDN, gdn[0]), chunks=1 + len(src_all),
                pre=hit, pre_from=None if not hit else src.pre_from, inc=inc,
                push=self.push_mode == 1 or self.push_mode == 2 and int(uid[1:]) % 2 == 0)
        r.v = self.final[uid][(src.gdn, "ssm")][2]
        final = self.final[uid]
        for sk, dk in zip(src_all, hit):
            r.expect[(dk, "kv")] = final[(sk, "kv")]
        for sk, dk in zip(src_all[len(hit):], r.att):  # the suffix, paired on the producer's tail
            r.expect[(dk, "kv")] = final[(sk, "kv")]
        r.expect[(r.gdn, "conv")] = final[(src.gdn, "conv")]
        r.expect[(r.gdn, "ssm")] = final[(src.gdn, "ssm")]
        w.reqs[uid] = r
        w.zero_next.extend(r.att)  # hybrid models zero newly allocated attention blocks

    def _d_end(self, uid: str, *, finished: bool = False) -> None:
        """The decode side lets go of the request (done, or aborted), and of its pushed import."""
        if finished:
            self.D.sched.request_finished(uid)
        else:
            self.D.sched.abort(uid)
        r = self.D.reqs[uid]
        self.D.drop(uid)
        if r.imp is not None and not r.imp.released:
            self.push.release(r.imp)

    def _importing(self) -> list[str]:
        D, P = self.D, self.P
        return [
            u for u in sorted(D.reqs)
            if u in P.reqs and D.sched.phase(u) in (RequestPhase.IMPORTING, RequestPhase.FAILED)
        ]

    @precondition(lambda self: self._importing())
    @rule(
        i=st.integers(min_value=0, max_value=7),
        mask=st.integers(min_value=1, max_value=7),
        aware=st.booleans(),
        expected_s=st.sampled_from([0.5, 2.0]),
    )
    def d_post(self, i: int, mask: int, aware: bool, expected_s: float) -> None:
        cand = self._importing()
        uid = cand[i % len(cand)]
        self._try_post(uid, frozenset(c for j, c in enumerate(COMPONENTS) if mask >> j & 1), aware, expected_s)

    def narrowed(self, dst: Req, comps) -> dict | None:
        """With a local prefix hit, the blocks the request holds alone (rule 7); else None (all of them)."""
        if not dst.pre:
            return None
        t = self.D.sched.table
        return {c.group: [t.block_of(k) for k in (dst.att if c.group == ATT else [dst.gdn])] for c in comps}

    def cells(self, uid: str, comps) -> list:
        """(source cell on P, destination cell on D) of every byte range the components carry."""
        src, dst = self.P.reqs[uid], self.D.reqs[uid]
        cells = []
        for c in comps:
            if c.group == ATT:
                src_all = src.pre + src.att
                cells += [((sk, "kv"), (dk, "kv")) for sk, dk in zip(src_all[len(src_all) - len(dst.att):], dst.att)]
            else:
                cells.append(((src.gdn, PART[c]), (dst.gdn, PART[c])))
        return cells

    def check_post(self, uid: str, dst_cells: list) -> None:
        dst_keys = {d[0] for d in dst_cells}
        if dst_keys & self.D.pending_keys():
            raise Violation(f"D: inbound write into blocks {sorted(dst_keys)} posted while a pending step touches them")

    def check_target(self, uid: str, inc: int, keys) -> None:
        """Bytes of incarnation ``inc`` of ``uid`` land in these decode blocks now: each must still be that
        incarnation's, or out of the pool's hands (parked), never free or another request's."""
        D = self.D
        s = D.sched
        r = D.reqs.get(uid)
        for k in keys:
            hs = s.holders(ATT, s.table.block_of(k))
            if s.pool.is_free(k) or hs and (list(hs) != [uid] or r is None or r.inc != inc):
                raise Violation(f"D: a write of {uid} (incarnation {inc}) lands in block {k}, which is "
                                f"{'free' if s.pool.is_free(k) else f'held by {list(hs)}'}")

    @staticmethod
    def names(comps) -> list[str]:
        return sorted(PART[c] for c in comps)

    def _try_post(self, uid: str, want: frozenset, aware: bool, expected_s: float) -> None:
        D, P = self.D, self.P
        dst = D.reqs[uid]
        if dst.push:
            self.push.post(uid)
            return
        flying = {c for x in self.xfers if not x.done and x.uid == uid and x.inc == dst.inc for c in x.comps}
        comps = want - flying - D.sched.arrived(uid)
        if not comps:
            return
        # The producer sends the block list only once its writes are settled (rule 1).
        if isinstance(P.sched.export_ready(uid), NotYet):
            return
        deadline = P.sched.leases.deadline(uid)
        ptid = None
        if aware:
            ptid = P.sched.post_export(uid, expected_s=expected_s)
            if isinstance(ptid, NotYet):
                return
        dtid = D.sched.post_import(uid, components=comps, blocks=self.narrowed(dst, comps), lease_deadline=deadline,
                                   expected_s=expected_s)
        if isinstance(dtid, NotYet):
            if ptid is not None:
                P.sched.transfer_failed(ptid)  # never started
            return
        cells = self.cells(uid, comps)
        self.check_post(uid, [d for _, d in cells])
        others = {d for x in self.xfers if not x.done for _, d in x.cells}
        if others & {d for _, d in cells}:
            raise Violation(f"D: two inbound transfers write the same cells of request {uid}")
        self.xfers.append(Xfer(uid=uid, comps=comps, cells=cells, dtid=dtid, ptid=ptid, inc=dst.inc))

    @staticmethod
    def _ref(table, key: int) -> tuple[int, int]:
        return ATT, table.block_of(key)  # one shared pool: any group names the page

    def overwritten(self, uid: str, cell: tuple[int, str]) -> bool:
        """Was the producer's source cell handed to a request that writes it (reused)?"""
        P = self.P
        key = cell[0]
        if P.sched.pool.is_free(key):
            return True
        owner = self.final[uid][cell][0]  # who wrote the bytes the consumer must get
        for h in P.sched.holders(*self._ref(P.sched.table, key)):
            r = P.reqs.get(h)
            if h not in (uid, owner) and r is not None and (key in r.att or key == r.gdn):
                return True
        return False

    def _flying(self) -> list[Xfer]:
        return [x for x in self.xfers if not x.done]

    def _land_some(self, land: int) -> None:
        if land:
            fl = [x for x in self.xfers if not x.done and not x.stuck]
            if fl:
                self._land(fl[(land - 1) % len(fl)], True)

    @precondition(lambda self: any(not x.done for x in self.xfers))
    @rule(i=st.integers(min_value=0, max_value=7), ok=st.booleans())
    def land(self, i: int, ok: bool) -> None:
        fl = self._flying()
        self._land(fl[i % len(fl)], ok)

    def _land(self, x: Xfer, ok: bool) -> None:
        x.done = True
        D, P = self.D, self.P
        r = D.reqs.get(x.uid)
        live = r is not None and r.inc == x.inc  # else its incarnation died: whatever lands is discarded
        self.check_target(x.uid, x.inc, {d[0] for _, d in (x.cells if ok else x.cells[:1])})
        if ok:
            dst_keys = {d[0] for _, d in x.cells}
            if dst_keys & D.pending_keys():
                raise Violation(f"D: transfer for {x.uid} lands into blocks a pending step writes")
            freed = any(self.overwritten(x.uid, s) for s, _ in x.cells)
            for s, d in x.cells:
                D.mem[d] = P.mem.get(s)
            out = D.sched.transfer_landed(x.dtid)
            if x.ptid is not None:
                P.sched.transfer_landed(x.ptid)
            if live and out is TransferOutcome.ACCEPTED:
                r.got |= x.comps
                if freed:
                    raise Violation(f"D: request {x.uid} accepted bytes read from freed producer blocks")
                if D.sched.is_ready(x.uid) and x.uid in P.reqs:
                    # The consumer has everything: it tells the producer to let go.
                    P.sched.export_done(x.uid)
                    P.drop(x.uid)
        else:
            for _, d in x.cells[:1]:
                D.mem[d] = GARBAGE  # a failed RDMA may have written part of its target
            out = D.sched.transfer_failed(x.dtid)
            if x.ptid is not None:
                P.sched.transfer_failed(x.ptid)
        if out is TransferOutcome.DUPLICATE or out is TransferOutcome.UNKNOWN:
            raise Violation(f"first completion of transfer {x.dtid} reported as {out}")
        if not live and out is not TransferOutcome.DISCARDED:
            raise Violation(f"a transfer of a dead incarnation of {x.uid} answered {out.name}; expected DISCARDED "
                            "(it must not count for the request now under that id)")

    @precondition(lambda self: any(x.done for x in self.xfers))
    @rule(i=st.integers(min_value=0, max_value=7), ok=st.booleans())
    def duplicate_completion(self, i: int, ok: bool) -> None:
        done = [x for x in self.xfers if x.done]
        x = done[i % len(done)]
        before = (self.D.sched.free_count(), self.D.sched.transfers_in_flight())
        out = self.D.sched.transfer_landed(x.dtid) if ok else self.D.sched.transfer_failed(x.dtid)
        if out is not TransferOutcome.DUPLICATE:
            raise Violation(f"duplicate completion of transfer {x.dtid} answered {out}")
        if before != (self.D.sched.free_count(), self.D.sched.transfers_in_flight()):
            raise Violation("a duplicate completion changed the scheduler's state")

    @rule(land=st.integers(min_value=0, max_value=3))
    def d_schedule(self, land: int) -> None:
        """One consumer scheduler iteration; ``land`` > 0 lets a transfer land first."""
        self._land_some(land)
        if len(self.D.pending) > self.depth:
            self.d_execute(0)
        # Like a connector polled once per step: retry every import still waiting.
        for uid in self._importing():
            self._try_post(uid, frozenset(COMPONENTS), aware=len(uid) % 2 == 0, expected_s=0.5)
        self.D.schedule()

    @precondition(lambda self: self.D.pending)
    @rule(land=st.integers(min_value=0, max_value=3))
    def d_execute(self, land: int) -> None:
        self._land_some(land)
        for r in self.D.execute():
            r.decoded += 1
            if r.decoded >= r.chunks:  # output processed: the request is done
                self._d_end(r.uid, finished=True)

    @precondition(lambda self: self.D.resident)
    @rule(i=st.integers(min_value=0, max_value=7))
    def d_append(self, i: int) -> None:
        res = sorted(self.D.resident)
        if not res:
            return
        uid = res[i % len(res)]
        got = self.D.sched.allocate(uid, ATT, 1)
        if not isinstance(got, NotYet):
            k = self.D.key(ATT, got[0])
            self.D.reqs[uid].app.append(k)
            self.D.zero_next.append(k)

    @precondition(lambda self: self.D.reqs)
    @rule(i=st.integers(min_value=0, max_value=7))
    def d_abort(self, i: int) -> None:
        if not self.D.reqs:
            return
        self._d_end(sorted(self.D.reqs)[i % len(self.D.reqs)])

    # ------------------------------------------------------------ quarantine, stalls, incarnations, give-up
    def _flights(self) -> list:
        """Transfers in flight: pulled (Xfer) and pushed imports a writer may still write (PushImport)."""
        return [*self._flying(), *self.push.writable()]

    @precondition(lambda self: self._flights())
    @rule(i=st.integers(min_value=0, max_value=7), producer=st.booleans())
    def quarantine(self, i: int, producer: bool) -> None:
        """The owner of a transfer in flight goes while it runs: the decode aborts the request, or the
        producer's lease lapses under a read. The blocks stay out of the pool (rule 5)."""
        fl = self._flights()
        x = fl[i % len(fl)]
        uid = x.uid
        pulled = isinstance(x, Xfer)
        if producer and x.ptid is not None:
            deadline = self.P.sched.leases.deadline(uid)
            if deadline is not None:
                self.advance_clock(deadline - self.clock.now + 0.25)
            w = self.P
            keys = {s[0] for s, _ in x.cells} if pulled else x.sources()
            if x.ptid is None:  # the read ended meanwhile (a pushed import's writers are past their deadline)
                keys = set()
        else:
            r = self.D.reqs.get(uid)
            if r is not None and r.inc == x.inc:
                self._d_end(uid)
            w = self.D
            keys = {d[0] for _, d in x.cells} if pulled else x.targets(self.clock.now)
        free = sorted(k for k in keys if w.sched.pool.is_free(k))
        if free:
            raise Violation(f"{w.name}: blocks {free} of a transfer in flight of {uid} are free once its request "
                            "is gone (rule 5: quarantined until it is terminal)")

    @precondition(lambda self: any(not x.done and not x.stuck for x in self.xfers))
    @rule(i=st.integers(min_value=0, max_value=7))
    def stall(self, i: int) -> None:
        """A transfer stops progressing: it lands only when named (``land``), never in passing."""
        fl = [x for x in self.xfers if not x.done and not x.stuck]
        fl[i % len(fl)].stuck = True

    def _readmittable(self) -> list[str]:
        P, D = self.P, self.D
        return [u for u in sorted(self.final) if u not in D.reqs and u in P.reqs and P.sched.has_request(u)
                and P.sched.phase(u) is RequestPhase.EXPORTING and not D.sched.has_request(u)]

    @precondition(lambda self: self._readmittable())
    @rule(i=st.integers(min_value=0, max_value=7))
    def d_readmit(self, i: int) -> None:
        """An incarnation: the decode admits again a request id whose previous incarnation died (a retry);
        the old one's transfers may still be in flight, its writers may still speak."""
        cand = self._readmittable()
        self.d_new(cand[i % len(cand)])

    def _give_up_candidates(self) -> list[str]:
        s = self.D.sched
        return [u for u in sorted(self.D.reqs) if s.phase(u) in (RequestPhase.FAILED, RequestPhase.IMPORTING)]

    @precondition(lambda self: self._give_up_candidates())
    @rule(i=st.integers(min_value=0, max_value=7))
    def give_up(self, i: int) -> None:
        """Give-up: an import failed (or never started) and the request recomputes its prompt here. Refused
        exactly while an inbound write of this incarnation runs (rule 5)."""
        cand = self._give_up_candidates()
        uid = cand[i % len(cand)]
        r = self.D.reqs[uid]
        writing = any(not x.done and x.uid == uid and x.inc == r.inc for x in self.xfers) \
            or self.push.writing(uid, r.inc)
        if writing:
            try:
                self.D.sched.recompute(uid)
            except ValueError:
                return
            raise Violation(f"D: {uid} gave its import up (recompute) while an inbound write into its blocks runs")
        self.D.sched.recompute(uid)
        r.local = True
        r.expect = {c: v for c, v in r.expect.items() if c[0] in r.pre}  # it reads its shared prefix only

    # ------------------------------------------------------------ pushed imports: the writers
    @precondition(lambda self: self.push.writable())
    @rule(i=st.integers(min_value=0, max_value=7), w=st.integers(min_value=0, max_value=1),
          mask=st.integers(min_value=1, max_value=7))
    def w_write(self, i: int, w: int, mask: int) -> None:
        """A writer's WRITE of some components lands, then its LANDED."""
        fl = self.push.writable()
        imp = fl[i % len(fl)]
        self.push.write(imp, w % imp.writers, mask)

    @precondition(lambda self: self.push.imports)
    @rule(i=st.integers(min_value=0, max_value=7), w=st.integers(min_value=0, max_value=1),
          how=st.integers(min_value=0, max_value=2))
    def w_word(self, i: int, w: int, how: int) -> None:
        """A writer says it drained (it writes nothing more), or failed (it may still write: not drained); or
        the import fails here (a lost node), which ends nothing either."""
        imp = self.push.imports[i % len(self.push.imports)]
        if how == 0:
            self.push.drained(imp, w % imp.writers)
        elif how == 1:
            self.push.writer_failed(imp, w % imp.writers)
        else:
            self.push.engine_fail(imp)

    @precondition(lambda self: self.push.dead)
    @rule(i=st.integers(min_value=0, max_value=7), w=st.integers(min_value=0, max_value=1),
          kind=st.integers(min_value=0, max_value=2))
    def late_word(self, i: int, w: int, kind: int) -> None:
        """A writer of a dead generation (its import ended and was released) speaks late."""
        imp = self.push.dead[i % len(self.push.dead)]
        self.push.late_word(imp, w % imp.writers, kind)

    # ------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        self.P.sched.audit()
        self.D.sched.audit()

    @invariant()
    def idle_free_lists(self) -> None:
        """Rules 2 and 5 on the model's own books: no free block may be touched by a pending step, a transfer
        in flight (any incarnation's), or a writer that may still write."""
        for w, busy in ((self.P, {s[0] for x in self.xfers if not x.done and x.ptid is not None
                                  for s, _ in x.cells} | self.push.read_sources()),
                        (self.D, {d[0] for x in self.xfers if not x.done for _, d in x.cells} | self.push.targets())):
            pool = w.sched.pool
            free = pool._free[0][pool._head[0]:]  # one pool; is_free() per block would slice it each time
            if not free:
                continue
            pending = w.pending_keys()
            for k in free:
                if k in busy or k in pending:
                    raise Violation(f"{w.name}: block {k} is free while "
                                    f"{'a pending step touches it' if k in pending else 'a transfer may touch it'}")

    @invariant()
    def books(self) -> None:
        """Rule 4 per incarnation: what arrived is exactly what this incarnation received."""
        s = self.D.sched
        for uid, r in self.D.reqs.items():
            got = s.arrived(uid)
            if got != r.got:
                raise Violation(f"D: {uid} (incarnation {r.inc}) has {self.names(got)} arrived; it received "
                                f"{self.names(r.got)}")

    def teardown(self) -> None:
        # Run both engines to completion by the ordinary protocol (so every
        # interleaving ends with its requests computed and checked), then drop
        # what is left; afterwards every block must be back in its pool.
        self.push.finish()
        for _ in range(64):
            for uid in list(self.D.reqs):
                # A consumer gives up on requests whose producer is gone or failed.
                if self.D.sched.phase(uid) is RequestPhase.FAILED or (
                    uid not in self.P.reqs and self.D.sched.phase(uid) is RequestPhase.IMPORTING
                ):
                    self._d_end(uid)
            if not (any(r.live for r in self.P.reqs.values()) or self.D.reqs or self._flying()):
                break
            self.heartbeat()
            self.p_schedule(0, 0)
            self.d_schedule(1)
            self.push.finish()
        for x in self._flying():
            self._land(x, True)
        for w in (self.P, self.D):
            while w.pending:
                w.execute()
        for uid in list(self.D.reqs):
            self._d_end(uid)
        for w in (self.P, self.D):
            for uid in w.sched.request_ids():
                w.sched.abort(uid)
        self.push.finish()
        self.clock.now += 10 * LEASE_S
        self.P.sched.poll()
        self.push.expire()
        for w in (self.P, self.D):
            w.sched.audit()
            if w.sched.free_count() != BLOCKS:
                raise Violation(f"{w.name}: {BLOCKS - w.sched.free_count()} blocks leaked")


# Examples per run: the CI budget is >= 10,000 interleavings in total over the property suite (counted and
# printed by conftest.py): two fifths of it here, a tenth to each of the six rule tests (test_rules.py).
EXAMPLES = max(1, int(os.environ.get("HYBRIDKV_PROPERTY_EXAMPLES", 10_000 if CI else 300)) * 2 // 5)


def test_fencing_two_sides(fence_policy_name: str) -> None:
    policy = FencePolicy(fence_policy_name)
    machine = type(f"FencingMachine_{policy.name}", (FencingMachine,), {"policy": policy})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )

