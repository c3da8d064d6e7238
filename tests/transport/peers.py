"""Real producer/consumer processes for the transport tests (spawned, talking over NIXL + ucxx).

Each process builds a real layout (plan_layout on host memory), a real
TransferScheduler, and runs the endpoint on asyncio. The test drives them
through multiprocessing queues: the producer reports its address, both report
outcomes, checksums, scheduler audits and free-block counts.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import time
import traceback

import numpy as np

# Both peers prove this secret unless a test passes ``secret=None`` (unauthenticated) or another one.
# As `hybridkv secret` writes one: the hex of 32 random bytes (auth.check_secret refuses weaker ones).
SECRET = b"55d10b05bbdceb41722b60c053311a2d724ebe2669fd4989c2a0e9d8eaa0bfe1"
#: The CPU tests register host memory that UCX serves over tcp, shm and cma: accepted by name, as an operator
#: would on such a host (transport/host_memory.py); over VRAM it changes nothing.
HOST_MEMORY_OK = True


def token(rid: str) -> bytes:
    """The request's capability token, as a router would hand it over: here both processes derive
    it the same way (a test fixture; a deployment issues auth.new_token() per request)."""
    return hashlib.sha256(b"hybridkv-test-token:" + rid.encode()).digest()[:16]


SMALL = dict(num_layers=4, num_kv_heads=1, num_k_heads=2, num_v_heads=2, head_dim=64, head_k_dim=32, head_v_dim=32)
BLOCK = 16
NUM_BLOCKS = {"attn": 64, "gdn": 8}


def geometry(**over):
    from hybridkv.layout.presets import qwen_hybrid

    return qwen_hybrid("test-hybrid", **{**SMALL, **over})


def model_geometry(model: str | None, geo_over=None):
    """A preset's geometry (``hybridkv.layout.presets``, as `hybridkv bench` takes ``--model``), or the test one."""
    from hybridkv.layout.presets import get_preset

    return get_preset(model) if model else geometry(**(geo_over or {}))


def build(seed: int, *, geo_over=None, scale: int = 1, mem: str = "dram", tp: int = 1, rank: int = 0,
          block: int = BLOCK, device: int = 0, model: str | None = None, num_blocks: dict | None = None):
    """``model``: a preset's geometry instead of the test one; ``num_blocks``: pages per kind as
    :data:`NUM_BLOCKS` keys them (default: those, attention's times ``scale``)."""
    from hybridkv.layout.alloc import NumpyAllocator, TorchAllocator
    from hybridkv.fencing.fence import PoolLayout
    from hybridkv.layout.geometry import LayerKind
    from hybridkv.layout import plan_layout
    from hybridkv.transport.memory import from_layout

    geo = model_geometry(model, geo_over)
    nb = num_blocks or {"attn": NUM_BLOCKS["attn"] * scale, "gdn": NUM_BLOCKS["gdn"]}
    nb = {LayerKind.FULL_ATTENTION: nb["attn"], LayerKind.GDN: nb["gdn"]}
    if mem == "vram":
        import torch

        torch.cuda.set_device(device)  # this process's GPU: NIXL/UCX work in its context
        allocator = TorchAllocator(f"cuda:{device}")
    else:
        allocator = NumpyAllocator()
    layout = plan_layout(geo, block_size=block, num_blocks=nb, allocator=allocator, tp=tp, rank=rank)
    for i, alloc in enumerate(layout.allocations):
        buf = alloc.owner
        fill = np.random.default_rng(seed * 100 + i).integers(0, 256, alloc.nbytes, dtype=np.uint8)
        if mem == "vram":  # pattern goes to the GPU; NIXL then reads/writes VRAM directly
            import torch

            buf.copy_(torch.from_numpy(fill))
            torch.cuda.synchronize(buf.device)
        else:
            buf[:] = fill
    pools = PoolLayout.separate(num_blocks=tuple(layout.regions[g.placements[0].region_id].num_pages
                                                 for g in layout.groups))
    return layout, from_layout(layout), pools


