"""Producer / consumer processes of one TP rank each, pairing by fields (heterogeneous TP, block sizes).

Each rank plans its own shard (plan_layout with tp/rank/block), fills it with a
rank-specific pattern, and reports a digest per field key of each request: the
field's bytes over the request's blocks in token order (clipped to the prompt
for token-indexed fields). A decode rank must end with exactly the bytes of the
prefill rank it was assigned each field from.
"""

from __future__ import annotations

import asyncio
import hashlib
import traceback

import numpy as np

from tests.transport.peers import SECRET, _await_inbox, _quiet, build, components, token


def field_digests(layout, blocks: dict[int, list[int]], tokens: int) -> dict[str, str]:
    out = {}
    for g in layout.groups:
        for p in g.placements:
            r = layout.regions[p.region_id]
            buf = layout.allocations[p.region_id].owner
            for f in p.fields:
                data = b"".join(buf[b * r.stride + f.offset: b * r.stride + f.offset + f.nbytes].tobytes()
                                for b in blocks.get(g.group_id, []))
                if f.token_bytes and g.block_tokens:
                    data = data[: tokens * f.token_bytes]
                out[f"{f.key[0].value}/{f.key[1]}/{f.key[2]}"] = hashlib.sha256(data).hexdigest()
    return out


def _counts(layout, tokens):
    return {g.group_id: (1 if g.block_tokens is None else -(-tokens // g.block_tokens)) for g in layout.groups}


def _pools(layout):
    from hybridkv.fencing.fence import PoolLayout

    return PoolLayout.separate(num_blocks=tuple(layout.regions[g.placements[0].region_id].num_pages
                                                for g in layout.groups))


def producer_main(opts, out, inbox) -> None:
    _quiet()
    try:
        asyncio.run(_producer(opts, out, inbox))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


async def _producer(opts, out, inbox):
    from hybridkv.descriptors.planning import DescriptorPlanner
    from hybridkv.fencing.scheduler import TransferScheduler
    from hybridkv.transport.endpoint import Pairing, Producer, TransportConfig

    tp, rank = opts["tp"], opts["rank"]
    layout, memory, _ = build(10 + rank, tp=tp, rank=rank, block=opts["block"])
    sched = TransferScheduler(_pools(layout), lease_s=30.0)
    prod = Producer(memory, sched, TransportConfig(secret=SECRET), planner=DescriptorPlanner(pairing=Pairing.FIELDS))
    out.put(("addr", await prod.start()))
    plans = {}
    for step, (rid, tokens) in enumerate(opts["requests"], 1):
        sched.add_request(rid)
        plans[rid] = {g: list(sched.allocate(rid, g, n)) for g, n in _counts(layout, tokens).items()}
        sched.step_scheduled(step, joined=[rid])
        sched.step_completed(step)
        sched.request_finished(rid, export=True)
    out.put(("fields", {rid: field_digests(layout, plans[rid], t) for rid, t in opts["requests"]}))
    results = await asyncio.gather(*(prod.export(rid, token=token(rid)) for rid in plans))
    sched.audit()
    out.put(("results", [(r.request_id, r.outcome.name, r.error) for r in results]))
    pools = sched.layout.pool_sizes
    out.put(("state", {"free": [sched.free_count(p) for p in range(len(pools))], "total": list(pools),
                       "in_flight": sched.transfers_in_flight()}))
    await _await_inbox(inbox, "stop", prod)
    await prod.close()


def consumer_main(opts, out, inbox) -> None:
    _quiet()
    try:
        asyncio.run(_consumer(opts, out, inbox))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


async def _consumer(opts, out, inbox):
    from hybridkv.descriptors.planning import DescriptorPlanner
    from hybridkv.fencing.scheduler import TransferScheduler
    from hybridkv.transport.endpoint import Consumer, Pairing, TransportConfig

    tp, rank = opts["tp"], opts["rank"]
    layout, memory, _ = build(50 + rank, tp=tp, rank=rank, block=opts["block"])
    sched = TransferScheduler(_pools(layout), lease_s=30.0)
    cons = Consumer(memory, sched, TransportConfig(secret=SECRET), planner=DescriptorPlanner(pairing=Pairing.FIELDS))
    agents = [await cons.connect(host, port) for host, port in opts["addrs"]]
    plan = cons.prepared(agents)
    comps = components(layout)
    plans = {}
    for rid, tokens in opts["requests"]:
        sched.add_request(rid, expect=comps)
        sched.add_request(rid + "-pad")  # the destination blocks sit elsewhere than the source's
        for g in _counts(layout, tokens):
            sched.allocate(rid + "-pad", g, 1)
        plans[rid] = {g: list(sched.allocate(rid, g, n)) for g, n in _counts(layout, tokens).items()}
    results = await asyncio.gather(*(cons.fetch(rid, comps, token=token(rid), peers=agents, readers=opts["readers"])
                                     for rid in plans))
    sched.audit()
    out.put(("results", [(r.request_id, r.outcome.name, r.error, r.descriptors, r.nbytes, r.planned)
                         for r in results]))
    out.put(("fields", {rid: field_digests(layout, plans[rid], t) for rid, t in opts["requests"]}))
    out.put(("sources", {r: sorted(f"{k[0].value}/{k[1]}/{k[2]}" for k in keys) for r, keys in plan.sources.items()}))
    out.put(("state", {"phases": {rid: sched.phase(rid).name for rid in plans},
                       "in_flight": sched.transfers_in_flight()}))
    await cons.close()
    out.put(("finished", None))
