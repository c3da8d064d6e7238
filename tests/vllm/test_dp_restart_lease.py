"""Data-parallel engines, a restarted producer and a decode queue longer than the lease, with the real vLLM.

Every engine is its own process (engine_peer.py): vLLM 0.33.0's config for its DP rank, its
real Scheduler, our connector's scheduler and worker halves from vLLM's factory, KV tensors
from vLLM's ``allocate_kv_cache``, NIXL (UCX) between the processes. The test is the router:
it sends prompts to prefill engines and forwards the ``kv_transfer_params`` they return to a
decode engine, as vLLM's toy proxy does. Bytes are compared layer by layer; each prefill
engine writes its own random bytes, so a read from the wrong rank would not match.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ports import free_ports
from tests.vllm.test_hetero_tp import Rank

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


class Engine(Rank):
    """One engine process (engine_peer.py), driven by JSON lines."""

    def __init__(self, cmd: dict, log) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "tests.vllm.engine_peer"], cwd=ROOT, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=log, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
        self._buf = b""
        self.send(cmd)

    def ready(self) -> list | None:
        return self.read(300)["address"]

    def prefill(self, prompts: dict[str, int]) -> tuple[dict, dict]:
        self.send({"prefill": [[rid, n] for rid, n in prompts.items()]})
        got = self.read(120)
        return got["params"], got["pages"]

    def decode(self, requests: list[tuple[str, int, int, dict]], timeout: float = 120) -> dict:
        self.send({"decode": [list(r) for r in requests]})
        return self.read(timeout)["done"]

    def wait_free(self, seconds: float) -> dict:
        self.send({"wait_free": seconds})
        return self.read(seconds + 30)

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                self.send({"stop": True})
            except (BrokenPipeError, OSError):
                pass
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(5)


def _same_bytes(done: dict, pages: dict, rid: str) -> None:
    got = done[rid]
    assert not got["failed"], (rid, got)
    assert got["reason"] == "length", (rid, got)
    assert got["pages"] and got["pages"] == pages[rid], f"{rid}: the bytes read are not the ones its prefill wrote"


#: Prefill DP rank 1 has a 4 s lease (the queue test; shorter ones lapse on a loaded 2-core host before
#: the decode's first handshake ends); DP rank 0 the default 30 s (the restart
#: test shows an abort freeing blocks long before it). Decode DP rank 1 runs one request at a time.
PREFILL = [{"role": "producer", "dp_rank": 0, "dp_size": 2, "seed": 100, "lease": 30},
           {"role": "producer", "dp_rank": 1, "dp_size": 2, "seed": 200, "lease": 4.0}]
DECODE = [{"role": "consumer", "dp_rank": 0, "dp_size": 2, "policy": "recompute", "export_timeout": 30},
          {"role": "consumer", "dp_rank": 1, "dp_size": 2, "policy": "fail", "max_num_seqs": 1}]


def _warm_up(engines: list[Engine]) -> None:
    """Each decode engine loads one request from each prefill engine before the tests, retried until
    one lands. A decode renews a producer's lease only over a link, and the first link's handshake
    (two NIXL agents, metadata both ways) took over 4 s on a loaded 2-core CI host: longer than
    prefill DP rank 1's lease, so the first test's loads lapsed. The tests are about routing, leases
    and restarts, not about the cost of a first handshake."""
    for d in engines[2:]:
        for p in engines[:2]:
            for attempt in range(3):
                rid = f"warm-{engines.index(d)}-{engines.index(p)}-{attempt}"
                params, _ = p.prefill({rid: 16})
                if not d.decode([(rid, 16, 1, params[rid])])[rid]["failed"]:
                    break
            else:
                raise AssertionError(f"decode engine {engines.index(d)} never loaded from prefill engine "
                                     f"{engines.index(p)} in 3 tries (see the engines' log)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two prefill DP engines sharing one host and one base port, and a decode endpoint of two
    DP engines: four processes, started side by side once for the module (vLLM's import is
    most of a process's start-up)."""
    base = free_ports(2)
    log = open(tmp_path_factory.mktemp("dp") / "engines.log", "w")
    cmds = [{**c, "port": base} for c in PREFILL] + DECODE
    engines = [Engine(c, log) for c in cmds]
    try:
        addresses = [e.ready() for e in engines]
        _warm_up(engines)
        yield {"base": base, "log": log, "engines": engines, "addresses": addresses, "cmds": cmds}
    finally:
        for e in engines:  # all at once: each takes seconds to close its NIXL agent
            if e.p.poll() is None:
                try:
                    e.send({"stop": True})
                except OSError:
                    pass
        for e in engines:
            e.stop()
        log.close()


