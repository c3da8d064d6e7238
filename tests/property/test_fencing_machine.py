"""Stateful race tests: a producer and a consumer under asynchronous scheduling.

hypothesis drives both engines through the real TransferScheduler: steps
scheduled up to ``depth`` ahead of each device, GDN state rewritten by every
step, attention blocks appended and zeroed on allocation, transfers of the
KV / conv / SSM components posted separately and landing, failing, landing
late or twice at any moment, aborts on both sides, lease heartbeats and
expiry. Memory is the shadow model of ``shadow.py``; the checks are on
content. With ``--fence-policy none`` this must fail.
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

    @initialize(depth=st.integers(min_value=1, max_value=3))
    def set_depth(self, depth: int) -> None:
        self.depth = depth

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

    def _cached(self) -> list[Req]:
        """Producer requests (live, or finished with their blocks not yet reusable) whose
        computed attention blocks a new request may hit as a cached prefix."""
        P = self.P
        pool, t = P.sched.pool, P.sched.table
        out = []
        for uid, r in sorted(self.computed.items()):
            k = r.att[0]
            if self.cached_by.get(k) != uid or P.mem.get((k, "kv")) != (uid, "kv", 0):
                continue
            if uid in P.sched.holders(ATT, t.block_of(k)) or pool.is_parked(k) and not P.sched.holders(ATT, t.block_of(k)):
                out.append(r)
        return out

    @precondition(lambda self: self._cached())
    @rule(i=st.integers(min_value=0, max_value=7), m=st.integers(min_value=1, max_value=2),
          n=st.integers(min_value=1, max_value=2), chunks=st.integers(min_value=1, max_value=2))
    def p_prefix_hit(self, i: int, m: int, n: int, chunks: int) -> None:
        """Rule 7: a new request shares the cached prefix of a live one (prefix caching) and
        computes only its own suffix; the prefix blocks now have two holders."""
        cand = self._cached()
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
        att = s.allocate(uid, ATT, n)
        gdn = s.allocate(uid, GDN, 1)
        self._evict(att, gdn)
        r = Req(uid=uid, att=[w.key(ATT, b) for b in att], gdn=w.key(GDN, gdn[0]), chunks=chunks,
                pre=list(pre), pre_from=o.uid)
        for j, k in enumerate(pre):
            r.expect[(k, "kv")] = (o.uid, "kv", j)  # computed by o: read, never rewritten
        w.reqs[uid] = r

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

    # ------------------------------------------------------------ consumer
    def d_new(self, uid: str) -> None:
        src = self.P.reqs[uid]
        s = self.D.sched
        w = self.D
        s.add_request(uid, expect=COMPONENTS)
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
                pre=hit, pre_from=None if not hit else src.pre_from)
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

    def _try_post(self, uid: str, want: frozenset, aware: bool, expected_s: float) -> None:
        D, P = self.D, self.P
        flying = {c for x in self.xfers if not x.done and x.uid == uid for c in x.comps}
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
        src, dst = P.reqs[uid], D.reqs[uid]
        blocks = None
        if dst.pre:  # a local prefix hit: load only the blocks the request holds alone
            t = D.sched.table
            blocks = {c.group: [t.block_of(k) for k in (dst.att if c.group == ATT else [dst.gdn])] for c in comps}
        dtid = D.sched.post_import(uid, components=comps, blocks=blocks, lease_deadline=deadline,
                                   expected_s=expected_s)
        if isinstance(dtid, NotYet):
            if ptid is not None:
                P.sched.transfer_failed(ptid)  # never started
            return
        cells = []
        for c in comps:
            if c.group == ATT:
                src_all = src.pre + src.att
                cells += [((sk, "kv"), (dk, "kv")) for sk, dk in zip(src_all[len(src_all) - len(dst.att):], dst.att)]
            else:
                cells.append(((src.gdn, PART[c]), (dst.gdn, PART[c])))
        dst_keys = {d[0] for _, d in cells}
        if dst_keys & D.pending_keys():
            raise Violation(f"D: inbound write into blocks {sorted(dst_keys)} posted while a pending step touches them")
        others = {d for x in self.xfers if not x.done for _, d in x.cells}
        if others & {d for _, d in cells}:
            raise Violation(f"D: two inbound transfers write the same cells of request {uid}")
        self.xfers.append(Xfer(uid=uid, comps=comps, cells=cells, dtid=dtid, ptid=ptid))

    @staticmethod
    def _ref(table, key: int) -> tuple[int, int]:
        return ATT, table.block_of(key)  # one shared pool: any group names the page

    def _overwritten(self, uid: str, cell: tuple[int, str]) -> bool:
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
        if land and any(not x.done for x in self.xfers):
            self.land(land - 1, True)

    @precondition(lambda self: any(not x.done for x in self.xfers))
    @rule(i=st.integers(min_value=0, max_value=7), ok=st.booleans())
    def land(self, i: int, ok: bool) -> None:
        fl = self._flying()
        x = fl[i % len(fl)]
        x.done = True
        D, P = self.D, self.P
        if ok:
            dst_keys = {d[0] for _, d in x.cells}
            if dst_keys & D.pending_keys():
                raise Violation(f"D: transfer for {x.uid} lands into blocks a pending step writes")
            freed = any(self._overwritten(x.uid, s) for s, _ in x.cells)
            for s, d in x.cells:
                D.mem[d] = P.mem.get(s)
            out = D.sched.transfer_landed(x.dtid)
            if x.ptid is not None:
                P.sched.transfer_landed(x.ptid)
            if out is TransferOutcome.ACCEPTED and freed:
                raise Violation(f"D: request {x.uid} accepted bytes read from freed producer blocks")
            if out is TransferOutcome.ACCEPTED and D.sched.is_ready(x.uid) and x.uid in P.reqs:
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
                self.D.sched.request_finished(r.uid)
                self.D.drop(r.uid)

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
        uid = sorted(self.D.reqs)[i % len(self.D.reqs)]
        self.D.sched.abort(uid)
        self.D.drop(uid)

    # ------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        self.P.sched.audit()
        self.D.sched.audit()

    def teardown(self) -> None:
        # Run both engines to completion by the ordinary protocol (so every
        # interleaving ends with its requests computed and checked), then drop
        # what is left; afterwards every block must be back in its pool.
        for _ in range(64):
            for uid in list(self.D.reqs):
                # A consumer gives up on requests whose producer is gone or failed.
                if self.D.sched.phase(uid) is RequestPhase.FAILED or (
                    uid not in self.P.reqs and self.D.sched.phase(uid) is RequestPhase.IMPORTING
                ):
                    self.D.sched.abort(uid)
                    self.D.drop(uid)
            if not (any(r.live for r in self.P.reqs.values()) or self.D.reqs or self._flying()):
                break
            self.heartbeat()
            self.p_schedule(0, 0)
            self.d_schedule(1)
        for x in self._flying():
            self.land(0, True)
        for w in (self.P, self.D):
            while w.pending:
                w.execute()
            for uid in w.sched.request_ids():
                w.sched.abort(uid)
        self.clock.now += 10 * LEASE_S
        self.P.sched.poll()
        for w in (self.P, self.D):
            w.sched.audit()
            if w.sched.free_count() != BLOCKS:
                raise Violation(f"{w.name}: {BLOCKS - w.sched.free_count()} blocks leaked")


# Examples per run: the CI budget is >= 10,000 interleavings in total over the
# property suite (counted and printed by conftest.py).
EXAMPLES = int(os.environ.get("HYBRIDKV_PROPERTY_EXAMPLES", 10_000 if CI else 300))


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