def vllm_layout(geo, *, tp: int, rank: int, block: int, kernel: int | None, pages: int, allocator):
    """vLLM 0.33's hybrid-allocator tensors as ``allocate_kv_cache`` lays them out with attention kernel
    blocks of ``kernel`` tokens inside each ``block``-token logical block: layer-outermost (LBHNC), the only
    layouts where vLLM splits a block into kernel blocks (``hybridkv.descriptors.hma.vllm_layout``). Tensor
    slot i (layer i of every group, one allocation, hence one region) holds ``pages`` pages of the hybrid page
    size; an attention page is ``block // kernel`` kernel pages [H, kernel, K|V] back to back, a GDN page its
    state at the front."""
    from hybridkv.descriptors.hma import PageOrder, plan_hma
    from hybridkv.descriptors.hma import vllm_layout as hma_layout

    if plan_hma(geo.shard(tp), block).block_size != block:
        raise ValueError(f"block {block} is not the hybrid allocator's for TP {tp} (it raises it to "
                         f"{plan_hma(geo.shard(tp), block).block_size})")
    return hma_layout(geo, tp=tp, rank=rank, block=block, pages=pages, allocator=allocator,
                      order=PageOrder.LAYER_OUTERMOST, kernel=kernel)


def build_vllm(seed: int, *, tp: int, rank: int, block: int, kernel: int | None, pages: int, geo_over=None,
               mem: str = "dram", device: int = 0, model: str | None = None):
    """:func:`vllm_layout` of the test geometry (or ``model``'s), filled with a seed's bytes like :func:`build`;
    one block pool shared by every group (vLLM's hybrid allocator). Returns (layout, memory map, pools)."""
    from hybridkv.fencing.fence import PoolLayout
    from hybridkv.layout.alloc import NumpyAllocator, TorchAllocator
    from hybridkv.transport.memory import from_layout

    if mem == "vram":
        import torch

        torch.cuda.set_device(device)
        allocator = TorchAllocator(f"cuda:{device}")
    else:
        allocator = NumpyAllocator()
    layout = vllm_layout(model_geometry(model, geo_over), tp=tp, rank=rank, block=block, kernel=kernel, pages=pages,
                         allocator=allocator)
    for i, alloc in enumerate(layout.allocations):
        fill = np.random.default_rng(seed * 100 + i).integers(0, 256, alloc.nbytes, dtype=np.uint8)
        if mem == "vram":
            import torch

            alloc.owner.copy_(torch.from_numpy(fill))
            torch.cuda.synchronize(alloc.owner.device)
        else:
            alloc.owner[:] = fill
    pools = PoolLayout.shared(num_blocks=pages, num_groups=len(layout.groups))
    return layout, from_layout(layout), pools


def components(layout):
    from hybridkv.layout.geometry import LayerKind
    from hybridkv.fencing.request_state import attention_component, gdn_components

    out = []
    for g in layout.groups:
        out.extend(gdn_components(g.group_id) if g.kind is LayerKind.GDN else [attention_component(g.group_id)])
    return tuple(out)


def digest(layout, blocks: dict[int, list[int]]) -> str:
    """sha256 over the pages of the given blocks, group by group, in block order."""
    h = hashlib.sha256()
    for g in layout.groups:
        for p in g.placements:
            r = layout.regions[p.region_id]
            buf = layout.allocations[p.region_id].owner
            for b in blocks.get(g.group_id, []):
                off = b * r.stride
                page = buf[off: off + r.page_bytes]
                if hasattr(page, "cpu"):  # a torch tensor in VRAM: hash the bytes NIXL landed there
                    page = page.cpu().numpy()
                h.update(page.tobytes())
    return h.hexdigest()


