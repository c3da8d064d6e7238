"""The disaggregated-serving simulator against cases computed by hand."""

from __future__ import annotations

import math

import pytest

from sims.pd.engine import simulate_point
from sims.pd.params import (DecodeSpec, LinkSpec, PrefillSpec, RequestSpec, Scheduling, SimConfig,
                            StepCost)
from sims.pd.sweep import run_sweep


def config(*, isl=100, osl=10, budget=100, prefill_cost=None, decode_cost=None, ranks=1,
           blocks_per_rank=1000, decode_blocks=1, descriptors=10, nbytes=1000, per_desc=1e-3,
           bw=1e5, latency=0.0, posting=False, scheduling=Scheduling.SYNC, prefill_endpoints=1,
           warmup=32, measure=128) -> SimConfig:
    return SimConfig(
        prefill=PrefillSpec(endpoints=prefill_endpoints, ranks=1, max_batched_tokens=budget,
                            cost=prefill_cost or StepCost(device_per_token_s=1e-4)),
        decode=DecodeSpec(endpoints=1, ranks=ranks, blocks_per_rank=blocks_per_rank,
                          cost=decode_cost or StepCost(device_base_s=1e-3)),
        link=LinkSpec(per_descriptor_s=per_desc, bytes_per_s=bw, latency_s=latency, posting_on_step=posting),
        request=RequestSpec(isl=isl, osl=osl, transfer_descriptors=descriptors, transfer_bytes=nbytes,
                            decode_blocks=decode_blocks),
        scheduling=scheduling, warmup_requests=warmup, measure_requests=measure,
    )


def test_one_user_latency_is_the_sum_of_its_stages():
    # prefill 100 tokens x 0.1 ms = 10 ms; transfer 10 desc x 1 ms + 1000 B / 100 kB/s = 20 ms;
    # decode 10 steps x 1 ms. One request every 40 ms over 2 GPUs of 110 tokens each.
    p = simulate_point(config(), 1)
    assert p.ttft_s == pytest.approx(0.010 + 0.020 + 0.001)
    assert p.itl_s == pytest.approx(0.001)
    assert p.tokens_per_s_per_user == pytest.approx(1000.0)
    assert p.tokens_per_s_per_gpu == pytest.approx(110 / 0.040 / 2)
    assert p.output_tokens_per_s_per_gpu == pytest.approx(10 / 0.040 / 2)
    assert p.transfer_s == pytest.approx(0.020)
    assert p.transfer_share == pytest.approx(0.020 / 0.031)
    assert not p.capacity_bound


def test_prefill_bound_endpoint_gives_budget_tokens_per_step():
    # Chunked prefill: 1000-token prompts in 1500-token batches, 3 ms + 10 us/token = 18 ms a step,
    # so 83,333 prompt tokens/s; decode and transfers are far from limiting.
    cfg = config(isl=1000, osl=8, budget=1500,
                 prefill_cost=StepCost(device_base_s=3e-3, device_per_token_s=1e-5),
                 decode_cost=StepCost(device_base_s=1e-5), ranks=4, descriptors=0, nbytes=0,
                 warmup=64, measure=600)
    p = simulate_point(cfg, 32)
    requests_per_s = 1500 / 0.018 / 1000
    assert p.tokens_per_s_per_gpu == pytest.approx(requests_per_s * 1008 / 5, rel=0.01)
    # More users only queue longer in front of the prefill endpoint.
    q = simulate_point(cfg, 64)
    assert q.tokens_per_s_per_gpu == pytest.approx(p.tokens_per_s_per_gpu, rel=0.01)
    assert q.ttft_s > 1.8 * p.ttft_s


def test_prefill_attention_term_counts_query_key_pairs():
    # One 100-token prompt in chunks of 50: pairs = 50*25 + 50*(50+25) = 5,000.
    cfg = config(budget=50, prefill_cost=StepCost(device_per_context_token_s=1e-6), descriptors=0, nbytes=0)
    p = simulate_point(cfg, 1)
    assert p.ttft_s == pytest.approx(5000e-6 + 0.001)


def test_zero_cost_transfers_take_no_time():
    free = config(descriptors=0, nbytes=0, per_desc=0.0, latency=0.0)
    p = simulate_point(free, 1)
    assert p.transfer_s == 0.0
    assert p.transfer_share == 0.0
    assert p.ttft_s == pytest.approx(0.010 + 0.001)
    assert p.tokens_per_s_per_gpu == pytest.approx(110 / 0.020 / 2)


def test_each_descriptor_adds_its_cost_to_ttft():
    base = simulate_point(config(descriptors=10), 1)
    more = simulate_point(config(descriptors=110), 1)
    assert more.ttft_s - base.ttft_s == pytest.approx(100 * 1e-3)
    assert more.itl_s == pytest.approx(base.itl_s)


def test_posting_on_step_also_delays_the_next_decode_step():
    # 10 descriptors x 1 ms are posted from the decode rank's step loop: the transfer still takes
    # 20 ms and the first decode step carries 10 ms more CPU time.
    off = simulate_point(config(posting=False), 1)
    on = simulate_point(config(posting=True), 1)
    assert on.ttft_s - off.ttft_s == pytest.approx(0.010)
    assert on.itl_s == pytest.approx(off.itl_s)


