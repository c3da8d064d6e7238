"""vLLM loads the connector from the built wheel by its new module path, hybridkv.connectors.vllm; the old
top-level path no longer exists (issue 45)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.packaging.wheel import build_wheel

pytestmark = pytest.mark.slow

LOAD = '''\
import sys
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

kvt = KVTransferConfig(kv_connector="HybridKVConnector", kv_connector_module_path=sys.argv[1], kv_role="kv_both")
cls = KVConnectorFactory.get_connector_class(kvt)
print(cls.__name__, sys.modules[cls.__module__].__file__)
'''


def test_vllm_loads_the_wheels_connector_by_its_new_path(tmp_path):
    wheel = build_wheel(tmp_path / "build")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    # The wheel's copy first on the path and the checkout absent from it: the editable install's finder
    # answers only for names the path does not hold.
    env = {**os.environ, "PYTHONPATH": str(target)}
    (tmp_path / "load.py").write_text(LOAD)
    new = subprocess.run([sys.executable, "load.py", "hybridkv.connectors.vllm"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert new.returncode == 0, new.stderr[-3000:]
    name, path = new.stdout.split()[-2:]
    assert name == "HybridKVConnector" and path.startswith(str(target)), new.stdout
    old = subprocess.run([sys.executable, "load.py", "connectors.vllm"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert old.returncode != 0 and "No module named 'connectors'" in old.stderr, old.stderr[-2000:]
