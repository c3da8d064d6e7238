"""`hybridkv demo --device ...`: bad device arguments are one error line, before any process starts."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _demo(*args: str) -> subprocess.CompletedProcess:
    # main() imported, not `-m hybridkv.cli`: run as __main__, the module's CommandError would be another class
    # than the one the demo raises, and the error would surface as a traceback.
    return subprocess.run([sys.executable, "-c", "import sys; from hybridkv.cli import main; sys.exit(main())", "demo",
                           *args], capture_output=True, text=True, timeout=120)


def test_bad_devices_and_model_are_refused_with_exit_2():
    proc = _demo("--devices", "0", "--requests", "1")
    assert proc.returncode == 2 and "--devices '0'; expected two CUDA device indices" in proc.stderr
    proc = _demo("--model", "qwen3.5-7b", "--requests", "1")
    assert proc.returncode == 2 and "--model 'qwen3.5-7b'; expected one of" in proc.stderr


def test_cuda_without_a_gpu_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the demo would run (tests/reference/test_demo_gpu.py)")
    proc = _demo("--device", "cuda", "--requests", "1")
    assert proc.returncode == 1 and "torch sees no CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr
