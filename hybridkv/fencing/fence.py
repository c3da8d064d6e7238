"""Block fencing: who may touch which block, and from which step on.

Under asynchronous scheduling the engine's scheduler runs one or more steps
ahead of the device, and RDMA transfers bypass the device stream entirely.
A block is therefore safe to hand to someone else only once every step that
may still touch it has finished on the device and no transfer reads or writes
it. This module holds that bookkeeping and nothing else; the rules that use it
live in :mod:`hybridkv.fencing.scheduler`.

Vocabulary (engine-agnostic):

* **step** – a scheduler step number, strictly increasing (an ``int``).
* **fence** – per block, the last scheduled step that may read or write it.
* **watermark** – the last step whose device work has completed, reported by
  the worker. A block is *settled* when ``watermark >= fence``.
* **readers / writers** – outbound transfers reading the block and inbound
  transfers writing it, counted while in flight.
* **resident request** – a request in the running batch. Every step scheduled
  while it is resident may touch all of its blocks, so its blocks' fence is
  the latest scheduled step; the fence closes when it leaves the batch. This
  keeps per-step cost independent of batch size and errs on the safe side
  (a block is never released earlier than its true last touch).

Blocks are addressed by ``(group, block id)``. Groups that share one physical
pool (vLLM's hybrid allocator: block ``b`` of every group aliases page ``b``)
share one namespace: the table keys blocks by pool, not by group.

:class:`FencePolicy` ``NONE`` turns every check into "yes"; it exists only so
the race simulator and the property tests can show what breaks without fencing.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

#: Fence of a block nobody has touched yet: settled under any watermark.
NEVER = -1


class FencePolicy(enum.Enum):
    """Whether the scheduler enforces the fencing rules."""

    FENCED = "fenced"
    NONE = "none"


class NotYetReason(enum.Enum):
    """Why a non-blocking call answered "not yet"; the engine asks again later."""

    PENDING_STEP = "a scheduled step that may touch the block has not completed"
    TRANSFER_IN_FLIGHT = "another transfer still reads or writes the block"
    POOL_EXHAUSTED = "not enough reusable blocks in the pool"
    LEASE_TOO_SHORT = "the read cannot finish inside the lease"


@dataclass(frozen=True, kw_only=True)
class NotYet:
    """The answer of a non-blocking call that cannot proceed now.

    Test for it with ``isinstance(x, NotYet)``. It has no truth value: the answers
    it stands beside are falsy at times (transfer id 0, no blocks allocated), so a
    truth test would read "not yet" into a yes.
    """

    reason: NotYetReason

    def __bool__(self) -> bool:
        raise TypeError(
            f"truth value of NotYet({self.reason.name}) tested; expected isinstance(x, NotYet): "
            "a posted transfer id may be 0 and an allocation may be empty, both falsy"
        )


@dataclass(frozen=True, kw_only=True)
class PoolLayout:
    """How KV-cache groups map onto physical block pools.

    ``pool_sizes[p]`` is the number of blocks of pool ``p``; ``group_pools[g]``
    is the pool of group ``g``. vLLM's hybrid allocator is one pool for all
    groups; SGLang keeps KV pages and Mamba slots in separate pools.
    """

    pool_sizes: tuple[int, ...]
    group_pools: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.pool_sizes:
            raise ValueError("pool_sizes is empty; expected at least one pool")
        for p, n in enumerate(self.pool_sizes):
            if not isinstance(n, int) or n <= 0:
                raise ValueError(f"pool_sizes[{p}] = {n!r}; expected a positive int")
        if not self.group_pools:
            raise ValueError("group_pools is empty; expected at least one group")
        for g, p in enumerate(self.group_pools):
            if not isinstance(p, int) or not 0 <= p < len(self.pool_sizes):
                raise ValueError(
                    f"group_pools[{g}] = {p!r}; expected a pool index in [0, {len(self.pool_sizes)})"
                )

    @classmethod
    def shared(cls, *, num_blocks: int, num_groups: int) -> PoolLayout:
        """All groups in one pool (vLLM hybrid allocator)."""
        return cls(pool_sizes=(num_blocks,), group_pools=(0,) * num_groups)

    @classmethod
    def separate(cls, *, num_blocks: tuple[int, ...]) -> PoolLayout:
        """One pool per group (SGLang: KV pages, Mamba slots)."""
        return cls(pool_sizes=tuple(num_blocks), group_pools=tuple(range(len(num_blocks))))

    @property
    def num_groups(self) -> int:
        return len(self.group_pools)

    @property
    def total_blocks(self) -> int:
        return sum(self.pool_sizes)


class FenceTable:
    """Per-block fence, readers and writers in flight, and the device watermark.

    Blocks are addressed internally by a dense *key* (pool offset + block id)
    so the per-block state is a few flat lists. :meth:`key` validates and
    converts ``(group, block)``; :meth:`block_of` converts back.
    """

    __slots__ = (
        "layout",
        "_base",
        "_pool_of_key",
        "_group_span",
        "fence",
        "readers",
        "writers",
        "holder",
        "sharers",
        "watermark",
        "scheduled",
    )

    def __init__(self, layout: PoolLayout) -> None:
        self.layout = layout
        self._base: list[int] = []
        offset = 0
        for n in layout.pool_sizes:
            self._base.append(offset)
            offset += n
        self._pool_of_key = [p for p, n in enumerate(layout.pool_sizes) for _ in range(n)]
        # (first key, block count) of each group's pool, for :meth:`keys`.
        self._group_span = [(self._base[p], layout.pool_sizes[p]) for p in layout.group_pools]
        total = offset
        self.fence: list[int] = [NEVER] * total
        self.readers: list[int] = [0] * total
        self.writers: list[int] = [0] * total
        # The request record whose residency extends the fence (see module doc), or None.
        self.holder: list[object | None] = [None] * total
        # Rule 7 (sharing): the holders of a block beyond ``holder``, for the few blocks
        # several live requests hold (a cached prefix, an export of a block a running
        # request also holds). Empty unless something is shared, so the hot paths test
        # it once and keep their single-holder code.
        self.sharers: dict[int, list[object]] = {}
        self.watermark: int = NEVER
        self.scheduled: int = NEVER

    # -- addressing ---------------------------------------------------------
    def key(self, group: int, block: int) -> int:
        pools = self.layout.group_pools
        if not isinstance(group, int) or not 0 <= group < len(pools):
            raise ValueError(f"group {group!r}; expected a group index in [0, {len(pools)})")
        pool = pools[group]
        size = self.layout.pool_sizes[pool]
        if not isinstance(block, int) or not 0 <= block < size:
            raise ValueError(
                f"block {block!r} of group {group}; expected a block id in [0, {size})"
            )
        return self._base[pool] + block

    def keys(self, refs: Iterable[tuple[int, int]]) -> list[int]:
        """:meth:`key` of every ``(group, block)``, in order; ValueError on the first bad one."""
        span = self._group_span
        ngroups = len(span)
        out = []
        append = out.append
        for g, b in refs:
            # Plain ints in range take the fast path; anything else gets key()'s checks and message.
            if g.__class__ is int and b.__class__ is int and 0 <= g < ngroups:
                base, size = span[g]
                if 0 <= b < size:
                    append(base + b)
                    continue
            append(self.key(g, b))
        return out

    def pool_of_key(self, key: int) -> int:
        return self._pool_of_key[key]

    def block_of(self, key: int) -> int:
        return key - self._base[self._pool_of_key[key]]

    def pool_keys(self, pool: int) -> range:
        base = self._base[pool]
        return range(base, base + self.layout.pool_sizes[pool])

    # -- fences ---------------------------------------------------------------
    def touch(self, keys: Iterable[int], step: int) -> None:
        """``step`` may read or write these blocks: their fence is at least ``step``."""
        fence = self.fence
        for k in keys:
            if step > fence[k]:
                fence[k] = step

    def release_holder(self, key: int) -> None:
        """Freeze the holder's residency (see the module doc) into the block's own fence."""
        h = self.holder[key]
        if h is None:
            return
        self.release_hold(key, h)

    # -- holds (rule 7) -------------------------------------------------------
    def holders(self, key: int) -> list[object]:
        """Every live holder of the block, the first one first."""
        h = self.holder[key]
        if h is None:
            return []
        more = self.sharers.get(key)
        return [h] if more is None else [h, *more]

    def hold_count(self, key: int) -> int:
        h = self.holder[key]
        if h is None:
            return 0
        more = self.sharers.get(key)
        return 1 if more is None else 1 + len(more)

    def add_hold(self, key: int, rec: object) -> None:
        """``rec`` holds the block too (one hold per request; the caller checks)."""
        if self.holder[key] is None:
            self.holder[key] = rec
        else:
            self.sharers.setdefault(key, []).append(rec)

    def release_hold(self, key: int, rec: object) -> bool:
        """``rec`` lets go of the block: its residency is frozen into the block's fence
        (rule 7: rules 1-5 apply per holder). True when that was the last hold."""
        hs = self.scheduled if rec.resident else rec.last_step  # type: ignore[attr-defined]
        if hs > self.fence[key]:
            self.fence[key] = hs
        more = self.sharers.get(key)
        if more is None:
            if self.holder[key] is rec:
                self.holder[key] = None
            return True
        if self.holder[key] is rec:
            self.holder[key] = more.pop(0)
        else:
            more.remove(rec)
        if not more:
            del self.sharers[key]
        return False

    # -- steps ----------------------------------------------------------------
    def advance_scheduled(self, step: int) -> None:
        """Record that ``step`` was scheduled; steps strictly increase."""
        if not isinstance(step, int) or step <= self.scheduled:
            raise ValueError(
                f"step {step!r} scheduled; expected an int greater than the last scheduled "
                f"step {self.scheduled}"
            )
        self.scheduled = step

    def advance_watermark(self, step: int) -> bool:
        """Record completion of ``step``; False for a late or duplicate report."""
        if not isinstance(step, int) or step > self.scheduled:
            raise ValueError(
                f"step {step!r} completed; expected an int no greater than the last scheduled "
                f"step {self.scheduled}"
            )
        if step <= self.watermark:
            return False
        self.watermark = step
        return True
