"""The two processes of `hybridkv bench transfer`: what each side sets up, and the producer.

Each side lays out one request (``_side``: the layout, its memory map and a raw span of the
request's size, registered with it) on the device ``--devices`` names for it. The producer process
(``_producer_main``, spawned by :func:`hybridkv.benchmarks.transfer.command.run`) exports the request once per
round; the consumer's rounds are :func:`hybridkv.benchmarks.transfer.measure._measure`.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
import traceback


def parse_devices(text: str | None, mem: str) -> tuple[int, int]:
    """(producer, consumer) CUDA device indices from "P,C" (or "D" for both); (0, 0) by default."""
    if text is None:
        return (0, 0)
    if mem != "vram":
        raise ValueError(f"--devices {text!r} places VRAM; it needs --mem vram, got --mem {mem}")
    parts = text.split(",")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--devices {text!r}; expected two CUDA device indices P,C such as 0,1")
    devs = tuple(int(p) for p in parts)
    return (devs[0], devs[-1])


def _geometry(model: str, layers: int | None):
    from hybridkv.layout.geometry import ModelGeometry
    from hybridkv.layout.presets import get_preset

    geo = get_preset(model)
    if layers is None or layers == geo.num_layers:
        return geo
    if layers <= 0 or layers > geo.num_layers or layers % 4:
        raise ValueError(f"--layers {layers}; expected a positive multiple of 4 up to {geo.num_layers}")
    return ModelGeometry(name=f"{geo.name}[{layers}L]", layers=geo.layers[:layers])


def _side(args, seed: int, device: int):
    """Layout for one request, plus a raw span of the request's size, registered with it."""
    from hybridkv import wire
    from hybridkv.layout.alloc import NumpyAllocator, TorchAllocator
    from hybridkv.fencing import scheduler_inputs
    from hybridkv.layout.kinds.base import Paging
    from hybridkv.layout import plan_layout
    from hybridkv.transport.memory import MemoryMap, from_layout

    geo = _geometry(args.model, args.layers)
    if args.mem == "vram":
        import torch

        torch.cuda.set_device(device)  # NIXL's UCX backend and cuda_ipc work in the current device's context
        alloc = TorchAllocator(f"cuda:{device}")
    else:
        alloc = NumpyAllocator()
    nblocks = -(-args.tokens // args.block_size)
    counts = {k: (1 if geo.spec_of(k).paging is Paging.STATE else nblocks) for k in geo.kinds()}
    layout = plan_layout(geo, block_size=args.block_size, num_blocks=counts, allocator=alloc)
    mm = from_layout(layout)
    total = sum(r.page_bytes * r.num_pages for r in mm.regions)
    raw = alloc.allocate(total)
    for a in (*layout.allocations, raw):
        _fill(a, seed)
    regions = (*mm.regions, wire.RegionInfo(region_id=len(mm.regions), base_addr=raw.addr, stride=total,
                                            page_bytes=total, num_pages=1, mem=mm.mem, device_id=raw.device_id))
    memory = MemoryMap(regions=regions, groups=mm.groups, compat=mm.compat)
    pools = scheduler_inputs(layout).pools
    return layout, memory, pools, raw


def _fill(alloc, seed: int) -> None:
    owner = alloc.owner
    if hasattr(owner, "fill_"):  # torch
        owner.view(-1)[: 1 << 20].random_(0, 255) if owner.numel() else None
        return
    owner[:] = (seed * 7 + 1) & 0xFF


def _finish_request(sched, rid: str, step: int, *, export: bool) -> None:
    sched.step_scheduled(step, joined=[rid])
    sched.step_completed(step)
    if export:
        sched.request_finished(rid, export=True)


def _producer_main(args_d: dict, out: mp.Queue) -> None:
    from hybridkv.transport.env import apply_ucx_defaults

    apply_ucx_defaults()
    try:
        asyncio.run(_producer(argparse.Namespace(**args_d), out))
    except ValueError as exc:  # bad input: the parent raises it as such (one line, no traceback)
        out.put(("invalid", str(exc)))
    except BaseException as exc:  # surface in the parent rather than hang it, with what a bug report needs
        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc().rstrip()}"))


async def _producer(args, out) -> None:
    from hybridkv.fencing.scheduler import TransferScheduler
    from hybridkv.transport.config import Outcome
    from hybridkv.transport.endpoint import Producer, TransportConfig

    layout, memory, pools, keep = _side(args, 1, parse_devices(args.devices, args.mem)[0])
    sched = TransferScheduler(pools, lease_s=60.0)
    prod = Producer(memory, sched, TransportConfig(secret=args.secret, insecure_host_memory=args.mem == "dram"),
                    planner=args.planner)
    host, port = await prod.start()
    out.put(("addr", (host, port)))
    await prod.wait_peer(60.0)
    for i in range(args.iters + 1):  # one warm-up
        rid = f"req{i}"
        sched.add_request(rid)
        for g in layout.groups:
            sched.allocate(rid, g.group_id, pools.pool_sizes[g.group_id])
        _finish_request(sched, rid, i + 1, export=True)
        res = await prod.export(rid, token=args.capabilities[i])
        if res.outcome is not Outcome.DONE:
            out.put(("error", f"export {rid}: {res.outcome.name} {res.error}"))
            return
    out.put(("done", None))
    t0 = time.monotonic()
    while prod.peers and time.monotonic() - t0 < 600:  # the consumer still runs the baselines
        await asyncio.sleep(0.05)
    await prod.close()
