"""HybridKVConnector's metrics in vLLM's conventions: a ``KVConnectorStats`` and Prometheus series.

The figures are hybridkv's own (:mod:`hybridkv.transport.metrics`): every worker's
transport and the scheduler half feed a ``TransferMetrics``; the connector's
``get_kv_connector_stats`` takes a snapshot of it as a :class:`HybridKVConnectorStats`,
and vLLM does the rest exactly as for its NixlConnector (``nixl/stats.py``): the
workers' stats are aggregated by ``KVOutputAggregator``, the scheduler's joined to
them in ``update_from_output``, sent as ``to_dict()`` in ``SchedulerStats``, rebuilt
by ``build_kv_connector_stats`` for the log line (``reduce``) and observed into the
``vllm:hybridkv_*`` series by :class:`HybridKVPromMetrics` (through the loop every connector
shares, :mod:`hybridkv.transport.snapshot_series`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats, PromMetric
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetricT
from vllm.v1.metrics.utils import create_metric_per_engine

from hybridkv.transport.metrics import FailureKind, MetricsSnapshot
from hybridkv.transport.snapshot_series import SnapshotSeries, observe_snapshot


class HybridKVConnectorStats(KVConnectorStats):
    """``data`` is a :meth:`MetricsSnapshot.to_dict` payload: lists per transfer, counts per kind."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        # Checked on the way in: a payload from another process is parsed, not trusted.
        super().__init__(data=MetricsSnapshot.from_dict(data).to_dict() if data else MetricsSnapshot().to_dict())

    @classmethod
    def of(cls, snapshot: MetricsSnapshot) -> HybridKVConnectorStats:
        return cls(snapshot.to_dict())

    @property
    def snapshot(self) -> MetricsSnapshot:
        return MetricsSnapshot.from_dict(self.data)

    def reset(self) -> None:
        self.data = MetricsSnapshot().to_dict()

    def is_empty(self) -> bool:
        return self.snapshot.is_empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, HybridKVConnectorStats):
            raise ValueError(f"cannot aggregate {type(other).__name__}; expected HybridKVConnectorStats")
        if not other.is_empty():
            self.data = self.snapshot.merge(other.snapshot).to_dict()
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for vLLM's periodic log line (NixlKVConnectorStats' keys where they match)."""
        s = self.snapshot
        out: dict[str, int | float] = {"Num successful transfers": s.transfers}
        if s.transfers:
            secs = np.asarray(s.transfer_seconds)
            mb = np.asarray(s.bytes, dtype=np.float64) / 2**20
            total_s = float(secs.sum())
            out.update({
                "Avg xfer time (ms)": round(float(secs.mean()) * 1e3, 3),
                "P90 xfer time (ms)": round(float(np.percentile(secs, 90)) * 1e3, 3),
                "Avg post time (ms)": round(float(np.mean(s.post_seconds)) * 1e3, 3),
                "Avg MB per transfer": round(float(mb.mean()), 3),
                "Throughput (MB/s)": round(float(mb.sum()) / total_s, 3) if total_s > 0 else 0.0,
                "Avg number of descriptors": round(float(np.mean(s.descriptors)), 1),
            })
        out["Num failed transfers"] = s.num_failures
        out.update({f"Failed ({k.value})": n for k, n in sorted(s.failures.items(), key=lambda kv: kv[0].value)})
        out["Num KV expired reqs"] = s.lease_expiries
        if s.fence_wait_steps:
            out["Avg fence wait (steps)"] = round(float(np.mean(s.fence_wait_steps)), 2)
            out["Max fence wait (steps)"] = int(max(s.fence_wait_steps))
        out["Quarantined blocks"] = s.quarantined_blocks
        out["Released quarantined blocks"] = s.released_blocks
        return out


class HybridKVPromMetrics(KVConnectorPromMetrics):
    """The ``vllm:hybridkv_*`` series, named and bucketed as vLLM's ``vllm:nixl_*`` ones where they match."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        hist, counter, gauge = self._histogram_cls, self._counter_cls, self._gauge_cls
        per_engine = self.per_engine_labelvalues

        def each(metric):
            return create_metric_per_engine(metric, per_engine)

        self.xfer_time = each(hist(
            name="vllm:hybridkv_xfer_time_seconds",
            documentation="Histogram of transfer duration (post to done) of hybridkv KV cache transfers.",
            buckets=[0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0], labelnames=labelnames))
        self.post_time = each(hist(
            name="vllm:hybridkv_post_time_seconds",
            documentation="Histogram of descriptor planning and posting time of hybridkv KV cache transfers.",
            buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0],
            labelnames=labelnames))
        self.bytes_hist = each(hist(
            name="vllm:hybridkv_bytes_transferred",
            documentation="Histogram of bytes moved per hybridkv KV cache transfer.",
            buckets=[2 ** (10 + i) for i in range(1, 25, 2)], labelnames=labelnames))
        self.descriptors = each(hist(
            name="vllm:hybridkv_num_descriptors",
            documentation="Histogram of NIXL descriptors posted per hybridkv KV cache transfer.",
            buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 1000, 4000, 20000], labelnames=labelnames))
        # Totals: the histograms' _sum.
        # One series per failure kind, as vLLM labels prompt tokens by source.
        self._failed = counter(
            name="vllm:hybridkv_num_failed_transfers",
            documentation="Failed hybridkv KV cache transfers, by kind (handshake, no_export, refused, peer_lost, "
                          "protocol, lease, transfer, timeout). Lease expiries on the producer are "
                          "counted in vllm:hybridkv_num_kv_expired_reqs.",
            labelnames=[*labelnames, "kind"])
        self.expired = each(counter(
            name="vllm:hybridkv_num_kv_expired_reqs",
            documentation="Exports whose lease lapsed before every reader was done (per prefill worker).",
            labelnames=labelnames))
        self.fence_wait = each(hist(
            name="vllm:hybridkv_fence_wait_steps",
            documentation="Histogram of scheduler steps a load waited for the fence (no in-flight step may "
                          "touch its blocks) before it started.",
            buckets=[0, 1, 2, 4, 8, 16, 32, 64], labelnames=labelnames))
        self.quarantined = each(counter(
            name="vllm:hybridkv_quarantined_blocks",
            documentation="Blocks kept out of reuse because a transfer into or out of them could not be stopped.",
            labelnames=labelnames))
        self.released = each(counter(
            name="vllm:hybridkv_quarantine_released_blocks",
            documentation="Quarantined blocks whose transfer has since ended.", labelnames=labelnames))
        self.quarantined_now = each(gauge(
            name="vllm:hybridkv_quarantined_blocks_current",
            documentation="Blocks in quarantine now (quarantined minus released).",
            multiprocess_mode="mostrecent", labelnames=labelnames))
        self._in_quarantine: dict[int, int] = {}
        self._series: dict[int, SnapshotSeries] = {}  # per engine: where observe() puts a snapshot

    def failed(self, engine_idx: int, kind: FailureKind):
        return self._failed.labels(*self.per_engine_labelvalues[engine_idx], kind.value)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        series = self._series.get(engine_idx)
        if series is None:
            series = self._series[engine_idx] = self._series_of(engine_idx)
        observe_snapshot(MetricsSnapshot.from_dict(transfer_stats_data), series)

    def _series_of(self, i: int) -> SnapshotSeries:
        def quarantine(quarantined: int, released: int) -> None:
            self.quarantined[i].inc(quarantined)
            self.released[i].inc(released)
            now = self._in_quarantine.get(i, 0) + quarantined - released
            self._in_quarantine[i] = now
            self.quarantined_now[i].set(now)  # "mostrecent": this process keeps the total

        return SnapshotSeries(
            transfer_seconds=lambda v: self.xfer_time[i].observe(v), post_seconds=lambda v: self.post_time[i].observe(v),
            bytes=lambda v: self.bytes_hist[i].observe(v), descriptors=lambda v: self.descriptors[i].observe(v),
            failures=lambda kind, n: self.failed(i, kind).inc(n), lease_expiries=lambda n: self.expired[i].inc(n),
            fence_wait_steps=lambda v: self.fence_wait[i].observe(v), quarantine=quarantine)


__all__ = ["HybridKVConnectorStats", "HybridKVPromMetrics"]
