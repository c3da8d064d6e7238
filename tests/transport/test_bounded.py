"""bounded.py: transfers settled by a deadline, aborted past it, kept until NIXL ends them where it will not abort.

A NIXL handle that hangs, or one NIXL refuses to abort, cannot be caused on one machine: the data plane here
is a fake (`_FakeHangingPlane`), which is all these steps touch (state, abort, release)."""

from __future__ import annotations

import threading
import time

from hybridkv.transport import bounded
from hybridkv.transport.dataplane import Transfer, XferState


class _FakeHangingPlane:
    """Fake: each transfer's state is what the test sets; an abort succeeds only where allowed."""

    def __init__(self) -> None:
        self.states: dict[int, XferState] = {}
        self.abortable: set[int] = set()
        self.released: list[Transfer] = []

    def xfer(self, state: XferState, *, abortable: bool = True) -> Transfer:
        x = Transfer([object()], "peer", 1, 1)
        self.states[id(x)] = state
        if abortable:
            self.abortable.add(id(x))
        return x

    def state(self, x: Transfer) -> XferState:
        return self.states[id(x)]

    def abort(self, x: Transfer) -> bool:
        if id(x) in self.abortable:
            self.released.append(x)
            return True
        return False

    def release(self, x: Transfer) -> None:
        self.released.append(x)


def test_settle_counts_errors_and_returns_what_still_runs_at_the_deadline():
    dp = _FakeHangingPlane()
    done, err, hung = dp.xfer(XferState.DONE), dp.xfer(XferState.ERROR), dp.xfer(XferState.IN_PROGRESS)
    t0 = time.monotonic()
    got = bounded.settle(dp, [done, err, hung], time.monotonic() + 0.05, 0.005)  # type: ignore[arg-type]
    assert got.errors == 1 and got.running == (hung,) and time.monotonic() - t0 < 5
    assert bounded.settle(dp, [done, err], time.monotonic() - 1, 0.005) == bounded.Settled(  # type: ignore[arg-type]
        errors=1, running=())


def test_abort_or_keep_releases_the_ended_aborts_the_running_and_keeps_the_unabortable():
    dp = _FakeHangingPlane()
    ended, aborted = dp.xfer(XferState.DONE), dp.xfer(XferState.IN_PROGRESS)
    stuck = dp.xfer(XferState.IN_PROGRESS, abortable=False)
    kept = bounded.abort_or_keep(dp, [ended, aborted, stuck], [aborted, stuck])  # type: ignore[arg-type]
    assert kept == [stuck]
    assert sorted(map(id, dp.released)) == sorted(map(id, [ended, aborted]))  # never the one still writing


def test_unabortable_is_reaped_only_once_every_transfer_of_it_ended():
    dp = _FakeHangingPlane()
    a, b = dp.xfer(XferState.IN_PROGRESS, abortable=False), dp.xfer(XferState.IN_PROGRESS, abortable=False)
    kept: bounded.Unabortable[int, str] = bounded.Unabortable(threading.RLock())
    kept.keep(7, [a, b], "room 7")
    ends: list = []
    assert kept.reap(dp, lambda k, p: ends.append((k, p))) == [] and len(kept) == 1  # type: ignore[arg-type]
    dp.states[id(a)] = XferState.DONE
    assert kept.reap(dp, lambda k, p: ends.append((k, p))) == [] and dp.released == []  # type: ignore[arg-type]
    dp.states[id(b)] = XferState.ERROR
    assert kept.reap(dp, lambda k, p: ends.append((k, p))) == ["room 7"]  # type: ignore[arg-type]
    assert ends == [(7, "room 7")] and len(kept) == 0 and kept.payloads() == []
    assert sorted(map(id, dp.released)) == sorted(map(id, [a, b]))
