"""HybridKVConnector's metrics, read back through vLLM 0.33.0's own stats path, with real transfers.

A prefill instance runs in its own process (serving_peer.py); this process is the
decode instance. Both: vLLM's real Scheduler with ``log_stats`` on, the connector's
halves from vLLM's factory, NIXL (UCX) moving the bytes. What the workers and the
scheduler half count reaches vLLM as ``KVConnectorOutput.kv_connector_stats`` /
``get_kv_connector_stats``, leaves ``update_from_output`` in ``SchedulerStats``, and
is read here the way vLLM's front end reads it: ``PrometheusStatLogger`` (the
``vllm:hybridkv_*`` series) and ``LoggingStatLogger`` (the periodic log line).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ports import free_ports

from tests.vllm import harness as h

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 8.0  # a loaded 2-core machine may take seconds between the prefill and the decode asking


class Peer:
    def __init__(self, tmp: Path) -> None:
        self.port = free_ports()
        self.log = open(tmp / "serving_peer.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm.serving_peer", str(self.port), str(LEASE_S)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert self.read(120)["ready"] == self.port

    def read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serving peer exited with {self.proc.returncode}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith("{"):
                    return json.loads(line)
        raise AssertionError(f"no answer from the serving peer in {timeout} s")

    def ask(self, cmd: dict, timeout: float = 60) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    p = Peer(tmp_path_factory.mktemp("peer"))
    try:
        yield p
    finally:
        p.close()


def decode(policy: str = "fail", *, async_scheduling: bool = True):
    vc = h.make_vllm_config(role="kv_consumer", async_scheduling=async_scheduling, policy=policy,
                            engine_id="decode-engine")
    kcc = h.make_kv_cache_config(vc)
    return vc, kcc, *h.real_decode(vc, kcc, async_scheduling=async_scheduling, log_stats=True)


def through_vllm(vc, scheduler_stats):
    """vLLM's front-end loggers fed the engine's SchedulerStats: (Prometheus reader, interval summary)."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger

    prom = PrometheusStatLogger(vc)  # unregisters earlier vllm:* collectors first
    logger = LoggingStatLogger(vc)
    for st in scheduler_stats:
        prom.record(st, None)
        logger.record(st, None)
    labels = {"model_name": str(vc.model_config.served_model_name), "engine": "0"}
    acc = logger.kv_connector_logging.transfer_stats_accumulator

    def sample(name: str, **extra) -> float:
        v = REGISTRY.get_sample_value(name, {**labels, **extra})
        return 0.0 if v is None else v

    return sample, (acc.reduce() if acc is not None else {})


def failures(sample) -> dict[str, float]:
    from hybridkv.transport.metrics import FailureKind

    return {k.value: sample("vllm:hybridkv_num_failed_transfers_total", kind=k.value) for k in FailureKind}


@pytest.mark.slow
def test_a_real_load_and_a_lapsed_lease_read_back_through_vllm_stats(peer):
    from vllm.v1.engine import FinishReason

    from hybridkv.connectors.vllm.connector import HybridKVConnector
    from hybridkv.connectors.vllm.stats import HybridKVConnectorStats

    vc, kcc, sched, conn, runner, d = decode()
    try:
        params = peer.ask({"rid": "m1", "prompt_len": 100})["params"]
        sched.add_request(h.make_request("d1", prompt_len=100, max_tokens=4, params=params))
        d.run_for(60, until=lambda: "d1" in d.finished)
        assert d.finished["d1"][0] is FinishReason.LENGTH and not runner.failed
        d.run_for(10, until=lambda: h.free_blocks(sched) == kcc.num_blocks - 1)
        d.drain()
        result = conn.worker.load_results["d1"]
        assert result.nbytes > 0 and result.descriptors > 0

        sample, summary = through_vllm(vc, d.scheduler_stats)
        assert sample("vllm:hybridkv_xfer_time_seconds_count") == 1
        assert 0 < sample("vllm:hybridkv_xfer_time_seconds_sum") <= result.seconds + 1e-9
        assert sample("vllm:hybridkv_bytes_transferred_count") == 1
        assert sample("vllm:hybridkv_bytes_transferred_sum") == result.nbytes
        assert sample("vllm:hybridkv_num_descriptors_sum") == result.descriptors
        assert sample("vllm:hybridkv_fence_wait_steps_count") == 1  # the one load, from the scheduler half
        assert not any(failures(sample).values())
        assert sample("vllm:hybridkv_quarantined_blocks_total") == 0
        assert summary["Num successful transfers"] == 1 and summary["Num failed transfers"] == 0
        assert summary["Avg number of descriptors"] == result.descriptors
        assert summary["Avg MB per transfer"] == round(result.nbytes / 2**20, 3)

        # Prefill side: an export nobody reads lapses after its lease, on the producer's worker.
        peer.ask({"rid": "m2", "prompt_len": 40})
        assert peer.ask({"wait_freed": 4 * LEASE_S + 10}, timeout=4 * LEASE_S + 40)["freed"]
        payloads = peer.ask({"stats": True})["stats"]
        assert payloads
        merged = HybridKVConnector.build_kv_connector_stats(payloads[0])
        for p in payloads[1:]:
            merged = merged.aggregate(HybridKVConnector.build_kv_connector_stats(p))
        assert isinstance(merged, HybridKVConnectorStats)
        snap = merged.snapshot
        assert snap.lease_expiries == 1  # m2; m1 was read in time
        assert snap.transfers == 0  # pull: the decode side posts and counts the READ
        assert not snap.failures
    finally:
        conn.shutdown()