def placement(layout) -> dict[str, list]:
    """Where the layout's memory lives: the device ids NIXL is told, and the tensors' own devices."""
    devs = {a.owner.device.index if getattr(getattr(a.owner, "device", None), "type", None) == "cuda" else None
            for a in layout.allocations}  # numpy arrays have a .device too ("cpu")
    return {"device_ids": sorted({int(r.device_id) for r in layout.regions}),
            "tensor_devices": sorted(devs, key=lambda d: -1 if d is None else d)}


def counts(layout, tokens: int) -> dict[int, int]:
    return {g.group_id: (1 if g.block_tokens is None else -(-tokens // g.block_tokens)) for g in layout.groups}


def _take(sched, layout, rid: str, group: int, n: int, spec: dict | None) -> list[int]:
    """n blocks of a group for a request: the pool's next ones, or (``spec`` given) the analyzer's
    block ids for fragmentation ``spec["f"]`` (hybridkv.descriptors.schemes.fragmented_blocks) from block
    ``spec["start"]``; a state group's one block is ``spec["slot"]``."""
    if spec is None:
        return list(sched.allocate(rid, group, n))
    from hybridkv.descriptors.schemes import fragmented_blocks

    start = spec["slot"] if layout.group(group).block_tokens is None else spec["start"]
    ids = [int(b) for b in fragmented_blocks(n, spec["f"], start=start)]
    sched.assign(rid, group, ids)
    return ids


def _quiet():
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import logging

    logging.getLogger("nixl").setLevel(logging.ERROR)


def run_peer(body, opts: dict, out: mp.Queue, inbox: mp.Queue) -> None:
    """A peer process's entry: ``body(opts, out, inbox)`` on its own event loop, a failure reported on ``out``."""
    _quiet()
    try:
        asyncio.run(body(opts, out, inbox))
    except BaseException as exc:  # report, don't hang the test
        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# ============================================================== producer
def producer_main(opts: dict, out: mp.Queue, inbox: mp.Queue) -> None:
    run_peer(_producer, opts, out, inbox)


async def _producer(opts, out, inbox):
    from hybridkv.descriptors.planning import DescriptorPlanner
    from hybridkv.fencing.scheduler import TransferScheduler
    from hybridkv.transport.auth import Claimants
    from hybridkv.transport.endpoint import Pairing, Producer, TransportConfig
    from hybridkv import wire

    layout, memory, pools = build(1, geo_over=opts.get("geo"), mem=opts.get("mem", "dram"),
                                  device=opts.get("device", 0), block=opts.get("block", BLOCK))
    # Blocks named by the test (``fragmentation``) come from an engine-owned pool, as vLLM's do.
    sched = TransferScheduler(pools, lease_s=opts.get("lease_s", 30.0), managed_pool=not opts.get("fragmentation"))
    cfg = TransportConfig(mode=wire.Mode[opts.get("mode", "PULL")], insecure_host_memory=HOST_MEMORY_OK,
                          allowed_peers=tuple(opts.get("allowed_peers", ())), secret=opts.get("secret", SECRET),
                          insecure_no_auth=opts.get("secret", SECRET) is None, compat=opts.get("compat", {}),
                          handshake_timeout_s=opts.get("handshake_timeout_s", 5.0),
                          max_wants_per_peer=opts.get("max_wants_per_peer", 4096),
                          idle_connection_s=opts.get("idle_connection_s", 10.0))
    prod = Producer(memory, sched, cfg, planner=DescriptorPlanner(pairing=Pairing.PAGES))
    host, port = await prod.start()
    out.put(("addr", (host, port, os.getpid())))
    requests = opts.get("requests", [])
    plans = {}
    step = 0
    for rid, tokens, shuffle in requests:
        sched.add_request(rid)
        blocks = {}
        for g, n in counts(layout, tokens).items():
            blocks[g] = _take(sched, layout, rid, g, n, opts.get("fragmentation", {}).get(rid))
        step += 1
        sched.step_scheduled(step, joined=[rid])
        sched.step_completed(step)
        plans[rid] = blocks
    if not requests:
        out.put(("ready", None))
        await _await_inbox(inbox, "stop", prod)
        out.put(("stats", vars(prod.stats)))
        await prod.close()
        return
    await prod.wait_peer(opts.get("peer_timeout_s", 20.0))
    if opts.get("stall_before_export_s"):  # the consumer asks first: its Want waits in the queue
        t_end = time.monotonic() + 10
        while set(prod.describe()["wants_ahead"]) < set(plans) and time.monotonic() < t_end:
            await asyncio.sleep(0.01)
    for rid in plans:  # the lease starts when the request finishes, with the consumer known
        sched.request_finished(rid, export=True)
    if opts.get("stall_before_export_s"):
        time.sleep(opts["stall_before_export_s"])  # the whole process stalls (loop blocked): a stuck prefill
    out.put(("digests", {rid: digest(layout, b) for rid, b in plans.items()}))
    bound = {rid: Claimants(agents=frozenset(names)) for rid, names in opts.get("claimants", {}).items()}
    results = await asyncio.gather(*(prod.export(rid, token=token(rid), claimants=bound.get(rid)) for rid in plans))
    for _ in range(int(opts.get("linger_s", 0) / 0.01)):
        await asyncio.sleep(0.01)  # let late notifications/leases arrive
    sched.poll()
    sched.audit()
    out.put(("results", [(r.request_id, r.outcome.name, r.error) for r in results]))
    out.put(("state", {"free": [sched.free_count(p) for p in range(len(pools.pool_sizes))],
                       "total": list(pools.pool_sizes), "in_flight": sched.transfers_in_flight(),
                       "requests": sched.requests_in_flight(), "stats": vars(prod.stats),
                       "wants_ahead": sum(prod.describe()["wants_ahead"].values()),
                       "metrics": prod.metrics.take().to_dict(), "placement": placement(layout)}))
    await _await_inbox(inbox, "stop", prod)
    await prod.close()


async def _await_inbox(inbox, word, side, timeout_s=60.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if inbox.get_nowait() == word:
                return
        except Exception:
            pass
        await asyncio.sleep(0.02)


# ============================================================== consumer
def consumer_main(opts: dict, out: mp.Queue, inbox: mp.Queue) -> None:
    run_peer(_consumer, opts, out, inbox)


async def _consumer(opts, out, inbox):
    from hybridkv.descriptors.planning import DescriptorPlanner
    from hybridkv import wire
    from hybridkv.errors import HandshakeRefused, HybridKVError
    from hybridkv.fencing.scheduler import TransferScheduler
    from hybridkv.transport.endpoint import Consumer, FailurePolicy, Pairing, TransportConfig

    host, port = opts["addr"]
    attempts = opts.get("attempts") or [{}]
    for att in attempts:  # handshake variants: each a fresh consumer
        layout, memory, pools = build(2, geo_over=att.get("geo"), mem=opts.get("mem", "dram"),
                                      device=opts.get("device", 0), block=opts.get("block", BLOCK))
        sched = TransferScheduler(pools, lease_s=30.0, managed_pool=not opts.get("fragmentation"))
        cfg = TransportConfig(mode=wire.Mode[att.get("mode", opts.get("mode", "PULL"))],
                              insecure_host_memory=HOST_MEMORY_OK, failure_policy=FailurePolicy[opts.get("policy", "FAIL")],
                              handshake_timeout_s=opts.get("handshake_timeout_s", 5.0),
                              export_timeout_s=opts.get("export_timeout_s", 20.0),
                              heartbeat_s=opts.get("heartbeat_s"),
                              notify_reads=opts.get("notify_reads", False),
                              transfer_timeout_s=opts.get("transfer_timeout_s", 60.0),
                              handshake_retries=opts.get("handshake_retries", 2),
                              handshake_backoff_s=opts.get("handshake_backoff_s", 0.5),
                              secret=att.get("secret", opts.get("secret", SECRET)),
                              insecure_no_auth=att.get("secret", opts.get("secret", SECRET)) is None,
                              compat=att.get("compat", opts.get("compat", {})))
        cons = Consumer(memory, sched, cfg, planner=DescriptorPlanner(pairing=Pairing.PAGES))
        if "protocol" in att:
            cons.compat["protocol"] = att["protocol"]
        try:
            t0 = time.monotonic()
            out.put(("dialing", None))
            await cons.connect(host, port)
        except HandshakeRefused as exc:
            out.put(("refused", (att.get("name"), sorted(exc.fields), str(exc))))
            await cons.close()
            continue
        except HybridKVError as exc:
            out.put(("connect_failed", (type(exc).__name__, str(exc), time.monotonic() - t0)))
            out.put(("connect_metrics", cons.metrics.take().to_dict()))
            await cons.close()
            continue
        out.put(("connected", att.get("name")))
        if not opts.get("requests"):
            await cons.close()
            continue
        await _run_requests(opts, out, inbox, layout, sched, cons)
        await cons.close()
    out.put(("finished", None))


async def _run_requests(opts, out, inbox, layout, sched, cons):
    comps = components(layout)
    plans = {}
    for rid, tokens, shuffle in opts["requests"]:
        sched.add_request(rid, expect=comps)
        blocks = {}
        if shuffle:  # the destination blocks sit elsewhere than the source's
            sched.add_request(rid + "-pad")
            for g in counts(layout, tokens):
                sched.allocate(rid + "-pad", g, 1)
        for g, n in counts(layout, tokens).items():
            blocks[g] = _take(sched, layout, rid, g, n, opts.get("fragmentation", {}).get(rid))
        plans[rid] = blocks
    if opts.get("pending_step"):
        # A step that zeroes the new blocks is scheduled and never completes (a stalled decode's
        # device): an import into them answers "not yet" for as long as the test runs.
        sched.step_scheduled(1, zeroing=[(g, b) for bl in plans.values() for g, bs in bl.items() for b in bs])
    if opts.get("wait_before_fetch_s"):
        for rid in plans:  # asked for up front: the Export (and its lease) comes while we are slow
            await cons.want(rid, token=token(rid))
        await asyncio.sleep(opts["wait_before_fetch_s"])
    if opts.get("signal_before_fetch"):
        for rid in plans:
            await cons.want(rid, token=token(rid))
        while not all(cons.exported(rid) for rid in plans):
            await asyncio.sleep(0.01)  # every Export arrived: the producer is committed
        out.put(("about_to_fetch", None))
        await _await_inbox(inbox, "go", cons)
    results = await asyncio.gather(*(cons.fetch(rid, comps, token=token(rid)) for rid in plans))
    digests = {r.request_id: digest(layout, plans[r.request_id]) for r in results}
    if opts.get("duplicate_notif_fake"):
        # A misbehaving peer: completions repeated and for unknown requests.
        from hybridkv.transport.side import notification

        for r in results:
            cons.dp.notify(cons.peer.agent, notification(cons.peer, r.request_id))
        cons.dp.notify(cons.peer.agent, notification(cons.peer, "never-exported"))
        # ... and one without its session's tag (with a secret; in a lab it is one more duplicate)
        cons.dp.notify(cons.peer.agent, b"hkv:" + results[0].request_id.encode())
        await asyncio.sleep(0.3)
    sched.audit()
    out.put(("results", [(r.request_id, r.outcome.name, r.error, r.descriptors, r.indices, r.nbytes, r.planned)
                         for r in results]))
    out.put(("digests", digests))
    out.put(("state", {"free": [sched.free_count(p) for p in range(len(sched.layout.pool_sizes))],
                       "total": list(sched.layout.pool_sizes), "in_flight": sched.transfers_in_flight(),
                       "phases": {rid: (sched.phase(rid).name if sched.has_request(rid) else None) for rid in plans},
                       "stats": vars(cons.stats), "metrics": cons.metrics.take().to_dict(),
                       "placement": placement(layout)}))
