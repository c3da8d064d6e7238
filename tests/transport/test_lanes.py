"""Lanes: a lane is worked on by one worker at a time, in order; other lanes go to other workers meanwhile."""

from __future__ import annotations

from hybridkv.transport.lanes import Lanes


def test_a_held_lane_never_blocks_another_and_keeps_its_order():
    lanes: Lanes[str] = Lanes()
    lanes.put("slow", "s1")
    lanes.put("slow", "s2")
    lanes.put("fast", "f1")
    assert lanes.take(0.01) == ("slow", "s1")  # a worker holds "slow" (its decode stalls)
    assert lanes.take(0.01) == ("fast", "f1")  # the next worker is not queued behind it
    assert lanes.take(0.01) is None and lanes.queued() == 1  # s2 waits for s1: a room's chunks stay in order
    lanes.put("fast", "f2")
    lanes.done("fast")
    assert lanes.take(0.01) == ("fast", "f2")
    lanes.done("slow")
    assert lanes.take(0.01) == ("slow", "s2")
    lanes.done("slow")
    lanes.done("fast")
    assert lanes.queued() == 0 and lanes.take(0.01) is None
