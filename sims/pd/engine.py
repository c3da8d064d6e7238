"""Discrete-event simulation of disaggregated serving at one load (users or a request rate).

Flow of a request: it arrives (a closed-loop user's next request, or a Poisson arrival) -> a
prefill endpoint computes the prompt in chunked batches, holding the prompt's blocks from its
first chunk -> a decode rank takes blocks for the prompt (or it waits for them) -> the rank posts
the transfer (CPU in its step or its posting thread) -> the node's shared link moves it -> the
prefill side frees its blocks and the decode endpoint generates OSL tokens, one per step, taking
a block whenever the context passes a block boundary; when a rank has none left it preempts its
most recently joined request, which later recomputes its context on a decode rank.

Decode bookkeeping is O(1) per request per step event: a request that joins at step j (or
rejoins with g tokens made, as if it joined at j - g) finishes at step j + OSL - 1 and its context
at step k is ISL + (k - j); per rank we keep the count and the sum of ISL - j. Finish and growth
events are keyed by step, with an epoch per request so that a preemption voids its old ones.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict, deque
from dataclasses import dataclass, field

from .loop import Clock, Link, Stepper
from .params import Arrivals, PointResult, Scheduling, SimConfig


# Bounds of an open loop's default windows, in completions (see _PointSim).
OPEN_WARMUP_CAP = 8192
OPEN_MEASURE_CAP = 16384


class _Req:
    __slots__ = ("isl", "osl", "descriptors", "posted", "nbytes", "rank", "endpoint", "t_arrive", "t_started",
                 "t_prefilled", "t_admitted", "t_transferred", "t_first", "t_finish", "waited", "blocks",
                 "prefill_blocks", "join", "cover", "epoch", "made", "recompute", "posting_s", "preempted",
                 "prefill")

    def __init__(self, t: float, isl: int, osl: int, transfer: tuple[int, int], posted: int) -> None:
        self.t_arrive = t
        self.isl, self.osl = isl, osl
        # All of the rank's descriptors cross the link; one posting thread posts `posted` of them.
        self.descriptors, self.nbytes = transfer
        self.posted = posted
        self.rank = self.endpoint = self.prefill = -1
        self.t_started = self.t_prefilled = self.t_admitted = self.t_transferred = math.nan
        self.t_first = self.t_finish = math.nan
        self.waited = False
        self.blocks = self.prefill_blocks = 0
        self.join = self.cover = self.epoch = self.made = 0
        self.recompute = 0  # context tokens to compute again on decode after a preemption
        self.posting_s = 0.0
        self.preempted = 0


@dataclass
class _PrefillBatch:
    tokens: int
    context: float
    requests: int
    done: list[_Req]


class _Prefill(Stepper):
    def __init__(self, sim: _PointSim, index: int) -> None:
        super().__init__(sim.clock, sim.cfg.scheduling)
        self.sim = sim
        self.index = index
        spec = sim.cfg.prefill
        self.budget = spec.max_batched_tokens * spec.ranks
        self.ranks = spec.ranks
        self.cost_model = spec.cost
        self.free_blocks = spec.blocks_per_rank * spec.ranks
        # [request, tokens already scheduled]; chunks are scheduled FCFS.
        self.queue: deque[list] = deque()
        self.queued_tokens = 0

    def submit(self, req: _Req, t: float) -> None:
        self.queue.append([req, 0])
        self.queued_tokens += req.isl
        self.wake(t)

    def release(self, req: _Req, t: float) -> None:
        """The request's transfer has ended: its prompt blocks go back to the pool."""
        self.free_blocks += req.prefill_blocks
        req.prefill_blocks = 0
        if self.queue:
            self.wake(t)

    def take_batch(self, t: float) -> _PrefillBatch | None:
        left = self.budget
        tokens = 0
        context = 0.0
        requests = 0
        done: list[_Req] = []
        for entry in self.queue:
            if left <= 0:
                break
            req, scheduled = entry
            if scheduled == 0:
                # First chunk: the prompt's blocks, held until its transfer ends. FCFS: a request
                # that does not fit stops the ones behind it (vLLM's waiting queue does the same).
                need = self.sim.cfg.sizing.prefill_blocks(req.isl)
                if need > self.free_blocks:
                    break
                self.free_blocks -= need
                req.prefill_blocks = need
                req.t_started = t
            n = min(left, req.isl - scheduled)
            context += n * (scheduled + n / 2)
            tokens += n
            requests += 1
            left -= n
            entry[1] = scheduled + n
            if entry[1] == req.isl:
                done.append(req)
        if tokens == 0:
            return None
        for _ in done:
            self.queue.popleft()
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
    link: _Link
    running: dict[_Req, None] = field(default_factory=dict)  # join order: the last is preempted first
    isl_minus_join: int = 0
    to_post: list[_Req] = field(default_factory=list)
    post_free_at: float = 0.0
    recompute_tokens: int = 0
    recompute_pairs: float = 0.0


