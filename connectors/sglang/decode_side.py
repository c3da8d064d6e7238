"""Decode side of the hybridkv SGLang backend: published destinations are fenced imports.

`begin_import` assigns a request's pages, slots and aux row in the fencing scheduler and posts one
import per component before SGLang publishes them; what the prefill ranks say about the room goes
to hybridkv's `ImportLedger` (hybridkv/fencing/imports.py), which decides when they end: a component
lands once every writer's LANDED named it; the imports end, and the room's blocks may go back, only
when every writer said DRAINED (or reported Success, sent only after its last WRITE ended) or the
drain deadline passed. A writer's Failed status, a STUCK, SGLang declaring the prefill dead (its
bootstrap server runs in another process than the writers) or the engine's abort fail the room and
start the deadline, nothing more. Blocks the engine hands back (abort, clear) stay out of reuse while
an import into them is open: `fenced` lists them.

Each import has a generation, sent in the METADATA and echoed by the prefill's LANDED, STUCK and
DRAINED: a message of an earlier request that used the same room never touches a later one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional

import numpy as np

from hybridkv.connectors.sglang import messages as msgs
from hybridkv.connectors.sglang.adopt import AdoptedLayout, request_id
from hybridkv.connectors.sglang.fenced_blocks import FencedBlocks
from hybridkv.connectors.sglang.staged_kv import DecodeSlots
from hybridkv.fencing.fence import NotYet
from hybridkv.fencing.imports import ImportLedger
from hybridkv.fencing.request_state import Component
from hybridkv.ids import TransferId
from hybridkv.transport.metrics import TransferMetrics
from hybridkv.transport.staging import Slot

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Room:
    """What the SGLang side keeps of an import beside the ledger's entry."""

    bootstrap_addr: str
    generation: int
    abort_sent: bool = False  # SGLang sent the prefill ranks an ABORT for this import
    quarantined: int = 0  # blocks held out of reuse since a writer said STUCK (for the metrics)
    #: staging (staged_kv.py): a slot per prefill rank, taken with the METADATA, back only once the import is over
    slots: dict[int, Slot] = dataclasses.field(default_factory=dict)
    prefill_tp: int = 0
    kv_pages: Optional[np.ndarray] = None
    staged: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # per writer, its LANDED's pages


