"""`hybridkv bench staging`: what staging costs (the producer's gather) against what it saves (descriptors).

Staging (``hybridkv/transport/staging.py``) packs the head slices one decode rank reads into a contiguous
slot, so that rank posts a handful of descriptors instead of one per slice per block. Its ``auto`` mode
takes that trade only where the descriptors saved cost more to post than the copies cost to run, at a
posting cost per descriptor and a gather speed per memory kind (``staging.COSTS``). This command measures
the gather on this machine, for one request in the setting engines produce (blocks scattered over a pool
twice the request's size, no two adjacent). Each producer rank decode rank 0 reads packs what the transport
packs for it: the fields its Want's mask names (only those decode rank 0 reads from that rank: a KV head GQA
replicates over prefill ranks is packed by the one it is read from), by the planner's stagers on both sides.
It prints the bytes each rank packs, times the largest pack (producers pack in parallel), and prints it beside:

* a plain contiguous copy of the same bytes, same run (the copy engine's ceiling: ``x copy``);
* on a GPU, the same pack three ways, same run: torch's indexing in words (``gather``, the copier's path
  without Triton or with ``HYBRIDKV_STAGING_GATHER=torch``), the Triton row gather (``kernel``, its default
  where Triton imports; its bytes compared with torch's), and torch a byte per index;
* the descriptors the decode rank posts sliced and staged, summed over the producer ranks (the planners the
  transport uses, each rank routed by ``staging.route`` as ON takes it), and the posting time they cost
  at the per-descriptor figure of ``staging.COSTS``;
* what ``auto`` decides for the rank timed with the assumed gather speed and with the measured ones (every
  rank's in ``--json``).

On the host (``--mem dram``) the copier gathers on numpy and there is no kernel column.
"""

from __future__ import annotations

import argparse
import statistics
import time

MAX_TOKENS = 1 << 20
MAX_ITERS = 10_000


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = "Time the staging gather against a contiguous copy and the posting it saves."
    from hybridkv.cli import bounded

    parser.add_argument("--model", default="qwen3.5-9b", help="geometry preset (default qwen3.5-9b)")
    parser.add_argument("--tokens", type=bounded(int, MAX_TOKENS), default=8192, help="tokens of the one request")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per block (vllm: raised as vLLM raises it) (default 64)")
    parser.add_argument("--tp", default="2:1,4:1,8:2,1:2", metavar="P:D[,P:D...]",
                        help="prefill TP : decode TP pairs (decode rank 0 and the producer ranks it reads)")
    parser.add_argument("--layout", choices=("vllm", "hybridkv"), default="vllm",
                        help="vllm: vLLM 0.33's hybrid-allocator pages, block-outermost, as the vLLM connector "
                             "adopts them (a head slice is contiguous only inside one layer's page); hybridkv: "
                             "its own planned layout (head-major pages: a slice is one piece per page)")
    parser.add_argument("--mem", choices=("dram", "vram"), default="dram",
                        help="host memory (numpy copies) or GPU 0 (torch copies) (default dram)")
    parser.add_argument("--iters", type=bounded(int, MAX_ITERS), default=9, help="timed runs of each copy")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        try:
            p, d = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"--tp {text!r}: {item!r} is not P:D; expected e.g. 8:2") from None
        if p <= 0 or d <= 0 or p == d or max(p, d) % min(p, d):
            raise ValueError(f"--tp {item!r}: expected two different positive TP sizes, one a multiple of the other")
        out.append((p, d))
    return out


def _vllm_layout(geo, *, tp: int, rank: int, block_size: int, pages: int, alloc):
    """vLLM 0.33's hybrid-allocator tensors in the block-outermost order the vLLM connector asks for."""
    from hybridkv.descriptors.hma import PageOrder, vllm_layout

    return vllm_layout(geo, tp=tp, rank=rank, block=block_size, pages=pages, allocator=alloc,
                       order=PageOrder.BLOCK_OUTERMOST)


