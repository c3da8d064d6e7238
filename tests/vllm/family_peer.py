"""The prefill side of test_model_families.py, in its own process: one producer worker per case.

For each case: vLLM's config, KV cache config and tensors for the case's tiny model (families.py),
the scheduler half built by vLLM's real ``Scheduler`` and a worker-role HybridKVConnector from vLLM's
factory, registered with the tensors; a request's blocks filled with random bytes and offered for
export as the scheduler half offers it (``exports_ready``). Protocol, one JSON object per line:
  <- {"ready": true}
  -> {"case": name, "pages": path, "tokens": n}
  <- {"case": name, "params": kv_transfer_params}   (the exported pages saved at path, layer by layer)
  -> {"finish": true, "expect_read": bool} once the consumer's load ended
  <- {"case": name, "sent": bool}          whether the consumer read them (waiting up to 30 s if expected)
  -> {"quit": true}
"""

from __future__ import annotations

import json
import sys
import time

import msgpack


def serve(case: str, pages_path: str, tokens: int) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hybridkv.connectors.vllm.metadata import HybridKVConnectorMetadata
    from hybridkv.connectors.vllm.params import producer_params
    from tests.vllm import families as fam
    from tests.vllm import harness as h

    from tests.ports import free_ports
    vc, kcc, kv = fam.build(case, role="kv_producer", engine_id="prefill-engine",
                            extra={"side_channel_port": free_ports(), "kv_lease_duration": 30})
    h.make_scheduler(vc, kcc, async_scheduling=False)  # the scheduler half starts for this model too
    conn = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.WORKER, kv_cache_config=kcc)
    conn.register_kv_caches(kv)
    try:
        rid = f"p-{case}"
        blocks = fam.request_blocks(kcc, tokens=tokens, first=1)
        fam.fill(kv, kcc, blocks, seed=len(case))
        with open(pages_path, "wb") as f:
            f.write(msgpack.packb(fam.read(kv, kcc, blocks), use_bin_type=True))
        token = h.token(rid)
        conn.worker.start_step(HybridKVConnectorMetadata(step=0, exports_ready={rid: blocks},
                                                         capabilities={rid: token}))
        w = conn.worker
        params = producer_params(engine_id="prefill-engine", request_id=rid, host="127.0.0.1", port=w.listen_port,
                                 block_ids=blocks, tp_size=1, num_tokens=tokens, lease_s=30, ranks=(w.advertised,),
                                 token=token)
        print(json.dumps({"case": case, "params": params}), flush=True)
        finish = json.loads(sys.stdin.readline())  # the consumer's load ended (landed or refused)
        deadline, sent = time.monotonic() + (30 if finish.get("expect_read", True) else 0), False
        while not sent and time.monotonic() <= deadline:
            sent = rid in w.transfer_results().finished_sending
            time.sleep(0.01)
        print(json.dumps({"case": case, "sent": sent}), flush=True)
    finally:
        conn.shutdown()


def main() -> int:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        serve(cmd["case"], cmd["pages"], cmd["tokens"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
