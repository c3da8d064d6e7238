"""A hot shared prefix on a prefill with prefix caching, with the real vLLM 0.33.0 AsyncScheduler.

Requests that share a 512-token system prompt keep arriving, so some running request reads the
prefix's cached blocks in every step. Those reads must not fence the blocks: a finished request's
export is offered within two steps of its finish, whatever the pool size (before, it waited until
the pool turned over: 47 steps with 256 blocks, 199 with 1,024). The export rule still holds for
blocks really written: a request stopped while its last step is in flight is offered only once that
step completed. (Fails with --fence-policy none.)
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.vllm import harness as h
from tests.vllm.test_scheduler_flows import assert_all_returned

PREFIX = 512
OWN = 64  # each prompt's own tail after the shared prefix
REQUESTS = 64
PER_STEP = 2  # arrivals per step: the prefix stays in use for the whole run
STOPPED_EVERY = 8  # every 8th request stops while its last step is in flight


@pytest.mark.parametrize("num_blocks", [256, 1024])
def test_hot_prefix_exports_are_offered_within_two_steps(num_blocks, fence_policy_name):
    from vllm.v1.request import RequestStatus

    vc = h.make_vllm_config(role="kv_producer", async_scheduling=True, num_blocks=num_blocks, prefix_caching=True,
                            extra={"hybridkv_fence_policy": fence_policy_name})
    kcc = h.make_kv_cache_config(vc)
    sched = h.make_scheduler(vc, kcc, async_scheduling=True)
    worker = h.StandInWorker()  # a consumer reads each export one step after it is offered
    d = h.Driver(sched, worker, async_scheduling=True)
    half = sched.connector.scheduler
    (att,) = [g for g in half.transfer_groups if g not in half._mamba_spec_blocks]

    finished_at: dict[str, int] = {}  # request -> the last step scheduled when it finished
    stopped: dict[str, int] = {}  # request stopped in flight -> the step it was last scheduled in
    waiting = [f"r{i}" for i in range(REQUESTS)]
    while waiting or sched.has_requests() or worker.pending():
        for _ in range(PER_STEP):
            if waiting:
                rid = waiting.pop(0)
                sched.add_request(h.make_request(rid, prompt_len=PREFIX + OWN, max_tokens=1, prefix_len=PREFIX,
                                                 suffix_seed=int(rid[1:]), params={"do_remote_decode": True}))
        d.step()
        step = d.steps - 1
        for rid in d.finished:
            finished_at.setdefault(rid, step)
        # A request stopped on a token the scheduler could not foresee is finished while the step it was
        # scheduled in still runs (async scheduling). A prefill's max_tokens=1 is always foreseen, so
        # vLLM's own finish_requests plays the stop.
        for rid in d.touched[step]:
            if int(rid[1:]) % STOPPED_EVERY == STOPPED_EVERY - 1 and rid not in stopped:
                stopped[rid] = step
                sched.finish_requests(rid, RequestStatus.FINISHED_STOPPED)
                finished_at[rid] = step
        assert d.steps < 400, "the run does not end"
    d.drain()

    offered = {rid: step for step, rid in worker.offered}
    assert set(offered) == {f"r{i}" for i in range(REQUESTS)}
    # The prefix was hot: the exports name the same prefix blocks (rule 7), which others ran on meanwhile.
    assert len(d.finished) == REQUESTS - len(stopped)
    # (The two first arrivals compute it side by side, before either has cached it.)
    heads = Counter(tuple(params["remote_block_ids"][att][:PREFIX // kcc.kv_cache_groups[att].kv_cache_spec.block_size])
                    for _, params in d.finished.values())
    assert heads.most_common(1)[0][1] >= len(d.finished) - 1, heads
    late = {rid: offered[rid] - finished_at[rid] for rid in offered if offered[rid] - finished_at[rid] > 2}
    assert not late, f"exports offered more than 2 steps after their request finished: {late}"
    # The export rule for blocks really written: a stopped request's last step wrote its blocks.
    early = {rid: (offered[rid], d.completed_at[s]) for rid, s in stopped.items() if d.completed_at[s] > offered[rid]}
    assert not early, f"exports offered (step) before the step writing their blocks completed (step): {early}"
    assert half.ts.holders(att, 1) == ()  # every export's hold ended
    assert_all_returned(sched, d)