class DecodeImports:
    """The decode manager's imports. Given the shared scheduler (`blocks`), the layout (which components a
    group holds), the metrics and the drain timeout; the manager's listener and SGLang's hooks call it."""

    def __init__(self, *, blocks: FencedBlocks, adopted: AdoptedLayout, metrics: TransferMetrics,
                 drain_timeout_s: float, slots: Optional[DecodeSlots] = None) -> None:
        self.blocks = blocks
        self.slots = slots  # the staging pool (None: staging off)
        self.adopted = adopted
        self.metrics = metrics
        self.ledger = ImportLedger(blocks.sched, drain_timeout_s=drain_timeout_s)
        self._rooms: dict[int, _Room] = {}

    @property
    def drain_timeout_s(self) -> float:
        return self.ledger.drain_timeout_s

    @drain_timeout_s.setter
    def drain_timeout_s(self, seconds: float) -> None:  # tests shorten it
        self.ledger.drain_timeout_s = float(seconds)

    def begin_import(self, room: int, bootstrap_addr: str, writers: int, blocks: dict[int, np.ndarray]) -> int:
        """Assign the request's blocks and post one import per component, before anything is published;
        returns the import's generation (the METADATA carries it).

        ValueError (nothing applied) if a block is held or still fenced: SGLang
        handed out a page that a write of an earlier request may still reach.
        """
        rid = request_id(room)
        with self.blocks.lock:
            sched = self.blocks.sched
            if room in self.ledger or sched.has_request(rid):
                raise ValueError(f"room {room} already has destinations published; expected a new room")
            comps = [c for g in sorted(blocks) for c in self.adopted.components_of(g) if len(blocks[g])]
            sched.add_request(rid, expect=comps)
            tids: dict[Component, TransferId] = {}
            try:
                for g in sorted(blocks):
                    sched.assign(rid, g, [int(b) for b in blocks[g]])
                for c in comps:
                    tid = sched.post_import(rid, components=[c])
                    if isinstance(tid, NotYet):
                        raise ValueError(f"room {room}: the scheduler refused the import of {c}: {tid.reason.value}")
                    tids[c] = tid
            except ValueError:
                for tid in tids.values():
                    sched.transfer_failed(tid)  # nothing was published: no write can come
                sched.abort(rid)
                self.blocks.collect_reusable()
                raise
            generation = self.ledger.open(room, request=rid, tids=tids, writers=max(1, writers))
            self._rooms[room] = _Room(bootstrap_addr=bootstrap_addr, generation=generation)
            return generation

    # ------------------------------------------------------------ staging slots (staged_kv.py)
    def offer_slots(self, room: int, prefill_tp: int, kv_pages: np.ndarray) -> None:
        """At different attention TP with staging on: a slot per prefill rank for the room's KV, named in its
        METADATA (none where the pool is full: the prefill ranks write sliced)."""
        if self.slots is None:
            return
        with self.blocks.lock:
            r = self._rooms.get(room)
            if r is None or r.slots:
                return
            r.slots = self.slots.offer(prefill_tp, len(kv_pages))
            if r.slots:
                r.prefill_tp, r.kv_pages = prefill_tp, np.asarray(kv_pages, dtype=np.int64).copy()

    def offers(self, room: int) -> tuple[msgs.StagedSlot, ...]:
        with self.blocks.lock:
            r = self._rooms.get(room)
            return () if r is None else tuple(msgs.StagedSlot(prefill_rank=k, offset=s.offset, nbytes=s.nbytes)
                                               for k, s in sorted(r.slots.items()))

    def unpack(self, room: int) -> int:
        """Every writer landed: copy what they staged from the room's slots into its pages (before SGLang is told
        the room is ready); the pages unpacked. ValueError (nothing copied) for a staged range that does not fit."""
        with self.blocks.lock:
            r = self._rooms.get(room)
            if r is None or not r.slots or not r.staged:
                return 0
            # Under the lock: a slot goes back only with the room's record (_forget), never during the copy.
            return self.slots.unpack(r.prefill_tp, r.slots, r.staged, r.kv_pages)

    def _give_back_slots(self, r: _Room) -> None:
        if r.slots and self.slots is not None:
            self.slots.give_back(r.slots)
        r.slots = {}

    def _slots_early(self, room: int) -> None:
        """The fence switched off (HYBRIDKV_STAGING_RULE_OFF, tests only): the slots go back as the room fails."""
        r = self._rooms.get(room)
        if r is not None and self.slots is not None and not self.slots.fence:
            self._give_back_slots(r)

    def generation(self, room: int) -> int:
        """The room's import generation (0: none, e.g. a dummy rank's METADATA)."""
        with self.blocks.lock:
            r = self._rooms.get(room)
            return r.generation if r is not None else 0

    def end_import(self, room: int, *, landed: bool) -> bool:
        """Receiver side: the engine is done with the room. True if nothing is in flight any more."""
        rid = request_id(room)
        with self.blocks.lock:
            if landed:
                if self.blocks.sched.has_request(rid):
                    self.blocks.sched.request_finished(rid)  # the pages belong to the running request now
                    self.blocks.collect_reusable()
            else:
                self.blocks.drop(rid)
                self._slots_early(room)
            gone = self.ledger.release(room)
            if gone:
                self._forget(room)
            return gone

    def rooms(self) -> list[int]:
        """Rooms with an import entry (open, or ended and not yet released by the engine)."""
        with self.blocks.lock:
            return sorted(set(self.ledger.keys()) | set(self._rooms))

    def imports_in_flight(self, room: int) -> int:
        with self.blocks.lock:
            return self.ledger.in_flight(room)

    def import_ready(self, room: int) -> bool:
        with self.blocks.lock:
            rid = request_id(room)
            return self.blocks.sched.has_request(rid) and self.blocks.sched.is_ready(rid)

    def missing_components(self, room: int) -> list[Component]:
        """Components of the room not landed: still in flight, or ended without landing."""
        with self.blocks.lock:
            return self.ledger.missing(room)

    def settle_imports(self, room: int, reason: str) -> None:
        """No writer can write into the room (nothing was published to any, or every one reported its whole
        transfer complete): imports still open end unlanded now."""
        with self.blocks.lock:
            n = self.ledger.in_flight(room)
            if self.ledger.settle(room, reason):
                logger.info("hybridkv: room %s: %d import(s) end unlanded (%s)", room, n, reason)
                self._ended(room)

    def fail(self, room: int, reason: str) -> None:
        """The room failed here (a writer's Failed, SGLang's abort or hold): its drain deadline starts.
        Nothing is released: a writer may still be writing."""
        with self.blocks.lock:
            self.ledger.fail(room, reason)
            self._slots_early(room)

    def abort_sent(self, room: int) -> None:
        """SGLang sent the room's ABORT: the prefill ranks answer DRAINED once nothing of it is in flight."""
        with self.blocks.lock:
            r = self._rooms.get(room)
            if r is not None:
                r.abort_sent = True

    def check_deadline(self, room: int) -> bool:
        """End the room's imports if its drain deadline passed. True if nothing of it is in flight."""
        with self.blocks.lock:
            if self.ledger.check_deadline(room):
                logger.error("hybridkv: room %s: imports ended by the drain deadline (%.0f s) without every "
                             "writer's DRAINED", room, self.drain_timeout_s)
                self._ended(room)
            return self.ledger.in_flight(room) == 0

    def tick(self) -> None:
        """The listener thread, every loop: end the imports whose drain deadline passed (a room SGLang
        released, or whose receiver nobody polls any more, is ended here)."""
        with self.blocks.lock:
            for room in self.ledger.expire():
                logger.error("hybridkv: room %s: imports ended by the drain deadline (%.0f s) without every "
                             "writer's DRAINED", room, self.drain_timeout_s)
                self._ended(room)

    def _ended(self, room: int) -> None:
        """The room's imports ended (under the lock): metrics, reusable blocks, the room's record."""
        r = self._rooms.get(room)
        if r is not None and r.quarantined:
            self.metrics.quarantine_released(r.quarantined)
            r.quarantined = 0
        if room not in self.ledger:
            self._forget(room)
        self.blocks.collect_reusable()

    def _forget(self, room: int) -> None:
        """The room's import is over and released: no write of it can land any more, its slots go back."""
        r = self._rooms.pop(room, None)
        if r is not None:
            self._give_back_slots(r)

    # ------------------------------------------------------------ SGLang's deferred decode KV release
    # decode.py: when the MIN-reduced poll of a request is Failed, every decode rank
    # arms the ABORT (ensure_abort_notified) and holds the request (its pages, Mamba
    # slot and metadata row) instead of freeing them; every scheduler iteration,
    # resolve_deferred_releases asks kv_mgr.is_abort_release_safe on each rank and
    # MIN-reduces the answers, so the ranks release together, then calls
    # kv_mgr.clear_deferred_abort_state and receiver.clear(). SGLang releases anyway
    # once SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT passed since it
    # began holding; the drain timeout is never longer (startup.py), and the ledger's
    # deadline starts at the room's first failure (at the latest when the ABORT is
    # armed, register_deferred_abort_room), before SGLang's own, so it comes first.
    # The manager's hooks of those names call these.

    def hold(self, room: int) -> None:
        """SGLang holds the room for a deferred release (register_deferred_abort_room)."""
        self.fail(room, "held by SGLang for a deferred release")

    def release_safe(self, room: int) -> bool:
        """True once no import into the room's blocks is in flight: every writer drained (DRAINED, or
        Success after its last WRITE), or the drain deadline passed. SGLang's count of ABORT_ACKs
        (is_abort_release_safe's `required_acks`) is the same question, answered per writer here."""
        return self.check_deadline(room)

    def released(self, room: int) -> None:
        """SGLang released the room it held (clear_deferred_abort_state)."""
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
            with self.blocks.lock:
                if self._current(m.room, m.generation):
                    if m.staged:
                        self._rooms[m.room].staged[m.prefill_rank] = tuple(m.staged)
                    self.ledger.landed(m.room, m.prefill_rank, m.components)
                    if m.room not in self.ledger:
                        self._forget(m.room)
        elif isinstance(m, msgs.Drained):
            self._on_drained(m)
        elif isinstance(m, msgs.Stuck):
            self._on_stuck(m)
        else:
            raise ValueError(f"decode got a {type(m).__name__} message")

    def _current(self, room: int, generation: int, *, after_abort: bool = False) -> bool:
        """A prefill's message names the room's current import: its generation, or 0 (the prefill did not
        know it: the room's METADATA never reached it, or it was cleared there) for an import that sent
        its ABORT, which that answers."""
        r = self._rooms.get(room)
        if r is None:
            return False
        return generation == r.generation or (after_abort and generation == 0 and r.abort_sent)

    def _on_drained(self, m: msgs.Drained) -> None:
        with self.blocks.lock:
            if not self._current(m.room, m.generation, after_abort=True):
                return
            if self.ledger.drained(m.room, m.prefill_rank):
                self._ended(m.room)

    def note_status(self, room: int, rank: int, *, success: bool, reason: Optional[str] = None) -> None:
        """A prefill rank's terminal KV_STATUS. Success comes only after its last WRITE of the room ended: it is
        drained. Failed is not: it may still be writing (a refused last chunk, an expired lease, a WRITE
        NIXL would not abort); the room fails and its deadline starts."""
        with self.blocks.lock:
            if room not in self._rooms:
                return
            if success:
                if self.ledger.drained(room, rank):
                    self._ended(room)
            else:
                self.ledger.writer_failed(room, rank, reason or "prefill reported Failed")

    def _on_stuck(self, m: msgs.Stuck) -> None:
        with self.blocks.lock:
            r = self._rooms.get(m.room)
            if r is None or not self._current(m.room, m.generation):
                return
            self.ledger.writer_failed(m.room, m.prefill_rank, "a WRITE NIXL would not abort may still land")
            rid = request_id(m.room)
            if not r.quarantined and self.ledger.in_flight(m.room) and self.blocks.sched.has_request(rid):
                # For the metrics: the room's blocks stay out of reuse until that writer drains.
                r.quarantined = self.blocks.count(rid)
                self.metrics.quarantined(r.quarantined)

    def writer_dead(self, bootstrap_addr: str) -> None:
        """SGLang's heartbeat lost that prefill's bootstrap server: its rooms fail. Not drained: the
        server runs in the tokenizer-manager process, the writers in the scheduler ranks, which may live
        on; the imports end on every writer's DRAINED (the ABORT asks for it) or at the deadline."""
        with self.blocks.lock:
            for room, r in self._rooms.items():
                if r.bootstrap_addr == bootstrap_addr:
                    self.ledger.fail(room, f"lost the prefill's bootstrap server {bootstrap_addr}")
