"""What the disaggregated-serving simulator is given: plain numbers, no model knowledge.

A recipe (sims/pd/recipe.py) turns a model, a descriptor scheme and hardware figures
into these; the engine (sims/pd/engine.py) only ever sees seconds, bytes, counts and
the per-request sizes of `Sizing`.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable
from dataclasses import dataclass


class Scheduling(enum.Enum):
    """SYNC: CPU work of a step, then its device work. ASYNC: the scheduler runs one
    step ahead, so step k+1's CPU work overlaps step k's device work (vLLM --async-scheduling)."""

    SYNC = "sync"
    ASYNC = "async"

    @classmethod
    def parse(cls, value: bool | str | Scheduling) -> Scheduling:
        if isinstance(value, Scheduling):
            return value
        if isinstance(value, bool):
            return cls.ASYNC if value else cls.SYNC
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"scheduling {value!r}: expected true/false, 'sync' or 'async'") from None


class Distribution(enum.Enum):
    FIXED = "fixed"
    UNIFORM = "uniform"
    LOGNORMAL = "lognormal"


# Bounds of a recipe's sizes (and the CLI's overrides): past them a run does not end in useful
# time, so they are refused at once, naming the bound. Every endpoint, rank and user is simulated
# one by one: the shipped recipes have 1-8 endpoints of up to 8 ranks and up to 5,120 users.
# Endpoints: 1,024 per side, beyond any one deployment. Ranks: 1,024 per endpoint, past the
# largest expert-parallel groups. Users: 100,000, 20x the seed topology's sweep.
MAX_ENDPOINTS = 1024
MAX_RANKS = 1024
MAX_CONCURRENCY = 100_000
# Requests per second of an open loop: 100x the closed loop's users over a one-second step.
MAX_REQUEST_RATE = 1e7
# Tokens of one prompt, output or batch: 64x the longest context of any preset (262,144).
MAX_TOKENS = 1 << 24
# A point's window: 500x the default measure window of 2,048 completions.
MAX_WINDOW_REQUESTS = 1_000_000
# Seeds per point: a spread needs a few; 100 per point already multiplies a sweep's hours by 30.
MAX_SEEDS = 100
# Points on a curve: a Pareto curve needs tens.
MAX_LOADS = 100
# Attention TP of a rank: as many GPUs as one NVL72 domain (the analyzer's bound).
MAX_TP = 72


def check_number(name: str, value: float, *, positive: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: expected a finite number")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name}={value!r}: expected a {'positive' if positive else 'non-negative'} number")


def check_int(name: str, value: int, *, minimum: int = 1, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value!r}: above the bound {maximum:,}")


@dataclass(frozen=True, kw_only=True)
class Lengths:
    """Token counts of a request's prompt or output, drawn per request.

    FIXED: always `mean`. UNIFORM: integers in [low, high]. LOGNORMAL: mean `mean` and
    coefficient of variation `cv`, redrawn until inside [low, high] (so the mean shifts a little
    when the bounds cut a tail).
    """

    name: str
    kind: Distribution
    mean: float
    low: int
    high: int
    cv: float = 0.0

    def __post_init__(self) -> None:
        check_int(f"{self.name}.low", self.low)
        check_int(f"{self.name}.high", self.high, minimum=self.low, maximum=MAX_TOKENS)
        check_number(f"{self.name}.mean", self.mean, positive=True)
        check_number(f"{self.name}.cv", self.cv)
        if not self.low <= self.mean <= self.high:
            raise ValueError(f"{self.name}: mean {self.mean} outside [{self.low}, {self.high}]")
        if self.kind is Distribution.LOGNORMAL and self.cv == 0:
            raise ValueError(f"{self.name}.cv=0: a lognormal needs a positive cv (use a fixed length instead)")

    @classmethod
    def fixed(cls, name: str, n: int) -> Lengths:
        check_int(name, n, maximum=MAX_TOKENS)
        return cls(name=name, kind=Distribution.FIXED, mean=n, low=n, high=n)

    def draw(self, rng: random.Random) -> int:
        if self.kind is Distribution.FIXED:
            return self.low
        if self.kind is Distribution.UNIFORM:
            return rng.randint(self.low, self.high)
        sigma = math.sqrt(math.log1p(self.cv ** 2))
        mu = math.log(self.mean) - sigma ** 2 / 2
        for _ in range(1000):
            n = round(rng.lognormvariate(mu, sigma))
            if self.low <= n <= self.high:
                return n
        raise ValueError(f"{self.name}: the lognormal (mean {self.mean}, cv {self.cv}) almost never falls in "
                         f"[{self.low}, {self.high}]")


class Arrivals(enum.Enum):
    """CLOSED: `load` users, each submitting its next request when the previous one ends, the first
    ones spread uniformly over the ramp. OPEN: Poisson arrivals at `load` requests per second."""

    CLOSED = "closed"
    OPEN = "open"


@dataclass(frozen=True, kw_only=True)
class Traffic:
    isl: Lengths
    osl: Lengths
    ramp_s: float

    def __post_init__(self) -> None:
        check_number("workload.ramp_s", self.ramp_s)
        if self.osl.low < 2:
            raise ValueError(f"osl low={self.osl.low}: expected >= 2 (one first token, then inter-token latency)")


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """Seconds of one engine step on one DP rank.

    device = base + per_request * requests + per_token * tokens + per_context_token * context,
    where `context` counts (query token, attended key) pairs: a decode step attends its whole
    context once per request; a prefill chunk of n tokens after p cached ones attends n*(p + n/2).
    cpu = cpu_base + cpu_per_request * requests (scheduling, input preparation, launch).
    """

    cpu_base_s: float
    cpu_per_request_s: float
    device_base_s: float
    device_per_request_s: float
    device_per_token_s: float
    device_per_context_token_s: float

    KEYS = ("cpu_base_s", "cpu_per_request_s", "device_base_s", "device_per_request_s",
            "device_per_token_s", "device_per_context_token_s")

    def __post_init__(self) -> None:
        for name in self.KEYS:
            check_number(name, getattr(self, name))

    @classmethod
    def of(cls, **given: float) -> StepCost:
        """Tests' shorthand: the keys not given are zero."""
        return cls(**({k: 0.0 for k in cls.KEYS} | given))

    def cpu(self, requests: float) -> float:
        return self.cpu_base_s + self.cpu_per_request_s * requests

    def device(self, requests: float, tokens: float, context: float) -> float:
        return (self.device_base_s + self.device_per_request_s * requests
                + self.device_per_token_s * tokens + self.device_per_context_token_s * context)

    def smallest_step_s(self) -> float:
        """What a step of one request and one token (half a query-key pair: n(p + n/2)) costs at least:
        zero would make throughput unbounded."""
        return self.cpu(1) + self.device(1, 1, 0.5)


