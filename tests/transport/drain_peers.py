"""Processes for the import-drain tests (test_import_drain.py): a producer whose write into the consumer's
blocks is held while it reports failure, goes away or is killed, and a consumer that hands the blocks
of a failed import to the next user as soon as its scheduler lets it, then checks those pages.

The producer is the transport's own, with one fault (named so, ``fake``): on the consumer's Import it
first says what the test asks (``Failure`` or ``Bye``, or nothing: the test kills it), then posts its
real WRITE ``hold_s`` later, through the real path (NIXL WRITE with its completion notification). A
WRITE held in the network after its writer failed, or that outlives its writer's control channel,
looks the same to the consumer, and no real NIXL holds one on demand.

With ``HYBRIDKV_DRAIN_RULE_OFF=1`` in the consumer's environment the rule is switched off (a mutant of
the core's ImportLedger: any failure ends the import as if every writer drained), to show each test
failing without it.
"""

from __future__ import annotations

import asyncio
import os
import time
import traceback

from tests.transport import peers
from tests.transport.peers import SECRET, build, components, counts, digest, token

RULE_OFF_ENV = "HYBRIDKV_DRAIN_RULE_OFF"


def _rule_off() -> None:
    """The mutant: a failure (a writer's, a lost producer, a local abort) taken as 'every writer drained'."""
    from hybridkv.fencing.imports import ImportLedger, ImportState

    real_fail = ImportLedger.fail

    def fail(self, key, reason, *, generation=None):
        known = real_fail(self, key, reason, generation=generation)
        e = self._entries.get(key)
        if e is not None and e.state is ImportState.OPEN:
            self._end(key, e, ImportState.DRAINED)
        return known

    ImportLedger.fail = fail


def _run(main, opts, out, inbox) -> None:
    peers._quiet()
    if opts.get("ucx_tls"):
        # Before UCX starts. Over TCP a READ's bytes move only as the producer answers it (cma or shared
        # memory move them one-sided, with only its completion waiting for the stopped producer).
        os.environ["UCX_TLS"] = opts["ucx_tls"]
    try:
        asyncio.run(main(opts, out, inbox))
    except BaseException as exc:  # report, don't hang the test
        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


