"""Producer / consumer processes of one TP rank each, pairing by fields (heterogeneous TP, block sizes).

Each rank plans its own shard (plan_layout with tp/rank/block), fills it with a
rank-specific pattern, and reports a digest per field key of each request: the
field's bytes over the request's blocks in token order (clipped to the prompt
for token-indexed fields). A decode rank must end with exactly the bytes of the
prefill rank it was assigned each field from.

``staging`` (a dict of StagingConfig fields, both sides): heterogeneous-TP reads go through
staging slots (transport/staging.py), but for the requests listed in ``sliced``. ``scatter``: blocks
handed out one at a time across the requests (no run of neighbours); ``sequential``: one fetch at a time. ``want_first`` (consumer): ask for every request and wait
for every Export before any READ, so that every slot is packed before the first is read (a slot
reused early then corrupts a read for certain).
"""

from __future__ import annotations

import asyncio
import hashlib
import traceback

import numpy as np

from tests.transport.peers import SECRET, _await_inbox, _quiet, build, build_vllm, components, token


def field_digests(layout, blocks: dict[int, list[int]], tokens: int) -> dict[str, str]:
    out = {}
    for g in layout.groups:
        for p in g.placements:
            r = layout.regions[p.region_id]
            buf = layout.allocations[p.region_id].owner
            if hasattr(buf, "cpu"):  # a GPU tensor (mem="vram"): its bytes, on the host
                buf = buf.cpu().numpy()
            for f in p.fields:
                data = b"".join(buf[b * r.stride + f.offset: b * r.stride + f.offset + f.nbytes].tobytes()
                                for b in blocks.get(g.group_id, []))
                if f.token_bytes and g.block_tokens:
                    data = data[: tokens * f.token_bytes]
                out[f"{f.key[0].value}/{f.key[1]}/{f.key[2]}"] = hashlib.sha256(data).hexdigest()
    return out


