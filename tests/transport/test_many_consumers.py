"""One producer, several consumer processes: each asks for the request it wants (wire.Want)."""

from __future__ import annotations

import pytest

from tests.transport.harness import consumer, producer

pytestmark = pytest.mark.slow

A = [("r-a", 200, False), ("r-a2", 40, True)]
B = [("r-b", 120, True)]


def test_two_consumers_read_different_requests_checksums():
    prod = producer(requests=A + B)
    try:
        host, port, _ = prod.expect("addr")
        ca = consumer((host, port), requests=A)
        cb = consumer((host, port), requests=B)
        sent = prod.expect("digests")
        for cons, mine in ((ca, A), (cb, B)):
            results = cons.expect("results")
            assert {r[0]: r[1] for r in results} == {rid: "READY" for rid, _, _ in mine}, results
            got = cons.expect("digests")
            assert got == {rid: sent[rid] for rid, _, _ in mine}  # each read its own request, byte for byte
            assert cons.expect("state")["in_flight"] == 0
        assert {r[0]: r[1] for r in prod.expect("results")} == {rid: "DONE" for rid, _, _ in A + B}
        pstate = prod.expect("state")
        assert pstate["free"] == pstate["total"] and pstate["requests"] == 0
        for cons in (ca, cb):
            cons.expect("finished")
    finally:
        prod.stop()


def test_second_claim_on_a_request_is_refused():
    one = [("r1", 100, False)]
    prod = producer(requests=one)
    try:
        host, port, _ = prod.expect("addr")
        ca = consumer((host, port), requests=one)
        cb = consumer((host, port), requests=one)
        outcomes = []
        for cons in (ca, cb):
            (rid, outcome, error, *_), = cons.expect("results")
            outcomes.append((outcome, error))
            state = cons.expect("state")
            assert state["in_flight"] == 0
            if outcome == "FAILED":  # the loser holds nothing
                assert state["free"] == state["total"] or state["phases"]["r1"] is None
        assert sorted(o for o, _ in outcomes) == ["FAILED", "READY"], outcomes
        error = next(e for o, e in outcomes if o == "FAILED")
        # Refused while the winner reads it, or after its export ended (the loser dialled late).
        assert "already claimed" in error or "already exported" in error, error
        assert {r[0]: r[1] for r in prod.expect("results")} == {"r1": "DONE"}
        pstate = prod.expect("state")
        assert pstate["free"] == pstate["total"]
    finally:
        prod.stop()
