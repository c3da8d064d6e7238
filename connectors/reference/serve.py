"""Prefill and decode worker processes of the demo.

Each runs one reference engine on an asyncio loop next to its hybridkv endpoint
(a NIXL `Producer` on prefill, a `Consumer` on decode). The router talks to them
over a pipe with msgpack messages; the KV and state move over NIXL only.
"""

from __future__ import annotations

import asyncio
import os
import time
import traceback
from dataclasses import dataclass

import msgpack


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    role: str
    async_depth: int = 1
    policy: str = "fenced"
    failure_policy: str = "recompute"
    chunk_size: int = 32
    max_running: int = 8
    attention_blocks: int = 96
    state_slots: int = 8
    fail_rids: tuple[str, ...] = ()       # inject: the READs of these requests fail in NIXL
    late_completion_s: float = 0.0        # inject: the decode stalls this long once a READ of late_rids landed
    late_rids: tuple[str, ...] = ()
    model_seed: int = 1234
    lease_s: float = 30.0
    model: str = "tiny"
    device: str = "cpu"                   # "cuda:N": model, KV pages and GDN states in that GPU's memory
    secret: bytes | None = None            # both workers prove it in the handshake (a fresh one per run)


def send(conn, msg: dict) -> None:
    conn.send_bytes(msgpack.packb(msg, use_bin_type=True))


def recv(conn) -> dict:
    return msgpack.unpackb(conn.recv_bytes(), raw=False)