def _counts(layout, tokens):
    return {g.group_id: (1 if g.block_tokens is None else -(-tokens // g.block_tokens)) for g in layout.groups}


def _staging(opts):
    from hybridkv.transport.staging import StagingConfig, StagingMode

    cfg = opts.get("staging")
    if cfg is None:
        return None
    cfg = dict(cfg)
    if "mode" in cfg:
        cfg["mode"] = StagingMode(cfg["mode"])
    return StagingConfig(**cfg)


def _scattered(sched, layout, requests) -> dict:
    """Blocks handed out one at a time, request after request (``scatter``): no two consecutive blocks
    of a request are neighbours in memory while the others still take blocks, as in a busy engine."""
    need = {rid: _counts(layout, tokens) for rid, tokens in requests}
    plans: dict = {rid: {g: [] for g in need[rid]} for rid in need}
    for g in next(iter(need.values())):
        while any(len(plans[rid][g]) < need[rid][g] for rid in need):
            for rid in need:
                if len(plans[rid][g]) < need[rid][g]:
                    plans[rid][g] += list(sched.allocate(rid, g, 1))
    return plans


def _layout(opts, seed: int):
    """(layout, block pools) of one rank: hybridkv's planned layout (separate pools), or with ``kernel``
    (tokens of the attention kernel's blocks) vLLM 0.33's hybrid-allocator pages of ``pages`` blocks split
    into kernel blocks, in the layer-compact layout vLLM needs for that (one pool, as vLLM's)."""
    tp, rank, mem = opts["tp"], opts["rank"], opts.get("mem", "dram")
    if opts.get("kernel"):
        layout, _, pools = build_vllm(seed, tp=tp, rank=rank, block=opts["block"], kernel=opts["kernel"],
                                      pages=opts["pages"], geo_over=opts.get("geo"), mem=mem)
        return layout, pools
    layout, _, _ = build(seed, tp=tp, rank=rank, block=opts["block"], geo_over=opts.get("geo"), mem=mem)
    return layout, _pools(layout)


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
    from hybridkv.transport.memory import from_layout

    layout, pools = _layout(opts, 10 + opts["rank"])
    memory = from_layout(layout)
    sched = TransferScheduler(pools, lease_s=30.0)
    host = opts.get("mem", "dram") == "dram"  # tests/transport/peers.py HOST_MEMORY_OK
    prod = Producer(memory, sched, TransportConfig(secret=SECRET, insecure_host_memory=host),
                    planner=DescriptorPlanner(pairing=Pairing.FIELDS),
                    staging=_staging(opts))
    out.put(("addr", await prod.start()))
    plans = {}
    if opts.get("scatter"):
        for rid, _ in opts["requests"]:
            sched.add_request(rid)
        plans = _scattered(sched, layout, opts["requests"])
    for step, (rid, tokens) in enumerate(opts["requests"], 1):
        if not opts.get("scatter"):
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
                       "in_flight": sched.transfers_in_flight(),
                       "staging": None if prod.staging is None else prod.staging.describe()}))
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
    from hybridkv.transport.memory import from_layout

    layout, pools = _layout(opts, 50 + opts["rank"])
    memory = from_layout(layout)
    sched = TransferScheduler(pools, lease_s=30.0)
    planner = DescriptorPlanner(pairing=Pairing.FIELDS, coalesce=opts.get("coalesce", True))
    host = opts.get("mem", "dram") == "dram"  # tests/transport/peers.py HOST_MEMORY_OK
    cons = Consumer(memory, sched, TransportConfig(secret=SECRET, insecure_host_memory=host), planner=planner,
                    staging=_staging(opts))
    agents = [await cons.connect(host, port) for host, port in opts["addrs"]]
    plan = cons.prepared(agents)
    comps = components(layout)
    plans = {}
    for rid, tokens in opts["requests"]:
        sched.add_request(rid, expect=comps)
        if opts.get("scatter"):
            continue
        sched.add_request(rid + "-pad")  # the destination blocks sit elsewhere than the source's
        for g in _counts(layout, tokens):
            sched.allocate(rid + "-pad", g, 1)
        plans[rid] = {g: list(sched.allocate(rid, g, n)) for g, n in _counts(layout, tokens).items()}
    if opts.get("scatter"):
        plans = _scattered(sched, layout, opts["requests"])
    sliced = set(opts.get("sliced", ()))  # requests read sliced whatever the staging config says
    if opts.get("want_first"):
        stage = cons._importer._stage_flags([cons.peers[a] for a in agents])
        for rid in plans:
            for a, st in zip(agents, stage):
                await cons.want(rid, token=token(rid), peer=a, readers=opts["readers"], stage=st and rid not in sliced)
        while not all(cons.exported(rid, peer=a) for rid in plans for a in agents):
            await asyncio.sleep(0.005)
    fetches = [cons.fetch(rid, comps, token=token(rid), peers=agents, readers=opts["readers"],
                          stage=False if rid in sliced else None) for rid in plans]
    if opts.get("sequential"):  # one at a time: each transfer's time is its own
        results = [await f for f in fetches]
    else:
        results = await asyncio.gather(*fetches)
    sched.audit()
    out.put(("results", [(r.request_id, r.outcome.name, r.error, r.descriptors, r.nbytes, r.planned, r.seconds)
                         for r in results]))
    out.put(("fields", {rid: field_digests(layout, plans[rid], t) for rid, t in opts["requests"]}))
    out.put(("sources", {r: sorted(f"{k[0].value}/{k[1]}/{k[2]}" for k in keys) for r, keys in plan.sources.items()}))
    out.put(("state", {"phases": {rid: sched.phase(rid).name for rid in plans},
                       "in_flight": sched.transfers_in_flight(),
                       "staging": None if cons.staging is None else cons.staging.describe()}))
    await cons.close()
    out.put(("finished", None))


