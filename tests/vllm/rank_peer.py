"""One vLLM worker rank (TP rank of a prefill or decode instance) in its own process, for test_hetero_tp.py.

vLLM 0.33.0's real config for the rank's TP size, KV tensors from vLLM's own
``allocate_kv_cache``, our connector's worker half from vLLM's factory. There is
no scheduler here: the test plays the scheduler half and hands each rank the
metadata it would emit (exports ready / load orders). One JSON object per line:
  -> {"role": "producer", "tp", "rank", "port", "host"?, "requests": [[rid, tokens], ...]}
  <- {"ready": port, "address": [host, port, agent], "blocks": {rid: per-group ids}, "fields": {rid: {field: sha256}},
      "block_size"}
  -> "go"                                 (the requests finish: exports offered, leases start)
  <- {"sent": [rid, ...]}                 once every export ended (then it exits)
  -> {"role": "consumer", "tp", "rank", "remote_port"?, "remote_tp"?, "scatter"?}
Either role also takes "num_blocks" (the pool, default 64), "kernel_block" (attention kernel blocks of that
many tokens, in vLLM's layer-compact LBHNC layout) and "model" (a model folder next to this file, default
qwen3_next_tiny); either "ready" answer also carries "block_size", the hybrid allocator's block size vLLM chose.
  <- {"ready": true}
  -> {"requests": [[rid, tokens, blocks], ...], "remote_port"?, "remote_tp"?,
      "remote_ranks"?: [[host, port, agent], ...]}
  <- {"results": {rid: [failed, descriptors, nbytes]}, "fields": ..., "sources": {rank: [field, ...]}}
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
import tempfile
import time


def _field_digests(layout, blocks, tokens: int) -> dict[str, str]:
    out = {}
    for g in layout.groups:
        ids = blocks[g.group_id]
        for p in g.placements:
            r = layout.regions[p.region_id]
            for f in p.fields:
                data = b"".join(ctypes.string_at(r.base_addr + b * r.stride + f.offset, f.nbytes) for b in ids)
                if f.token_bytes and g.block_tokens:
                    data = data[: tokens * f.token_bytes]
                out[f"{f.key[0].value}/{f.key[1]}/{f.key[2]}"] = hashlib.sha256(data).hexdigest()
    return out


def _blocks(kcc, i: int, tokens: int, base: int, scatter: bool = False) -> list[list[int]]:
    """Distinct ids per group (HMA groups share one pool), as vLLM's block pool hands them out; ``scatter``:
    every other id (a busy pool: no two blocks of the request side by side)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    step = 2 if scatter else 1
    at = base + 12 * i
    out = []
    for g in kcc.transfer_group_ids:
        spec = kcc.kv_cache_groups[g].kv_cache_spec
        n = 1 if isinstance(spec, MambaSpec) else -(-tokens // spec.block_size)
        out.append(list(range(at, at + step * n, step)))
        at += step * n
    return out


def _kernel_worker(vc, kernel: int):
    """A worker connector over tensors split into attention kernel blocks of ``kernel`` tokens, as vLLM
    allocates them for a backend with smaller kernel blocks (FlashInfer's 16): vLLM needs a layer-compact
    layout for that (it refuses to split a block-outermost page), so the layout is set to LBHNC first."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    from tests.vllm import harness as h

    vc.cache_config.kv_cache_layout = "LBHNC"
    kcc = h.make_kv_cache_config(vc)
    sizes = [None if isinstance(g.kv_cache_spec, MambaSpec) else kernel for g in kcc.kv_cache_groups]
    kv = allocate_kv_cache(kcc, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout(), sizes)
    conn = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.WORKER, kv_cache_config=kcc)
    conn.register_kv_caches(kv)
    return kcc, conn, kv


def _poll(conn, want: set[str], key: str, timeout: float = 60.0):
    got, failed = set(), set()
    deadline = time.monotonic() + timeout
    while got < want and time.monotonic() < deadline:
        res = conn.get_transfer_results(set())
        got |= getattr(res, key)
        failed |= res.failed_recving
        time.sleep(0.01)
    return got, failed


def main() -> int:
    import torch

    from tests.vllm import harness as h

    cmd = json.loads(sys.stdin.readline())
    role = cmd["role"]
    # Every rank proves one shared secret, read from a file of mode 0600 as a deployment would (each
    # rank its own copy of the test session's secret).
    secret_file = h.secret_file(tempfile.mkdtemp(prefix="hkv-rank-peer-"))
    extra = {"tp_rank": cmd["rank"], "kv_lease_duration": 60, "secret_file": secret_file, "insecure_host_memory": True,
             "staging": cmd.get("staging", "off"), "staging_capacity_mb": 4}
    if role == "producer":
        extra["side_channel_port"] = cmd["port"]
        extra["side_channel_host"] = cmd.get("host", "127.0.0.1")
    vc = h.make_vllm_config(role="kv_producer" if role == "producer" else "kv_consumer", tp=cmd["tp"],
                            extra=extra, engine_id=f"{role}-engine", num_blocks=cmd.get("num_blocks", 64),
                            model=h.TINY_MODEL.parent / cmd.get("model", h.TINY_MODEL.name))
    block_size = vc.cache_config.block_size
    if cmd.get("kernel_block"):
        kcc, conn, kv = _kernel_worker(vc, cmd["kernel_block"])
    else:
        kcc = h.make_kv_cache_config(vc)
        conn, kv = h.make_worker(vc, kcc)
    layout = conn.worker.layout
    from hybridkv.connectors.vllm.addressing import RankAddress
    from hybridkv.connectors.vllm.metadata import HybridKVConnectorMetadata, RecvOrder
    from hybridkv.connectors.vllm.params import RemotePrefill

    if role == "producer":
        from vllm.v1.kv_cache_interface import group_kernel_blocks

        gen = torch.Generator().manual_seed(1000 + cmd["rank"])
        blocks, fields = {}, {}
        for i, (rid, tokens) in enumerate(cmd["requests"]):
            ids = _blocks(kcc, i, tokens, base=1)
            for g, gids in zip(kcc.transfer_group_ids, ids):
                for name in kcc.kv_cache_groups[g].layer_names:
                    for b in gids:  # what the forward pass would write
                        page = group_kernel_blocks(kv[name], kcc.num_blocks)[b]  # kernel blocks of b too
                        rnd = torch.randint(-128, 128, (page.numel() * page.element_size(),), dtype=torch.int8,
                                            generator=gen)
                        page.copy_(rnd.view(page.dtype).view(page.shape))
            blocks[rid] = ids
            fields[rid] = _field_digests(layout, dict(zip(kcc.transfer_group_ids, ids)), tokens)
        address = conn.get_handshake_metadata().address.to_json()  # what vLLM's engine core collects
        print(json.dumps({"ready": conn.worker.listen_port, "address": address, "blocks": blocks, "fields": fields,
                          "block_size": block_size}), flush=True)
        sys.stdin.readline()  # go
        meta = HybridKVConnectorMetadata(step=1, exports_ready={rid: tuple(tuple(g) for g in b)
                                                                for rid, b in blocks.items()},
                                         capabilities={rid: h.token(rid) for rid in blocks})
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)
        conn.clear_connector_metadata()
        sent, _ = _poll(conn, set(blocks), "finished_sending")
        print(json.dumps({"sent": sorted(sent)}), flush=True)  # every reader finished: nothing left to serve
    else:
        print(json.dumps({"ready": True, "block_size": block_size}), flush=True)
        orders, local = [], {}
        work = json.loads(sys.stdin.readline())
        cmd.update({k: work[k] for k in ("remote_port", "remote_tp", "remote_ranks") if k in work})
        for i, (rid, tokens, remote_blocks) in enumerate(work["requests"]):
            ids = _blocks(kcc, i, tokens, base=30, scatter=cmd.get("scatter", False))
            local[rid] = (ids, tokens)
            remote = RemotePrefill(engine_id="producer-engine", request_id=rid, host="127.0.0.1",
                                   port=cmd["remote_port"], block_ids=tuple(tuple(g) for g in remote_blocks),
                                   token=h.token(rid), tp_size=cmd["remote_tp"],
                                   ranks=tuple(RankAddress.from_json(a, what="remote_ranks")
                                               for a in cmd.get("remote_ranks", ())))
            orders.append(RecvOrder(request_id=rid, transfer_id=i + 1, local_block_ids=tuple(tuple(g) for g in ids),
                                    remote=remote))
        conn.bind_connector_metadata(HybridKVConnectorMetadata(step=1, recvs=orders))
        conn.start_load_kv(None)
        conn.clear_connector_metadata()
        got, failed = _poll(conn, set(local), "finished_recving")
        results = {}
        for rid in local:
            r = conn.worker.load_results.get(rid)
            results[rid] = [rid in failed or rid not in got, r and r.descriptors, r and r.nbytes]
        fields = {rid: _field_digests(layout, dict(zip(kcc.transfer_group_ids, ids)), tokens)
                  for rid, (ids, tokens) in local.items()}
        sources = {}
        for plan in conn.worker._consumer.plans.values():  # a page plan reads one rank whole: no field split
            for rank, keys in getattr(plan, "sources", {}).items():
                sources[rank] = sorted(f"{k[0].value}/{k[1]}/{k[2]}" for k in keys)
        print(json.dumps({"results": results, "fields": fields, "sources": sources}), flush=True)
    conn.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
