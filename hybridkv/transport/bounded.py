"""Transfers bounded in time: settled by a deadline, aborted past it, kept where NIXL will not abort them.

One rule for both directions (docs/design.md, rule 5): a transfer still running at its deadline (a
timeout, or the lease of the blocks it reads or writes) may still move bytes into or out of its blocks, so
it is kept, with whatever its owner must not free before it ends (quarantined blocks, an open import or
export), until NIXL ends it. (:meth:`DataPlane.abort` releases only handles that ended: NIXL's release of a
running one returns, yet its bytes still land.) The owner decides what fails and tells
its peer; this module holds the waiting, the abort split and the kept transfers.

Used by the SGLang prefill's WRITEs (a worker thread waits: :func:`settle`; the control thread reaps:
:class:`Unabortable`). The consumer's READs (:mod:`hybridkv.transport.fetch`) take the same steps
(:func:`abort_or_keep`, :func:`ended`) and wait on its event loop instead of a thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from hybridkv.transport.dataplane import DataPlane, Transfer, XferState

K = TypeVar("K", bound=Hashable)
P = TypeVar("P")


@dataclass(frozen=True, kw_only=True)
class Settled:
    """What :func:`settle` saw: how many ended in error, and which were still running at the deadline."""

    errors: int
    running: tuple[Transfer, ...]


def settle(dp: DataPlane, xfers: Sequence[Transfer], deadline: float, poll_s: float) -> Settled:
    """Wait (this thread, polling every ``poll_s``) until none of ``xfers`` is in progress or the
    ``time.monotonic()`` deadline passed."""
    pending = list(xfers)
    errors = 0
    while pending:
        still = []
        for x in pending:
            s = dp.state(x)
            if s is XferState.IN_PROGRESS:
                still.append(x)
            elif s is XferState.ERROR:
                errors += 1
        pending = still
        if pending:
            if time.monotonic() > deadline:
                return Settled(errors=errors, running=tuple(pending))
            time.sleep(poll_s)
    return Settled(errors=errors, running=())


def abort_or_keep(dp: DataPlane, xfers: Sequence[Transfer], running: Sequence[Transfer]) -> list[Transfer]:
    """Past the deadline: abort the ``running`` ones (ended since the deadline: released) and release every
    other one of ``xfers``. Returns those still running: they may still move bytes, so their blocks stay out
    of reuse until they end."""
    kept = [x for x in running if not dp.abort(x)]
    for x in xfers:
        if not any(x is r for r in running):
            dp.release(x)
    return kept


def ended(dp: DataPlane, xfers: Sequence[Transfer]) -> bool:
    """None of ``xfers`` is in progress any more."""
    return not any(dp.state(x) is XferState.IN_PROGRESS for x in xfers)


@dataclass(frozen=True, kw_only=True)
class _Kept(Generic[P]):
    transfers: tuple[Transfer, ...]
    payload: P


class Unabortable(Generic[K, P]):
    """Transfers NIXL would not abort, by key (a transfer id), each with its owner's ``payload`` (what it
    frees once they end). Thread-safe under the owner's ``lock`` (reentrant: the owner may hold it)."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._kept: dict[K, _Kept[P]] = {}

    def keep(self, key: K, transfers: Sequence[Transfer], payload: P) -> None:
        with self._lock:
            self._kept[key] = _Kept(transfers=tuple(transfers), payload=payload)

    def __len__(self) -> int:
        return len(self._kept)

    def payloads(self) -> list[P]:
        with self._lock:
            return [k.payload for k in self._kept.values()]

    def reap(self, dp: DataPlane, end: Callable[[K, P], None]) -> list[P]:
        """Release the transfers of every entry none of whose transfers runs any more, and drop it; ``end``
        runs for each under the lock as it is dropped (the owner frees what it held). Returns their payloads
        in the order they were kept. States are read outside the lock (NIXL calls)."""
        if not self._kept:
            return []
        with self._lock:
            items = list(self._kept.items())
        out = []
        for key, kept in items:
            if not ended(dp, kept.transfers):
                continue
            for x in kept.transfers:
                dp.release(x)
            with self._lock:
                self._kept.pop(key, None)
                end(key, kept.payload)
            out.append(kept.payload)
        return out


__all__ = ["Settled", "Unabortable", "abort_or_keep", "ended", "settle"]
