"""The real vLLM 0.33.0 Scheduler and AsyncScheduler, a hybrid KV cache config, and our scheduler half.

Each test ends with every block back in vLLM's pool and nothing left in
hybridkv's books. The model runner and the worker's completion reports are
played by harness.StandInWorker (see harness.py for why).
"""

from __future__ import annotations

import pytest

from tests.vllm import harness as h

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
GROUPS = 4  # 3 GDN groups + 1 attention group (test_factory checks vLLM's grouping)


def setup(*, role: str, async_scheduling: bool, policy: str = "fail", num_blocks: int = 64, extra=None):
    vc = h.make_vllm_config(role=role, async_scheduling=async_scheduling, policy=policy, num_blocks=num_blocks,
                            extra=extra)
    kcc = h.make_kv_cache_config(vc)
    sched = h.make_scheduler(vc, kcc, async_scheduling=async_scheduling)
    worker = h.StandInWorker()
    return sched, worker, h.Driver(sched, worker, async_scheduling=async_scheduling)


def usable(sched) -> int:
    return sched.kv_cache_config.num_blocks - 1  # the null block is never free


def assert_all_returned(sched, driver) -> None:
    driver.drain()
    assert not sched.has_requests()
    assert h.free_blocks(sched) == usable(sched)
    assert sched.connector.scheduler.idle()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_decode_loads_then_runs(async_scheduling):
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

    sched, worker, d = setup(role="kv_consumer", async_scheduling=async_scheduling)
    worker.fates["r1"] = h.LoadFate(after_steps=3)
    sched.add_request(h.make_request("r1", prompt_len=100, max_tokens=4,
                                     params=h.remote_prefill_params("r1", groups=GROUPS)))
    d.run(until=lambda: bool(worker.orders))
    assert sched.requests["r1"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    [(step, rid)] = worker.orders
    assert rid == "r1"
    held = usable(sched) - h.free_blocks(sched)
    assert held == 4 + GROUPS - 1  # 99 tokens loaded: 4 attention blocks + one state block per GDN group
    d.run()
    reason, _ = d.finished["r1"]
    assert reason is FinishReason.LENGTH
    # Race B: vLLM zeroes newly allocated blocks of hybrid models, but never the
    # blocks a load writes (get_loaded_kv_cache_group_ids names every group).
    loaded = worker.order_blocks["r1"]
    assert not any(z & loaded for z in d.zeroed.values())
    # The request computed only the one token the producer left out (h(N-1) -> h(N)).
    assert sched.connector.scheduler.phase("r1") is None
    assert_all_returned(sched, d)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_prefill_exports_and_frees_only_after_the_read(async_scheduling):
    from vllm.v1.engine import FinishReason

    sched, worker, d = setup(role="kv_producer", async_scheduling=async_scheduling)
    worker.consumer_reads = False
    sched.add_request(h.make_request("p1", prompt_len=100, max_tokens=16, params={"do_remote_decode": True}))
    d.run(until=lambda: "p1" in d.finished)
    reason, params = d.finished["p1"]
    assert reason is FinishReason.LENGTH  # max_tokens forced to 1 on the producer
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == "p1"
    assert params["remote_engine_id"] == "engine-test" and params["remote_port"] == 5600
    blocks = params["remote_block_ids"]
    assert len(blocks) == GROUPS and all(len(b) == 1 for b in blocks[:3])
    assert len(blocks[3]) == 4  # 99 of 100 prompt tokens: the decoder recomputes the last one
    held = usable(sched) - h.free_blocks(sched)
    assert held == sum(map(len, blocks))
    for _ in range(6):
        d.step()
    d.drain()
    # Offered to readers once every step that wrote the blocks completed...
    [(offer_step, rid)] = worker.offered
    assert rid == "p1"
    last_touch = max(s for s, reqs in d.touched.items() if "p1" in reqs)
    assert d.completed_at[last_touch] <= offer_step
    # ...and never freed while no consumer has read them.
    assert usable(sched) - h.free_blocks(sched) == held
    worker._reads["p1"] = 1  # the consumer reads now
    d.run()
    assert_all_returned(sched, d)


def test_decode_hosts_bind_the_export_and_a_bad_value_only_skips_that_request():
    """A router that picks the decode first names it (kv_transfer_params ``decode_hosts``): the worker is told to
    bind the capability to it (transport: only a session from there may claim). A client's bad value costs that
    request its export, never the engine, and its blocks come back."""
    sched, worker, d = setup(role="kv_producer", async_scheduling=False)
    sched.add_request(h.make_request("bound", prompt_len=40, max_tokens=1,
                                     params={"do_remote_decode": True, "decode_hosts": ["10.0.0.7", "10.1.0.0/16"]}))
    sched.add_request(h.make_request("open", prompt_len=40, max_tokens=1, params={"do_remote_decode": True}))
    sched.add_request(h.make_request("bad", prompt_len=40, max_tokens=1,
                                     params={"do_remote_decode": True, "decode_hosts": "decode-1.example"}))
    d.run(until=lambda: {"bound", "open", "bad"} <= set(d.finished))
    assert d.finished["bad"][1] is None  # no kv_transfer_params: the decode computes it itself
    assert d.finished["bound"][1]["do_remote_prefill"] and d.finished["open"][1]["do_remote_prefill"]
    d.run()
    assert {rid for _, rid in worker.offered} == {"bound", "open"}
    assert worker.bound == {"bound": ["10.0.0.7", "10.1.0.0/16"]}
    assert_all_returned(sched, d)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_export_lease_lapses_without_a_reader(async_scheduling):
    sched, worker, d = setup(role="kv_producer", async_scheduling=async_scheduling,
                             extra={"kv_lease_duration": 0.2})
    worker.consumer_reads = False
    sched.add_request(h.make_request("p1", prompt_len=40, max_tokens=1, params={"do_remote_decode": True}))
    d.run(until=lambda: "p1" in d.finished)
    assert h.free_blocks(sched) < usable(sched)
    import time

    deadline = time.monotonic() + 10
    while h.free_blocks(sched) < usable(sched) and time.monotonic() < deadline:
        d.step()
        time.sleep(0.05)
    assert_all_returned(sched, d)


def test_export_held_while_the_consumer_renews_its_lease():
    import time

    sched, worker, d = setup(role="kv_producer", async_scheduling=True, extra={"kv_lease_duration": 0.2})
    worker.consumer_reads = False
    sched.add_request(h.make_request("p1", prompt_len=40, max_tokens=1, params={"do_remote_decode": True}))
    d.run(until=lambda: "p1" in d.finished)
    held = usable(sched) - h.free_blocks(sched)
    worker.renewing.add("p1")
    end = time.monotonic() + 1.0  # five leases
    while time.monotonic() < end:
        d.step()
        time.sleep(0.02)
    assert usable(sched) - h.free_blocks(sched) == held
    worker.renewing.clear()  # the consumer went away
    d.run_for(5, until=lambda: h.free_blocks(sched) == usable(sched))
    assert_all_returned(sched, d)


@pytest.mark.parametrize("async_scheduling", MODES)
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_load_honours_the_policy(async_scheduling, policy):
    from vllm.v1.engine import FinishReason

    sched, worker, d = setup(role="kv_consumer", async_scheduling=async_scheduling, policy=policy)
    worker.fates["r1"] = h.LoadFate(after_steps=2, fail=True)
    sched.add_request(h.make_request("r1", prompt_len=100, max_tokens=3,
                                     params=h.remote_prefill_params("r1", groups=GROUPS)))
    d.run()
    reason, _ = d.finished["r1"]
    assert reason is (FinishReason.ERROR if policy == "fail" else FinishReason.LENGTH)
    if policy == "recompute":
        # The whole prompt was recomputed locally: a full prefill was scheduled.
        prefill = [s for s, reqs in d.touched.items() if "r1" in reqs]
        assert prefill, "the request never ran"
    assert_all_returned(sched, d)


def test_unusable_transfer_params_compute_locally():
    from vllm.v1.engine import FinishReason

    sched, worker, d = setup(role="kv_consumer", async_scheduling=False)
    params = h.remote_prefill_params("r1", groups=GROUPS)
    del params["remote_port"]
    sched.add_request(h.make_request("r1", prompt_len=100, max_tokens=2, params=params))
    d.run()
    assert d.finished["r1"][0] is FinishReason.LENGTH and not worker.orders
    assert_all_returned(sched, d)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_abort_in_the_middle_of_a_transfer(async_scheduling):
    from vllm.v1.request import RequestStatus

    sched, worker, d = setup(role="kv_consumer", async_scheduling=async_scheduling)
    worker.fates["r1"] = h.LoadFate(after_steps=4)
    sched.add_request(h.make_request("r1", prompt_len=100, max_tokens=4,
                                     params=h.remote_prefill_params("r1", groups=GROUPS)))
    d.run(until=lambda: bool(worker.orders))
    held = usable(sched) - h.free_blocks(sched)
    assert held > 0
    sched.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    # The load still writes those blocks: they must stay out of the pool until it ends.
    d.step()
    assert usable(sched) - h.free_blocks(sched) == held
    d.run()
    assert_all_returned(sched, d)


def test_import_waits_for_the_step_that_still_touches_a_reused_block(fence_policy_name):
    """Race A. Async scheduling, a vLLM that frees at once (defer_block_free off, as
    before #45357): a local request stops on a token the scheduler could not foresee,
    the step already dispatched after it still runs on its blocks, and vLLM hands
    those blocks to a request that loads remote KV. hybridkv's fence, not vLLM,
    must hold the load back until that step completed. (Fails with --fence-policy none.)"""
    from vllm.v1.engine import FinishReason

    # 12 blocks: room for one of the two requests at a time with prefix caching on (align mode gives
    # every GDN group a slot per block of tokens), so r can only get q's blocks.
    sched, worker, d = setup(role="kv_consumer", async_scheduling=True, num_blocks=12,
                             extra={"hybridkv_fence_policy": fence_policy_name})
    sched.defer_block_free = False
    sched.add_request(h.make_request("q", prompt_len=60, max_tokens=50, stop_on_first=True))
    sched.add_request(h.make_request("r", prompt_len=60, max_tokens=2,
                                     params=h.remote_prefill_params("r", groups=GROUPS)))
    d.run()
    assert d.finished["q"][0] is FinishReason.STOP and d.finished["r"][0] is FinishReason.LENGTH
    [(order_step, rid)] = worker.orders
    assert rid == "r"
    alloc = d.load_alloc_step["r"]
    q_steps = [s for s, reqs in d.touched.items() if reqs.get("q", set()) & worker.order_blocks["r"]]
    # completed_at[s] = schedule() calls made when step s's output was processed;
    # step x is scheduled by call x+1.
    in_flight_at_alloc = [s for s in q_steps if d.completed_at[s] > alloc]
    assert in_flight_at_alloc, "no step touching the reused blocks was in flight: the race was not set up"
    unsafe = [s for s in q_steps if d.completed_at[s] > order_step]
    assert not unsafe, f"load ordered at step {order_step} while steps {unsafe} still touched its blocks"
    # Race B: vLLM zeroed q's fresh blocks (zeroing is on for this hybrid model)
    # but skipped the very same blocks once a load was to write them.
    assert any(z & d.touched[0]["q"] for z in d.zeroed.values())
    assert not any(z & worker.order_blocks["r"] for s, z in d.zeroed.items() if s >= alloc)
    assert_all_returned(sched, d)


def test_abort_while_the_fence_holds_the_load_back():
    from vllm.v1.request import RequestStatus

    sched, worker, d = setup(role="kv_consumer", async_scheduling=True, num_blocks=12)  # as above
    sched.defer_block_free = False
    sched.add_request(h.make_request("q", prompt_len=60, max_tokens=50, stop_on_first=True))
    sched.add_request(h.make_request("r", prompt_len=60, max_tokens=2,
                                     params=h.remote_prefill_params("r", groups=GROUPS)))
    half = sched.connector.scheduler
    d.run(until=lambda: "r" in half.loads._pending)
    sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    d.run()
    assert not worker.orders  # the load never started
    assert_all_returned(sched, d)


def test_a_late_worker_report_never_reaches_vllm_however_many_came_between():
    """The scheduler hands an export's blocks back to vLLM when its lease lapses; the worker's own report
    of that export comes later and must be dropped (vLLM asserts the request still exists), even after
    more than 65,536 other exports were handed back meanwhile (the former bound on what was remembered)."""
    import time

    sched, worker, d = setup(role="kv_producer", async_scheduling=True, extra={"kv_lease_duration": 0.2})
    worker.consumer_reads = False
    sched.add_request(h.make_request("p1", prompt_len=40, max_tokens=1, params={"do_remote_decode": True}))
    d.run(until=lambda: "p1" in d.finished)
    half = sched.connector.scheduler
    deadline = time.monotonic() + 10
    while "p1" in sched.requests and time.monotonic() < deadline:  # the lease lapses, vLLM frees p1
        d.step()
        time.sleep(0.05)
    assert "p1" not in sched.requests
    # 65,536 other exports handed back to vLLM meanwhile, their own worker reports still owed.
    others = {f"x{i}" for i in range(65_536)}
    half.exports._owed |= others
    half.exports._inject_sending |= others
    from vllm.v1.outputs import KVConnectorOutput

    from hybridkv.connectors.vllm.metadata import HybridKVWorkerMetadata

    out = KVConnectorOutput(kv_connector_worker_meta=HybridKVWorkerMetadata(step=half.ts.watermark))
    half.update_connector_output(out)
    assert others <= out.finished_sending
    worker._reads["p1"] = 1  # the worker's own report of p1, late
    d.run()
    assert "p1" not in half.exports._reported_sending
    half.exports._owed -= others
    half.exports._reported_sending -= others
    assert_all_returned(sched, d)
