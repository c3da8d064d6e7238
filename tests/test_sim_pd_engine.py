"""The disaggregated-serving simulator against cases computed by hand."""

from __future__ import annotations

import math
import random

import pytest

from hybridkv.sims.pd.engine import simulate_point
from hybridkv.sims.pd.params import (Arrivals, DecodeSpec, Distribution, Lengths, LinkSpec, PostingSpec, PrefillSpec,
                            Scheduling, SimConfig, Sizing, StepCost, Traffic)
from hybridkv.sims.pd.sweep import run_sweep

BIG = 10**9  # block_tokens that no context reaches: blocks never grow


def sizing(*, descriptors=10, nbytes=1000, decode_blocks=1, prefill_blocks=1, block_tokens=BIG) -> Sizing:
    blocks = decode_blocks if callable(decode_blocks) else (lambda _t: decode_blocks)
    pblocks = prefill_blocks if callable(prefill_blocks) else (lambda _t: prefill_blocks)
    return Sizing(transfer=lambda _isl: (descriptors, nbytes), decode_blocks=blocks, prefill_blocks=pblocks,
                  block_tokens=block_tokens)


def config(*, isl=100, osl=10, budget=100, prefill_cost=None, decode_cost=None, ranks=1, ranks_per_node=1,
           blocks_per_rank=1000, prefill_blocks_per_rank=1000, size=None, post_desc=0.0, post_fixed=0.0,
           on_step=False, wire_desc=1e-3, bw=1e5, latency=0.0, scheduling=Scheduling.SYNC,
           prefill_endpoints=1, warmup=32, measure=128, ramp=0.0) -> SimConfig:
    lengths = lambda name, n: n if isinstance(n, Lengths) else Lengths.fixed(name, n)  # noqa: E731
    return SimConfig(
        prefill=PrefillSpec(endpoints=prefill_endpoints, ranks=1, max_batched_tokens=budget,
                            blocks_per_rank=prefill_blocks_per_rank,
                            cost=prefill_cost or StepCost.of(device_per_token_s=1e-4)),
        decode=DecodeSpec(endpoints=1, ranks=ranks, ranks_per_node=ranks_per_node, blocks_per_rank=blocks_per_rank,
                          cost=decode_cost or StepCost.of(device_base_s=1e-3)),
        posting=PostingSpec(per_descriptor_s=post_desc, per_transfer_s=post_fixed, on_step=on_step),
        link=LinkSpec(per_descriptor_s=wire_desc, bytes_per_s=bw, latency_s=latency),
        sizing=size or sizing(),
        traffic=Traffic(isl=lengths("isl", isl), osl=lengths("osl", osl), ramp_s=ramp),
        scheduling=scheduling, warmup_requests=warmup, measure_requests=measure,
    )


def test_one_user_latency_is_the_sum_of_its_stages():
    # prefill 100 tokens x 0.1 ms = 10 ms; wire 10 desc x 1 ms + 1000 B / 100 kB/s = 20 ms;
    # decode 10 steps x 1 ms. One request every 40 ms over 2 GPUs of 110 tokens each.
    p = simulate_point(config(), 1)
    assert p.ttft_s == pytest.approx(0.010 + 0.020 + 0.001)
    assert p.itl_s == pytest.approx(0.001)
    assert p.tokens_per_s_per_user == pytest.approx(1000.0)
    assert p.tokens_per_s_per_gpu == pytest.approx(110 / 0.040 / 2)
    assert p.output_tokens_per_s_per_gpu == pytest.approx(10 / 0.040 / 2)
    assert p.transfer_s == pytest.approx(0.020)
    assert p.transfer_share == pytest.approx(0.020 / 0.031)
    assert not p.capacity_bound and p.preemptions == 0


@pytest.mark.parametrize("on_step", [True, False], ids=["posted-on-step", "posting-thread"])
def test_posting_is_charged_once_when_decode_is_idle(on_step):
    # The double count this replaces: with decode idle, the posting (10 x 1 ms) was charged inside the
    # transfer and again on the first decode step (TTFT 41 ms). Posting 10 ms of CPU (on an otherwise
    # empty step, or on the posting thread), then the wire's 10 ms (bytes only), then one 1 ms step.
    cfg = config(post_desc=1e-3, on_step=on_step, wire_desc=0.0)
    p = simulate_point(cfg, 1)
    assert p.ttft_s == pytest.approx(0.010 + 0.010 + 0.010 + 0.001)
    assert p.posting_s == pytest.approx(0.010)
    assert p.transfer_s == pytest.approx(0.020)
    assert p.itl_s == pytest.approx(0.001)


