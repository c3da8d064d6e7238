"""Inbound writes per writer: when an import into a request's blocks is over (fencing rule 5, per writer).

A consumer's blocks are written by one or more *writers* (the producer ranks that push into them; one for a
pull, where the consumer's own READ is the writer). The :class:`~hybridkv.fencing.scheduler.TransferScheduler`
keeps a block out of reuse while an inbound transfer is in flight; :class:`ImportLedger` decides when such a
transfer is terminal, from what each writer said:

* a component **lands** once every writer reported it written (``landed``): ``transfer_landed``;
* the import is **over** only when every writer said it is **drained** (it will write nothing more into these
  blocks) or the **drain deadline** passed; then the components that did not land end failed
  (``transfer_failed``) and the blocks settle as the scheduler's rules allow;
* a writer's **failure** is not drained: a failed writer may still have a WRITE in flight. It fails the import
  (the engine fails the request) and starts the drain deadline, nothing more;
* **losing a node** (heartbeats missed) is a failure too: the import fails, its transfers stay open until every
  writer drained or the deadline passed. A writer process may outlive the node's health endpoint.

Entries are keyed by whatever the engine names a request's import by (SGLang: the bootstrap room) and carry a
*generation*: a key the engine reuses is a new entry with a new generation, and a writer's message for
another generation is ignored, so a late "drained" of an old request never settles a new one.

The ledger is not thread-safe; callers hold the lock they hold around the scheduler. No engine, no torch.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

from hybridkv.fencing.lease import Clock
from hybridkv.fencing.request_state import Component
from hybridkv.fencing.scheduler import TransferScheduler
from hybridkv.ids import RequestId, TransferId

Writer = Hashable  # a writer's id as the engine names it (SGLang: the prefill rank)


class ImportState(enum.Enum):
    """Where an import stands."""

    OPEN = "open"  # a component may still be written
    LANDED = "landed"  # every component landed
    DRAINED = "drained"  # every writer drained; the components that did not land ended failed
    EXPIRED = "expired"  # the drain deadline passed; the components that did not land ended failed
    SETTLED = "settled"  # the engine said no writer can write (nothing was published to any); likewise


@dataclass(slots=True, kw_only=True, eq=False)
class _Entry:
    request: RequestId
    generation: int
    writers: int  # how many writers may write (each must drain)
    tids: dict[Component, TransferId]  # transfers still in flight, by component
    landed_from: dict[Component, set[Writer]] = field(default_factory=dict)
    drained: set[Writer] = field(default_factory=set)
    failed: dict[Writer, str] = field(default_factory=dict)  # writers that failed (not drained), why
    failure: str | None = None  # why the import failed (first reason), None while it has not
    deadline: float | None = None  # drain deadline, from the first failure on
    unlanded: list[Component] = field(default_factory=list)  # ended without landing
    state: ImportState = ImportState.OPEN
    released: bool = False  # the engine let go of the request: forget the entry once it is terminal


@dataclass(frozen=True, kw_only=True)
class ImportView:
    """A read-only snapshot of one import (tests, logs, metrics)."""

    request: RequestId
    generation: int
    state: ImportState
    in_flight: tuple[Component, ...]
    unlanded: tuple[Component, ...]
    drained: frozenset[Writer]
    failed: Mapping[Writer, str]
    failure: str | None
    deadline: float | None


class ImportLedger:
    """Per-import, per-writer ledger over a :class:`TransferScheduler`'s inbound transfers.

    ``open`` takes transfers already posted (``post_import``); every other call is a writer's word or the
    engine's, and returns whether the import became terminal with it. ``drain_timeout_s`` is how long a failed
    import waits for every writer to drain before its transfers end anyway.
    """

    def __init__(self, sched: TransferScheduler, *, drain_timeout_s: float, clock: Clock = time.monotonic) -> None:
        if not isinstance(sched, TransferScheduler):
            raise ValueError(f"sched {sched!r}; expected a TransferScheduler")
        if not drain_timeout_s > 0:
            raise ValueError(f"drain_timeout_s = {drain_timeout_s!r}; expected a positive number of seconds")
        self.sched = sched
        self.drain_timeout_s = float(drain_timeout_s)
        self.clock = clock
        self._entries: dict[Hashable, _Entry] = {}
        self._next_generation = 1

    # ------------------------------------------------------------ queries
    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def generation(self, key: Hashable) -> int | None:
        e = self._entries.get(key)
        return None if e is None else e.generation

    def state(self, key: Hashable) -> ImportState | None:
        e = self._entries.get(key)
        return None if e is None else e.state

    def in_flight(self, key: Hashable) -> int:
        """Transfers of the import still open (0 for an unknown key)."""
        e = self._entries.get(key)
        return 0 if e is None else len(e.tids)

    def missing(self, key: Hashable) -> list[Component]:
        """Components not landed: ended without landing, then still in flight."""
        e = self._entries.get(key)
        return [] if e is None else e.unlanded + list(e.tids)

    def view(self, key: Hashable) -> ImportView | None:
        e = self._entries.get(key)
        if e is None:
            return None
        return ImportView(request=e.request, generation=e.generation, state=e.state, in_flight=tuple(e.tids),
                          unlanded=tuple(e.unlanded), drained=frozenset(e.drained), failed=dict(e.failed),
                          failure=e.failure, deadline=e.deadline)

    # ------------------------------------------------------------ the engine
    def open(self, key: Hashable, *, request: RequestId, tids: Mapping[Component, TransferId], writers: int) -> int:
        """Track the import ``tids`` (one posted inbound transfer per component) of ``request`` under ``key``,
        written by ``writers`` writers. Returns its generation (echoed by writers' messages). ValueError if the
        key has an import still open or not yet released."""
        if not isinstance(writers, int) or writers < 1:
            raise ValueError(f"writers = {writers!r} for import {key!r}; expected a positive int")
        old = self._entries.get(key)
        if old is not None:
            if old.state is ImportState.OPEN or not old.released:
                raise ValueError(f"import {key!r} is still {old.state.value} (generation {old.generation}); "
                                 "expected a key whose previous import ended and was released")
            del self._entries[key]
        generation = self._next_generation
        self._next_generation += 1
        e = _Entry(request=request, generation=generation, writers=writers, tids=dict(tids))
        self._entries[key] = e
        if not e.tids:
            e.state = ImportState.LANDED
        return generation

    def fail(self, key: Hashable, reason: str, *, generation: int | None = None) -> bool:
        """The import failed here (the engine aborted it, a node was lost, a writer failed): the drain deadline
        starts now if it has not. Nothing ends: a writer may still be writing. True if the key is known."""
        e = self._get(key, generation)
        if e is None:
            return False
        if e.failure is None:
            e.failure = reason
        if e.deadline is None and e.state is ImportState.OPEN:
            e.deadline = self.clock() + self.drain_timeout_s
        return True

    def release(self, key: Hashable) -> bool:
        """The engine let go of the request (its blocks went back to the scheduler). The entry goes once it is
        terminal; while open, its deadline runs (a released import has failed, if it had not landed). True if
        the entry is gone now."""
        e = self._entries.get(key)
        if e is None:
            return True
        e.released = True
        if e.state is ImportState.OPEN:
            self.fail(key, "released by the engine before it ended")
            return False
        del self._entries[key]
        return True

    def settle(self, key: Hashable, reason: str) -> bool:
        """The engine knows no writer can write (nothing was published to any, or every writer reported its
        whole transfer complete): the open transfers end failed now. True if it became terminal here."""
        e = self._entries.get(key)
        if e is None or e.state is not ImportState.OPEN:
            return False
        if e.failure is None:
            e.failure = reason
        self._end(key, e, ImportState.SETTLED)
        return True

    def expire(self, now: float | None = None) -> list[Hashable]:
        """End every open import whose drain deadline passed; their keys."""
        now = self.clock() if now is None else now
        due = [k for k, e in self._entries.items()
               if e.state is ImportState.OPEN and e.deadline is not None and now >= e.deadline]
        for k in due:
            self._end(k, self._entries[k], ImportState.EXPIRED)
        return due

    def check_deadline(self, key: Hashable) -> bool:
        """:meth:`expire` of one import: True if it ended here."""
        e = self._entries.get(key)
        if e is None or e.state is not ImportState.OPEN or e.deadline is None or self.clock() < e.deadline:
            return False
        self._end(key, e, ImportState.EXPIRED)
        return True

    # ------------------------------------------------------------ what writers say
    def landed(self, key: Hashable, writer: Writer, components: Iterable[Component], *,
               generation: int | None = None) -> list[Component]:
        """``writer`` finished writing these components. A component lands once every writer said so. Returns
        the components that landed with this call."""
        e = self._get(key, generation)
        if e is None:
            return []
        out = []
        for comp in components:
            tid = e.tids.get(comp)
            if tid is None:
                continue
            seen = e.landed_from.setdefault(comp, set())
            seen.add(writer)
            if len(seen) >= e.writers:
                del e.tids[comp]
                self.sched.transfer_landed(tid)
                out.append(comp)
        if not e.tids and e.state is ImportState.OPEN:
            e.state = ImportState.LANDED
            self._forget_if_released(key, e)
        return out

    def drained(self, key: Hashable, writer: Writer, *, generation: int | None = None) -> bool:
        """``writer`` will write nothing more into the import's blocks (it said so after its last WRITE ended).
        True if the import became terminal: every writer drained."""
        e = self._get(key, generation)
        if e is None:
            return False
        e.drained.add(writer)
        e.failed.pop(writer, None)
        if e.state is ImportState.OPEN and len(e.drained) >= e.writers:
            self._end(key, e, ImportState.DRAINED)
            return True
        return False

    def writer_failed(self, key: Hashable, writer: Writer, reason: str, *, generation: int | None = None) -> bool:
        """``writer`` failed the request. Not drained: the import fails and its drain deadline starts, its
        transfers stay open. True if the key is known."""
        e = self._get(key, generation)
        if e is None:
            return False
        if writer not in e.drained:
            e.failed.setdefault(writer, reason)
        return self.fail(key, reason)

    # ------------------------------------------------------------ internals
    def _get(self, key: Hashable, generation: int | None) -> _Entry | None:
        e = self._entries.get(key)
        if e is None or (generation is not None and generation != e.generation):
            return None
        return e

    def _end(self, key: Hashable, e: _Entry, state: ImportState) -> None:
        sched = self.sched
        for comp, tid in e.tids.items():
            sched.transfer_failed(tid)
            e.unlanded.append(comp)
        e.tids.clear()
        e.state = state
        self._forget_if_released(key, e)

    def _forget_if_released(self, key: Hashable, e: _Entry) -> None:
        if e.released and self._entries.get(key) is e:
            del self._entries[key]


__all__ = ["ImportLedger", "ImportState", "ImportView", "Writer"]
