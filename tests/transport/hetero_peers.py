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
reused early then corrupts a read for certain). ``e2e``: also time each fetch from its call to its return
(Want, the producer's pack, post, landing, the consumer's unpack: a staged read's gathers included) and each
staging copy of either side, and report the copier's engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import numpy as np

from tests.transport.peers import SECRET, _await_inbox, build, build_vllm, components, run_peer, token


def field_digests(layout, blocks: dict[int, list[int]], tokens: int, host: dict | None = None) -> dict[str, str]:
    """``host``: GPU regions already copied to the host, by region id (filled here; pass one dict for every
    request of a layout, so that a model-sized region crosses once)."""
    out = {}
    host = {} if host is None else host
    for g in layout.groups:
        for p in g.placements:
            r = layout.regions[p.region_id]
            buf = layout.allocations[p.region_id].owner
            if hasattr(buf, "cpu"):  # a GPU tensor (mem="vram"): its bytes, on the host
                if p.region_id not in host:
                    host[p.region_id] = buf.cpu().numpy()
                buf = host[p.region_id]
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
    tp, rank, mem, model = opts["tp"], opts["rank"], opts.get("mem", "dram"), opts.get("model")
    if opts.get("kernel"):
        layout, _, pools = build_vllm(seed, tp=tp, rank=rank, block=opts["block"], kernel=opts["kernel"],
                                      pages=opts["pages"], geo_over=opts.get("geo"), mem=mem, model=model)
        return layout, pools
    layout, _, _ = build(seed, tp=tp, rank=rank, block=opts["block"], geo_over=opts.get("geo"), mem=mem,
                         model=model, num_blocks=opts.get("num_blocks"))
    return layout, _pools(layout)


def _pools(layout):
    from hybridkv.fencing.fence import PoolLayout

    return PoolLayout.separate(num_blocks=tuple(layout.regions[g.placements[0].region_id].num_pages
                                                for g in layout.groups))


def _timed(pool, log: list) -> None:
    """Record every run of the staging pool's copier (a pack or an unpack) as (seconds, bytes): the copier
    returns once its copies landed (on a GPU it synchronizes), so the time is the gather's."""
    if pool is None:
        return
    run = pool.copier.run

    def timed(steps):
        t0 = time.perf_counter()
        run(steps)
        nbytes = getattr(steps, "nbytes", None)  # CopySteps; a list of CopyStep in trees before 40ecfbe (A/B runs)
        log.append((time.perf_counter() - t0, nbytes if nbytes is not None
                    else sum(int(st.src_pages.size) * st.length for st in steps)))

    pool.copier.run = timed


def _engine(pool) -> str | None:
    """What ran the pool's gathers: numpy on host memory, on a GPU the Triton kernel or torch's indexing
    (StagingConfig.gather, from HYBRIDKV_STAGING_GATHER)."""
    from hybridkv import wire
    from hybridkv.kernels.staging.reference import gather_rows_reference

    if pool is None:
        return None
    if pool.region.mem is not wire.Mem.VRAM:
        return "numpy"
    fn = pool.copier.gpu_gather()
    return "torch indexing" if fn is gather_rows_reference else f"triton ({fn.__module__}.{fn.__name__})"


def producer_main(opts, out, inbox) -> None:
    run_peer(_producer, opts, out, inbox)


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
    copies: list = []
    if opts.get("e2e"):
        _timed(prod.staging, copies)
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
    host_copy: dict = {}
    out.put(("fields", {rid: field_digests(layout, plans[rid], t, host_copy) for rid, t in opts["requests"]}))
    host_copy.clear()
    results = await asyncio.gather(*(prod.export(rid, token=token(rid)) for rid in plans))
    sched.audit()
    out.put(("results", [(r.request_id, r.outcome.name, r.error) for r in results]))
    if opts.get("e2e"):
        out.put(("copies", {"engine": _engine(prod.staging), "runs": copies}))
    pools = sched.layout.pool_sizes
    out.put(("state", {"free": [sched.free_count(p) for p in range(len(pools))], "total": list(pools),
                       "in_flight": sched.transfers_in_flight(),
                       "staging": None if prod.staging is None else prod.staging.describe()}))
    await _await_inbox(inbox, "stop", prod)
    await prod.close()


def consumer_main(opts, out, inbox) -> None:
    run_peer(_consumer, opts, out, inbox)


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
    copies: list = []
    _timed(cons.staging, copies)  # the decode's copier runs only unpacks
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
        for rid in plans:
            stage = cons._importer._staging.flags(rid, [cons.peers[a] for a in agents])
            masks = cons._importer._staging.fields([cons.peers[a] for a in agents])  # what fetch's Wants name
            for a, st, mask in zip(agents, stage, masks):
                await cons.want(rid, token=token(rid), peer=a, readers=opts["readers"], stage=st and rid not in sliced,
                                fields=mask)
        while not all(cons.exported(rid, peer=a) for rid in plans for a in agents):
            await asyncio.sleep(0.005)
    walls: dict[str, float] = {}
    phases: dict[str, tuple[float, float]] = {}  # (call -> every Export in, every Export in -> return)
    exports_in: list[float] = []
    if opts.get("e2e"):  # the import asks for its planner once every Export is in (fetch.py, Importer._import)
        prepared0 = cons._importer._prepared

        def prepared(agents):
            exports_in.append(time.perf_counter())
            return prepared0(agents)

        cons._importer._prepared = prepared

    async def timed(rid, f):
        t0 = time.perf_counter()
        got = await f
        end = time.perf_counter()
        walls[rid] = end - t0
        if exports_in and exports_in[-1] >= t0:  # one fetch at a time (e2e runs are sequential)
            phases[rid] = (exports_in[-1] - t0, end - exports_in[-1])
        return got

    fetches = [timed(rid, cons.fetch(rid, comps, token=token(rid), peers=agents, readers=opts["readers"],
                                     stage=False if rid in sliced else None)) for rid in plans]
    if opts.get("sequential"):  # one at a time: each transfer's time is its own
        results = [await f for f in fetches]
    else:
        results = await asyncio.gather(*fetches)
    if opts.get("e2e"):
        out.put(("walls", {rid: (w, phases.get(rid)) for rid, w in walls.items()}))
        out.put(("copies", {"engine": _engine(cons.staging), "runs": copies}))
    sched.audit()
    out.put(("results", [(r.request_id, r.outcome.name, r.error, r.descriptors, r.nbytes, r.planned, r.seconds)
                         for r in results]))
    host_copy: dict = {}
    out.put(("fields", {rid: field_digests(layout, plans[rid], t, host_copy) for rid, t in opts["requests"]}))
    host_copy.clear()
    out.put(("sources", {r: sorted(f"{k[0].value}/{k[1]}/{k[2]}" for k in keys) for r, keys in plan.sources.items()}))
    out.put(("state", {"phases": {rid: sched.phase(rid).name for rid in plans},
                       "in_flight": sched.transfers_in_flight(), "unpack_runs": len(copies),
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
        wait = 600.0 if opts.get("e2e") else 60.0  # model-sized pools take a while to fill and hash
        addrs = [p.expect("addr", timeout=wait) for p in prods]
        for d in range(d_tp):
            ranks, readers = source_ranks(d_tp, d, p_tp)
            conss.append(Proc(consumer_main, {
                "tp": d_tp, "rank": d, "block": d_block, "requests": requests, "readers": readers,
                "addrs": [addrs[r] for r in ranks], **opts}))
        sent = [p.expect("fields", timeout=wait) for p in prods]
        per_rank = {rid: [] for rid, _ in requests}
        times: dict[str, list[float]] = {rid: [] for rid, _ in requests}
        walls: dict[str, list[float]] = {rid: [] for rid, _ in requests}
        splits: dict[str, list[tuple[float, float]]] = {rid: [] for rid, _ in requests}
        nbytes_of: dict[str, list[int]] = {rid: [] for rid, _ in requests}
        copies: dict[str, list] = {"pack": [], "unpack": [], "engine": []}  # runs: a list per process
        prefill_staging = []  # each producer rank's pool counters (describe())
        unpack_runs = []  # each decode rank's unpacks (copier runs)
        bad = []
        for cons in conss:
            if opts.get("e2e"):  # before results: a long run's reports arrive in this order
                for rid, (s, split) in cons.expect("walls", timeout=wait).items():
                    walls[rid].append(s)
                    if split is not None:
                        splits[rid].append(split)
                got_copies = cons.expect("copies")
                copies["unpack"].append(got_copies["runs"])
                copies["engine"].append(("decode", got_copies["engine"]))
            results = cons.expect("results", timeout=wait)
            assert {r[0]: r[1] for r in results} == {rid: "READY" for rid, _ in requests}, results
            got = cons.expect("fields", timeout=wait)
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
                nbytes_of[rid].append(nbytes)
            state = cons.expect("state")
            assert set(state["phases"].values()) == {"READY"} and state["in_flight"] == 0
            unpack_runs.append(state["unpack_runs"])
            if state["staging"] is not None:  # every slot of ours back: its READ ended, it was unpacked
                assert state["staging"]["free"] == state["staging"]["units"], state["staging"]
                # a full pool falls back to the sliced read unsaid: a timing run must never have
                assert not opts.get("e2e") or not state["staging"]["full"], ("decode staging pool full",
                                                                             state["staging"])
            cons.expect("finished")
        assert not bad, f"fields that differ from their producer's (request, field, producer rank): {bad[:8]}"
        for p in prods:  # every producer rank freed its blocks: each reader told it Done
            assert {r[0]: r[1] for r in p.expect("results")} == {rid: "DONE" for rid, _ in requests}
            if opts.get("e2e"):
                got_copies = p.expect("copies")
                copies["pack"].append(got_copies["runs"])
                copies["engine"].append(("prefill", got_copies["engine"]))
            state = p.expect("state")
            assert state["free"] == state["total"] and state["in_flight"] == 0
            prefill_staging.append(state["staging"])
            if state["staging"] is not None:
                assert state["staging"]["free"] == state["staging"]["units"], state["staging"]
                assert not opts.get("e2e") or not state["staging"]["full"], ("prefill staging pool full",
                                                                             state["staging"])
        out = {rid: {"per_rank": per_rank[rid], "total": sum(per_rank[rid]), "seconds": times[rid]}
               for rid, _ in requests}
        if opts.get("e2e"):
            for rid, _ in requests:
                out[rid].update(wall=walls[rid], nbytes=nbytes_of[rid],
                                want=[a for a, _ in splits[rid]], after=[b for _, b in splits[rid]])
            out["copies"] = copies
        out["prefill_staging"] = prefill_staging
        out["unpack_runs"] = unpack_runs
        return out
    finally:
        for p in prods + conss:
            p.stop()


def _ms(m: dict, rids, key: str = "seconds") -> float:
    import statistics

    return round(statistics.median(x * 1e3 for r in rids for x in m[r][key]), 2)


#: hybridkv's own layout's block in this harness (the tiny geometry's and a model's)
BLOCK = 48


def _model_pools(g, p_tp: int, d_tp: int, tokens: int, nreq: int, kernel: int | None) -> tuple[int, dict]:
    """(block, layout opts) for a model-sized run: each rank's pools hold ``nreq`` requests of ``tokens`` and a
    pad block per group each, no more (ten processes of 8:2 share one GPU)."""
    from hybridkv.descriptors.hma import plan_hma

    if kernel is None:
        n = -(-tokens // BLOCK)
        return BLOCK, {"num_blocks": {"attn": nreq * (n + 1), "gdn": 2 * nreq}}
    block = max(plan_hma(g.shard(tp)).block_size for tp in (p_tp, d_tp))
    groups = plan_hma(g.shard(d_tp), block).groups
    n = sum(grp.blocks_for_tokens(tokens) for grp in groups)
    return block, {"kernel": kernel, "pages": nreq * (n + len(groups)) + 2}


def _shard_layout(g, tp: int, rank: int, block: int, allocator, *, kernel=None, pages=None, num_blocks=None):
    """One rank's layout as its process plans it (``_layout``), here on any allocator (VirtualAllocator: no
    memory, for sizes and plans)."""
    from hybridkv.layout import plan_layout
    from hybridkv.layout.geometry import LayerKind
    from tests.transport.peers import vllm_layout

    if kernel:
        return vllm_layout(g, tp=tp, rank=rank, block=block, kernel=kernel, pages=pages, allocator=allocator)
    nb = {LayerKind.FULL_ATTENTION: num_blocks["attn"], LayerKind.GDN: num_blocks["gdn"]}
    return plan_layout(g, block_size=block, num_blocks=nb, allocator=allocator, tp=tp, rank=rank)


def predict(g, p_tp: int, d_tp: int, tokens: int, block: int, pools: dict) -> dict:
    """What decode rank 0's transport weighs per producer rank it reads (transport/import_staging.py's inputs to
    ``staging.route``): the sliced plan's descriptors, the staged slot's read straight into its pages, the
    packed bytes; on layouts planned as the processes' (no memory), blocks scattered (none adjacent). Also
    each rank's bytes of pages (rank 0 of each side)."""
    from hybridkv.descriptors.planning import DescriptorPlanner, source_ranks
    from hybridkv.descriptors.schemes import fragmented_blocks
    from hybridkv.layout.alloc import VirtualAllocator
    from hybridkv.transport.endpoint import Pairing
    from hybridkv.transport.memory import from_layout

    alloc = VirtualAllocator()
    ranks, readers = source_ranks(d_tp, 0, p_tp)
    srcs = [_shard_layout(g, p_tp, r, block, alloc, **pools) for r in ranks]
    dst = _shard_layout(g, d_tp, 0, block, alloc, **pools)
    prepared = DescriptorPlanner(pairing=Pairing.FIELDS).prepare([from_layout(x) for x in srcs], from_layout(dst))
    sb, at = {}, 0
    for grp in dst.groups:  # groups apart where they share one pool (vLLM's)
        sb[grp.group_id] = fragmented_blocks(1 if grp.block_tokens is None else -(-tokens // grp.block_tokens),
                                             1.0, start=at)
        at = int(sb[grp.group_id][-1]) + 2 if pools.get("kernel") else 0
    db = {gid: b + 1 for gid, b in sb.items()}  # elsewhere than the source's
    parts = []
    for i, rank in enumerate(ranks):
        stager = prepared.stager(i)
        if stager is None:  # feeds none of this rank's fields (GQA duplicate)
            continue
        parts.append({"rank": rank, "sliced": prepared.plan(i, sb, db).num_descriptors,
                      "direct": stager.read(1 << 46, 0, sb, db).num_descriptors, "nbytes": stager.nbytes(sb)})
    return {"parts": parts, "readers": readers, "prefill_bytes": sum(a.nbytes for a in srcs[0].allocations),
            "decode_bytes": sum(a.nbytes for a in dst.allocations)}


def routes(part: dict, mem, gbps: float | None) -> dict:
    """staging.route's choice for one part: ON's way, AUTO's at COSTS and at ``gbps``, and the gather speed
    above which AUTO stages it (the descriptors saved at COSTS' posting cost against the copies added)."""
    from hybridkv.transport.staging import COSTS, Route, StagingConfig, StagingMode, route

    args = {"sliced": part["sliced"], "direct": part["direct"], "own_pool": True, "nbytes": part["nbytes"],
            "mem": mem}
    on = route(StagingConfig(mode=StagingMode.ON), **args)
    got: dict = {"on": on, "auto": route(StagingConfig(mode=StagingMode.AUTO), **args),
           "auto_at": None if gbps is None else route(StagingConfig(mode=StagingMode.AUTO, copy_gbps=gbps), **args),
           "costs": COSTS[mem], "break_even_gbps": None}
    if on is not Route.SLICED:
        saved_us = (part["sliced"] - (part["direct"] if on is Route.DIRECT else 1)) * COSTS[mem][0]
        copies = 1 if on is Route.DIRECT else 2
        got["break_even_gbps"] = copies * part["nbytes"] / (saved_us * 1e3) if saved_us > 0 else float("inf")
    return got


def _copy_speed(runs: list) -> str:
    """Median of a side's staging copies after each process's first third (the warm-up request's)."""
    import statistics

    kept = [r for proc in runs for r in proc[len(proc) // 3:]]
    if not kept:
        return "none"
    s = statistics.median(t for t, _ in kept)
    b = statistics.median(n for _, n in kept)
    return f"{s * 1e3:.2f} ms for {b / 1e6:.1f} MB ({b / s / 1e9:.1f} GB/s, {len(kept)} runs)"


def _model_report(model: str, mem: str, gbps: float | None, pred: dict, m: dict, e: dict, capacity: int,
                  p_tp: int, d_tp: int) -> None:
    from hybridkv import wire
    from hybridkv.transport.staging import Route

    kind = wire.Mem.VRAM if mem == "vram" else wire.Mem.DRAM
    parts = pred["parts"]
    reads = sum(p["nbytes"] for p in parts)
    staged_ms, sliced_ms = _ms(m, ["s1", "s2"], "wall"), _ms(m, ["x1", "x2"], "wall")
    winner = "staged" if staged_ms < sliced_ms else "sliced"
    engines = sorted({f"{side}: {eng}" for side, eng in m["copies"]["engine"] if eng is not None})
    print(f"  fetch, call to return (Want, pack, post, landed, unpack): staged {staged_ms} ms, sliced {sliced_ms} "
          f"ms, unmerged {_ms(e, ['n1', 'n2'], 'wall')} ms -> {winner} wins ({staged_ms / sliced_ms:.2f}x sliced)")
    for way, rids in (("staged", ["s1", "s2"]), ("sliced", ["x1", "x2"])):
        if all(m[r].get("want") for r in rids):
            after = [a - s for r in rids for a, s in zip(m[r]["after"], m[r]["seconds"])]
            print(f"  {way}: call -> every Export in (the Want, the producer's pack, its Export) "
                  f"{_ms(m, rids, 'want')} ms; Export in -> return less post-to-landed (planning, unpack, ledger) "
                  f"{sorted(after)[len(after) // 2] * 1e3:.2f} ms")
    print(f"  staging copies ({'; '.join(engines) or 'none'}): pack {_copy_speed(m['copies']['pack'])}; "
          f"unpack {_copy_speed(m['copies']['unpack'])}")
    print(f"  producers pack {reads / 1e6:.1f} MB for decode rank 0 ({len(parts)} rank(s); a GQA-replicated head "
          f"only by the one it is read from); it reads (measured: "
          f"staged {min(m['s1']['nbytes']) / 1e6:.1f}-{max(m['s1']['nbytes']) / 1e6:.1f} MB, sliced "
          f"{min(m['x1']['nbytes']) / 1e6:.1f}-{max(m['x1']['nbytes']) / 1e6:.1f} MB per decode rank)")
    for p in parts:
        r = routes(p, kind, gbps)
        us, assumed = r["costs"]
        at = "" if gbps is None else f", at {gbps:g} GB/s {r['auto_at'].value}"
        even = r["break_even_gbps"]
        turns = ("" if even is None else "; AUTO never stages it" if even == float("inf")
                 else f"; AUTO stages above {even:.1f} GB/s")
        print(f"    from P rank {p['rank']}: {p['nbytes'] / 1e6:.1f} MB packed; sliced {p['sliced']} descriptors, "
              f"straight from the slot {p['direct']}; ON reads it {r['on'].value}"
              f"{'' if r['on'] is Route.SLICED else ' (' + str(p['direct'] if r['on'] is Route.DIRECT else 1) + ')'}"
              f"; AUTO at COSTS ({us:g} us/descriptor, {assumed:g} GB/s) {r['auto'].value}{at}"
              f"{turns}")
    print(f"  memory per rank: prefill {pred['prefill_bytes'] / 1e9:.2f} GB, decode {pred['decode_bytes'] / 1e9:.2f} "
          f"GB of pages, + staging pool {capacity / 1e6:.0f} MB each; all {p_tp + d_tp} processes "
          f"{(p_tp * pred['prefill_bytes'] + d_tp * pred['decode_bytes'] + (p_tp + d_tp) * capacity) / 1e9:.2f} GB "
          f"({model}, {mem})", flush=True)


def _positive(kind):
    import argparse

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{text!r}; expected a positive number")
        return v
    return parse


def parse_args(argv=None):
    """The command line, checked: pairs of two different TP sizes, one a multiple of the other; a preset
    model of full attention and GDN layers (what this harness lays out)."""
    import argparse

    from hybridkv.layout.geometry import LayerKind
    from hybridkv.layout.presets import PRESET_NAMES, get_preset

    ap = argparse.ArgumentParser(prog="python -m tests.transport.hetero_peers")
    ap.add_argument("--mem", choices=("dram", "vram"), default="dram")
    ap.add_argument("--tokens", type=_positive(int), default=450)  # six requests fit the test layouts' 64 pages
    ap.add_argument("--pairs", default="2:1,1:2,4:1", metavar="P:D[,P:D...]",
                    help="prefill TP : decode TP pairs; 8:2 starts ten processes")
    ap.add_argument("--kernel-block", type=_positive(int), default=None, metavar="TOKENS",
                    help="run on vLLM 0.33's own pages instead (hybrid allocator, its block size for the pair, "
                         "layer-compact as vLLM needs for kernel blocks), split into attention kernel blocks "
                         "of this many tokens (e.g. 16, FlashInfer's); NixlConnector's count at that kernel block")
    ap.add_argument("--model", default=None, metavar="NAME",
                    help="a preset geometry (as `hybridkv bench staging --model`: "
                         f"{', '.join(n for n in PRESET_NAMES if n.startswith('qwen'))}) instead of the "
                         "test one, its pools sized from --tokens; also times each fetch call to return "
                         "(gathers included) and says what staging.route's AUTO picks")
    ap.add_argument("--gather-gbps", type=_positive(float), default=None, metavar="GBPS",
                    help="with --model: also say what AUTO picks at this gather speed")
    args = ap.parse_args(argv)
    try:
        args.pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.pairs.split(",")]
    except ValueError:
        ap.error(f"--pairs {args.pairs!r}; expected P:D[,P:D...] such as 2:1,8:2")
    for p, d in args.pairs:
        if p <= 0 or d <= 0 or p == d or max(p, d) % min(p, d):
            ap.error(f"--pairs {p}:{d}; expected two different positive TP sizes, one a multiple of the other")
    if args.gather_gbps is not None and args.model is None:
        ap.error("--gather-gbps weighs a model's reads; it needs --model")
    if args.model is not None:
        try:
            kinds = set(get_preset(args.model).kinds())
        except ValueError as exc:
            ap.error(f"--model: {exc}")
        if kinds != {LayerKind.FULL_ATTENTION, LayerKind.GDN}:
            ap.error(f"--model {args.model!r} has layers {sorted(k.value for k in kinds)}; expected full "
                     "attention and GDN (a Qwen3.5 / Qwen3-Next preset)")
    return args


def _analyzer_said(g, p_tp: int, d_tp: int, tokens: int, block: int, pools: dict, w, analyzer: int, *,
                   vllm: bool) -> str:
    """The analyzer's staged count (ON) and the block it counts at: the engine's, raised until a page holds a GDN
    state (vLLM's rule, for every scheme alike), where hybridkv's own layout runs here at ``block``. Where the two
    differ, also the same planner and ``staging.route`` on this run's block and layouts (decode rank 0): the count
    for the run's own pattern, which the measured one should equal."""
    from hybridkv import wire
    from hybridkv.transport.staging import Route
    from tests.transport.peers import NUM_BLOCKS

    said = f"analyzer ({'hybridkv-vllm' if vllm else 'hybridkv'}, on, block {w.effective_block_size}"
    if w.effective_block_size == block:
        return f"{said}) {analyzer}"
    mine = {key: v for key, v in pools.items() if key in ("kernel", "pages", "num_blocks")}
    parts = predict(g, p_tp, d_tp, tokens, block, mine or {"num_blocks": NUM_BLOCKS})["parts"]
    ways = [(x, routes(x, wire.Mem.DRAM, None)["on"]) for x in parts]  # ON does not weigh the memory
    here = sum({Route.SLOT: 1, Route.DIRECT: min(x["direct"], x["sliced"])}.get(way, x["sliced"]) for x, way in ways)
    return f"{said}, as vLLM raises {block}) {analyzer}; planner + route at this run's block {block}: {here}"


def main(argv=None) -> None:
    """Staged against sliced reads, post to landed, in one run per TP pair (blocks scattered, one fetch at
    a time, a sliced and a staged warm-up first), then the same requests posted unmerged, piece by piece and
    block by block as engines build their lists, and NixlConnector's count for the request:

        .venv/bin/python -m tests.transport.hetero_peers [--mem vram] [--tokens 500] [--pairs 2:1,1:2,4:1,8:2]
            [--kernel-block 16] [--model qwen3.5-9b [--gather-gbps 150]]

    On a GPU (``--mem vram``) every rank is a process on GPU 0 (cuda_ipc), staging copies run on the copier's
    engine (HYBRIDKV_STAGING_GATHER). With ``--model`` the pools are that model's, sized from ``--tokens``; each
    fetch is also timed from its call to its return, the producer's pack and the decode's unpack included (no
    Export asked ahead), and each pair says what staging.route's AUTO picks for decode rank 0's reads."""
    from hybridkv.descriptors.hma import plan_hma
    from hybridkv.descriptors.schemes import Scheme, Workload, count_descriptors
    from hybridkv.transport.staging import StagingConfig, StagingMode
    from tests.transport.peers import geometry, model_geometry

    args = parse_args(argv)
    pairs = args.pairs
    t, k, model = args.tokens, args.kernel_block, args.model
    reqs = [("w0", t), ("v0", t), ("s1", t), ("x1", t), ("s2", t), ("x2", t)]  # w0, v0: warm-ups
    where = ("block 48, hybridkv's layout" if k is None else
             f"vLLM's pages (LBHNC, hybrid allocator's block) in {k}-token kernel blocks")
    if model is not None:
        where = f"{model}, {where}"
    print(f"staged (ON) vs sliced, {t} tokens, {where}, blocks scattered, {args.mem}; ms post to landed, "
          "per decode rank")
    for p_tp, d_tp in pairs:
        geo = None
        if model is not None:
            g = model_geometry(model)
        else:
            # The test geometry has 2 KV heads; a TP above that needs as many heads as ranks.
            heads = max(p_tp, d_tp)
            geo = {"num_kv_heads": heads, "num_k_heads": heads, "num_v_heads": heads} if heads > 2 else None
            g = geometry(**(geo or {}))
        layout: dict = {}
        block = BLOCK
        staging: dict = {"mode": "on"}
        timing: dict = {"want_first": True}
        if model is not None:
            block, layout = _model_pools(g, p_tp, d_tp, t, len(reqs), k)
            pred = predict(g, p_tp, d_tp, t, block, layout)
            # slots for every part of a fetch and the three before it (their Done may still be on its way and a
            # slot waits for its fence), on every side; a full pool would fall back to the sliced read (run_pair
            # refuses that: on one H100 two were too few at 2:1, 8192 tokens)
            unit = StagingConfig().slot_bytes
            most = max((p["nbytes"] for p in pred["parts"]), default=unit)
            capacity = -(-most // unit) * unit * 4 * max(len(pred["parts"]), pred["readers"])
            staging["capacity_bytes"] = capacity
            layout["model"] = model
            timing = {"e2e": True}  # the pack on the clock: no Export asked ahead
        elif k is not None:
            # vLLM raises the block until a page holds a GDN state, per rank's shard; both sides at the larger
            # (NixlConnector pairs equal block sizes); a pool for every request's blocks, scattered, twice over
            block = max(plan_hma(g.shard(tp)).block_size for tp in (p_tp, d_tp))
            n = sum(grp.blocks_for_tokens(t) for grp in plan_hma(g.shard(d_tp), block).groups)
            layout = {"kernel": k, "pages": 2 * n * (len(reqs) + 1) + 8}
        m = run_pair(p_tp, d_tp, block, block, reqs, staging=staging, sliced=["w0", "x1", "x2"],
                     scatter=True, sequential=True, geo=geo, mem=args.mem, **timing, **layout)
        staged = StagingConfig(mode=StagingMode.ON)
        w = Workload(geometry=g, tokens=t, block_size=block, tp_prefill=p_tp, tp_decode=d_tp, fragmentation=1.0,
                     kernel_block_size=k, staging=staged)
        nixl = count_descriptors(Scheme.VLLM_033, w).per_decode_rank
        analyzer = count_descriptors(Scheme.HYBRIDKV_VLLM if k is not None else Scheme.HYBRIDKV, w).per_decode_rank
        ms = lambda rids: _ms(m, rids)  # noqa: E731
        # The engine's way on the same memory: the sliced plan piece by piece, block by block, unmerged
        # (what NixlConnector's list is, in this layout), posted by the same transport right after.
        e = run_pair(p_tp, d_tp, block, block, [("n0", t), ("n1", t), ("n2", t)], coalesce=False, scatter=True,
                     sequential=True, geo=geo, mem=args.mem, **({"e2e": True} if model is not None else {}),
                     **layout)
        said = _analyzer_said(g, p_tp, d_tp, t, block, layout, w, analyzer, vllm=k is not None)
        print(f"P TP{p_tp} -> D TP{d_tp}{'' if k is None else f' block {block} k{k}'}: staged "
              f"{max(m['s1']['per_rank'])} descriptors {ms(['s1', 's2'])} ms; "
              f"sliced {max(m['x1']['per_rank'])} descriptors {ms(['x1', 'x2'])} ms; unmerged (engine-style) "
              f"{max(e['n1']['per_rank'])} descriptors {_ms(e, ['n1', 'n2'])} "
              f"ms; NixlConnector's list {nixl}; {said}", flush=True)
        if model is not None:
            _model_report(model, args.mem, args.gather_gbps, pred, m, e, capacity, p_tp, d_tp)


if __name__ == "__main__":
    main()