def worker_main(conn, opts: dict) -> None:
    import faulthandler
    import logging
    import signal

    from hybridkv.transport.env import apply_ucx_defaults

    # This process's endpoint is about to start both planes (and so both UCX contexts).
    apply_ucx_defaults()

    # The router sends SIGUSR1 when a run is stuck: every thread's stack goes to stderr,
    # even if the asyncio loop itself is blocked and cannot answer a "dump".
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    logging.getLogger("nixl").setLevel(logging.ERROR)
    try:
        asyncio.run(_worker(conn, WorkerOptions(**opts)))
    except BaseException as exc:  # tell the router instead of leaving it waiting
        try:
            send(conn, {"op": "error", "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
        except Exception:
            pass


async def _worker(conn, o: WorkerOptions) -> None:
    import torch

    from hybridkv.fencing.fence import FencePolicy, NotYet
    from hybridkv.descriptors.planning import DescriptorPlanner
    from hybridkv.transport.endpoint import Consumer, FailurePolicy, Pairing, Producer, TransportConfig
    from hybridkv.transport.memory import from_layout

    from .cache import CacheConfig
    from .engine import Engine, EngineConfig, Role
    from .model import TinyHybridModel, model_config

    torch.set_num_threads(1)
    if o.device.startswith("cuda"):
        torch.cuda.set_device(o.device)
    role = Role(o.role)
    cfg = EngineConfig(role=role, async_depth=o.async_depth, chunk_size=o.chunk_size, max_running=o.max_running,
                       policy=FencePolicy[o.policy.upper()], lease_s=o.lease_s, device=o.device,
                       cache=CacheConfig(attention_blocks=o.attention_blocks, state_slots=o.state_slots))
    model = TinyHybridModel(model_config(o.model, seed=o.model_seed), device=o.device)
    results: dict[str, dict] = {}
    from hybridkv.transport.auth import new_token

    # The demo's instances share one host and the CPU demo's caches are host memory, which UCX serves over
    # shm/cma/tcp: accepted by name (transport/host_memory.py), as its one-host lab setting is.
    tcfg = TransportConfig(failure_policy=FailurePolicy(o.failure_policy), secret=o.secret,
                           insecure_host_memory=not o.device.startswith("cuda"))
    capabilities: dict[str, bytes] = {}  # decode: each request's token, from the router
    planner = DescriptorPlanner(pairing=Pairing.PAGES)  # both instances cut pages alike
    engine: Engine | None = None

    first_tokens: dict[str, int] = {}

    def first_token(r) -> None:
        if role is Role.PREFILL:
            first_tokens[r.rid] = r.output[0]

    def finished(r) -> None:
        if role is Role.DECODE:
            res = getattr(r, "import_result", None)
            # Taken before the first step that read the imported pages; that step's results are in,
            # so the checksums (earlier on the same stream) are too.
            sums = r.import_check.values() if r.import_check is not None else None
            send(conn, {"op": "done", "rid": r.rid, "output": r.output, "status": r.status.value,
                        "error": r.error, "token_times": r.token_times, "recomputed": r.recompute,
                        "checksums": sums,
                        "transfer": None if res is None else {
                            "outcome": res.outcome.value, "error": res.error, "descriptors": res.descriptors,
                            "indices": res.indices, "fence_wait_s": res.fence_wait_seconds,
                            "nbytes": res.nbytes, "seconds": res.seconds}})

    if role is Role.PREFILL:
        holder: dict = {}

        async def exporter(rid: str):
            # Hand the request to decode once its blocks may be read (rule 1: every step that
            # wrote them completed), as a P/D proxy does when prefill returns: decode then
            # allocates and reads at once, the timing in which vLLM's races fired.
            sched = engine.sched
            while sched.has_request(rid) and isinstance(sched.export_ready(rid), NotYet):
                await asyncio.sleep(0.0005)
            token = new_token()  # the request's capability: only the decode worker it is handed to reads it
            send(conn, {"op": "first", "rid": rid, "token": first_tokens.pop(rid), "t": time.time(),
                        "capability": token.hex()})
            # The request goes to whichever consumer asks for it (a restarted one included).
            result = await holder["p"].export(rid, token=token)
            results[rid] = {"outcome": result.outcome.value, "error": result.error}
            send(conn, {"op": "exported", "rid": rid, "outcome": result.outcome.value, "error": result.error,
                        "checksums": await engine.wait_for(engine.requests[rid].export_check)})
            return result

        engine = Engine(model, cfg, exporter=exporter, on_first_token=first_token)
        prod = Producer(from_layout(engine.cache.layout), engine.sched, tcfg, planner=planner)
        holder["p"] = prod
        host, port = await prod.start()
        send(conn, {"op": "addr", "host": host, "port": port, "pid": os.getpid()})
        endpoint = prod
    else:
        holder = {}

        async def connected() -> str | None:
            """The producer's handshake, shared by the requests that need it; None once connected,
            else why not. A failed one (its retries spent) is tried again by the next request."""
            task = holder.get("dial")
            if task is None or task.done() and task.exception() is not None:
                task = holder["dial"] = asyncio.ensure_future(cons.connect(*holder["addr"]))
            try:
                await asyncio.shield(task)
            except Exception as exc:  # the producer stayed away: its requests degrade, the worker lives
                return f"{type(exc).__name__}: {exc}"
            return None

        async def fetcher(rid: str, comps):
            error = await connected()
            token = capabilities.pop(rid)
            if error is not None:
                return cons.give_up(rid, comps, f"no handshake with the producer: {error}")
            return await cons.fetch(rid, comps, token=token)

        engine = Engine(model, cfg, fetcher=fetcher, on_finished=finished)
        cons = _FaultyConsumer(from_layout(engine.cache.layout), engine.sched, tcfg, planner=planner,
                               fail_rids=set(o.fail_rids), late_rids=set(o.late_rids), late_s=o.late_completion_s)
        holder["c"] = cons
        msg = recv(conn)
        holder["addr"] = (msg["host"], msg["port"])
        send(conn, {"op": "connected", "pid": os.getpid(), "error": await connected()})
        endpoint = cons

    stop = False
    while not stop:
        while conn.poll():
            msg = recv(conn)
            if msg["op"] == "req":
                if "capability" in msg:
                    capabilities[msg["rid"]] = bytes.fromhex(msg["capability"])
                engine.submit(msg["rid"], msg["prompt"], msg["max_tokens"], first_token=msg.get("first_token"))
            elif msg["op"] == "stop":
                stop = True
            elif msg["op"] == "dump":
                send(conn, {"op": "dump", "engine": engine.describe(), "endpoint": endpoint.describe(),
                            "loop_tasks": len(asyncio.all_tasks())})
        if engine.busy:
            await engine.run_step()
        else:
            await asyncio.sleep(0.002)
    await engine.drain()
    stats = engine.stats()
    steps = sorted(engine.step_seconds)
    stats.update(leaked=engine.leaked_blocks(), role=role.value, steps_launched=engine.steps_launched,
                 steps_overlapped=engine.steps_overlapped, steps_ahead=engine.steps_ahead,
                 step_ms_median=steps[len(steps) // 2] * 1e3 if steps else 0.0)
    send(conn, {"op": "stats", "stats": stats})
    await endpoint.close()


def _faulty_consumer_class():
    import dataclasses

    import numpy as np

    from hybridkv.transport.endpoint import Consumer

    class FaultyConsumer(Consumer):
        """A consumer whose READs for chosen requests point past the peer's descriptor list,
        so NIXL itself refuses them: a real data-plane failure, handled by the real path.
        And one that stalls (the whole process: no heartbeats, no messages) right after a READ of
        another chosen request landed, past the lease, so that its completion is reported late:
        the scheduler answers LATE and the request recomputes."""

        def __init__(self, *args, fail_rids: set[str], late_rids: set[str] = frozenset(), late_s: float = 0.0,
                     **kw) -> None:
            super().__init__(*args, **kw)
            self.fail_rids = fail_rids
            self.late_rids, self.late_s = set(late_rids), late_s
            self._late: set = set()
            self.injected = 0

        def give_up(self, rid, comps, error):
            """An import that cannot start (no handshake): recomputed or failed per the policy."""
            return self._give_up(rid, comps, error)

        def _post(self, w, notif):
            if w.part.rid in self.fail_rids:
                self.injected += 1
                p = w.plan
                p = (dataclasses.replace(p, src_index=p.src_index + (1 << 30)) if p.indexed else
                     dataclasses.replace(p, src=p.src + np.array([1 << 50, 0, 0], dtype=p.src.dtype)))
                w = dataclasses.replace(w, plan=p)
            xfer = super()._post(w, notif)
            if w.part.rid in self.late_rids:
                self.late_rids.discard(w.part.rid)
                self._late.add(xfer)
            return xfer

        async def _wait_xfer(self, xfer, until=None):
            state = await super()._wait_xfer(xfer, until)
            if xfer in self._late:
                self._late.discard(xfer)
                self.injected += 1
                time.sleep(self.late_s)  # the loop itself stops: the bytes landed, nobody says so in time
            return state

    return FaultyConsumer


def _FaultyConsumer(*args, **kw):  # noqa: N802 - a class made lazily (no NIXL import at module load)
    return _faulty_consumer_class()(*args, **kw)
