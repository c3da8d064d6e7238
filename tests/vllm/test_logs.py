"""hybridkv's logs under vLLM's own logging set-up: formatted, filtered and written as NixlConnector's are.

vLLM configures only its ``vllm`` logger, in each of its processes (``configure_logging`` with a
``LoggingConfig`` from ``VLLM_LOGGING_LEVEL`` / ``VLLM_CONFIGURE_LOGGING``). A fresh process applies
it as vLLM's engine core does, builds the scheduler half of the connector, and logs one INFO line
through the connector and one through NixlConnector's logger.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CODE = r'''
import logging
from tests.vllm import harness as h  # vLLM's CPU platform, before vLLM is imported
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging, init_logger

configure_logging(LoggingConfig())  # what each vLLM process does at start (the environment decides)
vc = h.make_vllm_config(role="kv_producer", extra={"backends": ["UCX"]})  # a NixlConnector key: an INFO line
kcc = h.make_kv_cache_config(vc)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.SCHEDULER, kv_cache_config=kcc)
logging.getLogger("hybridkv.connectors.vllm.scheduler_half").info("HKV-INFO-LINE")
logging.getLogger("hybridkv.connectors.vllm.scheduler_half").warning("HKV-WARNING-LINE")
init_logger("vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector").info("NIXL-INFO-LINE")
'''

# vLLM's text format: "(ProcessName pid=N) LEVEL MM-DD HH:MM:SS [file.py:line] message"
LINE = r"^\(\S+ pid=\d+\) {level} \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+:\d+\] {msg}$"


def _start(**env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CODE], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_COLOR": "0", **env})


def _output(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out + err


@pytest.mark.slow
def test_connector_lines_follow_vllms_logging_set_up():
    # Three fresh processes (each imports vLLM, most of the time), side by side.
    procs = [_start(VLLM_LOGGING_LEVEL="INFO", VLLM_CONFIGURE_LOGGING="1"),
             _start(VLLM_LOGGING_LEVEL="WARNING", VLLM_CONFIGURE_LOGGING="1"),
             _start(VLLM_LOGGING_LEVEL="INFO", VLLM_CONFIGURE_LOGGING="0")]
    info, warning, unconfigured = (_output(p) for p in procs)
    text = info
    lines = text.splitlines()
    nixl = [x for x in lines if x.endswith("NIXL-INFO-LINE")]
    ours = [x for x in lines if x.endswith("HKV-INFO-LINE")]
    assert len(nixl) == 1 and len(ours) == 1, text[-3000:]
    # The same shape as NixlConnector's line.
    assert re.match(LINE.format(level="INFO", msg="NIXL-INFO-LINE"), nixl[0]), nixl[0]
    assert re.match(LINE.format(level="INFO", msg="HKV-INFO-LINE"), ours[0]), ours[0]
    # A start-up INFO line of the connector itself (its config names NixlConnector's keys it ignores),
    # its file and line named.
    start = [x for x in lines if "HybridKVConnector ignores NixlConnector's" in x]
    assert len(start) == 1 and re.match(LINE.format(level="INFO", msg=".*"), start[0]), text[-3000:]
    assert "[config.py:" in start[0] or "/config.py:" in start[0], start[0]

    # VLLM_LOGGING_LEVEL: the connector's INFO goes with vLLM's, its warnings stay.
    text = warning
    assert "NIXL-INFO-LINE" not in text and "HKV-INFO-LINE" not in text
    assert any(re.match(LINE.format(level="WARNING", msg="HKV-WARNING-LINE"), x) for x in text.splitlines())

    # VLLM_CONFIGURE_LOGGING=0: vLLM leaves logging alone, and so does the connector (Python's defaults).
    text = unconfigured
    assert "HKV-INFO-LINE" not in text and "NIXL-INFO-LINE" not in text
    assert "HKV-WARNING-LINE" in text.splitlines()
