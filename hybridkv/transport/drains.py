"""The consumer's imports by writer: when an import is over, so that its blocks may go back (rule 5).

:class:`Drains` is held by :class:`~hybridkv.transport.consumer.Consumer` and runs the core's
:class:`~hybridkv.fencing.imports.ImportLedger` over the consumer's scheduler. Every posted import is
opened there with the *writers* that may write its blocks, and ends only when each of them landed its
share or drained (it will write nothing more), or when the drain deadline passed:

* **push**: the one writer is the producer. Its completion notification (``hkv:<rid>``, after the data)
  lands the import; its ``Done`` (the sender is finished with the transfer, ok or not) drains it. Its
  ``Failure`` is *not* drained: the import fails and the drain deadline (``transfer_timeout_s``) starts,
  its blocks stay out of reuse. Losing the producer (``Bye``, a dropped channel) and this side's own abort
  (past the lease, ``Consumer.release``) fail it the same way. A write that lands after the import failed
  ends it without its bytes being used.
* **pull**: the writers are this consumer's own READs, one per producer. A READ's completion lands its
  share; a READ that ended any other way (error, aborted) drains it. One NIXL will not abort fails the
  import and drains it when NIXL ends it: NIXL says when, so no deadline ends it early.

Producer words are routed by (producer agent, request id) and must carry the request's token; a key
that was reused is a new entry of the ledger (a late word of the old import never ends the new one).
Everything runs on the consumer's event loop, as the ledger requires. No torch.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridkv import wire
from hybridkv.fencing import Component, ImportLedger, ImportState, RequestPhase, TransferOutcome
from hybridkv.ids import RequestId, TransferId
from hybridkv.transport.parts import Part
from hybridkv.transport.side import Side


@dataclass(eq=False, kw_only=True)
class Import:
    """One posted import, as the consumer tracks it beside its ledger entry."""

    key: tuple[str, int]  # the ledger's key: the request id and a serial (a request id may come back)
    rid: str
    tid: int
    writers: tuple[str, ...]  # push: the producer's agent; pull: the agents this side READs from
    components: tuple[Component, ...]
    part: Part | None = None  # push: the producer's part (its token, lease, what it said)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    state: ImportState = ImportState.OPEN  # the ledger's, as last seen while it held the entry
    failure: str | None = None  # why it failed (the first reason), None while it has not
    quarantined: int = 0  # blocks counted as quarantined: let go of by the engine while still open
    deadline_counted: bool = False  # push: its drain deadline runs (counted for the pump's expiry)
    let_go: bool = False  # the import's fetch ended (the engine has the request's outcome)


class Drains:
    """The ledger of the consumer ``side``'s imports (``side.config.transfer_timeout_s`` is the drain
    deadline of a failed push import)."""

    def __init__(self, side: Side) -> None:
        self._side = side
        self._push = side.config.mode is wire.Mode.PUSH
        self.ledger = ImportLedger(side.scheduler, drain_timeout_s=side.config.transfer_timeout_s)
        self._serial = itertools.count(1)
        self._open: dict[tuple[str, int], Import] = {}  # key -> import not yet ended
        self._routes: dict[tuple[str, str], Import] = {}  # push: (producer agent, rid) -> its open import
        self._failed_open = 0  # open imports with a drain deadline running (push): the pump expires them
        self._next_expiry = 0.0

    # ------------------------------------------------------------ this side
    def open(self, rid: str, tid: int, components: Sequence[Component], writers: Sequence[str], *,
             part: Part | None = None) -> Import:
        """Track the posted import ``tid`` (every component of ``rid`` in one transfer, so that they become
        visible together) written by ``writers``. Push: ``part`` is the producer's, and opening comes
        before the Import is sent (its notification may come at once)."""
        imp = Import(key=(rid, next(self._serial)), rid=rid, tid=tid, writers=tuple(writers),
                     components=tuple(components), part=part)
        # One transfer carries every component: the ledger ends it with the first and finds it ended
        # (DUPLICATE, no effect) for the rest.
        self.ledger.open(imp.key, request=RequestId(rid), tids={c: TransferId(tid) for c in imp.components},
                         writers=len(imp.writers))
        self._open[imp.key] = imp
        if part is not None:
            for agent in imp.writers:
                self._routes[(agent, rid)] = imp
        return imp

    def landed(self, imp: Import, writer: str) -> None:
        """``writer`` wrote its share of every component. Where the import failed already, the write only
        ended: drained, its bytes are not used."""
        if imp.key not in self._open:
            return
        if self._failure(imp) is not None:
            self.drained(imp, writer)
            return
        self.ledger.landed(imp.key, writer, imp.components)
        self._after(imp)

    def drained(self, imp: Import, writer: str) -> None:
        """``writer`` will write nothing more into the import's blocks."""
        if imp.key not in self._open:
            return
        self.ledger.drained(imp.key, writer)
        self._after(imp)

    def writer_failed(self, imp: Import, writer: str, reason: str) -> None:
        """``writer`` failed the request: not drained, the import fails and its drain deadline starts."""
        if imp.key not in self._open:
            return
        self.ledger.writer_failed(imp.key, writer, reason)
        self._started(imp)

    def fail(self, imp: Import, reason: str) -> None:
        """The import failed here (an abort, a lost producer): kept open until its writers drain."""
        if imp.key not in self._open:
            return
        self.ledger.fail(imp.key, reason)
        self._started(imp)

    def settle(self, imp: Import, reason: str) -> None:
        """No writer can write (nothing was posted): ends it now, failed."""
        if imp.key not in self._open:
            return
        self.ledger.settle(imp.key, reason)
        self._after(imp)

    def release(self, imp: Import, *, quarantined: int = 0) -> None:
        """The engine let go of the request. An import still open keeps its blocks out of reuse until it
        ends (``quarantined``: how many, for the metrics, counted now and again when it ends)."""
        imp.let_go = True
        if imp.key in self._open and quarantined:
            imp.quarantined = quarantined
            self._side.metrics.quarantined(quarantined)
        self.ledger.release(imp.key)
        if imp.key in self._open:
            self._started(imp)  # a released open import has failed: its deadline runs (push)

    def check_deadline(self, imp: Import) -> None:
        """Push: end the import if its drain deadline passed."""
        if self._push and imp.key in self._open and self.ledger.check_deadline(imp.key):
            self._after(imp)

    def deadline(self, imp: Import) -> float | None:
        view = self.ledger.view(imp.key)
        return None if view is None else view.deadline

    def outcome(self, imp: Import) -> TransferOutcome | None:
        """For an import that landed: what the scheduler made of it (LATE past the lease: not trusted)."""
        if imp.state is not ImportState.LANDED:
            return None
        sched = self._side.scheduler
        if not sched.has_request(imp.rid):
            return TransferOutcome.DISCARDED
        return TransferOutcome.ACCEPTED if sched.phase(imp.rid) is RequestPhase.READY else TransferOutcome.LATE

    def settling(self, rid: str) -> bool:
        """Whether an import of ``rid`` whose fetch ended (failed) may still be written."""
        return any(i.rid == rid and i.let_go for i in self._open.values())

    async def settled(self, rid: str) -> None:
        """Wait until no import of ``rid`` whose fetch ended may still be written."""
        for imp in [i for i in self._open.values() if i.rid == rid and i.let_go]:
            await imp.ended.wait()

    # ------------------------------------------------------------ what producers say (push)
    def heard(self, agent: str, msg: wire.Done | wire.Failure) -> bool:
        """A producer's Done (drained) or Failure (failed, not drained) about an import it may be
        writing. False if it names none (or not with its token)."""
        imp = self._route(agent, msg.request_id, msg.token)
        if imp is None:
            return False
        if isinstance(msg, wire.Done):
            self.drained(imp, agent)
        else:
            self.writer_failed(imp, agent, f"producer failed the request: {msg.detail}")
        return True

    def notified(self, agent: str, rid: str) -> bool:
        """The producer's completion notification (after its WRITE's data). False if it names no open
        import of that producer."""
        imp = self._routes.get((agent, rid))
        if imp is None:
            return False
        if imp.part is not None and imp.part.lease_lost:
            self.fail(imp, "lease lapsed before the WRITE landed: bytes not trusted")
        self.landed(imp, agent)
        return True

    def lost(self, agent: str, reason: str) -> None:
        """The producer is gone (Bye, dropped channel): each import it may be writing fails, and stays
        open until it drains or the deadline passes. Its writer may outlive its control channel."""
        for imp in [i for (a, _), i in self._routes.items() if a == agent]:
            self.fail(imp, reason)

    def aborted(self, agent: str, rid: str, token: bytes, reason: str) -> None:
        """This side gave the request up (``Consumer.release``) while the producer may be writing."""
        imp = self._route(agent, rid, token)
        if imp is not None:
            self.fail(imp, reason)

    def expire(self) -> None:
        """From the pump (push): end the imports whose drain deadline passed (a fetch that waits on one
        checks it itself; this covers one nobody waits on any more). At the idle pace at most."""
        if not self._failed_open:
            return
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + self._side.config.pump_idle_s
        ended = set(self.ledger.expire())
        for imp in [i for k, i in self._open.items() if k in ended]:
            self._after(imp)

    def describe(self) -> dict:
        return {f"{i.rid}#{i.key[1]}": {"writers": list(i.writers), "failure": self._failure(i),
                                        "deadline": self.deadline(i)} for i in self._open.values()}

    # ------------------------------------------------------------ internals
    def _route(self, agent: str, rid: str, token: bytes) -> Import | None:
        imp = self._routes.get((agent, rid))
        if imp is None or imp.part is None or imp.part.token != token:
            return None
        return imp

    def _failure(self, imp: Import) -> str | None:
        view = self.ledger.view(imp.key)
        return imp.failure if view is None else view.failure

    def _started(self, imp: Import) -> None:
        # A failed open import: its drain deadline runs from now (the ledger's), the pump expires it (push).
        if self._push and not imp.deadline_counted and self.deadline(imp) is not None:
            imp.deadline_counted = True
            self._failed_open += 1
        self._after(imp)

    def _after(self, imp: Import) -> None:
        """Note where the import stands; once it ended: its waiters wake, its routes go."""
        view = self.ledger.view(imp.key)
        if view is not None:
            imp.failure = view.failure
            imp.state = view.state
            if view.state is ImportState.OPEN:
                return
        if self._open.pop(imp.key, None) is None:
            return
        if imp.deadline_counted:
            self._failed_open -= 1
        for agent in imp.writers:
            if self._routes.get((agent, imp.rid)) is imp:
                del self._routes[(agent, imp.rid)]
        if imp.quarantined:
            self._side.metrics.quarantine_released(imp.quarantined)
        imp.ended.set()


__all__ = ["Drains", "Import"]
