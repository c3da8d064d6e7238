"""Where a :class:`~hybridkv.transport.metrics.MetricsSnapshot`'s figures go: one loop for every connector.

Each connector names its own series in its engine's conventions (vLLM's ``vllm:hybridkv_*`` per engine,
SGLang's ``sglang:hybridkv_*`` per rank, each with its own units and buckets) as a :class:`SnapshotSeries`
of callables; :func:`observe_snapshot` feeds a snapshot into them, so what a snapshot counts, and when a
series is touched at all, is decided here once. No Prometheus import: the callables are the connector's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridkv.transport.metrics import FailureKind, MetricsSnapshot


@dataclass(frozen=True, kw_only=True)
class SnapshotSeries:
    """A connector's series, one callable per figure (it converts units: SGLang's are ms and MB)."""

    transfer_seconds: Callable[[float], object]  # one call per transfer that landed
    bytes: Callable[[int], object]
    descriptors: Callable[[int], object]
    failures: Callable[[FailureKind, int], object]  # per kind that failed, with how many
    lease_expiries: Callable[[int], object]  # only when some lapsed
    #: (quarantined, released) blocks, only when either is non-zero: the connector keeps its own "now"
    #: (a gauge incremented across processes in SGLang, a running total set per engine in vLLM)
    quarantine: Callable[[int, int], object]
    post_seconds: Callable[[float], object] | None = None  # None: the connector has no such series
    fence_wait_steps: Callable[[int], object] | None = None


def observe_snapshot(s: MetricsSnapshot, into: SnapshotSeries) -> None:
    """Feed what ``s`` counted into the connector's series."""
    for secs, post, nbytes, descs in zip(s.transfer_seconds, s.post_seconds, s.bytes, s.descriptors):
        into.transfer_seconds(secs)
        if into.post_seconds is not None:
            into.post_seconds(post)
        into.bytes(nbytes)
        into.descriptors(descs)
    for kind, n in s.failures.items():
        into.failures(kind, n)
    if s.lease_expiries:
        into.lease_expiries(s.lease_expiries)
    if into.fence_wait_steps is not None:
        for steps in s.fence_wait_steps:
            into.fence_wait_steps(steps)
    if s.quarantined_blocks or s.released_blocks:
        into.quarantine(s.quarantined_blocks, s.released_blocks)


__all__ = ["SnapshotSeries", "observe_snapshot"]
