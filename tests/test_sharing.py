"""Fencing rule 7 (sharing): reference-counted holds on blocks several requests hold.

Prefix caching lets requests share cached blocks, and an export reads blocks a running
request may also hold. Holds are counted; rules 1-5 apply per holder; a block returns to
reuse only when its last holder released it, it settled and no transfer reads it.
"""

from __future__ import annotations

import pytest

from hybridkv.fencing.fence import FencePolicy, NotYet, PoolLayout
from hybridkv.fencing.request_state import attention_component
from hybridkv.fencing.scheduler import TransferScheduler

KV = attention_component(0)


def _managed(policy: FencePolicy = FencePolicy.FENCED, blocks: int = 6) -> TransferScheduler:
    return TransferScheduler(PoolLayout.shared(num_blocks=blocks, num_groups=1), policy=policy)


def test_a_shared_block_is_reused_only_after_its_last_holder_and_the_watermark() -> None:
    s = _managed()
    s.add_request("a")
    prefix = s.allocate("a", 0, 2)
    s.step_scheduled(0, joined=["a"])
    s.add_request("b")  # shares a's cached prefix, computes its own suffix
    s.share("b", 0, prefix)
    s.allocate("b", 0, 1)
    assert s.holders(0, prefix[0]) == ("a", "b")
    s.step_scheduled(1, joined=["b"])
    free = s.free_count()
    s.request_finished("a")
    s.step_completed(1)
    assert s.free_count() == free  # b still holds the prefix: nothing came back
    assert s.holders(0, prefix[0]) == ("b",)
    s.step_scheduled(2)
    s.request_finished("b")  # b was resident through step 2
    assert s.free_count() == free
    s.step_completed(2)
    assert s.free_count() == free + 3
    s.audit()


def test_a_parked_block_taken_again_is_not_released_by_its_stale_entry() -> None:
    s = _managed()
    s.add_request("a")
    blocks = s.allocate("a", 0, 2)
    s.step_scheduled(0, joined=["a"])
    s.request_finished("a")  # parked under fence 0
    s.add_request("c")
    s.share("c", 0, blocks)  # a prefix hit on blocks not yet reusable
    s.step_scheduled(1, joined=["c"])
    free = s.free_count()
    s.step_completed(0)  # the stale heap entry pops: the blocks stay c's
    assert s.free_count() == free and s.holders(0, blocks[0]) == ("c",)
    s.audit()
    s.request_finished("c")
    s.step_completed(1)
    assert s.free_count() == free + 2
    s.audit()


def test_an_export_of_a_shared_block_is_a_read_hold() -> None:
    s = _managed()
    s.add_request("a")
    blocks = s.allocate("a", 0, 2)
    s.add_request("b")
    s.share("b", 0, blocks[:1])
    s.step_scheduled(0, joined=["a", "b"])
    s.request_finished("a", export=True)
    s.step_completed(0)
    tid = s.post_export("a")
    assert not isinstance(tid, NotYet)
    s.transfer_landed(tid)
    assert s.export_done("a")
    # The export let go of a's hold only: b keeps the shared block, a's own block is back.
    assert s.holders(0, blocks[0]) == ("b",) and s.holders(0, blocks[1]) == ()
    assert s.pool.is_free(s.table.key(0, blocks[1])) and not s.pool.is_free(s.table.key(0, blocks[0]))
    s.audit()


def test_a_shared_block_read_by_a_transfer_stays_quarantined_after_its_last_holder() -> None:
    s = _managed()
    s.add_request("a")
    blocks = s.allocate("a", 0, 1)
    s.add_request("b")
    s.share("b", 0, blocks)
    s.step_scheduled(0, joined=["a", "b"])
    s.step_completed(0)
    s.request_finished("a", export=True)
    tid = s.post_export("a")
    s.abort("a")  # the lease keeps a's hold; abort the export for good:
    s.poll()
    s.request_finished("b")
    assert s.holders(0, blocks[0]) == ("a",)
    s.leases.end("a")
    s.export_done("a")
    key = s.table.key(0, blocks[0])
    assert s.pool.is_parked(key)  # the read is still in flight
    s.transfer_landed(tid)
    assert s.pool.is_free(key)
    s.audit()


