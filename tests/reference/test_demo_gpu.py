"""The demo on a GPU (`hybridkv demo --device cuda`): Qwen3.5-0.8b-shaped caches in VRAM, moved by NIXL
between two processes on one GPU (or cuda:0 -> cuda:1 where there are two), checked byte for byte and token
by token. Needs a CUDA device and nixl-cu13: skipped in CI (no GPU), run on the H200 through
tools/device/demo_gpu.sh."""

from __future__ import annotations

import pytest

from hybridkv.connectors.reference.demo import DemoOptions, run_demo

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

GPU = dict(requests=12, device="cuda", model="qwen3.5-0.8b", min_prompt=16, max_prompt=512, chunk_size=128,
           min_tokens=6, max_tokens=12, attention_blocks=640, lease_s=20.0)


def _pair() -> tuple[int, int]:
    import torch

    return (0, 1) if torch.cuda.device_count() > 1 else (0, 0)


def test_cuda_demo_is_byte_and_token_exact_with_async_steps():
    report = run_demo(DemoOptions(**GPU, devices=_pair(), async_depth=2))
    assert report.mismatches == 0, report.mismatched
    assert report.byte_mismatches == 0, report.extra["byte_mismatched"]
    assert report.pages_checked >= report.requests * 2  # at least one attention page and the state page each
    assert report.leaked_blocks == 0 and report.failed == 0
    assert report.bytes_moved > report.requests * 19_000_000  # a 0.8b GDN state page is 19.5 MB
    # async scheduling for real: steps were enqueued before the previous step's results were taken back
    ahead = {k: int(v.split("/")[0]) for k, v in report.steps_overlapped.items()}
    assert ahead["decode"] > 0, report.steps_overlapped


def test_cuda_demo_without_fencing_is_caught():
    report = run_demo(DemoOptions(**GPU, devices=_pair(), async_depth=2, policy="none"))
    assert report.mismatches + report.byte_mismatches > 0