def test_posting_on_step_lengthens_the_step_that_posts():
    # Two users: while one decodes, the other's transfer is posted from the decode step loop, so the
    # running request's step carries 10 ms more CPU; on a posting thread it does not.
    common = dict(post_desc=1e-3, wire_desc=0.0, osl=50)
    on = simulate_point(config(on_step=True, **common), 2)
    off = simulate_point(config(on_step=False, **common), 2)
    assert off.itl_s == pytest.approx(0.001)
    assert on.itl_s > off.itl_s + 0.010 / 50 * 0.5


def test_zero_cost_transfers_take_no_time():
    free = config(size=sizing(descriptors=0, nbytes=0), wire_desc=0.0, latency=0.0)
    p = simulate_point(free, 1)
    assert p.transfer_s == 0.0
    assert p.transfer_share == 0.0
    assert p.ttft_s == pytest.approx(0.010 + 0.001)
    assert p.tokens_per_s_per_gpu == pytest.approx(110 / 0.020 / 2)


def test_each_descriptor_adds_its_wire_cost_to_ttft():
    base = simulate_point(config(size=sizing(descriptors=10)), 1)
    more = simulate_point(config(size=sizing(descriptors=110)), 1)
    assert more.ttft_s - base.ttft_s == pytest.approx(100 * 1e-3)
    assert more.itl_s == pytest.approx(base.itl_s)


def test_a_nodes_ranks_share_its_link():
    # Both prompts are prefilled in one batch and placed on two ranks; their 20 ms transfers run
    # together. One link per rank: each takes 20 ms. One link for both: 40 ms each (shared halves).
    kw = dict(ranks=2, budget=200, osl=10)
    apart = simulate_point(config(ranks_per_node=1, **kw), 2)
    shared = simulate_point(config(ranks_per_node=2, **kw), 2)
    assert apart.transfer_s == pytest.approx(0.020)
    assert shared.transfer_s == pytest.approx(0.040)


def test_prefill_holds_its_blocks_until_the_transfer_ends():
    # The prefill pool holds one prompt: the next prompt starts only when the previous transfer
    # has ended (20 ms after its 10 ms prefill), not when its prefill did.
    free = simulate_point(config(prefill_blocks_per_rank=4), 2)
    tight = simulate_point(config(prefill_blocks_per_rank=1), 2)
    assert free.prefill_wait_s < tight.prefill_wait_s
    assert tight.tokens_per_s_per_gpu < free.tokens_per_s_per_gpu
    with pytest.raises(ValueError, match="could never be prefilled"):
        config(prefill_blocks_per_rank=1, size=sizing(prefill_blocks=2))


def test_prefill_attention_term_counts_query_key_pairs():
    # One 100-token prompt in chunks of 50: pairs = 50*25 + 50*(50+25) = 5,000.
    cfg = config(budget=50, prefill_cost=StepCost.of(device_per_context_token_s=1e-6),
                 size=sizing(descriptors=0, nbytes=0))
    p = simulate_point(cfg, 1)
    assert p.ttft_s == pytest.approx(5000e-6 + 0.001)


@pytest.mark.parametrize(("cpu", "device"), [(0.002, 0.005), (0.005, 0.002)])
def test_async_scheduling_overlaps_cpu_with_the_previous_step(cpu, device):
    cost = StepCost.of(cpu_base_s=cpu, device_base_s=device)
    free = sizing(descriptors=0, nbytes=0)
    sync = simulate_point(config(decode_cost=cost, size=free), 1)
    asyn = simulate_point(config(decode_cost=cost, size=free, scheduling=Scheduling.ASYNC), 1)
    assert sync.itl_s == pytest.approx(cpu + device)
    assert asyn.itl_s == pytest.approx(max(cpu, device))
    # The first step cannot hide its own CPU work.
    assert asyn.ttft_s == pytest.approx(sync.ttft_s)


def test_decode_step_reads_a_growing_context():
    # Step k attends ISL + k tokens: ITL = c * (ISL + OSL/2) for steps 1..OSL-1.
    c = 1e-6
    p = simulate_point(config(decode_cost=StepCost.of(device_per_context_token_s=c),
                              size=sizing(descriptors=0, nbytes=0)), 1)
    assert p.itl_s == pytest.approx(c * (100 + 10 / 2))
    assert p.ttft_s == pytest.approx(0.010 + c * 100)


def test_decode_ranks_step_in_lockstep_at_the_busiest_ranks_cost():
    cost = StepCost.of(device_base_s=1e-3, device_per_request_s=1e-3)
    free = sizing(descriptors=0, nbytes=0)
    # Both prompts fit one prefill batch, so the two requests decode side by side.
    one_rank = simulate_point(config(decode_cost=cost, ranks=1, size=free, budget=200), 2)
    two_ranks = simulate_point(config(decode_cost=cost, ranks=2, size=free, budget=200), 2)
    assert one_rank.itl_s == pytest.approx(3e-3)
    assert two_ranks.itl_s == pytest.approx(2e-3)


