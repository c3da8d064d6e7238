"""A vLLM decode engine whose load's READ is held, for test_import_drain_vllm.py: one process.

vLLM 0.33.0's real config, real ``Scheduler``, our connector's two halves from vLLM's factory, KV
tensors from vLLM's ``allocate_kv_cache``; the forward pass writes random bytes into every block a
scheduled request holds. The pool is small (``num_blocks``), so that the request queued behind the load
(``next``, whose prompt needs every usable block) runs only once the load's blocks are vLLM's again: the
blocks it writes are the very ones the held READ may still write.

The one thing added around the real path is a gate: the worker's load of the remote request starts only
once its producer's Export arrived and the test said "go" (meanwhile the test stops the producer, so the
READ is posted and held). ``UCX_TLS`` is set by the test in this process's environment: over TCP a READ's
bytes move only as the stopped producer answers it.
With ``HYBRIDKV_DRAIN_RULE_OFF=1`` the core ledger's rule is switched off here (tests/transport/drain_peers).

One JSON object per line on stdin/stdout:
  -> {"num_blocks"}
  <- {"ready": true, "usable": n}
  -> {"load": [rid, prompt_len, params], "next": [rid, prompt_len]}
  <- {"about_to_fetch": rid}                         the load has its Export; held at the gate
  -> {"go": true}
  <- {"reused": {...}}                               the next request ran (on the load's blocks)
  -> {"check": true}
  <- {"pages": {...}}                                the load's blocks now, against what the next request left
  -> {"stop": true}
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
import sys
import threading
import time
import zlib

_out = threading.Lock()


def _say(obj) -> None:
    with _out:
        print(json.dumps(obj), flush=True)


def _reader(q: queue.Queue) -> None:
    for line in sys.stdin:
        if line.strip():
            q.put(json.loads(line))
    q.put({"stop": True})


def _digests(pages: dict[str, list[bytes]]) -> dict[str, str]:
    return {name: hashlib.sha256(b"".join(p)).hexdigest() for name, p in pages.items()}


def _prompt_seed(rid: str) -> int:
    """The prompt the prefill engine computed for ``rid`` (engine_peer.py's, the same on both sides)."""
    return zlib.crc32(rid.encode()) % 1000


def _gate(worker_cls, go: threading.Event) -> None:
    """The worker's load waits, after its producer's Export arrived, for the test's "go"."""
    real_load = worker_cls._load

    async def gated_load(self, order):
        prid = order.remote.request_id
        end = time.monotonic() + 60
        while not (self._consumer is not None
                   and any(self._consumer.exported(prid, peer=a) for a in list(self._consumer.peers))):
            if time.monotonic() > end:
                raise TimeoutError(f"no Export for {prid} within 60 s")
            await asyncio.sleep(0.01)
        _say({"about_to_fetch": order.request_id})
        while not go.is_set():
            await asyncio.sleep(0.005)
        go.clear()
        await real_load(self, order)

    worker_cls._load = gated_load


def main() -> int:
    from tests.vllm import harness as h

    cmd = json.loads(sys.stdin.readline())
    from tests.transport.drain_peers import RULE_OFF_ENV, _rule_off

    if os.environ.get(RULE_OFF_ENV) == "1":  # a test switch, like the transport drain tests' own
        _rule_off()
    from hybridkv.connectors.vllm.worker_half import WorkerHalf

    go = threading.Event()
    _gate(WorkerHalf, go)
    vc = h.make_vllm_config(role="kv_consumer", policy="fail", num_blocks=cmd["num_blocks"],
                            extra={"kv_lease_duration": 30}, engine_id="decode-drain")
    kcc = h.make_kv_cache_config(vc)
    sched = h.make_scheduler(vc, kcc, async_scheduling=False)
    conn, kv_caches = h.make_worker(vc, kcc)
    runner = h.RealWorker(conn, kv_caches, sched, writes=True, seed=5)
    d = h.Driver(sched, runner, async_scheduling=False)
    _say({"ready": True, "usable": h.free_blocks(sched)})

    q: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(q,), daemon=True).start()
    load = nxt = prid = shared = t_reuse = None
    ran_on: set[int] = set()
    t_failed = found = None
    reused: dict | None = None
    stop = False
    while not stop:
        while True:
            try:
                msg = q.get_nowait()
            except queue.Empty:
                break
            if msg.get("stop"):
                stop = True
                break
            if "load" in msg:
                rid, n, params = msg["load"]
                sched.add_request(h.make_request(rid, prompt_len=n, max_tokens=4, params=params,
                                                 suffix_seed=_prompt_seed(params["remote_request_id"])))
                nrid, nn = msg["next"]
                sched.add_request(h.make_request(nrid, prompt_len=nn, max_tokens=1,
                                                 suffix_seed=_prompt_seed(nrid)))
                load, nxt, t_failed, found, reused, t_reuse = rid, nrid, None, None, None, None
                ran_on = set()
                prid = params["remote_request_id"]
            if msg.get("go"):
                go.set()
            if msg.get("check"):
                now = _digests(runner.pages(shared))
                _say({"pages": {"intact": now == reused["left"], "now": now,
                                "settling": conn.worker._consumer.settling(prid),
                                "in_flight": conn.worker._ts.transfers_in_flight()}})
        t_step = time.monotonic()
        d.step()
        if load is not None and t_failed is None and load in d.finished:
            # vLLM has the load's outcome: its blocks are free from the next schedule() on. What the
            # READ left in them (the producer's bytes, if it landed), before the next request writes them.
            t_failed = time.monotonic()
            found = _digests(runner.pages(runner.order_blocks[load]))
        touched = d.touched.pop(max(d.touched), {})  # the blocks of each request this step ran
        d.touched.clear()
        if nxt is not None and nxt in touched:
            if t_reuse is None:
                t_reuse = t_step
            ran_on |= touched[nxt]
        if nxt is not None and reused is None and nxt in d.finished:
            # The load's blocks the next request wrote (vLLM's free queue may hand it one other first)
            shared = tuple([b for b in ids if b in ran_on] for ids in runner.order_blocks[load])
            result = conn.worker.load_results.get(load)
            reused = {"t_reuse": t_reuse, "t_failed": t_failed, "failed": load in runner.failed,
                      "reason": str(d.finished.get(load, ("?",))[0]),
                      "error": conn.worker.load_errors.get(load), "result_error": result and result.error,
                      "shared": sum(map(len, shared)), "of": sum(map(len, runner.order_blocks[load])),
                      "shared_groups": sum(1 for ids in shared if ids), "found": found,
                      "left": _digests(runner.pages(shared))}
            _say({"reused": reused})
        time.sleep(0.005)
    conn.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
