"""Start the forkserver every rank process forks from before the first test, so that
its one import of SGLang runs beside the pytest process's own (tests/sglang/pd_peer.py)."""

from __future__ import annotations

import multiprocessing.forkserver

import pytest


@pytest.fixture(scope="session", autouse=True)
def _rank_processes_share_one_sglang_import():
    from tests.sglang import pd_peer

    pd_peer.context()
    multiprocessing.forkserver.ensure_running()
    yield
