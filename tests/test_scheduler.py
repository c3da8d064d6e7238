"""One test per fencing rule of docs/design.md, each under both policies where it matters."""

from __future__ import annotations

import pytest

from hybridkv.fencing.fence import FencePolicy, NotYet, NotYetReason, PoolLayout
from hybridkv.fencing.request_state import (
    RequestPhase,
    TransferOutcome,
    attention_component,
    gdn_components,
)
from hybridkv.fencing.scheduler import TransferScheduler

KV = attention_component(0)
CONV, SSM = gdn_components(1)
ALL = (KV, CONV, SSM)
FENCED, NONE = FencePolicy.FENCED, FencePolicy.NONE


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(policy: FencePolicy = FENCED, blocks: int = 4, clock: Clock | None = None) -> TransferScheduler:
    return TransferScheduler(
        PoolLayout.shared(num_blocks=blocks, num_groups=2), policy=policy, lease_s=10.0, clock=clock or Clock()
    )


def running(s: TransferScheduler, rid: str, step: int, n_att: int = 1) -> None:
    s.add_request(rid)
    s.allocate(rid, 0, n_att)
    s.allocate(rid, 1, 1)
    s.step_scheduled(step, joined=[rid])


# Rule 2 (vLLM Race A): a freed block waits for every step that may still touch it.
@pytest.mark.parametrize("policy", [FENCED, NONE])
def test_rule2_free_waits_for_in_flight_steps(policy: FencePolicy) -> None:
    s = make(policy, blocks=2)
    running(s, "q", 0)
    s.step_scheduled(1)  # already dispatched; still contains q
    s.request_finished("q")  # q's EOS came out of step 0
    s.step_completed(0)
    s.add_request("r", expect=ALL)
    got = s.allocate("r", 1, 1)
    if policy is FENCED:
        assert got == NotYet(reason=NotYetReason.POOL_EXHAUSTED)
        s.step_completed(1)
        assert not isinstance(s.allocate("r", 1, 1), NotYet)
    else:
        assert not isinstance(got, NotYet)  # reused under the stale step: the race
    s.audit()


# Rule 1: export only after the writing step completed.
def test_rule1_export_waits_for_writer() -> None:
    s = make()
    running(s, "p", 0)
    lease = s.request_finished("p", export=True)
    assert lease is not None and lease.deadline == 10.0
    assert s.export_ready("p") == NotYet(reason=NotYetReason.PENDING_STEP)
    assert s.post_export("p") == NotYet(reason=NotYetReason.PENDING_STEP)
    s.step_completed(0)
    assert s.export_ready("p") is True
    tid = s.post_export("p")
    assert isinstance(tid, int)
    s.export_done("p")  # blocks stay quarantined while the read is in flight
    assert s.free_count() == 2
    assert s.transfer_landed(tid) is TransferOutcome.DISCARDED
    assert s.free_count() == 4


def test_rule1_unfenced_exports_at_once() -> None:
    s = make(NONE)
    running(s, "p", 0)
    s.request_finished("p", export=True)
    assert s.export_ready("p") is True


# Rule 3 (vLLM Race B): zeroing before the post is fenced; zeroing after it is skipped.
def test_rule3_import_waits_for_zeroing_scheduled_before() -> None:
    s = make()
    s.add_request("r", expect=ALL)
    (b,) = s.allocate("r", 0, 1)
    s.allocate("r", 1, 1)
    s.step_scheduled(0, zeroing=[(0, b)])
    assert s.post_import("r", components=ALL) == NotYet(reason=NotYetReason.PENDING_STEP)
    s.step_completed(0)
    assert isinstance(s.post_import("r", components=ALL), int)


def test_rule3_zeroing_after_post_is_skipped_even_after_landing() -> None:
    s = make()
    s.add_request("r", expect=ALL)
    (b,) = s.allocate("r", 0, 1)
    s.allocate("r", 1, 1)
    tid = s.post_import("r", components=(KV,))
    assert s.step_scheduled(0, zeroing=[(0, b)]).skip_zeroing == ((0, b),)
    s.transfer_landed(tid)
    assert s.step_scheduled(1, zeroing=[(0, b)]).skip_zeroing == ((0, b),)


