"""hybridkv.transport.metrics: the counters every connector reports, as plain data."""

from __future__ import annotations

import threading

import msgpack
import pytest

from hybridkv.transport.metrics import FailureKind, MetricsSnapshot, TransferMetrics


def test_take_hands_out_what_was_counted_and_starts_over():
    m = TransferMetrics()
    m.transfer(nbytes=4096, descriptors=3, seconds=0.5, post_seconds=0.01)
    m.failure(FailureKind.LEASE)
    m.failure(FailureKind.LEASE)
    m.lease_expired()
    m.fence_wait(2)
    m.quarantined(5)
    m.quarantine_released(5)
    s = m.take()
    assert s.transfers == 1 and s.bytes == (4096,) and s.descriptors == (3,) and s.post_seconds == (0.01,)
    assert s.failures == {FailureKind.LEASE: 2} and s.num_failures == 2 and s.lease_expiries == 1
    assert s.fence_wait_steps == (2,) and s.quarantined_blocks == s.released_blocks == 5
    assert m.take().is_empty() and MetricsSnapshot().is_empty()


def test_the_payload_is_plain_data_and_round_trips():
    m = TransferMetrics()
    m.transfer(nbytes=1, descriptors=1, seconds=0.1)
    m.failure(FailureKind.HANDSHAKE)
    s = m.take()
    wire = msgpack.unpackb(msgpack.packb(s.to_dict()))  # what msgspec/pickle carry between processes
    assert MetricsSnapshot.from_dict(wire) == s
    assert s.merge(s).bytes == (1, 1) and s.merge(s).failures == {FailureKind.HANDSHAKE: 2}


def test_counts_from_many_threads_are_not_lost():
    m = TransferMetrics()

    def feed():
        for _ in range(2000):
            m.failure(FailureKind.TRANSFER)
            m.fence_wait(1)

    threads = [threading.Thread(target=feed) for _ in range(4)]
    for t in threads:
        t.start()
    taken = [m.take() for _ in range(20)]
    for t in threads:
        t.join()
    taken.append(m.take())
    total = MetricsSnapshot()
    for s in taken:
        total = total.merge(s)
    assert total.failures == {FailureKind.TRANSFER: 8000} and len(total.fence_wait_steps) == 8000


@pytest.mark.parametrize("bad, match", [
    ({"failures": {"nope": 1}}, "failure kind 'nope'"),
    ({"lease_expiries": -1}, "lease_expiries"),
    ({"bytes": [1]}, "equal lengths"),
    ({"extra": 1}, "unknown key"),
    ([1, 2], "expected a mapping"),
])
def test_a_bad_payload_is_refused_naming_it(bad, match):
    with pytest.raises(ValueError, match=match):
        MetricsSnapshot.from_dict(bad)


def test_bad_input_is_refused():
    m = TransferMetrics()
    with pytest.raises(ValueError, match="FailureKind"):
        m.failure("lease")
    with pytest.raises(ValueError, match="expected >= 0"):
        m.fence_wait(-1)
