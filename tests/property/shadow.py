"""Shadow memory model for the fencing property tests.

Two workers, a producer P (prefill) and a consumer D (decode), each with a
real :class:`~hybridkv.fencing.scheduler.TransferScheduler`, a device that runs
scheduled steps in order up to ``depth`` steps behind its scheduler, and a
memory of *cells*: ``(block key, part)`` -> value, where part is ``kv`` for
an attention page and ``conv`` / ``ssm`` for the two halves of a GDN page.

Values say who wrote what: ``(uid, "kv", i)`` for attention block ``i`` of a
request, ``(uid, "conv"|"ssm", v)`` for GDN state after ``v`` steps, ``ZERO``
after a zeroing kernel, ``GARBAGE`` after a failed (partial) transfer. Every
request carries the values it expects; a step that computes on anything else
is a violation. RDMA copies happen when a transfer lands, at any moment the
test machine chooses, independent of both devices' queues.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybridkv.fencing.fence import FencePolicy, PoolLayout
from hybridkv.fencing.request_state import Component, ComponentKind
from hybridkv.fencing.scheduler import TransferScheduler

ATT, GDN = 0, 1
KV = Component(group=ATT, kind=ComponentKind.KV)
CONV = Component(group=GDN, kind=ComponentKind.CONV)
SSM = Component(group=GDN, kind=ComponentKind.SSM)
COMPONENTS = (KV, CONV, SSM)
PART = {KV: "kv", CONV: "conv", SSM: "ssm"}
ZERO = ("zero",)
GARBAGE = ("garbage",)
PAGE_PARTS = ("kv", "conv", "ssm")  # a page of the shared pool holds either kind

BLOCKS = 8
LEASE_S = 4.0


class Violation(AssertionError):
    """A property of the memory model is broken: the fencing failed."""


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Req:
    uid: str
    att: list[int]
    gdn: int
    app: list[int] = field(default_factory=list)  # decode-side appended attention blocks
    # Rule 7: a cached prefix shared with another live request (read, never written by this one),
    # and that request's uid.
    pre: list[int] = field(default_factory=list)
    pre_from: str | None = None
    v: int = 0  # GDN versions written so far (producer) / expected next read (consumer)
    steps_in: int = 0  # scheduled steps that include the request
    chunks: int = 1  # steps before the request is finished (prefill chunks / decode steps)
    decoded: int = 0
    live: bool = True  # its outputs are used (not finished, not aborted)
    expect: dict[tuple[int, str], tuple] = field(default_factory=dict)
    # Decode side. inc: which incarnation of the id (a request id reused after its old incarnation died);
    # got: the components whose own transfer landed (what the scheduler's arrived() must say); push: its
    # import is written by remote writers through the ImportLedger (else the decode side pulls); local: it
    # gave its import up and computes its prompt here (recompute), writing its attention KV as a prefill does.
    inc: int = 0
    got: set = field(default_factory=set)
    push: bool = False
    local: bool = False
    imp: object | None = None  # its PushImport, once posted


@dataclass
class Step:
    step: int
    work: list[tuple[Req, list[int], int, list[int]]]  # request, attention keys, gdn key, appended keys
    zero: list[int]


class Worker:
    """One side: scheduler + device queue + memory."""

    def __init__(self, name: str, policy: FencePolicy, clock: Clock) -> None:
        self.name = name
        self.producer = name == "P"
        self.sched = TransferScheduler(
            PoolLayout.shared(num_blocks=BLOCKS, num_groups=2), policy=policy, lease_s=LEASE_S, clock=clock
        )
        self.mem: dict[tuple[int, str], tuple] = {}
        self.pending: deque[Step] = deque()
        self.reqs: dict[str, Req] = {}
        self.resident: dict[str, Req] = {}
        self.zero_next: list[int] = []
        self.next_step = 0

    def key(self, group: int, block: int) -> int:
        return self.sched.table.key(group, block)

    def pending_keys(self) -> set[int]:
        out: set[int] = set()
        for s in self.pending:
            out.update(s.zero)
            for r, att, gdn, app in s.work:
                out.update(r.pre)  # a cached prefix the step reads
                out.update(att)
                out.add(gdn)
                out.update(app)
        return out

    def schedule(self) -> None:
        s = self.sched
        joined = [r for uid, r in self.reqs.items() if uid not in self.resident and r.live and s.is_ready(uid)]
        zero_refs = [(ATT, s.table.block_of(k)) for k in self.zero_next]
        step = self.next_step
        self.next_step += 1
        ticket = s.step_scheduled(step, joined=[r.uid for r in joined], zeroing=zero_refs)
        skipped = {self.key(g, b) for g, b in ticket.skip_zeroing}
        zero = [k for k in self.zero_next if k not in skipped]
        self.zero_next = []
        for r in joined:
            self.resident[r.uid] = r
        work = []
        for r in self.resident.values():
            r.steps_in += 1
            work.append((r, list(r.att), r.gdn, list(r.app)))
        self.pending.append(Step(step=step, work=work, zero=zero))

    def execute(self) -> list[Req]:
        """Run the oldest pending step; returns the live requests it computed."""
        st = self.pending.popleft()
        done = []
        mem = self.mem
        for k in st.zero:
            for part in PAGE_PARTS:
                mem[(k, part)] = ZERO
        for r, att, gdn, app in st.work:
            uid = r.uid
            if r.live:
                for cell, want in r.expect.items():
                    got = mem.get(cell)
                    if got != want:
                        raise Violation(
                            f"{self.name} step {st.step}: request {uid} computes on {cell}={got}, "
                            f"expected {want} (written by its producer)"
                        )
            r.v += 1
            writes = {(gdn, "conv"): (uid, "conv", r.v), (gdn, "ssm"): (uid, "ssm", r.v)}
            if self.producer or r.local:  # prefill (or a recompute) writes the prompt's KV; decode only appends
                for i, k in enumerate(att):
                    writes[(k, "kv")] = (uid, "kv", i)
            for i, k in enumerate(app):
                writes[(k, "kv")] = (uid, "app", i)
            mem.update(writes)
            if r.live:
                r.expect.update(writes)
                done.append(r)
        self.sched.step_completed(st.step)
        return done

    def drop(self, uid: str) -> None:
        r = self.reqs.pop(uid)
        r.live = False
        self.resident.pop(uid, None)
        if self.zero_next:  # a block the request let go of is not the engine's to zero any more
            mine = {*r.att, *r.app}
            self.zero_next = [k for k in self.zero_next if k not in mine]


@dataclass
class Xfer:
    uid: str
    comps: frozenset
    cells: list[tuple[tuple[int, str], tuple[int, str]]]  # (source cell on P, destination cell on D)
    dtid: int
    ptid: int | None
    inc: int = 0  # the decode-side incarnation that posted it
    stuck: bool = False  # stalled: lands only when picked by name (land), never in passing
    done: bool = False