def test_rule3_unfenced_neither_waits_nor_skips() -> None:
    s = make(NONE)
    s.add_request("r", expect=ALL)
    (b,) = s.allocate("r", 0, 1)
    s.step_scheduled(0, zeroing=[(0, b)])
    assert isinstance(s.post_import("r", components=(KV,)), int)
    assert s.step_scheduled(1, zeroing=[(0, b)]).skip_zeroing == ()


def test_rule3_step_touching_block_being_written_is_rejected_whole() -> None:
    s = make()
    s.add_request("r", expect=ALL)
    (b,) = s.allocate("r", 0, 1)
    s.post_import("r", components=(KV,))
    with pytest.raises(ValueError, match="inbound transfer is writing"):
        s.step_scheduled(0, touched=[(0, b)])
    assert s.scheduled_step == -1  # nothing applied
    s.step_scheduled(0)


@pytest.mark.parametrize("policy", [FENCED, NONE])
def test_pool_touched_ids_fence_like_pairs_and_bad_ids_apply_nothing(policy: FencePolicy) -> None:
    """Block ids given per pool (vLLM's one shared pool: its ids as they are) fence as (group, block)
    pairs do; a bad id is named and the step applies nothing, in a one-pool and a two-pool table."""
    s = make(policy)
    s.add_request("r", expect=ALL)
    (b,) = s.allocate("r", 0, 1)
    s.step_scheduled(0, pool_touched={0: {b}})
    assert s.table.fence[s.table.key(0, b)] == 0
    if policy is FENCED:
        s.step_completed(0)
        assert not isinstance(s.post_import("r", components=(KV,)), NotYet)
        with pytest.raises(ValueError, match="inbound transfer is writing"):
            s.step_scheduled(1, pool_touched={0: {b}})
        assert s.scheduled_step == 0
    one = TransferScheduler(PoolLayout.shared(num_blocks=8, num_groups=2), policy=policy, managed_pool=False)
    two = TransferScheduler(PoolLayout.separate(num_blocks=(8, 4)), policy=policy, managed_pool=False)
    for t, pool in ((one, 0), (two, 1)):
        size = t.layout.pool_sizes[pool]
        for bad in (-1, size, 2.0, "3", None):
            with pytest.raises(ValueError, match=rf"blocks \[{bad!r}\] of pool {pool}; expected block ids"):
                t.step_scheduled(0, pool_touched={pool: {1, bad}})
            assert t.scheduled_step == -1 and t.table.fence == [-1] * t.layout.total_blocks
        t.step_scheduled(0, pool_touched={pool: {size - 1}})
        assert t.table.fence[t.table.key(pool, size - 1)] == 0
    with pytest.raises(ValueError, match="pool 2; expected a pool index"):
        two.step_scheduled(1, pool_touched={2: {0}})


# Rule 4 (SGLang #39846): visible only when every component of every group arrived.
@pytest.mark.parametrize("policy", [FENCED, NONE])
def test_rule4_all_components_before_ready(policy: FencePolicy) -> None:
    s = make(policy)
    s.add_request("r", expect=ALL)
    s.allocate("r", 0, 1)
    s.allocate("r", 1, 1)
    t_kv = s.post_import("r", components=(KV,))
    t_gdn = s.post_import("r", components=(CONV, SSM))
    with pytest.raises(ValueError, match="already have a transfer in flight"):
        s.post_import("r", components=(SSM,))
    assert s.transfer_landed(t_kv) is TransferOutcome.ACCEPTED
    if policy is FENCED:
        assert not s.is_ready("r")
        with pytest.raises(ValueError, match="expected a ready request"):
            s.step_scheduled(0, joined=["r"])
    else:
        assert s.is_ready("r")  # the bug: declared complete after its first component
    s.transfer_landed(t_gdn)
    assert s.is_ready("r") and s.arrived("r") == frozenset(ALL)
    s.step_scheduled(0, joined=["r"])
    assert s.phase("r") is RequestPhase.RUNNING


