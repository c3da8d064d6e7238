"""What the disaggregated-serving simulator is given: plain numbers, no model knowledge.

A recipe (sims/pd/recipe.py) turns a model, a descriptor scheme and hardware figures
into these; the engine (sims/pd/engine.py) only ever sees seconds, bytes and counts.
"""

from __future__ import annotations

import enum
import math
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


def _check(name: str, value: float, *, positive: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: expected a finite number")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name}={value!r}: expected a {'positive' if positive else 'non-negative'} number")


def _check_int(name: str, value: int, *, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """Seconds of one engine step on one DP rank.

    device = base + per_request * requests + per_token * tokens + per_context_token * context,
    where `context` counts (query token, attended key) pairs: a decode step attends its whole
    context once per request; a prefill chunk of n tokens after p cached ones attends n*(p + n/2).
    cpu = cpu_base + cpu_per_request * requests (scheduling, input preparation, launch).
    """

    cpu_base_s: float = 0.0
    cpu_per_request_s: float = 0.0
    device_base_s: float = 0.0
    device_per_request_s: float = 0.0
    device_per_token_s: float = 0.0
    device_per_context_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("cpu_base_s", "cpu_per_request_s", "device_base_s", "device_per_request_s",
                     "device_per_token_s", "device_per_context_token_s"):
            _check(name, getattr(self, name))

    def cpu(self, requests: float) -> float:
        return self.cpu_base_s + self.cpu_per_request_s * requests

    def device(self, requests: float, tokens: float, context: float) -> float:
        return (self.device_base_s + self.device_per_request_s * requests
                + self.device_per_token_s * tokens + self.device_per_context_token_s * context)


@dataclass(frozen=True, kw_only=True)
class PrefillSpec:
    """`endpoints` prefill endpoints, each `ranks` DP ranks stepping together.

    An endpoint's batch takes up to ranks * max_batched_tokens tokens, chunking prompts
    (vLLM chunked prefill); its tokens are assumed evenly spread over the ranks.
    """

    endpoints: int
    ranks: int
    max_batched_tokens: int
    cost: StepCost

    def __post_init__(self) -> None:
        _check_int("prefill.endpoints", self.endpoints)
        _check_int("prefill.ranks", self.ranks)
        _check_int("prefill.max_batched_tokens", self.max_batched_tokens)


@dataclass(frozen=True, kw_only=True)
class DecodeSpec:
    """`endpoints` decode endpoints of `ranks` DP ranks; each rank holds its own requests'
    cache in `blocks_per_rank` blocks. The ranks step in lockstep (expert parallel MoE),
    so a step lasts as long as the busiest rank's."""

    endpoints: int
    ranks: int
    blocks_per_rank: int
    cost: StepCost

    def __post_init__(self) -> None:
        _check_int("decode.endpoints", self.endpoints)
        _check_int("decode.ranks", self.ranks)
        _check_int("decode.blocks_per_rank", self.blocks_per_rank)


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One link per decode rank (it pulls its requests' caches); transfers on a link run
    one after another. time = latency + descriptors * per_descriptor + bytes / bandwidth."""

    per_descriptor_s: float
    bytes_per_s: float
    latency_s: float = 0.0
    # The decode worker posts a transfer's descriptors from its step loop (vLLM's
    # start_load_kv), so posting time also lands on that rank's next step's CPU time.
    posting_on_step: bool = False

    def __post_init__(self) -> None:
        _check("link.per_descriptor_s", self.per_descriptor_s)
        _check("link.bytes_per_s", self.bytes_per_s, positive=True)
        _check("link.latency_s", self.latency_s)
        if not isinstance(self.posting_on_step, bool):
            raise ValueError(f"link.posting_on_step={self.posting_on_step!r}: expected true or false")

    def posting_s(self, descriptors: int) -> float:
        return descriptors * self.per_descriptor_s

    def transfer_s(self, descriptors: int, nbytes: int) -> float:
        return self.latency_s + descriptors * self.per_descriptor_s + nbytes / self.bytes_per_s


@dataclass(frozen=True, kw_only=True)
class RequestSpec:
    """Every request has the same shape (fixed ISL/OSL, as in the seed's benchmark)."""

    isl: int
    osl: int
    transfer_descriptors: int
    transfer_bytes: int
    decode_blocks: int

    def __post_init__(self) -> None:
        _check_int("isl", self.isl)
        _check_int("osl", self.osl, minimum=2)
        _check_int("transfer_descriptors", self.transfer_descriptors, minimum=0)
        _check_int("transfer_bytes", self.transfer_bytes, minimum=0)
        _check_int("decode_blocks", self.decode_blocks)


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    prefill: PrefillSpec
    decode: DecodeSpec
    link: LinkSpec
    request: RequestSpec
    scheduling: Scheduling
    # Completions discarded before measuring (None: 2 per user, at least 512), then completions
    # measured (None: 4 per user, at least 2048).
    warmup_requests: int | None = None
    measure_requests: int | None = None

    def __post_init__(self) -> None:
        if self.request.decode_blocks > self.decode.blocks_per_rank:
            raise ValueError(
                f"a request needs {self.request.decode_blocks} decode blocks but a rank has "
                f"{self.decode.blocks_per_rank}: no request could ever be decoded")
        if self.warmup_requests is not None:
            _check_int("warmup_requests", self.warmup_requests, minimum=0)
        if self.measure_requests is not None:
            _check_int("measure_requests", self.measure_requests)

    @property
    def total_gpus(self) -> int:
        return (self.prefill.endpoints * self.prefill.ranks
                + self.decode.endpoints * self.decode.ranks)

    @property
    def transfer_s(self) -> float:
        return self.link.transfer_s(self.request.transfer_descriptors, self.request.transfer_bytes)

    def requests_per_rank(self) -> int:
        return self.decode.blocks_per_rank // self.request.decode_blocks


@dataclass(frozen=True, kw_only=True)
class PointResult:
    concurrency: int
    tokens_per_s_per_gpu: float
    output_tokens_per_s_per_gpu: float
    tokens_per_s_per_user: float
    ttft_s: float
    itl_s: float
    transfer_s: float
    # Mean transfer time over mean TTFT: how much of the wait for the first token is the move.
    transfer_share: float
    decode_wait_s: float
    # Some request waited for decode blocks inside the measurement window.
    capacity_bound: bool
    completed: int

    def as_json(self) -> dict[str, float | int | bool]:
        return {
            "concurrency": self.concurrency,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tokens_per_s_per_user": self.tokens_per_s_per_user,
            "ttft_s": self.ttft_s,
            "itl_s": self.itl_s,
            "output_tokens_per_s_per_gpu": self.output_tokens_per_s_per_gpu,
            "transfer_s": self.transfer_s,
            "transfer_share": self.transfer_share,
            "decode_wait_s": self.decode_wait_s,
            "capacity_bound": self.capacity_bound,
        }