def _capacity_config(scheduling=Scheduling.SYNC) -> SimConfig:
    # A rank holds 3 requests (12 blocks / 4); prefill is quick, decode is slow.
    return config(isl=10, budget=10, prefill_cost=StepCost.of(device_per_token_s=1e-5), osl=50,
                  decode_cost=StepCost.of(device_base_s=1e-3), blocks_per_rank=12,
                  size=sizing(decode_blocks=4, descriptors=0, nbytes=0), scheduling=scheduling)


def test_capacity_cuts_the_sweep_at_the_first_point_that_waits():
    points, skipped = run_sweep(_capacity_config(), [1, 2, 3, 4, 5, 6], stop_at_capacity=True)
    assert [p.load for p in points] == [1, 2, 3, 4]
    assert [p.capacity_bound for p in points] == [False, False, False, True]
    assert skipped == (5, 6)
    assert points[-1].mean("decode_wait_s") > 0
    assert all(p.mean("decode_wait_s") == 0 for p in points[:-1])


def test_past_capacity_requests_wait_and_throughput_stops_growing():
    points, skipped = run_sweep(_capacity_config(), [3, 4, 8], stop_at_capacity=False)
    assert skipped == ()
    three, four, eight = (p.runs[0] for p in points)
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


def _growing(blocks_per_rank: int) -> SimConfig:
    # 10-token blocks: a request takes 1 block per 10 tokens of context, 10 at admission (ISL 100)
    # and 12 by its end (OSL 20). Prefill is quick so requests pile into decode.
    return config(isl=100, osl=20, budget=400, prefill_cost=StepCost.of(device_per_token_s=1e-6),
                  decode_cost=StepCost.of(device_base_s=1e-3), blocks_per_rank=blocks_per_rank,
                  size=sizing(decode_blocks=lambda t: -(-t // 10), descriptors=0, nbytes=0, block_tokens=10),
                  warmup=16, measure=64)


def test_blocks_grow_with_the_context_and_preempt_when_they_run_out():
    # 4 users x 12 blocks = 48 fit at once: no preemption. With 44 blocks, 4 users admitted at 10
    # blocks each (40) outgrow the rank: the last to join is preempted and recomputes.
    roomy = simulate_point(_growing(48), 4)
    tight = simulate_point(_growing(44), 4)
    assert roomy.preemptions == 0
    assert tight.preemptions > 0
    assert tight.completed == roomy.completed == 64
    # Recomputing costs time: the same users get fewer tokens through.
    assert tight.tokens_per_s_per_gpu < roomy.tokens_per_s_per_gpu


def test_seeds_vary_the_start_and_a_seed_repeats_exactly():
    cfg = config(ramp=0.05, scheduling=Scheduling.ASYNC, osl=30)
    a, b = simulate_point(cfg, 7, seed=1), simulate_point(cfg, 7, seed=1)
    c = simulate_point(cfg, 7, seed=2)
    assert a == b
    assert a.ttft_s != c.ttft_s
    assert all(math.isfinite(v) for v in (a.tokens_per_s_per_gpu, a.ttft_s, a.itl_s))


def test_lengths_are_drawn_from_their_distribution():
    rng = random.Random(0)
    uni = Lengths(name="isl", kind=Distribution.UNIFORM, mean=150, low=100, high=200)
    got = [uni.draw(rng) for _ in range(4000)]
    assert min(got) >= 100 and max(got) <= 200
    assert sum(got) / len(got) == pytest.approx(150, rel=0.02)
    logn = Lengths(name="isl", kind=Distribution.LOGNORMAL, mean=1000, cv=0.5, low=1, high=100_000)
    got = [logn.draw(rng) for _ in range(4000)]
    assert sum(got) / len(got) == pytest.approx(1000, rel=0.05)
    with pytest.raises(ValueError, match="outside"):
        Lengths(name="isl", kind=Distribution.UNIFORM, mean=50, low=100, high=200)


def test_open_loop_throughput_is_the_arrival_rate_below_capacity():
    # 20 requests/s of 110 tokens over 2 GPUs: 1,100 tokens/s/GPU, whatever the service times.
    cfg = config(isl=Lengths(name="isl", kind=Distribution.UNIFORM, mean=100, low=50, high=150),
                 warmup=100, measure=1500)
    runs = [simulate_point(cfg, 20.0, arrivals=Arrivals.OPEN, seed=s) for s in range(3)]
    mean = sum(r.tokens_per_s_per_gpu for r in runs) / 3
    assert mean == pytest.approx(20 * 110 / 2, rel=0.06)
    assert len({r.tokens_per_s_per_gpu for r in runs}) == 3
    assert all(abs(r.backlog_growth) < 50 for r in runs)
    # Past capacity the queue only grows. The link moves 50 prompts/s (20 ms each) and prefill holds
    # each prompt's blocks until its transfer ends, so prefill too is held to 50/s.
    over = simulate_point(cfg, 200.0, arrivals=Arrivals.OPEN, seed=0)
    assert over.backlog_growth > 0.3 * over.completed
    assert over.tokens_per_s_per_gpu == pytest.approx(50 * 110 / 2, rel=0.08)


def test_bad_inputs_are_rejected_with_the_value():
    with pytest.raises(ValueError, match="needs 5 decode blocks"):
        config(blocks_per_rank=4, size=sizing(decode_blocks=5))
    with pytest.raises(ValueError, match="concurrency=0"):
        simulate_point(config(), 0)
    with pytest.raises(ValueError, match="request_rate=inf"):
        simulate_point(config(), math.inf, arrivals=Arrivals.OPEN)
    with pytest.raises(ValueError, match="device_base_s=-1"):
        StepCost.of(device_base_s=-1)
    with pytest.raises(ValueError, match="osl low=1"):
        config(osl=1)
    with pytest.raises(ValueError, match="link.bytes_per_s"):
        LinkSpec(per_descriptor_s=0, bytes_per_s=0, latency_s=0)
    with pytest.raises(ValueError, match="link.bytes_per_s=inf"):
        LinkSpec(per_descriptor_s=0, bytes_per_s=math.inf, latency_s=0)
    with pytest.raises(ValueError, match="posting.per_descriptor_s=nan"):
        PostingSpec(per_descriptor_s=math.nan, per_transfer_s=0, on_step=True)
    with pytest.raises(ValueError, match="scheduling 'maybe'"):
        Scheduling.parse("maybe")


def test_all_zero_step_costs_are_refused_not_divided_by():
    with pytest.raises(ValueError, match="decode.cost: every term is zero"):
        config(decode_cost=StepCost.of())
    with pytest.raises(ValueError, match="prefill.cost: every term is zero"):
        config(prefill_cost=StepCost.of())


def test_a_posting_thread_posts_its_share_and_the_link_carries_all():
    # Attention TP > 1: each GPU of the decode rank posts its own 2 of the request's 10 descriptors, in
    # parallel; all 10 and all the bytes cross the node's link. Posting 2 x 1 ms, then wire 10 x 1 ms + 10 ms.
    size = Sizing(transfer=lambda _isl: (10, 1000), posted=lambda _isl: 2, decode_blocks=lambda _t: 1,
                  prefill_blocks=lambda _t: 1, block_tokens=BIG)
    p = simulate_point(config(size=size, post_desc=1e-3), 1)
    assert p.posting_s == pytest.approx(0.002)
    assert p.transfer_s == pytest.approx(0.002 + 0.010 + 0.010)
    # Without a share, the thread posts them all.
    assert simulate_point(config(post_desc=1e-3), 1).posting_s == pytest.approx(0.010)


def test_capacity_is_the_highest_rate_without_backlog_growth():
    # The link moves 50 prompts/s (20 ms each) and prefill holds each prompt's blocks until its transfer
    # ends: 50/s is the capacity. The sweep brackets it, the search narrows it to 2% (a point is overloaded
    # once its queue grows by 5% of the window's completions, so the bracket may sit a little above 50).
    from hybridkv.sims.pd.sweep import CAPACITY_TOLERANCE, search_capacity, sweep_capacity

    cfg = config(isl=Lengths(name="isl", kind=Distribution.UNIFORM, mean=100, low=50, high=150),
                 warmup=50, measure=600)
    points, _ = run_sweep(cfg, (20.0, 200.0), arrivals=Arrivals.OPEN, seeds=(0,), stop_at_capacity=False)
    assert [p.overloaded for p in points] == [False, True]
    bracket = sweep_capacity(points)
    assert (bracket.rate, bracket.above, bracket.searched) == (20.0, 200.0, False)
    found = search_capacity(cfg, bracket, seeds=(0,))
    assert found.searched and found.above <= found.rate * (1 + CAPACITY_TOLERANCE)
    assert 45 <= found.rate <= 56
    # Closed loops have no backlog: never "overloaded".
    closed, _ = run_sweep(cfg, (4,), seeds=(0,), stop_at_capacity=False)
    assert not closed[0].overloaded
