"""One vLLM engine (one DP rank: scheduler + its worker) in its own process, for test_dp_restart_lease.py.

vLLM 0.33.0's real config (``data_parallel_size`` / ``data_parallel_rank`` as a DP engine
gets them), real ``Scheduler``, our connector's two halves from vLLM's factory, KV tensors
from vLLM's ``allocate_kv_cache``; the forward pass writes random bytes (seeded per engine,
so two engines' bytes differ). At start-up the worker's handshake metadata goes to the
scheduler half through vLLM's own ``set_xfer_handshake_metadata_pp_aware``, as the engine core
does. The engine loop steps all the time, as vLLM's engine core does while it holds requests.

One JSON object per line on stdin/stdout:
  -> {"role": "producer"|"consumer", "dp_rank", "dp_size", "port", "lease", "policy", "max_num_seqs", "seed"}
  <- {"ready": true, "address": [host, port, agent] | null}
  -> {"prefill": [[rid, prompt_len], ...]}
  <- {"params": {rid: kv_transfer_params}, "pages": {rid: {layer: sha256}}}     once all finished
  -> {"decode": [[rid, prompt_len, max_tokens, params], ...]}
  <- {"done": {rid: {"reason", "failed", "pages", "seconds"}}}                  once all finished
  -> {"local": [[rid, prompt_len, max_tokens], ...]}   (a request computed here, no transfer)
  -> {"abort": [rid, ...]}                 (the requests end, e.g. while queued)
  -> {"wait_free": seconds}
  <- {"freed": bool, "seconds": s, "free": n, "usable": m}   every block vLLM's again, connector idle
  -> {"stop": true}
"""

from __future__ import annotations

import hashlib
import json
import queue
import sys
import threading
import time
import zlib


def _digests(pages: dict[str, list[bytes]]) -> dict[str, str]:
    return {name: hashlib.sha256(b"".join(p)).hexdigest() for name, p in pages.items()}


def _reader(q: queue.Queue) -> None:
    for line in sys.stdin:
        if line.strip():
            q.put(json.loads(line))
    q.put({"stop": True})


def _say(obj) -> None:
    print(json.dumps(obj), flush=True)


def _prompt_seed(rid: str) -> int:
    """A prompt of its own per request (the same on both sides): with prefix caching on, equal prompts
    would hit each other's blocks, and these tests are about which rank serves a request."""
    return zlib.crc32(rid.encode()) % 1000


def main() -> int:
    from tests.vllm import harness as h

    cmd = json.loads(sys.stdin.readline())
    producer = cmd["role"] == "producer"
    extra = {"kv_lease_duration": cmd.get("lease", 30), "export_timeout_s": cmd.get("export_timeout", 30)}
    if producer:
        extra["side_channel_port"] = cmd["port"]
    vc = h.make_vllm_config(role="kv_producer" if producer else "kv_consumer", policy=cmd.get("policy", "recompute"),
                            extra=extra, engine_id=f"{cmd['role']}-dp", dp_rank=cmd["dp_rank"],
                            dp_size=cmd["dp_size"], max_num_seqs=cmd.get("max_num_seqs", 8))
    kcc = h.make_kv_cache_config(vc)
    sched = h.make_scheduler(vc, kcc, async_scheduling=False)
    conn, kv_caches = h.make_worker(vc, kcc)
    # What vLLM's engine core does once the workers registered their caches.
    meta = conn.get_handshake_metadata()
    sched.connector.set_xfer_handshake_metadata_pp_aware({} if meta is None else {(0, 0): meta})
    runner = h.RealWorker(conn, kv_caches, sched, writes=producer, seed=cmd.get("seed", 0))
    d = h.Driver(sched, runner, async_scheduling=False)
    _say({"ready": True, "address": None if meta is None else meta.address.to_json()})

    q: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(q,), daemon=True).start()
    usable = kcc.num_blocks - 1
    prefills: set[str] = set()
    decodes: dict[str, float] = {}  # request -> when it was queued
    wait_free: tuple[float, float] | None = None  # (since, deadline)
    stop = False
    while not stop:
        msgs = []
        while True:  # every message that came since the last step
            try:
                msgs.append(q.get_nowait())
            except queue.Empty:
                break
        for msg in msgs:
            if msg.get("stop"):
                stop = True
                break
            for rid, n in msg.get("prefill", ()):
                sched.add_request(h.make_request(rid, prompt_len=n, max_tokens=8, params={"do_remote_decode": True},
                                                 suffix_seed=_prompt_seed(rid)))
                prefills.add(rid)
            for rid, n, max_tokens in msg.get("local", ()):
                sched.add_request(h.make_request(rid, prompt_len=n, max_tokens=max_tokens))
            for rid, n, max_tokens, params in msg.get("decode", ()):
                sched.add_request(h.make_request(rid, prompt_len=n, max_tokens=max_tokens, params=params,
                                                 suffix_seed=_prompt_seed(params.get("remote_request_id", rid))))
                decodes[rid] = time.monotonic()
            if msg.get("abort"):
                from vllm.v1.request import RequestStatus

                sched.finish_requests(msg["abort"], RequestStatus.FINISHED_ABORTED)
                for rid in msg["abort"]:
                    decodes.pop(rid, None)
            if "wait_free" in msg:
                wait_free = (time.monotonic(), time.monotonic() + msg["wait_free"])
        d.step()
        if prefills and prefills <= set(d.finished):
            params = {rid: d.finished[rid][1] for rid in prefills}
            _say({"params": params, "pages": {rid: _digests(runner.pages(p["remote_block_ids"]))
                                               for rid, p in params.items()}})
            prefills = set()
        if decodes and set(decodes) <= set(d.finished):
            now = time.monotonic()
            _say({"done": {rid: {"reason": str(d.finished[rid][0]), "failed": rid in runner.failed,
                                 "pages": _digests(runner.snapshots.get(rid, {})), "seconds": now - t}
                           for rid, t in decodes.items()}})
            decodes = {}
        if wait_free is not None:
            since, deadline = wait_free
            freed = h.free_blocks(sched) == usable and sched.connector.scheduler.idle()
            if freed or time.monotonic() > deadline:
                _say({"freed": freed, "seconds": time.monotonic() - since, "free": h.free_blocks(sched),
                      "usable": usable})
                wait_free = None
        time.sleep(0.005)
    conn.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