@pytest.mark.slow
def test_unabortable_stuck_read_keeps_blocks_until_it_ends_faked_stuck_read(peer, monkeypatch):
    """NIXL will not abort a READ that is still running (faked: the decode side's data plane
    reports it in progress and refuses the abort, the one fault a real NIXL will not give on
    demand). vLLM must not hear the load finished while it may still write the blocks."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

    from hybridkv.connectors.vllm.worker_half import WorkerHalf
    from hybridkv.transport.dataplane import DataPlane, XferState

    stuck = {"on": True}
    real_state, real_abort, real_config = DataPlane.state, DataPlane.abort, WorkerHalf._config
    monkeypatch.setattr(DataPlane, "state",
                        lambda self, x: XferState.IN_PROGRESS if stuck["on"] else real_state(self, x))
    # the fetch's wait polls through DataPlane.poller: stuck there too
    monkeypatch.setattr(DataPlane, "poller", lambda self, x: lambda: self.state(x))
    monkeypatch.setattr(DataPlane, "abort", lambda self, x: False if stuck["on"] else real_abort(self, x))
    monkeypatch.setattr(WorkerHalf, "_config",
                        lambda self, port=0: dataclasses.replace(real_config(self, port), transfer_timeout_s=1.0))

    vc, kcc, sched, conn, runner, d = decode("recompute", async_scheduling=False)
    try:
        params = peer.ask({"rid": "s1", "prompt_len": 100})["params"]
        sched.add_request(h.make_request("d2", prompt_len=100, max_tokens=2, params=params))
        d.run_for(30, until=lambda: conn.worker._consumer is not None and conn.worker._consumer.settling("s1"))
        # The READ was given up (past its timeout) but may still write: for a while nothing changes.
        held = kcc.num_blocks - 1 - h.free_blocks(sched)
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            d.step()
            time.sleep(0.01)
        assert "d2" not in d.finished and "d2" not in runner.failed
        assert sched.requests["d2"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
        assert kcc.num_blocks - 1 - h.free_blocks(sched) == held > 0

        stuck["on"] = False  # the READ ends
        d.run_for(30, until=lambda: "d2" in d.finished)
        assert runner.failed == {"d2"}
        assert d.finished["d2"][0] is FinishReason.LENGTH  # recomputed locally, after the READ ended
        d.run_for(10, until=lambda: h.free_blocks(sched) == kcc.num_blocks - 1)
        d.drain()
        assert sched.connector.scheduler.idle()

        sample, summary = through_vllm(vc, d.scheduler_stats)
        assert failures(sample)["timeout"] == 1 and sum(failures(sample).values()) == 1
        quarantined = sample("vllm:hybridkv_quarantined_blocks_total")
        assert quarantined == sum(len(b) for b in runner.order_blocks["d2"]) > 0
        assert sample("vllm:hybridkv_quarantine_released_blocks_total") == quarantined
        assert sample("vllm:hybridkv_quarantined_blocks_current") == 0
        assert summary["Failed (timeout)"] == 1 and summary["Quarantined blocks"] == quarantined
        assert peer.ask({"wait_freed": 20}, timeout=60)["freed"]
    finally:
        stuck["on"] = False
        conn.shutdown()