def test_dp2_prefill_to_dp2_decode_every_request_on_its_rank(cluster):
    """The prefill engines listen on distinct ports, kv_transfer_params name the engine that
    computed the request, and each decode DP engine reads from both prefill engines."""
    p0, p1, d0, d1 = cluster["engines"]
    a0, a1, _, _ = cluster["addresses"]
    base = cluster["base"]
    assert (a0[1], a1[1]) == (base, base + 1)  # DP rank d listens on base + d x TP + rank: no collision
    assert a0[2] != a1[2]  # each engine's worker is its own incarnation
    params0, pages0 = p0.prefill({"a0": 100, "a1": 60})
    params1, pages1 = p1.prefill({"b0": 100, "b1": 80})
    for params, address in ((params0, a0), (params1, a1)):
        for p in params.values():
            assert p["remote_ranks"] == [address]
            assert (p["remote_host"], p["remote_port"]) == (address[0], address[1])
    # Same prompt, two engines: different bytes, so reading the wrong engine cannot pass.
    assert pages0["a0"] != pages1["b0"]
    pages = {**pages0, **pages1}
    d0.send({"decode": [["a0", 100, 3, params0["a0"]], ["b0", 100, 3, params1["b0"]]]})
    d1.send({"decode": [["a1", 60, 3, params0["a1"]], ["b1", 80, 3, params1["b1"]]]})
    done0, done1 = d0.read(120)["done"], d1.read(120)["done"]
    for rid in ("a0", "b0"):
        _same_bytes(done0, pages, rid)
    for rid in ("a1", "b1"):
        _same_bytes(done1, pages, rid)
    for p in (p0, p1):
        end = p.wait_free(30)
        assert end["freed"], end  # every export read and released


def test_decode_queue_longer_than_the_lease_loses_nothing(cluster):
    """Prefill DP rank 1 leases for 4 s; decode DP rank 1 runs one request at a time and is busy
    with long local requests, so five loads wait in its queue for longer than the lease and the
    prefill scheduler's 1.5 x lease hold. Decode renews every queued request from arrival:
    every load succeeds under kv_load_failure_policy "fail", bytes equal."""
    _, p1, _, d1 = cluster["engines"]
    lease = PREFILL[1]["lease"]
    # Decode's only running slot stays busy until the abort below: one local request ends by itself after
    # ~900 steps, which a quiet host runs in about 6 s (the queue then waited 5.95 s, under the 1.5 x lease
    # the check below needs), so three queue ahead of the loads (first come, first served).
    busy = ["busy0", "busy1", "busy2"]
    d1.send({"local": [[rid, 32, 900] for rid in busy]})
    prompts = {f"q{i}": 48 + 16 * i for i in range(5)}
    params, pages = p1.prefill(prompts)
    d1.send({"decode": [[rid, n, 4, params[rid]] for rid, n in prompts.items()]})
    # The engine also sees each message a step or so late on a loaded host (at load 13 on 2 cores the queue
    # waited 5.85 s of a 2.5 x lease sleep).
    time.sleep(3.5 * lease)
    d1.send({"abort": busy})  # the slot frees: the queued loads run one after another
    done = d1.read(120)["done"]
    waited = min(r["seconds"] for r in done.values())
    assert waited > 1.5 * lease, f"the queue never outlived the lease ({waited:.1f} s): the test shows nothing"
    for rid in prompts:
        _same_bytes(done, pages, rid)
    end = p1.wait_free(30)
    assert end["freed"], end


def test_restarted_producer_old_requests_fail_fast_new_ones_load(cluster):
    """Prefill DP rank 0 is SIGKILLed and started again at the same address: a request it
    prefilled before dying fails at once (recompute policy: computed locally), not after the
    30 s export timeout or lease; a request of the new incarnation loads, bytes equal. Then an
    abort on decode is told to the prefill, which frees the blocks at once (lease 30 s)."""
    engines = cluster["engines"]
    p, d = engines[0], engines[2]
    first = cluster["addresses"][0]
    params, pages = p.prefill({"x1": 80, "x2": 64})
    _same_bytes(d.decode([("x1", 80, 2, params["x1"])]), pages, "x1")  # decode knows incarnation 1
    p.p.send_signal(signal.SIGKILL)
    p.p.wait(10)
    engines[0] = restarted = Engine({**cluster["cmds"][0], "seed": 101}, cluster["log"])
    second = restarted.ready()
    assert second[:2] == first[:2] and second[2] != first[2]  # same address, new incarnation
    params3, pages3 = restarted.prefill({"x3": 96})
    assert params3["x3"]["remote_ranks"] == [second]
    t0 = time.monotonic()
    done = d.decode([("x2", 64, 2, params["x2"]), ("x3", 96, 2, params3["x3"])], timeout=60)
    elapsed = time.monotonic() - t0
    assert done["x2"]["failed"] and done["x2"]["reason"] == "length", done["x2"]  # recomputed locally
    assert done["x2"]["seconds"] < 10 and elapsed < 20, (done, elapsed)  # not the 30 s timeout
    _same_bytes(done, pages3, "x3")
    # Leases from arrival, aborts told: decode queues x4 and aborts it before it is allocated.
    params4, _ = restarted.prefill({"x4": 64})
    d.send({"decode": [["x4", 64, 2, params4["x4"]]], "abort": ["x4"]})
    end = restarted.wait_free(20)
    assert end["freed"] and end["seconds"] < 10, end  # freed on the decode's word, not after 45 s