# Rule 5 (SGLang #24527): abort and failure quarantine blocks until transfers are terminal.
@pytest.mark.parametrize("policy", [FENCED, NONE])
def test_rule5_abort_quarantines_until_terminal(policy: FencePolicy) -> None:
    s = make(policy, blocks=2)
    s.add_request("r", expect=ALL)
    s.allocate("r", 0, 1)
    s.allocate("r", 1, 1)
    tid = s.post_import("r", components=ALL)
    assert s.abort("r") and not s.abort("r")
    assert s.free_count() == (0 if policy is FENCED else 2)
    assert s.transfer_landed(tid) is TransferOutcome.DISCARDED
    assert s.transfer_landed(tid) is TransferOutcome.DUPLICATE
    assert s.transfer_failed(99) is TransferOutcome.UNKNOWN
    assert s.free_count() == 2
    s.audit()


def test_rule5_failure_then_retry_or_recompute() -> None:
    s = make()
    s.add_request("r", expect=ALL)
    s.allocate("r", 0, 1)
    s.allocate("r", 1, 1)
    tid = s.post_import("r", components=ALL)
    assert s.transfer_failed(tid) is TransferOutcome.ACCEPTED
    assert s.phase("r") is RequestPhase.FAILED and not s.is_ready("r")
    tid = s.post_import("r", components=ALL)  # retry
    s.transfer_failed(tid)
    s.recompute("r")
    assert s.is_ready("r")


def test_rule5_import_given_up_before_any_post_recomputes_under_a_pending_step() -> None:
    # A stalled decode: the lease lapsed before the read could start, and the zeroing step of the
    # request's blocks is still pending (post_import would answer not yet): recompute, not fail.
    s = make()
    s.add_request("r", expect=ALL)
    s.allocate("r", 0, 1)
    s.allocate("r", 1, 1)
    s.step_scheduled(0, zeroing=[(0, b) for b in s.blocks("r", 0)])
    assert isinstance(s.post_import("r", components=ALL), NotYet)
    s.recompute("r")
    assert s.is_ready("r") and s.phase("r") is RequestPhase.LOCAL
    s.add_request("q", expect=ALL)
    s.allocate("q", 0, 1)
    s.allocate("q", 1, 1)
    s.post_import("q", components=ALL)
    with pytest.raises(ValueError, match="in flight"):
        s.recompute("q")  # a transfer still writes its blocks


# Rule 6: leases.
def test_rule6_lease_bounds_reads_and_expiry_releases() -> None:
    clock = Clock()
    s = make(clock=clock)
    running(s, "p", 0)
    s.request_finished("p", export=True)
    s.step_completed(0)
    assert s.post_export("p", expected_s=11.0) == NotYet(reason=NotYetReason.LEASE_TOO_SHORT)
    clock.now = 5.0
    assert s.heartbeat("p").deadline == 15.0
    tid = s.post_export("p", expected_s=9.0)
    assert isinstance(tid, int)
    clock.now = 16.0
    assert s.poll() == ["p"] and not s.has_request("p")
    assert s.free_count() == 2  # the read in flight still pins its blocks
    s.transfer_landed(tid)
    assert s.free_count() == 4


def test_rule6_abort_of_export_keeps_blocks_until_lease_lapses() -> None:
    clock = Clock()
    s = make(clock=clock)
    running(s, "p", 0)
    s.request_finished("p", export=True)
    s.step_completed(0)
    s.abort("p")  # a consumer may be pulling without telling us
    assert s.heartbeat("p") is None and s.free_count() == 2
    clock.now = 11.0
    s.poll()
    assert s.free_count() == 4


