"""A producer that computed another token range than decode loads: the load is refused, never shifted.

The prefill instance computed fewer prompt tokens than the decode instance schedules (another chat
template, tokenizer or lookahead setting on one side). Loading anyway would pair decode's range with
the tail of the producer's blocks, shifted by the difference, and load the GDN state of another
position; those blocks would then enter decode's prefix cache as this prompt's. The scheduler half
checks ``remote_num_tokens`` against what decode loads and refuses: the real worker half reports the
load failed, vLLM 0.33.0's real scheduler applies ``kv_load_failure_policy``.
"""

from __future__ import annotations

import pytest

from tests.vllm import harness as h
from tests.vllm.test_scheduler_flows import GROUPS, assert_all_returned

PROMPT = 200
LOADED = PROMPT - 1  # GDN: decode computes the last prompt token itself


def _decode(policy: str, *, worker: str):
    vc = h.make_vllm_config(role="kv_consumer", async_scheduling=True, policy=policy)
    kcc = h.make_kv_cache_config(vc)
    if worker == "real":
        return h.real_decode(vc, kcc, async_scheduling=True)
    sched, runner = h.make_scheduler(vc, kcc, async_scheduling=True), h.StandInWorker()
    return sched, None, runner, h.Driver(sched, runner, async_scheduling=True)


def _params(rid: str, num_tokens: int) -> dict:
    return {**h.remote_prefill_params(rid, groups=GROUPS, blocks_per_group=LOADED // 32 + 1),
            "remote_num_tokens": num_tokens}


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("short_by", [40, -40], ids=["short", "long"])
def test_a_load_of_another_token_range_is_refused(policy, short_by):
    from vllm.v1.engine import FinishReason

    sched, conn, runner, d = _decode(policy, worker="real")
    try:
        req = h.make_request("r1", prompt_len=PROMPT, max_tokens=3, params=_params("r1", LOADED - short_by))
        sched.add_request(req)
        hashes = list(req.block_hashes)  # what vLLM would cache this prompt's blocks under
        d.run()
        assert not runner.orders, "a load was ordered for a token range the producer did not compute"
        assert "r1" in conn.worker.load_errors and "remote_num_tokens" in conn.worker.load_errors["r1"]
        reason, _ = d.finished["r1"]
        if policy == "fail":
            assert reason is FinishReason.ERROR
            # Nothing of it entered decode's prefix cache.
            pool = sched.kv_cache_manager.block_pool
            assert hashes and not any(pool.get_cached_block(x, list(range(GROUPS))) for x in hashes)
        else:
            assert reason is FinishReason.LENGTH  # the whole prompt computed here instead
        # The producer is told at once that its export will not be read.
        half = sched.connector.scheduler
        assert not half.loads._intents and not half.loads._refused
        assert_all_returned(sched, d)
    finally:
        conn.shutdown()


def test_the_range_the_producer_computed_is_loaded():
    sched, _, worker, d = _decode("fail", worker="stand-in")
    sched.add_request(h.make_request("r1", prompt_len=PROMPT, max_tokens=3, params=_params("r1", LOADED)))
    d.run()
    assert [rid for _, rid in worker.orders] == ["r1"]
    assert_all_returned(sched, d)
