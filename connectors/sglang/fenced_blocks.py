"""The fencing scheduler over SGLang's pools, shared by the manager's parts.

One `hybridkv.fencing.scheduler.TransferScheduler` per manager over the engine-owned pools
(KV pages, one pool per state type, aux rows; one pool per group), the lock around it, and
the blocks the engine handed back that the scheduler does not yet let it reuse.
"""

from __future__ import annotations

import threading

from hybridkv.fencing.scheduler import TransferScheduler
from hybridkv.ids import RequestId


class FencedBlocks:
    """The scheduler is not thread-safe: SGLang's thread, the workers, the listener and the
    heartbeat thread all take `lock` (reentrant) around it."""

    def __init__(self, sched: TransferScheduler) -> None:
        self.sched = sched
        self.lock = threading.RLock()
        #: blocks the engine handed back that the scheduler does not yet let it reuse: (group, block)
        self.fenced: set[tuple[int, int]] = set()

    def blocks(self, rid: RequestId) -> list[tuple[int, int]]:
        """Every block the request holds, (group, block)."""
        with self.lock:
            return [(g, int(b)) for g in range(self.sched.layout.num_groups) for b in self.sched.blocks(rid, g)]

    def count(self, rid: RequestId) -> int:
        """How many blocks the request holds (0 if the scheduler does not know it)."""
        with self.lock:
            return len(self.blocks(rid)) if self.sched.has_request(rid) else 0

    def drop(self, rid: RequestId, *, export: bool = False) -> None:
        """Hand a request's blocks back: still-fenced ones are remembered in `fenced`."""
        with self.lock:
            if not self.sched.has_request(rid):
                return
            self.fenced.update(self.blocks(rid))
            if export:
                self.sched.export_done(rid)
            else:
                self.sched.abort(rid)
            self.collect_reusable()

    def collect_reusable(self) -> None:
        # One pool per group, so the pool index is the group.
        with self.lock:
            for pool, block in self.sched.take_reusable():
                self.fenced.discard((pool, int(block)))
