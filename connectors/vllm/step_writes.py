"""Which blocks one vLLM step writes: what the scheduler half fences for that step.

A block's fence is the last step that may still change it (docs/design.md, "Fencing"). A step writes
the blocks of the tokens it computes and each GDN/Mamba group's state slots; it only *reads* the
blocks of the tokens before them. Fencing those reads too would hold back every export of a request
that shares a hot prefix (a system prompt): some running request reads the prefix in every step, so
its fence would never settle while traffic lasts.

A read matters only to a block vLLM hands to an import while the read is still in flight, which
needs the reader to have let the block go:

* a finished request: its last step's output is discarded, so what it read no longer matters;
* a block vLLM frees while the request still runs (a sliding window's or a chunk's past blocks, an
  align-mode Mamba state that moved on): the step that last read it is fenced here, because each
  group's range starts at the first block that step may read, not at the first it writes;
* a preempted request: vLLM delivers its in-flight output after all. On an engine that imports, its
  blocks are fenced at the step that preempted it (once per preemption, off the per-step path).

Per step this costs a few index operations per scheduled request and group, never a walk over a
request's whole block table. Positions come from the scheduler output (``num_computed_tokens`` as
the step was scheduled, before vLLM advances it).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig


class Reach(enum.Enum):
    """How far before a step's first token its writes and freeable reads start, in one group."""

    #: Full attention: the blocks of the tokens it computes, nothing before them.
    TOKENS = "tokens"
    #: Sliding window / chunked local attention: from the first token it still attends to
    #: (vLLM frees the blocks before that while the request runs).
    WINDOW = "window"
    #: Align-mode Mamba/GDN: from the state slot it copies from to the end of the table (the running
    #: slot, checkpoints and speculative slots; vLLM retires passed slots while the request runs).
    STATE = "state"
    #: Anything else (a Mamba group in "none" mode, whose few slots are all live; a spec kind not
    #: modelled here): every block the request holds.
    ALL = "all"


