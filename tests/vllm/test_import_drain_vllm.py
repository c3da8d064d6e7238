"""No block of a failed load goes back to vLLM while its READ can still land (fencing rule 5, per writer),
through the vLLM connector's consumer: a real vLLM 0.33.0 decode engine (scheduler, both connector halves,
tensors from vLLM's ``allocate_kv_cache``) in one process (drain_peer.py), a real prefill engine in another
(engine_peer.py), NIXL (UCX) between them.

The decode's load is the one of tests/transport/test_import_drain.py's pull cases, run the way vLLM runs it:
the producer is stopped (SIGSTOP) once its Export arrived, the decode's READ is posted and held, the lease
lapses and the load fails. The held READ may still write the blocks (NIXL's UCX backend releases a READ in
progress and says so, yet its bytes land once the peer answers: DataPlane.abort keeps such a handle), so the
worker must report the load to vLLM (``finished_recving``, which frees the blocks) only once the READ ended;
the request queued
behind it needs every usable block of the small pool, so the blocks it runs on are the load's. Its pages are
compared after the late READ would have landed. Both engines run over UCX's TCP transport only (set per
process: on loopback, shared memory or cma move a READ's bytes without the stopped producer).

Run with ``HYBRIDKV_DRAIN_RULE_OFF=1`` to switch the rule off in the decode (the core ledger's mutant,
tests/transport/drain_peers.py): every test here then fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.ports import free_ports
from tests.vllm.lines import JsonProcess

pytestmark = pytest.mark.slow

LEASE_S = 3.0  # the producer's lease: the held READ is given up once it lapses (no renewal from a stopped producer)
# The decode's pool: 15 usable blocks. The load takes 13 (10 attention blocks, one per GDN group); the request
# queued behind it takes 10 for its first chunk (7 attention blocks, one per GDN group) and 4 more for its last:
# it waits for the load's blocks and runs on all but one of them.
NUM_BLOCKS = 16
LOAD_PROMPT = 320
NEXT_PROMPT = 256


class Proc(JsonProcess):
    """One engine process over UCX's tcp transport (set in its own environment: nothing leaks to other tests)."""

    def __init__(self, module: str, cmd: dict, log) -> None:
        super().__init__(module, cmd, log, env={"UCX_TLS": "tcp"}, what="engine process")

    def quiet_for(self, seconds: float) -> dict | None:
        """The next JSON line if one comes within ``seconds``, else None."""
        try:
            return self.read(seconds)
        except AssertionError as exc:
            if "no answer" in str(exc):
                return None
            raise

    def signal(self, sig: int) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        if self.p.poll() is None:
            try:
                self.send({"stop": True})
                self.p.wait(20)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait(5)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A prefill engine and a decode engine, reused by the tests (the one that kills the producer last)."""
    log = open(tmp_path_factory.mktemp("drain") / "engines.log", "w")
    prod = Proc("tests.vllm.engine_peer", {"role": "producer", "dp_rank": 0, "dp_size": 1, "port": free_ports(1),
                                           "lease": LEASE_S, "policy": "fail"}, log)
    dec = Proc("tests.vllm.drain_peer", {"num_blocks": NUM_BLOCKS}, log)
    try:
        assert prod.read(300)["ready"]
        ready = dec.read(300)
        assert ready["usable"] == NUM_BLOCKS - 1, ready
        yield prod, dec
    finally:
        dec.stop()
        prod.stop()
        log.close()


def _held_load(prod: Proc, dec: Proc, rid: str) -> tuple[dict, float]:
    """The decode's load of ``rid`` posted with its producer stopped: (the producer's pages of it, when
    the producer stopped). The load fails at most a lease after the stop; its READ stays held."""
    prod.send({"prefill": [[rid, LOAD_PROMPT]]})
    got = prod.read()
    params, pages = got["params"][rid], got["pages"][rid]
    dec.send({"load": [f"d-{rid}", LOAD_PROMPT, params], "next": [f"next-{rid}", NEXT_PROMPT]})
    assert dec.read(60)["about_to_fetch"] == f"d-{rid}"
    prod.signal(signal.SIGSTOP)
    t_stop = time.monotonic()
    dec.send({"go": True})
    return pages, t_stop


def test_read_held_past_the_lease_lands_before_vllm_gets_the_blocks_back(engines):
    """The load fails (lease lapsed, READ held: kept, not released): vLLM must not get its blocks back, and
    the next request must not run on them, before the READ ended. Resumed, the producer serves the READ
    into them; only then does the next request write them, and its bytes are still there afterwards."""
    prod, dec = engines
    pages, t_stop = _held_load(prod, dec, "a")
    try:
        early = dec.quiet_for(LEASE_S + 1.0)  # past the lease: the load has failed, the READ is still held
    finally:
        t_resume = time.monotonic()
        prod.signal(signal.SIGCONT)
    reused = (early or dec.read(30))["reused"]
    time.sleep(0.5)  # the READ, resumed, has landed by now
    dec.send({"check": True})
    now = dec.read()["pages"]
    assert now["intact"], f"the failed load's READ overwrote pages the next request wrote: {reused}"
    assert early is None, f"the next request ran on the blocks while the failed load's READ was held: {early}"
    assert reused["failed"] and "quarantined" in (reused["result_error"] or ""), reused
    assert reused["shared"] >= reused["of"] - 1 and reused["shared_groups"] == 4, reused  # it ran on the load's
    assert reused["t_reuse"] >= reused["t_failed"] >= t_resume, (reused, t_resume)
    assert reused["found"] == pages, "the READ did not land in the load's blocks"  # it did land there
    assert now["in_flight"] == 0 and not now["settling"]


def test_producer_killed_while_the_read_is_held_keeps_the_blocks_until_the_read_ends(engines):
    """As above, then the producer is killed (SIGKILL) instead of resumed: its READ ends with the connection,
    and only then does vLLM get the blocks back (a killed writer's READ never lands: the time shows it)."""
    prod, dec = engines
    _, t_stop = _held_load(prod, dec, "b")
    early = dec.quiet_for(LEASE_S + 1.0)
    t_kill = time.monotonic()
    prod.signal(signal.SIGKILL)
    prod.p.wait(10)
    reused = (early or dec.read(60))["reused"]
    assert early is None, f"the next request ran on the blocks while the failed load's READ was held: {early}"
    assert reused["failed"] and "quarantined" in (reused["result_error"] or ""), reused
    assert reused["shared"] >= reused["of"] - 1 and reused["shared_groups"] == 4, reused
    assert reused["t_reuse"] >= reused["t_failed"] >= t_kill, (reused, t_kill)
    dec.send({"check": True})
    now = dec.read()["pages"]
    assert now["intact"] and now["in_flight"] == 0 and not now["settling"]
