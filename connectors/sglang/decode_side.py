"""Decode side of the hybridkv SGLang backend: published destinations are fenced imports.

`begin_import` assigns a request's pages, slots and aux row in the fencing
scheduler and posts one import per component before SGLang publishes them; a
component lands on the writer's LANDED message; imports still open when every
writer is quiet (KV_STATUS, DRAINED), dead, or past the drain deadline end as
failed. Blocks the engine hands back (abort, clear) stay out of reuse while an
import into them is open: `fenced` lists them. A writer that said STUCK (NIXL
would not abort its WRITE) is quiet only on its DRAINED, not on its Failed
status.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict

import numpy as np

from hybridkv.connectors.sglang import messages as msgs
from hybridkv.connectors.sglang.adopt import AdoptedLayout, request_id
from hybridkv.connectors.sglang.fenced_blocks import FencedBlocks
from hybridkv.fencing.fence import NotYet
from hybridkv.fencing.request_state import Component
from hybridkv.ids import TransferId
from hybridkv.transport.metrics import TransferMetrics

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Import:
    """Decode side: a room whose destinations were (or are about to be) published."""

    bootstrap_addr: str
    writers: int  # prefill ranks expected to write
    tids: dict[Component, TransferId]  # imports still in flight
    landed_from: dict[Component, set[int]] = dataclasses.field(default_factory=lambda: defaultdict(set))
    quiet: set[int] = dataclasses.field(default_factory=set)
    stuck: set[int] = dataclasses.field(default_factory=set)  # ranks whose Failed status is not quiet
    unlanded: list[Component] = dataclasses.field(default_factory=list)  # ended without landing
    cleared: bool = False
    quarantined: int = 0  # blocks held out of reuse since a writer said STUCK (for the metrics)


class DecodeImports:
    """The decode manager's imports. Given the shared scheduler (`blocks`), the layout (which components a
    group holds), the metrics and the drain timeout; the manager's listener and SGLang's hooks call it."""

    def __init__(self, *, blocks: FencedBlocks, adopted: AdoptedLayout, metrics: TransferMetrics,
                 drain_timeout_s: float) -> None:
        self.blocks = blocks
        self.adopted = adopted
        self.metrics = metrics
        self.drain_timeout_s = drain_timeout_s
        self._imports: dict[int, _Import] = {}
        self._held_since: dict[int, float] = {}  # rooms SGLang holds for a deferred release

    def begin_import(self, room: int, bootstrap_addr: str, writers: int, blocks: dict[int, np.ndarray]) -> None:
        """Assign the request's blocks and post one import per component, before anything is published.

        ValueError (nothing applied) if a block is held or still fenced: SGLang
        handed out a page that a write of an earlier request may still reach.
        """
        rid = request_id(room)
        with self.blocks.lock:
            if room in self._imports or self.blocks.sched.has_request(rid):
                raise ValueError(f"room {room} already has destinations published; expected a new room")
            comps = [c for g in sorted(blocks) for c in self.adopted.components_of(g) if len(blocks[g])]
            self.blocks.sched.add_request(rid, expect=comps)
            tids: dict[Component, TransferId] = {}
            try:
                for g in sorted(blocks):
                    self.blocks.sched.assign(rid, g, [int(b) for b in blocks[g]])
                for c in comps:
                    tid = self.blocks.sched.post_import(rid, components=[c])
                    if isinstance(tid, NotYet):
                        raise ValueError(f"room {room}: the scheduler refused the import of {c}: {tid.reason.value}")
                    tids[c] = tid
            except ValueError:
                for tid in tids.values():
                    self.blocks.sched.transfer_failed(tid)  # nothing was published: no write can come
                self.blocks.sched.abort(rid)
                self.blocks.collect_reusable()
                raise
            self._imports[room] = _Import(bootstrap_addr=bootstrap_addr, writers=max(1, writers), tids=tids)

    def end_import(self, room: int, *, landed: bool) -> bool:
        """Receiver side: the engine is done with the room. True if nothing is in flight any more."""
        rid = request_id(room)
        with self.blocks.lock:
            imp = self._imports.get(room)
            if landed:
                if self.blocks.sched.has_request(rid):
                    self.blocks.sched.request_finished(rid)  # the pages belong to the running request now
                    self.blocks.collect_reusable()
            else:
                self.blocks.drop(rid)
            if imp is None or not imp.tids:
                self._imports.pop(room, None)
                return True
            imp.cleared = True
            return False

    def imports_in_flight(self, room: int) -> int:
        with self.blocks.lock:
            imp = self._imports.get(room)
            return len(imp.tids) if imp else 0

    def import_ready(self, room: int) -> bool:
        with self.blocks.lock:
            rid = request_id(room)
            return self.blocks.sched.has_request(rid) and self.blocks.sched.is_ready(rid)

    def missing_components(self, room: int) -> list[Component]:
        """Components of the room not landed: still in flight, or ended without landing."""
        with self.blocks.lock:
            imp = self._imports.get(room)
            return imp.unlanded + list(imp.tids) if imp else []

    def settle_imports(self, room: int, reason: str) -> None:
        """Every writer of the room is quiet (or gone): imports still open will never land."""
        with self.blocks.lock:
            imp = self._imports.get(room)
            if imp is None:
                return
            if imp.tids:
                logger.info("hybridkv: room %s: %d import(s) end unlanded (%s)", room, len(imp.tids), reason)
            for comp, tid in imp.tids.items():
                self.blocks.sched.transfer_failed(tid)
                imp.unlanded.append(comp)
            imp.tids.clear()
            if imp.quarantined:
                self.metrics.quarantine_released(imp.quarantined)
                imp.quarantined = 0
            if imp.cleared:
                self._imports.pop(room, None)
            self.blocks.collect_reusable()

    # ------------------------------------------------------------ SGLang's deferred decode KV release
    # decode.py: when the MIN-reduced poll of a request is Failed, every decode rank
    # arms the ABORT (ensure_abort_notified) and holds the request (its pages, Mamba
    # slot and metadata row) instead of freeing them; every scheduler iteration,
    # resolve_deferred_releases asks kv_mgr.is_abort_release_safe on each rank and
    # MIN-reduces the answers, so the ranks release together, then calls
    # kv_mgr.clear_deferred_abort_state and receiver.clear(). SGLang releases anyway
    # once SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT passed since it
    # began holding; the drain timeout is never longer (startup.py), and hybridkv's
    # hold clock starts when the ABORT is armed (register_deferred_abort_room), which
    # SGLang does before it starts its own, so hybridkv's deadline comes first.
    # The manager's hooks of those names call these.

    def hold(self, room: int) -> None:
        """SGLang holds the room for a deferred release (register_deferred_abort_room)."""
        with self.blocks.lock:
            self._held_since.setdefault(room, time.monotonic())

    def release_safe(self, room: int) -> bool:
        """True once no import into the room's blocks is in flight in hybridkv's scheduler:
        every writer is quiet (KV_STATUS, DRAINED, a STUCK write ended), dead, or the
        drain deadline passed. SGLang's count of ABORT_ACKs (is_abort_release_safe's
        `required_acks`) is not needed: DRAINED says the same, and a STUCK writer's Failed
        status does not."""
        with self.blocks.lock:
            imp = self._imports.get(room)
            if imp is None or not imp.tids:
                return True
            since = self._held_since.setdefault(room, time.monotonic())
        if time.monotonic() - since < self.drain_timeout_s:
            return False
        logger.error("hybridkv: room %s released after %.0fs without a drain answer", room, time.monotonic() - since)
        self.settle_imports(room, "drain deadline passed")
        return True

    def released(self, room: int) -> None:
        """SGLang released the room it held (clear_deferred_abort_state)."""
        with self.blocks.lock:
            self._held_since.pop(room, None)
        if self.imports_in_flight(room):
            # Not expected (the drain timeout is never longer than SGLang's): the pages go
            # back to its allocator. The scheduler keeps them fenced (a new transfer into
            # them is refused), but the engine may hand them to a running request.
            logger.error(
                "hybridkv: SGLang released room %s with %d import(s) in flight before the drain timeout (%.0f s) "
                "ended them", room, self.imports_in_flight(room), self.drain_timeout_s)

    # ------------------------------------------------------------ what the prefill ranks say (the manager's listener)
    def on_message(self, m: msgs.Message) -> None:
        """A LANDED, DRAINED or STUCK of a prefill rank."""
        if isinstance(m, msgs.Landed):
            self._on_landed(m)
        elif isinstance(m, msgs.Drained):
            self.note_quiet(m.room, m.prefill_rank, drained=True)
        elif isinstance(m, msgs.Stuck):
            self._on_stuck(m)
        else:
            raise ValueError(f"decode got a {type(m).__name__} message")

    def _on_landed(self, landed: msgs.Landed) -> None:
        with self.blocks.lock:
            imp = self._imports.get(landed.room)
            if imp is None:
                return
            for comp in landed.components:
                if comp not in imp.tids:
                    continue
                imp.landed_from[comp].add(landed.prefill_rank)
                if len(imp.landed_from[comp]) >= imp.writers:
                    self.blocks.sched.transfer_landed(imp.tids.pop(comp))

    def note_quiet(self, room: int, rank: int, *, drained: bool = False) -> None:
        """That prefill rank will write nothing more into the room (a terminal status, or DRAINED)."""
        with self.blocks.lock:
            imp = self._imports.get(room)
            if imp is None:
                return
            if drained:
                imp.stuck.discard(rank)
            elif rank in imp.stuck:
                return  # it said STUCK: a write may still land until its DRAINED
            imp.quiet.add(rank)
            done = len(imp.quiet) >= imp.writers
        if done:
            self.settle_imports(room, "every writer is quiet")

    def _on_stuck(self, m: msgs.Stuck) -> None:
        with self.blocks.lock:
            imp = self._imports.get(m.room)
            if imp is None:
                return
            imp.stuck.add(m.prefill_rank)
            rid = request_id(m.room)
            if not imp.quarantined and imp.tids and self.blocks.sched.has_request(rid):
                # A write NIXL would not abort may still land: the room's blocks
                # stay out of reuse until that writer drains.
                imp.quarantined = self.blocks.count(rid)
                self.metrics.quarantined(imp.quarantined)

    def writer_dead(self, bootstrap_addr: str) -> None:
        """SGLang's heartbeat declared that prefill dead: its rooms' imports end."""
        with self.blocks.lock:
            rooms = [r for r, imp in self._imports.items() if imp.bootstrap_addr == bootstrap_addr]
        for room in rooms:
            self.settle_imports(room, f"prefill {bootstrap_addr} is dead")
