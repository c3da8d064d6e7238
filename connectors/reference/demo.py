"""`hybridkv demo`: disaggregated prefill -> decode of a hybrid model, checked token by token.

A router (this process) runs the aggregated baseline, then starts a prefill process
and a decode process, sends every request to prefill, forwards each to decode with
the prefill's first token once the prefill has it, and compares every output with
the aggregated run. The KV blocks and GDN states move between the two processes
over NIXL (UCX), through hybridkv's layout, fencing and transport.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import random
import secrets
import signal
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

from .serve import WorkerOptions, recv, send, worker_main


#: Measured with the default 32 requests: clean at depth 8 (sim race's limit too); at 16 the
#: disaggregated run fails 3 requests, and at 48 the aggregated engine's 96 attention blocks run dry.
MAX_ASYNC_DEPTH = 8


class Fault:
    DROP_TRANSFER = "drop-transfer"
    KILL_DECODE = "kill-decode"
    LATE_COMPLETION = "late-completion"
    STALL_PREFILL = "stall-prefill"
    ALL = (DROP_TRANSFER, KILL_DECODE, LATE_COMPLETION, STALL_PREFILL)

#: --inject stall-prefill: the prefill process is SIGSTOPped this long while the decode handshakes,
#: longer than one handshake try (5 s): the decode's retry waits it out.
STALL_PREFILL_S = 8.0


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    requests: int = 32
    seed: int = 0
    async_depth: int = 1
    policy: str = "fenced"
    failure_policy: str = "recompute"
    inject: tuple[str, ...] = ()
    min_prompt: int = 3
    max_prompt: int = 120
    min_tokens: int = 6
    max_tokens: int = 16
    max_running: int = 8
    state_slots: int = 10
    attention_blocks: int = 96
    timeout_s: float = 240.0  # the whole run: the aggregated baseline and the disaggregated run
    lease_s: float = 4.0  # short, so blocks of a killed consumer's exports come back within the demo
    chunk_size: int = 32
    model: str = "tiny"
    device: str = "cpu"  # "cuda": the model, KV pages and GDN states in VRAM, NIXL between GPUs' memory
    devices: tuple[int, int] = (0, 0)  # CUDA devices of prefill and decode (the aggregated run uses prefill's)

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if not 0 <= self.async_depth <= MAX_ASYNC_DEPTH:
            # Deeper, the demo's fixed pools fail requests or run dry (the reference engine does
            # not preempt): say so here rather than as a pool error naming no flag.
            raise ValueError(f"--async-depth {self.async_depth}; expected 0 to {MAX_ASYNC_DEPTH}")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout {self.timeout_s}; expected > 0 seconds")
        bad = [f for f in self.inject if f not in Fault.ALL]
        if bad:
            raise ValueError(f"--inject {bad[0]!r} is not one of {', '.join(Fault.ALL)}")
        if not 1 <= self.min_prompt <= self.max_prompt or not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError("prompt and token ranges must be non-empty and positive")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}; expected cpu or cuda")
        if len(self.devices) != 2 or min(self.devices) < 0:
            raise ValueError(f"--devices {self.devices}; expected two CUDA device indices P,D")
        if self.chunk_size < 1:
            raise ValueError(f"--chunk-size {self.chunk_size}; expected >= 1")

    def device_of(self, role: str) -> str:
        """Where a process computes: the CPU, or its CUDA device (aggregated runs on prefill's)."""
        if self.device == "cpu":
            return "cpu"
        return f"cuda:{self.devices[1] if role == 'decode' else self.devices[0]}"


@dataclass(kw_only=True)
class Report:
    requests: int
    tokens: int
    mismatches: int
    mismatched: list[str]
    failed: int
    recomputed: int
    resent: int  # prefilled again after the decode process holding them was lost (kill-decode)
    leaked_blocks: int
    processes: int
    async_depth: int
    policy: str
    transport: str
    faults_injected: int
    faults: dict
    descriptors_per_request: float
    vllm_033_descriptors_per_request: float
    bytes_moved: int
    transfer_GBps: float
    ttft_ms: float
    itl_ms: float
    wall_s: float
    aggregated_s: float
    extra: dict = field(default_factory=dict)
    model: str = "tiny"
    device: str = "cpu"
    byte_mismatches: int = 0  # requests whose imported pages differ from what the producer exported
    pages_checked: int = 0  # attention pages + state pages compared byte for byte (by checksum)
    pages_mismatched: int = 0
    tokens_per_s: float = 0.0  # output tokens over the disaggregated run's wall time
    aggregated: dict = field(default_factory=dict)  # the same figures for the aggregated run
    transfer_GBps_each: dict = field(default_factory=dict)  # per READ: min / median / max
    fence_wait_ms: dict = field(default_factory=dict)  # per import: mean / max time the fence held it
    # per engine, "A/O/N": of N steps launched, A were enqueued before the previous step's results were taken
    # back, O while the previous step's kernels were still running
    steps_overlapped: dict = field(default_factory=dict)


def make_requests(o: DemoOptions) -> list[tuple[str, list[int], int]]:
    rng = random.Random(o.seed)
    out = []
    for i in range(o.requests):
        n = rng.randint(o.min_prompt, o.max_prompt)
        out.append((f"req-{i:03d}", [rng.randrange(1, 384) for _ in range(n)], rng.randint(o.min_tokens, o.max_tokens)))
    return out


def run_aggregated(o: DemoOptions, requests, figures: dict | None = None) -> dict[str, list[int]]:
    """The reference: one engine doing prefill and decode, same model, same async depth.
    It runs first, so it may take the whole --timeout; past that a TimeoutError says what it holds.
    `figures` gets its TTFT, inter-token latency and output tokens/s."""
    import torch

    from .cache import CacheConfig
    from .engine import Engine, EngineConfig, Role
    from .model import TinyHybridModel, model_config

    torch.set_num_threads(1)
    device = o.device_of("aggregated")
    if device != "cpu":
        torch.cuda.set_device(device)
    done: dict[str, list[int]] = {}
    firsts: list[float] = []
    gaps: list[float] = []

    def finished(r) -> None:
        done[r.rid] = list(r.output)
        if r.token_times:
            firsts.append(r.token_times[0] - r.arrived_s)
            gaps.extend(b - a for a, b in zip(r.token_times, r.token_times[1:]))

    cfg = EngineConfig(role=Role.AGGREGATED, async_depth=o.async_depth, max_running=o.max_running,
                       chunk_size=o.chunk_size, device=device,
                       cache=CacheConfig(attention_blocks=o.attention_blocks, state_slots=o.state_slots))
    engine = Engine(TinyHybridModel(model_config(o.model), device=device), cfg, on_finished=finished)
    t0 = time.perf_counter()
    for rid, prompt, n in requests:
        engine.submit(rid, prompt, n)
    limit = o.timeout_s
    try:
        # wait_for besides drain's own check between steps: a step that never returns is caught too.
        asyncio.run(asyncio.wait_for(engine.drain(timeout_s=limit), limit))
    except TimeoutError:
        raise TimeoutError(
            f"the aggregated baseline timed out after {limit:.1f} s with {len(done)}/{len(requests)} requests "
            f"done (--timeout covers it and the disaggregated run)\n"
            f"aggregated: {json.dumps(engine.describe(), default=str)}") from None
    if engine.leaked_blocks():
        raise RuntimeError(f"the aggregated baseline leaked {engine.leaked_blocks()} blocks")
    if figures is not None:
        wall = time.perf_counter() - t0
        figures.update(ttft_ms=statistics.mean(firsts) * 1e3 if firsts else 0.0,
                       itl_ms=statistics.mean(gaps) * 1e3 if gaps else 0.0,
                       tokens_per_s=sum(len(v) for v in done.values()) / wall, wall_s=wall,
                       steps_ahead=engine.steps_ahead, steps_overlapped=engine.steps_overlapped,
                       steps_launched=engine.steps_launched)
    del engine
    if device != "cpu":
        torch.cuda.empty_cache()  # the workers start next, on the same GPU
    return done


class _Worker:
    def __init__(self, ctx, role: str, o: DemoOptions, **extra) -> None:
        self.role = role
        self.conn, child = ctx.Pipe()
        opts = asdict(WorkerOptions(role=role, async_depth=o.async_depth, policy=o.policy,
                                    failure_policy=o.failure_policy, max_running=o.max_running,
                                    attention_blocks=o.attention_blocks, state_slots=o.state_slots,
                                    lease_s=o.lease_s, chunk_size=o.chunk_size, model=o.model,
                                    device=o.device_of(role), **extra))
        self.proc = ctx.Process(target=worker_main, args=(child, opts), daemon=True)
        self.proc.start()

    def expect(self, op: str, timeout_s: float = 60.0) -> dict:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"no {op!r} from the {self.role} worker in {timeout_s:.1f} s "
                               "(--timeout covers the whole run)")
        msg = recv(self.conn)
        if msg["op"] == "error":
            raise RuntimeError(f"worker failed: {msg['error']}\n{msg.get('trace', '')}")
        if msg["op"] != op:
            raise RuntimeError(f"expected {op!r} from the worker, got {msg!r}")
        return msg


