"""``has_pending_block_frees``: what stops vLLM's scheduler from preempting, against the real Scheduler.

vLLM asks it when a running request cannot get a block: True makes the scheduler
wait for the connector to free blocks instead of preempting. Only blocks whose
export already ended come back within a step or two; an export still waiting for
its reader may hold its blocks for a whole lease.
"""

from __future__ import annotations

import pytest

from tests.vllm import harness as h
from tests.vllm.test_scheduler_flows import MODES, assert_all_returned, setup, usable


@pytest.mark.parametrize("async_scheduling", MODES)
def test_an_export_waiting_for_its_reader_does_not_block_preemption(async_scheduling):
    sched, worker, d = setup(role="kv_producer", async_scheduling=async_scheduling)
    worker.consumer_reads = False
    sched.add_request(h.make_request("p1", prompt_len=100, max_tokens=1, params={"do_remote_decode": True}))
    d.run(until=lambda: "p1" in d.finished)
    for _ in range(4):
        d.step()
    assert worker.offered and usable(sched) > h.free_blocks(sched)  # held for a reader that has not come
    assert sched.connector.has_pending_block_frees() is False
    worker._reads["p1"] = 1  # the consumer reads now
    for _ in range(8):
        d.step()
        if h.free_blocks(sched) == usable(sched):
            break
    d.drain()
    assert_all_returned(sched, d)
    assert sched.connector.has_pending_block_frees() is False


@pytest.mark.parametrize("async_scheduling", MODES)
def test_running_requests_preempt_while_an_export_waits_for_its_reader(async_scheduling):
    """A pool too small for two growing requests and an unread export: vLLM must preempt one
    request and finish both, not wait a whole lease for the export's blocks."""
    sched, worker, d = setup(role="kv_producer", async_scheduling=async_scheduling, num_blocks=28)
    worker.consumer_reads = False
    sched.add_request(h.make_request("p1", prompt_len=100, max_tokens=1, params={"do_remote_decode": True}))
    d.run(until=lambda: "p1" in d.finished)
    held = usable(sched) - h.free_blocks(sched)
    for rid in ("r2", "r3"):
        sched.add_request(h.make_request(rid, prompt_len=60, max_tokens=160))
    d.run(max_steps=600, until=lambda: {"r2", "r3"} <= set(d.finished))
    # The export was never read: its blocks stayed held the whole time.
    assert not worker._reads and usable(sched) - h.free_blocks(sched) == held
    worker._reads["p1"] = 1
    d.run()
    assert_all_returned(sched, d)
