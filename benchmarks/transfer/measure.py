"""The consumer's side of `hybridkv bench transfer`: every variant timed, round by round, and the report.

``_measure`` connects to the producer, runs (a) hybridkv's fetch, (a') the plan that fetch posted, its
index pairs posted with (b)'s bare NIXL calls, (a'') the same right after planning the request again (a post
on a core in the state the fetch's own work leaves it), (b) the raw span (whole, cut, and with a notification),
(c) the vLLM 0.33 list and the posting probe once per round in a shuffled order, then times (d) and
returns the report that :func:`hybridkv.benchmarks.transfer.command.run` prints. Per scheme
(``schemes``): the posting call's thread CPU and wall time and post to landed, each against (b); what
hybridkv's own path adds is (a) against (a'), what its descriptors and memory cost NIXL is (a') against (b).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from hybridkv.benchmarks.transfer.copy import _copy_ceiling
from hybridkv.benchmarks.transfer.posting import (_span_rows, _timed, _vllm_ids, _vllm_scheme_rows, gapped_rows,
                                                  parse_curve, parse_splits, posting_fit)
from hybridkv.benchmarks.transfer.sides import _side
from hybridkv.cli import CommandError


async def _measure(args, addr, out, devices: tuple[int, int]) -> dict:
    import numpy as np

    from hybridkv.layout.geometry import LayerKind
    from hybridkv.fencing import scheduler_inputs
    from hybridkv.fencing.scheduler import TransferScheduler
    from hybridkv.transport.config import Outcome
    from hybridkv.transport.dataplane import DataPlaneConfig
    from hybridkv.transport.endpoint import Consumer, TransportConfig
    from hybridkv.transport.side import NOTIF_PREFIX

    class Replay:
        """A prepared planner that keeps its last inputs, so that the bench can plan that request again."""

        def __init__(self, inner) -> None:
            self.inner, self.last = inner, None

        def plan(self, source, theirs, mine):
            self.last = (source, theirs, mine)
            return self.inner.plan(source, theirs, mine)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class Recording(Consumer):
        """The consumer, also keeping when its import's Exports were in (planning starts; perf_counter)
        and its planner's last inputs. Nothing of it runs between the post and the READ seen landed: a
        hook there (it had one around the post and one around the wait) is timed as hybridkv's."""

        planning_at = 0.0

        def prepared(self, agents):
            self.planning_at = time.perf_counter()  # the Exports are in: planning starts
            key = tuple(agents)
            if not isinstance(self.plans.get(key), Replay):
                self.plans[key] = Replay(super().prepared(agents))
            return self.plans[key]

    def last_plan():
        """The plan of the last fetch, planned again from its inputs (planning is deterministic)."""
        replay = cons.plans.get((peer.agent,))
        if replay is None or replay.last is None:
            return None
        return replay.inner.plan(*replay.last)

    layout, memory, pools, raw_span = _side(args, 2, devices[1])  # raw_span: alive until the end (registered)
    sched = TransferScheduler(pools, lease_s=60.0)
    cons = Recording(memory, sched, TransportConfig(notify_reads=args.read_notif == "on", secret=args.secret,
                                                    insecure_host_memory=args.mem == "dram",
                                                    dataplane=DataPlaneConfig(spin_s=args.spin_us / 1e6,
                                                                              prime=args.prime == "on")),
                     planner=args.planner)
    await cons.connect(*addr)
    comps = scheduler_inputs(layout).components
    peer = cons.peer
    agent = cons.dp.agent
    mem = memory.mem.name
    raw_local, raw_remote = len(memory.regions) - 1, len(peer.memory.regions) - 1
    # (b) one descriptor each side: the request's bytes as one span.
    geo = layout.geometry
    attn_g = next(g for g in layout.groups if g.kind is not LayerKind.GDN)
    gdn_g = next(g for g in layout.groups if g.kind is LayerKind.GDN)
    blocks = pools.pool_sizes[attn_g.group_id]
    n_attn, n_gdn = len(attn_g.layer_indices), len(gdn_g.layer_indices)
    ar, gr = attn_g.placements[0].region_id, gdn_g.placements[0].region_id
    nbytes = memory.regions[ar].page_bytes * blocks + memory.regions[gr].page_bytes
    splits = parse_splits(args.raw_splits)
    lr, rr = memory.regions[raw_local], peer.memory.regions[raw_remote]
    raw_lists = {n: (agent.prep_xfer_dlist("NIXL_INIT_AGENT", _span_rows(lr.base_addr, nbytes, lr.device_id, n), mem),
                     agent.prep_xfer_dlist(peer.agent, _span_rows(rr.base_addr, nbytes, rr.device_id, n),
                                           peer.memory.mem.name),
                     np.arange(n, dtype=np.int32)) for n in splits}
    # The posting curve: N touching pieces of the span, and N small pieces kept apart, each side.
    curve = parse_curve(args.posting_curve)
    curve_lists = {}
    for n in curve:
        for shape, rows in (("touching", lambda r, n=n: _span_rows(r.base_addr, nbytes, r.device_id, n)),
                            ("apart", lambda r, n=n: gapped_rows(r.base_addr, nbytes, r.device_id, n,
                                                                 args.probe_bytes))):
            curve_lists[(shape, n)] = (agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows(lr), mem),
                                       agent.prep_xfer_dlist(peer.agent, rows(rr), peer.memory.mem.name),
                                       np.arange(n, dtype=np.int32))
    curve_runs: dict[tuple[str, int], list[tuple[int, float, float]]] = {k: [] for k in curve_lists}
    # (c) the vLLM 0.33 scheme's list over the same pages.
    vl = _vllm_scheme_rows(memory, layout, ar, gr, n_attn, n_gdn, blocks)
    vr = _vllm_scheme_rows(peer.memory, layout, ar, gr, n_attn, n_gdn, blocks)
    v_l = agent.prep_xfer_dlist("NIXL_INIT_AGENT", vl, mem)
    v_r = agent.prep_xfer_dlist(peer.agent, vr, peer.memory.mem.name)
    v_idx = np.arange(len(vl), dtype=np.int32)
    # The posting probe: the same lists with every descriptor cut to --probe-bytes, so that what the
    # posting thread spends is handling descriptors, not moving bytes (UCX's CMA path over DRAM copies
    # inside the post call).
    tiny = lambda rows: np.concatenate([rows[:, :1], np.full((len(rows), 1), args.probe_bytes, np.uint64),  # noqa: E731
                                        rows[:, 2:]], axis=1)
    t_vl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", tiny(vl), mem)
    t_vr = agent.prep_xfer_dlist(peer.agent, tiny(vr), peer.memory.mem.name)
    t_rl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", tiny(vl[:1]), mem)
    t_rr = agent.prep_xfer_dlist(peer.agent, tiny(vr[:1]), peer.memory.mem.name)
    if int(vl[:, 1].sum()) != nbytes:
        raise RuntimeError(f"vLLM-scheme list covers {int(vl[:, 1].sum())} bytes, expected {nbytes}")
    hyb, vll = [], []
    posts: dict[str, list[float]] = {"hybridkv": [], "plan": [], "plan_cold": [], "raw": [],
                                     "vllm_scheme": []}  # (build,) make + post
    cpu: dict[str, list[float]] = {k: [] for k in posts}  # the same, CPU time of the posting thread
    plan_t: list[float] = []  # hybridkv's last plan, its index pairs posted with the raw span's NIXL calls
    cold_t: list[float] = []  # the same, right after planning that request again
    # The fetch's own work around its READ: from the Exports in to the post (planning, the fence) and from
    # the READ seen landed to the fetch's return (telemetry, the ledger, Done to the producer), together.
    phases: dict[str, list[float]] = {"exports_to_return": [], "around_read": []}
    plan = None  # hybridkv's last plan, planned again after its fetch
    block_ids = np.arange(blocks, dtype=np.int64)
    v_build = lambda: _vllm_ids(n_attn, block_ids, 2 * n_gdn)  # noqa: E731
    if not np.array_equal(v_build()[0], v_idx):
        raise RuntimeError("the vLLM-style id build does not index the vLLM-scheme list in order")
    raws: dict[int, list[float]] = {n: [] for n in splits}
    desc = idx = planned = plan_desc = None
    r_desc = v_desc = None
    # Each round runs every variant once, in a fresh seeded order, and lets the control traffic of
    # the previous one settle first: on the H200s a baseline READ started right after a fetch (its Done
    # message, the producer's next export) took ~4 ms instead of ~0.2 ms in every round, which a fixed
    # (or merely rotated) order charged to one variant only.
    variants = ["hybridkv", "plan", "plan_cold", *(("raw", n) for n in splits), "raw_notif", "vllm", "probe_one", "probe_vllm",
                *curve_lists]
    probe: dict[str, list[tuple[int, float]]] = {"probe_one": [], "probe_vllm": []}
    raw_notif: list[float] = []
    for i in range(args.iters + 1):
        kept = i > 0  # the first round warms connections and caches
        order = variants[:]
        random.Random(i).shuffle(order)
        for var in order:
            await asyncio.sleep(args.settle_ms / 1e3)
            if var == "hybridkv":
                rid = f"req{i}"
                sched.add_request(rid, expect=comps)
                for g in layout.groups:
                    sched.allocate(rid, g.group_id, pools.pool_sizes[g.group_id])
                res = await cons.fetch(rid, comps, token=args.capabilities[i])
                returned = time.perf_counter()
                if res.outcome is not Outcome.READY or res.nbytes != nbytes:
                    # A transfer that failed ends the run (exit 1); it is not a bug of the bench.
                    raise CommandError(f"fetch {rid}: {res.outcome.name} {res.error} ({res.nbytes} of {nbytes} bytes)")
                hyb += [res.seconds] * kept
                posts["hybridkv"] += [res.post_seconds] * kept
                cpu["hybridkv"] += [res.post_cpu_seconds] * kept
                desc, idx, planned = res.descriptors, res.indices, res.planned
                phases["exports_to_return"] += [returned - cons.planning_at] * kept
                phases["around_read"] += [returned - cons.planning_at - res.seconds] * kept
                plan = last_plan()
            elif var == "plan_cold":
                if plan is None:
                    continue
                # The consumer's own planning of that request again (its planner, the same block lists, the
                # plan's checks), then its index pairs posted with raw's bare calls: a post in the state that
                # the fetch's own work leaves the thread's caches in, without hybridkv's posting path.
                again = last_plan()
                again.check()
                l_h, r_h = cons.dp.prepped(peer.agent)
                pt, _, p_post, p_cpu = _timed(agent, "READ", l_h, again.dst_index, r_h, again.src_index)
                cold_t += [pt] * kept
                posts["plan_cold"] += [p_post] * kept
                cpu["plan_cold"] += [p_cpu] * kept
            elif var == "plan":
                if plan is None:  # the warm-up round ran it before any fetch
                    continue
                l_h, r_h = cons.dp.prepped(peer.agent)
                pt, plan_desc, p_post, p_cpu = _timed(agent, "READ", l_h, plan.dst_index, r_h, plan.src_index)
                plan_t += [pt] * kept
                posts["plan"] += [p_post] * kept
                cpu["plan"] += [p_cpu] * kept
            elif var == "raw_notif":  # the one-span READ carrying a notification, as hybridkv's may
                l_h, r_h, ids = raw_lists[1]
                raw_notif += [_timed(agent, "READ", l_h, ids, r_h, ids, NOTIF_PREFIX + b"baseline")[0]] * kept
            elif var == "probe_one":
                _, n, _, c = _timed(agent, "READ", t_rl, np.zeros(1, np.int32), t_rr, np.zeros(1, np.int32))
                probe[var] += [(n, c)] * kept
            elif var == "probe_vllm":
                _, n, _, c = _timed(agent, "READ", t_vl, None, t_vr, None, build=v_build)
                probe[var] += [(n, c)] * kept
            elif var == "vllm":
                vt, v_desc, v_post, v_cpu = _timed(agent, "READ", v_l, None, v_r, None, build=v_build)
                vll += [vt] * kept
                posts["vllm_scheme"] += [v_post] * kept
                cpu["vllm_scheme"] += [v_cpu] * kept
            elif var in curve_lists:
                l_h, r_h, ids = curve_lists[var]
                landed, posted, _, post_cpu = _timed(agent, "READ", l_h, ids, r_h, ids)
                curve_runs[var] += [(posted, post_cpu, landed)] * kept
            else:
                l_h, r_h, ids = raw_lists[var[1]]
                rt, posted, post_s, post_cpu = _timed(agent, "READ", l_h, ids, r_h, ids)
                raws[var[1]] += [rt] * kept
                if var[1] == 1:
                    r_desc = posted
                    posts["raw"] += [post_s] * kept
                    cpu["raw"] += [post_cpu] * kept
        sched.step_scheduled(i + 1, joined=[f"req{i}"])
        sched.step_completed(i + 1)
        sched.request_finished(f"req{i}")
    # Off the event loop: the last fetch's Done may still be on its way to the producer.
    msg = await asyncio.to_thread(out.get, True, 60)
    if msg[0] == "error":
        raise CommandError(f"the producer process failed: {msg[1]}")
    await cons.close()
    del raw_span  # registered with NIXL: freed only after the agent is done with it
    copy = _copy_ceiling(nbytes, devices if args.mem == "vram" else None, args.iters)
    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    raw = raws[1]
    h, r, v = (gbps(statistics.median(ts)) for ts in (hyb, raw, vll))
    med = statistics.median
    # Posting (CPU in the posting thread) and the wire (the rest, to DONE) per descriptor, each
    # from the same run's one-span READ and vLLM list: the simulator charges them separately.
    post_per, post_fixed = posting_fit({k: (v[0][0], med(c for _, c in v)) for k, v in probe.items()})
    wire_per, wire_fixed = posting_fit({
        "raw": (r_desc, med(t - p for t, p in zip(raw, posts["raw"]))),
        "vllm_scheme": (v_desc, med(t - p for t, p in zip(vll, posts["vllm_scheme"])))})
    c = gbps(copy["copy_s"])
    # Per scheme, the same run: the posting call (thread CPU, wall) and post to landed, each against the
    # one-span READ; x_raw_paired is the median of the per-round ratios (each round runs every scheme
    # once, so a loaded machine's slow spell hits both sides of a ratio alike).
    landed = {"hybridkv": hyb, "plan": plan_t, "plan_cold": cold_t, "raw": raw, "vllm_scheme": vll}
    schemes = {name: {
        "posted": {"hybridkv": desc, "plan": plan_desc, "plan_cold": plan_desc, "raw": r_desc,
                   "vllm_scheme": v_desc}[name],
        "post_cpu_us": round(med(cpu[name]) * 1e6, 1), "post_us": round(med(posts[name]) * 1e6, 1),
        "landed_us": round(med(ts) * 1e6, 1), "GBps": round(gbps(med(ts)), 3),
        "x_raw": round(med(raw) / med(ts), 3),
        "x_raw_paired": round(med(r_t / t for r_t, t in zip(raw, ts)), 3)} for name, ts in landed.items()}
    return {
        "model": geo.name, "tokens": args.tokens, "block_size": args.block_size, "layers": geo.num_layers,
        "mem": args.mem, "devices": list(devices) if args.mem == "vram" else None,
        "bytes": nbytes, "iters": args.iters, "processes": 2, "settle_ms": args.settle_ms,
        "hybridkv_GBps": round(h, 3), "raw_GBps": round(r, 3), "ratio": round(h / r, 3), "schemes": schemes,
        "descriptors": desc, "planned_descriptors": planned, "index_pairs": idx, "raw_posted": r_desc,
        "vllm_scheme_descriptors": int(len(vl)), "vllm_scheme_posted": v_desc,
        "vllm_scheme_GBps": round(v, 3), "vllm_ratio": round(v / r, 3),
        "copy_GBps": round(c, 3), "copy_kind": copy["copy_kind"], "peer_access": copy["peer_access"],
        "hybridkv_vs_copy": round(h / c, 4), "raw_vs_copy": round(r / c, 4), "vllm_vs_copy": round(v / c, 4),
        "fetch_phases_us": {k: round(med(ts) * 1e6, 1) for k, ts in phases.items()},
        "median_s": {"hybridkv": statistics.median(hyb), "plan": statistics.median(plan_t), "raw": statistics.median(raw),
                     "vllm_scheme": statistics.median(vll), "copy": copy["copy_s"]},
        "read_notif": args.read_notif, "spin_us": args.spin_us, "prime": args.prime, "raw_notif_GBps": round(gbps(statistics.median(raw_notif)), 3),
        "raw_split_GBps": {str(n): round(gbps(statistics.median(ts)), 3) for n, ts in raws.items()},
        # Where a fixed per-request cost goes: making and posting vs waiting for DONE.
        "post_us": {name: round(statistics.median(ts) * 1e6, 1) for name, ts in posts.items()},
        "post_cpu_us": {name: round(statistics.median(ts) * 1e6, 1) for name, ts in cpu.items()},
        "posting": {"per_descriptor_us": round(post_per * 1e6, 4), "fixed_us": round(post_fixed * 1e6, 1),
                    "wire_per_descriptor_us": round(wire_per * 1e6, 4), "wire_fixed_us": round(wire_fixed * 1e6, 1),
                    "from": f"posting: {args.probe_bytes}-byte descriptors, 1 vs the vllm-0.33 list's "
                            f"{probe['probe_vllm'][0][0]} (ids built per post), thread CPU; wire: one-span READ "
                            f"({r_desc} posted) vs the vllm-0.33 list ({v_desc} posted), time to DONE after the post"},
        "posting_curve": {str(n): {shape: {
            "posted": curve_runs[(shape, n)][0][0],
            "post_cpu_us": round(med(c for _, c, _ in curve_runs[(shape, n)]) * 1e6, 1),
            "landed_us": round(med(t for _, _, t in curve_runs[(shape, n)]) * 1e6, 1)}
            for shape in ("touching", "apart")} for n in curve},
        "samples_GBps": {name: [round(gbps(t), 1) for t in ts]
                         for name, ts in (("hybridkv", hyb), ("raw", raw), ("vllm_scheme", vll))},
    }