async def _wait_word(inbox, word: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if inbox.get_nowait() == word:
                return
        except Exception:
            pass
        await asyncio.sleep(0.01)
    raise TimeoutError(f"no {word!r} from the test within {timeout_s} s")


# ============================================================== producer
async def _producer(opts, out, inbox):
    from hybridkv import wire
    from hybridkv.descriptors.planning import DescriptorPlanner
    from hybridkv.fencing.scheduler import TransferScheduler
    from hybridkv.transport.endpoint import Pairing, Producer, TransportConfig
    from hybridkv.transport.side import send_quietly

    layout, memory, pools = build(1)
    sched = TransferScheduler(pools, lease_s=30.0)
    mode = wire.Mode[opts["mode"]]
    cfg = TransportConfig(mode=mode, secret=SECRET, insecure_host_memory=True)
    prod = Producer(memory, sched, cfg, planner=DescriptorPlanner(pairing=Pairing.PAGES))
    host, port = await prod.start()
    out.put(("addr", (host, port, os.getpid())))
    rid, tokens = opts["request"]
    sched.add_request(rid)
    for g, n in counts(layout, tokens).items():
        sched.allocate(rid, g, n)
    sched.step_scheduled(1, joined=[rid])
    sched.step_completed(1)

    fault = opts.get("fault")
    if fault is not None:  # fake: the WRITE is held hold_s after the producer said what the test asks
        exports = prod._exports
        real_on_import = exports._on_import
        loop = asyncio.get_running_loop()

        def held_on_import(peer, msg):
            rec = exports._exports.get(msg.request_id)
            if fault == "failure" and rec is not None:
                asyncio.ensure_future(send_quietly(peer.channel, wire.Failure(
                    request_id=msg.request_id, code=wire.FailureCode.TRANSFER_ERROR,
                    detail="fake: failed while its WRITE is held", token=rec.token)))
            elif fault == "bye":
                asyncio.ensure_future(send_quietly(peer.channel, wire.Bye(reason="fake: control gone, writer not")))
            out.put(("held", time.monotonic()))
            if fault != "killed":  # killed: the test kills this process while the WRITE is held
                loop.call_later(opts["hold_s"], real_on_import, peer, msg)

        exports._on_import = held_on_import

    out.put(("sent", digest(layout, {g: list(sched.blocks(rid, g)) for g in counts(layout, tokens)})))
    await prod.wait_peer(20.0)
    sched.request_finished(rid, export=True)
    result = await prod.export(rid, token=token(rid))
    out.put(("results", (result.outcome.name, result.error, time.monotonic())))
    await _wait_word(inbox, "stop")
    await prod.close()


def producer_main(opts, out, inbox) -> None:
    _run(_producer, opts, out, inbox)


# ============================================================== consumer
def _fill(layout, blocks: dict[int, list[int]], seed: int) -> None:
    """What an engine computing into these pages leaves there: a pattern of its own."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for g in layout.groups:
        for p in g.placements:
            r = layout.regions[p.region_id]
            buf = layout.allocations[p.region_id].owner
            for b in blocks.get(g.group_id, []):
                buf[b * r.stride: b * r.stride + r.page_bytes] = rng.integers(0, 256, r.page_bytes, dtype=np.uint8)


async def _consumer(opts, out, inbox):
    if os.environ.get(RULE_OFF_ENV) == "1":
        _rule_off()
    from hybridkv import wire
    from hybridkv.fencing import NotYet
    from hybridkv.fencing.scheduler import TransferScheduler
    from hybridkv.descriptors.planning import DescriptorPlanner
    from hybridkv.transport.endpoint import Consumer, FailurePolicy, Pairing, TransportConfig

    layout, memory, pools = build(2)
    sched = TransferScheduler(pools, lease_s=30.0)
    cfg = TransportConfig(mode=wire.Mode[opts["mode"]], failure_policy=FailurePolicy[opts["policy"]],
                          transfer_timeout_s=opts["transfer_timeout_s"], secret=SECRET,
                          insecure_host_memory=True)
    cons = Consumer(memory, sched, cfg, planner=DescriptorPlanner(pairing=Pairing.PAGES))
    if opts.get("abort_refused_fake"):
        # fake: NIXL refuses to abort the stuck READ (the one fault a real NIXL will not give on demand)
        cons.dp.abort = lambda xfer: False
    host, port = opts["addr"]
    await cons.connect(host, port)
    comps = components(layout)
    rid, tokens = opts["request"]
    need = counts(layout, tokens)
    # Every block but the request's goes to another request first: a block it gives back early is
    # the very block the next request gets.
    sched.add_request("pad")
    for g, n in need.items():
        sched.allocate("pad", g, pools.pool_sizes[g] - n)
    sched.add_request(rid, expect=comps)
    mine = {g: [int(b) for b in sched.allocate(rid, g, n)] for g, n in need.items()}
    await cons.want(rid, token=token(rid))
    while not cons.exported(rid):
        await asyncio.sleep(0.01)
    out.put(("about_to_fetch", None))
    await _wait_word(inbox, "go")
    result = await cons.fetch(rid, comps, token=token(rid))
    t_result = time.monotonic()
    # The engine moves on: a recomputed request computes into its own blocks at once; a failed one's
    # blocks go to the next request as soon as the scheduler hands them out.
    if result.outcome.name == "RECOMPUTE":
        reused = mine
    else:
        sched.add_request("next")
        reused = {}
        end = time.monotonic() + 60
        while len(reused) < len(need) and time.monotonic() < end:
            for g, n in need.items():
                if g not in reused:
                    got = sched.allocate("next", g, n)
                    if not isinstance(got, NotYet):
                        reused[g] = [int(b) for b in got]
            await asyncio.sleep(0.005)
    t_reuse = time.monotonic()
    before = digest(layout, reused)  # what the import left there (the producer's bytes, if its write landed)
    _fill(layout, reused, seed=3)
    want = digest(layout, reused)
    out.put(("reused", {"outcome": result.outcome.name, "error": result.error, "t_result": t_result,
                        "t_reuse": t_reuse, "same_blocks": reused == mine, "complete": len(reused) == len(need),
                        "found": before}))
    await _wait_word(inbox, "check")  # the late write, if any, has landed by now
    sched.audit()
    out.put(("pages", {"intact": digest(layout, reused) == want, "now": digest(layout, reused),
                       "in_flight": sched.transfers_in_flight(),
                       "settling": cons.settling(rid)}))
    await _wait_word(inbox, "stop")
    await cons.close()


def consumer_main(opts, out, inbox) -> None:
    _run(_consumer, opts, out, inbox)
