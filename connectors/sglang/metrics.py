"""The hybridkv backend's metrics in SGLang's conventions.

SGLang's own transfer metrics stay as they are: the sender's ``get_transfer_metric()``
(a ``KVTransferMetric``: latency, and here the bytes hybridkv actually wrote for the
room) feeds ``sglang:kv_transfer_latency_ms`` / ``kv_transfer_total_mb`` /
``kv_transfer_speed_gb_s`` in the prefill scheduler, and a failed room counts in
``sglang:num_transfer_failed_reqs_total``. What SGLang has no series for (descriptors,
failures by kind, quarantined pages, lease expiries) is registered here as
``sglang:hybridkv_*``, with labels of SGLang's scheduler metrics, in the process's
Prometheus registry (SGLang's ``/metrics`` serves it with ``--enable-metrics``). The figures are hybridkv's own
(:mod:`hybridkv.transport.metrics`), counted by the manager's threads; the manager's
control thread observes them here, through the loop every connector shares
(:mod:`hybridkv.transport.snapshot_series`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

from hybridkv.transport.metrics import FailureKind, MetricsSnapshot
from hybridkv.transport.snapshot_series import SnapshotSeries, observe_snapshot

logger = logging.getLogger(__name__)


#: The labels of SGLang's scheduler metrics this backend's series carry (tp_rank: the TP rank, as SGLang's
#: scheduler labels it, so every DP-attention rank has its own series; dp_rank: the replica's, "" for none).
LABELS = ("model_name", "engine_type", "tp_rank", "dp_rank")


@functools.cache
def _collectors() -> dict:
    """One set per process (a process may build several managers: tests, a role switch)."""
    from prometheus_client import Counter, Gauge, Histogram

    names = list(LABELS)
    return {
        "latency": Histogram(
            name="sglang:hybridkv_transfer_latency_ms",
            documentation="Histogram of hybridkv chunk transfer latency (post to every WRITE done) in ms.",
            labelnames=names, buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)),
        "mb": Histogram(
            name="sglang:hybridkv_transfer_mb",
            documentation="Histogram of bytes written per hybridkv chunk transfer, in MB.",
            labelnames=names, buckets=(0.1, 1, 5, 10, 50, 100, 500, 1000, 5000, 10000)),
        "descriptors": Histogram(
            name="sglang:hybridkv_num_descriptors",
            documentation="Histogram of NIXL descriptors posted per hybridkv chunk transfer.",
            labelnames=names, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1000, 4000, 20000)),
        "failed": Counter(
            name="sglang:hybridkv_transfer_failed",
            documentation="Failed hybridkv transfers by kind (transfer, timeout, incomplete, fenced, ...).",
            labelnames=[*names, "kind"]),
        "expired": Counter(
            name="sglang:hybridkv_lease_expired",
            documentation="Prefill exports whose lease lapsed (no chunk, no heartbeat) before they ended.",
            labelnames=names),
        "quarantined": Counter(
            name="sglang:hybridkv_quarantined_pages",
            documentation="Pages and slots kept out of reuse because a write into or out of them could not "
                          "be stopped.", labelnames=names),
        "released": Counter(
            name="sglang:hybridkv_quarantine_released_pages",
            documentation="Quarantined pages and slots whose write has since ended.", labelnames=names),
        "now": Gauge(
            name="sglang:hybridkv_quarantined_pages_current",
            documentation="Pages and slots in quarantine now.", labelnames=names, multiprocess_mode="livesum"),
    }


class HybridKVSGLangMetrics:
    """The ``sglang:hybridkv_*`` series of one manager (one rank of one engine)."""

    def __init__(self, labels: Mapping[str, object]) -> None:
        if set(labels) != set(LABELS):
            raise ValueError(f"metric labels {sorted(labels)}; expected {sorted(LABELS)}")
        self.labels = {k: str(v) for k, v in labels.items()}
        c = _collectors()
        self.transfer_latency_ms = c["latency"].labels(**self.labels)
        self.transfer_mb = c["mb"].labels(**self.labels)
        self.descriptors = c["descriptors"].labels(**self.labels)
        self._failed = c["failed"]
        self.lease_expired = c["expired"].labels(**self.labels)
        self.quarantined = c["quarantined"].labels(**self.labels)
        self.released = c["released"].labels(**self.labels)
        self.quarantined_now = c["now"].labels(**self.labels)
        self._series = SnapshotSeries(
            transfer_seconds=lambda secs: self.transfer_latency_ms.observe(secs * 1e3),
            bytes=lambda n: self.transfer_mb.observe(n / 2**20), descriptors=lambda n: self.descriptors.observe(n),
            failures=lambda kind, n: self.failed(kind).inc(n), lease_expiries=lambda n: self.lease_expired.inc(n),
            quarantine=self._quarantine)

    def failed(self, kind: FailureKind):
        return self._failed.labels(**self.labels, kind=kind.value)

    def _quarantine(self, quarantined: int, released: int) -> None:
        self.quarantined.inc(quarantined)
        self.released.inc(released)
        self.quarantined_now.inc(quarantined - released)  # a livesum gauge: each process adds its own

    def observe(self, s: MetricsSnapshot) -> None:
        observe_snapshot(s, self._series)


def metrics_for_engine(*, model_name: object, engine_type: object, tp_rank: int,
                       dp_rank: int | None) -> HybridKVSGLangMetrics | None:
    """A manager's series, labelled as SGLang's scheduler series are: the TP rank, not the attention-TP one
    (every DP-attention group has an attention rank 0), and the replica's DP rank ("": none, as SGLang leaves
    it out); None, said once, without prometheus-client (sglang requires it; a stripped install may lack it)."""
    try:
        return HybridKVSGLangMetrics({"model_name": model_name, "engine_type": engine_type, "tp_rank": tp_rank,
                                      "dp_rank": "" if dp_rank is None else dp_rank})
    except ImportError as e:
        logger.warning("hybridkv: no sglang:hybridkv_* metrics (%s); pip install prometheus-client", e)
        return None


__all__ = ["HybridKVSGLangMetrics", "metrics_for_engine"]
