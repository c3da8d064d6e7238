"""The reference engine: chunked prefill, decode, and asynchronous scheduling over hybridkv.

The scheduler runs `async_depth` steps ahead of the worker, as vLLM's
`--async-scheduling` does: step N+1 is planned before step N's tokens are known, a
request that stops at step N (its stop condition is only seen in N's output) is
still computed once more by step N+1, and newly allocated attention blocks are
zeroed by the first step that follows their allocation (vLLM #35219). So the races
hybridkv fences against are live here: the fence table decides when a freed block
may be reused (Race A), when an import may write a block a queued zeroing will
touch (Race B), and when an export may read what a step wrote.

On a GPU the worker is asynchronous too: a step is enqueued on the engine's compute stream
and step k+1 is enqueued before step k's tokens are back (its decode inputs are step k's
outputs on the device); a step completes, for the fences, when its CUDA event has fired,
so a NIXL import into VRAM races the kernels still queued ahead of it.

The engine talks to hybridkv only through what every connector uses: the planned
layout, `TransferScheduler`, and the producer/consumer endpoints (given as callables
so this module also runs without a peer, as the aggregated baseline).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

import torch

from hybridkv.fencing import NotYet, TransferScheduler, scheduler_inputs

from .cache import PagedCache
from .model import TinyHybridModel
from .records import Checksums, Entry, EngineConfig, Exporter, Fetcher, Launched, Request, Role, Status, StepPlan

# Re-exported: callers name the engine's config and role from here.
__all__ = ["Engine", "EngineConfig", "Role", "Status", "Request"]


class Engine:
    def __init__(self, model: TinyHybridModel, cfg: EngineConfig, *, fetcher: Fetcher | None = None,
                 exporter: Exporter | None = None, on_first_token=None, on_finished=None) -> None:
        if cfg.async_depth < 0:
            raise ValueError(f"async_depth must be >= 0, got {cfg.async_depth}")
        self.model, self.cfg = model, cfg
        self.device = torch.device(cfg.device)
        self.cache = PagedCache(model.cfg.geometry(), cfg.cache, device=cfg.device)
        self.stream = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)
            # The pools and the weights were made on the default stream; the compute stream starts after them.
            torch.cuda.synchronize(self.device)
        layout = self.cache.layout
        self.attn_gid = self.cache.attn_group.group_id
        self.gdn_gid = self.cache.gdn_group.group_id
        inputs = scheduler_inputs(layout)
        self.sched = TransferScheduler(inputs.pools, policy=cfg.policy, lease_s=cfg.lease_s)
        self.components = inputs.components
        self.fetcher, self.exporter = fetcher, exporter
        self.on_first_token, self.on_finished = on_first_token, on_finished
        self.requests: dict[str, Request] = {}
        self.waiting: deque[str] = deque()
        self.running: list[str] = []
        self.queue: deque[StepPlan] = deque()
        self.pending_zero: list[int] = []
        self.step = 0
        self.tasks: set[asyncio.Task] = set()
        self.skipped_zeroing = 0
        self._fresh_imports: list[Request] = []
        self.launched: deque[Launched] = deque()
        self._last_token: dict[str, torch.Tensor] = {}  # a request's newest token, on the device
        self.steps_launched = 0
        self.steps_ahead = 0  # enqueued before the previous step's results were taken back
        self.steps_overlapped = 0  # enqueued while the previous step was still running on the device
        self.step_seconds: list[float] = []  # launch -> results back, per step

    # ------------------------------------------------------------------ intake
    def submit(self, rid: str, prompt: list[int], max_tokens: int, *, first_token: int | None = None) -> None:
        if rid in self.requests:
            raise ValueError(f"request {rid!r} already submitted")
        if not prompt or max_tokens < 1:
            raise ValueError(f"request {rid!r}: prompt must be non-empty and max_tokens >= 1, got "
                             f"{len(prompt)} tokens, max_tokens {max_tokens}")
        r = Request(rid=rid, prompt=list(prompt), max_tokens=max_tokens, arrived_s=time.perf_counter())
        if self.cfg.role is Role.DECODE:
            if first_token is None:
                raise ValueError(f"request {rid!r}: a decode instance needs the prefill's first token")
            r.output.append(first_token)
        self.requests[rid] = r
        self.waiting.append(rid)

    @property
    def busy(self) -> bool:
        # An import that landed between steps leaves its request RUNNING but not yet joined:
        # that is work too (missing it once left a decode engine idle with 4 landed requests).
        return bool(self.queue or self.launched or self.tasks or self._has_work() or any(
            r.status is Status.IMPORTING for r in self.requests.values()))

    # --------------------------------------------------------------- admission
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.cache.block_size)

    def _grow(self, r: Request, upto: int) -> None:
        """Blocks for positions < upto, allocated as the request grows (as vLLM does); new
        blocks are zeroed by the next step. No preemption here: running dry is an error."""
        need = self._blocks_for(upto) - len(r.attn_blocks)
        if need <= 0:
            return
        more = self.sched.allocate(r.rid, self.attn_gid, need)
        if isinstance(more, NotYet):
            raise RuntimeError(f"attention pool exhausted growing {r.rid!r} ({more}); the reference engine "
                               "does not preempt: give it more attention_blocks")
        r.attn_blocks.extend(more)
        self.pending_zero.extend(more)

    def _admit(self) -> list[str]:
        """Give blocks to waiting requests (all or none). Returns the local ones that may join now."""
        joined = []
        while self.waiting and len(self.running) + self._importing() < self.cfg.max_running:
            rid = self.waiting[0]
            r = self.requests[rid]
            remote = self.cfg.role is Role.DECODE and not r.recompute
            self.sched.add_request(rid, expect=self.components if remote else ())
            attn = self.sched.allocate(rid, self.attn_gid, self._blocks_for(len(r.prompt)))
            slot = attn if isinstance(attn, NotYet) else self.sched.allocate(rid, self.gdn_gid, 1)
            if isinstance(slot, NotYet):  # attn's NotYet, or slot's own
                self.sched.abort(rid)  # all or none: give back what was taken
                break
            self.waiting.popleft()
            r.attn_blocks, r.slot = list(attn), slot[0]
            # Stale bits of a reused page must not leak into a new request (vLLM #35219).
            self.pending_zero.extend(r.attn_blocks)
            if remote:
                r.status = Status.IMPORTING
                self._fresh_imports.append(r)
                self._spawn(self._import(r))
            else:
                joined.append(rid)
        return joined

    def _importing(self) -> int:
        return sum(1 for r in self.requests.values() if r.status is Status.IMPORTING)

    async def _import(self, r: Request) -> None:
        from hybridkv.transport.endpoint import Outcome

        try:
            result = await self.fetcher(r.rid, self.components)
        except Exception as exc:  # a broken fetcher fails its request; it must not leave it importing
            r.import_result = None
            r.status, r.error = Status.FAILED, f"fetcher raised {type(exc).__name__}: {exc}"
            self._finish(r, failed=True)
            return
        r.import_result = result
        if result.outcome is Outcome.READY:
            r.status = Status.RUNNING
            r.imported = (list(r.attn_blocks), r.slot)
            r.scheduled = len(r.prompt)  # the prompt's KV and state arrived
        elif result.outcome is Outcome.RECOMPUTE:
            r.recompute, r.status = True, Status.RUNNING  # prefill here; the scheduler made it local
        else:
            r.status, r.error = Status.FAILED, result.error
            self._finish(r, failed=True)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -------------------------------------------------------------- scheduling
    def _schedule(self) -> None:
        self.step += 1
        joined = self._admit()
        for r in self.requests.values():
            if r.status is Status.RUNNING and not r.joined and r.rid not in joined and self.sched.is_ready(r.rid):
                joined.append(r.rid)
        entries = []
        for rid in joined:
            r = self.requests[rid]
            r.joined, r.status = True, Status.RUNNING
            self.running.append(rid)
        keep = []
        for rid in self.running:
            r = self.requests[rid]
            if not r.prefill_done:
                n = min(self.cfg.chunk_size, len(r.prompt) - r.scheduled)
                entries.append(Entry(rid=rid, start=r.scheduled, n=n, prefill=True))
                r.scheduled += n
                # A prefill-only instance knows the request ends with its prompt (max_tokens 1):
                # it is never scheduled again, so nothing overwrites what it will export.
                if r.prefill_done and self.cfg.role is Role.PREFILL:
                    continue
            else:
                self._grow(r, r.scheduled + 1)
                entries.append(Entry(rid=rid, start=r.scheduled, n=1, prefill=False))
                r.scheduled += 1
            keep.append(rid)
        self.running = keep
        zero = [(self.attn_gid, b) for b in self.pending_zero]
        self.pending_zero = []
        ticket = self.sched.step_scheduled(self.step, joined=joined, zeroing=zero)
        skip = {b for _, b in ticket.skip_zeroing}
        self.skipped_zeroing += len(skip)
        self.queue.append(StepPlan(step=self.step, entries=entries, zero_blocks=[b for _, b in zero if b not in skip]))

    # ---------------------------------------------------------------- the loop
    async def run_step(self) -> bool:
        """Plan ahead, let transfers progress, launch the oldest planned step and take back the
        launched steps whose results are in. False when idle."""
        in_flight = self.sched.transfers_in_flight()
        while len(self.queue) <= self.cfg.async_depth and self._has_work():
            self._schedule()
        await asyncio.sleep(self.cfg.step_gap_s)
        # vLLM's worker starts a request's load at the start of the step after its blocks were
        # allocated: give the imports admitted just now the chance to post before that step runs
        # (a fenced import is told "not yet" and waits for the step instead).
        t_end = time.monotonic() + self.cfg.import_launch_s
        while self._fresh_imports and time.monotonic() < t_end:
            if self.sched.transfers_in_flight() >= in_flight + len(self._fresh_imports) or all(
                    r.status is not Status.IMPORTING for r in self._fresh_imports):
                break
            await asyncio.sleep(0.0005)
        self._fresh_imports.clear()
        t_end = time.monotonic() + self.cfg.settle_transfers_s
        while self.sched.transfers_in_flight() and time.monotonic() < t_end:
            await asyncio.sleep(0.0005)
        if self.queue:
            self.launched.append(self._launch(self.queue.popleft()))
            ahead = self.cfg.async_depth if self.stream is not None else 0
        elif not self.launched:
            return self.busy
        else:
            ahead = 0  # nothing more to enqueue: take what the stream holds
        await self._collect(ahead)
        return True

    def _has_work(self) -> bool:
        return bool(self.running or self.waiting or any(
            r.status is Status.RUNNING and not r.joined for r in self.requests.values()))

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _to_device(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.int64)
        if self.stream is None:
            return t
        # Pinned, so the copy is queued behind the stream's work instead of waiting for it.
        return t.pin_memory().to(self.device, non_blocking=True)

    def _to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        if self.stream is None:
            return t, None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.stream)
        return host, event

    def checksums(self, blocks: list[int], slot: int) -> Checksums:
        """Enqueue checksums of these pages behind everything on the compute stream (so they see
        what the steps before them wrote and nothing a later step writes)."""
        with self._on_stream():
            host, event = self._to_host(self.cache.checksums(blocks, slot))
        return Checksums(host=host, event=event)

    @staticmethod
    async def wait_for(sums: Checksums) -> list[int]:
        while not sums.ready():
            await asyncio.sleep(0.0002)
        return sums.values()

    def _launch(self, plan: StepPlan) -> Launched:
        """The worker: enqueues whatever was planned, finished requests included (it cannot know)."""
        if self.launched:
            self.steps_ahead += 1  # the previous step's results were not taken back yet
        if any(not x.done() for x in self.launched):
            self.steps_overlapped += 1  # ... and its kernels were still running
        self.steps_launched += 1
        t0 = time.perf_counter()
        with self._on_stream():
            self.cache.zero_blocks(plan.zero_blocks)
            out = []
            for e in plan.entries:
                r = self.requests[e.rid]
                if r.imported is not None and r.import_check is None:
                    # The imported bytes as the first step that reads them will find them.
                    r.import_check = self.checksums(*r.imported)
                if e.prefill:
                    tokens = self._to_device(r.prompt[e.start: e.start + e.n])
                else:
                    tokens = self._last_token.get(r.rid)
                    if tokens is None:  # the prefill's first token, from the host
                        tokens = self._to_device([r.output[-1]])
                table = self.cache.block_table(r.attn_blocks)
                kv = {layer: self.cache.kv_view(layer, table) for layer in self.cache.attn_layer}
                st = {layer: self.cache.state_view(layer, r.slot) for layer in self.cache.gdn_layer}
                tok = self.model.forward(tokens, e.start, kv, st)
                # The token the next decode step reads, where `_process` will take it as an output.
                if not e.prefill or (e.start + e.n >= len(r.prompt) and not (r.recompute and r.output)):
                    self._last_token[r.rid] = tok
                out.append(tok)
            tokens = torch.cat(out) if out else torch.empty(0, dtype=torch.int64, device=self.device)
            host, event = self._to_host(tokens)
        return Launched(plan=plan, host=host, event=event, launched_s=t0)

    async def _collect(self, ahead: int) -> None:
        """Take back every step whose results are in, and wait for the oldest while more than
        `ahead` are still running. Only now is a step completed for the fences."""
        while self.launched and (self.launched[0].done() or len(self.launched) > ahead):
            step = self.launched[0]
            while not step.done():
                await asyncio.sleep(0.0002)  # transfers and the endpoint progress meanwhile
            self.launched.popleft()
            self.step_seconds.append(time.perf_counter() - step.launched_s)
            self.sched.step_completed(step.plan.step)
            self.sched.poll()  # once per step: lapsed export leases give their blocks back
            self._process(step.plan, [int(x) for x in step.host.tolist()])

    def _process(self, plan: StepPlan, outputs: list[int]) -> None:
        now = time.perf_counter()
        for e, tok in zip(plan.entries, outputs):
            r = self.requests[e.rid]
            if r.status is not Status.RUNNING:
                continue  # an overshoot step of a finished request: its output is discarded
            if e.prefill and e.start + e.n < len(r.prompt):
                continue
            if e.prefill and r.recompute and r.output:
                continue  # recomputed prompt of an import: its first token came from the prefill
            r.output.append(tok)
            r.token_times.append(now)
            if e.prefill and self.on_first_token is not None:
                self.on_first_token(r)
            if self.cfg.role is Role.PREFILL or len(r.output) >= r.max_tokens:
                self._finish(r)

    def _finish(self, r: Request, *, failed: bool = False) -> None:
        if r.status is not Status.FAILED:
            r.status = Status.FINISHED
        if r.rid in self.running:
            self.running.remove(r.rid)
        self._last_token.pop(r.rid, None)
        if self.cfg.role is Role.PREFILL and not failed:
            # Enqueued before the pages can be handed to anyone else (fenced or not), behind the
            # steps that wrote them: what the export should deliver.
            r.export_check = self.checksums(list(r.attn_blocks), r.slot)
            self.sched.request_finished(r.rid, export=True)
            if self.exporter is not None:
                self._spawn(self.exporter(r.rid))
        elif self.sched.has_request(r.rid):
            if failed:
                self.sched.abort(r.rid)
            else:
                self.sched.request_finished(r.rid)
        if self.on_finished is not None:
            self.on_finished(r)

    async def drain(self, timeout_s: float = 60.0) -> None:
        """Run until every request is done and every transfer settled, then let the watermark
        pass the last scheduled step so deferred frees return to the pool."""
        t0 = time.monotonic()
        while self.busy:
            await self.run_step()
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"engine still busy after {timeout_s} s: {self.stats()}")
        # Idle steps: nothing planned, but they carry the watermark past deferred frees.
        self.step += 1
        self.sched.step_scheduled(self.step)
        self.sched.step_completed(self.step)
        # Exports abandoned by a lost consumer keep their blocks until the lease lapses.
        while self.sched.requests_in_flight():
            self.sched.poll()
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"requests still held after {timeout_s} s: {self.stats()}")
            await asyncio.sleep(0.01)

    def stats(self) -> dict:
        pools = self.sched.layout.pool_sizes
        return {
            "step": self.step, "watermark": self.sched.watermark,
            "free": [self.sched.free_count(p) for p in range(len(pools))], "total": list(pools),
            "requests_in_flight": self.sched.requests_in_flight(),
            "transfers_in_flight": self.sched.transfers_in_flight(), "skipped_zeroing": self.skipped_zeroing,
        }

    def describe(self) -> dict:
        """Every request's status and the queue: what a stuck run prints."""
        return {**self.stats(), "queue": [p.step for p in self.queue], "tasks": len(self.tasks),
                "waiting": list(self.waiting), "running": list(self.running),
                "requests": {r.rid: f"{r.status.value} scheduled={r.scheduled}/{len(r.prompt)} out={len(r.output)}"
                             for r in self.requests.values() if r.status not in (Status.FINISHED, Status.FAILED)}}

    def leaked_blocks(self) -> int:
        """Blocks neither free nor held by a live request (call after drain)."""
        s = self.stats()
        return sum(s["total"]) - sum(s["free"])
