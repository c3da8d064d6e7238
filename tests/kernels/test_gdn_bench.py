"""CPU: `hybridkv bench gdn` refuses what it cannot measure, and the breakdown's arithmetic and table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridkv.kernels.gdn.breakdown import Breakdown, render


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridkv.cli", "bench", "gdn", *args], capture_output=True,
                          text=True, timeout=120)


def test_breakdown_idle_is_call_time_minus_kernel_time():
    b = Breakdown(name="hybridkv", call_us=100.0, kernels=(("_chunk_state_kernel", 60.0), ("_inv", 25.5)))
    assert b.kernel_us == pytest.approx(85.5)
    assert b.idle_us == pytest.approx(14.5)
    # Profiler and event clocks differ slightly: a call never shows negative idle time.
    assert Breakdown(name="x", call_us=10.0, kernels=(("k", 10.4),)).idle_us == 0.0
    text = render("35B 1x8192", [b])
    assert text.splitlines()[0] == "35B 1x8192"
    assert "call    100.0 us = kernels     85.5 + idle    14.5" in text
    # A pipelined call's kernels overlap on two streams: said so, not shown as zero idle.
    piped = Breakdown(name="hybridkv", call_us=480.0, kernels=(("_chunk_state_kernel", 450.0), ("_inv", 145.0)))
    assert piped.overlap_us == pytest.approx(115.0) and piped.idle_us == 0.0
    assert "call    480.0 us < kernels    595.0: 115.0 us ran side by side" in render("35B 1x8192", [piped])
    assert "60.0 us  _chunk_state_kernel" in text


@pytest.mark.parametrize(("args", "message"), [
    (("--iters", "0"), "--iters must be >= 1, got 0"),
    (("--breakdown",), "bench gdn needs a CUDA device"),
])
def test_bench_gdn_refuses_with_a_clear_error(args, message):
    torch = pytest.importorskip("torch")
    if "--breakdown" in args and torch.cuda.is_available():
        pytest.skip("with a GPU this would run the benchmark")
    done = _cli(*args)
    assert done.returncode != 0
    assert message in done.stderr


def test_tuned_choices_name_each_self_tuning_kernel():
    pytest.importorskip("triton")
    from hybridkv.kernels.gdn import bench, triton_chunk, triton_recurrent  # noqa: F401

    tuned = bench._tuned_choices()
    assert set(tuned) == {"chunk state (H, HV, log2 work, K, V; BV, warps, stages)", "decode (BV, warps)"}
    assert all(picks == {} for picks in tuned.values())  # nothing ran here
