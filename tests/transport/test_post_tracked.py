"""A pull import's READs are in the consumer's ledger before any is posted, so that nothing but the post
itself runs between the post and the first poll of its state; a READ NIXL refuses leaves nothing open.

In process over the property suite's consumer (tests/property/stage.py): its data plane is a fake (named so
there: NIXL cannot be made to refuse a post at will); the Importer, Drains, ledger and scheduler are real.
"""

from __future__ import annotations

import asyncio

import numpy as np

from hybridkv import wire
from hybridkv.errors import TransferError
from hybridkv.fencing.fence import FencePolicy
from hybridkv.transport.config import Outcome
from hybridkv.transport.dataplane import XferState
from hybridkv.transport.fetch import Work
from hybridkv.transport.parts import Part
from tests.property.shadow import Clock
from tests.property.stage import D_BLOCKS, KV, ConsumerSide, ProducerSide


def _import(refuse: bool, at_check: bool = False):
    """One request of two pages pulled by consumer 0; returns (the ledger as each post saw it, the result,
    the consumer)."""
    clock = Clock()
    c = ConsumerSide(0, FencePolicy.FENCED, clock, ProducerSide(FencePolicy.FENCED, clock))
    rid, token = "r1", b"r1".ljust(wire.TOKEN_BYTES, b"#")
    c.sched.add_request(rid, expect=(KV,))
    mine = {0: np.asarray(c.sched.allocate(rid, 0, 2), dtype=np.int64)}
    tid = c.sched.post_import(rid, components=(KV,), lease_deadline=None)
    seen = []
    ready = c.importer._ready

    def readying(w, notif):
        if at_check:  # DataPlane.ready refuses it before any READ is posted
            raise ValueError("index arrays of shapes (2,) and (3,); expected equal non-empty 1-D (fake)")
        go = ready(w, notif)

        def posting():
            seen.append(c.importer._drains.describe())  # what the ledger tracks at the moment of the post
            if refuse:
                raise TransferError("NIXL refused the transfer (fake)")
            x = go()
            x.copy()
            x.state = XferState.DONE  # landed at once: the wait returns at its first poll
            return x

        return posting

    c.importer._ready = readying

    async def run():
        fut = asyncio.get_running_loop().create_future()
        part = Part(rid=rid, peer=c.producer, export=fut, token=token)
        work = Work(part=part, plan=c.planned.plan(0, {0: np.array([0, 1])}, mine))
        return await c.importer._pull_parts(rid, tid, [work], (KV,))

    return seen, asyncio.run(run()), c


def test_the_read_is_tracked_by_its_writer_before_it_is_posted():
    seen, res, c = _import(refuse=False)
    assert res.outcome is Outcome.READY
    assert len(seen) == 1 and [v["writers"] for v in seen[0].values()] == [["P"]]
    assert not c.importer._drains.describe()  # landed: nothing left open


def test_a_refused_post_fails_the_import_and_leaves_nothing_open():
    seen, res, c = _import(refuse=True)
    assert res.outcome is Outcome.FAILED and res.error == "NIXL refused the transfer (fake)"
    assert len(seen) == 1  # tracked before the refused post too
    assert not c.importer._drains.describe()  # the writer that never posted drained the import at once
    assert not c.sched.has_request("r1") and c.sched.free_count() == D_BLOCKS  # its blocks went back


def test_a_read_refused_at_its_check_posts_nothing_and_leaves_nothing_open():
    seen, res, c = _import(refuse=False, at_check=True)
    assert res.outcome is Outcome.FAILED and "expected equal non-empty 1-D" in res.error
    assert not seen  # checked before the posting window: nothing went out
    assert not c.importer._drains.describe()
    assert not c.sched.has_request("r1") and c.sched.free_count() == D_BLOCKS