_SCHEME_NAMES = {"raw": "(b) raw NIXL, one span", "hybridkv": "(a) hybridkv fetch",
                 "plan": "(a') its plan, raw's calls", "plan_cold": "(a'') the same, re-planned first",
                 "vllm_scheme": "(c) vllm-0.33 list"}


def print_schemes(rep: dict) -> None:
    """The per-scheme table of a report: posting call and post to landed, side by side with raw."""
    print("  per scheme (median; CPU and post: the posting call's thread CPU and wall time; landed: post to DONE;"
          " paired: median of per-round ratios):")
    print(f"    {'scheme':<33}{'posted':>7}{'CPU us':>10}{'post us':>10}{'landed us':>11}{'GB/s':>9}{'x raw':>7}"
          f"{'paired':>8}")
    for name in ("raw", "hybridkv", "plan", "plan_cold", "vllm_scheme"):
        r = rep["schemes"][name]
        print(f"    {_SCHEME_NAMES[name]:<33}{r['posted']!s:>7}{r['post_cpu_us']:>10,.0f}{r['post_us']:>10,.0f}"
              f"{r['landed_us']:>11,.0f}{r['GBps']:>9.2f}{r['x_raw']:>7.3f}{r['x_raw_paired']:>8.3f}")
    ph = rep["fetch_phases_us"]
    print(f"  hybridkv's fetch (median us): Exports in to its return {ph['exports_to_return']:,.0f}, of which"
          f" {ph['around_read']:,.0f} around its READ (planning, the fence; telemetry, the ledger, Done)")
