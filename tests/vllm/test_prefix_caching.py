"""Prefix caching with the real vLLM 0.33.0 scheduler: what hybridkv supports, and what it refuses.

vLLM 0.33 turns prefix caching on a Mamba/GDN model into ``mamba_cache_mode='align'``
(per-block state checkpoints, cached and shared); hybridkv moves one running-state slot per
GDN group, so the connector refuses that configuration at start-up, naming it, instead of
failing on a request. Blocks shared by several finished requests (rule 7) never crash the
engine: an export is a read hold, and a block goes back to vLLM only after its last holder.
"""

from __future__ import annotations

import pytest

from tests.vllm import harness as h


def test_prefix_caching_on_a_hybrid_model_is_refused_at_start_up_naming_it():
    vc = h.make_vllm_config(role="kv_producer", prefix_caching=True)
    assert vc.cache_config.mamba_cache_mode == "align"  # vLLM's own choice for prefix caching
    kcc = h.make_kv_cache_config(vc)
    with pytest.raises(ValueError, match=r"prefix caching on a model with Mamba/GDN layers.*mamba_cache_mode='align'"):
        h.make_scheduler(vc, kcc, async_scheduling=False)


def test_requests_that_share_a_block_export_it_under_counted_holds():
    """The issue's crash: two finished requests whose exports name one block (a cached prefix)."""
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from connectors.vllm.metadata import HybridKVWorkerMetadata

    vc = h.make_vllm_config(role="kv_producer")
    kcc = h.make_kv_cache_config(vc)
    sched = h.make_scheduler(vc, kcc, async_scheduling=False)
    half = sched.connector.scheduler
    groups = len(kcc.kv_cache_groups)
    (att,) = [g for g in half.transfer_groups if g not in half._mamba_spec_blocks]
    reqs = []
    for rid, own in (("a", 5), ("b", 6)):
        r = h.make_request(rid, prompt_len=40, max_tokens=1, params={"do_remote_decode": True})
        r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        r.num_computed_tokens = 40
        ids = [[] for _ in range(groups)]
        for g in half.transfer_groups:
            ids[g] = [4, own] if g == att else [10 * own + g]  # block 4: the shared prefix
        delay, params = half.request_finished(r, tuple(ids))
        assert delay and params is not None
        reqs.append(r)
    assert half.ts.holders(att, 4) == ("a", "b")
    half.build_connector_meta(type("SO", (), {"num_scheduled_tokens": {}})())
    half.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=HybridKVWorkerMetadata(step=0)))
    out = KVConnectorOutput(finished_sending={"a"}, kv_connector_worker_meta=HybridKVWorkerMetadata(step=0))
    half.update_connector_output(out)
    # a's read is done, but block 4 is b's too: vLLM hears of a once b lets it go as well.
    assert half.ts.holders(att, 4) == ("b",) and "a" not in (out.finished_sending or ())
    out = KVConnectorOutput(finished_sending={"b"}, kv_connector_worker_meta=HybridKVWorkerMetadata(step=0))
    half.update_connector_output(out)
    assert out.finished_sending == {"a", "b"}
    assert half.idle()
