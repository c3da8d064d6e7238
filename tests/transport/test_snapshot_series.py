"""observe_snapshot: the one loop that feeds a MetricsSnapshot into a connector's series (vLLM's and SGLang's)."""

from __future__ import annotations

from hybridkv.transport.metrics import FailureKind, TransferMetrics
from hybridkv.transport.snapshot_series import SnapshotSeries, observe_snapshot


def series(calls: list, *, post: bool = True, waits: bool = True) -> SnapshotSeries:
    def rec(name):
        return lambda *a: calls.append((name, *a))

    return SnapshotSeries(transfer_seconds=rec("secs"), bytes=rec("bytes"), descriptors=rec("descs"),
                          failures=rec("failed"), lease_expiries=rec("expired"), quarantine=rec("quarantine"),
                          post_seconds=rec("post") if post else None, fence_wait_steps=rec("wait") if waits else None)


def test_every_figure_goes_to_its_series_once():
    m = TransferMetrics()
    m.transfer(nbytes=100, descriptors=2, seconds=0.5, post_seconds=0.1)
    m.transfer(nbytes=300, descriptors=4, seconds=0.25, post_seconds=0.2)
    m.failure(FailureKind.TIMEOUT)
    m.failure(FailureKind.TIMEOUT)
    m.lease_expired()
    m.fence_wait(3)
    m.quarantined(5)
    m.quarantine_released(2)
    calls: list = []
    observe_snapshot(m.take(), series(calls))
    assert calls == [("secs", 0.5), ("post", 0.1), ("bytes", 100), ("descs", 2),
                     ("secs", 0.25), ("post", 0.2), ("bytes", 300), ("descs", 4),
                     ("failed", FailureKind.TIMEOUT, 2), ("expired", 1), ("wait", 3), ("quarantine", 5, 2)]


def test_nothing_counted_touches_nothing_and_absent_series_are_skipped():
    calls: list = []
    observe_snapshot(TransferMetrics().take(), series(calls))
    assert calls == []  # no zero increments: a series that never moved stays unborn in Prometheus
    m = TransferMetrics()
    m.transfer(nbytes=1, descriptors=1, seconds=1.0, post_seconds=0.5)
    m.fence_wait(0)
    m.quarantine_released(1)  # released only (quarantined in an earlier interval) still reaches the series
    observe_snapshot(m.take(), series(calls, post=False, waits=False))  # SGLang's: no post or fence series
    assert calls == [("secs", 1.0), ("bytes", 1), ("descs", 1), ("quarantine", 0, 1)]
