"""Free lists with deferred reuse (fencing rule 2 of docs/design.md, vLLM Race A).

A freed block is not reusable at once: a step that is already dispatched may
still rewrite it (GDN state is rewritten in full by every step), and a
transfer may still read or write it. :class:`BlockPool` parks freed blocks
until the :class:`~hybridkv.fencing.fence.FenceTable` says they are settled and idle:

* blocks waiting only for the watermark sit in a heap ordered by fence, so a
  watermark advance releases them in O(released · log n);
* blocks with a transfer in flight sit in quarantine and are re-examined when
  a transfer touching them becomes terminal.

With ``FencePolicy.NONE`` a freed block goes straight back to the free list.

The pool can be *managed* (it hands out blocks: the reference engine, the
simulators) or *external* (the engine owns allocation, as vLLM does): then
reusable blocks accumulate in :meth:`take_reusable` for the engine to return
to its own pool.
"""

from __future__ import annotations

import heapq

from hybridkv.fencing.fence import FenceTable


class BlockPool:
    """Free lists of every physical pool of one worker, over block keys."""

    __slots__ = (
        "_table",
        "_fenced",
        "managed",
        "_free",
        "_head",
        "_heap",
        "_seq",
        "_tail",
        "_quarantine",
        "_parked",
        "_reusable",
        "_stale",
    )

    def __init__(self, table: FenceTable, *, fenced: bool, managed: bool) -> None:
        self._table = table
        self._fenced = fenced
        self.managed = managed
        npools = len(table.layout.pool_sizes)
        # Low block ids first, then first freed first reused: deterministic. Each
        # free list is a queue kept as a list and a head index, so taking n keys
        # is one slice; the taken prefix is deleted once it is most of the list.
        self._free: list[list[int]] = [list(table.pool_keys(p)) if managed else [] for p in range(npools)]
        self._head: list[int] = [0] * npools
        # (fence, seq, keys): one entry per batch of keys freed together.
        self._heap: list[tuple[int, int, list[int]]] = []
        self._seq = 0
        # The entry pushed last, (fence, keys): blocks parked next under the same
        # fence join it (see park_idle).
        self._tail: tuple[int, list[int]] | None = None
        self._quarantine: set[int] = set()
        # Every freed key not yet reusable, to reject double frees cheaply.
        self._parked: set[int] = set()
        self._reusable: list[int] = []
        # Heap occurrences of keys taken back out of the pool by a new holder (rule 7,
        # :meth:`unpark`): key -> how many of its next occurrences to skip. A key's
        # fence never decreases and a later entry has a higher sequence number, so its
        # stale occurrences pop before a live one.
        self._stale: dict[int, int] = {}

    # -- queries ------------------------------------------------------------
    def free_count(self, pool: int) -> int:
        return len(self._free[pool]) - self._head[pool]

    def parked_count(self) -> int:
        return len(self._parked)

    def is_parked(self, key: int) -> bool:
        return key in self._parked

    def is_free(self, key: int) -> bool:
        pool = self._table.pool_of_key(key)
        return key in self._free[pool][self._head[pool] :]

    # -- allocation -----------------------------------------------------------
    def take(self, pool: int, n: int) -> list[int] | None:
        """Pop ``n`` reusable keys of ``pool``, or None (nothing taken) if fewer exist."""
        free = self._free[pool]
        head = self._head[pool]
        end = head + n
        if end > len(free):
            return None
        keys = free[head:end]
        if end >= 1024 and 2 * end >= len(free):
            del free[:end]
            end = 0
        self._head[pool] = end
        return keys

    def adopt(self, key: int) -> None:
        """An external engine hands out ``key``; it must not be parked."""
        if key in self._parked:
            raise ValueError(
                f"block {self._table.block_of(key)} of pool {self._table.pool_of_key(key)} "
                "is still fenced (freed, not yet reusable); expected a reusable block"
            )

    def unpark(self, key: int) -> None:
        """A parked block gets a holder again (rule 7: a prefix-cache hit on a block
        whose last holder released it): it leaves the pool's waiting lists. Its fence
        stays, and applies again when its new holders release it."""
        if key not in self._parked:
            raise ValueError(f"block key {key} is not parked; expected a freed, not yet reusable block")
        self._parked.discard(key)
        if key in self._quarantine:
            self._quarantine.discard(key)  # no heap occurrence while quarantined
        else:
            self._stale[key] = self._stale.get(key, 0) + 1

    # -- release --------------------------------------------------------------
    def park(self, key: int) -> None:
        """A block was freed; make it reusable as soon as the rules allow."""
        self.park_many([key])

    def park_many(self, keys: list[int]) -> None:
        """Blocks were freed together (one request's); one heap entry per fence value."""
        if not self._fenced:
            self._release_many(keys)
            return
        t = self._table
        readers, writers, fence, w = t.readers, t.writers, t.fence, t.watermark
        later: dict[int, list[int]] = {}
        for key in keys:
            if readers[key] or writers[key]:
                self._parked.add(key)
                self._quarantine.add(key)
                continue
            f = fence[key]
            if f <= w:
                self._release(key)
            else:
                self._parked.add(key)
                later.setdefault(f, []).append(key)
        for f, batch in later.items():
            self._push(f, batch)

    def park_idle(self, keys: list[int], fence: int) -> None:
        """:meth:`park_many` of blocks the caller knows are idle (no transfer reads or
        writes them) and all fenced at ``fence``: one heap entry, no per-block checks."""
        if not keys:
            return
        if not self._fenced or fence <= self._table.watermark:
            self._release_many(keys)
            return
        self._parked.update(keys)
        tail = self._tail
        if tail is not None and tail[0] == fence:
            # The last entry has this fence, so it is still in the heap (fence is
            # above the watermark) and nothing was pushed after it: joining it
            # releases the same blocks in the same order as an entry of their own.
            # Requests retired by one step share its fence: one entry per step.
            tail[1].extend(keys)
        else:
            self._push(fence, list(keys))

    def on_watermark(self) -> None:
        heap = self._heap
        if not heap:
            return
        t = self._table
        w = t.watermark
        readers, writers = t.readers, t.writers
        parked = self._parked
        while heap and heap[0][0] <= w:
            _, _, batch = heapq.heappop(heap)
            if self._stale:
                batch = self._live(batch)
            for key in batch:
                if readers[key] or writers[key]:
                    break
            else:  # the usual case: the whole batch is idle
                parked.difference_update(batch)
                self._release_many(batch)
                continue
            for key in batch:
                if readers[key] or writers[key]:
                    self._quarantine.add(key)
                else:
                    parked.discard(key)
                    self._release(key)

    def on_transfer_terminal(self, keys: list[int]) -> None:
        q = self._quarantine
        if not q or q.isdisjoint(keys):
            return
        t = self._table
        readers, writers, fence, w = t.readers, t.writers, t.fence, t.watermark
        settled = []
        for key in keys:
            if key in q and not readers[key] and not writers[key]:
                q.discard(key)
                f = fence[key]
                if f <= w:
                    settled.append(key)
                else:
                    tail = self._tail
                    if tail is not None and tail[0] == f:
                        tail[1].append(key)  # as in park_idle: the same order as an entry of its own
                    else:
                        self._push(f, [key])
        if settled:
            self._parked.difference_update(settled)
            self._release_many(settled)

    def _live(self, batch: list[int]) -> list[int]:
        """``batch`` less its stale occurrences (keys re-held since they were parked)."""
        stale = self._stale
        out = []
        for key in batch:
            n = stale.get(key)
            if n is None:
                out.append(key)
            elif n == 1:
                del stale[key]
            else:
                stale[key] = n - 1
        return out

    def _push(self, fence: int, keys: list[int]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (fence, self._seq, keys))
        self._tail = (fence, keys)

    def _release(self, key: int) -> None:
        if self.managed:
            self._free[self._table.pool_of_key(key)].append(key)
        else:
            self._reusable.append(key)

    def _release_many(self, keys: list[int]) -> None:
        """:meth:`_release` of each key, in order."""
        if not self.managed:
            self._reusable.extend(keys)
        elif len(self._free) == 1:
            self._free[0].extend(keys)
        else:
            free, pool_of = self._free, self._table.pool_of_key
            for key in keys:
                free[pool_of(key)].append(key)

    def take_reusable(self) -> list[int]:
        """External mode: keys that became reusable since the last call."""
        out, self._reusable = self._reusable, []
        return out
