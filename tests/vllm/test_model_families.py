"""Every model family vLLM 0.33 serves starts and moves: layout from vLLM's KVCacheConfig, not the HF config.

Real vllm==0.33.0 on CPU, tiny configs (families.py): Qwen3.5 with and without MTP, bf16 and fp8 KV
cache; a dense Llama-shaped model (also with attention kernel blocks smaller than the logical block);
a Mamba2 hybrid (Nemotron-H-shaped); an MLA model (DeepSeek-V3-shaped). Both halves start (vLLM's
Scheduler builds the scheduler half; vLLM's factory the worker half, registered with the tensors of
``allocate_kv_cache``); a request's blocks move P -> D between two processes over NIXL (UCX), bytes
compared layer by layer, the MTP draft layer's included. A KV cache hybridkv cannot move is refused
when vLLM constructs the connector, naming the layer and why.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from tests.vllm import families as fam
from tests.vllm import harness as h

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 100


@pytest.mark.parametrize("case", list(fam.CASES))
def test_both_halves_start_with_the_layout_vllm_decided(case):
    from hybridkv.layout import AttentionSpec, DType, GDNSpec, StateSpec

    vc, kcc, kv = fam.build(case, role="kv_consumer", engine_id="decode-engine")
    sched = h.make_scheduler(vc, kcc, async_scheduling=False)  # vLLM builds the scheduler half
    assert sched.connector.scheduler is not None
    conn, _ = _worker(vc, kcc, kv)  # the worker half, registered with the tensors vLLM allocated
    try:
        specs, layout = conn.worker.specs, conn.worker.layout
        assert set(specs.layer_names) == {n for g in kcc.kv_cache_groups for n in g.layer_names}
        # Every layer's fields sit in the layout under its own number, named by vLLM's layer name.
        placed = {f.key[1] for g in layout.groups for p in g.placements for f in p.fields}
        assert placed == set(range(len(specs.layer_names)))
        opts = fam.CASES[case]
        attn = [s for s in specs.geometry.layers if isinstance(s, AttentionSpec)]
        assert attn
        if opts.get("kv_cache_dtype") == "fp8":
            assert {(s.dtype, s.encoding) for s in attn} == {(DType.UINT8, "fp8")}
        else:
            assert {s.dtype for s in attn} == {DType.BFLOAT16}
        if opts.get("mtp"):
            draft = specs.layer_index("mtp.layers.0.self_attn.attn")
            assert specs.draft_layers == {"mtp.layers.0.self_attn.attn"}
            assert isinstance(specs.geometry.layers[draft], AttentionSpec)
            gdn = [s for s in specs.geometry.layers if isinstance(s, GDNSpec)]
            assert {s.conv_kernel for s in gdn} == {4 + 1}  # vLLM keeps the draft token's conv column
        if opts["family"] == "qwen3.5":
            assert {s.ssm_dtype for s in specs.geometry.layers if isinstance(s, GDNSpec)} == {DType.FLOAT32}
        if opts["family"] == "nemotron_h":
            states = [s for s in specs.geometry.layers if isinstance(s, StateSpec)]
            assert len(states) == 3 and {s.family for s in states} == {"mamba2"}
        if opts["family"] == "deepseek":
            assert {(s.num_kv_heads, s.head_dim, s.head_dim_v) for s in attn} == {(1, 96, 0)}  # the MLA latent
    finally:
        conn.shutdown()


def test_an_unsupported_cache_is_refused_when_the_scheduler_half_is_built():
    """Cross-attention (an encoder-decoder's cache) cannot move: the SCHEDULER-role connector refuses it,
    naming the layer and why, before any request is served."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from hybridkv.connectors.vllm.specs import UnsupportedKVCache

    vc = fam.make_config("llama", role="kv_consumer")
    spec = CrossAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.encoder_attn.attn"], spec)])
    with pytest.raises(UnsupportedKVCache, match=r"'model.layers.0.encoder_attn.attn' is vLLM's CrossAttentionSpec; "
                                                 r"hybridkv cannot move it: an encoder-decoder's cross-attention"):
        KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.SCHEDULER, kv_cache_config=kcc)


