"""Fence table, block pool and lease table."""

from __future__ import annotations

import pytest

from hybridkv.fencing.block_pool import BlockPool
from hybridkv.fencing.fence import NEVER, FenceTable, NotYet, NotYetReason, PoolLayout
from hybridkv.fencing.lease import LeaseTable


def test_layout_validation() -> None:
    with pytest.raises(ValueError, match="pool_sizes\\[0\\] = 0"):
        PoolLayout(pool_sizes=(0,), group_pools=(0,))
    with pytest.raises(ValueError, match="group_pools\\[1\\] = 2"):
        PoolLayout(pool_sizes=(4, 4), group_pools=(0, 2))
    sep = PoolLayout.separate(num_blocks=(4, 2))
    assert sep.total_blocks == 6 and sep.num_groups == 2


def test_shared_pool_is_one_namespace_separate_pools_are_not() -> None:
    shared = FenceTable(PoolLayout.shared(num_blocks=4, num_groups=2))
    assert shared.key(0, 3) == shared.key(1, 3)
    sep = FenceTable(PoolLayout.separate(num_blocks=(4, 2)))
    assert sep.key(0, 1) != sep.key(1, 1)
    assert sep.block_of(sep.key(1, 1)) == 1 and sep.pool_of_key(sep.key(1, 1)) == 1
    with pytest.raises(ValueError, match="block 2 of group 1"):
        sep.key(1, 2)
    with pytest.raises(ValueError, match="group 5"):
        sep.key(5, 0)


def test_watermark_and_steps() -> None:
    t = FenceTable(PoolLayout.shared(num_blocks=3, num_groups=1))
    assert t.watermark == NEVER and t.fence == [NEVER] * 3
    t.advance_scheduled(0)
    t.advance_scheduled(3)
    with pytest.raises(ValueError, match="step 3 scheduled"):
        t.advance_scheduled(3)
    with pytest.raises(ValueError, match="step 4 completed"):
        t.advance_watermark(4)
    t.touch([0, 1], 3)
    t.touch([1], 2)  # a fence never moves back
    assert t.fence == [3, 3, NEVER]
    assert t.advance_watermark(2)
    assert not t.advance_watermark(1)  # late report ignored
    assert t.advance_watermark(3) and t.watermark == 3


def test_pool_defers_reuse_until_settled_and_idle() -> None:
    t = FenceTable(PoolLayout.shared(num_blocks=3, num_groups=1))
    pool = BlockPool(t, fenced=True, managed=True)
    keys = pool.take(0, 3)
    assert keys == [0, 1, 2] and pool.take(0, 1) is None
    t.advance_scheduled(5)
    t.touch([0], 5)
    t.readers[1] += 1
    for k in keys:
        pool.park(k)
    assert pool.free_count(0) == 1  # key 2: never touched, idle
    t.advance_watermark(5)
    pool.on_watermark()
    assert pool.free_count(0) == 2  # key 0 settled; key 1 still read
    t.readers[1] -= 1
    pool.on_transfer_terminal([1])
    assert pool.free_count(0) == 3 and pool.parked_count() == 0


def test_unfenced_pool_reuses_at_once() -> None:
    t = FenceTable(PoolLayout.shared(num_blocks=1, num_groups=1))
    pool = BlockPool(t, fenced=False, managed=True)
    (k,) = pool.take(0, 1)
    t.advance_scheduled(9)
    t.touch([k], 9)
    t.writers[k] += 1
    pool.park(k)
    assert pool.free_count(0) == 1


def test_external_pool_reports_reusable() -> None:
    t = FenceTable(PoolLayout.shared(num_blocks=2, num_groups=1))
    pool = BlockPool(t, fenced=True, managed=False)
    assert pool.take(0, 1) is None
    pool.park(1)
    assert pool.take_reusable() == [1] and pool.take_reusable() == []


def test_lease_grant_renew_fit_expire() -> None:
    now = [0.0]
    leases = LeaseTable(duration_s=10.0, clock=lambda: now[0])
    assert leases.grant("a").deadline == 10.0
    assert leases.fits("a", 10.0) and not leases.fits("a", 10.5) and not leases.fits("b", 0)
    now[0] = 6.0
    assert leases.renew("a").deadline == 16.0
    now[0] = 12.0
    assert leases.expire() == []  # the renewed deadline holds; the stale heap entry is skipped
    now[0] = 16.5
    assert leases.renew("a") is None
    assert leases.expire() == ["a"] and len(leases) == 0
    with pytest.raises(ValueError, match="lease duration 0"):
        LeaseTable(duration_s=0, clock=lambda: 0.0)


def test_not_yet_has_no_truth_value_and_says_why() -> None:
    n = NotYet(reason=NotYetReason.PENDING_STEP)
    assert isinstance(n, NotYet) and "not completed" in n.reason.value
    with pytest.raises(TypeError, match="NotYet\\(PENDING_STEP\\).*expected isinstance\\(x, NotYet\\)"):
        bool(n)  # a transfer id 0 is falsy too: truth tests read "not yet" into a yes


def test_keys_fast_path_agrees_with_key() -> None:
    t = FenceTable(PoolLayout.separate(num_blocks=(4, 2)))
    refs = [(0, 3), (1, 0), (1, 1), (0, 0), (True, 1)]  # a bool group is an int group, as in key()
    assert t.keys(refs) == [t.key(g, b) for g, b in refs]
    assert t.keys([]) == []
    with pytest.raises(ValueError, match="block 2 of group 1"):
        t.keys([(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="group -1"):
        t.keys([(-1, 0)])
    with pytest.raises(ValueError, match="block 1.5 of group 0"):
        t.keys([(0, 1.5)])


def test_free_list_is_first_in_first_out_across_compaction() -> None:
    n = 3000
    t = FenceTable(PoolLayout.shared(num_blocks=n, num_groups=1))
    pool = BlockPool(t, fenced=True, managed=True)
    first = pool.take(0, 2000)  # past the point where the taken prefix is dropped
    assert first == list(range(2000)) and pool.free_count(0) == n - 2000
    pool.park_many([5, 3, 1999])  # never touched: reusable at once, in this order
    assert pool.take(0, n - 2000) == list(range(2000, n))
    assert pool.take(0, 4) is None and pool.take(0, 3) == [5, 3, 1999]
    assert pool.free_count(0) == 0 and not pool.is_free(5)
    pool.park(7)
    assert pool.is_free(7) and pool.free_count(0) == 1


def test_idle_batches_of_one_fence_release_in_order_they_were_parked() -> None:
    t = FenceTable(PoolLayout.shared(num_blocks=12, num_groups=1))
    pool = BlockPool(t, fenced=True, managed=True)
    pool.take(0, 12)
    t.advance_scheduled(4)
    t.touch(range(9), 4)
    pool.park_idle([3, 1], 4)
    pool.park_many([5])  # a separate entry of the same fence in between
    pool.park_idle([0, 2], 4)
    pool.park_idle([], 4)
    t.touch([9], 3)
    pool.park_idle([9], 3)  # an earlier fence comes back first
    assert pool.parked_count() == 6 and pool.free_count(0) == 0
    t.advance_watermark(3)
    pool.on_watermark()
    assert pool.take(0, 1) == [9]
    t.advance_watermark(4)
    pool.on_watermark()
    assert pool.take(0, 5) == [3, 1, 5, 0, 2] and pool.parked_count() == 0
    pool.park_idle([6, 8], 4)  # settled already: reusable at once
    assert pool.take(0, 2) == [6, 8]
