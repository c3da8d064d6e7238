"""Two real processes over NIXL (UCX) with VRAM regions: pattern-filled pages, checksums compared."""

from __future__ import annotations

import pytest

from tests.transport.harness import consumer, producer

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

REQUESTS = [("v-long", 300, False), ("v-short", 20, False), ("v-mid", 100, True)]


@pytest.mark.parametrize("mode", ["PULL", "PUSH"])
def test_vram_round_trip_checksums(mode):
    prod = producer(mode=mode, requests=REQUESTS, mem="vram")
    try:
        host, port, _ = prod.expect("addr")
        cons = consumer((host, port), mode=mode, requests=REQUESTS, mem="vram")
        sent = prod.expect("digests")
        results = cons.expect("results")
        got = cons.expect("digests")
        assert {r[0]: r[1] for r in results} == {rid: "READY" for rid, _, _ in REQUESTS}, results
        assert got == sent  # every byte of every block landed in the consumer's GPU memory
        if mode == "PULL":  # the consumer posts the READs, so it counts the bytes
            assert all(nbytes > 0 for *_, nbytes in results), results
        pstate = prod.expect("state")
        assert pstate["free"] == pstate["total"] and pstate["in_flight"] == 0
        cons.expect("finished")
    finally:
        prod.stop()