@dataclass(frozen=True, kw_only=True)
class PrefillSpec:
    """`endpoints` prefill endpoints, each `ranks` DP ranks stepping together.

    An endpoint's batch takes up to ranks * max_batched_tokens tokens, chunking prompts
    (vLLM chunked prefill); its tokens are assumed evenly spread over the ranks. A request holds
    its prompt's blocks on the endpoint from its first chunk until its transfer has ended; the
    endpoint's ranks pool `blocks_per_rank` each.

    A rank is one attention DP rank: `gpus_per_rank` GPUs (its attention TP) stepping as one, each
    holding its head slice of every block; `cost` is that rank's step, `blocks_per_rank` its blocks.
    """

    endpoints: int
    ranks: int
    max_batched_tokens: int
    blocks_per_rank: int
    cost: StepCost
    gpus_per_rank: int = 1

    def __post_init__(self) -> None:
        check_int("prefill.endpoints", self.endpoints, maximum=MAX_ENDPOINTS)
        check_int("prefill.ranks", self.ranks, maximum=MAX_RANKS)
        check_int("prefill.attention_tp", self.gpus_per_rank, maximum=MAX_RANKS)
        check_int("prefill.max_batched_tokens", self.max_batched_tokens, maximum=MAX_TOKENS)
        check_int("prefill.blocks_per_rank", self.blocks_per_rank)
        if not self.cost.smallest_step_s() > 0:
            raise ValueError("prefill.cost: every term is zero, so a prefill step takes no time "
                             "(throughput would be unbounded); give at least one positive cost")