def run_pair(p_tp: int, d_tp: int, p_block: int, d_block: int, requests, **opts) -> dict:
    """One process per rank on each side; every decode rank's fields compared with the producer rank
    it read each from, every block and staging slot given back on both sides. Returns per request
    the descriptors each decode rank posted (``per_rank``) and their sum (``total``)."""
    from hybridkv.descriptors.planning import source_ranks
    from tests.transport.harness import Proc

    prods = [Proc(producer_main, {"tp": p_tp, "rank": r, "block": p_block, "requests": requests, **opts})
             for r in range(p_tp)]
    conss = []
    try:
        addrs = [p.expect("addr") for p in prods]
        for d in range(d_tp):
            ranks, readers = source_ranks(d_tp, d, p_tp)
            conss.append(Proc(consumer_main, {
                "tp": d_tp, "rank": d, "block": d_block, "requests": requests, "readers": readers,
                "addrs": [addrs[r] for r in ranks], **opts}))
        sent = [p.expect("fields") for p in prods]
        per_rank = {rid: [] for rid, _ in requests}
        times: dict[str, list[float]] = {rid: [] for rid, _ in requests}
        bad = []
        for cons in conss:
            results = cons.expect("results")
            assert {r[0]: r[1] for r in results} == {rid: "READY" for rid, _ in requests}, results
            got = cons.expect("fields")
            sources = cons.expect("sources")
            owner = {key: rank for rank, keys in sources.items() for key in keys}
            for rid, _ in requests:
                assert set(owner) == set(got[rid])  # every field of this rank came from some producer rank
                bad += [(rid, key, owner[key]) for key, digest in got[rid].items()
                        if digest != sent[owner[key]][rid][key]]
            for rid, _, _, desc, nbytes, planned, seconds in results:
                assert desc and nbytes > 0
                assert desc == planned, (rid, desc, planned)  # NIXL posted what the planner said
                per_rank[rid].append(desc)
                times[rid].append(seconds)
            state = cons.expect("state")
            assert set(state["phases"].values()) == {"READY"} and state["in_flight"] == 0
            if state["staging"] is not None:  # every slot of ours back: its READ ended, it was unpacked
                assert state["staging"]["free"] == state["staging"]["units"], state["staging"]
            cons.expect("finished")
        assert not bad, f"fields that differ from their producer's (request, field, producer rank): {bad[:8]}"
        for p in prods:  # every producer rank freed its blocks: each reader told it Done
            assert {r[0]: r[1] for r in p.expect("results")} == {rid: "DONE" for rid, _ in requests}
            state = p.expect("state")
            assert state["free"] == state["total"] and state["in_flight"] == 0
            if state["staging"] is not None:
                assert state["staging"]["free"] == state["staging"]["units"], state["staging"]
        return {rid: {"per_rank": per_rank[rid], "total": sum(per_rank[rid]), "seconds": times[rid]}
                for rid, _ in requests}
    finally:
        for p in prods + conss:
            p.stop()


def _ms(m: dict, rids) -> float:
    import statistics

    return round(statistics.median(x * 1e3 for r in rids for x in m[r]["seconds"]), 2)


