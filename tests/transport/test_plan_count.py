"""One planner: for the same request, the analyzer's hybridkv count, the count the consumer's
planner predicted and the descriptors NIXL's telemetry says it posted are one number.

Two real processes over NIXL (UCX, DRAM), pages paired whole (equal TP, equal block size):
the blocks of each request are the analyzer's own (hybridkv.descriptors.schemes.fragmented_blocks) at
fragmentation 0, 0.5 and 1, so the analyzer's Workload describes exactly the request moved.
"""

from __future__ import annotations

import pytest

from tests.transport.harness import consumer, producer

pytestmark = pytest.mark.slow

BLOCK = 48  # the analyzer's HMA-aligned block size for this geometry (asserted below)
REQUESTS = [("contiguous", 300, False), ("half", 200, False), ("scattered", 300, False)]
SPECS = {"contiguous": {"f": 0.0, "start": 0, "slot": 0}, "half": {"f": 0.5, "start": 12, "slot": 1},
         "scattered": {"f": 1.0, "start": 24, "slot": 2}}


def _analyzer(tokens: int, fragmentation: float) -> int:
    from hybridkv.descriptors.schemes import Scheme, Workload, count_descriptors
    from tests.transport.peers import geometry

    w = Workload(geometry=geometry(), tokens=tokens, block_size=BLOCK, fragmentation=fragmentation)
    assert w.effective_block_size == BLOCK
    return count_descriptors(Scheme.HYBRIDKV, w).descriptors


def test_analyzer_planner_and_nixl_agree_on_descriptors(capsys):
    prod = producer(requests=REQUESTS, block=BLOCK, fragmentation=SPECS)
    try:
        host, port, _ = prod.expect("addr")
        cons = consumer((host, port), requests=REQUESTS, block=BLOCK, fragmentation=SPECS)
        sent = prod.expect("digests")
        results = cons.expect("results")
        assert {r[0]: r[1] for r in results} == {rid: "READY" for rid, _, _ in REQUESTS}, results
        assert cons.expect("digests") == sent  # the pairing moved the right bytes
        tokens = {rid: t for rid, t, _ in REQUESTS}
        counts = {}
        for rid, _, _, posted, indices, nbytes, planned in results:
            analyzer = _analyzer(tokens[rid], SPECS[rid]["f"])
            counts[rid] = (analyzer, planned, posted, indices)
            assert posted == planned == analyzer, (rid, counts[rid])
        # Fragmentation shows in the count: merged runs, not one descriptor per page.
        assert counts["contiguous"][2] < counts["half"][2] < counts["scattered"][2]
        with capsys.disabled():
            for rid, (analyzer, planned, posted, indices) in counts.items():
                print(f"\n{rid} ({tokens[rid]} tokens, fragmentation {SPECS[rid]['f']}): analyzer {analyzer}, "
                      f"planner {planned}, NIXL posted {posted} (from {indices} index pairs)")
        cons.expect("finished")
    finally:
        prod.stop()
