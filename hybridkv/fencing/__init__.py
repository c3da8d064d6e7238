"""Block fencing and async-safe transfer scheduling: the request lifecycle on both sides.

:class:`TransferScheduler` is the one object an engine connector asks *when* a block may be read,
written, reused or computed on (the fencing rules of ``docs/design.md``). Underneath it:

- :mod:`~hybridkv.fencing.fence`: per-block fences, readers and writers, the worker's watermark;
- :mod:`~hybridkv.fencing.block_pool`: free blocks, returned only once settled;
- :mod:`~hybridkv.fencing.lease`: renewable leases on exported blocks;
- :mod:`~hybridkv.fencing.request_state`: request and transfer records, and :class:`Component`,
  one separately-arriving piece of a request's cache.
- :mod:`~hybridkv.fencing.imports`: :class:`ImportLedger`, per writer, when an import into a consumer's
  blocks is over (every writer drained, or the drain deadline passed);
- :mod:`~hybridkv.fencing.pools`: :func:`~hybridkv.fencing.pools.scheduler_inputs`, a layout ->
  the scheduler's pools and components (exported by ``hybridkv``, not here: it imports this package).

The scheduler is composed of its records (:mod:`~hybridkv.fencing.records`) and two sets of
rules over them, each in its own module: requests and steps (:mod:`~hybridkv.fencing.steps`),
transfers and leases (:mod:`~hybridkv.fencing.transfers`). Those three are internal; the names
below are the API.
"""

from hybridkv.fencing.fence import NEVER, FencePolicy, FenceTable, NotYet, NotYetReason, PoolLayout
from hybridkv.fencing.lease import Clock, LeaseGrant, LeaseTable
from hybridkv.fencing.request_state import (
    Component,
    ComponentKind,
    RequestPhase,
    TransferDirection,
    TransferOutcome,
    attention_component,
    gdn_components,
)
from hybridkv.fencing.scheduler import StepTicket, TransferScheduler
from hybridkv.fencing.imports import ImportLedger, ImportState

# Last: pools builds on the names above (it imports them from this package).
from hybridkv.fencing.pools import SchedulerInputs, scheduler_inputs  # noqa: E402

__all__ = [
    "NEVER", "Clock", "Component", "ComponentKind", "FencePolicy", "FenceTable", "ImportLedger", "ImportState",
    "LeaseGrant", "LeaseTable",
    "NotYet", "NotYetReason", "PoolLayout", "SchedulerInputs", "RequestPhase", "StepTicket", "TransferDirection",
    "TransferOutcome", "TransferScheduler", "attention_component", "gdn_components", "scheduler_inputs",
]
