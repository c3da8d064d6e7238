"""A request's blocks move between two worker processes over NIXL (UCX), bytes compared.

The prefill side runs in its own process (prefill_peer.py); this process is
the decode side. Both sides: vLLM 0.33.0's real Scheduler, our connector's two
halves built by vLLM's factory, KV tensors allocated by vLLM's own
``allocate_kv_cache`` for the tiny hybrid config (block-outermost BLHNC,
HMA-aliased groups, GDN conv/SSM pages) and adopted into a hybridkv layout.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from tests.ports import free_ports

from tests.vllm import harness as h

ROOT = Path(__file__).resolve().parents[2]


def _read(proc, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"prefill peer exited with {proc.returncode}")
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("{"):
                return json.loads(line)
    raise AssertionError(f"no answer from the prefill peer in {timeout} s")


@pytest.mark.slow
def test_request_moves_between_two_worker_processes(tmp_path):
    """Qwen3.5 with MTP speculative decoding on both sides under async scheduling: the prefill's real
    AsyncScheduler truncates the prompt by the backoff (the drafter's lookahead less one, as NixlConnector's
    _prefill_backoff), decode's loads exactly that range, then decodes with draft tokens scheduled; every
    layer's blocks arrive byte for byte, the draft layers' (``mtp.layers.N``) included, each GDN group's running state and not a speculative scratch slot, in fewer NIXL descriptors
    than NixlConnector's for the same config."""
    from vllm.v1.engine import FinishReason

    from tests.vllm import families as fam

    # Three MTP modules drafting three tokens (multi-module MTP): the drafter's lookahead makes the backoff 2,
    # beyond GDN's 1, so the prefill and decode halves must agree on it.
    case, opts, prompt = "qwen3.5-mtp-bf16", {"mtp": 3, "mtp_modules": 3}, 100
    port = free_ports()
    log = open(tmp_path / "peer.log", "w")
    peer = subprocess.Popen(
        [sys.executable, "-m", "tests.vllm.prefill_peer", str(port), "async", case, json.dumps(opts)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    conn = None
    try:
        vc, kcc, kv = fam.build(case, role="kv_consumer", engine_id="decode-engine", async_scheduling=True, **opts)
        assert vc.num_speculative_tokens == 3 and vc.speculative_config.use_multi_module_mtp()
        assert any(getattr(g.kv_cache_spec, "num_speculative_blocks", 0) == 3 for g in kcc.kv_cache_groups)
        conn = fam.worker(vc, kcc, kv)
        sched = h.make_scheduler(vc, kcc, async_scheduling=True)
        runner = h.RealWorker(conn, kv, sched, writes=False)
        d = h.Driver(sched, runner, async_scheduling=True)
        backoff = sched.connector.scheduler.prefill_backoff
        assert backoff == vc.num_prefill_lookahead_tokens - 1 == 2
        assert _read(peer, 120)["ready"] == port
        pages_path = tmp_path / "pages.msgpack"
        peer.stdin.write(json.dumps({"prompt_len": prompt, "pages": str(pages_path)}) + "\n")
        peer.stdin.flush()
        params = _read(peer, 60)["params"]
        assert params["remote_num_tokens"] == prompt - backoff  # the prefill left the backoff to decode
        sched.add_request(h.make_request("d1", prompt_len=prompt, max_tokens=8, params=params))
        d.run_for(60, until=lambda: "d1" in d.finished)
        assert d.finished["d1"][0] is FinishReason.LENGTH and not runner.failed, conn.worker.load_errors
        assert d.drafts_scheduled.get("d1", 0) > 0  # decode ran speculative steps after the load
        sent = msgpack.unpackb(pages_path.read_bytes(), raw=False)
        got = runner.snapshots["d1"]
        assert set(got) == set(sent) == set(kv) and {f"mtp.layers.{j}.self_attn.attn" for j in range(3)} <= set(got)
        for name in sent:
            assert len(got[name]) == len(sent[name]) > 0
            assert got[name] == sent[name], f"layer {name}: bytes differ"
        # What the prefill's forward wrote, not zeros (it leaves speculative scratch slots untouched): the draft
        # layer's KV moved, and each GDN group's running state did, not a scratch slot.
        assert all(any(page) for name in got for page in got[name]), [n for n in got if not all(map(any, got[n]))]
        # One GDN slot per state group: the running state, never a speculative scratch slot.
        for g, ids in zip(kcc.transfer_group_ids, runner.order_blocks["d1"]):
            if getattr(kcc.kv_cache_groups[g].kv_cache_spec, "num_speculative_blocks", None):
                assert len(ids) == 1
        result = conn.worker.load_results["d1"]
        blocks = sum(len(b) for b in runner.order_blocks["d1"])
        # Block-outermost pages: at most one descriptor per block of every group
        # (NixlConnector posts one per layer region per block, per GDN sub-field).
        assert 0 < result.descriptors <= blocks
        vllm_ids = h.nixl_connector_descriptor_ids(runner.order_blocks["d1"], case=(case, opts))
        assert result.descriptors < vllm_ids
        print(f"\nsame request, same config: hybridkv (BLHNC) posted {result.descriptors} NIXL descriptor(s) for "
              f"{blocks} blocks ({result.nbytes} bytes); vLLM 0.33.0 NixlConnector (LBHNC) would hand NIXL "
              f"{vllm_ids} descriptor ids")
        end = _read(peer, 90)
        assert end["freed"], end
        d.run_for(10, until=lambda: h.free_blocks(sched) == kcc.num_blocks - 1)
        d.drain()
        assert sched.connector.scheduler.idle()
    finally:
        if conn is not None:
            conn.shutdown()
        if peer.poll() is None:
            peer.kill()
        peer.wait(10)
        log.close()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["unreachable", "tp2_unreachable"])
def test_failed_load_by_policy_recompute_recovers(fault):
    """Real faults, no fake: the producer named in kv_transfer_params is not there
    (with TP 2 there, this decode rank dials both of its producer ranks: neither answers)."""
    from vllm.v1.engine import FinishReason

    vc = h.make_vllm_config(role="kv_consumer", policy="recompute", engine_id="decode-engine")
    kcc = h.make_kv_cache_config(vc)
    sched, conn, runner, d = h.real_decode(vc, kcc, async_scheduling=False)
    params = h.remote_prefill_params("d1", groups=len(kcc.transfer_group_ids))
    params["remote_port"] = free_ports()  # nobody listens there
    if fault == "tp2_unreachable":
        params["tp_size"] = 2
    sched.add_request(h.make_request("d1", prompt_len=100, max_tokens=2, params=params))
    try:
        d.run_for(60, until=lambda: "d1" in d.finished)
        assert runner.failed == {"d1"}
        assert d.finished["d1"][0] is FinishReason.LENGTH  # recomputed locally
        d.drain()
        assert h.free_blocks(sched) == kcc.num_blocks - 1
        assert sched.connector.scheduler.idle()
    finally:
        conn.shutdown()