def test_an_import_never_writes_a_shared_block() -> None:
    s = _managed()
    s.add_request("local")
    prefix = s.allocate("local", 0, 2)
    s.add_request("d", expect=(KV,))
    s.share("d", 0, prefix)  # a local prefix hit
    suffix = s.allocate("d", 0, 3)
    with pytest.raises(ValueError, match="other requests hold too"):
        s.post_import("d", components=(KV,))
    tid = s.post_import("d", components=(KV,), blocks={0: suffix})  # only the missing suffix
    assert not isinstance(tid, NotYet)
    assert s.transfer_landed(tid).value == "accepted" and s.is_ready("d")
    s.audit()


def test_share_refuses_blocks_nobody_holds_and_double_holds() -> None:
    s = _managed()
    s.add_request("a")
    (b,) = s.allocate("a", 0, 1)
    with pytest.raises(ValueError, match="already held by request 'a'"):
        s.share("a", 0, [b])
    s.add_request("b")
    with pytest.raises(ValueError, match="neither held nor parked"):
        s.share("b", 0, [5])
    s.audit()


@pytest.mark.parametrize("policy", list(FencePolicy))
def test_holds_are_counted_under_either_policy(policy: FencePolicy) -> None:
    s = TransferScheduler(PoolLayout.shared(num_blocks=4, num_groups=1), policy=policy, managed_pool=False)
    s.add_request("a")
    s.assign("a", 0, [1, 2])
    s.add_request("b")
    s.assign("b", 0, [2, 3])  # block 2 is a's cached prefix: a second hold
    s.request_finished("a")
    assert s.take_reusable() == [(0, 1)]
    s.request_finished("b")
    assert sorted(s.take_reusable()) == [(0, 2), (0, 3)]
    s.audit()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("end", ["done_before_the_read_completed", "lease_lapsed"])
def test_a_shared_block_whose_exports_read_outlives_its_request_is_not_reused_by_the_last_holder(end: str) -> None:
    """a and b share a block; a's export is being read when a's request ends (the consumer's Done came before the
    read's completion, or a's lease lapsed); then b, the last holder, finishes. The block must wait for the
    read: before, b's release put it straight on the free list (b has no transfer of its own) and audit passed."""
    clock = _Clock()
    s = TransferScheduler(PoolLayout.shared(num_blocks=2, num_groups=1), lease_s=10.0, clock=clock)
    s.add_request("a")
    blocks = s.allocate("a", 0, 1)
    s.add_request("b")
    s.share("b", 0, blocks)
    s.step_scheduled(0, joined=["a", "b"])
    s.step_completed(0)
    s.request_finished("a", export=True)
    tid = s.post_export("a")
    if end == "lease_lapsed":
        clock.now = 11.0
        assert s.poll() == ["a"]
    else:
        assert s.export_done("a")
    s.request_finished("b")
    s.audit()
    s.add_request("c")
    assert isinstance(s.allocate("c", 0, 2), NotYet)  # one block is free, the other still read
    s.transfer_landed(tid)
    assert s.allocate("c", 0, 2) == (1, 0)
    s.audit()


def test_share_refuses_a_block_an_import_is_writing() -> None:
    """The importer aborts while its write is in flight and a sharer finishes: the block would go back with the
    RDMA write still landing. So no second hold on a block being written (share, and assign of a held block);
    the aborted importer's block stays quarantined until the write ends."""
    s = _managed(blocks=2)
    s.add_request("a", expect=(KV,))
    blocks = s.allocate("a", 0, 1)
    tid = s.post_import("a", components=(KV,))
    s.add_request("b")
    with pytest.raises(ValueError, match="being written by an import"):
        s.share("b", 0, blocks)
    s.abort("a")
    with pytest.raises(ValueError, match="being written by an import"):
        s.share("b", 0, blocks)  # parked under the write: still refused
    s.request_finished("b")
    s.add_request("c")
    assert isinstance(s.allocate("c", 0, 2), NotYet)
    s.transfer_failed(tid)
    assert len(s.allocate("c", 0, 2)) == 2
    s.audit()

    e = TransferScheduler(PoolLayout.shared(num_blocks=2, num_groups=1), managed_pool=False)
    e.add_request("a", expect=(KV,))
    e.assign("a", 0, [0])
    e.post_import("a", components=(KV,))
    e.add_request("b")
    with pytest.raises(ValueError, match="being written by an import"):
        e.assign("b", 0, [0])
    e.audit()
