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
from collections import deque
from dataclasses import dataclass, field

from .decode import DecodeEndpoint
from .loop import Clock, Link
from .params import Arrivals, PointResult, SimConfig
from .prefill import PrefillEndpoint
from .request import Request


# Bounds of an open loop's default windows, in completions (see PointSim).
OPEN_WARMUP_CAP = 8192
OPEN_MEASURE_CAP = 16384


@dataclass
class _Stats:
    prefill_tokens: int = 0
    output_tokens: int = 0
    reqs: list[Request] = field(default_factory=list)
    waited: bool = False
    preemptions: int = 0


class PointSim:
    def __init__(self, cfg: SimConfig, load: float, arrivals: Arrivals, seed: int) -> None:
        self.cfg = cfg
        self.load = load
        self.arrivals = arrivals
        self.seed = seed
        self.rng = random.Random(seed)
        self.clock = Clock()
        spec = cfg.decode
        nodes = -(-spec.ranks // spec.ranks_per_node)
        self.prefills = [PrefillEndpoint(self, i) for i in range(cfg.prefill.endpoints)]
        self.decodes = [DecodeEndpoint(self, i, [Link(self.clock, cfg.link.latency_s, self.transferred) for _ in range(nodes)])
                        for i in range(spec.endpoints)]
        self.waiting: deque[Request] = deque()
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
        req = Request(t, isl, osl, sizing.transfer(isl), sizing.posted_descriptors(isl))
        self.in_system += 1
        # Route to the prefill endpoint with the least queued work (ties: lowest index).
        target = min(self.prefills, key=lambda p: p.queued_tokens)
        req.prefill = target.index
        target.submit(req, t)

    def _open_arrival(self, t: float) -> None:
        self.submit(t)
        self.clock.at(t + self.rng.expovariate(self.load), self._open_arrival)

    def requeue(self, req: Request) -> None:
        """A preempted request goes back to the front of the queue, as vLLM's scheduler puts it.
        It is placed again only after the step being formed has taken the blocks it was preempted for."""
        self.waiting.appendleft(req)
        self.clock.at(self.clock.now, self.retry_waiting)

    def decode_admit(self, req: Request, t: float) -> None:
        if self.waiting or not self._try_place(req, t):
            req.waited = True
            if self.window_open:
                self.stats.waited = True
            self.waiting.append(req)

    def retry_waiting(self, t: float) -> None:
        while self.waiting and self._try_place(self.waiting[0], t):
            self.waiting.popleft()

    def _try_place(self, req: Request, t: float) -> bool:
        tokens = req.recompute or req.isl
        need = self.cfg.sizing.decode_blocks(tokens)
        best: tuple[int, DecodeEndpoint, int] | None = None
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

    def start_wire(self, link: Link, req: Request, t: float) -> None:
        link.start(req, t, self.cfg.link.work_s(req.descriptors, req.nbytes))

    def transferred(self, req: Request, t: float) -> None:
        self.prefills[req.prefill].release(req, t)
        self.decodes[req.endpoint].landed(req, t)

    def recompute_s(self, tokens: int, pairs: float) -> float:
        if not tokens:
            return 0.0
        # Same model, same GPU: the prefill step's per-token and per-pair device cost.
        cost = self.cfg.prefill.cost
        return cost.device_per_token_s * tokens + cost.device_per_context_token_s * pairs

    def preempted(self, req: Request) -> None:
        if self.window_open and math.isnan(self.t_close):
            self.stats.preemptions += 1

    def complete(self, req: Request, t: float) -> None:
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
    return PointSim(cfg, load, arrivals, seed).run()