def test_rule6_consumer_side_lease() -> None:
    clock = Clock()
    s = make(clock=clock)
    s.add_request("r", expect=ALL)
    s.allocate("r", 0, 1)
    s.allocate("r", 1, 1)
    assert s.post_import("r", components=ALL, lease_deadline=1.0, expected_s=2.0) == NotYet(
        reason=NotYetReason.LEASE_TOO_SHORT
    )
    tid = s.post_import("r", components=ALL, lease_deadline=3.0, expected_s=2.0)
    clock.now = 2.5
    s.lease_renewed("r", 5.0)
    clock.now = 5.5
    assert s.transfer_landed(tid) is TransferOutcome.LATE  # bytes read after the lease: untrusted
    assert s.phase("r") is RequestPhase.FAILED


def test_bad_input_is_rejected_without_side_effects() -> None:
    s = make()
    with pytest.raises(ValueError, match="request 'zz' is unknown"):
        s.allocate("zz", 0, 1)
    s.add_request("a")
    with pytest.raises(ValueError, match="already exists"):
        s.add_request("a")
    with pytest.raises(ValueError, match="n = -1"):
        s.allocate("a", 0, -1)
    assert s.allocate("a", 0, 5) == NotYet(reason=NotYetReason.POOL_EXHAUSTED)
    assert s.free_count() == 4  # all or nothing
    with pytest.raises(ValueError, match="expected an int greater than"):
        s.step_scheduled(0)
        s.step_scheduled(0)
    with pytest.raises(ValueError, match="expected a ready request"):
        s.add_request("b", expect=ALL)
        s.step_scheduled(1, joined=["a", "b"])
    assert s.phase("a") is RequestPhase.LOCAL  # not half applied
    s.audit()


def test_rejected_step_applies_nothing() -> None:
    s = make()
    running(s, "a", 0)
    s.add_request("b", expect=ALL)
    with pytest.raises(ValueError, match="step 0 scheduled"):
        s.add_request("c")
        s.step_scheduled(0, joined=["c"], zeroing=[(0, 3)])  # the step is checked last
    assert s.scheduled_step == 0 and s.phase("c") is RequestPhase.LOCAL
    assert s.step_scheduled(1, joined=["c"]).step == 1 and s.phase("c") is RequestPhase.RUNNING


def test_transfer_id_zero_is_a_posted_transfer() -> None:
    s = make()
    s.add_request("r", expect=ALL)
    s.allocate("r", 0, 1)
    s.allocate("r", 1, 1)
    assert s.allocate("r", 0, 0) == ()  # an empty allocation is not "not yet" either
    tid = s.post_import("r", components=ALL)
    assert tid == 0 and not isinstance(tid, NotYet)
    assert s.transfers_in_flight() == 1


def test_add_request_checks_expected_components() -> None:
    from hybridkv.fencing.request_state import Component, ComponentKind

    s = make()
    bad = (Component(group=5, kind=ComponentKind.KV),)
    for _ in range(2):  # a refused tuple is not remembered
        with pytest.raises(ValueError, match="expected a Component of a group in \\[0, 2\\)"):
            s.add_request("x", expect=bad)
    with pytest.raises(ValueError, match="component 'kv' of request 'x'"):
        s.add_request("x", expect=["kv"])
    assert not s.has_request("x")
    s.add_request("x", expect=ALL)
    s.add_request("y", expect=list(ALL))
    s.add_request("z", expect=ALL)
    assert all(s.phase(r) is RequestPhase.IMPORTING for r in ("x", "y", "z"))


def test_component_sets_are_checked_for_each_request() -> None:
    # Posts are remembered by the caller's tuple; each request's expectation is still checked.
    s = make(blocks=8)
    s.add_request("a", expect=ALL)
    s.add_request("b", expect=(KV,))
    for rid in ("a", "b"):
        s.allocate(rid, 0, 1)
        s.allocate(rid, 1, 1)
    t_a = s.post_import("a", components=ALL)
    with pytest.raises(ValueError, match="expected a non-empty subset"):
        s.post_import("b", components=ALL)
    with pytest.raises(ValueError, match="already have a transfer in flight"):
        s.post_import("a", components=[SSM])  # a list: not remembered, the same checks
    t_b = s.post_import("b", components=(KV,))
    assert s.transfer_landed(t_a) is TransferOutcome.ACCEPTED and s.is_ready("a")
    assert s.transfer_landed(t_b) is TransferOutcome.ACCEPTED and s.is_ready("b")
    s.audit()