def main(argv=None) -> None:
    """Staged against sliced reads, post to landed, in one run per TP pair (blocks scattered, one fetch at
    a time, a sliced and a staged warm-up first), then the same requests posted unmerged, piece by piece and
    block by block as engines build their lists, and NixlConnector's count for the request:

        .venv/bin/python -m tests.transport.hetero_peers [--mem vram] [--tokens 500] [--pairs 2:1,1:2,4:1,8:2]
            [--kernel-block 16]

    On a GPU (``--mem vram``) every rank is a process on GPU 0 (cuda_ipc), staging copies run on torch."""
    import argparse

    from hybridkv.descriptors.hma import plan_hma
    from hybridkv.descriptors.schemes import Scheme, Workload, count_descriptors
    from hybridkv.transport.staging import StagingConfig, StagingMode
    from tests.transport.peers import geometry

    ap = argparse.ArgumentParser()
    ap.add_argument("--mem", choices=("dram", "vram"), default="dram")
    ap.add_argument("--tokens", type=int, default=450)  # six requests fit the test layouts' 64 pages
    ap.add_argument("--pairs", default="2:1,1:2,4:1", metavar="P:D[,P:D...]",
                    help="prefill TP : decode TP pairs; 8:2 starts ten processes")
    ap.add_argument("--kernel-block", type=int, default=None, metavar="TOKENS",
                    help="run on vLLM 0.33's own pages instead (hybrid allocator, its block size for the pair, "
                         "layer-compact as vLLM needs for kernel blocks), split into attention kernel blocks "
                         "of this many tokens (e.g. 16, FlashInfer's); NixlConnector's count at that kernel block")
    args = ap.parse_args(argv)
    pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.pairs.split(",")]
    t, k = args.tokens, args.kernel_block
    reqs = [("w0", t), ("v0", t), ("s1", t), ("x1", t), ("s2", t), ("x2", t)]  # w0, v0: warm-ups
    where = ("block 48, hybridkv's layout" if k is None else
             f"vLLM's pages (LBHNC, hybrid allocator's block) in {k}-token kernel blocks")
    print(f"staged (ON) vs sliced, {t} tokens, {where}, blocks scattered, {args.mem}; ms post to landed, "
          "per decode rank")
    for p_tp, d_tp in pairs:
        # The test geometry has 2 KV heads; a TP above that needs as many heads as ranks.
        heads = max(p_tp, d_tp)
        geo = {"num_kv_heads": heads, "num_k_heads": heads, "num_v_heads": heads} if heads > 2 else None
        g = geometry(**(geo or {}))
        layout: dict = {}
        block = 48
        if k is not None:
            # vLLM raises the block until a page holds a GDN state, per rank's shard; both sides at the larger
            # (NixlConnector pairs equal block sizes); a pool for every request's blocks, scattered, twice over
            block = max(plan_hma(g.shard(tp)).block_size for tp in (p_tp, d_tp))
            n = sum(grp.blocks_for_tokens(t) for grp in plan_hma(g.shard(d_tp), block).groups)
            layout = {"kernel": k, "pages": 2 * n * (len(reqs) + 1) + 8}
        m = run_pair(p_tp, d_tp, block, block, reqs, staging={"mode": "on"}, sliced=["w0", "x1", "x2"],
                     want_first=True, scatter=True, sequential=True, geo=geo, mem=args.mem, **layout)
        staged = StagingConfig(mode=StagingMode.ON)
        w = Workload(geometry=g, tokens=t, block_size=block, tp_prefill=p_tp, tp_decode=d_tp, fragmentation=1.0,
                     kernel_block_size=k, staging=staged)
        nixl = count_descriptors(Scheme.VLLM_033, w).per_decode_rank
        analyzer = count_descriptors(Scheme.HYBRIDKV_VLLM if k is not None else Scheme.HYBRIDKV, w).per_decode_rank
        ms = lambda rids: _ms(m, rids)  # noqa: E731
        # The engine's way on the same memory: the sliced plan piece by piece, block by block, unmerged
        # (what NixlConnector's list is, in this layout), posted by the same transport right after.
        e = run_pair(p_tp, d_tp, block, block, [("n0", t), ("n1", t), ("n2", t)], coalesce=False, scatter=True,
                     sequential=True, geo=geo, mem=args.mem, **layout)
        print(f"P TP{p_tp} -> D TP{d_tp}{'' if k is None else f' block {block} k{k}'}: staged "
              f"{max(m['s1']['per_rank'])} descriptors {ms(['s1', 's2'])} ms; "
              f"sliced {max(m['x1']['per_rank'])} descriptors {ms(['x1', 'x2'])} ms; unmerged (engine-style) "
              f"{max(e['n1']['per_rank'])} descriptors {_ms(e, ['n1', 'n2'])} "
              f"ms; NixlConnector's list {nixl}; analyzer "
              f"({'hybridkv-vllm' if k is not None else 'hybridkv'}, on) {analyzer}", flush=True)


if __name__ == "__main__":
    main()
