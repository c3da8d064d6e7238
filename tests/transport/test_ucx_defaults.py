"""hybridkv's UCX defaults: set before the first agent, never over the operator's own setting."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import os
from hybridkv.transport.dataplane import DataPlane
from tests.transport.peers import build
layout, memory, _ = build(1)
dp = DataPlane(memory)
print(os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY"))
dp.close()
"""


@pytest.mark.parametrize(("preset", "expected"), [(None, "on"), ("auto", "auto"), ("off", "off")])
def test_cuda_ipc_reads_default_on_unless_set(preset, expected):
    """A real agent is created in a fresh process (UCX reads the variable when the backend starts)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"}
    if preset is not None:
        env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = preset
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expected
