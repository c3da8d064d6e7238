"""A simulated decode endpoint: its ranks' blocks and running requests, transfers posted on the step or on a
posting thread, one token per request per step, preemption when a rank runs out of blocks (bookkeeping O(1) per
request per step event: see engine.py)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .loop import Link, Stepper
from .params import Scheduling
from .request import Request

if TYPE_CHECKING:
    from .engine import PointSim


@dataclass
class DecodeBatch:
    step: int
    requests: int
    joined: list[Request]
    finishing: list[Request]


@dataclass
class DecodeRank:
    free_blocks: int
    link: Link
    running: dict[Request, None] = field(default_factory=dict)  # join order: the last is preempted first
    isl_minus_join: int = 0
    to_post: list[Request] = field(default_factory=list)
    post_free_at: float = 0.0
    recompute_tokens: int = 0
    recompute_pairs: float = 0.0


class DecodeEndpoint(Stepper):
    def __init__(self, sim: PointSim, index: int, links: list[Link]) -> None:
        super().__init__(sim.clock, sim.cfg.scheduling)
        self.sim = sim
        self.index = index
        spec = sim.cfg.decode
        self.cost_model = spec.cost
        self.ranks = [DecodeRank(free_blocks=spec.blocks_per_rank, link=links[i // spec.ranks_per_node])
                      for i in range(spec.ranks)]
        self.ready: list[Request] = []
        self.step = 0
        self.finish_at: dict[int, list[tuple[Request, int]]] = defaultdict(list)
        self.grow_at: dict[int, list[tuple[Request, int]]] = defaultdict(list)
        self.deferred: list[Request] = []
        self._cost = (0.0, 0.0)

    def landed(self, req: Request, t: float) -> None:
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

    def _join(self, req: Request, k: int) -> None:
        rank = self.ranks[req.rank]
        req.join = k - req.made
        rank.running[req] = None
        rank.isl_minus_join += req.isl - req.join
        self.finish_at[req.join + req.osl - 1].append((req, req.epoch))
        self._next_growth(req)

    def _next_growth(self, req: Request) -> None:
        # The context after step k is isl + k - join + 1; it outgrows the blocks' cover at step
        # cover - isl + join.
        k = req.cover - req.isl + req.join
        if k <= req.join + req.osl - 1:
            self.grow_at[k].append((req, req.epoch))

    def _leave(self, req: Request) -> None:
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

    def _preempt(self, req: Request, k: int) -> None:
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

    def take_batch(self, t: float) -> DecodeBatch | None:
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
            return DecodeBatch(step=k, requests=0, joined=[], finishing=[])
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
        return DecodeBatch(step=k, requests=total, joined=joined, finishing=finishing)

    def cost(self, batch: DecodeBatch) -> tuple[float, float]:
        return self._cost

    def finish(self, batch: DecodeBatch, t: float) -> None:
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

    def _free(self, reqs: list[Request], t: float) -> None:
        if not reqs:
            return
        for req in reqs:
            self.ranks[req.rank].free_blocks += req.blocks
            req.blocks = 0
        self.sim.retry_waiting(t)
