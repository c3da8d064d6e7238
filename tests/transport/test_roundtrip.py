"""Two real processes over NIXL (UCX, DRAM): pattern-filled regions, checksums compared."""

from __future__ import annotations

import pytest

from tests.transport.harness import consumer, producer

pytestmark = pytest.mark.slow

REQUESTS = [("r-long", 300, False), ("r-short", 20, False), ("r-mid", 100, True)]


@pytest.mark.parametrize("mode", ["PULL", "PUSH"])
def test_round_trip_checksums(mode):
    prod = producer(mode=mode, requests=REQUESTS)
    try:
        host, port, _ = prod.expect("addr")
        cons = consumer((host, port), mode=mode, requests=REQUESTS)
        sent = prod.expect("digests")
        results = cons.expect("results")
        got = cons.expect("digests")
        assert {r[0]: r[1] for r in results} == {rid: "READY" for rid, _, _ in REQUESTS}, results
        assert got == sent  # every byte of every block of every group arrived
        cstate = cons.expect("state")
        assert set(cstate["phases"].values()) == {"READY"}
        assert cstate["in_flight"] == 0
        assert {r[0]: r[1] for r in prod.expect("results")} == {rid: "DONE" for rid, _, _ in REQUESTS}
        pstate = prod.expect("state")
        assert pstate["free"] == pstate["total"]  # the producer freed every exported block
        assert pstate["in_flight"] == 0 and pstate["requests"] == 0
        # The metrics: every transfer counted once, on the side that posted it (pull: the consumer).
        poster, other = (cstate, pstate) if mode == "PULL" else (pstate, cstate)
        assert len(poster["metrics"]["bytes"]) == len(REQUESTS) and all(poster["metrics"]["bytes"])
        assert not other["metrics"]["bytes"] and not poster["metrics"]["failures"] and not other["metrics"]["failures"]
        if mode == "PULL":
            assert sorted(poster["metrics"]["bytes"]) == sorted(r[5] for r in results)
            assert sorted(poster["metrics"]["descriptors"]) == sorted(r[3] for r in results)
        if mode == "PULL":
            # NIXL merged back-to-back pages: far fewer descriptors posted than index pairs, and
            # exactly as many as the planner said (r-mid's blocks sit elsewhere than the source's).
            for rid, _, _, desc, idx, nbytes, planned in results:
                assert desc is not None and desc < idx or idx <= 2, (rid, desc, idx)
                assert desc == planned, (rid, desc, planned)
                assert nbytes > 0
        cons.expect("finished")
    finally:
        prod.stop()
