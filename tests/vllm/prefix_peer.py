"""A vLLM prefill instance with prefix caching on (vLLM's default), minus the model, for test_prefix_caching.py.

As prefill_peer.py, but requests share prefixes: each prompt is ``prefix_len`` common tokens
and a suffix of its own. vLLM's scheduler serves the common blocks of a later request from
its cache, so several exports hold those blocks at once (rule 7). The forward pass writes
only the blocks of the tokens it computes and each GDN group's running-state slot.
Protocol on stdin/stdout, one JSON object per line:
  <- {"ready": port}
  -> {"requests": [[rid, prompt_len, suffix_seed, prefix_len], ...], "pages": path, "free_within": s}
  <- {"params": {rid: kv_transfer_params}}
     (page bytes of each request's exported blocks saved at path, as {rid: {layer: [page]}})
  <- {"freed": bool, "free": n, "usable": m}   once the consumer read (or released) them all, or after
                                               free_within seconds (default 60)
"""

from __future__ import annotations

import json
import sys
import time

import msgpack


def main() -> int:
    port = int(sys.argv[1])
    from tests.vllm import harness as h

    vc = h.make_vllm_config(role="kv_producer", async_scheduling=True, engine_id="prefill-engine",
                            prefix_caching=True, extra={"side_channel_port": port, "kv_lease_duration": 30})
    kcc = h.make_kv_cache_config(vc)
    sched = h.make_scheduler(vc, kcc, async_scheduling=True)
    conn, kv_caches = h.make_worker(vc, kcc)
    runner = h.RealWorker(conn, kv_caches, sched, writes=True, seed=port, only_new=True)
    d = h.Driver(sched, runner, async_scheduling=True)
    print(json.dumps({"ready": conn.worker.listen_port}), flush=True)
    cmd = json.loads(sys.stdin.readline())
    params, pages = {}, {}
    for rid, n, seed, prefix in cmd["requests"]:
        req = h.make_request(rid, prompt_len=n, max_tokens=8, params={"do_remote_decode": True},
                             suffix_seed=seed, prefix_len=prefix)
        sched.add_request(req)
        d.run(until=lambda: rid in d.finished)
        params[rid] = d.finished[rid][1]
        # Saved at once: a later request's forward pass must not touch what this one exported.
        pages[rid] = runner.pages(params[rid]["remote_block_ids"])
    with open(cmd["pages"], "wb") as f:
        f.write(msgpack.packb(pages, use_bin_type=True))
    print(json.dumps({"params": params}), flush=True)
    usable = kcc.num_blocks - 1
    deadline = time.monotonic() + cmd.get("free_within", 60)
    # With prefix caching, freed blocks stay cached but count as free in vLLM's pool.
    while (h.free_blocks(sched) < usable or not sched.connector.scheduler.idle()) and time.monotonic() < deadline:
        d.step()
        time.sleep(0.005)
    d.drain()
    freed = h.free_blocks(sched) == usable and sched.connector.scheduler.idle()
    print(json.dumps({"freed": freed, "free": h.free_blocks(sched), "usable": usable}), flush=True)
    conn.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
