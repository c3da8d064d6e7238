"""A producer and a consumer process that connect and then rest (no request, no polling of their own),
for measuring what a connected, idle control plane costs (tests/transport/test_idle_cpu.py).

Each waits for the test's word on a thread blocked in ``Queue.get`` (costs nothing), so the only CPU
either process uses at rest is the endpoint's own: its pump, UCX's progress thread and ucxx's waits.
"""

from __future__ import annotations

import asyncio
import os
import traceback

from tests.transport import peers


def _endpoint(kind: str, seed: int):
    from hybridkv.descriptors.planning import DescriptorPlanner
    from hybridkv.fencing.scheduler import TransferScheduler
    from hybridkv.transport.endpoint import Consumer, Pairing, Producer, TransportConfig

    _, memory, pools = peers.build(seed)
    cls = Producer if kind == "producer" else Consumer
    return cls(memory, TransferScheduler(pools, lease_s=30.0), TransportConfig(secret=peers.SECRET, insecure_host_memory=True),
               planner=DescriptorPlanner(pairing=Pairing.PAGES))


async def _rest(inbox) -> str:
    """The test's next word, waited for off the loop (a blocked thread: no wake-ups)."""
    return await asyncio.get_running_loop().run_in_executor(None, inbox.get)


async def _producer(opts: dict, out, inbox) -> None:
    prod = _endpoint("producer", 1)
    host, port = await prod.start()
    out.put(("addr", (host, port, os.getpid())))
    await prod.wait_peer(60.0)
    out.put(("connected", os.getpid()))
    await _rest(inbox)
    await prod.close()


async def _consumer(opts: dict, out, inbox) -> None:
    cons = _endpoint("consumer", 2)
    await cons.connect(*opts["addr"])
    out.put(("connected", os.getpid()))
    await _rest(inbox)
    await cons.close()


def _main(coro_fn, opts: dict, out, inbox) -> None:
    peers._quiet()
    try:
        asyncio.run(coro_fn(opts, out, inbox))
    except BaseException as exc:  # report, don't hang the test
        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def producer_main(opts: dict, out, inbox) -> None:
    _main(_producer, opts, out, inbox)


def consumer_main(opts: dict, out, inbox) -> None:
    _main(_consumer, opts, out, inbox)
