"""How an import ends: its producers told, and the request's outcome under the failure policy.

:class:`Endings` is held by :class:`~hybridkv.transport.fetch.Importer`. A producer that exported to an
import given up hears a Failure (its blocks are free); every part of a posted import hears Done, sent in
the background for one whose READ landed (:meth:`Endings.flush` waits for those when the consumer
closes). A failed import ends per the failure policy (RECOMPUTE or FAILED), counted by why it failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hybridkv import wire
from hybridkv.fencing import TransferOutcome
from hybridkv.transport.config import FailurePolicy, Outcome, Result
from hybridkv.transport.metrics import FailureKind
from hybridkv.transport.parts import Part
from hybridkv.transport.side import Side, send_quietly

if TYPE_CHECKING:
    from hybridkv.transport.import_staging import Work

log = logging.getLogger(__name__)


class Endings:
    """The ends of the consumer's imports. Given the side (its config, scheduler and counters)."""

    def __init__(self, side: Side) -> None:
        self._config = side.config
        self._scheduler = side.scheduler
        self._metrics = side.metrics
        #: Done messages of landed imports, still being sent (end_parts_soon)
        self._sending: set[asyncio.Task] = set()

    async def tell_parts(self, parts: Sequence[Part], detail: str) -> None:
        """Producers that exported to us while the import gave up: their blocks are free."""
        for part in parts:
            if part.export.done() and not part.export.cancelled() and part.export.exception() is None:
                await send_quietly(part.peer.channel, wire.Failure(
                    request_id=part.rid, code=wire.FailureCode.ABORTED, detail=detail[: wire.MAX_TEXT],
                    token=part.token))

    async def end_parts(self, work: Sequence[Work], ok: bool) -> None:
        for w in work:
            await send_quietly(w.part.peer.channel, wire.Done(request_id=w.part.rid, ok=ok, token=w.part.token))

    def end_parts_soon(self, work: Sequence[Work], ok: bool) -> None:
        """:meth:`end_parts` in the background (:meth:`flush` waits for it): for a part whose READ ended."""
        task = asyncio.get_running_loop().create_task(self.end_parts(work, ok))
        self._sending.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task) -> None:
        self._sending.discard(task)
        if not task.cancelled() and task.exception() is not None:  # send_quietly lets only a bug through
            log.warning("sending Done failed: %r", task.exception())

    async def flush(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the Done messages still being sent (the consumer closes: they go
        before its Bye); one still stuck then is cancelled (its producer's lease frees the blocks)."""
        if not self._sending:
            return
        _, stuck = await asyncio.wait(set(self._sending), timeout=timeout_s)
        for task in stuck:
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)

    def policy(self, rid: str, error: str, *, kind: FailureKind | None = FailureKind.TRANSFER) -> Result:
        """The import failed after a transfer was posted: apply the failure policy (``kind``: why,
        for the metrics; None where it was counted already)."""
        if kind is not None:
            self._metrics.failure(kind)
        if self._config.failure_policy is FailurePolicy.RECOMPUTE and self._scheduler.has_request(rid):
            self._scheduler.recompute(rid)
            return Result(request_id=rid, outcome=Outcome.RECOMPUTE, error=error)
        self._scheduler.abort(rid)
        return Result(request_id=rid, outcome=Outcome.FAILED, error=error)

    def give_up(self, rid: str, comps, error: str, *, kind: FailureKind = FailureKind.TRANSFER) -> Result:
        """Failed before any transfer was posted: nothing is in flight. Under RECOMPUTE the request
        computes locally even while steps touching its blocks are pending (a stalled decode): a load
        that can no longer complete degrades, it does not fail."""
        self._metrics.failure(kind)
        sched = self._scheduler
        if self._config.failure_policy is FailurePolicy.RECOMPUTE and sched.has_request(rid):
            sched.recompute(rid)
            return Result(request_id=rid, outcome=Outcome.RECOMPUTE, error=error)
        sched.abort(rid)
        return Result(request_id=rid, outcome=Outcome.FAILED, error=error)


def kind_of_outcome(outcome: TransferOutcome) -> FailureKind:
    # LATE: landed past the lease, bytes not trusted; anything else is a transfer the scheduler refused.
    return FailureKind.LEASE if outcome is TransferOutcome.LATE else FailureKind.TRANSFER


__all__ = ["Endings", "kind_of_outcome"]