def run_demo(o: DemoOptions, progress=None) -> Report:
    if o.device == "cuda":
        # The GDN chunk kernels are autotuned by timing; a tie broken differently in another process
        # could pick another tile and so other roundings. Cached on disk, the aggregated run's choice
        # is the one every worker (spawned after it, same environment) loads.
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    requests = make_requests(o)
    by_rid = {rid: (prompt, n) for rid, prompt, n in requests}
    t0 = time.perf_counter()
    # One budget for the whole run, so that --timeout bounds what the user waits for.
    run_deadline = time.monotonic() + o.timeout_s
    agg_figures: dict = {}
    expected = run_aggregated(o, requests, agg_figures)
    aggregated_s = time.perf_counter() - t0

    rng = random.Random(o.seed + 1)
    fail_rids = tuple(sorted(rng.sample(sorted(by_rid), k=max(1, o.requests // 8)))) \
        if Fault.DROP_TRANSFER in o.inject else ()
    # The decode stalls past the lease once the READ of one request landed: its completion is late.
    late_rids = tuple(random.Random(o.seed + 2).sample(sorted(by_rid), k=1)) \
        if Fault.LATE_COMPLETION in o.inject else ()
    late_s = 1.25 * o.lease_s if late_rids else 0.0
    ctx = mp.get_context("spawn")
    # The workers authenticate each other with a secret of this run, handed over through the spawn.
    secret = secrets.token_bytes(32)
    t_start = time.perf_counter()
    prefill = _Worker(ctx, "prefill", o, secret=secret)
    addr = prefill.expect("addr", _left(run_deadline))
    if Fault.STALL_PREFILL in o.inject:  # a real stall of the whole prefill process, during the handshake
        os.kill(prefill.proc.pid, signal.SIGSTOP)
        threading.Timer(STALL_PREFILL_S, os.kill, (prefill.proc.pid, signal.SIGCONT)).start()

    def start_decode() -> _Worker:
        d = _Worker(ctx, "decode", o, fail_rids=fail_rids, late_completion_s=late_s, late_rids=late_rids,
                    secret=secret)
        send(d.conn, {"op": "connect", "host": addr["host"], "port": addr["port"]})
        d.expect("connected", _left(run_deadline))
        return d

    decode = start_decode()
    sent_at: dict[str, float] = {}
    ttft: dict[str, float] = {}
    done: dict[str, dict] = {}
    exported: dict[str, dict] = {}  # by prefill id: what the producer's pages held (checksums)
    at_decode: set[str] = set()
    alias: dict[str, str] = {}  # prefill id -> request id (re-sent after a decode restart)
    faults = {f: 0 for f in Fault.ALL}
    faults[Fault.DROP_TRANSFER] = len(fail_rids)
    faults[Fault.LATE_COMPLETION] = len(late_rids)
    faults[Fault.STALL_PREFILL] = 1 if Fault.STALL_PREFILL in o.inject else 0
    kill_after = o.requests // 3 if Fault.KILL_DECODE in o.inject else None
    retries = 0
    for rid, prompt, n in requests:
        sent_at[rid] = time.perf_counter()
        send(prefill.conn, {"op": "req", "rid": rid, "prompt": prompt, "max_tokens": 1})
    while len(done) < len(requests):
        if time.monotonic() > run_deadline:
            raise TimeoutError(f"demo timed out after {o.timeout_s:.1f} s with {len(done)}/{len(requests)} "
                               "requests done; what each worker holds:\n"
                               + _diagnose((("prefill", prefill), ("decode", decode))))
        for w in (prefill, decode):
            while w.conn.poll():
                msg = recv(w.conn)
                op = msg["op"]
                if op == "error":
                    raise RuntimeError(f"worker failed: {msg['error']}\n{msg.get('trace', '')}")
                if op == "first":
                    rid = alias.get(msg["rid"], msg["rid"])
                    ttft.setdefault(rid, time.perf_counter() - sent_at[rid])
                    prompt, n = by_rid[rid]
                    # Decode imports what prefill exported: the prefill's id names the export.
                    # With the request's capability, as a P/D proxy forwards kv_transfer_params.
                    send(decode.conn, {"op": "req", "rid": msg["rid"], "prompt": prompt, "max_tokens": n,
                                       "first_token": msg["token"], "capability": msg["capability"]})
                    at_decode.add(rid)
                elif op == "exported":
                    exported[msg["rid"]] = msg
                elif op == "done":
                    rid = alias.get(msg["rid"], msg["rid"])
                    done[rid] = msg
                    at_decode.discard(rid)
                    if progress is not None:
                        progress(len(done), len(requests))
        # Only while decode holds requests: a crash then loses work that must be redone.
        if kill_after is not None and len(done) >= kill_after and at_decode:
            kill_after = None
            os.kill(decode.proc.pid, signal.SIGKILL)  # a real crash: no goodbye, no cleanup
            decode.proc.join(10)
            faults[Fault.KILL_DECODE] += 1
            decode = start_decode()
            retries += 1
            for rid in sorted(at_decode):  # lost with the process: prefill them again
                retry = f"{rid}~retry{retries}"
                alias[retry] = rid
                send(prefill.conn, {"op": "req", "rid": retry, "prompt": by_rid[rid][0], "max_tokens": 1})
            at_decode.clear()
        time.sleep(0.002)
    wall_s = time.perf_counter() - t_start
    stats = {}
    for name, w in (("prefill", prefill), ("decode", decode)):
        send(w.conn, {"op": "stop"})
    for name, w in (("prefill", prefill), ("decode", decode)):
        deadline = time.monotonic() + 90
        while True:
            msg = _next_stats(w, deadline, exported)
            if msg is not None:
                stats[name] = msg["stats"]
                break
        w.proc.join(30)
    return _report(o, requests, expected, done, stats, ttft, faults, wall_s, aggregated_s, resent=len(alias),
                   exported=exported, aggregated=agg_figures)


def _left(deadline: float, most_s: float = 60.0) -> float:
    """Seconds a worker handshake may wait: at most `most_s`, never past the run's deadline."""
    return max(0.1, min(most_s, deadline - time.monotonic()))


def _diagnose(workers) -> str:
    """Ask each worker what it holds (and make it print its stacks): a timeout says why."""
    lines = []
    for name, w in workers:
        if not w.proc.is_alive():
            lines.append(f"{name}: process exited with {w.proc.exitcode}")
            continue
        got = None
        try:
            os.kill(w.proc.pid, signal.SIGUSR1)
            send(w.conn, {"op": "dump"})
            t_end = time.monotonic() + 5
            while got is None and time.monotonic() < t_end:
                if w.conn.poll(0.1):
                    msg = recv(w.conn)
                    if msg["op"] == "dump":
                        got = msg
        except (OSError, EOFError) as exc:
            # It died between the check above and now: the dump reports that, it must not replace it.
            lines.append(f"{name}: gone while asked for a dump ({type(exc).__name__}: {exc})")
            continue
        lines.append(f"{name}: " + ("no answer to a dump in 5 s (its loop is blocked; stacks on stderr)"
                                    if got is None else json.dumps(got, default=str)))
    return "\n".join(lines)


def _next_stats(w: _Worker, deadline: float, exported: dict[str, dict]) -> dict:
    while time.monotonic() < deadline:
        if w.conn.poll(0.1):
            msg = recv(w.conn)
            if msg["op"] == "stats":
                return msg
            if msg["op"] == "exported":  # an export that ended after its request's decode
                exported[msg["rid"]] = msg
            if msg["op"] == "error":
                raise RuntimeError(f"worker failed: {msg['error']}\n{msg.get('trace', '')}")
    raise TimeoutError("a worker did not report its final state")


def _byte_check(done: dict[str, dict], exported: dict[str, dict]) -> tuple[list[str], int, int]:
    """Requests whose imported pages (checksummed on the decode side before their first use)
    differ from what the prefill exported; pages compared; pages that differ."""
    bad, checked, differ = [], 0, 0
    for rid, d in done.items():
        got = d.get("checksums")
        if got is None:
            continue  # not imported (recomputed or failed)
        want = exported.get(d["rid"], {}).get("checksums")
        if want is None or len(want) != len(got):
            bad.append(rid)  # an import with no export to match is a mismatch, not a pass
            differ += len(got)
            checked += len(got)
            continue
        n = sum(1 for a, b in zip(want, got) if a != b)
        checked += len(got)
        differ += n
        if n:
            bad.append(rid)
    return sorted(bad), checked, differ


def _spread(values: list[float], scale: float = 1.0) -> dict:
    if not values:
        return {}
    v = sorted(values)
    return {"min": round(v[0] * scale, 3), "median": round(v[len(v) // 2] * scale, 3),
            "max": round(v[-1] * scale, 3), "mean": round(statistics.mean(v) * scale, 3)}


def _report(o, requests, expected, done, stats, ttft, faults, wall_s, aggregated_s, *, resent: int,
            exported: dict[str, dict], aggregated: dict) -> Report:
    from hybridkv.descriptors.schemes import Scheme, Workload, count_descriptors
    from hybridkv.fencing import TransferOutcome

    from .model import model_config

    mismatched = sorted(rid for rid, _, _ in requests if done[rid]["output"] != expected[rid])
    failed = [rid for rid in done if done[rid]["status"] == "failed"]
    xfers = [d["transfer"] for d in done.values() if d["transfer"] and d["transfer"]["outcome"] == "ready"]
    desc = [x["descriptors"] for x in xfers if x["descriptors"] is not None]
    geometry = model_config(o.model).geometry()
    byte_bad, pages_checked, pages_bad = _byte_check(done, exported)
    vllm = [count_descriptors(Scheme.VLLM_033, Workload(geometry=geometry, tokens=len(p), block_size=16)).descriptors
            for rid, p, _ in requests]
    nbytes = sum(x["nbytes"] for x in xfers)
    secs = sum(x["seconds"] for x in xfers)
    gaps = [b - a for d in done.values() for a, b in zip(d["token_times"], d["token_times"][1:])]
    return Report(
        requests=len(requests), tokens=sum(len(d["output"]) for d in done.values()),
        mismatches=len(mismatched), mismatched=mismatched, failed=len(failed),
        recomputed=sum(1 for d in done.values() if d["recomputed"]), resent=resent,
        leaked_blocks=sum(s["leaked"] for s in stats.values()), processes=3, async_depth=o.async_depth,
        policy=o.policy, transport="nixl", faults_injected=sum(faults.values()), faults=faults,
        descriptors_per_request=statistics.mean(desc) if desc else 0.0,
        vllm_033_descriptors_per_request=statistics.mean(vllm), bytes_moved=nbytes,
        transfer_GBps=nbytes / secs / 1e9 if secs else 0.0,
        ttft_ms=statistics.mean(ttft.values()) * 1e3 if ttft else 0.0,
        itl_ms=statistics.mean(gaps) * 1e3 if gaps else 0.0, wall_s=wall_s, aggregated_s=aggregated_s,
        extra={"stats": stats, "failed_ids": sorted(failed),
               # imports whose completion came past their lease: not trusted, recomputed (rule 6)
               "late": sorted(rid for rid, d in done.items()
                              if d["transfer"] and d["transfer"]["error"] == f"transfer {TransferOutcome.LATE.value}"),
               "expected_lengths": {rid: len(expected[rid]) for rid, _, _ in requests},
               "byte_mismatched": byte_bad,
               "recomputed_ids": sorted(rid for rid, d in done.items() if d["recomputed"]),
               "errors": {rid: done[rid]["error"] for rid in sorted(failed)}},
        model=o.model, device=o.device if o.device == "cpu" else f"cuda {o.devices[0]},{o.devices[1]}",
        byte_mismatches=len(byte_bad), pages_checked=pages_checked, pages_mismatched=pages_bad,
        tokens_per_s=sum(len(d["output"]) for d in done.values()) / wall_s if wall_s else 0.0,
        aggregated={k: round(v, 3) if isinstance(v, float) else v for k, v in aggregated.items()},
        transfer_GBps_each=_spread([x["nbytes"] / x["seconds"] / 1e9 for x in xfers if x["seconds"] > 0]),
        fence_wait_ms=_spread([x.get("fence_wait_s", 0.0) for x in xfers], 1e3),
        steps_overlapped={name: f"{s.get('steps_ahead', 0)}/{s.get('steps_overlapped', 0)}/{s.get('steps_launched', 0)}"
                          for name, s in stats.items()},
    )
