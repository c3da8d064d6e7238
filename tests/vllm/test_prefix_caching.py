"""Prefix caching with the real vLLM 0.33.0 scheduler (vLLM's default), at both ends.

vLLM 0.33 turns prefix caching on a Mamba/GDN model into ``mamba_cache_mode='align'``. On the
prefill side, requests that share a prefix share its cached blocks: each export is a read hold
(rule 7 of docs/design.md), and a block goes back to vLLM only after its last holder. On the
decode side the connector accepts vLLM's divergent hybrid hits (the full-attention hit reported
as the local prefix): a load moves only the attention suffix the decode does not hold, paired
with the tail of the producer's list, and always the running GDN state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from tests.vllm import harness as h
from tests.ports import free_ports
from tests.vllm.test_worker_nixl import _read

ROOT = Path(__file__).resolve().parents[2]


def test_prefix_caching_on_a_hybrid_model_starts_in_align_mode():
    vc = h.make_vllm_config(role="kv_producer", prefix_caching=True)
    assert vc.cache_config.mamba_cache_mode == "align"  # vLLM's own choice for prefix caching
    kcc = h.make_kv_cache_config(vc)
    sched = h.make_scheduler(vc, kcc, async_scheduling=True)
    assert sched.connector.supports_divergent_local_hybrid_hits


def test_requests_that_share_a_block_export_it_under_counted_holds():
    """The issue's crash: two finished requests whose exports name one block (a cached prefix)."""
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from hybridkv.connectors.vllm.metadata import HybridKVWorkerMetadata

    vc = h.make_vllm_config(role="kv_producer", prefix_caching=True)
    kcc = h.make_kv_cache_config(vc)
    sched = h.make_scheduler(vc, kcc, async_scheduling=False)
    half = sched.connector.scheduler
    groups = len(kcc.kv_cache_groups)
    (att,) = [g for g in half.transfer_groups if g not in half._mamba_spec_blocks]
    reqs = []
    for rid, own in (("a", 5), ("b", 6)):
        r = h.make_request(rid, prompt_len=40, max_tokens=1, params={"do_remote_decode": True})
        r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        r.num_computed_tokens = 40
        ids = [[] for _ in range(groups)]
        for g in half.transfer_groups:
            ids[g] = [4, own] if g == att else [10 * own + g]  # block 4: the shared prefix
        delay, params = half.request_finished(r, tuple(ids))
        assert delay and params is not None
        reqs.append(r)
    assert half.ts.holders(att, 4) == ("a", "b")
    from vllm.v1.core.sched.output import SchedulerOutput

    half.build_connector_meta(SchedulerOutput.make_empty())
    half.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=HybridKVWorkerMetadata(step=0)))
    out = KVConnectorOutput(finished_sending={"a"}, kv_connector_worker_meta=HybridKVWorkerMetadata(step=0))
    half.update_connector_output(out)
    # a's read is done, but block 4 is b's too: vLLM hears of a once b lets it go as well.
    assert half.ts.holders(att, 4) == ("b",) and "a" not in (out.finished_sending or ())
    out = KVConnectorOutput(finished_sending={"b"}, kv_connector_worker_meta=HybridKVWorkerMetadata(step=0))
    half.update_connector_output(out)
    assert out.finished_sending == {"a", "b"}
    assert half.idle()


# a: the common prefix alone; b: the prefix and a suffix of its own; c: a's prompt again.
PROMPTS = [("a", 128, 1, 128), ("b", 170, 2, 128), ("c", 128, 1, 128)]
# d: a's prompt and one token more. Decode holds all of it but the token it computes itself (as after
# any load): a zero-token load, which decode tells the prefill instead of loading.
ZERO = ("d", 129, 1, 129)


