"""A simulated prefill endpoint: chunked batches over a queue of prompts, holding each prompt's blocks from its
first chunk until the decode side's transfer has taken them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .loop import Stepper
from .request import Request

if TYPE_CHECKING:
    from .engine import PointSim


@dataclass
class PrefillBatch:
    tokens: int
    context: float
    requests: int
    done: list[Request]


class PrefillEndpoint(Stepper):
    def __init__(self, sim: PointSim, index: int) -> None:
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

    def submit(self, req: Request, t: float) -> None:
        self.queue.append([req, 0])
        self.queued_tokens += req.isl
        self.wake(t)

    def release(self, req: Request, t: float) -> None:
        """The request's transfer has ended: its prompt blocks go back to the pool."""
        self.free_blocks += req.prefill_blocks
        req.prefill_blocks = 0
        if self.queue:
            self.wake(t)

    def take_batch(self, t: float) -> PrefillBatch | None:
        left = self.budget
        tokens = 0
        context = 0.0
        requests = 0
        done: list[Request] = []
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
        return PrefillBatch(tokens=tokens, context=context, requests=requests, done=done)

    def cost(self, batch: PrefillBatch) -> tuple[float, float]:
        r = self.ranks
        return (self.cost_model.cpu(batch.requests / r),
                self.cost_model.device(batch.requests / r, batch.tokens / r, batch.context / r))

    def finish(self, batch: PrefillBatch, t: float) -> None:
        self.sim.count_tokens(batch.tokens, 0)
        for req in batch.done:
            req.t_prefilled = t
            self.sim.decode_admit(req, t)