@dataclass(frozen=True, kw_only=True)
class GroupWrites:
    reach: Reach
    block_size: int
    #: WINDOW: tokens before the first computed one the step still reads (window - 1), or the chunk
    #: size for chunked local attention (``chunk`` > 0).
    back: int = 0
    chunk: int = 0

    def first_block(self, start: int) -> int:
        if self.reach is Reach.TOKENS:
            return start // self.block_size
        if self.reach is Reach.WINDOW:
            first = start - start % self.chunk if self.chunk else start - self.back
            return max(0, first) // self.block_size
        if self.reach is Reach.STATE:
            return max(0, start - 1) // self.block_size
        return 0

    def last_block(self, end: int, held: int) -> int:
        """One past the last block index the step may write (``held``: the table's length)."""
        if self.reach is Reach.TOKENS or self.reach is Reach.WINDOW:
            return min(held, -(-end // self.block_size))
        return held


def group_writes(spec: Any) -> GroupWrites:
    """The rule for one KV cache group's spec (vLLM's classes, matched exactly: a subclass may page
    differently, and then every block it holds is fenced)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    kind = type(spec)
    bs = int(spec.block_size)
    if kind in (FullAttentionSpec, MLAAttentionSpec):
        # A uniform-spec group may carry a window or a chunk on the full-attention class.
        if spec.sliding_window is not None:
            return GroupWrites(reach=Reach.WINDOW, block_size=bs, back=int(spec.sliding_window) - 1)
        if spec.attention_chunk_size is not None:
            return GroupWrites(reach=Reach.WINDOW, block_size=bs, chunk=int(spec.attention_chunk_size))
        return GroupWrites(reach=Reach.TOKENS, block_size=bs)
    if kind in (SlidingWindowSpec, SlidingWindowMLASpec):
        return GroupWrites(reach=Reach.WINDOW, block_size=bs, back=int(spec.sliding_window) - 1)
    if kind is ChunkedLocalAttentionSpec:
        return GroupWrites(reach=Reach.WINDOW, block_size=bs, chunk=int(spec.attention_chunk_size))
    if kind is MambaSpec and spec.mamba_cache_mode == "align":
        return GroupWrites(reach=Reach.STATE, block_size=bs)
    return GroupWrites(reach=Reach.ALL, block_size=bs)


class _ByRequest:
    """One group's blocks of a request through vLLM's public API (the fallback of _block_tables)."""

    def __init__(self, manager: KVCacheManager, group: int) -> None:
        self.manager = manager
        self.group = group

    def get(self, rid: str) -> Sequence[Any]:
        return self.manager.get_blocks(rid).blocks[self.group]


class StepWrites:
    """The block ids each scheduled step writes, over every KV cache group (one shared pool)."""

    def __init__(self, kv_cache_config: KVCacheConfig, *, imports: bool) -> None:
        self.groups: tuple[GroupWrites, ...] = tuple(group_writes(g.kv_cache_spec)
                                                     for g in kv_cache_config.kv_cache_groups)
        self.imports = imports
        # imports only: each running request's block tables (vLLM's live lists, not copies) as of its
        # last step, for the step that preempts it.
        self._tables: dict[str, Sequence[Sequence[Any]]] = {}

    def of_step(self, so: SchedulerOutput, manager: KVCacheManager) -> set[int]:
        out: set[int] = set()
        maps = self._block_tables(manager)
        if self.imports:
            self._track(so, maps, out)
        starts: dict[str, int] = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        scheduled = [(rid, starts.get(rid), n) for rid, n in so.num_scheduled_tokens.items()]
        # Groups that page alike (the GDN groups of a hybrid) share one rule; per rule and group the
        # loop over the scheduled requests is inlined (it is this module's whole per-step cost).
        add = out.add
        update = out.update
        for g, by_request in zip(self.groups, maps):
            # Plain bools, not Enum members: an Enum attribute costs a lookup per request here.
            tokens, state, window = g.reach is Reach.TOKENS, g.reach is Reach.STATE, g.reach is Reach.WINDOW
            bs, back, chunk = g.block_size, g.back, g.chunk
            get = by_request.get
            for rid, start, n in scheduled:
                blocks = get(rid)
                if not blocks:
                    continue
                if tokens and start is not None:
                    first, last = start // bs, -(-(start + n) // bs)
                elif state and start is not None:
                    first, last = ((start - 1) // bs if start else 0), len(blocks)
                elif window and start is not None:
                    first = max(0, start - start % chunk if chunk else start - back) // bs
                    last = -(-(start + n) // bs)
                else:
                    first, last = 0, len(blocks)
                if last - first == 1:  # most steps: one token, or a chunk inside one block
                    if first < len(blocks):
                        add(blocks[first].block_id)
                else:
                    update([b.block_id for b in blocks[first:last]])
        for copy in so.kv_cache_block_copies or ():
            add(copy.dst_block_id)  # a copy-on-write fills this step's block from a cached one
        return out

    def _track(self, so: SchedulerOutput, maps: list[Any], out: set[int]) -> None:
        """Imports: a preempted request's blocks are fenced at the step that preempted it (its in-flight
        step may still read them, and vLLM delivers what that step computes). vLLM keeps a request's
        block lists for its whole run (appends and nulls in place), so they are taken once, when it
        is first scheduled (or resumed), and read when it is preempted."""
        tables = self._tables
        for rid in so.preempted_req_ids or ():
            for blocks in tables.pop(rid, ()):
                out.update([b.block_id for b in blocks])
        cached = so.scheduled_cached_reqs
        for rid in [r.req_id for r in so.scheduled_new_reqs] + list(cached.resumed_req_ids):
            tables[rid] = [m.get(rid) or () for m in maps]

    def _block_tables(self, manager: KVCacheManager) -> list[Any]:
        """Each group's request -> blocks map: vLLM's own (live lists, nothing copied). vLLM's public
        ``get_blocks`` builds a fresh object per request and call, most of this module's cost."""
        managers = getattr(getattr(manager, "coordinator", None), "single_type_managers", None)
        if managers is not None and len(managers) == len(self.groups):
            return [m.req_to_blocks for m in managers]
        return [_ByRequest(manager, g) for g in range(len(self.groups))]

    def forget(self, rid: str) -> None:
        """The request finished: vLLM discards what its in-flight step computed."""
        self._tables.pop(rid, None)
