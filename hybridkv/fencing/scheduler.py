"""Async-safe transfer scheduling for both sides of a disaggregated pair.

:class:`TransferScheduler` is the one object an engine connector talks to
about *when* blocks may be read, written, reused or computed on. It enforces
the six fencing rules of DESIGN.md over a :class:`~hybridkv.fencing.fence.FenceTable`:

1. *export*: an outbound transfer reads a block only once the step that wrote
   it completed (``watermark >= fence``);
2. *reuse*: a freed block returns to the pool only when settled and no
   transfer touches it (vLLM Race A, #45357);
3. *import*: an inbound transfer writes a block only when no pending step
   touches it; a zeroing scheduled for it before the post is fenced (the post
   waits for it), one scheduled after the post (write in flight or landed) is
   skipped (vLLM Race B, #48481);
4. *visibility*: a request may join a step only once every component of every
   group arrived (SGLang #39846);
5. *abort/failure*: blocks with a transfer in flight are quarantined until the
   transfer is terminal (SGLang #24527);
6. *lease*: exported blocks live under a renewable lease; expiry releases
   them; a read that cannot finish inside its lease is never started, and one
   that lands after it is not trusted.

Engine-shaped, non-blocking API (every call returns at once; a call that
cannot proceed returns a falsy :class:`~hybridkv.fencing.fence.NotYet` and the engine
asks again on a later step). Block ids are ints per KV-cache group; groups map
onto physical pools through :class:`~hybridkv.fencing.fence.PoolLayout`.

Both sides::

    add_request(rid, expect=components)   # expect=() for a locally computed request
    allocate(rid, group, n) -> blocks | NotYet     # managed pool
    assign(rid, group, blocks)                     # engine-owned pool
    step_scheduled(step, joined=..., touched=..., zeroing=...) -> StepTicket
    step_completed(step)                           # the worker's watermark
    free_blocks(rid, group, blocks)                # e.g. sliding-window tail clipping
    request_finished(rid, export=False) -> LeaseGrant | None
    abort(rid)
    transfer_landed(tid) / transfer_failed(tid) -> TransferOutcome
    poll()                                         # lease expiry; call once per step

Consumer (decode) side::

    post_import(rid, components=..., lease_deadline=..., expected_s=...) -> tid | NotYet
    lease_renewed(rid, deadline);  is_ready(rid);  recompute(rid)

Producer (prefill) side::

    export_ready(rid) -> True | NotYet;  post_export(rid, expected_s=...) -> tid | NotYet
    heartbeat(rid) -> LeaseGrant | None;  export_done(rid)

A request joins the running batch through ``step_scheduled(joined=...)`` and
stays *resident* (touched by every later step) until it finishes or aborts;
see :mod:`hybridkv.fencing.fence` for why. The per-step cost is therefore
proportional to what changed in the step, not to the batch size.

``FencePolicy.NONE`` answers yes to every check: frees are immediate, imports
post at once, a request is ready after its first component, leases are not
checked. It exists to show what breaks.

Nothing here imports torch or an engine.
"""

from __future__ import annotations

from hybridkv.fencing.fence import GroupId
from hybridkv.fencing.scheduler_steps import BlockRef, StepTicket, _RequestSteps  # noqa: F401 - BlockRef: re-exported
from hybridkv.fencing.scheduler_transfers import _TransferRules

# The class is assembled from its parts, one module each: records and queries
# (scheduler_state), requests and steps (scheduler_steps), transfers and leases
# (scheduler_transfers). They share one set of records, so they are one object.


class TransferScheduler(_TransferRules, _RequestSteps):
    """Fencing rules for one worker (one rank) of either side. Not thread-safe."""


__all__ = ["GroupId", "StepTicket", "TransferScheduler"]
