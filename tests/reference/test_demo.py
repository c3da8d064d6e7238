"""The demo's flow in reduced size: real prefill and decode processes over NIXL, token-exact."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridkv.connectors.reference.demo import DemoOptions, run_demo

pytestmark = pytest.mark.slow

SMALL = dict(requests=8, max_prompt=70, min_tokens=4, max_tokens=8)


def _assert_clean(report) -> None:
    assert report.mismatches == 0, report.mismatched
    assert report.byte_mismatches == 0, report.extra["byte_mismatched"]
    assert report.leaked_blocks == 0
    assert report.transport == "nixl" and report.processes == 3


def test_disaggregated_is_token_exact_request_by_request():
    report = run_demo(DemoOptions(**SMALL, async_depth=2))
    _assert_clean(report)
    assert report.failed == 0 and report.recomputed == 0
    assert report.tokens == sum(n for n in report.extra["expected_lengths"].values())
    assert 0 < report.descriptors_per_request < report.vllm_033_descriptors_per_request
    assert report.bytes_moved > 0
    # every imported request's pages were compared with the export: its attention pages and its state page
    assert report.pages_checked >= 2 * report.requests


def test_drop_transfer_recovers_by_recompute():
    report = run_demo(DemoOptions(**SMALL, inject=("drop-transfer",)))
    _assert_clean(report)
    assert report.faults_injected == report.faults["drop-transfer"] >= 1
    assert report.recomputed == report.faults["drop-transfer"]  # the affected ones, and only they


def test_drop_transfer_under_fail_policy_fails_only_the_affected():
    report = run_demo(DemoOptions(**SMALL, inject=("drop-transfer",), failure_policy="fail"))
    assert report.leaked_blocks == 0
    assert report.failed == report.faults["drop-transfer"] >= 1
    assert set(report.mismatched) == set(report.extra["failed_ids"])  # unaffected requests untouched


def test_killed_decode_is_restarted_and_its_requests_redone():
    report = run_demo(DemoOptions(**SMALL, inject=("kill-decode",)))
    _assert_clean(report)
    assert report.faults["kill-decode"] == 1
    assert report.resent >= 1  # the requests the dead process held were prefilled again


def test_late_completion_reaches_the_late_path_and_recomputes():
    """The decode stalls (its whole process) past the lease right after one READ landed: the scheduler
    answers LATE for that import (rule 6: bytes that land after the lease are not trusted), the request
    recomputes, and every output still matches."""
    report = run_demo(DemoOptions(**SMALL, inject=("late-completion",)))
    _assert_clean(report)
    assert report.faults["late-completion"] == 1
    assert report.extra["late"], report.extra  # the late path was reached, not just a slow completion
    assert report.recomputed >= len(report.extra["late"]) and report.failed == 0


def test_prefill_stalled_during_the_handshake_is_waited_out():
    """The prefill process is SIGSTOPped for 8 s while the decode handshakes (one try gives up at 5 s):
    the decode retries instead of dying, and the run completes token-exact."""
    report = run_demo(DemoOptions(**SMALL, inject=("stall-prefill",)))
    _assert_clean(report)
    assert report.faults["stall-prefill"] == 1 and report.failed == 0


def test_without_fencing_the_corruption_is_real():
    """FencePolicy.NONE in both engines: freed slots are reused under in-flight steps and
    zeroing runs over landed KV, so outputs differ: the equality above is not luck."""
    report = run_demo(DemoOptions(requests=10, max_prompt=70, min_tokens=6, max_tokens=10, policy="none"))
    assert report.mismatches > 0
    # ... and the byte check sees it where it happens: imported pages differ from what was exported
    assert report.byte_mismatches > 0 and report.pages_mismatched > 0


def test_cli_json_last_line_and_exit_code():
    proc = subprocess.run([sys.executable, "-m", "hybridkv.cli", "demo", "--requests", "4", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("requests", "mismatches", "leaked_blocks", "processes", "async_depth", "transport",
                "faults_injected"):
        assert key in out
    assert out["requests"] == 4 and out["mismatches"] == 0 and out["transport"] == "nixl"
