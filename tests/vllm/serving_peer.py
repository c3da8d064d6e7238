"""A vLLM prefill instance minus the model that serves several requests, for test_metrics.py.

As prefill_peer.py (real Scheduler with stats on, both connector halves from vLLM's
factory, KV tensors from vLLM's ``allocate_kv_cache``, random bytes as the forward
pass), but it keeps serving, and reports the ``kv_connector_stats`` payloads vLLM's
scheduler put in its ``SchedulerStats``. Argv: port, lease seconds. One JSON object
per line on stdin/stdout:
  <- {"ready": port}
  -> {"rid": id, "prompt_len": n}
  <- {"params": kv_transfer_params}
  -> {"wait_freed": seconds}     steps until every block is vLLM's again (read, failed or lease lapsed)
  <- {"freed": bool}
  -> {"stats": true}
  <- {"stats": [payload, ...]}   every kv_connector_stats payload since the last ask
"""

from __future__ import annotations

import json
import select
import sys
import time


def main() -> int:
    port, lease = int(sys.argv[1]), float(sys.argv[2])
    from tests.vllm import harness as h

    vc = h.make_vllm_config(role="kv_producer", engine_id="prefill-engine",
                            extra={"side_channel_port": port, "kv_lease_duration": lease})
    kcc = h.make_kv_cache_config(vc)
    sched = h.make_scheduler(vc, kcc, async_scheduling=False, log_stats=True)
    conn, kv_caches = h.make_worker(vc, kcc)
    runner = h.RealWorker(conn, kv_caches, sched, writes=True, seed=port)
    d = h.Driver(sched, runner, async_scheduling=False)
    usable = kcc.num_blocks - 1
    print(json.dumps({"ready": conn.worker.listen_port}), flush=True)
    while True:
        # The engine keeps stepping between commands, as a server does: exports are offered to
        # readers, leases renewed or lapsed, blocks handed back, all on steps.
        ready, _, _ = select.select([sys.stdin], [], [], 0.005)
        if not ready:
            d.step()
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        if "rid" in cmd:
            rid = cmd["rid"]
            sched.add_request(h.make_request(rid, prompt_len=cmd["prompt_len"], max_tokens=8,
                                             params={"do_remote_decode": True}))
            d.run(until=lambda: rid in d.finished)
            print(json.dumps({"params": d.finished[rid][1]}), flush=True)
        elif "wait_freed" in cmd:
            deadline = time.monotonic() + cmd["wait_freed"]
            while h.free_blocks(sched) < usable and time.monotonic() < deadline:
                d.step()
                time.sleep(0.005)
            d.step()  # one more step: what was counted at the last report reaches SchedulerStats
            print(json.dumps({"freed": h.free_blocks(sched) == usable and sched.connector.scheduler.idle()}),
                  flush=True)
        elif "stats" in cmd:
            payloads = [s.kv_connector_stats for s in d.scheduler_stats if s.kv_connector_stats]
            d.scheduler_stats.clear()
            print(json.dumps({"stats": payloads}), flush=True)
    conn.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
