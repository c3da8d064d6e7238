"""HybridKVConnectorStats through vLLM 0.33.0's aggregation: workers (KVOutputAggregator), the
scheduler's own (joined in update_from_output), the logger's interval accumulator, and
pickling between processes; plus the worker's bounded load results."""

from __future__ import annotations

import pickle

import pytest

from tests.vllm import harness as h


def stats(**kw):
    from hybridkv.connectors.vllm.stats import HybridKVConnectorStats
    from hybridkv.transport.metrics import TransferMetrics

    m = TransferMetrics()
    for nbytes, descs, secs in kw.get("transfers", ()):
        m.transfer(nbytes=nbytes, descriptors=descs, seconds=secs, post_seconds=secs / 10)
    for kind in kw.get("failures", ()):
        m.failure(kind)
    for steps in kw.get("waits", ()):
        m.fence_wait(steps)
    for _ in range(kw.get("expiries", 0)):
        m.lease_expired()
    m.quarantined(kw.get("quarantined", 0))
    return HybridKVConnectorStats.of(m.take())


def output(st):
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    return ModelRunnerOutput(req_ids=[], req_id_to_index={},
                             kv_connector_output=KVConnectorOutput(kv_connector_stats=st))


def test_two_workers_and_the_scheduler_aggregate_as_vllm_does():
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    from hybridkv.connectors.vllm.connector import HybridKVConnector
    from hybridkv.transport.metrics import FailureKind

    w0 = stats(transfers=[(1000, 2, 0.01)], failures=[FailureKind.TIMEOUT], quarantined=3)
    w1 = stats(transfers=[(3000, 4, 0.03)], expiries=1)
    # Between processes the stats travel pickled (the executor's output), as plain data.
    w1 = pickle.loads(pickle.dumps(w1))
    agg = KVOutputAggregator(expected_finished_count=2).aggregate([output(w0), output(w1)])
    worker_stats = agg.kv_connector_output.kv_connector_stats
    sched_stats = stats(waits=[0, 3])
    assert not sched_stats.is_empty()
    joined = worker_stats.aggregate(sched_stats)  # Scheduler.update_from_output
    s = joined.snapshot
    assert s.bytes == (1000, 3000) and s.descriptors == (2, 4) and s.fence_wait_steps == (0, 3)
    assert s.failures == {FailureKind.TIMEOUT: 1} and s.lease_expiries == 1 and s.quarantined_blocks == 3

    vc = h.make_vllm_config(role="kv_consumer")
    logging_ = KVConnectorLogging(vc.kv_transfer_config)
    logging_.observe(joined.to_dict())  # SchedulerStats carries the dict; the logger rebuilds it
    logging_.observe(stats(transfers=[(2000, 6, 0.02)]).to_dict())
    lines = []
    logging_.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
    [line] = lines
    assert "Num successful transfers=3" in line and "Avg number of descriptors=4.0" in line
    assert "Failed (timeout)=1" in line and "Num KV expired reqs=1" in line and "Max fence wait (steps)=3" in line
    assert isinstance(HybridKVConnector.build_kv_connector_stats(None), type(joined))


def test_a_bad_payload_is_refused_naming_it():
    from hybridkv.connectors.vllm.stats import HybridKVConnectorStats

    with pytest.raises(ValueError, match="unknown key"):
        HybridKVConnectorStats({"transfer_duration": [1.0]})  # NixlKVConnectorStats' payload
    with pytest.raises(ValueError, match="failure kind 'disk'"):
        HybridKVConnectorStats({"failures": {"disk": 1}})
    with pytest.raises(ValueError, match="equal lengths"):
        HybridKVConnectorStats({"bytes": [1], "transfer_seconds": []})


def test_load_results_keep_only_the_latest():
    from hybridkv.connectors.vllm.worker_half import LOAD_RESULTS_KEPT

    vc = h.make_vllm_config(role="kv_consumer", engine_id="decode-engine")
    kcc = h.make_kv_cache_config(vc)
    conn, _ = h.make_worker(vc, kcc)
    try:
        results = conn.worker.load_results
        for i in range(LOAD_RESULTS_KEPT + 10):
            results[f"r{i}"] = i  # the worker writes one per load, for as long as it serves
        assert len(results) == LOAD_RESULTS_KEPT
        assert "r0" not in results and results[f"r{LOAD_RESULTS_KEPT + 9}"] == LOAD_RESULTS_KEPT + 9
    finally:
        conn.shutdown()
