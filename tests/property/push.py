"""Pushed imports in the fencing state machine: remote writers through the real ImportLedger.

A pushed import (SGLang's layout: the prefill ranks WRITE into the decode's blocks) is posted on the decode's
scheduler one transfer per component and opened in an :class:`~hybridkv.fencing.imports.ImportLedger` with
``writers`` writers. Each writer is modelled here: it writes components (the bytes land in the decode's memory
at that moment, copied from the producer's), says it drained, or says it failed - and a failed writer may
still write, until it drained or the drain deadline passed (the model's contract with a writer: past the
deadline it is dead). The ledger's every answer is checked against this model, and the machine checks that no
block a live writer may still write is ever free, or held by another request, when its bytes land.

Incarnations: a request id reused after its old incarnation died opens the same ledger key under a new
generation; a writer of the old generation may still speak (a late LANDED, DRAINED or Failed), and must
change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.fencing.fence import NotYet
from hybridkv.fencing.imports import ImportLedger, ImportState
from hybridkv.fencing.request_state import RequestPhase
from tests.property.shadow import COMPONENTS, Violation

DRAIN_S = 3.0  # the ledger's drain deadline, from an import's first failure

_OPEN = ImportState.OPEN


@dataclass(eq=False)
class PushImport:
    uid: str
    inc: int  # the decode-side incarnation that opened it
    gen: int  # its ledger generation
    writers: int
    cells: dict  # component -> [(source cell on P, destination cell on D)]
    tids: dict  # component -> decode transfer id, while the ledger keeps it in flight
    ptid: int | None  # the producer's read of its source blocks, while a writer may write
    written: dict = field(default_factory=dict)  # component -> writers that wrote it
    drained: set = field(default_factory=set)
    failed: set = field(default_factory=set)
    deadline: float | None = None  # the drain deadline, from the first failure on
    state: ImportState = _OPEN
    released: bool = False  # the engine let go of the request
    gone: bool = False  # the ledger forgot it (released and ended): its generation is dead

    def may_write(self, w: int, now: float) -> bool:
        """May writer ``w`` still write? Not once it drained, past the deadline, or with nothing left to write."""
        return (self.state is _OPEN and w not in self.drained and (self.deadline is None or now < self.deadline)
                and any(w not in self.written.get(c, ()) for c in self.tids))

    def live(self, now: float) -> bool:
        return any(self.may_write(w, now) for w in range(self.writers))

    def todo(self, w: int) -> list:
        return [c for c in COMPONENTS if c in self.tids and w not in self.written.get(c, ())]

    def targets(self, now: float) -> set[int]:
        """Decode blocks a write of this import may still land in."""
        out: set[int] = set()
        for w in range(self.writers):
            if self.may_write(w, now):
                for c in self.todo(w):
                    out.update(d[0] for _, d in self.cells[c])
        return out

    def sources(self) -> set[int]:
        return {s[0] for cells in self.cells.values() for s, _ in cells}


class PushSide:
    """The ledger over the decode's scheduler, and the model of every pushed import's writers."""

    def __init__(self, machine) -> None:
        self.m = machine
        self.ledger = ImportLedger(machine.D.sched, drain_timeout_s=DRAIN_S, clock=machine.clock)
        self.imports: list[PushImport] = []  # the ledger's entries (open, or ended and not yet released)
        self.dead: list[PushImport] = []  # forgotten generations whose writers may still speak

    # ------------------------------------------------------------ queries
    def open_imports(self) -> list[PushImport]:
        return [imp for imp in self.imports if imp.state is _OPEN]

    def writable(self) -> list[PushImport]:
        now = self.m.clock.now
        return [imp for imp in self.imports if imp.live(now)]

    def targets(self) -> set[int]:
        now = self.m.clock.now
        out: set[int] = set()
        for imp in self.imports:
            if imp.state is _OPEN:
                out |= imp.targets(now)
        return out

    def read_sources(self) -> set[int]:
        """Producer blocks under a pushed import's read (its ptid in flight)."""
        out: set[int] = set()
        for imp in self.imports + self.dead:
            if imp.ptid is not None:
                out |= imp.sources()
        return out

    def writing(self, uid: str, inc: int) -> bool:
        """Is an import of this incarnation still in flight (the ledger keeps its transfers open)?"""
        return any(imp.uid == uid and imp.inc == inc and imp.state is _OPEN for imp in self.imports)

    # ------------------------------------------------------------ the engine
    def post(self, uid: str) -> None:
        """Post every component of the request at once and open its import; nothing if the producer is not
        ready, or the key still names an earlier incarnation's import (SGLang refuses the room then)."""
        m = self.m
        D, P = m.D, m.P
        r = D.reqs[uid]
        if r.imp is not None or uid in self.ledger or D.sched.phase(uid) is not RequestPhase.IMPORTING:
            return
        if isinstance(P.sched.export_ready(uid), NotYet):
            return
        ptid = P.sched.post_export(uid, expected_s=0.5)
        if isinstance(ptid, NotYet):
            return
        tids = {}
        for c in COMPONENTS:
            blocks = m.narrowed(r, (c,))
            tid = D.sched.post_import(uid, components=(c,), blocks=blocks, lease_deadline=None, expected_s=0.0)
            if isinstance(tid, NotYet):
                for t in tids.values():
                    D.sched.transfer_failed(t)  # nothing was published: no write can come
                P.sched.transfer_failed(ptid)
                return
            tids[c] = tid
        cells = {c: m.cells(uid, (c,)) for c in COMPONENTS}
        m.check_post(uid, [d for cs in cells.values() for _, d in cs])
        gen = self.ledger.open(uid, request=uid, tids=tids, writers=m.writers)
        imp = PushImport(uid=uid, inc=r.inc, gen=gen, writers=m.writers, cells=cells, tids=dict(tids), ptid=ptid)
        r.imp = imp
        self.imports.append(imp)

    def release(self, imp: PushImport) -> None:
        """The engine let go of the request (abort, or done): the entry goes once it ended."""
        gone = self.ledger.release(imp.uid)
        imp.released = True
        if imp.state is _OPEN:
            self._fail(imp)
        if gone != (imp.state is not _OPEN):
            raise Violation(f"ledger.release({imp.uid}) answered {gone} for a {imp.state.value} import")
        self._forget(imp)

    def engine_fail(self, imp: PushImport) -> None:
        """The import failed here (the engine aborted it, the writers' node was lost): nothing ends."""
        before = self.m.D.sched.transfers_in_flight()
        if not self.ledger.fail(imp.uid, "lost the writers' node", generation=imp.gen):
            raise Violation(f"ledger.fail of a live import {imp.uid} generation {imp.gen} answered False")
        self._fail(imp)
        if self.m.D.sched.transfers_in_flight() != before:
            raise Violation(f"a failure of import {imp.uid} ended transfers a writer may still write")

    def expire(self) -> None:
        now = self.m.clock.now
        due = sorted(imp.uid for imp in self.imports
                     if imp.state is _OPEN and imp.deadline is not None and now >= imp.deadline)
        got = sorted(self.ledger.expire())
        if got != due:
            raise Violation(f"ledger.expire at {now} ended {got}; the drain deadlines say {due}")
        for imp in list(self.imports):
            if imp.uid in due and imp.state is _OPEN:
                self._end(imp, ImportState.EXPIRED)
        self.settle_reads()

    # ------------------------------------------------------------ what writers say
    def write(self, imp: PushImport, w: int, mask: int) -> None:
        m = self.m
        D, P = m.D, m.P
        if not imp.may_write(w, m.clock.now):
            return
        todo = imp.todo(w)
        comps = [c for j, c in enumerate(todo) if mask >> j & 1] or todo[:1]
        # The bytes land now, whatever the decode side did meanwhile.
        m.check_target(imp.uid, imp.inc, [d[0] for c in comps for _, d in imp.cells[c]])
        for c in comps:
            for s, d in imp.cells[c]:
                D.mem[d] = P.mem.get(s)
        want = []
        for c in comps:
            seen = imp.written.setdefault(c, set())
            seen.add(w)
            if len(seen) >= imp.writers:
                want.append(c)
        before = D.sched.arrived(imp.uid) if D.sched.has_request(imp.uid) else None
        got = self.ledger.landed(imp.uid, w, comps, generation=imp.gen)
        if sorted(map(id, got)) != sorted(map(id, want)):
            raise Violation(f"writer {w} of import {imp.uid} wrote {m.names(comps)}: the ledger landed "
                            f"{m.names(got)}; every writer having written says {m.names(want)}")
        for c in want:
            del imp.tids[c]
        if not imp.tids:
            imp.state = ImportState.LANDED
            self._forget(imp)
        r = D.reqs.get(imp.uid)
        if r is not None and r.inc == imp.inc:
            r.got |= set(want)
            if want and any(m.overwritten(imp.uid, s) for c in want for s, _ in imp.cells[c]):
                raise Violation(f"D: request {imp.uid} accepted pushed bytes read from freed producer blocks")
        elif before is not None and D.sched.arrived(imp.uid) != before:
            raise Violation(f"a write of a dead incarnation of {imp.uid} (generation {imp.gen}) landed for "
                            "its next incarnation")
        self.settle_reads()

    def drained(self, imp: PushImport, w: int) -> None:
        if imp.gone or w in imp.drained:
            return
        imp.drained.add(w)
        imp.failed.discard(w)
        ends = imp.state is _OPEN and len(imp.drained) >= imp.writers
        got = self.ledger.drained(imp.uid, w, generation=imp.gen)
        if got != ends:
            raise Violation(f"writer {w} of import {imp.uid} drained ({sorted(imp.drained)} of {imp.writers}): "
                            f"the ledger answered {got}, expected {ends}")
        if ends:
            self._end(imp, ImportState.DRAINED)
        self.settle_reads()

    def writer_failed(self, imp: PushImport, w: int) -> None:
        """Writer ``w`` failed: not drained. It may still write until it drains or the deadline passes."""
        if imp.gone:
            return
        before = self.m.D.sched.transfers_in_flight()
        if not self.ledger.writer_failed(imp.uid, w, "a WRITE may still land", generation=imp.gen):
            raise Violation(f"ledger.writer_failed of a live import {imp.uid} answered False")
        if w not in imp.drained:
            imp.failed.add(w)
        self._fail(imp)
        if self.m.D.sched.transfers_in_flight() != before:
            raise Violation(f"writer {w}'s Failed ended transfers of import {imp.uid}; it may still write")

    def late_word(self, imp: PushImport, w: int, kind: int) -> None:
        """A writer of a dead generation speaks: whatever it says, nothing changes."""
        D = self.m.D
        view = self.ledger.view(imp.uid)
        flights = D.sched.transfers_in_flight()
        arrived = D.sched.arrived(imp.uid) if D.sched.has_request(imp.uid) else None
        if kind == 0:
            got = self.ledger.landed(imp.uid, w, COMPONENTS, generation=imp.gen)
            changed = got != []
        elif kind == 1:
            changed = self.ledger.drained(imp.uid, w, generation=imp.gen)
        else:
            changed = self.ledger.writer_failed(imp.uid, w, "late", generation=imp.gen)
        after = D.sched.arrived(imp.uid) if D.sched.has_request(imp.uid) else None
        if changed or self.ledger.view(imp.uid) != view or D.sched.transfers_in_flight() != flights \
                or after != arrived:
            raise Violation(f"a {('LANDED', 'DRAINED', 'Failed')[kind]} of writer {w} of dead generation "
                            f"{imp.gen} of {imp.uid} changed the import now under that key")

    # ------------------------------------------------------------ internals
    def _fail(self, imp: PushImport) -> None:
        if imp.deadline is None and imp.state is _OPEN:
            imp.deadline = self.m.clock.now + DRAIN_S

    def _end(self, imp: PushImport, state: ImportState) -> None:
        imp.tids.clear()
        imp.state = state
        self._forget(imp)

    def _forget(self, imp: PushImport) -> None:
        if imp.released and imp.state is not _OPEN and not imp.gone:
            imp.gone = True
            self.imports.remove(imp)
            self.dead.append(imp)
            del self.dead[:-4]  # a few old generations are enough to speak late
            if self.ledger.generation(imp.uid) == imp.gen:
                raise Violation(f"import {imp.uid} generation {imp.gen} released and ended, still in the ledger")

    def settle_reads(self) -> None:
        """The producer's read of a pushed import ends once no writer of it may write; the consumer, ready,
        lets the producer go (as a pull's landing does)."""
        m = self.m
        now = m.clock.now
        for imp in self.imports + self.dead:
            if imp.ptid is not None and not imp.live(now):
                m.P.sched.transfer_landed(imp.ptid)
                imp.ptid = None
                r = m.D.reqs.get(imp.uid)
                if r is not None and r.inc == imp.inc and not imp.tids and m.D.sched.is_ready(imp.uid) \
                        and imp.uid in m.P.reqs:
                    m.P.sched.export_done(imp.uid)
                    m.P.drop(imp.uid)

    def finish(self) -> None:
        """Teardown: every writer that may write writes what it has left, then every writer drains."""
        now = self.m.clock.now
        for imp in list(self.imports):
            for w in range(imp.writers):
                if imp.may_write(w, now):
                    self.write(imp, w, 7)
            for w in range(imp.writers):
                if not imp.gone:
                    self.drained(imp, w)
