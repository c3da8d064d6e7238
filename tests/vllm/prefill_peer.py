"""A vLLM prefill instance minus the model, in its own process, for test_worker_nixl.py.

Real Scheduler + scheduler-half and worker-half HybridKVConnector, KV tensors
allocated by vLLM's ``allocate_kv_cache``; the forward pass writes random bytes.
Arguments: port, "async"|"sync"[, a families.py case, JSON of make_config options over it].
Protocol on stdin/stdout, one JSON object per line:
  <- {"ready": port}
  -> {"prompt_len": n, "pages": path}
  <- {"params": kv_transfer_params}          (page bytes of the exported blocks saved at path)
  <- {"freed": bool, "free": n, "usable": m, "descriptors": k}   once the consumer read them
"""

from __future__ import annotations

import json
import sys
import time

import msgpack


def main() -> int:
    port = int(sys.argv[1])
    async_scheduling = sys.argv[2] == "async"
    from tests.vllm import harness as h

    extra = {"side_channel_port": port, "kv_lease_duration": 30}
    if len(sys.argv) > 3:  # a families.py case, with make_config options over it (JSON)
        from tests.vllm import families as fam

        vc, kcc, kv_caches = fam.build(sys.argv[3], role="kv_producer", engine_id="prefill-engine", extra=extra,
                                       async_scheduling=async_scheduling, **json.loads(sys.argv[4]))
        conn = fam.worker(vc, kcc, kv_caches)
    else:
        vc = h.make_vllm_config(role="kv_producer", async_scheduling=async_scheduling, engine_id="prefill-engine",
                                extra=extra)
        kcc = h.make_kv_cache_config(vc)
        conn, kv_caches = h.make_worker(vc, kcc)
    sched = h.make_scheduler(vc, kcc, async_scheduling=async_scheduling)
    # A case's forward pass writes only what a model writes (its tokens' blocks, each GDN group's running-state
    # slot): a speculative scratch slot stays zeros, so a transfer that picked one instead shows.
    runner = h.RealWorker(conn, kv_caches, sched, writes=True, seed=port, only_new=len(sys.argv) > 3)
    d = h.Driver(sched, runner, async_scheduling=async_scheduling)
    print(json.dumps({"ready": conn.worker.listen_port}), flush=True)
    cmd = json.loads(sys.stdin.readline())
    sched.add_request(h.make_request("p1", prompt_len=cmd["prompt_len"], max_tokens=8,
                                     params={"do_remote_decode": True}))
    d.run(until=lambda: "p1" in d.finished)
    params = d.finished["p1"][1]
    with open(cmd["pages"], "wb") as f:
        f.write(msgpack.packb(runner.pages(params["remote_block_ids"]), use_bin_type=True))
    print(json.dumps({"params": params}), flush=True)
    usable = kcc.num_blocks - 1
    deadline = time.monotonic() + 60
    while h.free_blocks(sched) < usable and time.monotonic() < deadline:
        d.step()
        time.sleep(0.005)
    d.drain()
    freed = h.free_blocks(sched) == usable and sched.connector.scheduler.idle()
    print(json.dumps({"freed": freed, "free": h.free_blocks(sched), "usable": usable}), flush=True)
    conn.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