@pytest.mark.parametrize(("cpu", "device"), [(0.002, 0.005), (0.005, 0.002)])
def test_async_scheduling_overlaps_cpu_with_the_previous_step(cpu, device):
    cost = StepCost(cpu_base_s=cpu, device_base_s=device)
    sync = simulate_point(config(decode_cost=cost, descriptors=0, nbytes=0), 1)
    asyn = simulate_point(config(decode_cost=cost, descriptors=0, nbytes=0, scheduling=Scheduling.ASYNC), 1)
    assert sync.itl_s == pytest.approx(cpu + device)
    assert asyn.itl_s == pytest.approx(max(cpu, device))
    # The first step cannot hide its own CPU work.
    assert asyn.ttft_s == pytest.approx(sync.ttft_s)


def test_decode_step_reads_a_growing_context():
    # Step k attends ISL + k tokens: ITL = c * (ISL + OSL/2) for steps 1..OSL-1.
    c = 1e-6
    p = simulate_point(config(decode_cost=StepCost(device_per_context_token_s=c), descriptors=0, nbytes=0), 1)
    assert p.itl_s == pytest.approx(c * (100 + 10 / 2))
    assert p.ttft_s == pytest.approx(0.010 + c * 100)


def test_decode_ranks_step_in_lockstep_at_the_busiest_ranks_cost():
    cost = StepCost(device_base_s=1e-3, device_per_request_s=1e-3)
    # Both prompts fit one prefill batch, so the two requests decode side by side.
    one_rank = simulate_point(config(decode_cost=cost, ranks=1, descriptors=0, nbytes=0, budget=200), 2)
    two_ranks = simulate_point(config(decode_cost=cost, ranks=2, descriptors=0, nbytes=0, budget=200), 2)
    assert one_rank.itl_s == pytest.approx(3e-3)
    assert two_ranks.itl_s == pytest.approx(2e-3)


def _capacity_config(scheduling=Scheduling.SYNC) -> SimConfig:
    # A rank holds 3 requests (12 blocks / 4); prefill is quick, decode is slow.
    return config(isl=10, budget=10, prefill_cost=StepCost(device_per_token_s=1e-5), osl=50,
                  decode_cost=StepCost(device_base_s=1e-3), blocks_per_rank=12, decode_blocks=4,
                  descriptors=0, nbytes=0, scheduling=scheduling)


def test_capacity_cuts_the_sweep_at_the_first_point_that_waits():
    points, skipped = run_sweep(_capacity_config(), [1, 2, 3, 4, 5, 6], stop_at_capacity=True)
    assert [p.concurrency for p in points] == [1, 2, 3, 4]
    assert [p.capacity_bound for p in points] == [False, False, False, True]
    assert skipped == (5, 6)
    assert points[-1].decode_wait_s > 0
    assert all(p.decode_wait_s == 0 for p in points[:-1])


def test_past_capacity_requests_wait_and_throughput_stops_growing():
    points, skipped = run_sweep(_capacity_config(), [3, 4, 8], stop_at_capacity=False)
    assert skipped == ()
    three, four, eight = points
    # Three requests decode at once whatever the number of users: 3 tokens per 1 ms step.
    assert eight.output_tokens_per_s_per_gpu == pytest.approx(three.output_tokens_per_s_per_gpu, rel=0.02)
    assert eight.output_tokens_per_s_per_gpu == pytest.approx(3 / 1e-3 / 2, rel=0.02)
    assert eight.ttft_s > four.ttft_s > three.ttft_s


def test_async_deferred_free_holds_blocks_one_step_longer():
    # With frees deferred a step (vLLM #45357), a user's next request finds its old
    # blocks still held: at concurrency == capacity it already waits.
    sync = simulate_point(_capacity_config(), 3)
    asyn = simulate_point(_capacity_config(Scheduling.ASYNC), 3)
    assert not sync.capacity_bound
    assert asyn.capacity_bound


def test_bad_inputs_are_rejected_with_the_value():
    with pytest.raises(ValueError, match="needs 5 decode blocks"):
        config(blocks_per_rank=4, decode_blocks=5)
    with pytest.raises(ValueError, match="concurrency=0"):
        simulate_point(config(), 0)
    with pytest.raises(ValueError, match="device_base_s=-1"):
        StepCost(device_base_s=-1)
    with pytest.raises(ValueError, match="osl=1"):
        RequestSpec(isl=10, osl=1, transfer_descriptors=0, transfer_bytes=0, decode_blocks=1)
    with pytest.raises(ValueError, match="link.bytes_per_s"):
        LinkSpec(per_descriptor_s=0, bytes_per_s=0)
    with pytest.raises(ValueError, match="scheduling 'maybe'"):
        Scheduling.parse("maybe")


def test_all_zero_costs_are_rejected_not_divided_by():
    free = config(prefill_cost=StepCost(), decode_cost=StepCost(), descriptors=0, nbytes=0)
    with pytest.raises(ValueError, match="every cost is zero"):
        simulate_point(free, 2)


def test_results_are_finite_and_deterministic():
    a = simulate_point(config(scheduling=Scheduling.ASYNC), 7)
    b = simulate_point(config(scheduling=Scheduling.ASYNC), 7)
    assert a == b
    assert all(math.isfinite(v) for v in (a.tokens_per_s_per_gpu, a.ttft_s, a.itl_s))
