"""Heterogeneous TP and block sizes: one process per TP rank on each side, bytes compared field by field.

Each pair moves three requests: ``r1`` and ``r3`` staged (transport/staging.py: the producer packs
the decode rank's head slices into a slot, the decode rank reads the slot), ``r2`` sliced (head slice
by head slice, as NixlConnector's list does). Every decode rank's bytes are compared field by field with the
producer rank it read each from; every block and every staging slot goes back on both sides. The
descriptors each decode rank posts are what the analyzer's hybridkv scheme says (with the same
staging config, or none), and a staged read posts at most a tenth of NixlConnector's list for the
same request (the analyzer's vllm-0.33 model).

Every Export is in before the first READ (``want_first``), so a slot given back before its read
ended (``HYBRIDKV_STAGING_RULE_OFF=1``) is overwritten by r3's slices before r1 reads it, and the
comparison fails.
"""

from __future__ import annotations

import pytest

from tests.transport import hetero_peers

pytestmark = pytest.mark.slow

# r1 long enough that NixlConnector's list is long (it grows with the blocks; a staged read does not);
# both requests fit the 64 attention pages of tests/transport/peers.py on each side.
REQUESTS = [("r1", 1500), ("r2", 200), ("r3", 300)]
SHORT = [("r1", 600), ("r2", 70), ("r3", 100)]  # 16-token blocks take 3x the pages
FOUR = {"num_kv_heads": 4, "num_k_heads": 4, "num_v_heads": 4}  # heads TP 4 can split
# Blocks here are allocated back to back, so a sliced plan merges across blocks and AUTO would keep
# it (already short): ON stages every read it is asked to. SLOT (direct_rows 1) has every staged read
# go through a slot of the decode rank's and its unpack; with ON the decode rank reads the producer's
# slot straight into its pages where that is short (P1-D2, P2-D1), through a slot where it is not
# (16- to 32-token blocks).
ON = {"mode": "on"}
SLOT = {"mode": "on", "direct_rows": 1}


def _workload(p_tp, d_tp, block, tokens, geo, staging):
    from hybridkv.descriptors.schemes import Workload
    from tests.transport.peers import geometry

    w = Workload(geometry=geometry(**(geo or {})), tokens=tokens, block_size=block, tp_prefill=p_tp,
                 tp_decode=d_tp, fragmentation=0.0, staging=staging)
    assert w.effective_block_size == block
    return w


@pytest.mark.parametrize("p_tp,d_tp,p_block,d_block,geo,requests,staging", [
    pytest.param(2, 1, 48, 48, None, REQUESTS, ON, id="P2-D1"),
    pytest.param(1, 2, 48, 48, None, REQUESTS, ON, id="P1-D2"),
    pytest.param(4, 1, 48, 48, FOUR, REQUESTS, SLOT, id="P4-D1-slot"),
    pytest.param(2, 1, 16, 32, None, SHORT, ON, id="P2-D1-blocks16to32"),
])
def test_hetero_tp_field_by_field(p_tp, d_tp, p_block, d_block, geo, requests, staging, capsys):
    from hybridkv.descriptors.schemes import Scheme, count_descriptors, hybridkv_plans
    from hybridkv.transport.staging import StagingConfig, StagingMode

    measured = hetero_peers.run_pair(p_tp, d_tp, p_block, d_block, requests, staging=staging, sliced=["r2"],
                                     want_first=True, geo=geo)
    config = StagingConfig(**{**staging, "mode": StagingMode(staging["mode"])})
    with capsys.disabled():
        for rid, tokens in requests:
            staged = rid != "r2"
            most = max(measured[rid]["per_rank"])
            line = (f"\nP TP{p_tp} (block {p_block}) -> D TP{d_tp} (block {d_block}), {tokens} tokens, "
                    f"{'staged' if staged else 'sliced'}: {measured[rid]['per_rank']} descriptors per decode rank")
            if p_block == d_block:  # the analyzer models one block size on both sides
                w = _workload(p_tp, d_tp, p_block, tokens, geo, config if staged else None)
                analyzer = sum(p.num_descriptors for p in hybridkv_plans(w))
                nixl = count_descriptors(Scheme.VLLM_033, w).per_decode_rank
                line += f"; analyzer (hybridkv scheme): {analyzer} in all; NixlConnector's list {nixl}"
                assert measured[rid]["total"] == analyzer
                if rid == "r1":  # the long one (r3 is there for the slot fence)
                    assert most * 10 <= nixl, (most, nixl)
            elif rid == "r1":  # each producer rank's slot read into one slot of the decode rank's
                assert most <= p_tp, measured[rid]
            print(line)
    if staging is SLOT:  # every staged read of a fetch lands in a slot of ours: all are unpacked in one run
        assert measured["unpack_runs"] == [sum(rid != "r2" for rid, _ in requests)] * d_tp, measured["unpack_runs"]


def test_model_run_checked_sized_and_weighed():
    """`python -m tests.transport.hetero_peers --model`, without its processes (the device runs those): bad
    arguments refused, a decode rank's predicted reads cover its request exactly, and the gather speed it says
    AUTO stages above is where staging.route turns."""
    from hybridkv import wire
    from hybridkv.layout.alloc import VirtualAllocator
    from hybridkv.transport.staging import Route
    from tests.transport.peers import model_geometry

    for bad in (["--model", "nope"], ["--model", "gemma-3-4b-it"], ["--gather-gbps", "100"], ["--pairs", "2:2"],
                ["--model", "qwen3.5-9b", "--gather-gbps", "0"]):
        with pytest.raises(SystemExit):
            hetero_peers.parse_args(bad)
    args = hetero_peers.parse_args(["--model", "qwen3.5-9b", "--pairs", "2:1,8:2", "--gather-gbps", "150"])
    assert args.pairs == [(2, 1), (8, 2)] and args.gather_gbps == 150.0
    g, tokens = model_geometry("qwen3.5-9b"), 1000
    for kernel in (None, 16):
        block, pools = hetero_peers._model_pools(g, 2, 1, tokens, 6, kernel)
        pred = hetero_peers.predict(g, 2, 1, tokens, block, pools)
        dst = hetero_peers._shard_layout(g, 1, 0, block, VirtualAllocator(), **pools)
        assert len(pred["parts"]) == 2 and pred["decode_bytes"] == 2 * pred["prefill_bytes"]
        if kernel is None:  # hybridkv's layout (a region per group): TP1 reads its whole request, half from each
            whole = sum(dst.regions[gr.placements[0].region_id].page_bytes * hetero_peers._counts(dst, tokens)[gid]
                        for gid, gr in ((gr.group_id, gr) for gr in dst.groups))
            assert [p["nbytes"] for p in pred["parts"]] == [whole // 2] * 2
        for part in pred["parts"]:
            r = hetero_peers.routes(part, wire.Mem.VRAM, None)
            assert r["on"] is Route.SLOT  # sliced pieces land piece by piece here: through a slot of the decode's
            even = r["break_even_gbps"]
            assert hetero_peers.routes(part, wire.Mem.VRAM, even * 1.01)["auto_at"] is Route.SLOT
            assert hetero_peers.routes(part, wire.Mem.VRAM, even * 0.99)["auto_at"] is Route.SLICED