class _Decode(Stepper):
    def __init__(self, sim: _PointSim, index: int, links: list[Link]) -> None:
        super().__init__(sim.clock, sim.cfg.scheduling)
        self.sim = sim
        self.index = index
        spec = sim.cfg.decode
        self.cost_model = spec.cost
        self.ranks = [_Rank(free_blocks=spec.blocks_per_rank, link=links[i // spec.ranks_per_node])
                      for i in range(spec.ranks)]
        self.ready: list[_Req] = []
        self.step = 0
        self.finish_at: dict[int, list[tuple[_Req, int]]] = defaultdict(list)
        self.grow_at: dict[int, list[tuple[_Req, int]]] = defaultdict(list)
        self.deferred: list[_Req] = []
        self._cost = (0.0, 0.0)

    def landed(self, req: _Req, t: float) -> None:
        req.t_transferred = t
        self.ready.append(req)
        self.wake(t)

    def _post(self, t: float) -> float:
        """Post every rank's queued transfers in this step's CPU time; the step's posting is the
        busiest rank's (the ranks step together)."""
        most = 0.0
        posting = self.sim.cfg.posting
        for rank in self.ranks:
            spent = 0.0
            for req in rank.to_post:
                req.posting_s = posting.seconds(req.posted)
                spent += req.posting_s
                # The wire starts when this transfer's post returns, inside the step's CPU time.
                self.sim.clock.at(t + spent, lambda now, r=req, lk=rank.link: self.sim.start_wire(lk, r, now))
            rank.to_post = []
            most = max(most, spent)
        return most

    def _join(self, req: _Req, k: int) -> None:
        rank = self.ranks[req.rank]
        req.join = k - req.made
        rank.running[req] = None
        rank.isl_minus_join += req.isl - req.join
        self.finish_at[req.join + req.osl - 1].append((req, req.epoch))
        self._next_growth(req)

    def _next_growth(self, req: _Req) -> None:
        # The context after step k is isl + k - join + 1; it outgrows the blocks' cover at step
        # cover - isl + join.
        k = req.cover - req.isl + req.join
        if k <= req.join + req.osl - 1:
            self.grow_at[k].append((req, req.epoch))

    def _leave(self, req: _Req) -> None:
        rank = self.ranks[req.rank]
        del rank.running[req]
        rank.isl_minus_join -= req.isl - req.join

    def _grow(self, k: int) -> None:
        size = self.sim.cfg.sizing
        for req, epoch in self.grow_at.pop(k, []):
            if epoch != req.epoch:
                continue
            rank = self.ranks[req.rank]
            need = size.decode_blocks(req.cover + 1) - req.blocks
            while need > rank.free_blocks:
                victim = next(reversed(rank.running))
                self._preempt(victim, k)
                if victim is req:
                    break
            if req.epoch != epoch:
                continue
            rank.free_blocks -= need
            req.blocks += need
            req.cover += size.block_tokens
            self._next_growth(req)

    def _preempt(self, req: _Req, k: int) -> None:
        """Blocks ran out: the request gives all of its up and later computes its context again."""
        self._leave(req)
        req.epoch += 1
        req.made = k - req.join
        req.recompute = req.isl + req.made
        req.preempted += 1
        self.sim.preempted(req)
        self.ranks[req.rank].free_blocks += req.blocks
        req.blocks = 0
        self.sim.requeue(req)

    def take_batch(self, t: float) -> _DecodeBatch | None:
        k = self.step
        posting = self._post(t) if self.sim.cfg.posting.on_step else 0.0
        joined = self.ready
        self.ready = []
        for req in joined:
            self._join(req, k)
        self._grow(k)
        joined = [r for r in joined if r in self.ranks[r.rank].running]
        total = sum(len(r.running) for r in self.ranks)
        if total == 0:
            if posting == 0.0:
                return None
            # Nothing to decode, but the step loop still runs to post (vLLM's start_load_kv).
            self._cost = (posting, 0.0)
            return _DecodeBatch(step=k, requests=0, joined=[], finishing=[])
        # Ranks step together: the step costs what the busiest rank's work costs.
        cpu = device = 0.0
        for rank in self.ranks:
            n = len(rank.running)
            ctx = n * k + rank.isl_minus_join
            cpu = max(cpu, self.cost_model.cpu(n))
            device = max(device, self.cost_model.device(n, n, ctx) + self.sim.recompute_s(
                rank.recompute_tokens, rank.recompute_pairs))
            rank.recompute_tokens, rank.recompute_pairs = 0, 0.0
        finishing = [req for req, epoch in self.finish_at.pop(k, []) if epoch == req.epoch]
        for req in finishing:
            self._leave(req)
        self.step = k + 1
        self._cost = (cpu + posting, device)
        return _DecodeBatch(step=k, requests=total, joined=joined, finishing=finishing)

    def cost(self, batch: _DecodeBatch) -> tuple[float, float]:
        return self._cost

    def finish(self, batch: _DecodeBatch, t: float) -> None:
        self.sim.count_tokens(0, batch.requests)
        for req in batch.joined:
            if math.isnan(req.t_first):
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
            self.ranks[req.rank].free_blocks += req.blocks
            req.blocks = 0
        self.sim.retry_waiting(t)


@dataclass
class _Stats:
    prefill_tokens: int = 0
    output_tokens: int = 0
    reqs: list[_Req] = field(default_factory=list)
    waited: bool = False
    preemptions: int = 0


class _PointSim:
    def __init__(self, cfg: SimConfig, load: float, arrivals: Arrivals, seed: int) -> None:
        self.cfg = cfg
        self.load = load
        self.arrivals = arrivals
        self.seed = seed
        self.rng = random.Random(seed)
        self.clock = Clock()
        spec = cfg.decode
        nodes = -(-spec.ranks // spec.ranks_per_node)
        self.prefills = [_Prefill(self, i) for i in range(cfg.prefill.endpoints)]
        self.decodes = [_Decode(self, i, [Link(self.clock, cfg.link.latency_s, self.transferred) for _ in range(nodes)])
                        for i in range(spec.endpoints)]
        self.waiting: deque[_Req] = deque()
        self.completed = 0
        users = int(load) if arrivals is Arrivals.CLOSED else 0
        # Requests started together move in cohorts that dissolve slowly; short windows then
        # measure the phase of a wave, not the steady state.
        self.warmup = max(2 * users, 512) if cfg.warmup_requests is None else cfg.warmup_requests
        self.measure = max(4 * users, 2048) if cfg.measure_requests is None else cfg.measure_requests
        # An open loop has no user count to size its windows by: the requests in the system play that part,
        # and they take a request's whole life (1,024 steps at the seed) to build up. A fixed window would
        # measure the fill, whose growth reads as overload. So by default the window opens once the
        # completions reach twice the requests in the system (or OPEN_WARMUP_CAP, for a point so far past
        # capacity that they never do) and measures four times them (at most OPEN_MEASURE_CAP).
        self.size_warmup = arrivals is Arrivals.OPEN and cfg.warmup_requests is None
        self.size_measure = arrivals is Arrivals.OPEN and cfg.measure_requests is None
        self.window_open = self.warmup == 0
        self.t_open = 0.0
        self.t_close = math.nan
        self.in_system_at_open = self.in_system_at_close = 0
        self.in_system = 0
        self.stats = _Stats()
        block = cfg.sizing.block_tokens
        self._cover = lambda tokens: -(-tokens // block) * block  # noqa: E731

    # --- flow -------------------------------------------------------------------------
    def submit(self, t: float) -> None:
        traffic = self.cfg.traffic
        isl, osl = traffic.isl.draw(self.rng), traffic.osl.draw(self.rng)
        sizing = self.cfg.sizing
        req = _Req(t, isl, osl, sizing.transfer(isl), sizing.posted_descriptors(isl))
        self.in_system += 1
        # Route to the prefill endpoint with the least queued work (ties: lowest index).
        target = min(self.prefills, key=lambda p: p.queued_tokens)
        req.prefill = target.index
        target.submit(req, t)

    def _open_arrival(self, t: float) -> None:
        self.submit(t)
        self.clock.at(t + self.rng.expovariate(self.load), self._open_arrival)

    def requeue(self, req: _Req) -> None:
        """A preempted request goes back to the front of the queue, as vLLM's scheduler puts it.
        It is placed again only after the step being formed has taken the blocks it was preempted for."""
        self.waiting.appendleft(req)
        self.clock.at(self.clock.now, self.retry_waiting)

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
        tokens = req.recompute or req.isl
        need = self.cfg.sizing.decode_blocks(tokens)
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
        req.blocks = need
        req.cover = self._cover(tokens)
        req.rank = i
        req.endpoint = decode.index
        if req.recompute:
            # No transfer: the rank computes the context again in the step the request rejoins.
            rank.recompute_tokens += req.recompute
            rank.recompute_pairs += req.recompute * req.recompute / 2
            req.recompute = 0
            decode.ready.append(req)
            decode.wake(t)
            return True
        req.t_admitted = t
        posting = self.cfg.posting
        if posting.on_step:
            rank.to_post.append(req)
            decode.wake(t)
        else:
            req.posting_s = posting.seconds(req.posted)
            rank.post_free_at = max(t, rank.post_free_at) + req.posting_s
            self.clock.at(rank.post_free_at, lambda now: self.start_wire(rank.link, req, now))
        return True

    def start_wire(self, link: Link, req: _Req, t: float) -> None:
        link.start(req, t, self.cfg.link.work_s(req.descriptors, req.nbytes))

    def transferred(self, req: _Req, t: float) -> None:
        self.prefills[req.prefill].release(req, t)
        self.decodes[req.endpoint].landed(req, t)

    def recompute_s(self, tokens: int, pairs: float) -> float:
        if not tokens:
            return 0.0
        # Same model, same GPU: the prefill step's per-token and per-pair device cost.
        cost = self.cfg.prefill.cost
        return cost.device_per_token_s * tokens + cost.device_per_context_token_s * pairs

    def preempted(self, req: _Req) -> None:
        if self.window_open and math.isnan(self.t_close):
            self.stats.preemptions += 1

    def complete(self, req: _Req, t: float) -> None:
        self.completed += 1
        self.in_system -= 1
        if self.window_open:
            if math.isnan(self.t_close):
                self.stats.reqs.append(req)
                if len(self.stats.reqs) >= self.measure:
                    self.t_close = t
                    self.in_system_at_close = self.in_system
        elif self.completed >= self.warmup and (
                not self.size_warmup or self.completed >= min(2 * self.in_system, OPEN_WARMUP_CAP)):
            if self.size_measure:
                self.measure = min(max(4 * self.in_system, self.measure), OPEN_MEASURE_CAP)
            self.window_open = True
            self.t_open = t
            self.in_system_at_open = self.in_system
        if self.arrivals is Arrivals.CLOSED:
            self.submit(t)

    def count_tokens(self, prefill: int, output: int) -> None:
        if self.window_open and math.isnan(self.t_close):
            self.stats.prefill_tokens += prefill
            self.stats.output_tokens += output

    # --- run --------------------------------------------------------------------------
    def run(self) -> PointResult:
        if self.arrivals is Arrivals.CLOSED:
            ramp = self.cfg.traffic.ramp_s
            for _ in range(int(self.load)):
                self.clock.at(self.rng.uniform(0.0, ramp) if ramp > 0 else 0.0, self.submit)
        else:
            self.clock.at(self.rng.expovariate(self.load), self._open_arrival)
        self.clock.run(stop=lambda: not math.isnan(self.t_close))
        if math.isnan(self.t_close):
            raise RuntimeError("simulation ran out of events before the measurement window closed")
        return self._result()

    def _result(self) -> PointResult:
        window = self.t_close - self.t_open
        if not window > 0:
            raise ValueError(f"measurement window is {window} s long: the costs are degenerate")
        reqs = self.stats.reqs
        n = len(reqs)
        ttft = sum(r.t_first - r.t_arrive for r in reqs) / n
        itl = sum((r.t_finish - r.t_first) / (r.osl - 1) for r in reqs) / n
        xfer = sum(r.t_transferred - r.t_admitted for r in reqs) / n
        post = sum(r.posting_s for r in reqs) / n
        wait = sum(r.t_admitted - r.t_prefilled for r in reqs) / n
        pwait = sum(r.t_started - r.t_arrive for r in reqs) / n
        gpus = self.cfg.total_gpus
        total = (self.stats.prefill_tokens + self.stats.output_tokens) / window / gpus
        return PointResult(
            load=self.load, arrivals=self.arrivals, seed=self.seed,
            tokens_per_s_per_gpu=total,
            output_tokens_per_s_per_gpu=self.stats.output_tokens / window / gpus,
            tokens_per_s_per_user=1.0 / itl,
            ttft_s=ttft, itl_s=itl, transfer_s=xfer, posting_s=post,
            transfer_share=xfer / ttft if ttft > 0 else 0.0,
            decode_wait_s=wait, prefill_wait_s=pwait, preemptions=self.stats.preemptions,
            capacity_bound=self.stats.waited, completed=n,
            backlog_growth=self.in_system_at_close - self.in_system_at_open,
        )


def simulate_point(cfg: SimConfig, load: float, *, arrivals: Arrivals = Arrivals.CLOSED,
                   seed: int = 0) -> PointResult:
    """Steady-state figures of `load` closed-loop users (each submitting its next request as
    soon as the previous one finishes) or of Poisson arrivals at `load` requests per second."""
    if arrivals is Arrivals.CLOSED:
        if not isinstance(load, int) or isinstance(load, bool) or load < 1:
            raise ValueError(f"concurrency={load!r}: expected an integer >= 1")
    elif isinstance(load, bool) or not isinstance(load, (int, float)) or not math.isfinite(load) or load <= 0:
        raise ValueError(f"request_rate={load!r}: expected a finite number of requests per second > 0")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r}: expected an integer")
    return _PointSim(cfg, load, arrivals, seed).run()