@dataclass(frozen=True, kw_only=True)
class DecodeSpec:
    """`endpoints` decode endpoints of `ranks` DP ranks; each rank holds its own requests'
    cache in `blocks_per_rank` blocks, allocated as the context grows. The ranks step in lockstep
    (expert parallel MoE), so a step lasts as long as the busiest rank's. `ranks_per_node` ranks
    share one node's link.

    A rank is one attention DP rank: `gpus_per_rank` GPUs (its attention TP) in one node, stepping
    as one; each GPU holds its head slice of the rank's blocks and posts its own part of every
    transfer, all in parallel (Sizing.posted is one GPU's part)."""

    endpoints: int
    ranks: int
    ranks_per_node: int
    blocks_per_rank: int
    cost: StepCost
    gpus_per_rank: int = 1

    def __post_init__(self) -> None:
        check_int("decode.endpoints", self.endpoints, maximum=MAX_ENDPOINTS)
        check_int("decode.ranks", self.ranks, maximum=MAX_RANKS)
        check_int("decode.attention_tp", self.gpus_per_rank, maximum=MAX_RANKS)
        check_int("decode.ranks_per_node", self.ranks_per_node, maximum=MAX_RANKS)
        check_int("decode.blocks_per_rank", self.blocks_per_rank)
        if not self.cost.smallest_step_s() > 0:
            raise ValueError("decode.cost: every term is zero, so a decode step takes no time "
                             "(throughput would be unbounded); give at least one positive cost")


