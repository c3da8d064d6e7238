"""Heterogeneous TP and block sizes: one process per TP rank on each side, bytes compared field by field."""

from __future__ import annotations

import pytest

from hybridkv.descriptors.planning import source_ranks
from tests.transport import hetero_peers
from tests.transport.harness import Proc

pytestmark = pytest.mark.slow

REQUESTS = [("r1", 200), ("r2", 70)]


def _analyzer_descriptors(p_tp: int, d_tp: int, block: int, tokens: int) -> int:
    from hybridkv.descriptors.schemes import Workload, hybridkv_plans
    from tests.transport.peers import geometry

    w = Workload(geometry=geometry(), tokens=tokens, block_size=block, tp_prefill=p_tp, tp_decode=d_tp,
                 fragmentation=0.0)
    assert w.effective_block_size == block
    return sum(p.num_descriptors for p in hybridkv_plans(w))


@pytest.mark.parametrize("p_tp,d_tp,p_block,d_block", [
    pytest.param(1, 2, 48, 48, id="P1-D2"),
    pytest.param(2, 1, 48, 48, id="P2-D1"),
    pytest.param(2, 1, 16, 32, id="P2-D1-blocks16to32"),
])
def test_hetero_tp_field_by_field(p_tp, d_tp, p_block, d_block, capsys):
    prods = [Proc(hetero_peers.producer_main, {"tp": p_tp, "rank": r, "block": p_block, "requests": REQUESTS})
             for r in range(p_tp)]
    conss = []
    try:
        addrs = [p.expect("addr") for p in prods]
        for d in range(d_tp):
            ranks, readers = source_ranks(d_tp, d, p_tp)
            conss.append(Proc(hetero_peers.consumer_main, {
                "tp": d_tp, "rank": d, "block": d_block, "requests": REQUESTS, "readers": readers,
                "addrs": [addrs[r] for r in ranks]}))
        sent = [p.expect("fields") for p in prods]
        measured = {rid: 0 for rid, _ in REQUESTS}
        for cons in conss:
            results = cons.expect("results")
            assert {r[0]: r[1] for r in results} == {rid: "READY" for rid, _ in REQUESTS}, results
            got = cons.expect("fields")
            sources = cons.expect("sources")
            owner = {key: rank for rank, keys in sources.items() for key in keys}
            for rid, _ in REQUESTS:
                assert set(owner) == set(got[rid])  # every field of this rank came from some producer rank
                for key, digest in got[rid].items():
                    assert digest == sent[owner[key]][rid][key], (rid, key, owner[key])
            for rid, _, _, desc, nbytes, planned in results:
                assert desc and nbytes > 0
                assert desc == planned, (rid, desc, planned)  # NIXL posted what the planner said
                measured[rid] += desc
            state = cons.expect("state")
            assert set(state["phases"].values()) == {"READY"} and state["in_flight"] == 0
            cons.expect("finished")
        for p in prods:  # every producer rank freed its blocks: each reader told it Done
            assert {r[0]: r[1] for r in p.expect("results")} == {rid: "DONE" for rid, _ in REQUESTS}
            state = p.expect("state")
            assert state["free"] == state["total"] and state["in_flight"] == 0
        with capsys.disabled():
            for rid, tokens in REQUESTS:
                line = f"\nP TP{p_tp} (block {p_block}) -> D TP{d_tp} (block {d_block}), {tokens} tokens: " \
                       f"{measured[rid]} NIXL descriptors posted over all decode ranks"
                if p_block == d_block:
                    analyzer = _analyzer_descriptors(p_tp, d_tp, p_block, tokens)
                    line += f"; analyzer (hybridkv scheme): {analyzer}"
                    assert measured[rid] == analyzer
                print(line)
    finally:
        for p in prods + conss:
            p.stop()