def _median_s(fn, iters: int, sync) -> float:
    fn()
    sync()  # warm-up: lazy CUDA set-up and page faults outside the clock
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _layouts(args, p_tp: int, d_tp: int, ranks, alloc):
    """(block, blocks per request, the producer ranks' layouts, decode rank 0's), pools twice the request's."""
    from hybridkv.layout import plan_layout
    from hybridkv.layout.presets import get_preset

    geo = get_preset(args.model)
    if args.layout == "vllm":
        from hybridkv.descriptors.hma import plan_hma

        # vLLM raises the block size until a page holds a GDN state, per rank's shard; both sides at the
        # larger of the two, since NixlConnector pairs equal block sizes
        block = max(plan_hma(geo.shard(tp), args.block_size).groups[0].block_size for tp in (p_tp, d_tp))
        n = -(-args.tokens // block)
        srcs = [_vllm_layout(geo, tp=p_tp, rank=r, block_size=block, pages=2 * n + 2, alloc=alloc) for r in ranks]
        dst = _vllm_layout(geo, tp=d_tp, rank=0, block_size=block, pages=2 * n + 2, alloc=alloc)
        return block, n, srcs, dst
    block = args.block_size
    n = -(-args.tokens // block)
    srcs = [plan_layout(geo, block_size=block, num_blocks=2 * n + 2, allocator=alloc, tp=p_tp, rank=r) for r in ranks]
    dst = plan_layout(geo, block_size=block, num_blocks=2 * n + 2, allocator=alloc, tp=d_tp, rank=0)
    return block, n, srcs, dst


def _one_pair(args, p_tp: int, d_tp: int) -> dict:
    import numpy as np

    from hybridkv import wire
    from hybridkv.layout.alloc import NumpyAllocator, TorchAllocator
    from hybridkv.transport.memory import from_layout
    from hybridkv.transport.staging import COSTS, Copier, GatherEngine, Route, StagingConfig, StagingMode, route

    from hybridkv.descriptors.planning import DescriptorPlanner, source_ranks
    from hybridkv.descriptors.schemes import fragmented_blocks
    from hybridkv.descriptors.staging import shared_order

    if args.mem == "vram":
        import torch

        alloc: TorchAllocator | NumpyAllocator = TorchAllocator("cuda:0")
        sync = torch.cuda.synchronize
    else:
        alloc = NumpyAllocator()
        sync = lambda: None  # noqa: E731
    ranks, _ = source_ranks(d_tp, 0, p_tp)
    block, n, src_layouts, dst = _layouts(args, p_tp, d_tp, ranks, alloc)
    srcs, dmap = [from_layout(x) for x in src_layouts], from_layout(dst)
    # What the transport does for decode rank 0: its planner over every producer it reads; per producer the
    # stager of the fields it reads from it, whose field mask its Want names (ImportStaging.fields); the producer
    # packs what its own stager makes of that mask (its planner's stager(source, dest, fields), exports.py)
    planned = DescriptorPlanner().prepare(srcs, dmap)
    sb = {g.group_id: fragmented_blocks(1 if g.block_tokens is None else n, 1.0) for g in dst.groups}
    db = {g.group_id: fragmented_blocks(1 if g.block_tokens is None else n, 1.0, start=1) for g in dst.groups}
    mem = wire.Mem.VRAM if args.mem == "vram" else wire.Mem.DRAM
    us, assumed = COSTS[mem]

    def decide(mode: StagingMode, sliced: int, direct: int, nbytes: int, gbps: float | None = None) -> Route:
        # staging's one rule (staging.route), as ON takes it and as AUTO weighs it at COSTS and at a gather speed
        cfg = StagingConfig(mode=mode, capacity_bytes=1 << 30, copy_gbps=gbps)
        return route(cfg, sliced=sliced, direct=direct, own_pool=True, nbytes=nbytes, mem=mem)

    parts = []
    for i, rank in enumerate(ranks):
        sliced = planned.plan(i, sb, db).num_descriptors
        asked = getattr(planned, "stager", lambda _: None)(i)
        if asked is None:  # feeds none of decode rank 0's fields (every head a duplicate), or pages pair whole
            parts.append({"rank": rank, "fields": None, "fields_packed": 0, "fields_shared": None, "bytes": 0,
                          "sliced": sliced, "direct": None, "route": Route.SLICED.value, "staged": sliced,
                          "stager": None})
            continue
        stager = DescriptorPlanner().stager(srcs[i], dmap, asked.fields)
        gsb = {g: b for g, b in sb.items() if g in stager.groups}
        nbytes = stager.nbytes(gsb)
        direct = asked.read(0, 0, gsb, db).num_descriptors
        way = decide(StagingMode.ON, sliced, direct, nbytes)
        shared = len(shared_order(src_layouts[i], dst))
        parts.append({"rank": rank, "fields": asked.fields.hex(), "fields_packed": len(stager.keys),
                      "fields_shared": shared, "bytes": nbytes, "sliced": sliced,
                      "direct": direct, "route": way.value,
                      "staged": {Route.DIRECT: direct, Route.SLOT: 1}.get(way, sliced), "auto_assumed":
                      decide(StagingMode.AUTO, sliced, direct, nbytes).value, "stager": (stager, gsb)})
    packing = [x for x in parts if x["stager"] is not None]
    if not packing:
        raise ValueError(f"--tp {p_tp}:{d_tp}: no producer rank stages for decode rank 0 ({args.layout} layout); "
                         "expected a pair read field by field")
    timed = max(packing, key=lambda x: x["bytes"])  # the producers pack in parallel: the largest pack is timed
    stager, gsb = timed["stager"]
    src = src_layouts[ranks.index(timed["rank"])]
    nbytes = timed["bytes"]
    if args.mem == "vram":
        import torch

        slot = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")  # zeros: the kernel's bytes compare
        other = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        plain = lambda: other.copy_(slot)  # noqa: E731
    else:
        slot = np.empty(nbytes, dtype=np.uint8)
        other = np.empty(nbytes, dtype=np.uint8)
        plain = lambda: np.copyto(other, slot)  # noqa: E731
    copier = Copier(from_layout(src), slot, engine=GatherEngine.TORCH)
    steps = stager.pack(gsb)
    gather_s = _median_s(lambda: copier.run(steps), args.iters, sync)
    kernel_s = None
    matches = None
    if args.mem == "vram":
        # the Triton row gather (the copier's default on a GPU), same run; its bytes against torch's
        expected = slot.clone()
        slot.zero_()
        kernel = Copier(from_layout(src), slot, engine=GatherEngine.TRITON)
        kernel_s = _median_s(lambda: kernel.run(steps), args.iters, sync)
        matches = bool(torch.equal(slot, expected))
    # the same gather a byte per index (what the copier did before it moved words), same run
    bytewise = Copier(from_layout(src), slot, max_word=1, engine=GatherEngine.TORCH)
    bytes_s = _median_s(lambda: bytewise.run(steps), args.iters, sync)
    plain_s = _median_s(plain, args.iters, sync)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        stager.pack(gsb)
    steps_us = (time.perf_counter() - t0) / args.iters * 1e6
    measured = nbytes / gather_s / 1e9
    kernel_gbps = None if kernel_s is None else nbytes / kernel_s / 1e9
    for x in parts:
        if x.pop("stager") is not None:
            x["auto_measured"] = decide(StagingMode.AUTO, x["sliced"], x["direct"], x["bytes"], measured).value
            x["auto_kernel"] = None if kernel_gbps is None else \
                decide(StagingMode.AUTO, x["sliced"], x["direct"], x["bytes"], kernel_gbps).value
    sliced, staged = sum(x["sliced"] for x in parts), sum(x["staged"] for x in parts)
    return {
        "pair": f"{p_tp}:{d_tp}", "producer_rank": timed["rank"], "block": block, "bytes": nbytes,
        "copy_steps": steps.num_steps, "gather_us": gather_s * 1e6, "gather_GBps": measured, "copy_us": plain_s * 1e6,
        "copy_GBps": nbytes / plain_s / 1e9, "x_copy": plain_s / gather_s, "steps_us": steps_us,
        "bytewise_us": bytes_s * 1e6, "bytewise_GBps": nbytes / bytes_s / 1e9,
        "sliced": sliced, "staged": staged, "route": timed["route"], "posting_saved_us": (sliced - staged) * us,
        "us_per_descriptor": us, "assumed_GBps": assumed, "auto_assumed": timed["auto_assumed"],
        "auto_measured": timed["auto_measured"],
        "kernel_us": None if kernel_s is None else kernel_s * 1e6, "kernel_GBps": kernel_gbps,
        "kernel_x_copy": None if kernel_s is None else plain_s / kernel_s, "kernel_matches": matches,
        "auto_kernel": timed["auto_kernel"], "ranks": parts,
    }


def run(args: argparse.Namespace) -> int:
    from hybridkv.cli import print_json

    rows = [_one_pair(args, p, d) for p, d in _pairs(args.tp)]
    if args.json:
        print_json({"model": args.model, "tokens": args.tokens, "layout": args.layout, "mem": args.mem,
                    "iters": args.iters, "rows": rows})
        return 0
    print(f"staging gather vs a contiguous copy of the same bytes, {args.model}, {args.tokens} tokens, "
          f"{args.layout} layout, block {rows[0]['block']}, blocks scattered, {args.mem}, median of {args.iters}; "
          "decode rank 0")
    for r in rows:
        print(f"  P{r['pair'].replace(':', ' -> D')}: {r['bytes'] / 1e6:8.1f} MB in {r['copy_steps']:3d} copies: "
              f"gather {r['gather_us']:9.1f} us {r['gather_GBps']:7.1f} GB/s | copy {r['copy_us']:8.1f} us "
              f"{r['copy_GBps']:7.1f} GB/s | x copy {r['x_copy']:.2f} | steps built {r['steps_us']:6.1f} us | "
              f"a byte per index {r['bytewise_GBps']:6.1f} GB/s")
        if r["kernel_us"] is not None:
            print(f"      Triton kernel {r['kernel_us']:9.1f} us {r['kernel_GBps']:7.1f} GB/s | x copy "
                  f"{r['kernel_x_copy']:.2f} | {'same bytes as' if r['kernel_matches'] else 'DIFFERENT BYTES from'} "
                  f"the gather; auto chooses {r['auto_kernel']} at its speed")
        packed = ", ".join(f"{x['rank']}: {x['bytes'] / 1e6:.1f} MB" + (" (feeds none)" if x["fields"] is None else
                           f" ({x['fields_packed']}/{x['fields_shared']} fields)") for x in r["ranks"])
        print(f"      packed per producer rank (the fields its Want names; the largest timed): {packed}")
        print(f"      descriptors sliced {r['sliced']} -> staged {r['staged']} (rank {r['producer_rank']}: "
              f"{r['route']}): {r['posting_saved_us']:.0f} us of posting saved at {r['us_per_descriptor']} us each; auto chooses "
              f"{r['auto_assumed']} at the assumed {r['assumed_GBps']:g} GB/s, {r['auto_measured']} at the measured "
              "gather's")
    return 0