@dataclass(frozen=True, kw_only=True)
class PostingSpec:
    """CPU time of building and posting one transfer in the thread that posts it:
    per_transfer + per_descriptor * descriptors (measured by `hybridkv bench transfer`).

    `on_step`: the decode worker posts from its step loop (vLLM's start_load_kv), so that time
    is the CPU time of the step that posts, and the wire starts when the posting ends. Otherwise
    a posting thread per decode rank does it, one transfer after another, off the step."""

    per_descriptor_s: float
    per_transfer_s: float
    on_step: bool

    def __post_init__(self) -> None:
        check_number("transfer.posting.per_descriptor_s", self.per_descriptor_s)
        check_number("transfer.posting.per_transfer_s", self.per_transfer_s)
        if not isinstance(self.on_step, bool):
            raise ValueError(f"transfer.posting.on_step={self.on_step!r}: expected true or false")

    def seconds(self, descriptors: int) -> float:
        return self.per_transfer_s + descriptors * self.per_descriptor_s


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One link per decode node, shared by every transfer into that node's ranks (processor
    sharing: n transfers in flight each progress at 1/n of the link). A transfer's work is
    per_descriptor * descriptors + bytes / bandwidth link-seconds; `latency_s` is added once
    (the completion's round trip), after the work."""

    per_descriptor_s: float
    bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        check_number("transfer.link.per_descriptor_s", self.per_descriptor_s)
        check_number("transfer.link.bytes_per_s", self.bytes_per_s, positive=True)
        check_number("transfer.link.latency_s", self.latency_s)

    def work_s(self, descriptors: int, nbytes: int) -> float:
        return descriptors * self.per_descriptor_s + nbytes / self.bytes_per_s

    def alone_s(self, descriptors: int, nbytes: int) -> float:
        """Seconds of one transfer on an otherwise idle link."""
        return self.latency_s + self.work_s(descriptors, nbytes)


@dataclass(frozen=True, kw_only=True)
class Sizing:
    """Per-request sizes, from the model and the scheme (sims/pd/model.py) or given by a test.

    transfer(isl) -> (descriptors, bytes) of moving a prompt of isl tokens, over every GPU of the
    decode rank (what crosses the node's link); posted(isl): the descriptors one posting thread
    builds and posts for it (one GPU's part at attention TP > 1; None: all of them);
    decode_blocks(tokens) and prefill_blocks(tokens): blocks a request of that context holds. Blocks
    grow only where the context passes a multiple of `block_tokens`.
    """

    transfer: Callable[[int], tuple[int, int]]
    decode_blocks: Callable[[int], int]
    prefill_blocks: Callable[[int], int]
    block_tokens: int
    posted: Callable[[int], int] | None = None

    def posted_descriptors(self, isl: int) -> int:
        return self.transfer(isl)[0] if self.posted is None else self.posted(isl)

    def __post_init__(self) -> None:
        check_int("block_tokens", self.block_tokens)


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    prefill: PrefillSpec
    decode: DecodeSpec
    posting: PostingSpec
    link: LinkSpec
    sizing: Sizing
    traffic: Traffic
    scheduling: Scheduling
    # Completions discarded before measuring (None: 2 per user, at least 512), then completions
    # measured (None: 4 per user, at least 2048).
    warmup_requests: int | None = None
    measure_requests: int | None = None

    def __post_init__(self) -> None:
        longest = self.traffic.isl.high + self.traffic.osl.high
        need = self.sizing.decode_blocks(longest)
        if need > self.decode.blocks_per_rank:
            raise ValueError(
                f"the longest request ({longest} tokens) needs {need} decode blocks but a rank has "
                f"{self.decode.blocks_per_rank}: it could never be decoded")
        need = self.sizing.prefill_blocks(self.traffic.isl.high)
        if need > self.prefill.blocks_per_rank * self.prefill.ranks:
            raise ValueError(
                f"the longest prompt ({self.traffic.isl.high} tokens) needs {need} prefill blocks but an "
                f"endpoint has {self.prefill.blocks_per_rank * self.prefill.ranks}: it could never be prefilled")
        if self.warmup_requests is not None:
            check_int("warmup_requests", self.warmup_requests, minimum=0, maximum=MAX_WINDOW_REQUESTS)
        if self.measure_requests is not None:
            check_int("measure_requests", self.measure_requests, maximum=MAX_WINDOW_REQUESTS)

    @property
    def total_gpus(self) -> int:
        return (self.prefill.endpoints * self.prefill.ranks * self.prefill.gpus_per_rank
                + self.decode.endpoints * self.decode.ranks * self.decode.gpus_per_rank)

    def typical(self) -> tuple[int, int, int]:
        """(descriptors, bytes, decode blocks) of a request of mean lengths, for titles."""
        isl = round(self.traffic.isl.mean)
        d, b = self.sizing.transfer(isl)
        return d, b, self.sizing.decode_blocks(isl + round(self.traffic.osl.mean))

    def typical_posted(self) -> int:
        """Descriptors one posting thread posts for a request of mean lengths."""
        return self.sizing.posted_descriptors(round(self.traffic.isl.mean))

    def typical_transfer_s(self) -> float:
        d, b, _ = self.typical()
        return self.posting.seconds(self.typical_posted()) + self.link.alone_s(d, b)


METRICS = ("tokens_per_s_per_gpu", "output_tokens_per_s_per_gpu", "tokens_per_s_per_user", "ttft_s", "itl_s",
           "transfer_s", "posting_s", "transfer_share", "decode_wait_s", "prefill_wait_s", "preemptions",
           "backlog_growth")


@dataclass(frozen=True, kw_only=True)
class PointResult:
    load: float
    arrivals: Arrivals
    seed: int
    tokens_per_s_per_gpu: float
    output_tokens_per_s_per_gpu: float
    tokens_per_s_per_user: float
    ttft_s: float
    itl_s: float
    # From the decode rank's placement to the bytes landed: posting, link queueing, the wire.
    transfer_s: float
    # Of which the posting thread's CPU (or the posting step's).
    posting_s: float
    # Mean transfer time over mean TTFT: how much of the wait for the first token is the move.
    transfer_share: float
    decode_wait_s: float
    # From arrival at a prefill endpoint to its first chunk (queueing, waiting for prefill blocks).
    prefill_wait_s: float
    # Requests preempted on decode (blocks ran out as contexts grew) inside the window.
    preemptions: int
    # Some request waited for decode blocks inside the measurement window.
    capacity_bound: bool
    completed: int
    # Requests in the system at the window's close minus at its open: an open loop past capacity
    # keeps growing its queue (its TTFT then depends on how long it ran).
    backlog_growth: int

    def value(self, metric: str) -> float:
        return float(getattr(self, metric))
