"""Stalls degrade instead of failing (issue 26 item 4), with real processes stopped and resumed.

A decode that stalls past its lease recomputes its requests under ``recompute`` (even while a step
touching their blocks is pending); a prefill that stalls past the lease before exporting answers the
consumers already asking at once, instead of leaving them to their export timeout; a producer that
stalls during the handshake is waited out by retries with backoff. Every scenario ends with nothing
in flight and every block back in its pool (or held by a request computing locally).
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.transport.harness import consumer, producer

pytestmark = pytest.mark.slow

ONE = [("r1", 200, False)]


def _outcomes(results):
    return {r[0]: r[1] for r in results}


def test_handshake_retried_past_a_stopped_producer():
    """The producer is SIGSTOPped while the consumer dials, for longer than one handshake timeout:
    the retry after backoff completes the handshake, and the request lands byte-exact."""
    prod = producer(requests=ONE, linger_s=0.3)
    try:
        host, port, _ = prod.expect("addr")
        prod.signal(signal.SIGSTOP)
        cons = consumer((host, port), requests=ONE, handshake_timeout_s=1.5, handshake_retries=2,
                        handshake_backoff_s=0.5)
        cons.expect("dialing")
        time.sleep(2.5)  # past the first try's 1.5 s, inside the second's window (2.0 - 3.5 s)
        prod.signal(signal.SIGCONT)
        assert cons.expect("connected") is None
        assert _outcomes(cons.expect("results")) == {"r1": "READY"}
        assert cons.expect("digests") == prod.expect("digests")
        assert _outcomes(prod.expect("results")) == {"r1": "DONE"}
        pstate = prod.expect("state")
        assert pstate["free"] == pstate["total"] and pstate["in_flight"] == 0
    finally:
        prod.signal(signal.SIGCONT)
        prod.stop()


def test_handshake_retries_then_fails_without_killing_the_caller():
    """A producer that stays stopped: every try times out, then connect raises HandshakeTimeout,
    after the retries and their backoff (not before), and the consumer process carries on."""
    prod = producer()
    try:
        host, port, _ = prod.expect("addr")
        prod.expect("ready")
        prod.signal(signal.SIGSTOP)
        cons = consumer((host, port), handshake_timeout_s=1.0, handshake_retries=2, handshake_backoff_s=0.25)
        kind, text, took = cons.expect("connect_failed")
        assert kind == "HandshakeTimeout" and "3 tries" in text, text
        assert 3 * 1.0 + 0.25 + 0.5 <= took < 10, took
        cons.expect("finished")
    finally:
        prod.signal(signal.SIGCONT)
        prod.stop()


@pytest.mark.parametrize("policy", ["RECOMPUTE", "FAIL"])
def test_decode_stopped_past_its_lease_recomputes_under_a_pending_step(policy):
    """The decode process is SIGSTOPped after the Export arrived, past the lease (its heartbeats stop
    too). The producer lets the lease lapse and frees the blocks; resumed, the consumer can no longer
    post the read. A zeroing step of its blocks is still pending (post_import answers not yet): under
    recompute the request computes locally all the same, under fail it fails; nothing leaks."""
    prod = producer(requests=ONE, lease_s=1.0, linger_s=0.5)
    try:
        host, port, _ = prod.expect("addr")
        cons = consumer((host, port), requests=ONE, signal_before_fetch=True, pending_step=True, policy=policy)
        cons.expect("about_to_fetch")
        cons.signal(signal.SIGSTOP)
        time.sleep(2.5)
        cons.signal(signal.SIGCONT)
        cons.send("go")
        (rid, outcome, error, *_), = cons.expect("results")
        cstate = cons.expect("state")
        assert outcome == {"RECOMPUTE": "RECOMPUTE", "FAIL": "FAILED"}[policy], (outcome, error)
        assert "lease" in error, error
        assert cstate["in_flight"] == 0
        if policy == "RECOMPUTE":
            assert cstate["phases"]["r1"] == "LOCAL"  # keeps its blocks and computes them here
        else:
            assert cstate["phases"]["r1"] is None
        assert _outcomes(prod.expect("results")) == {"r1": "EXPIRED"}
        pstate = prod.expect("state")
        assert pstate["free"] == pstate["total"] and pstate["in_flight"] == 0 and pstate["requests"] == 0
    finally:
        cons.signal(signal.SIGCONT)
        prod.stop()


def test_prefill_stalled_past_the_lease_answers_queued_wants_at_once():
    """The consumer asks first (its Want waits in the producer's queue), then the prefill's loop blocks
    (a stall of the whole process) between finishing the request and exporting it, past the lease. Resumed, the
    producer expires the export and tells that consumer at once: it recomputes within seconds, not
    after its 20 s export timeout."""
    prod = producer(requests=ONE, lease_s=1.0, stall_before_export_s=2.0, linger_s=0.3)
    try:
        host, port, _ = prod.expect("addr")
        t0 = time.monotonic()
        cons = consumer((host, port), requests=ONE, policy="RECOMPUTE", export_timeout_s=20.0)
        (rid, outcome, error, *_), = cons.expect("results", timeout=30)
        took = time.monotonic() - t0
        assert outcome == "RECOMPUTE" and "lease expired" in error, (outcome, error)
        assert took < 12, took  # consumer start-up (~2-4 s) + the 2 s stall; the export timeout is 20 s
        cstate = cons.expect("state")
        assert cstate["in_flight"] == 0 and cstate["phases"]["r1"] == "LOCAL"
        assert _outcomes(prod.expect("results")) == {"r1": "EXPIRED"}
        pstate = prod.expect("state")
        assert pstate["free"] == pstate["total"] and pstate["in_flight"] == 0 and pstate["requests"] == 0
    finally:
        prod.stop()
