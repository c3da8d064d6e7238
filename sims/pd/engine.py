"""Discrete-event simulation of disaggregated serving at one closed-loop concurrency.

Flow of a request: a user submits it -> a prefill endpoint computes the prompt in chunked
batches -> a decode rank reserves blocks for its whole life (or it waits for them) -> that
rank's link pulls the cache -> the decode endpoint generates OSL tokens, one per step ->
the blocks are freed and the user submits the next request at once.

Decode bookkeeping is O(1) per step: every running request advances one token per step,
so a request that joins at step j finishes at step j + OSL - 1 and its context at step k is
ISL + (k - j); per rank we keep the count and the sum of join steps.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .params import PointResult, Scheduling, SimConfig

Event = Callable[[float], None]


class _Req:
    __slots__ = ("rank", "endpoint", "t_arrive", "t_prefilled", "t_admitted", "t_transferred",
                 "t_first", "t_finish", "waited")

    def __init__(self, t: float) -> None:
        self.t_arrive = t
        self.rank = -1
        self.endpoint = -1
        self.t_prefilled = self.t_admitted = self.t_transferred = math.nan
        self.t_first = self.t_finish = math.nan
        self.waited = False


class _Clock:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = 0
        self.now = 0.0

    def at(self, t: float, event: Event) -> None:
        if t < self.now:
            raise RuntimeError(f"event scheduled in the past: {t} < {self.now}")
        # seq breaks ties in scheduling order: a step's completion, scheduled when the
        # step was formed, runs before a later formation at the same instant.
        heapq.heappush(self._heap, (t, self._seq, event))
        self._seq += 1

    def run(self, stop: Callable[[], bool]) -> None:
        while self._heap and not stop():
            t, _, event = heapq.heappop(self._heap)
            self.now = t
            event(t)


class _Stepper:
    """A step loop: form a batch, spend CPU time, then device time.

    SYNC forms the next step when this one's output is processed. ASYNC forms it as soon
    as this step is on the device, so at most one step is prepared ahead (one step of
    overlap); the next device phase starts when both its CPU work and this step are done.
    """

    def __init__(self, clock: _Clock, scheduling: Scheduling) -> None:
        self.clock = clock
        self.scheduling = scheduling
        self.device_free_at = 0.0
        self.active = False

    def wake(self, t: float) -> None:
        if not self.active:
            self.active = True
            self.clock.at(t, self._form)

    def _form(self, t: float) -> None:
        batch = self.take_batch(t)
        if batch is None:
            self.active = False
            self.on_idle(t)
            return
        cpu, device = self.cost(batch)
        start = max(t + cpu, self.device_free_at)
        end = start + device
        self.device_free_at = end
        if self.scheduling is Scheduling.ASYNC:
            self.clock.at(end, lambda now: self.finish(batch, now))
            self.clock.at(start, self._form)
        else:
            def done(now: float) -> None:
                self.finish(batch, now)
                self._form(now)
            self.clock.at(end, done)

    def take_batch(self, t: float):  # pragma: no cover - abstract
        raise NotImplementedError

    def cost(self, batch) -> tuple[float, float]:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish(self, batch, t: float) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_idle(self, t: float) -> None:
        pass


@dataclass
class _PrefillBatch:
    tokens: int
    context: float
    requests: int
    done: list[_Req]


class _Prefill(_Stepper):
    def __init__(self, sim: _PointSim, index: int) -> None:
        super().__init__(sim.clock, sim.cfg.scheduling)
        self.sim = sim
        self.index = index
        spec = sim.cfg.prefill
        self.budget = spec.max_batched_tokens * spec.ranks
        self.ranks = spec.ranks
        self.cost_model = spec.cost
        # [request, tokens already scheduled]; chunks are scheduled FCFS.
        self.queue: deque[list] = deque()
        self.queued_tokens = 0

    def submit(self, req: _Req, t: float) -> None:
        self.queue.append([req, 0])
        self.queued_tokens += self.sim.cfg.request.isl
        self.wake(t)

    def take_batch(self, t: float) -> _PrefillBatch | None:
        isl = self.sim.cfg.request.isl
        left = self.budget
        tokens = 0
        context = 0.0
        requests = 0
        done: list[_Req] = []
        while left > 0 and self.queue:
            entry = self.queue[0]
            req, scheduled = entry
            n = min(left, isl - scheduled)
            context += n * (scheduled + n / 2)
            tokens += n
            requests += 1
            left -= n
            entry[1] = scheduled + n
            if entry[1] == isl:
                self.queue.popleft()
                done.append(req)
        if tokens == 0:
            return None
        self.queued_tokens -= tokens
        return _PrefillBatch(tokens=tokens, context=context, requests=requests, done=done)

    def cost(self, batch: _PrefillBatch) -> tuple[float, float]:
        r = self.ranks
        return (self.cost_model.cpu(batch.requests / r),
                self.cost_model.device(batch.requests / r, batch.tokens / r, batch.context / r))

    def finish(self, batch: _PrefillBatch, t: float) -> None:
        self.sim.count_tokens(batch.tokens, 0)
        for req in batch.done:
            req.t_prefilled = t
            self.sim.decode_admit(req, t)


@dataclass
class _DecodeBatch:
    step: int
    requests: int
    joined: list[_Req]
    finishing: list[_Req]


@dataclass
class _Rank:
    free_blocks: int
    running: int = 0
    join_sum: int = 0
    link_free_at: float = 0.0
    posting_cpu_s: float = 0.0


class _Decode(_Stepper):
    def __init__(self, sim: _PointSim, index: int) -> None:
        super().__init__(sim.clock, sim.cfg.scheduling)
        self.sim = sim
        self.index = index
        spec = sim.cfg.decode
        self.cost_model = spec.cost
        self.ranks = [_Rank(free_blocks=spec.blocks_per_rank) for _ in range(spec.ranks)]
        self.ready: list[_Req] = []
        self.step = 0
        self.last_step: dict[int, list[_Req]] = defaultdict(list)
        self.deferred: list[_Req] = []
        self.ctx_cache: list[float] = [0.0] * spec.ranks

    def free_blocks(self) -> int:
        return sum(r.free_blocks for r in self.ranks)

    def transferred(self, req: _Req, t: float) -> None:
        req.t_transferred = t
        self.ready.append(req)
        self.wake(t)

    def take_batch(self, t: float) -> _DecodeBatch | None:
        k = self.step
        joined = self.ready
        self.ready = []
        for req in joined:
            rank = self.ranks[req.rank]
            rank.running += 1
            rank.join_sum += k
            self.last_step[k + self.sim.cfg.request.osl - 1].append(req)
        total = sum(r.running for r in self.ranks)
        if total == 0:
            # Posting done while the endpoint idled delayed no step.
            for rank in self.ranks:
                rank.posting_cpu_s = 0.0
            return None
        isl = self.sim.cfg.request.isl
        # Ranks step together: the step costs what the busiest rank's work costs.
        cpu = device = 0.0
        for rank in self.ranks:
            ctx = rank.running * (isl + k) - rank.join_sum
            cpu = max(cpu, self.cost_model.cpu(rank.running) + rank.posting_cpu_s)
            rank.posting_cpu_s = 0.0
            device = max(device, self.cost_model.device(rank.running, rank.running, ctx))
        finishing = self.last_step.pop(k, [])
        for req in finishing:
            rank = self.ranks[req.rank]
            rank.running -= 1
            rank.join_sum -= k - self.sim.cfg.request.osl + 1
        self.step = k + 1
        batch = _DecodeBatch(step=k, requests=total, joined=joined, finishing=finishing)
        self._cost = (cpu, device)
        return batch

    def cost(self, batch: _DecodeBatch) -> tuple[float, float]:
        return self._cost

    def finish(self, batch: _DecodeBatch, t: float) -> None:
        self.sim.count_tokens(0, batch.requests)
        for req in batch.joined:
            req.t_first = t
        if self.scheduling is Scheduling.ASYNC:
            # Blocks of a request that finished are reused only after the step that was
            # already in flight has completed too (vLLM #45357's deferred free).
            self._free(self.deferred, t)
            self.deferred = []
        for req in batch.finishing:
            req.t_finish = t
            self.sim.complete(req, t)
        if self.scheduling is Scheduling.ASYNC and self.active:
            self.deferred = list(batch.finishing)
        else:
            # No step is in flight behind this one: nothing can still touch the blocks.
            self._free(batch.finishing, t)

    def on_idle(self, t: float) -> None:
        self._free(self.deferred, t)
        self.deferred = []

    def _free(self, reqs: list[_Req], t: float) -> None:
        if not reqs:
            return
        for req in reqs:
            self.ranks[req.rank].free_blocks += self.sim.cfg.request.decode_blocks
        self.sim.retry_waiting(t)


@dataclass
class _Stats:
    prefill_tokens: int = 0
    output_tokens: int = 0
    reqs: list[_Req] = field(default_factory=list)
    waited: bool = False


class _PointSim:
    def __init__(self, cfg: SimConfig, concurrency: int) -> None:
        self.cfg = cfg
        self.concurrency = concurrency
        self.clock = _Clock()
        self.prefills = [_Prefill(self, i) for i in range(cfg.prefill.endpoints)]
        self.decodes = [_Decode(self, i) for i in range(cfg.decode.endpoints)]
        self.waiting: deque[_Req] = deque()
        self.completed = 0
        # Identical requests started together move in cohorts that dissolve slowly; short
        # windows then measure the phase of a wave, not the steady state.
        self.warmup = max(2 * concurrency, 512) if cfg.warmup_requests is None else cfg.warmup_requests
        self.measure = max(4 * concurrency, 2048) if cfg.measure_requests is None else cfg.measure_requests
        self.window_open = self.warmup == 0
        self.t_open = 0.0
        self.t_close = math.nan
        self.stats = _Stats()

    # --- flow -------------------------------------------------------------------------
    def submit(self, t: float) -> None:
        req = _Req(t)
        # Route to the prefill endpoint with the least queued work (ties: lowest index).
        target = min(self.prefills, key=lambda p: p.queued_tokens)
        req.endpoint = target.index
        target.submit(req, t)

    def decode_admit(self, req: _Req, t: float) -> None:
        if self.waiting or not self._try_place(req, t):
            req.waited = True
            if self.window_open:
                self.stats.waited = True
            self.waiting.append(req)

    def retry_waiting(self, t: float) -> None:
        while self.waiting and self._try_place(self.waiting[0], t):
            self.waiting.popleft()

    def _try_place(self, req: _Req, t: float) -> bool:
        need = self.cfg.request.decode_blocks
        best: tuple[int, _Decode, int] | None = None
        for decode in self.decodes:
            for i, rank in enumerate(decode.ranks):
                if rank.free_blocks >= need and (best is None or rank.free_blocks > best[0]):
                    best = (rank.free_blocks, decode, i)
        if best is None:
            return False
        _, decode, i = best
        rank = decode.ranks[i]
        rank.free_blocks -= need
        req.rank = i
        req.t_admitted = t
        start = max(t, rank.link_free_at)
        end = start + self.cfg.transfer_s
        rank.link_free_at = end
        link = self.cfg.link
        if link.posting_on_step:
            rank.posting_cpu_s += link.posting_s(self.cfg.request.transfer_descriptors)
        self.clock.at(end, lambda now: decode.transferred(req, now))
        return True

    def complete(self, req: _Req, t: float) -> None:
        self.completed += 1
        if self.window_open:
            self.stats.reqs.append(req)
            if len(self.stats.reqs) >= self.measure:
                self.t_close = t
        elif self.completed >= self.warmup:
            self.window_open = True
            self.t_open = t
        self.submit(t)

    def count_tokens(self, prefill: int, output: int) -> None:
        if self.window_open and math.isnan(self.t_close):
            self.stats.prefill_tokens += prefill
            self.stats.output_tokens += output

    # --- run --------------------------------------------------------------------------
    def run(self) -> PointResult:
        for _ in range(self.concurrency):
            self.submit(0.0)
        self.clock.run(stop=lambda: not math.isnan(self.t_close))
        if math.isnan(self.t_close):
            raise RuntimeError("simulation ran out of events before the measurement window closed")
        return self._result()

    def _result(self) -> PointResult:
        cfg = self.cfg
        window = self.t_close - self.t_open
        if window <= 0:
            raise ValueError(
                f"measurement window is {window} s long: every cost is zero, so throughput is unbounded")
        reqs = self.stats.reqs
        n = len(reqs)
        ttft = sum(r.t_first - r.t_arrive for r in reqs) / n
        itl = sum((r.t_finish - r.t_first) / (cfg.request.osl - 1) for r in reqs) / n
        xfer = sum(r.t_transferred - r.t_admitted for r in reqs) / n
        wait = sum(r.t_admitted - r.t_prefilled for r in reqs) / n
        gpus = cfg.total_gpus
        total = (self.stats.prefill_tokens + self.stats.output_tokens) / window / gpus
        return PointResult(
            concurrency=self.concurrency,
            tokens_per_s_per_gpu=total,
            output_tokens_per_s_per_gpu=self.stats.output_tokens / window / gpus,
            tokens_per_s_per_user=1.0 / itl if itl > 0 else math.inf,
            ttft_s=ttft,
            itl_s=itl,
            transfer_s=xfer,
            transfer_share=xfer / ttft if ttft > 0 else 0.0,
            decode_wait_s=wait,
            capacity_bound=self.stats.waited,
            completed=n,
        )


def simulate_point(cfg: SimConfig, concurrency: int) -> PointResult:
    """Steady-state figures of `concurrency` users, each submitting a new request as soon
    as its previous one finishes."""
    if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
        raise ValueError(f"concurrency={concurrency!r}: expected an integer >= 1")
    return _PointSim(cfg, concurrency).run()