def _read(proc, timeout: float, *, key: str = "ready", case: str | None = None) -> dict:
    """The peer's next answer holding ``key`` (for ``case``): an earlier case's late answers (a test that
    failed mid-way) are skipped, so one failure does not fail the cases after it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"family peer exited with {proc.returncode}")
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("{"):
                answer = json.loads(line)
                if key in answer and answer.get("case") == case:
                    return answer
    raise AssertionError(f"no {key!r} from the family peer in {timeout} s")


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    """One producer process for every case (vLLM imported once)."""
    log_path = tmp_path_factory.mktemp("family-peer") / "peer.log"
    log = open(log_path, "w")
    peer = subprocess.Popen([sys.executable, "-m", "tests.vllm.family_peer"], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert _read(peer, 300)["ready"]
        yield peer
        peer.stdin.write(json.dumps({"quit": True}) + "\n")
        peer.stdin.flush()
        peer.wait(30)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)
        log.close()


def _load(prefill, tmp_path, *, produced: str, consumed: str, expect_read: bool):
    """The peer exports a request of case ``produced``; a decode worker of case ``consumed`` loads it.
    Returns (decode connector, tensors, KV cache config, its blocks, the producer's pages, failed?)."""
    from hybridkv.connectors.vllm.metadata import HybridKVConnectorMetadata, RecvOrder
    from hybridkv.connectors.vllm.params import RemotePrefill

    pages = tmp_path / "pages.msgpack"
    prefill.stdin.write(json.dumps({"case": produced, "pages": str(pages), "tokens": TOKENS}) + "\n")
    prefill.stdin.flush()
    params = _read(prefill, 300, key="params", case=produced)["params"]
    vc, kcc, kv = fam.build(consumed, role="kv_consumer", engine_id="decode-engine")
    conn, _ = _worker(vc, kcc, kv)
    try:
        # Decode holds the request in other blocks than prefill did (its own pool).
        local = fam.request_blocks(kcc, tokens=TOKENS, first=kcc.num_blocks // 2)
        order = RecvOrder(request_id="d1", transfer_id=1, local_block_ids=local,
                          remote=RemotePrefill.from_params(params))
        conn.worker.start_step(HybridKVConnectorMetadata(step=0, recvs=[order]))
        deadline, done = time.monotonic() + 120, set()
        failed: set[str] = set()
        while "d1" not in done:
            assert time.monotonic() < deadline, "the load did not finish in 120 s"
            r = conn.worker.transfer_results()
            done |= r.finished_recving
            failed |= r.failed_recving
            time.sleep(0.01)
    finally:
        prefill.stdin.write(json.dumps({"finish": True, "expect_read": expect_read}) + "\n")
        prefill.stdin.flush()
    sent = _read(prefill, 90, key="sent", case=produced)["sent"]
    return conn, kv, kcc, local, msgpack.unpackb(pages.read_bytes(), raw=False), bool(failed), sent


@pytest.mark.slow
@pytest.mark.parametrize("case", list(fam.CASES))
def test_a_request_moves_prefill_to_decode_layer_by_layer(case, prefill, tmp_path):
    conn, kv, kcc, local, sent, failed, read = _load(prefill, tmp_path, produced=case, consumed=case,
                                                     expect_read=True)
    try:
        assert not failed, conn.worker.load_errors.get("d1")
        assert read  # the producer saw its export read
        got = fam.read(kv, kcc, local)
        assert set(got) == set(sent) == set(conn.worker.specs.layer_names)  # every layer, draft included
        for name in sent:
            assert len(got[name]) == len(sent[name]) > 0
            assert got[name] == sent[name], f"layer {name}: bytes differ"
        if fam.CASES[case].get("mtp"):
            draft = got["mtp.layers.0.self_attn.attn"]
            assert any(any(page) for page in draft)  # the draft layer's KV moved with the request
    finally:
        conn.shutdown()


#: (produced, consumed) -> the compatibility key that differs, decode's value and prefill's.
WHY_REFUSED = {
    ("qwen3.5-mtp-bf16", "qwen3.5-bf16"): ("vllm.speculative", "none", "mtp:1:"),
    ("qwen3.5-fp8", "qwen3.5-bf16"): ("vllm.kv_cache_dtype", "auto", "fp8"),
}


@pytest.mark.slow
@pytest.mark.parametrize(("produced", "consumed"), [
    ("qwen3.5-mtp-bf16", "qwen3.5-bf16"),  # MTP on prefill only: a draft layer and conv column decode lacks
    ("qwen3.5-fp8", "qwen3.5-bf16"),  # fp8 KV on prefill only
])
def test_an_incompatible_pair_is_refused_at_the_handshake(produced, consumed, prefill, tmp_path):
    """Layouts from each side's KVCacheConfig (and vLLM's speculative config and kv-cache dtype in the
    handshake's compatibility map) differ: the pair is refused before a byte moves, never a shifted read."""
    conn, *_, failed, sent = _load(prefill, tmp_path, produced=produced, consumed=consumed, expect_read=False)
    try:
        assert failed and not sent
        error = str(conn.worker.load_errors["d1"])
        assert "HandshakeRefused" in error, error
        # The consumer's error names the key that differs and both values, as the producer's log does.
        key, here, there = WHY_REFUSED[(produced, consumed)]
        assert re.search(rf"{re.escape(key)}: local '{re.escape(here)}[^']*', peer '{re.escape(there)}", error), error
        assert error.count(f"{key}:") == 1, error  # once, as decode sees it
    finally:
        conn.shutdown()


def _worker(vc, kcc, kv):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    conn = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.WORKER, kv_cache_config=kcc)
    conn.register_kv_caches(kv)
    return conn, kv