def test_external_pool_assign_and_take_reusable() -> None:
    s = TransferScheduler(PoolLayout.separate(num_blocks=(4, 2)), managed_pool=False)
    s.add_request("a")
    s.assign("a", 0, [1, 2])
    s.assign("a", 1, [1])
    s.add_request("b")
    s.assign("b", 0, [2])  # rule 7: a block another request holds gets a second hold
    assert s.holders(0, 2) == ("a", "b")
    with pytest.raises(ValueError, match="already held by request 'b'"):
        s.assign("b", 0, [2])
    s.step_scheduled(0, joined=["a"])
    s.free_blocks("a", 0, [2])  # sliding-window clipping
    assert s.take_reusable() == [] and s.holders(0, 2) == ("b",)
    s.request_finished("b")  # the last hold: a's step 0 still fences it
    assert s.take_reusable() == []
    s.add_request("c")
    with pytest.raises(ValueError, match="still fenced"):
        s.assign("c", 0, [2])
    s.step_completed(0)
    assert s.take_reusable() == [(0, 2)]
    s.request_finished("a")
    assert sorted(s.take_reusable()) == [(0, 1), (1, 1)]


def test_components_are_interned_values() -> None:
    import copy
    import dataclasses
    import pickle

    from hybridkv.fencing.request_state import Component, ComponentKind

    kv = Component(group=0, kind=ComponentKind.KV)
    assert kv is KV and kv == KV and hash(kv) == hash(KV) and kv != CONV
    assert pickle.loads(pickle.dumps(SSM)) is SSM and copy.deepcopy(CONV) is CONV
    assert dataclasses.replace(CONV, kind=ComponentKind.SSM) is SSM
    assert {Component(group=1, kind=ComponentKind.CONV), SSM} == {CONV, SSM}
    with pytest.raises(dataclasses.FrozenInstanceError):
        kv.group = 1  # type: ignore[misc]


def test_freed_blocks_under_different_fences_come_back_each_when_settled() -> None:
    s = make(blocks=3)
    s.add_request("r", expect=ALL)  # never joins a step: no residency fence
    att = s.allocate("r", 0, 2)
    s.allocate("r", 1, 1)
    s.step_scheduled(0, zeroing=[(0, att[0])])
    s.step_scheduled(1)
    s.abort("r")
    assert s.free_count() == 2  # the unzeroed block and the GDN slot: nothing touches them
    s.step_completed(0)
    assert s.free_count() == 3
    s.audit()


def test_blocks_freed_by_one_step_come_back_together_in_order() -> None:
    s = make(blocks=8)
    for rid in ("a", "b", "c"):
        s.add_request(rid)
        s.allocate(rid, 0, 2)
    s.step_scheduled(0, joined=["a", "b", "c"])
    for rid in ("b", "a", "c"):
        s.request_finished(rid)  # retired by step 0, fenced until it completes
    assert s.free_count() == 2
    s.step_completed(0)
    assert s.free_count() == 8
    s.add_request("d")
    assert s.allocate("d", 0, 8) == (6, 7, 2, 3, 0, 1, 4, 5)  # never-used first, then in freeing order
    s.audit()


def test_bench_fence_reports_every_line() -> None:
    import argparse
    import contextlib
    import io
    import json

    from hybridkv.benchmarks import fence as bench_fence

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench_fence.run(argparse.Namespace(steps=10, seed=0, json=True)) == 0
    d = json.loads(out.getvalue())
    assert d["steps"] == 10 and d["in_flight"] > 900 and d["median_us"] > 0
    assert set(d["baselines"]) == {"none", "per_block_touch", "fenced_no_churn"}