@pytest.mark.slow
def test_prefix_caching_at_both_ends_moves_only_the_missing_suffix(tmp_path):
    from vllm.v1.engine import FinishReason

    port = free_ports()
    log = open(tmp_path / "peer.log", "w")
    peer = subprocess.Popen([sys.executable, "-m", "tests.vllm.prefix_peer", str(port)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        vc = h.make_vllm_config(role="kv_consumer", async_scheduling=True, engine_id="decode-engine",
                                prefix_caching=True)
        kcc = h.make_kv_cache_config(vc)
        sched = h.make_scheduler(vc, kcc, async_scheduling=True)
        conn, kv_caches = h.make_worker(vc, kcc)
        # Decode's steps write what they compute (the last prompt token, the decoded ones), as a model does.
        runner = h.RealWorker(conn, kv_caches, sched, writes=True, only_new=True, seed=1)
        d = h.Driver(sched, runner, async_scheduling=True)
        assert _read(peer, 120)["ready"] == port
        pages_path = tmp_path / "pages.msgpack"
        # Every export is read or released within 20 s; an unreleased one would be held for the lease (30 s).
        peer.stdin.write(json.dumps({"requests": [*PROMPTS, ZERO], "pages": str(pages_path),
                                     "free_within": 20}) + "\n")
        peer.stdin.flush()
        params = _read(peer, 120)["params"]
        sent = msgpack.unpackb(pages_path.read_bytes(), raw=False)
        half = sched.connector.scheduler
        (att,) = [i for i, g in enumerate(half.transfer_groups) if g not in half._mamba_spec_blocks]
        remote = {rid: params[rid]["remote_block_ids"] for rid, *_ in PROMPTS}
        # Prefill: b and c hit a's cached blocks; their exports hold them together.
        assert set(remote["a"][att]) & set(remote["b"][att]) and set(remote["a"][att]) & set(remote["c"][att])
        att_layers = set(kcc.kv_cache_groups[half.transfer_groups[att]].layer_names)

        def load(rid, n, seed, prefix):
            # What a P/D proxy does: forward the producer's kv_transfer_params to decode.
            sched.add_request(h.make_request(rid, prompt_len=n, max_tokens=4, params=dict(params[rid]),
                                             suffix_seed=seed, prefix_len=prefix))
            d.run_for(60, until=lambda: rid in d.finished)
            assert d.finished[rid][0] is FinishReason.LENGTH and not runner.failed, runner.failed

        load(*PROMPTS[0])  # a: nothing cached on decode yet, every block moves
        for p in PROMPTS[1:]:
            load(*p)
        load(*ZERO)
        assert "d" not in runner.order_blocks  # nothing to load: released to the prefill instead
        for rid, *_ in PROMPTS:
            order = runner.order_blocks[rid]
            # The request's whole attention table on decode, when its load landed, holds what prefill
            # computed: the prefix from decode's own cache (an earlier load, completed by decode's
            # own steps), the suffix from this load.
            for name in att_layers:
                assert runner.table_pages[rid][name] == sent[rid][name], f"{rid} layer {name}: bytes differ"
            # What moved: the GDN state and the attention suffix only, paired with prefill's tail.
            got = runner.snapshots[rid]
            for name, pages in got.items():
                want = sent[rid][name][-len(pages):] if name in att_layers else sent[rid][name]
                assert pages == want, f"{rid} layer {name}: bytes differ"
            moved = len(order[att])
            if rid == "a":
                assert moved == len(remote[rid][att])
            else:
                assert 0 < moved < len(remote[rid][att]), (rid, moved, remote[rid][att])
        # Bytes on the wire: every load moves the same GDN state (whole, padded pages); beyond
        # that, exactly the attention blocks it loaded.
        block_bytes = sum(len(sent["a"][name][0]) for name in att_layers)
        base = conn.worker.load_results["a"].nbytes - len(remote["a"][att]) * block_bytes
        for rid, *_ in PROMPTS:
            assert conn.worker.load_results[rid].nbytes == base + len(runner.order_blocks[rid][att]) * block_bytes
        end = _read(peer, 90)
        assert end["freed"], end  # every shared block went back to prefill's vLLM after its last reader
        d.run_for(10, until=lambda: h.free_blocks(sched) == kcc.num_blocks - 1)
        d.drain()
        assert half.idle()
        conn.shutdown()
    finally:
        if peer.poll() is None:
            peer.kill()
        peer.wait(10)
        log.close()
