"""Start the forkserver every rank process forks from before the first test, so that
its one import of SGLang runs beside the pytest process's own (tests/sglang/pd_peer.py);
and the lab-mode pair most modules use: a decode manager in this process and a prefill
rank process, one of each per module (a module may define its own, as test_auth does)."""

from __future__ import annotations

import multiprocessing.forkserver

import pytest

from tests.sglang import pd_peer


@pytest.fixture(scope="session", autouse=True)
def _rank_processes_share_one_sglang_import():
    pd_peer.context()
    multiprocessing.forkserver.ensure_running()
    yield


@pytest.fixture(scope="module")
def decode():
    sa = pd_peer.configure("decode", port=pd_peer.free_port(), bootstrap_port=pd_peer.free_port())
    pools = pd_peer.make_pools(None)
    mgr = pd_peer.make_manager("decode", pools, sa)
    yield mgr, pools
    mgr.close()


@pytest.fixture(scope="module")
def prefill():
    p, port = pd_peer.prefill_rank()
    p.addr = f"127.0.0.1:{port}"
    yield p
    p.close()
