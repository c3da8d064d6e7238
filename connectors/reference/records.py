"""The reference engine's records: its role and config, a request and its status, a planned step and one enqueued on
the compute stream, and checksums of blocks taken behind the stream (`engine.Engine` keeps them)."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from hybridkv.fencing import FencePolicy

from .cache import CacheConfig


class Role(enum.Enum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class Status(enum.Enum):
    WAITING = "waiting"      # not admitted yet (no blocks)
    IMPORTING = "importing"  # blocks held, remote KV/state on its way
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(eq=False, kw_only=True)
class Request:
    rid: str
    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    attn_blocks: list[int] = field(default_factory=list)
    slot: int = -1
    scheduled: int = 0          # tokens whose computation is scheduled (runs ahead of `computed`)
    joined: bool = False
    recompute: bool = False     # a failed import: compute the prompt here after all
    arrived_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    imported: tuple[list[int], int] | None = None  # (attention blocks, slot) a landed import wrote
    import_check: Checksums | None = None  # their checksums, taken before the first step that reads them
    export_check: Checksums | None = None  # prefill: checksums of what it exports, taken when it finished

    @property
    def prefill_done(self) -> bool:
        return self.scheduled >= len(self.prompt)


@dataclass(frozen=True, kw_only=True)
class Entry:
    rid: str
    start: int
    n: int
    prefill: bool


@dataclass(frozen=True, eq=False, kw_only=True)
class Checksums:
    """Checksums enqueued on the compute stream, copied to host memory behind it."""
    host: torch.Tensor
    event: object | None  # torch.cuda.Event; None on the CPU (computed at once)

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def values(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return [int(x) for x in self.host.tolist()]


@dataclass(frozen=True, eq=False, kw_only=True)
class Launched:
    """A step enqueued on the compute stream whose results may not be back yet."""
    plan: StepPlan
    host: torch.Tensor  # the entries' next tokens, landing here behind the step
    event: object | None
    launched_s: float

    def done(self) -> bool:
        return self.event is None or self.event.query()


@dataclass(eq=False, kw_only=True)
class StepPlan:
    step: int
    entries: list[Entry]
    zero_blocks: list[int]


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    role: Role = Role.AGGREGATED
    async_depth: int = 1
    chunk_size: int = 32
    max_running: int = 8
    policy: FencePolicy = FencePolicy.FENCED
    cache: CacheConfig = CacheConfig()
    step_gap_s: float = 0.0005  # the worker's launch latency: transfers progress meanwhile
    # Before launching a step, let in-flight transfers land (up to this long). On GPUs a
    # KV/state RDMA is far shorter than the steps queued ahead of it, which is the regime
    # where vLLM's async races fired; on this CPU engine a step is short and the transfer
    # slow, so without this the races would almost never show (fencing or not).
    settle_transfers_s: float = 0.5
    lease_s: float = 30.0  # how long exported blocks wait for a consumer (renewed by its heartbeats)
    import_launch_s: float = 0.05  # how long a step waits for the imports admitted with it to post
    # "cpu" computes each step when it is launched; on "cuda:N" a step is only enqueued on the
    # engine's compute stream, and up to `async_depth` launched steps may still be running when
    # the next is enqueued (their tokens feed the next step on the device, as vLLM's async
    # scheduling does). A step counts as completed (the fence watermark) when its event fired.
    device: str = "cpu"


Fetcher = Callable[[str, tuple], Awaitable[object]]
Exporter = Callable[[str], Awaitable[object]]
